"""Faults placed in one fused kernel of the fused build only: what measures the harness's power.

A fault is injected after FuseTIR (stage ``after_tir_fusion``), into the PrimFunc one call site of ``main``
runs: the kernel that actually executes, so a fault in the tiled attention kernel (which replaces its
composite: a fault in the composite's body never runs) is a fault in what runs. When FuseTIR shares one
PrimFunc between identical groups, the called function is copied (``<name>_fault``) and only the chosen call
site is pointed at the faulty copy, so exactly one group is wrong; a function called once is changed in place. The pass is marked ``fused_only``: `CompileOptions.unfused()`
drops it, so the unfused build stays the correct reference, as with a real fusion bug.

Two families (issue 50), each applied to the last block that writes the kernel's output:

* structure kept: ``scale`` (value * (1 + size)), ``shift`` (value + size), ``round`` (the stored value
  rounded through float16: accumulation in reduced precision); in a reduction block the update term is
  scaled (``C = C + x`` -> ``C = C + x (1 + size)``, an exact scale of the sum) and the init shifted;
* an operation added or dropped: ``clip`` (negatives clipped: max(value, 0) added), ``drop`` (the block's
  outermost operation dropped: ``a * b`` -> ``a``, ``f(a)`` -> ``a``, a select's mask dropped: its
  true branch everywhere).

The fault's repr holds every parameter, so the build cache's key (which names a pass by its class source
and repr) never serves a faulty build for a clean one or one fault's build for another's.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

STRUCTURE_KEPT = ("scale", "shift", "round")
OP_CHANGED = ("clip", "drop")
KINDS = STRUCTURE_KEPT + OP_CHANGED


class FaultNotApplicable(Exception):
    """The chosen kernel has no block this kind of fault can change (a drop in a plain copy, say)."""


@dataclass
class KernelFault:
    """``fn(mod) -> mod`` for stage ``after_tir_fusion``: fault the `call`-th call site of PrimFunc `kernel`."""

    kernel: str
    kind: str
    size: float = 0.1
    call: int = 0
    fused_only: bool = True
    #: filled by the pass: the var `main` binds the faulty call to, and what was changed
    site: str = field(default="", compare=False)
    changed: str = field(default="", compare=False)
    function: str = field(default="", compare=False)     # the faulty PrimFunc's name in the first build
    _original: Any = field(default=None, compare=False, repr=False)
    calls_seen: int = field(default=0, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; kinds are {', '.join(KINDS)}")
        self.__name__ = f"fault_{self.kind}"

    def __repr__(self) -> str:
        return f"KernelFault(kernel={self.kernel!r}, kind={self.kind!r}, size={self.size!r}, call={self.call})"

    def cache_id(self) -> str:
        """What the build cache's key names this pass by: its class's source and its parameters."""
        import hashlib

        return hashlib.sha256((inspect.getsource(type(self)) + _SOURCE_OF_HELPERS + repr(self)).encode()).hexdigest()[:16]

    def __call__(self, mod: Any) -> Any:
        import tvm
        import tvm_ffi
        from tvm import relax

        gv = next((g for g, f in mod.functions_items() if g.name_hint == self.kernel), None)
        if gv is not None and self._original is None:
            self._original = mod[gv]
        elif self._original is not None and (gv is None or not tvm_ffi.structural_equal(mod[gv], self._original)):
            # another module (bisect's reproducer: the cut-out holding the group): the kernel that is the same
            # PrimFunc, whatever FuseTIR named it there, as a fusion bug would fire on the same group again
            prims = [(g, f) for g, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
            gv = next((g for g, f in prims if tvm_ffi.structural_equal(f, self._original)), None)
            if gv is None:    # the same ops fused (FuseTIR names a group by them), its outputs or shapes differing
                gv = next((g for g, f in prims if _stem(g.name_hint) == _stem(self.kernel)), None)
        if gv is None and self._original is not None:
            return mod            # a module without the faulty group: nothing to break, as with a real fusion bug
        if gv is None:
            raise FaultNotApplicable(f"no function {self.kernel!r} in the module")
        func = mod[gv]
        main = mod["main"]
        sites: list[tuple[relax.Var, relax.Call]] = []
        index = self.call if gv.name_hint == self.kernel else 0
        for block in main.body.blocks:
            for binding in block.bindings:
                value = binding.value
                if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and \
                        value.op.name.startswith("relax.call_tir") and value.args[0].same_as(gv):
                    sites.append((binding.var, value))
        if index >= len(sites) and self._original is not None and sites and len(sites) < self.calls_seen:
            index = 0             # a cut-out holding one of the calls: the group it holds
        if index >= len(sites):
            raise FaultNotApplicable(f"{self.kernel} has {len(sites)} call site(s), not {index + 1}")
        self.calls_seen = max(self.calls_seen, len(sites))
        var, call = sites[index]
        outputs = len(var.ty.fields) if isinstance(var.ty, relax.TupleType) else 1
        faulty, self.changed = _fault_primfunc(func, self.kind, self.size, outputs)
        if len(sites) == 1:       # called once: changed in place, under its own name (what the report knows)
            out = tvm.IRModule(dict(mod.functions.items()), attrs=mod.attrs)
            out[gv] = faulty
            self.site, self.function = var.name, self.function or gv.name_hint
            return out
        builder = relax.BlockBuilder(mod)
        new_gv = builder.add_func(faulty.without_attr("global_symbol"), f"{gv.name_hint}_fault")
        mod = builder.get()
        functions = dict(mod.functions.items())
        new_call = relax.Call(call.op, [new_gv] + list(call.args[1:]), call.attrs, call.ty_args)

        def swap(expr: Any) -> Any:
            return new_call if expr.same_as(call) else expr


        functions[mod.get_global_var("main")] = tvm_ffi.structural_map(main, (relax.Call, swap), order="post")
        out = relax.transform.Normalize()(tvm.IRModule(functions, attrs=mod.attrs))   # the new call's type
        self.site, self.function = var.name, self.function or new_gv.name_hint
        return out


def _stem(name: str) -> str:
    """A fused kernel's name without FuseTIR's de-duplicating digits: the ops it fuses."""
    return re.sub(r"\d+(?=_|$)", "", name)


def _fault_primfunc(func: Any, kind: str, size: float, outputs: int) -> tuple[Any, str]:
    """`func` with the last block writing one of its `outputs` output buffers faulted (module docstring)."""
    import tvm_ffi
    from tvm import s_tir, tirx

    out_buffers = list(func.params)[-outputs:]        # buffers are their own vars: the DPS outputs come last
    writers: list[Any] = []

    def collect(block: Any) -> Any:
        if isinstance(block.body, tirx.BufferStore) and any(block.body.buffer.same_as(b) for b in out_buffers):
            writers.append(block)
        return block

    tvm_ffi.structural_map(func.body, (s_tir.SBlock, collect), order="post")
    if not writers:      # a hand-written kernel (the tiled attention): its last plain store into the output
        stores: list[Any] = []

        def collect_store(st: Any) -> Any:
            if any(st.buffer.same_as(b) for b in out_buffers):
                stores.append(st)
            return st

        tvm_ffi.structural_map(func.body, (tirx.BufferStore, collect_store), order="post")
        if not stores:
            raise FaultNotApplicable("nothing stores into the kernel's output")
        last = stores[-1]
        new_value = _plain_fault(last.value, kind, size, str(last.buffer.dtype), "the last store")
        new_store = tirx.BufferStore(last.buffer, new_value, last.indices)
        return (tvm_ffi.structural_map(func, (tirx.BufferStore, lambda st: new_store if st.same_as(last) else st),
                                       order="post"), "the last store into the output")
    target = writers[-1]
    store = target.body
    value = store.value
    dtype = str(store.buffer.dtype)
    init = target.init
    if not dtype.startswith(("float", "bfloat")):
        raise FaultNotApplicable(f"the output is {dtype}: only floating outputs are faulted")

    def const(v: float) -> Any:
        return tirx.const(v, dtype)

    changed = f"block {target.name_hint!r}"
    new_init = init
    if init is not None:                        # a reduction: C = C + x (or max)
        if not hasattr(value, "a"):
            raise FaultNotApplicable(f"reduction block {target.name_hint!r} is not acc = op(acc, x)")
        acc = value.a if isinstance(value.a, tirx.BufferLoad) and value.a.source.same_as(store.buffer) else value.b
        term = value.b if acc is value.a else value.a
        if kind == "scale" and isinstance(value, tirx.Add):
            value = tirx.Add(acc, term * const(1 + size))
        elif kind == "shift" and isinstance(init, tirx.BufferStore):
            new_init = tirx.BufferStore(init.buffer, init.value + const(size), init.indices)
        elif kind == "round":
            value = tirx.Cast(dtype, tirx.Cast("float16", value))
        elif kind == "drop":
            value = acc                            # the reduction's update dropped: C stays its init
        else:
            raise FaultNotApplicable(f"a {kind} fault in reduction block {target.name_hint!r}")
    else:
        value = _plain_fault(value, kind, size, dtype, f"block {target.name_hint!r}")
    new_store = tirx.BufferStore(store.buffer, value, store.indices)

    def swap(block: Any) -> Any:
        if not block.same_as(target):
            return block
        return s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, new_store, new_init,
                            block.alloc_buffers, block.match_buffers, block.annotations)

    return tvm_ffi.structural_map(func, (s_tir.SBlock, swap), order="post"), changed


def _plain_fault(value: Any, kind: str, size: float, dtype: str, where: str) -> Any:
    """The stored `value` with a fault of `kind` (not a reduction's update)."""
    from tvm import tirx

    if not dtype.startswith(("float", "bfloat")):
        raise FaultNotApplicable(f"the output is {dtype}: only floating outputs are faulted")
    if kind == "scale":
        return value * tirx.const(1 + size, dtype)
    if kind == "shift":
        return value + tirx.const(size, dtype)
    if kind == "round":
        return tirx.Cast(dtype, tirx.Cast("float16", value))
    if kind == "clip":
        return tirx.Max(value, tirx.const(0.0, dtype))
    dropped = _drop_outermost(value)
    if dropped is None:
        raise FaultNotApplicable(f"{where} stores a plain value: no operation to drop")
    return dropped


def _drop_outermost(value: Any) -> Any | None:
    """`value` without its outermost operation (the first operand that is an expression of the same dtype)."""
    from tvm import tirx

    if isinstance(value, tirx.Select):           # a mask (where / causal / padding): always the true branch
        return value.true_value
    if isinstance(value, tirx.Cast):
        return _drop_outermost(value.value)
    operands = [getattr(value, "a", None), getattr(value, "b", None)] if hasattr(value, "a") else \
        list(getattr(value, "args", []))
    for operand in operands:
        if operand is not None and hasattr(operand, "ty") and str(operand.ty.dtype) == str(value.ty.dtype) and \
                not isinstance(operand, (tirx.FloatImm, tirx.IntImm)):
            return operand
    return None


_SOURCE_OF_HELPERS = "".join(inspect.getsource(f) for f in (_fault_primfunc, _plain_fault, _drop_outermost))


# ----------------------------------------------------------------------------- where faults can go


@dataclass(frozen=True)
class Site:
    """One call of one fused kernel: its kind (the pattern that made it, or "generic" for TVM's FuseOps),
    the PrimFunc and which of its call sites."""

    kind: str
    kernel: str
    call: int
    calls: int
    ops: tuple[str, ...] = ()


def fused_sites(loaded: Any, options: Any) -> list[Site]:
    """Every fused kernel call of `loaded`'s fused build, in execution order (one build)."""
    import tvm
    from tvm import relax

    from fuseguard.compiler.pipeline import compile_model
    from dataclasses import replace

    loaded = prepared(loaded)
    held: dict[str, Any] = {}

    def grab(mod: Any) -> Any:
        held["mod"] = mod
        return mod

    compiled = compile_model(loaded, options=replace(options, extra_passes=tuple(options.extra_passes)
                                                     + (("after_tir_fusion", grab),)))
    kinds: dict[str, tuple[str, tuple[str, ...]]] = {}
    for g in compiled.report.groups:
        kinds.setdefault(g.kernel or g.function, (g.pattern, tuple(g.ops)))
    mod = held["mod"]
    order: list[str] = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and \
                    value.op.name.startswith("relax.call_tir") and isinstance(value.args[0], relax.GlobalVar):
                order.append(value.args[0].name_hint)
    seen: dict[str, int] = {}
    sites = []
    for name in order:
        i = seen.get(name, 0)
        seen[name] = i + 1
        if name in kinds:
            sites.append(Site(kinds[name][0], name, i, order.count(name), kinds[name][1]))
    return sites


def prepared(loaded: Any) -> Any:
    """`loaded` as bisect builds it (shape computations folded when the importer needs it), so the kernels
    listed here are the kernels bisect's builds make."""
    from dataclasses import replace

    from fuseguard.compiler.frontend.importer import fold_shape_computations, import_model

    if import_model(loaded).prepared:
        return replace(loaded, model=fold_shape_computations(loaded.model))
    return loaded


@dataclass
class FaultOutcome:
    """What the harness made of one injected fault."""

    model: str
    site: Site
    fault: str
    size: float
    applied: bool = True
    caught: bool = False            # the fused build fails against ONNX Runtime (what `fuseguard verify` says)
    localised: bool = False         # bisect's culprit is the faulty kernel
    proven: bool = False            # ... and its reproducer fails fused vs unfused on its own
    blamed: str = ""                # what bisect named instead
    effect: float = 0.0             # the worst output's max abs error / its reference's max abs (how big it was)
    below_tolerance: bool = False   # the fault changed the outputs by less than the tolerance: nothing to catch
    detail: str = ""
    seconds: float = 0.0


def run_fault(loaded: Any, options: Any, site: Site, kind: str, size: float, out_dir: Any,
              inputs: Any = None) -> FaultOutcome:
    """Inject one fault at `site` (fused build only) and run bisect with its reproducer check."""
    import time
    from dataclasses import replace

    from .bisect import bisect_model

    fault = KernelFault(site.kernel, kind, size, site.call)
    out = FaultOutcome(loaded.name, site, kind, size)
    start = time.perf_counter()
    result = bisect_model(loaded, options=replace(options, extra_passes=tuple(options.extra_passes)
                                                  + (("after_tir_fusion", fault),)),
                          inputs=inputs, out_dir=out_dir, confirm=True)
    out.seconds = time.perf_counter() - start
    if result.status == "untestable":
        out.applied = False
        out.detail = result.error
        return out
    fused = result.fused_vs_reference
    out.caught = fused is not None and not fused
    worst = fused.worst if fused is not None else None
    if worst is not None and worst.max_abs_error is not None:
        out.effect = float(worst.max_abs_error)
    out.below_tolerance = fused is not None and bool(fused) and result.status == "no-drift"
    c = result.culprit
    if c is not None:
        out.localised = bool(fault.function) and c.function == fault.function
        out.proven = bool(out.localised and result.reproducer is not None and result.reproducer.confirmed)
        out.blamed = "" if out.localised else f"{c.pattern or 'operator'} {c.function or c.kernel}"
    out.detail = result.summary()
    return out
