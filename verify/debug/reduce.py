"""`fuseguard reduce MODEL`: shrink a model whose build fails to the fewest ONNX nodes that fail the same way.

A failure you can hand over (to TVM, or to whoever owns the fusion rule) is a small model, not a 400-node
export. Polygraphy's `debug reduce` and PyTorch's minifier are the anchors; the traps their users report are a
reproducer that does not reproduce, and a *different* failure minimised instead of the original. So:

- every candidate is built in the worker subprocess (a native crash or hang fails that candidate, not the run),
  fused and unfused as the original failed, and counts only when it fails with the original's **signature**
  (`Signature`: error or crash, the exception class, the message with names and numbers blanked);
- the search cuts the graph where ONNX Runtime's exporter users would (a prefix: later nodes dropped, the last
  kept tensors made outputs; a suffix: earlier nodes dropped, their tensors made inputs with the shapes shape
  inference gives them), then drops single nodes one at a time (delta debugging's last, 1-minimal step);
- the written model is built once more at the end, from the file, and must fail the same way (`confirmed`).

Scope: build failures (import, fusion, scheduling, code generation) and crashes while building. Outputs that
drift are `fuseguard bisect`'s job.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx

#: Where a check ran out of time: a hang is a failure of its own kind (signature "timeout").
DEFAULT_CHECK_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Signature:
    """What a failure is, without what it is about: two builds fail "the same way" when these are equal."""

    kind: str      # "error" (an exception in the build) or "crash" (the worker died or hung)
    type: str      # exception class, or the signal / "timeout"
    message: str   # the first line, the model's name and every number and quoted name blanked
    config: str    # which build failed first: "fused" or "unfused"

    def line(self) -> str:
        return f"{self.kind} in the {self.config} build: {self.type}: {self.message}"


def signature_of(kind: str, type_name: str, message: str, config: str, model_name: str) -> Signature:
    first = message.strip().splitlines()[0] if message.strip() else ""
    first = first.replace(model_name, "MODEL")
    first = re.sub(r"'[^']*'|\"[^\"]*\"", "'_'", first)          # node and tensor names
    first = re.sub(r"\b[\w./-]*\.onnx\b", "MODEL", first)
    first = re.sub(r"\d+", "#", first)
    return Signature(kind, type_name, first[:160], config)


def check_build(path: str, shapes: Mapping[str, Sequence[int]] | None, options: Any, fused_only: bool) -> dict | None:
    """Worker task: build `path` fused (then unfused unless `fused_only`); the first failure as a dict, or None."""
    from fuseguard.compiler.pipeline import compile_model
    from fuseguard.compiler.plugins import load_env_plugins

    load_env_plugins()
    configs = [("fused", options)] + ([] if fused_only or not options.fusion else [("unfused", options.unfused())])
    for config, opts in configs:
        try:
            compile_model(path, shapes, opts, name="reduce_candidate")
        except Exception as err:  # noqa: BLE001 - any build failure is the data this task reports
            return {"kind": "error", "type": type(err).__name__, "message": str(err), "config": config}
    return None


# ----------------------------------------------------------------------------- cutting a graph


@dataclass
class Graph:
    """The original model, shape-inferred once, from which every candidate is cut."""

    model: onnx.ModelProto
    types: dict[str, onnx.TypeProto] = field(default_factory=dict)

    @classmethod
    def of(cls, model: onnx.ModelProto) -> Graph:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
        g = inferred.graph
        types = {v.name: v.type for v in [*g.input, *g.value_info, *g.output]}
        return cls(inferred, types)

    @property
    def nodes(self) -> list[onnx.NodeProto]:
        return list(self.model.graph.node)

    def cut(self, keep: Sequence[int]) -> onnx.ModelProto | None:
        """The nodes at `keep` as a model of their own, or None when a boundary tensor has no known type."""
        g = self.model.graph
        nodes = [g.node[i] for i in sorted(keep)]
        produced = {o for n in nodes for o in n.output if o}
        consumed = [i for n in nodes for i in n.input if i]
        inits = {t.name: t for t in g.initializer}
        originals = {o.name for o in g.output}
        new_inputs: list[str] = []
        for name in consumed:
            if name not in produced and name not in inits and name not in new_inputs:
                new_inputs.append(name)
        consumed_set = set(consumed)
        outputs = [o for n in nodes for o in n.output if o and (o not in consumed_set or o in originals)]
        if not outputs:
            return None
        if any(not self._typed(t) for t in [*new_inputs, *outputs]):
            return None
        graph = onnx.helper.make_graph(
            nodes, f"{g.name or 'graph'}_reduced",
            [onnx.helper.make_value_info(t, self.types[t]) for t in new_inputs],
            [onnx.helper.make_value_info(t, self.types[t]) for t in outputs],
            [inits[t] for t in dict.fromkeys(consumed) if t in inits])
        model = onnx.helper.make_model(graph, opset_imports=list(self.model.opset_import),
                                       ir_version=self.model.ir_version)
        model.functions.extend(self.model.functions)
        return model

    def _typed(self, name: str) -> bool:
        t = self.types.get(name)
        return t is not None and t.HasField("tensor_type") and t.tensor_type.elem_type != 0 and \
            t.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in t.tensor_type.shape.dim)


# ----------------------------------------------------------------------------- the search


@dataclass
class ReduceResult:
    model: str
    original_nodes: int
    signature: Signature | None
    kept: list[str] = field(default_factory=list)        # node names of the reduced model
    ops: list[str] = field(default_factory=list)
    checks: int = 0
    path: str | None = None
    confirmed: bool = False

    def __bool__(self) -> bool:
        return self.signature is not None and self.confirmed

    def line(self) -> str:
        if self.signature is None:
            return f"{self.model}: builds fused and unfused: nothing to reduce"
        where = f" -> {self.path}" if self.path else ""
        sure = "reproduces" if self.confirmed else "DID NOT REPRODUCE from the written file"
        return (f"{self.model}: {self.original_nodes} -> {len(self.kept)} node(s) ({', '.join(self.ops[:8])}"
                f"{' ...' if len(self.ops) > 8 else ''}) still fail: {self.signature.line()} [{self.checks} "
                f"builds; {sure}]{where}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["signature"] = asdict(self.signature) if self.signature else None
        return d


Check = Callable[[onnx.ModelProto], "Signature | None"]


def reduce_nodes(graph: Graph, target: Signature, fails: Check, *, progress: Callable[[str], None] = print,
                 ) -> tuple[list[int], int]:
    """Indices of a 1-minimal node set failing with `target`, and the number of builds it took."""
    n = len(graph.nodes)
    checks = 0
    memo: dict[tuple[int, ...], bool] = {}

    def same(keep: Sequence[int]) -> bool:
        nonlocal checks
        key = tuple(sorted(keep))
        if key not in memo:
            model = graph.cut(key)
            if model is None:
                memo[key] = False
            else:
                checks += 1
                memo[key] = fails(model) == target
        return memo[key]

    # A prefix: the smallest k with nodes[:k] failing (the failing node is the last one kept).
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        if same(range(mid)):
            hi = mid
        else:
            lo = mid + 1
    end = lo
    progress(f"prefix: {end} of {n} nodes")
    # A suffix of that prefix: the largest start still failing.
    lo, hi = 0, end - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if same(range(mid, end)):
            lo = mid
        else:
            hi = mid - 1
    keep = list(range(lo, end))
    progress(f"window: nodes {lo}..{end - 1} ({len(keep)})")
    # 1-minimal: no single node can go.
    changed = True
    while changed and len(keep) > 1:
        changed = False
        for i in reversed(list(keep)):
            trial = [k for k in keep if k != i]
            if trial and same(trial):
                keep = trial
                changed = True
    progress(f"1-minimal: {len(keep)} node(s)")
    return keep, checks


def reduce_model(source: Any, worker: Any, *, options: Any, shapes: Mapping[str, Sequence[int]] | None = None,
                 fused_only: bool = False, out_dir: str | Path = "reduced", timeout: float = DEFAULT_CHECK_TIMEOUT_S,
                 progress: Callable[[str], None] = print) -> ReduceResult:
    """Find the original failure, shrink the model keeping it, write `out_dir/reduced.onnx` and confirm it."""
    from fuseguard.compiler.frontend.loader import load

    from ..check.model import SuiteSpec

    if isinstance(source, SuiteSpec):
        loaded = load(source.build(), None, name=source.label)
    else:
        loaded = load(source, shapes)
    with tempfile.TemporaryDirectory(prefix="fuseguard-reduce-") as tmp:
        return _reduce(loaded, Path(tmp), worker, options=options, fused_only=fused_only,
                       out_dir=Path(out_dir), timeout=timeout, progress=progress)


def _reduce(loaded: Any, work: Path, worker: Any, *, options: Any, fused_only: bool, out_dir: Path,
            timeout: float, progress: Callable[[str], None]) -> ReduceResult:
    from ..atomic import atomic_write_json
    from ..worker import WorkerFailure, WorkerTaskError

    label = loaded.name
    pinned = loaded.model   # input shapes pinned by the loader

    def run(path: Path) -> Signature | None:
        try:
            got = worker.call("fuseguard.verify.debug.reduce:check_build", what=f"building a candidate of {label}", timeout=timeout,
                              path=str(path), shapes=None, options=options, fused_only=fused_only)
        except WorkerFailure as err:
            text = str(err)
            signal = re.search(r"SIG[A-Z]+", text)
            how = "timeout" if "timed out" in text else signal.group(0) if signal else "crash"
            return signature_of("crash", how, "", "fused", label)
        except WorkerTaskError as err:
            return signature_of("error", err.type_name, err.message, "fused", label)
        if got is None:
            return None
        return signature_of(got["kind"], got["type"], got["message"], got["config"], "reduce_candidate")

    counter = [0]

    def fails(model: onnx.ModelProto) -> Signature | None:
        counter[0] += 1
        path = work / f"candidate{counter[0]}.onnx"
        onnx.save(model, str(path))
        return run(path)

    original = work / "original.onnx"
    onnx.save(pinned, str(original))
    target = run(original)
    result = ReduceResult(model=label, original_nodes=len(pinned.graph.node), signature=target, checks=1)
    if target is None:
        return result
    progress(f"{label}: {target.line()}")
    graph = Graph.of(pinned)
    keep, checks = reduce_nodes(graph, target, fails, progress=lambda m: progress(f"{label}: {m}"))
    result.checks += checks
    reduced = graph.cut(keep)
    if reduced is None:   # cannot happen for a set that was checked, but never write a model we did not build
        return result
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "reduced.onnx"
    onnx.save(reduced, str(path))
    result.kept = [graph.nodes[i].name for i in keep]
    result.ops = [graph.nodes[i].op_type for i in keep]
    result.path = str(path)
    result.confirmed = run(path) == target
    result.checks += 1
    atomic_write_json(out_dir / "reduce.json", result.to_dict())
    return result
