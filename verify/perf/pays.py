"""Does fusion pay? The fused build against the unfused build of the same model, same run, any machine.

No stored baseline is needed, so this gate works on every CPU class CI lands on (the per-architecture
latency baselines go blind on a new class). Both builds are exported once; fresh timing processes each
time them interleaved (verify/perf/bench.py); the ratio fused/unfused is the geometric mean of the per-process
ratios with a 95% t-interval. Verdicts:

* ``slower``: the whole interval lies above `factor` (fused slower than unfused by more than 5%);
* ``pays`` / ``same``: the interval lies below `factor` (fused at least as fast, or within the margin);
* ``inconclusive``: the interval straddles `factor` after `max_processes` processes.

AlexNet's fused build ran 12x slower than its unfused one while every check stayed green; this is the
check that would have said so.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from fuseguard.compiler.paths import PROJECT_ROOT

#: Fused may be at most 5% slower than unfused (the issue's target); the interval must clear it.
PAYS_FACTOR = 1.05


@dataclass
class PaysResult:
    model: str
    verdict: str                      # pays / same / slower / inconclusive
    ratio: float                      # fused / unfused, geometric mean over processes
    ci: tuple[float, float]
    processes: int
    per_process: list[float] = field(default_factory=list)
    factor: float = PAYS_FACTOR

    @property
    def passed(self) -> bool:
        return self.verdict != "slower"

    def __bool__(self) -> bool:
        return self.passed

    def line(self) -> str:
        return (f"{self.model}: {self.verdict}: fused/unfused {self.ratio:.3f}x [{self.ci[0]:.3f}, {self.ci[1]:.3f}] "
                f"over {self.processes} processes (limit {self.factor:.2f}x)")


def decide(ratios: Sequence[float], factor: float = PAYS_FACTOR) -> tuple[str, float, tuple[float, float]]:
    from .bench import ratio_interval

    est, (lo, hi) = ratio_interval(list(ratios))
    if lo > factor:
        return "slower", est, (lo, hi)
    if hi <= factor:
        return ("pays" if hi < 1.0 else "same"), est, (lo, hi)
    return "inconclusive", est, (lo, hi)


def check_fusion_pays(worker: Any, source: Any, *, options: Any, threads: int, env: Mapping[str, str],
                      processes: int = 3, max_processes: int = 8, repeats: int = 9,
                      factor: float = PAYS_FACTOR, timeout: float = 900.0,
                      shapes: Mapping[str, Sequence[int]] | None = None) -> PaysResult:
    """Compile and export in `worker`, then time in fresh processes until the verdict is clear or the budget
    is spent."""
    label = getattr(source, "label", str(source))
    with tempfile.TemporaryDirectory(prefix="fuseguard-pays-") as tmp:
        meta = worker.call("fuseguard.verify.perf.bench:prepare_bench", what=f"compiling {label}", timeout=timeout,
                           source=source, directory=tmp, shapes=shapes, options=options)
        return time_prepared_pays(tmp, meta["model"], threads=threads, env=env, processes=processes,
                                  max_processes=max_processes, repeats=repeats, factor=factor, timeout=timeout)


def time_prepared_pays(directory: str, model: str, *, threads: int, env: Mapping[str, str], processes: int = 3,
                       max_processes: int = 8, repeats: int = 9, factor: float = PAYS_FACTOR,
                       timeout: float = 900.0) -> PaysResult:
    """The verdict on a prepared directory (`bench.prepare_bench`'s layout): fresh timing processes, one
    fused/unfused ratio each, until the interval clears `factor` or `max_processes` are spent."""
    import numpy as np

    from ..worker import Worker

    ratios: list[float] = []
    verdict, est, ci = "inconclusive", float("nan"), (float("nan"), float("nan"))
    while len(ratios) < max_processes:
        with Worker(sys_path=[str(PROJECT_ROOT)], env=dict(env)) as timer:
            run = timer.call("fuseguard.verify.perf.bench:time_prepared", what=f"timing {model}", timeout=timeout,
                             directory=directory, threads=threads, repeats=repeats,
                             contenders=("tvm_fused", "tvm_unfused"))
        ratios.append(float(np.median(run["tvm_fused"]) / np.median(run["tvm_unfused"])))
        if len(ratios) >= max(2, processes):
            verdict, est, ci = decide(ratios, factor)
            if verdict != "inconclusive":
                break
    return PaysResult(model=model, verdict=verdict, ratio=est, ci=ci, processes=len(ratios), per_process=ratios,
                      factor=factor)
