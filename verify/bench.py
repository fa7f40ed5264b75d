"""`fuseguard bench`: TVM fused, TVM unfused, ONNX Runtime (all graph optimisations / none), one run.

A benchmark, not a test: it prints figures and ratios measured in the same process, interleaved
(A B B A ...) so that load from the neighbours of a shared machine hits every contender alike, with
the same thread count everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from compiler.onnx_loader import load
from compiler.pipeline import CompileOptions, compile_model
from compiler.plugins import load_env_plugins

from .inputs import make_inputs
from .timing import measure_interleaved, ort_timing_options


@dataclass
class BenchResult:
    model: str
    threads: int
    tvm_fused_ms: float
    tvm_unfused_ms: float
    ort_ms: float
    ort_noopt_ms: float
    compile_s: float
    unfused_compile_s: float
    fused_iqr_ms: float
    samples: int
    kernels_fused: int
    kernels_unfused: int

    @property
    def fused_vs_ort(self) -> float:
        return self.tvm_fused_ms / self.ort_ms

    @property
    def fusion_gain(self) -> float:
        return self.tvm_unfused_ms / self.tvm_fused_ms

    @property
    def ort_fusion_gain(self) -> float:
        return self.ort_noopt_ms / self.ort_ms

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(fused_vs_ort=self.fused_vs_ort, fusion_gain=self.fusion_gain, ort_fusion_gain=self.ort_fusion_gain)
        return d


def _ort_session(model, threads: int, optimize: bool):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), ort_timing_options(threads, optimize=optimize),
                                providers=["CPUExecutionProvider"])


def bench_model(source: Any, *, shapes: Mapping[str, Sequence[int]] | None = None,
                options: CompileOptions = CompileOptions(), threads: int | None = None, repeats: int = 7,
                warmup: int = 2, seed: int = 0, name: str | None = None) -> BenchResult:
    """Runs inside a worker whose TVM_NUM_THREADS equals `threads` and whose thread pool does not spin
    (timing.NO_SPIN_ENV), both set before TVM's pool starts."""
    from .core import SuiteSpec

    load_env_plugins()
    if isinstance(source, SuiteSpec):
        name = name or source.label
        source = source.build()
    threads = threads or int(os.environ.get("TVM_NUM_THREADS", "0")) or (os.cpu_count() or 1)
    loaded = load(source, shapes, name=name)
    inputs = make_inputs(loaded.model, loaded.input_shapes, seed=seed)
    fused = compile_model(loaded, options=options)
    unfused = compile_model(loaded, options=options.unfused())
    ort_all, ort_none = _ort_session(loaded.model, threads, True), _ort_session(loaded.model, threads, False)
    feed = {i.name: inputs[i.name] for i in ort_all.get_inputs()}
    samples = measure_interleaved({
        "tvm_fused": fused.time_fn(inputs),
        "tvm_unfused": unfused.time_fn(inputs),
        "ort": lambda: ort_all.run(None, feed),
        "ort_noopt": lambda: ort_none.run(None, feed),
    }, warmup=warmup, repeats=repeats, threads=threads)
    med = {k: float(np.median(s.usable_ms)) for k, s in samples.items()}
    return BenchResult(model=loaded.name, threads=threads, tvm_fused_ms=med["tvm_fused"],
                       tvm_unfused_ms=med["tvm_unfused"], ort_ms=med["ort"], ort_noopt_ms=med["ort_noopt"],
                       compile_s=fused.compile_s, unfused_compile_s=unfused.compile_s,
                       fused_iqr_ms=samples["tvm_fused"].iqr_ms, samples=samples["tvm_fused"].n,
                       kernels_fused=fused.report.kernels, kernels_unfused=unfused.report.kernels)


def render(results: Sequence[BenchResult], title: str):
    from rich.table import Table

    table = Table(title=title)
    for col in ("model", "TVM fused ms", "TVM unfused ms", "ORT ms", "ORT no-opt ms", "fused / ORT",
                "unfused / fused", "ORT no-opt / ORT", "compile s", "kernels f/u"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in results:
        table.add_row(r.model, f"{r.tvm_fused_ms:.2f}", f"{r.tvm_unfused_ms:.2f}", f"{r.ort_ms:.2f}",
                      f"{r.ort_noopt_ms:.2f}", f"{r.fused_vs_ort:.2f}x", f"{r.fusion_gain:.2f}x",
                      f"{r.ort_fusion_gain:.2f}x", f"{r.compile_s:.1f}", f"{r.kernels_fused}/{r.kernels_unfused}")
    return table
