"""`fuseguard bisect`: find the fused group (or the lowered operator) where a model's output drifts.

Polygraphy's ``--mark all`` turns every tensor into a graph output, and so takes apart the very
fusions under suspicion. Here both builds are compiled exactly as shipped and only *probed*:
`compiler.capture.CapturePass` makes Relax ``main`` also return every kernel's output, after
FuseOps/FuseTIR and without touching a kernel. One fused kernel is one fused group, one unfused
kernel is one operator, and `compiler.capture.align` maps each fused group's output onto the
unfused tensor that holds the same value (provenance names, then structure).

Then, in execution order:

* **fusion** (fused != unfused while unfused == ONNX Runtime): the first fused kernel whose output
  leaves tolerance while its inputs still agree is the culprit group;
* **import/lowering** (unfused != ONNX Runtime): unfused intermediates are compared with ONNX
  Runtime's values for the ONNX tensors they stand for (ORT runs with graph optimisations off and
  the intermediates exposed as graph outputs); where no tensor maps, the ONNX graph is bisected in
  node order with prefix sub-models cut by `onnx.utils.Extractor` (log2 N builds).

The culprit is written out as a minimal reproducer: the ONNX sub-model from the culprit's input
tensors to its output tensor, plus the input values it actually saw (``repro.npz``), so that
``fuseguard verify repro.onnx --inputs repro.npz`` reproduces it on its own. A *fusion* bug only
reproduces where the same bad fusion is built: load the same ``--plugin`` (or pass the same
``extra_passes``) when verifying the reproducer.

Exit codes follow ``git bisect run``: 0 no drift, 1 drift found, 125 the model cannot be built
(or run) at this commit, so the commit is skipped; 2 is a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from compiler.errors import FuseguardError, UsageError

from .compare import CompareResult, OutputCompareResult, Tolerance, Tolerances, compare_outputs, resolve_tolerance

if TYPE_CHECKING:
    import onnx

    from compiler.capture import Alignment, CaptureManifest, CapturedKernel
    from compiler.onnx_loader import LoadedModel
    from compiler.pipeline import CompileOptions, CompiledModel

EXIT_NO_DRIFT, EXIT_DRIFT, EXIT_USAGE, EXIT_UNTESTABLE = 0, 1, 2, 125
BLAME_FUSION = "fusion"
BLAME_LOWERING = "import/lowering"
_SUFFIX = re.compile(r"\d+$")


# ----------------------------------------------------------------------------- results


@dataclass
class Culprit:
    """The first kernel (fused group or operator) whose output drifts while its inputs agree."""

    blame: str                      # "fusion" (fused != unfused) or "import/lowering" (unfused != ORT)
    kernel: str                     # capture key of its output in the build where it drifts
    function: str                   # the PrimFunc that ran ("" when found by ONNX-order bisection)
    pattern: str                    # fusion rule, "generic" (TVM FuseOps) or "" (a single operator)
    ops: list[str]
    onnx_nodes: list[str]
    onnx_op_types: list[str]
    onnx_inputs: list[str]          # ONNX tensors the culprit reads
    onnx_outputs: list[str]         # ONNX tensor it produces
    error: OutputCompareResult      # its output vs the reference (unfused build, or ORT)
    inputs_agree: bool | None       # None: some input could not be compared
    input_errors: dict[str, float | None] = field(default_factory=dict)   # max abs error per input
    reason: str = ""                # the cost model's reason for fusing it
    via: str = "kernel capture"     # or "ONNX-order bisection"

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "error"}
        d["error"] = self.error.to_dict()
        return d


@dataclass
class Reproducer:
    """The culprit cut out as its own ONNX model with the input values it saw."""

    model: str
    inputs: str
    command: str
    confirmed: bool | None = None   # did `verify` on the reproducer fail as the full model did?
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class BisectResult:
    """Truthy when there is no drift. `exit_code` is what `git bisect run` wants."""

    model: str
    target: str
    status: str                                  # "no-drift" | "drift" | "untestable"
    culprit: Culprit | None = None
    other: list[Culprit] = field(default_factory=list)   # a second culprit of the other blame, if any
    fused_vs_reference: CompareResult | None = None
    unfused_vs_reference: CompareResult | None = None
    compared: int = 0                            # intermediate tensors compared
    unmapped: list[str] = field(default_factory=list)    # fused kernels with no unfused counterpart
    builds: int = 0
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    reproducer: Reproducer | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.status == "no-drift"

    @property
    def exit_code(self) -> int:
        return {"no-drift": EXIT_NO_DRIFT, "drift": EXIT_DRIFT}.get(self.status, EXIT_UNTESTABLE)

    def summary(self) -> str:
        if self.status == "untestable":
            return f"{self.model}: cannot be tested: {self.error}"
        if self.status == "no-drift":
            return f"{self.model}: no drift (fused, unfused and ONNX Runtime agree; {self.builds} builds, {self.seconds:.1f} s)"
        if self.culprit is None:
            return f"{self.model}: drift, not localised ({'; '.join(self.notes) or 'no kernel diverged'})"
        c = self.culprit
        what = f"{c.pattern} group" if c.pattern else "operator"
        return (f"{self.model}: {c.blame} drift at {what} {c.function or c.kernel} "
                f"({', '.join(c.onnx_nodes[:6])}{' ...' if len(c.onnx_nodes) > 6 else ''}): "
                f"max abs err {_fmt(c.error.max_abs_error)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "target": self.target, "status": self.status, "summary": self.summary(),
            "culprit": self.culprit.to_dict() if self.culprit else None,
            "other": [c.to_dict() for c in self.other],
            # `is not None`: a CompareResult is falsy when it failed, the comparison that matters most.
            "fused_vs_reference": None if self.fused_vs_reference is None else self.fused_vs_reference.to_dict(),
            "unfused_vs_reference": (None if self.unfused_vs_reference is None
                                     else self.unfused_vs_reference.to_dict()),
            "compared": self.compared, "unmapped": list(self.unmapped), "builds": self.builds,
            "seconds": self.seconds, "timings": dict(self.timings),
            "reproducer": self.reproducer.to_dict() if self.reproducer else None,
            "error": self.error, "notes": list(self.notes), "exit_code": self.exit_code,
        }

    def __rich__(self) -> Any:
        return self.render()

    def render(self) -> Any:
        from rich.console import Group
        from rich.markup import escape
        from rich.table import Table

        colour = {"no-drift": "green", "drift": "red"}.get(self.status, "yellow")
        head = Table(title=f"fuseguard bisect: {escape(self.model)} on {self.target}", show_header=False,
                     title_justify="left")
        head.add_column("", style="bold")
        head.add_column("", overflow="fold")
        head.add_row("verdict", f"[{colour}]{escape(self.summary())}[/]")
        for label, res in (("fused vs ORT", self.fused_vs_reference), ("unfused vs ORT", self.unfused_vs_reference)):
            if res is not None:
                head.add_row(label, escape(res.summary()))
        head.add_row("cost", f"{self.builds} builds, {self.seconds:.1f} s, {self.compared} intermediates compared"
                     + (f", {len(self.unmapped)} fused kernels unmapped" if self.unmapped else ""))
        parts: list[Any] = [head]
        for c in [self.culprit, *self.other]:
            if c is None:
                continue
            t = Table(title=f"culprit ({c.blame}, found by {c.via})", show_header=False, title_justify="left")
            t.add_column("", style="bold")
            t.add_column("", overflow="fold")
            t.add_row("kernel", escape(f"{c.function} -> {c.kernel}" if c.function else c.kernel))
            t.add_row("pattern", escape(c.pattern or "(not fused: a single operator)"))
            t.add_row("ops", escape(" + ".join(c.ops)))
            t.add_row("ONNX nodes", escape(", ".join(f"{n} ({o})" for n, o in zip(c.onnx_nodes, c.onnx_op_types))))
            t.add_row("ONNX tensors", escape(f"{', '.join(c.onnx_inputs)} -> {', '.join(c.onnx_outputs)}"))
            e = c.error
            t.add_row("error", escape(f"max abs {_fmt(e.max_abs_error)} at {e.max_abs_index}, mean abs "
                                      f"{_fmt(e.mean_abs_error)}, max rel {_fmt(e.max_rel_error)}, "
                                      f"{e.mismatches}/{e.size} out of {e.tolerance}"))
            agree = {True: "yes", False: "NO", None: "unknown"}[c.inputs_agree]
            t.add_row("inputs agree", escape(f"{agree} ({', '.join(f'{k}: {_fmt(v)}' for k, v in c.input_errors.items())})"))
            if c.reason:
                t.add_row("why fused", escape(c.reason))
            parts.append(t)
        if self.reproducer is not None:
            r = self.reproducer
            state = {True: "[red]fails verify on its own[/]", False: "[yellow]passes verify on its own[/]",
                     None: "not checked"}[r.confirmed]
            parts.append(f"reproducer: {escape(r.model)} + {escape(r.inputs)} ({state})\n  {escape(r.command)}"
                         + (f"\n  {escape(r.detail)}" if r.detail else ""))
        for note in self.notes:
            parts.append(f"[yellow]note:[/] {escape(note)}")
        return Group(*parts)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


# ----------------------------------------------------------------------------- helpers


def _close(actual: np.ndarray, reference: np.ndarray, tol: Tolerance) -> bool:
    """The comparator's rule (|a - r| <= atol + rtol |r|, NaN never passes), cheaply, for scanning."""
    if actual.shape != reference.shape:
        return False
    if actual.size == 0:
        return True
    if actual.dtype.kind in "biu" and reference.dtype.kind in "biu" and tol.exact:
        return bool(np.array_equal(actual, reference))
    with np.errstate(invalid="ignore", over="ignore"):
        return bool(np.isclose(actual.astype(np.float64), reference.astype(np.float64), rtol=tol.rtol,
                               atol=tol.atol, equal_nan=False).all())


def _max_abs(actual: np.ndarray, reference: np.ndarray) -> float | None:
    if actual.shape != reference.shape or actual.size == 0:
        return None
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.max(np.abs(actual.astype(np.float64) - reference.astype(np.float64))))


def _compare_one(name: str, actual: np.ndarray, reference: np.ndarray, tolerances: Tolerances) -> OutputCompareResult:
    return compare_outputs({name: actual}, {name: reference}, tolerances=tolerances)[name]


def _tol(name: str, reference: np.ndarray, tolerances: Tolerances) -> Tolerance:
    return resolve_tolerance(name, reference.dtype, tolerances)


def _stem(function: str) -> str:
    return _SUFFIX.sub("", function).rstrip("_")


class _Graph:
    """ONNX graph facts the bisector needs: producers, initializers, tensor names per node."""

    def __init__(self, model: "onnx.ModelProto") -> None:
        g = model.graph
        self.model = model
        self.nodes = list(g.node)
        self.initializers = {i.name for i in g.initializer}
        self.inputs = [i.name for i in g.input if i.name not in self.initializers]
        self.outputs = [o.name for o in g.output]
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = {}
        for i, n in enumerate(self.nodes):
            for t in n.output:
                if t:
                    self.producer[t] = i
            for t in n.input:
                if t:
                    self.consumers.setdefault(t, []).append(i)

    def is_constant(self, tensor: str) -> bool:
        if tensor in self.initializers:
            return True
        p = self.producer.get(tensor)
        return p is not None and self.nodes[p].op_type == "Constant"

    def node_tensor(self, index: int, folded_bn: bool) -> str | None:
        """The ONNX tensor a var tagged with node `index` holds, when that is unambiguous."""
        if not 0 <= index < len(self.nodes):
            return None
        node = self.nodes[index]
        outs = [t for t in node.output if t]
        if len(outs) != 1:
            return None
        if folded_bn and node.op_type == "Conv":
            # FoldBatchNorm keeps the Conv's name on the conv with scaled weights: not the Conv's value.
            if any(self.nodes[c].op_type == "BatchNormalization" for c in self.consumers.get(outs[0], [])):
                return None
        return outs[0]

    def frontier(self, k: int) -> list[str]:
        """Tensors made by nodes[0..k] that later nodes read or the graph returns (and node k's own)."""
        made = [t for n in self.nodes[:k + 1] for t in n.output if t]
        live = []
        for t in made:
            later = any(c > k for c in self.consumers.get(t, []))
            if later or t in self.outputs or self.producer.get(t) == k:
                live.append(t)
        return [t for t in dict.fromkeys(live) if not self.is_constant(t)]


def _expose(model: "onnx.ModelProto", names: Sequence[str]) -> "onnx.ModelProto":
    """A copy of the model with these intermediate tensors added to graph.output (typed by shape inference)."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(copy)
    except Exception:  # best effort: tensors without a type are not exposed
        inferred = copy
    typed = {vi.name: vi for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    present = {o.name for o in copy.graph.output}
    for name in names:
        if name in present or name not in typed or not typed[name].type.HasField("tensor_type"):
            continue
        copy.graph.output.append(typed[name])
        present.add(name)
    return copy


def _extract(model: "onnx.ModelProto", inputs: Sequence[str], outputs: Sequence[str]) -> "onnx.ModelProto":
    """The sub-model from `inputs` to `outputs`; inputs it still lacks are added until it checks."""
    import onnx
    import onnx.utils

    try:
        model = onnx.shape_inference.infer_shapes(model)  # the extractor types cut tensors from value_info
    except Exception:
        pass
    extractor = onnx.utils.Extractor(model)
    inputs = list(dict.fromkeys(inputs))
    for _ in range(8):
        sub = extractor.extract_model(inputs, list(outputs))
        produced = {t for n in sub.graph.node for t in n.output}
        known = produced | {i.name for i in sub.graph.input} | {i.name for i in sub.graph.initializer}
        missing = [t for n in sub.graph.node for t in n.input if t and t not in known]
        if not missing:
            onnx.checker.check_model(sub)
            return sub
        inputs += list(dict.fromkeys(missing))
    raise ValueError(f"cannot cut a self-contained sub-model for outputs {list(outputs)}")


# ----------------------------------------------------------------------------- the bisector


def _anchors(build: "_Build") -> dict[str, str]:
    """Fused capture key -> the pattern group's output var before fusion (the cost model's anchor).

    Only for functions called once: FuseOps/FuseTIR merge structurally identical groups into one
    function, and the report then repeats that function's first anchor for every call.
    """
    from compiler.capture import node_index

    calls: dict[str, list[str]] = {}
    for k in build.manifest.kernels:
        if k.tuple_index in (None, 0):
            calls.setdefault(k.function, []).append(k.key)
    seen: dict[str, int] = {}
    out: dict[str, str] = {}
    for g in build.compiled.report.groups:
        i = seen.get(g.function, 0)
        seen[g.function] = i + 1
        keys = calls.get(g.function, [])
        if g.pattern != "generic" and len(keys) == 1 and i == 0 and node_index(g.output_var) is not None:
            out[keys[i]] = g.output_var
    return out



@dataclass
class _Build:
    compiled: "CompiledModel"
    manifest: "CaptureManifest"
    outputs: list[np.ndarray]
    captures: dict[str, np.ndarray]


class _Bisector:
    def __init__(self, loaded: "LoadedModel", options: "CompileOptions", inputs: dict[str, np.ndarray],
                 tolerances: Tolerances, out_dir: Path, confirm: bool, strategy: str) -> None:
        self.loaded, self.options, self.inputs = loaded, options, inputs
        self.tolerances, self.out_dir, self.confirm, self.strategy = tolerances, out_dir, confirm, strategy
        self.graph = _Graph(loaded.model)
        self.result = BisectResult(model=loaded.name, target="", status="drift")
        self.start = time.perf_counter()

    # -- steps

    def _timed(self, label: str, start: float) -> None:
        self.result.timings[label] = self.result.timings.get(label, 0.0) + time.perf_counter() - start

    def build(self, options: "CompileOptions", label: str) -> _Build:
        from compiler.capture import CapturePass
        from compiler.pipeline import compile_model

        capture = CapturePass()
        opts = dataclasses.replace(options, extra_passes=tuple(options.extra_passes) + (("after_tir_fusion", capture),))
        start = time.perf_counter()
        compiled = compile_model(self.loaded, options=opts)
        self.result.builds += 1
        self._timed(f"build {label}", start)
        start = time.perf_counter()
        flat = compiled.run(self.inputs)
        self._timed(f"run {label}", start)
        outputs, captures = capture.manifest.split(flat)
        return _Build(compiled, capture.manifest, outputs, captures)

    def onnx_tensors(self, manifest: "CaptureManifest") -> dict[str, str]:
        """Capture key -> the ONNX tensor it holds (model inputs, tagged node outputs, model outputs)."""
        from compiler.capture import node_index

        out: dict[str, str] = dict(zip(manifest.params, self.loaded.input_shapes))
        folded = self.options.bn_folding
        for k in manifest.kernels:
            index = node_index(k.key) if "#" not in k.key else None
            tensor = self.graph.node_tensor(index, folded) if index is not None else None
            if tensor is not None:
                out[k.key] = tensor
        for key, name in zip(manifest.outputs, self.loaded.output_names):
            if key:
                out[key] = name
        return out

    def node_names(self, keys: Sequence[str]) -> tuple[list[str], list[str]]:
        from compiler.capture import node_indices

        idx = sorted({i for k in keys for i in node_indices(k) if i < len(self.graph.nodes)})
        return [self.graph.nodes[i].name for i in idx], [self.graph.nodes[i].op_type for i in idx]

    def run(self) -> BisectResult:
        from compiler.capture import align
        from compiler.target import cuda_device_present, resolve

        from .core import run_onnxruntime

        res = self.result
        spec = resolve(self.options.gpu_arch, self.options.mcpu)
        res.target = spec.label
        if spec.is_gpu and not cuda_device_present():
            return self._untestable("no CUDA device to run the build on")
        try:
            fused = self.build(self.options, "fused")
            unfused = self.build(self.options.unfused(), "unfused")
        except FuseguardError as err:
            if isinstance(err, UsageError):
                raise
            return self._untestable(str(err))
        except Exception as err:  # a TVM failure while building or running: this commit cannot be tested
            return self._untestable(f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}")

        u2onnx = self.onnx_tensors(unfused.manifest)
        start = time.perf_counter()
        wanted = [t for k, t in u2onnx.items() if k not in unfused.manifest.params]
        reference = run_onnxruntime(_expose(self.loaded.model, wanted), self.inputs)
        self._timed("onnxruntime", start)
        names = self.loaded.output_names
        res.fused_vs_reference = compare_outputs(dict(zip(names, fused.outputs)), {n: reference[n] for n in names},
                                                 tolerances=self.tolerances)
        res.unfused_vs_reference = compare_outputs(dict(zip(names, unfused.outputs)),
                                                   {n: reference[n] for n in names}, tolerances=self.tolerances)
        start = time.perf_counter()
        alignment = align(fused.manifest, unfused.manifest, anchors=_anchors(fused))
        self._timed("align", start)
        res.unmapped = list(alignment.unmapped)
        if res.fused_vs_reference and res.unfused_vs_reference:
            res.status = "no-drift"
            return self._finish()

        culprits: list[Culprit] = []
        if not res.unfused_vs_reference:
            lowering = None if self.strategy == "onnx-order" else self._lowering_culprit(unfused, u2onnx, reference)
            if lowering is None and self.strategy != "onnx-order":
                res.notes.append("no unfused intermediate that maps to an ONNX tensor drifts; bisecting the ONNX "
                                 "graph in node order")
            if lowering is None:
                lowering = self._onnx_order_culprit(reference)
            if lowering is not None:
                culprits.append(lowering)
        if not res.fused_vs_reference or (res.unfused_vs_reference and not culprits):
            fusion = self._fusion_culprit(fused, unfused, alignment, u2onnx)
            if fusion is not None:
                culprits.append(fusion)
            elif not res.unfused_vs_reference:
                pass  # the fused build inherits the lowering drift; nothing fusion-specific diverged
            else:
                res.notes.append(f"no fused kernel that maps onto the unfused build diverges "
                                 f"({len(alignment.unmapped)} fused kernels could not be mapped)")
        if culprits:
            res.culprit, res.other = culprits[0], culprits[1:]
            start = time.perf_counter()
            try:
                res.reproducer = self._reproducer(res.culprit, fused, unfused, alignment, u2onnx, reference)
            except Exception as err:  # the verdict stands without a reproducer
                res.notes.append(f"no reproducer: {type(err).__name__}: {err}")
            self._timed("reproducer", start)
        return self._finish()

    def _finish(self) -> BisectResult:
        self.result.seconds = time.perf_counter() - self.start
        return self.result

    def _untestable(self, why: str) -> BisectResult:
        self.result.status = "untestable"
        self.result.error = why
        return self._finish()

    # -- blame: import/lowering (unfused vs ORT)

    def _lowering_culprit(self, unfused: _Build, u2onnx: Mapping[str, str],
                          reference: Mapping[str, np.ndarray]) -> Culprit | None:
        from compiler.capture import upstream

        agree: set[str] = set(unfused.manifest.params)
        keys = unfused.manifest.by_key()
        for k in unfused.manifest.kernels:
            tensor = u2onnx.get(k.key)
            if tensor is None or tensor not in reference or reference[tensor].shape != unfused.captures[k.key].shape:
                continue
            self.result.compared += 1
            actual, ref = unfused.captures[k.key], reference[tensor]
            if _close(actual, ref, _tol(tensor, ref, self.tolerances)):
                agree.add(k.key)
                continue
            closure = upstream(k, keys, agree, set(unfused.manifest.params), 10_000)
            members, leaves = closure if closure else ([k.key], set())
            input_errors: dict[str, float | None] = {}
            for leaf in sorted(leaves):
                t = u2onnx.get(leaf, leaf)
                value = unfused.captures.get(leaf, self.inputs.get(t))
                input_errors[t] = _max_abs(value, reference[t]) if value is not None and t in reference else 0.0
            nodes, ops = self.node_names(members)
            return Culprit(
                blame=BLAME_LOWERING, kernel=k.key, function=k.function, pattern="",
                ops=[_stem(keys[m].function) for m in members if m in keys], onnx_nodes=nodes, onnx_op_types=ops,
                onnx_inputs=[u2onnx.get(leaf, leaf) for leaf in sorted(leaves, key=lambda x: keys[x].index if x in keys else -1)],
                onnx_outputs=[tensor], error=_compare_one(tensor, actual, ref, self.tolerances),
                inputs_agree=bool(closure), input_errors=input_errors)
        return None

    def _onnx_order_culprit(self, reference: Mapping[str, np.ndarray]) -> Culprit | None:
        """Bisect node order: the first prefix whose live tensors drift (unfused build vs ORT) ends at the culprit."""
        from compiler.onnx_loader import load
        from compiler.cache import compile_cached

        from .core import run_onnxruntime

        g = self.graph
        memo: dict[int, tuple[bool, CompareResult | None]] = {}

        def drifts(k: int) -> bool:
            if k in memo:
                return memo[k][0]
            outputs = g.frontier(k)
            sub = _extract(g.model, g.inputs, outputs)
            feed = {i.name: self.inputs[i.name] for i in sub.graph.input if i.name in self.inputs}
            start = time.perf_counter()
            try:
                sub_loaded = load(sub, {n: tuple(v.shape) for n, v in feed.items()}, name=f"prefix{k}")
                compiled = compile_cached(sub_loaded, self.options.unfused())
                self.result.builds += 1
                got = compiled.run(feed)
            except FuseguardError as err:
                self.result.notes.append(f"prefix up to node {k} does not build ({err}); counted as drifting")
                memo[k] = (True, None)
                return True
            finally:
                self._timed("onnx-order bisection", start)
            ref = run_onnxruntime(sub, feed)
            cmp = compare_outputs(dict(zip(sub_loaded.output_names, got)), {n: ref[n] for n in sub_loaded.output_names},
                                  tolerances=self.tolerances)
            memo[k] = (not cmp, cmp)
            return not cmp

        lo, hi = 0, len(g.nodes) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if drifts(mid):
                hi = mid
            else:
                lo = mid + 1
        if not drifts(lo):
            return None
        node = g.nodes[lo]
        cmp = memo[lo][1]
        outs = [t for t in node.output if t]
        if cmp is not None:
            failing = [n for n in outs if n in cmp and not cmp[n]] or cmp.failed
            error = cmp[failing[0]] if failing else cmp.worst
        else:
            error = OutputCompareResult(name=outs[0] if outs else node.name, dtype="", shape=(), passed=False,
                                        tolerance=Tolerance(0, 0), reason="prefix does not build")
        ins = [t for t in node.input if t and not g.is_constant(t)]
        return Culprit(blame=BLAME_LOWERING, kernel=outs[0] if outs else node.name, function="", pattern="",
                       ops=[node.op_type], onnx_nodes=[node.name], onnx_op_types=[node.op_type], onnx_inputs=ins,
                       onnx_outputs=outs, error=error, inputs_agree=True if lo == 0 or not drifts(lo - 1) else None,
                       input_errors={t: 0.0 for t in ins}, via="ONNX-order bisection")

    # -- blame: fusion (fused vs unfused)

    def _fusion_culprit(self, fused: _Build, unfused: _Build, alignment: "Alignment",
                        u2onnx: Mapping[str, str]) -> Culprit | None:
        agree: dict[str, float | None] = {p: 0.0 for p in fused.manifest.params}
        for k in fused.manifest.kernels:
            target = alignment.mapping.get(k.key)
            if target is None or target not in unfused.captures:
                continue
            self.result.compared += 1
            actual, ref = fused.captures[k.key], unfused.captures[target]
            if _close(actual, ref, _tol(target, ref, self.tolerances)):
                agree[k.key] = _max_abs(actual, ref)
                continue
            input_errors: dict[str, float | None] = {}
            inputs_agree: bool | None = True
            for v in k.input_vars:
                u = alignment.mapping.get(v, v if v in fused.manifest.params else None)
                if v in agree:
                    input_errors[u2onnx.get(u or v, v)] = agree[v]
                elif u is not None and v in fused.captures and u in unfused.captures:
                    input_errors[u2onnx.get(u, u)] = _max_abs(fused.captures[v], unfused.captures[u])
                    inputs_agree = False
                else:
                    input_errors[v] = None
                    inputs_agree = None if inputs_agree else inputs_agree
            members = alignment.members.get(k.key, [target])
            nodes, ops = self.node_names(members)
            group = self._report_group(fused.compiled, k, target)
            ins = [u2onnx.get(alignment.mapping.get(v, v), alignment.mapping.get(v, v)) for v in k.input_vars]
            name = u2onnx.get(target, target)
            return Culprit(
                blame=BLAME_FUSION, kernel=k.key, function=k.function,
                pattern=group.pattern if group else ("" if len(members) <= 1 else "generic"),
                ops=list(group.ops) if group else [_stem(unfused.manifest.by_key()[m].function) for m in members],
                onnx_nodes=nodes, onnx_op_types=ops, onnx_inputs=list(dict.fromkeys(ins)), onnx_outputs=[name],
                error=_compare_one(name, actual, ref, self.tolerances), inputs_agree=inputs_agree,
                input_errors=input_errors, reason=group.reason if group else "")
        return None

    @staticmethod
    def _report_group(compiled: "CompiledModel", kernel: "CapturedKernel", target: str) -> Any:
        groups = [g for g in compiled.report.groups if g.function == kernel.function]
        for g in groups:
            if g.output_var in (kernel.var, target):
                return g
        return groups[0] if groups else None

    # -- the reproducer

    def _reproducer(self, culprit: Culprit, fused: _Build, unfused: _Build, alignment: "Alignment",
                    u2onnx: Mapping[str, str], reference: Mapping[str, np.ndarray]) -> Reproducer:
        import onnx

        from .core import run_onnxruntime, verify_model

        values: dict[str, np.ndarray] = dict(self.inputs)
        for key, tensor in u2onnx.items():
            if key in unfused.captures:
                values.setdefault(tensor, unfused.captures[key])
        if culprit.blame == BLAME_FUSION:  # the values the fused kernel actually read
            for f_key, u_key in alignment.mapping.items():
                if u_key in u2onnx and f_key in fused.captures:
                    values[u2onnx[u_key]] = fused.captures[f_key]
        g = self.graph
        inputs = [t for t in culprit.onnx_inputs if not g.is_constant(t)]
        sub = _extract(g.model, inputs, culprit.onnx_outputs)
        needed = [i.name for i in sub.graph.input]
        missing = [n for n in needed if n not in values]
        if missing:
            values.update({k: v for k, v in run_onnxruntime(_expose(g.model, missing), self.inputs).items() if k in missing})
        feed = {n: np.ascontiguousarray(values[n]) for n in needed}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        model_path, inputs_path = self.out_dir / "repro.onnx", self.out_dir / "repro.npz"
        onnx.save(sub, str(model_path))
        np.savez(inputs_path, **feed)
        command = f"fuseguard verify {model_path} --inputs {inputs_path}"
        if not self.options.schedule:
            command += " --no-schedule"
        if self.options.gpu_arch:
            command += f" --gpu-arch {self.options.gpu_arch}"
        if culprit.blame == BLAME_FUSION:
            command += "  # plus the --plugin that made the bad fusion, if it came from one"
        repro = Reproducer(model=str(model_path), inputs=str(inputs_path), command=command)
        if self.confirm:
            user_opts = self.options
            verdict = verify_model(str(model_path), options=user_opts, inputs_file=str(inputs_path),
                                   tolerances=self.tolerances)
            self.result.builds += 2
            repro.confirmed = not verdict.passed
            parts = [f"{b.config}: {b.compare.summary() if b.compare is not None else b.error}"
                     for b in (verdict.fused, verdict.unfused)]
            repro.detail = "verify on the reproducer: " + verdict.status + " (" + "; ".join(parts) + ")"
        return repro


# ----------------------------------------------------------------------------- API


def bisect_model(source: Any, shapes: Mapping[str, Sequence[int]] | None = None,
                 options: "CompileOptions | None" = None,
                 inputs: Mapping[str, np.ndarray] | str | Path | None = None, seed: int | None = None,
                 tolerances: Tolerances = None, out_dir: str | Path = "fuseguard-bisect", *,
                 name: str | None = None, confirm: bool = True, strategy: str = "capture",
                 default_dim: int | None = None) -> BisectResult:
    """Localise output drift to one fused group (blame: fusion) or one lowered operator (import/lowering).

    `source`: ONNX path/bytes/ModelProto, a `LoadedModel` or a `verify.core.SuiteSpec`. `inputs`: arrays
    or an .npz path (missing inputs are drawn from `seed`). `strategy="onnx-order"` skips the kernel
    capture for import/lowering blame and bisects ONNX node order instead. The reproducer is written
    to `out_dir`; `confirm` re-verifies it (two more builds).
    """
    from compiler.importer import fold_shape_computations, import_model
    from compiler.onnx_loader import LoadedModel, load
    from compiler.pipeline import CompileOptions

    from .core import SuiteSpec
    from .inputs import load_npz, make_inputs

    if strategy not in ("capture", "onnx-order"):
        raise UsageError(f"unknown bisect strategy {strategy!r}; use 'capture' or 'onnx-order'")
    options = options or CompileOptions()
    if not options.fusion:
        raise UsageError("bisect compares the fused build with the unfused one: fusion must be on")
    from compiler.plugins import load_env_plugins

    load_env_plugins()
    if isinstance(source, SuiteSpec):
        name = name or source.label
        seed = source.seed if seed is None else seed
        source = source.build()
    seed = 0 if seed is None else seed
    loaded = source if isinstance(source, LoadedModel) else load(source, shapes, name=name, default_dim=default_dim)
    try:
        imported = import_model(loaded)
    except FuseguardError as err:
        if isinstance(err, UsageError):
            raise
        return BisectResult(model=loaded.name, target=options.gpu_arch or "cpu", status="untestable", error=str(err))
    if imported.prepared:  # provenance tags index the shape-folded graph: bisect that one
        loaded = dataclasses.replace(loaded, model=fold_shape_computations(loaded.model))
    user = load_npz(inputs) if isinstance(inputs, (str, Path)) else (dict(inputs) if inputs is not None else None)
    feed = make_inputs(loaded.model, loaded.input_shapes, seed=seed, user=user)
    bisector = _Bisector(loaded, options, feed, tolerances, Path(out_dir), confirm, strategy)
    return bisector.run()


# ----------------------------------------------------------------------------- CLI


def add_bisect_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`fuseguard bisect MODEL`: the sub-command, on the CLI's sub-parsers."""
    p = subparsers.add_parser(
        "bisect", help="find the fused group (or lowered operator) where the output drifts",
        description="Compile fused and unfused with every kernel output captured (fusion intact), run both and "
                    "ONNX Runtime, and name the first fused group or operator whose output drifts while its "
                    "inputs agree. Writes a reproducer (sub-model + inputs). Exit codes for `git bisect run`: "
                    "0 no drift, 1 drift, 125 cannot be built at this commit, 2 usage error.")
    p.add_argument("model", metavar="MODEL", help="an ONNX file or a built-in suite model name")
    from .options import BISECT_TIMEOUT_S, add_build_options, add_compare_options, add_model_options

    add_build_options(p.add_argument, timeout=BISECT_TIMEOUT_S)
    add_model_options(p.add_argument)
    add_compare_options(p.add_argument)
    p.add_argument("--out", default="fuseguard-bisect", metavar="DIR",
                   help="where the reproducer goes (default ./fuseguard-bisect)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")
    p.add_argument("--html", default=None, metavar="FILE", help="write a self-contained HTML page (the verdict, "
                   "both builds against ONNX Runtime, the drifting group, its ONNX nodes and the reproducer)")
    p.add_argument("--no-confirm", action="store_true", help="do not re-verify the reproducer (saves two builds)")
    p.add_argument("--onnx-order", action="store_true",
                   help="for import/lowering drift, bisect ONNX node order instead of using captured kernels")
    return p


def run_bisect(args: argparse.Namespace) -> int:
    """Run `fuseguard bisect`; returns the exit code (0 no drift, 1 drift, 125 untestable)."""
    from rich.console import Console

    from compiler.onnx_loader import parse_shape_spec
    from compiler.plugins import load_plugins

    from .core import SuiteSpec, dim_overrides, resolve_model_arg
    from .options import compile_options, getter
    from .options import tolerances as tolerances_from

    load_plugins(args.plugin)
    options = compile_options(getter(args))
    tolerances = tolerances_from(args.atol, args.rtol)
    shapes = dict(parse_shape_spec(s) for s in args.shape)
    source: Any = resolve_model_arg(args.model, dims=dim_overrides(args.dim), seed=args.seed)
    if isinstance(source, SuiteSpec) and shapes:
        raise UsageError("--shape needs a MODEL.onnx (a built-in suite model pins its own shapes)")
    # In a worker: a native crash or hang in TVM at this commit is "cannot test" (125), not a dead bisect.
    from compiler.plugins import env_for

    from .worker import Worker, WorkerFailure, WorkerTaskError

    label = source.label if isinstance(source, SuiteSpec) else str(source)
    with Worker(sys_path=[str(Path.cwd())], env=env_for(args.plugin), forward_output=args.debug) as worker:
        try:
            result = worker.call("verify.bisect:bisect_model", what=f"bisecting {label}", timeout=args.timeout,
                                 source=source, shapes=shapes or None, options=options, inputs=args.inputs,
                                 seed=args.seed, tolerances=tolerances, out_dir=args.out,
                                 confirm=not args.no_confirm, default_dim=args.default_dim,
                                 strategy="onnx-order" if args.onnx_order else "capture")
        except (WorkerFailure, WorkerTaskError) as err:
            # A crash, a hang or an exception in the bisection at this commit: "cannot test" (125) for
            # `git bisect run`, never 1 (= "bad").
            if args.debug and getattr(err, "remote_traceback", None):
                print(err.remote_traceback, file=sys.stderr)
            print(f"fuseguard: cannot test: {label}: {str(err).splitlines()[0]}", file=sys.stderr)
            return EXIT_UNTESTABLE
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(result.render())
    if args.json:
        from .atomic import atomic_write_json

        atomic_write_json(args.json, result.to_dict())
    if args.html:
        from .atomic import atomic_write_text
        from .html import render_bisect

        atomic_write_text(args.html, render_bisect(result.to_dict()))
        print(f"wrote {args.html}", file=sys.stderr)
    if result.status == "untestable":
        print(f"fuseguard: cannot test: {result.error}", file=sys.stderr)
    return result.exit_code
