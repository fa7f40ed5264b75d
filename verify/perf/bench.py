"""`fuseguard bench`: TVM fused, TVM unfused, ONNX Runtime (all graph optimisations / none).

A benchmark, not a test: it prints figures and ratios, each contender measured interleaved with the others
(A B B A ...) so that load from the neighbours of a shared machine hits every contender alike, with the
same thread count everywhere.

Across processes (`--processes N`, docs/measurement.md): both builds are compiled once and exported
(`export_library`); N fresh timing processes each load them, time all four contenders interleaved and
return their medians. Each ratio is the geometric mean of the per-process ratios with a 95% t-interval
on their logarithms, so the interval includes the between-process variance (per-process speed modes);
with one process it is a bootstrap over that process's rounds and says so.

Thread pools (`--thread-pools`): ``parked`` (default) turns spin-waiting off in both runtimes, so that one's
spinning threads cannot steal the cores of the other's run; every parallel kernel then pays a thread wake-up,
which TVM's 50-60 kernels a convnet feel more than ORT (ResNet-50, SPR: +2.0 ms against +0.6 ms).
``brief`` lets each pool spin ~0.2 ms after a parallel region and then park, with a pause between
contenders: one run's kernels find their workers awake (figures near ``deployed``'s at a sample's cost, but
noisier than parked: docs/measurement.md). ``deployed`` keeps each runtime's default spinning and times each
contender settled (`timing.measure_interleaved(settle=True)`): as a model runs deployed, at a cost of ~0.1 s
a sample.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fuseguard.compiler import progress
from fuseguard.compiler.cache import compile_cached
from fuseguard.compiler.pipeline import CompileOptions

from .timing import DEFAULT_POOLS, SAMPLE_BUDGET_S, SWITCH_PAUSE_S, measure_interleaved, ort_timing_options


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
    processes: int = 1
    thread_pools: str = DEFAULT_POOLS
    #: 95% intervals of fused/ORT and unfused/fused (see the module docstring), and the between-process
    #: spread of the fused build's per-process medians ((max - min) / median; 0 with one process)
    fused_vs_ort_ci: tuple[float, float] | None = None
    fusion_gain_ci: tuple[float, float] | None = None
    between_process_spread: float = 0.0
    per_process_ms: dict[str, list[float]] | None = None
    #: processes left out of the figures: the host slowed them as a whole (`slow_host_processes`)
    set_aside: int = 0
    fused_vs_ort_est: float | None = None
    fusion_gain_est: float | None = None
    #: the half-width the intervals were sampled for (`--halfwidth`), None when the process count was fixed
    halfwidth_target: float | None = None

    @property
    def halfwidth(self) -> float:
        """The wider relative half-width of the two ratio intervals (inf without intervals)."""
        return max(halfwidth(self.fused_vs_ort, self.fused_vs_ort_ci), halfwidth(self.fusion_gain, self.fusion_gain_ci))

    @property
    def resolved(self) -> bool:
        """Both intervals within the half-width asked for (always True when none was asked)."""
        return self.halfwidth_target is None or self.halfwidth <= self.halfwidth_target

    @property
    def fused_vs_ort(self) -> float:
        return self.fused_vs_ort_est if self.fused_vs_ort_est is not None else self.tvm_fused_ms / self.ort_ms

    @property
    def fusion_gain(self) -> float:
        return self.fusion_gain_est if self.fusion_gain_est is not None else self.tvm_unfused_ms / self.tvm_fused_ms

    @property
    def ort_fusion_gain(self) -> float:
        return self.ort_noopt_ms / self.ort_ms

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(fused_vs_ort=self.fused_vs_ort, fusion_gain=self.fusion_gain, ort_fusion_gain=self.ort_fusion_gain)
        return d


def ort_session(model, threads: int, optimize: bool, pools: str = DEFAULT_POOLS):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(),
                                ort_timing_options(threads, optimize=optimize, pools=pools),
                                providers=["CPUExecutionProvider"])


# ----------------------------------------------------------------------------- across processes

def prepare_bench(source: Any, directory: str, *, shapes: Mapping[str, Sequence[int]] | None = None,
                  options: CompileOptions = CompileOptions(), seed: int = 0, name: str | None = None) -> dict:
    """Compile fused and unfused once and export them, with the model and inputs, into `directory`."""
    import json
    from pathlib import Path

    from ..check.model import load_with_inputs

    loaded, inputs = load_with_inputs(source, shapes, name=name, seed=seed)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {"model": loaded.name}
    for label, opts in (("fused", options), ("unfused", options.unfused())):
        with progress.scope(f"compile {label}"):
            compiled = compile_cached(loaded, opts)
        if compiled.library_path:
            shutil.copyfile(compiled.library_path, out / f"{label}.so")
        else:
            compiled.executable.export_library(str(out / f"{label}.so"))
        meta[label] = {"input_names": compiled.input_names, "compile_s": compiled.compile_s,
                       "kernels": compiled.report.kernels}
    (out / "model.onnx").write_bytes(loaded.model.SerializeToString())
    np.savez(out / "inputs.npz", **inputs)
    (out / "meta.json").write_text(json.dumps(meta))
    return meta


def time_prepared(directory: str, *, threads: int, repeats: int = 7, warmup: int = 2,
                  contenders: Sequence[str] = ("tvm_fused", "tvm_unfused", "ort", "ort_noopt"),
                  thread_pools: str = DEFAULT_POOLS,
                  min_sampled_s: float = SAMPLE_BUDGET_S) -> dict[str, list[float]]:
    """In a fresh process: load the exported builds, time the contenders interleaved (at least `repeats`
    rounds and `min_sampled_s` of samples each); usable samples. With ``thread_pools="deployed"`` the process
    must have been started with TVM's spinning on (``timing_env(against_ort=False)``), and the time budget is
    not applied: each sample first waits ~0.1 s for the pools to go idle. Otherwise the process's environment
    must match ``thread_pools`` (``timing_env(pools=...)``)."""
    deployed = thread_pools == "deployed"
    import json
    from pathlib import Path

    import onnx
    import tvm
    from tvm import relax

    d = Path(directory)
    meta = json.loads((d / "meta.json").read_text())
    with np.load(d / "inputs.npz") as z:
        inputs = {k: z[k] for k in z.files}
    fns = {}
    for label in ("fused", "unfused"):
        vm = relax.VirtualMachine(tvm.runtime.load_module(str(d / f"{label}.so")), tvm.cpu())
        args = [tvm.runtime.tensor(np.ascontiguousarray(inputs[n])) for n in meta[label]["input_names"]]
        main = vm["main"]
        fns[f"tvm_{label}"] = (lambda main=main, args=args: main(*args))
    model = onnx.load(str(d / "model.onnx"))
    ort_all = ort_session(model, threads, True, thread_pools)
    ort_none = ort_session(model, threads, False, thread_pools)
    feed = {i.name: inputs[i.name] for i in ort_all.get_inputs()}
    fns["ort"] = lambda: ort_all.run(None, feed)
    fns["ort_noopt"] = lambda: ort_none.run(None, feed)
    samples = measure_interleaved({k: fns[k] for k in contenders}, warmup=warmup, repeats=repeats, threads=threads,
                                  settle=deployed, min_sampled_s=0.0 if deployed else min_sampled_s,
                                  switch_pause_s=SWITCH_PAUSE_S if thread_pools == "brief" else 0.0)
    return {k: [float(v) for v in s.usable_ms] for k, s in samples.items()}


def ratio_interval(per_process: Sequence[float], rounds: tuple[Sequence[float], Sequence[float]] | None = None,
                   confidence: float = 0.95) -> tuple[float, tuple[float, float]]:
    """Estimate and interval of a ratio: geometric mean of per-process ratios with a t-interval on their
    logs (>= 2 processes); with one process, a bootstrap of the ratio of medians over its rounds."""
    from scipy import stats

    r = np.log(np.asarray(per_process, dtype=float))
    if len(r) >= 2:
        mean, sem = float(r.mean()), float(r.std(ddof=1) / np.sqrt(len(r)))
        half = float(stats.t.ppf(0.5 + confidence / 2, len(r) - 1)) * sem
        return float(np.exp(mean)), (float(np.exp(mean - half)), float(np.exp(mean + half)))
    num, den = (np.asarray(x, dtype=float) for x in rounds)  # type: ignore[misc]
    n = min(len(num), len(den))
    rng = np.random.default_rng(0)
    idx = rng.integers(0, n, size=(2000, n))
    boot = np.median(num[:n][idx], axis=1) / np.median(den[:n][idx], axis=1)
    lo, hi = np.percentile(boot, [50 * (1 - confidence), 50 * (1 + confidence)])
    return float(np.exp(r[0])), (float(lo), float(hi))


def halfwidth(estimate: float, interval: tuple[float, float] | None) -> float:
    """Relative half-width of an interval around its estimate: max(hi / est - 1, 1 - lo / est)."""
    if interval is None or not estimate:
        return float("inf")
    lo, hi = interval
    return max(hi / estimate - 1.0, 1.0 - lo / estimate)


#: Fresh processes `bench` adds at most, per model, while an interval is wider than `--halfwidth`: each costs
#: a start (1.3 s: `import tvm` without torch, verify/worker.py), a load and >= 200 ms a contender (2.6 s a
#: process for mlp_gelu, SPR class). 10 had left mlp_gelu (~1.3 ms, 19 MB of weights streamed from L3) at
#: +-2.5-5.2%: its per-process fused/ORT ratios spread 2.6-5% (sd), so a t-interval needs 10-30 of them for
#: +-2% (`fuseguard bench mlp_gelu --processes 30 --halfwidth 0`: 1.9% and 1.6% in two runs; the first 10
#: and 20 of the first run: 1.9% and 2.3%). The models that reach +-2% stop where they do (3-10 processes).
MAX_PROCESSES = 30


def needs_more(result: BenchResult, target: float | None, max_processes: int) -> bool:
    """Sample another fresh process? Only with a target, from two processes on (one gives a bootstrap over
    rounds, which does not see per-process modes), while an interval is wider than the target; processes set
    aside count against `max_processes`."""
    return (target is not None and result.processes >= 2 and result.processes + result.set_aside < max_processes
            and result.halfwidth > target)


#: A timing process whose ONNX Runtime median is at least this many times the median over the model's processes
#: ran on a host that took about a core from it, and is set aside. The reference runtime decides, never the
#: ratios the figures report. Measured (`fuseguard bench` of ten models, SPR class, 2 vCPUs): bert_encoder's
#: processes 6 and 7 of 30 ran ORT 1.8x and TVM 2.3-2.6x their medians (fused/ORT 1.38x and 1.28x against
#: 0.89-1.07x in the 28 others) and widened its interval from +-1.7% to +-3.3%; host drift over a run moved
#: ORT's per-process medians by up to 1.3x (mlp_gelu, 0.90-1.43 ms over 30 processes), which stays in.
SLOW_HOST_FACTOR = 1.5


def slow_host_processes(runs: Sequence[Mapping[str, Sequence[float]]]) -> list[int]:
    """Indices of the processes the host slowed as a whole (:data:`SLOW_HOST_FACTOR`); none below 3 processes,
    where a median cannot tell which one is off."""
    if len(runs) < 3:
        return []
    ort = [float(np.median(run["ort"])) for run in runs]
    mid = float(np.median(ort))
    return [i for i, o in enumerate(ort) if o >= SLOW_HOST_FACTOR * mid]


def aggregate(meta: dict, runs: Sequence[dict[str, list[float]]], threads: int,
              thread_pools: str = DEFAULT_POOLS) -> BenchResult:
    """One BenchResult from the timing processes' samples (module docstring), without the processes the host
    slowed as a whole."""
    slow = set(slow_host_processes(runs))
    runs = [run for i, run in enumerate(runs) if i not in slow]
    med = {k: [float(np.median(run[k])) for run in runs] for k in runs[0]}
    overall = {k: float(np.median(v)) for k, v in med.items()}
    fused_ort = [f / o for f, o in zip(med["tvm_fused"], med["ort"])]
    gain = [u / f for u, f in zip(med["tvm_unfused"], med["tvm_fused"])]
    one = len(runs) == 1
    fo, fo_ci = ratio_interval(fused_ort, (runs[0]["tvm_fused"], runs[0]["ort"]) if one else None)
    fg, fg_ci = ratio_interval(gain, (runs[0]["tvm_unfused"], runs[0]["tvm_fused"]) if one else None)
    fused = med["tvm_fused"]
    spread = (max(fused) - min(fused)) / overall["tvm_fused"] if len(fused) > 1 else 0.0
    q1, q3 = np.percentile(runs[0]["tvm_fused"], [25, 75])
    return BenchResult(model=meta["model"], threads=threads, tvm_fused_ms=overall["tvm_fused"],
                       tvm_unfused_ms=overall["tvm_unfused"], ort_ms=overall["ort"], ort_noopt_ms=overall["ort_noopt"],
                       compile_s=meta["fused"]["compile_s"], unfused_compile_s=meta["unfused"]["compile_s"],
                       fused_iqr_ms=float(q3 - q1), samples=sum(len(r["tvm_fused"]) for r in runs),
                       kernels_fused=meta["fused"]["kernels"], kernels_unfused=meta["unfused"]["kernels"],
                       processes=len(runs), fused_vs_ort_ci=fo_ci, fusion_gain_ci=fg_ci,
                       between_process_spread=float(spread), per_process_ms=med, fused_vs_ort_est=fo,
                       fusion_gain_est=fg, thread_pools=thread_pools, set_aside=len(slow))


def _ci(value: float, ci: tuple[float, float] | None) -> str:
    return f"{value:.2f}x" if ci is None else f"{value:.2f}x [{ci[0]:.2f}, {ci[1]:.2f}]"


def unresolved_note(results: Sequence[BenchResult]) -> str:
    """One line naming the models whose intervals stayed wider than the target, or ''."""
    wide = [f"{r.model} +-{100 * r.halfwidth:.1f}% after {r.processes}" for r in results if not r.resolved]
    if not wide:
        return ""
    target = next(r.halfwidth_target for r in results if not r.resolved)
    return (f"fuseguard bench: intervals wider than +-{100 * target:g}% at the process budget ({'; '.join(wide)}): "
            f"a difference smaller than that is inside this machine's noise here")


def set_aside_note(results: Sequence[BenchResult]) -> str:
    """One line naming the models with processes set aside (:data:`SLOW_HOST_FACTOR`), or ''."""
    slowed = [f"{r.model} {r.set_aside} of {r.processes + r.set_aside}" for r in results if r.set_aside]
    if not slowed:
        return ""
    return (f"fuseguard bench: set aside the processes in which ONNX Runtime ran >= {SLOW_HOST_FACTOR:g}x its median "
            f"over the model's processes, the host having taken about a core ({'; '.join(slowed)})")


def render(results: Sequence[BenchResult], title: str):
    from rich.table import Table

    table = Table(title=title)
    for col in ("model", "TVM fused ms", "TVM unfused ms", "ORT ms", "ORT no-opt ms", "fused / ORT [95% CI]",
                "unfused / fused [95% CI]", "ORT no-opt / ORT", "between-process spread", "compile s", "kernels f/u"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in results:
        table.add_row(r.model, f"{r.tvm_fused_ms:.2f}", f"{r.tvm_unfused_ms:.2f}", f"{r.ort_ms:.2f}",
                      f"{r.ort_noopt_ms:.2f}", _ci(r.fused_vs_ort, r.fused_vs_ort_ci), _ci(r.fusion_gain, r.fusion_gain_ci),
                      f"{r.ort_fusion_gain:.2f}x", f"{100 * r.between_process_spread:.1f}%" if r.processes > 1 else "-",
                      f"{r.compile_s:.1f}", f"{r.kernels_fused}/{r.kernels_unfused}")
    return table
