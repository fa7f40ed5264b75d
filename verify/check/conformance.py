"""The ONNX backend node-test suite through fuseguard: every case built fused and unfused, run, and
compared with the suite's expected outputs and with ONNX Runtime.

    fuseguard conformance                       all 1884 cases (~10-20 min on 2 cores)
    fuseguard conformance --ops 'LayerNorm*'    the cases of matching operators
    fuseguard conformance --sample              one case per operator (what the default pytest run keeps)

The cases come from `onnx.backend.test.case.node.collect_testcases()` (models and data in memory, ~5 s;
the wheel no longer ships the files). A case is *right* when every output matches the expected one
(shape and dtype kind exactly; floats within rtol 1e-3 / atol 1e-5 with NaN only where NaN is expected;
integers, bools and strings exactly). Cases refused because an input the suite passes at run time must be
a constant for TVM (axes, scales, pads, k) are retried with every input but the first frozen into the
graph from the case's own data (then every input, when the first is a size or shape: a window's size,
ConstantOfShape's shape), and counted apart ("right frozen").

Each case runs in the worker subprocess, so a crash in TVM is that case's "error (crash)", not the run's.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

RTOL, ATOL = 1e-3, 1e-5
#: Statuses, best first. "refused": fuseguard or TVM rejected the model as given (a constant needed, a
#: zero-size tensor, a non-tensor input); "unsupported": no converter for an operator.
STATUSES = ("right", "right frozen", "wrong", "refused", "unsupported", "error")


@dataclass
class BuildOutcome:
    status: str                  # right / wrong / refused / unsupported / error
    reason: str = ""


@dataclass
class CaseResult:
    name: str
    op: str
    fused: BuildOutcome
    unfused: BuildOutcome
    ort: BuildOutcome
    frozen: bool = False         # the statuses are those of the frozen retry

    @property
    def status(self) -> str:
        """The fused build's status, frozen cases marked."""
        if self.frozen and self.fused.status == "right":
            return "right frozen"
        return self.fused.status

    @property
    def fusion_only_failure(self) -> bool:
        return self.unfused.status == "right" and self.fused.status != "right"

    @property
    def wrong_where_ort_right(self) -> bool:
        return self.ort.status == "right" and self.fused.status == "wrong"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}


@dataclass
class ConformanceReport:
    results: list[CaseResult] = field(default_factory=list)

    def counts(self, side: str = "fused") -> Counter:
        c: Counter = Counter()
        for r in self.results:
            outcome = getattr(r, side)
            c["right frozen" if side != "ort" and r.frozen and outcome.status == "right" else outcome.status] += 1
        return c

    @property
    def right(self) -> int:
        c = self.counts()
        return c["right"] + c["right frozen"]

    def by_op(self) -> dict[str, list[CaseResult]]:
        out: dict[str, list[CaseResult]] = defaultdict(list)
        for r in self.results:
            out[r.op].append(r)
        return dict(sorted(out.items()))

    def __bool__(self) -> bool:
        """Passes when fusion broke nothing and no case is wrong where ONNX Runtime is right."""
        return not any(r.fusion_only_failure or r.wrong_where_ort_right for r in self.results)

    def summary(self) -> str:
        f, u, o = self.counts("fused"), self.counts("unfused"), self.counts("ort")
        line = lambda c: ", ".join(f"{c[s]} {s}" for s in STATUSES if c[s])  # noqa: E731
        return (f"{len(self.results)} cases; fused: {line(f)}; unfused: {line(u)}; ONNX Runtime: {line(o)}; "
                f"fusion-only failures: {sum(r.fusion_only_failure for r in self.results)}; wrong where ONNX "
                f"Runtime is right: {sum(r.wrong_where_ort_right for r in self.results)}")

    def render(self) -> Any:
        from rich.table import Table

        table = Table(title="fuseguard conformance: ONNX node tests (fused build; unfused and ORT where they differ)")
        for col in ("operator", "cases", *STATUSES, "ORT right", "first reason"):
            table.add_column(col, overflow="fold")
        for op, rs in self.by_op().items():
            c = Counter(r.status for r in rs)
            first = next((f"{r.name}: {r.fused.reason}" for r in rs if r.fused.status != "right"), "")
            table.add_row(op, str(len(rs)), *[str(c[s]) if c[s] else "" for s in STATUSES],
                          str(sum(r.ort.status == "right" for r in rs)), first[:140])
        return table

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "fused": dict(self.counts("fused")),
                "unfused": dict(self.counts("unfused")), "ort": dict(self.counts("ort")),
                "cases": [r.to_dict() for r in self.results]}


# ----------------------------------------------------------------------------- the cases

@functools.lru_cache(maxsize=1)
def _cases() -> dict[str, Any]:
    import warnings

    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {c.name: c for c in collect_testcases() if c.kind == "node" and c.model is not None}


@functools.lru_cache(maxsize=1)
def _op_names() -> list[tuple[str, str]]:
    """(snake_case, OpType) for every ONNX operator, longest first (to name a case by its op)."""
    import onnx

    names = {s.name for s in onnx.defs.get_all_schemas()}
    snake = [(re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", n).lower(), n) for n in names]
    return sorted(snake, key=lambda t: -len(t[0]))


def case_op(name: str, model: Any) -> str:
    """The operator a case tests: its single node's type, else the op its name starts with."""
    nodes = [n for n in model.graph.node if n.op_type != "Constant"]
    if len(nodes) == 1:
        return nodes[0].op_type
    stem = name.removeprefix("test_")
    for snake, op in _op_names():
        if stem.startswith(snake):
            return op
    return nodes[0].op_type if nodes else "?"


def case_names(ops: str | None = None, sample: bool = False) -> list[str]:
    """Case names, optionally only those whose operator matches the glob `ops`, or one per operator."""
    names = []
    seen: set[str] = set()
    for name, case in sorted(_cases().items()):
        op = case_op(name, case.model)
        if ops and not any(fnmatch.fnmatch(op, p.strip()) for p in ops.split(",")):
            continue
        if sample:
            if op in seen or name.endswith("_expanded"):
                continue
            seen.add(op)
        names.append(name)
    return names


# ----------------------------------------------------------------------------- comparing

def compare(actual: Sequence[np.ndarray], expected: Sequence[Any]) -> BuildOutcome:
    if len(actual) != len(expected):
        return BuildOutcome("wrong", f"{len(actual)} outputs, expected {len(expected)}")
    for i, (a, e) in enumerate(zip(actual, expected)):
        if not isinstance(e, np.ndarray):
            return BuildOutcome("refused", f"output {i} is a {type(e).__name__}, not a tensor")
        a = np.asarray(a)
        if a.shape != e.shape:
            return BuildOutcome("wrong", f"output {i}: shape {a.shape}, expected {e.shape}")
        kinds = {a.dtype.kind, e.dtype.kind}
        if _is_float(e.dtype) != _is_float(a.dtype) or \
                (not _is_float(e.dtype) and a.dtype.kind != e.dtype.kind and not kinds <= {"i", "u"}):
            return BuildOutcome("wrong", f"output {i}: dtype {a.dtype}, expected {e.dtype}")
        if _is_float(e.dtype):
            a64, e64 = a.astype(np.float64), e.astype(np.float64)
            if not np.array_equal(np.isnan(a64), np.isnan(e64)):
                return BuildOutcome("wrong", f"output {i}: NaN where none is expected (or the reverse)")
            if not np.allclose(a64, e64, rtol=RTOL, atol=ATOL, equal_nan=True):
                err = np.nanmax(np.abs(a64 - e64)) if a64.size else 0.0
                return BuildOutcome("wrong", f"output {i}: max abs error {err:.3g}")
        elif not np.array_equal(a, e):
            return BuildOutcome("wrong", f"output {i}: values differ")
    return BuildOutcome("right")


def _classify(err: BaseException) -> BuildOutcome:
    from fuseguard.compiler.errors import CompileError, FuseguardError, UnsupportedOperatorError

    text = str(err).strip().splitlines()
    line = text[0] if text else type(err).__name__
    if isinstance(err, UnsupportedOperatorError):
        return BuildOutcome("unsupported", line[:300])
    if isinstance(err, CompileError):
        return BuildOutcome("error", f"compile: {line[:300]}")
    if isinstance(err, FuseguardError):
        return BuildOutcome("refused", line[:300])
    return BuildOutcome("error", f"{type(err).__name__}: {line[:300]}")


def _tensors(values: Sequence[Any]) -> list[Any]:
    """numpy scalars (the generator's 0-d values) as 0-d arrays, TensorProtos (dtypes numpy lacks: bfloat16,
    float8, int4, ...) as ml_dtypes arrays; sequences and maps stay what they are."""
    from onnx import TensorProto, numpy_helper

    out = []
    for v in values:
        if isinstance(v, TensorProto):
            v = numpy_helper.to_array(v)
        out.append(np.asarray(v) if isinstance(v, np.generic) else v)
    return out


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind in "fc" or dtype.name.startswith(("bfloat16", "float8", "float4"))


def _freeze(model: Any, inputs: Sequence[Any], keep_first: bool = True) -> tuple[Any, list[Any]]:
    """Every graph input but the first (or every one) becomes an initializer holding the case's own data."""
    import onnx
    from onnx import numpy_helper

    frozen = onnx.ModelProto.FromString(model.SerializeToString())
    graph = frozen.graph
    kept = 1 if keep_first else 0
    keep = list(graph.input[:kept])
    for vi, value in list(zip(graph.input, inputs))[kept:]:
        if not isinstance(value, np.ndarray):
            return model, list(inputs)
        graph.initializer.append(numpy_helper.from_array(value, vi.name))
    del graph.input[:]
    graph.input.extend(keep)
    return frozen, list(inputs[:kept])


def _frozen_variants(model: Any, inputs: Sequence[Any]) -> list[tuple[Any, list[Any]]]:
    """The retries, in order: every input but the first frozen; then every input, when the first is itself
    a size, shape or count (an integer tensor of rank <= 1: ConstantOfShape's shape, a window's size)."""
    variants = []
    if len(model.graph.input) > 1:
        variants.append(_freeze(model, inputs))
    first = inputs[0] if inputs else None
    if isinstance(first, np.ndarray) and first.dtype.kind in "iu" and first.ndim <= 1 and first.size <= 8:
        variants.append(_freeze(model, inputs, keep_first=False))
    return [(m, i) for m, i in variants if m is not model]


def _run_build(model: Any, inputs: Sequence[Any], expected: Sequence[Any], options: Any) -> BuildOutcome:
    from fuseguard.compiler.pipeline import compile_model

    if any(not isinstance(x, np.ndarray) for x in inputs):
        return BuildOutcome("refused", "a sequence, map or optional input (fuseguard takes tensors)")
    names = [vi.name for vi in model.graph.input if vi.name not in {i.name for i in model.graph.initializer}]
    shapes = {n: list(x.shape) for n, x in zip(names, inputs)}
    try:
        compiled = compile_model(model, shapes, options=options, name="case")
    except Exception as err:  # noqa: BLE001 - any failure is this case's outcome
        return _classify(err)
    try:
        outputs = compiled.run(dict(zip(names, inputs)))
    except Exception as err:  # noqa: BLE001
        return BuildOutcome("error", f"run: {type(err).__name__}: {str(err).strip().splitlines()[-1][:300] if str(err).strip() else ''}")
    return compare(outputs, expected)


def _run_ort(model: Any, inputs: Sequence[Any], expected: Sequence[Any]) -> BuildOutcome:
    import onnxruntime as ort

    try:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 4
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        feed = {i.name: x for i, x in zip(session.get_inputs(), inputs)}
        outputs = session.run(None, feed)
    except Exception as err:  # noqa: BLE001
        return BuildOutcome("error", f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}")
    return compare(outputs, expected)


def run_case(name: str, options: Any = None) -> CaseResult:
    """One case fused, unfused and in ONNX Runtime (in the calling process; the CLI calls it in a worker)."""
    from fuseguard.compiler.pipeline import CompileOptions

    options = options or CompileOptions()
    case = _cases()[name]
    inputs, expected = (_tensors(v) for v in case.data_sets[0])
    model = case.model
    ort = _run_ort(model, inputs, expected)
    fused = _run_build(model, inputs, expected, options)
    unfused = _run_build(model, inputs, expected, options.unfused())
    frozen = False
    if fused.status in ("refused", "unsupported", "error"):
        for fmodel, finputs in _frozen_variants(model, inputs):
            f2 = _run_build(fmodel, finputs, expected, options)
            if f2.status == "right":
                fused, unfused, frozen = f2, _run_build(fmodel, finputs, expected, options.unfused()), True
                break
    return CaseResult(name=name, op=case_op(name, model), fused=fused, unfused=unfused, ort=ort, frozen=frozen)


def run_cases(names: Iterable[str], options: Any = None) -> list[CaseResult]:
    return [run_case(n, options) for n in names]


def run_in_worker(names: Sequence[str], *, options: Any = None, timeout: float = 300.0, worker: Any = None,
                  progress: Any = None, batch: int = 16) -> ConformanceReport:
    """Every case in a worker, in batches; a crash or hang fails the case it happened in (re-run alone)."""
    from ..worker import WorkerFailure, WorkerTaskError, get_worker

    worker = worker or get_worker()
    report = ConformanceReport()
    pending = list(names)
    while pending:
        chunk, pending = pending[:batch], pending[batch:]
        try:
            report.results += worker.call("fuseguard.verify.check.conformance:run_cases", what=f"conformance {chunk[0]}..",
                                          timeout=timeout * len(chunk), names=chunk, options=options)
        except (WorkerFailure, WorkerTaskError):
            for name in chunk:          # one at a time, to pin the crash on its case
                try:
                    report.results += worker.call("fuseguard.verify.check.conformance:run_cases", what=f"conformance {name}",
                                                  timeout=timeout, names=[name], options=options)
                except (WorkerFailure, WorkerTaskError) as err:
                    why = f"crash: {str(err).splitlines()[0][:200]}"
                    crashed = BuildOutcome("error", why)
                    report.results.append(CaseResult(name=name, op="?", fused=crashed, unfused=crashed,
                                                     ort=BuildOutcome("error", "not run (worker crashed)")))
        if progress is not None:
            progress(len(report.results))
    return report
