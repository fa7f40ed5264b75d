"""Capture every kernel's output without changing a kernel: the probe behind `fuseguard bisect`.

Marking every tensor as a graph output (Polygraphy's ``--mark all``) breaks the very fusions
under suspicion, because a fused intermediate can no longer stay in registers. Here the probe runs
*after* FuseOps/FuseTIR (stage ``after_tir_fusion``): each ``call_tir`` in Relax ``main`` is one
kernel — a whole fused group in the fused build, one operator in the unfused build — and its result
already lives in memory. `CapturePass` only makes ``main`` return those results as well; no PrimFunc
is touched, so what is fused stays fused.

The pass records a `CaptureManifest` (ordered kernels with their inputs, output shape and the
PrimFunc called) so the extra outputs can be named after the run and two builds aligned
(`align`): single-operator kernels keep the importer's provenance names (``n<i>_<Op>``) in both
builds, while fused kernels are bound to fresh names (``lv3``) and are matched structurally to the
unfused operators they replace (same inputs, same weights, same output type, same TIR blocks).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax

from .ir import tags

KERNEL_OPS = ("relax.call_tir", "relax.call_tir_inplace", "relax.call_dps_packed")
_BLOCK = re.compile(r"^\s*with T\.sblock\(", re.M)


@dataclass(frozen=True)
class KernelArg:
    """One argument of a kernel call: a tensor var of ``main`` (``var``) or a weight (``const``)."""

    var: str | None = None
    const: str | None = None       # content hash of a non-scalar constant; scalars are not compared


@dataclass
class CapturedKernel:
    """One kernel launch in ``main`` whose output is captured."""

    key: str                       # unique capture key: the bound var's name (``#k`` on repeats)
    var: str                       # the var name as bound in main
    function: str                  # the PrimFunc (or packed function) called
    args: list[KernelArg]
    shape: tuple[int, ...] | None
    dtype: str
    blocks: int                    # TIR blocks in the PrimFunc (fused kernels: the sum over their ops)
    index: int                     # position among captured kernels (execution order)
    tuple_index: int | None = None  # for a field of a multi-output kernel

    @property
    def node_index(self) -> int | None:
        """The ONNX node whose output this tensor is, by the importer's provenance tag."""
        return node_index(self.var)

    @property
    def input_vars(self) -> list[str]:
        return [a.var for a in self.args if a.var is not None]

    @property
    def consts(self) -> list[str]:
        return sorted(a.const for a in self.args if a.const is not None)


@dataclass
class CaptureManifest:
    """What the capture pass added to ``main``: kernels in execution order after the real outputs."""

    params: list[str] = field(default_factory=list)
    kernels: list[CapturedKernel] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)   # keys of the vars main originally returned
    num_outputs: int = 0                                # flattened tensors main originally returned

    def by_key(self) -> dict[str, CapturedKernel]:
        return {k.key: k for k in self.kernels}

    def split(self, flat: Sequence[np.ndarray]) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
        """A run's flattened outputs -> (the model's own outputs, capture key -> tensor)."""
        if len(flat) != self.num_outputs + len(self.kernels):
            raise ValueError(f"run returned {len(flat)} tensors; the capture manifest expects "
                             f"{self.num_outputs} outputs + {len(self.kernels)} captures")
        own = list(flat[:self.num_outputs])
        return own, {k.key: flat[self.num_outputs + i] for i, k in enumerate(self.kernels)}


def _const_key(const: tvm.ir.Constant) -> str | None:
    data = const.value.numpy()
    if data.size <= 1:
        return None
    digest = hashlib.blake2b(np.ascontiguousarray(data).tobytes(), digest_size=12).hexdigest()
    return f"{data.dtype}{list(data.shape)}:{digest}"


def _tensor_type(expr: relax.Expr) -> tuple[tuple[int, ...] | None, str] | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType):
        return None
    shape = None
    if ty.shape is not None:
        try:
            shape = tuple(int(d) for d in ty.shape.values)
        except (TypeError, AttributeError, ValueError):
            shape = None
    return shape, str(ty.dtype)


def _count_blocks(mod: tvm.IRModule, gv: relax.Expr, cache: dict[str, int]) -> int:
    if not isinstance(gv, relax.GlobalVar):
        return 0
    name = gv.name_hint
    if name not in cache:
        func = mod[gv]
        cache[name] = len(_BLOCK.findall(func.script())) if hasattr(func, "script") else 0
    return cache[name]


def output_cones(func: Any) -> list[tuple[set[int], int]] | None:
    """For each output buffer of a multi-output PrimFunc: (indices of the params its value depends on, TIR
    blocks on its cone). A fused add + RMSNorm returns the residual sum and the normalised value; aligned as
    one kernel, both fields looked like the whole group and both were mapped to the norm's output, so the sum
    (correct) was compared with the norm and blamed. Each field is aligned as the sub-group that computes it.
    None when the function is not a TIR PrimFunc made of blocks."""
    import tvm_ffi
    from tvm import s_tir, tirx

    if not isinstance(func, tirx.PrimFunc):
        return None
    params = list(func.params)
    blocks: list[Any] = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, lambda b: blocks.append(b) if b.name_hint != "root" else None),
                            order="post")
    if not blocks:
        return None
    writers: dict[Any, list[int]] = {}
    for i, b in enumerate(blocks):
        for region in b.writes:
            writers.setdefault(region.source, []).append(i)

    def source_of(buf: Any) -> Any:
        return next((key for key in writers if key.same_as(buf)), None)

    cones = []
    for out in params:
        key = source_of(out)
        if key is None:
            continue
        seen: set[int] = set()
        read_params: set[int] = set()
        stack = list(writers[key])
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            for region in blocks[i].reads:
                for j, p in enumerate(params):
                    if region.source.same_as(p) and not p.same_as(out):
                        read_params.add(j)
                producer = source_of(region.source)
                if producer is not None:
                    stack.extend(w for w in writers[producer] if w not in seen)
        cones.append((read_params, len(seen)))
    return cones


def _flat_len(ty: Any) -> int:
    if isinstance(ty, relax.TupleType):
        return sum(_flat_len(f) for f in ty.fields)
    return 1


class CapturePass:
    """``fn(mod) -> mod`` for ``CompileOptions(extra_passes=(("after_tir_fusion", capture),))``.

    Rewrites ``main`` to return ``(original result, captured kernel outputs...)``. After a build,
    ``manifest`` says which flattened output is which kernel. One instance per build.
    """

    __name__ = "fuseguard_capture"

    def __init__(self, function: str = "main") -> None:
        self.function = function
        self.manifest = CaptureManifest()

    def __call__(self, mod: tvm.IRModule) -> tvm.IRModule:
        func = mod[self.function]
        if not isinstance(func.body, relax.SeqExpr):
            return mod
        manifest = CaptureManifest(params=[p.name for p in func.params])
        producers: dict[relax.Var, CapturedKernel] = {}
        seen: dict[str, int] = {}
        captured: list[relax.Var] = []
        blocks_cache: dict[str, int] = {}
        cones_cache: dict[str, list[tuple[set[int], int]] | None] = {}
        names: dict[relax.Var, str] = {p: p.name for p in func.params}

        def arg_of(expr: relax.Expr) -> KernelArg | None:
            if isinstance(expr, relax.Var):
                return KernelArg(var=names.get(expr, expr.name))
            if isinstance(expr, tvm.ir.Constant):
                key = _const_key(expr)
                return KernelArg(const=key) if key else None
            return None

        def add(var: relax.Var, gv: relax.Expr, args: list[KernelArg | None], tuple_index: int | None) -> None:
            tt = _tensor_type(var)
            if tt is None:
                return
            blocks = _count_blocks(mod, gv, blocks_cache)
            if tuple_index is not None and isinstance(gv, relax.GlobalVar):
                cones = cones_cache.setdefault(gv.name_hint, output_cones(mod[gv]))
                if cones is not None and tuple_index < len(cones):
                    reads, blocks = cones[tuple_index]
                    args = [a for i, a in enumerate(args) if i in reads]
            args = [a for a in args if a is not None]
            count = seen.get(var.name, 0)
            seen[var.name] = count + 1
            key = var.name if count == 0 else f"{var.name}#{count}"
            names[var] = key
            kernel = CapturedKernel(key=key, var=var.name,
                                    function=gv.name_hint if isinstance(gv, relax.GlobalVar) else str(gv),
                                    args=args, shape=tt[0], dtype=tt[1], blocks=blocks,
                                    index=len(manifest.kernels), tuple_index=tuple_index)
            manifest.kernels.append(kernel)
            producers[var] = kernel
            captured.append(var)

        calls: dict[relax.Var, tuple[relax.Expr, list[KernelArg | None]]] = {}
        for block in func.body.blocks:
            for binding in block.bindings:
                if not isinstance(binding, relax.VarBinding):
                    continue
                value, var = binding.value, binding.var
                if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in KERNEL_OPS:
                    gv = value.args[0]
                    inner = value.args[1]
                    fields = inner.fields if isinstance(inner, relax.Tuple) else [inner]
                    args = [arg_of(f) for f in fields]
                    if isinstance(var.ty, relax.TupleType):
                        calls[var] = (gv, args)
                        names[var] = var.name
                    else:
                        add(var, gv, args, None)
                elif isinstance(value, relax.TupleGetItem) and value.tuple_value in calls:
                    gv, args = calls[value.tuple_value]
                    add(var, gv, args, int(value.index))
                else:
                    names.setdefault(var, var.name)

        body = func.body.body
        outs = body.fields if isinstance(body, relax.Tuple) else [body]
        manifest.outputs = [names.get(o, o.name) if isinstance(o, relax.Var) else "" for o in outs]
        manifest.num_outputs = _flat_len(body.ty)
        if not captured:
            self.manifest = manifest
            return mod

        blocks = list(func.body.blocks)
        last = blocks[-1]
        cap_tuple = relax.Tuple(captured)
        # A non-dataflow var bound inside a dataflow block is that block's output (what R.output makes).
        out_var = relax.Var("fuseguard_captures", cap_tuple.ty)
        kind = relax.DataflowBlock if isinstance(last, relax.DataflowBlock) else relax.BindingBlock
        blocks[-1] = kind(list(last.bindings) + [relax.VarBinding(out_var, cap_tuple)])
        result = relax.Tuple([body, out_var])
        new_func = relax.Function(list(func.params), relax.SeqExpr(blocks, result), result.ty, func.is_pure,
                                  func.attrs, func.span)
        mod = tvm.IRModule(dict(mod.functions.items()), attrs=mod.attrs)
        mod[self.function] = new_func
        mod = relax.transform.Normalize()(mod)
        self.manifest = manifest
        return mod


# --------------------------------------------------------------------------- aligning two builds


@dataclass
class Alignment:
    """Fused capture key -> unfused capture key (or a model input name), and how each was found."""

    mapping: dict[str, str] = field(default_factory=dict)
    how: dict[str, str] = field(default_factory=dict)          # "name" | "output" | "anchor" | "structure"
    members: dict[str, list[str]] = field(default_factory=dict)  # fused key -> unfused keys it fuses
    unmapped: list[str] = field(default_factory=list)
    #: unmapped fused kernel -> the mapped unfused tensors its region (it and the unmapped kernels before it)
    #: reads: where a cut-out around a kernel that reads it starts
    regions: dict[str, list[str]] = field(default_factory=dict)


def align(fused: CaptureManifest, unfused: CaptureManifest, *, anchors: Mapping[str, str] | None = None,
          max_group: int = 64) -> Alignment:
    """Map every fused kernel output to the unfused tensor holding the same value.

    Provenance names first (single-operator kernels and model outputs), then `anchors` (fused key ->
    unfused name, e.g. a pattern group's output var recorded by the cost model before fusion); then, for
    the remaining fused groups,
    the unfused subgraph ending at a candidate tensor whose inputs are exactly the group's inputs
    (already mapped, in execution order), whose weights are the group's weights and whose TIR
    block count adds up to the group's. Names inside deduplicated fused functions are shared by
    every call site, so they cannot be trusted per call; structure can.
    """
    ukeys = unfused.by_key()
    order = {k.key: k.index for k in unfused.kernels}
    result = Alignment()
    m: dict[str, str] = {p: p for p in fused.params if p in set(unfused.params)}
    out_map = dict(zip(fused.outputs, unfused.outputs))
    used: set[str] = set()
    fkeys = fused.by_key()
    #: unmapped fused kernel -> (the mapped tensors its region reads, the unmapped kernels in the region)
    regions: dict[str, tuple[list[str], list[str]]] = {}

    for f in fused.kernels:
        if f.key in out_map and out_map[f.key] in ukeys:
            target = ukeys[out_map[f.key]]
            if target.shape == f.shape and target.dtype == f.dtype:
                m[f.key], result.how[f.key] = target.key, "output"
        elif tags.is_tagged(f.key) and f.key in ukeys:
            target = ukeys[f.key]
            if target.shape == f.shape and target.dtype == f.dtype:
                m[f.key], result.how[f.key] = target.key, "name"
        elif anchors and anchors.get(f.key) in ukeys:
            target = ukeys[anchors[f.key]]
            if target.shape == f.shape and target.dtype == f.dtype:
                m[f.key], result.how[f.key] = target.key, "anchor"
        inputs = [m.get(v) for v in f.input_vars]
        absorbed: list[str] = []
        if f.key not in m and any(i is None for i in inputs):
            # an input from a fused kernel with no unfused counterpart (a layout transpose the attention kernel
            # needs): search from that kernel's own mapped inputs, the two compared as one region
            widened: list[str | None] = []
            for v, i in zip(f.input_vars, inputs):
                if i is None and v in regions:
                    widened.extend(regions[v][0])
                    absorbed.extend(regions[v][1])
                else:
                    widened.append(i)
            inputs = widened
        if f.key in m:
            closure = None
            if all(i is not None for i in inputs):
                closure = upstream(ukeys[m[f.key]], ukeys, set(inputs), set(unfused.params), max_group)  # type: ignore[arg-type]
            result.members[f.key] = sorted(closure[0], key=lambda k: order[k]) if closure else [m[f.key]]
            used.add(m[f.key])
            continue
        if any(i is None for i in inputs):
            result.unmapped.append(f.key)
            continue
        own_blocks = f.blocks + sum(fkeys[a].blocks for a in absorbed)
        want_inputs = set(inputs)  # type: ignore[arg-type]
        after = max((order.get(i, -1) for i in want_inputs), default=-1)
        best: tuple[tuple[int, ...], CapturedKernel, list[str]] | None = None
        for u in unfused.kernels:
            if u.index <= after or u.shape != f.shape or u.dtype != f.dtype:
                continue
            closure = upstream(u, ukeys, want_inputs, set(unfused.params), max_group)
            if closure is None:
                continue
            members, leaves = closure
            if leaves != want_inputs:
                continue
            consts = sorted(c for k in members for c in ukeys[k].consts)
            blocks = sum(ukeys[k].blocks for k in members)
            if f.blocks and blocks < own_blocks:
                # the fused kernel does more than these unfused ops (an extra transpose): it holds another
                # value, of the same shape when head_dim == seq. (Recognised norms are fewer blocks, never more.)
                continue
            want_consts = sorted(f.consts + [c for a in absorbed for c in fkeys[a].consts])
            score = (int(consts == want_consts), int(blocks == own_blocks), int(u.key not in used), -len(members))
            if best is None or score > best[0]:
                best = (score, u, members)
        if best is None or best[0][0] == 0 and (f.consts or absorbed):
            result.unmapped.append(f.key)
            regions[f.key] = ([i for i in inputs if i is not None], absorbed + [f.key])
            continue
        m[f.key], result.how[f.key] = best[1].key, "structure" if not absorbed else "structure+" + ",".join(absorbed)
        result.members[f.key] = sorted(best[2], key=lambda k: order[k])
        used.add(best[1].key)
    result.mapping = {k: v for k, v in m.items() if k not in fused.params}
    result.regions = {k: list(v[0]) for k, v in regions.items()}
    return result


def upstream(root: CapturedKernel, ukeys: Mapping[str, CapturedKernel], stop: set[str], params: set[str],
             limit: int) -> tuple[list[str], set[str]] | None:
    """Unfused kernels from ``root`` back to the ``stop`` tensors: (members, stop tensors reached)."""
    members: list[str] = []
    leaves: set[str] = set()
    stack, seen = [root.key], set()
    while stack:
        key = stack.pop()
        if key in seen:
            continue
        seen.add(key)
        if key in stop:
            leaves.add(key)
            continue
        if key in params or key not in ukeys:
            return None          # reached a model input (or unknown) that the group does not read
        members.append(key)
        if len(members) > limit:
            return None
        stack.extend(ukeys[key].input_vars)
    return members, leaves


def node_indices(key: str) -> list[int]:
    """Every ONNX node a provenance-tagged name stands for (``n1x2x9_LayerNorm`` -> [1, 2, 9])."""
    return tags.indices(key)


def node_index(key: str) -> int | None:
    """The ONNX node whose output a tagged tensor is: the last node of a merged tag (its root)."""
    indices = node_indices(key)
    return indices[-1] if indices else None
