"""Latency measurement that keeps every sample and survives a noisy, shared machine.

Why keep all samples: the gate's statistical tests need the distribution, and an outlier (a context
switch, a GPU clock change) is information about the run, so outliers are flagged with Tukey fences
and reported but never dropped. Why interleave: on a 2-core CI host a neighbour's build can slow a
whole stretch of the run by 20%; measuring candidate and reference alternately (AB BA AB ...) makes
such drift hit both equally, so the candidate/reference ratio stays honest.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from compiler.errors import UsageError

TUKEY_K = 1.5


@dataclass(frozen=True)
class Samples:
    """Per-call latencies of one function, in run order. ``inner`` calls were timed together per sample."""

    times_ns: tuple[float, ...]
    inner: int = 1
    threads: int | None = None

    @property
    def ms(self) -> np.ndarray:
        return np.asarray(self.times_ns, dtype=float) / 1e6

    @property
    def n(self) -> int:
        return len(self.times_ns)

    @property
    def median_ms(self) -> float:
        return float(np.median(self.ms))

    @property
    def quartiles_ms(self) -> tuple[float, float]:
        q1, q3 = np.percentile(self.ms, [25, 75])
        return float(q1), float(q3)

    @property
    def iqr_ms(self) -> float:
        q1, q3 = self.quartiles_ms
        return q3 - q1

    @property
    def fences_ms(self) -> tuple[float, float]:
        """Tukey fences: beyond them a sample is an outlier (flagged, kept)."""
        q1, q3 = self.quartiles_ms
        return q1 - TUKEY_K * (q3 - q1), q3 + TUKEY_K * (q3 - q1)

    @property
    def outliers(self) -> tuple[int, ...]:
        """Indices (run order) of samples outside the Tukey fences."""
        lo, hi = self.fences_ms
        values = self.ms
        return tuple(int(i) for i in np.flatnonzero((values < lo) | (values > hi)))

    def extend(self, other: Samples) -> Samples:
        """This run followed by ``other`` (adaptive sampling appends rounds)."""
        return Samples(self.times_ns + other.times_ns, inner=max(self.inner, other.inner),
                       threads=self.threads if self.threads is not None else other.threads)

    def summary(self) -> str:
        """One line: median, IQR, n and how many outliers were kept."""
        out = self.outliers
        tail = f", {len(out)} outlier{'s' if len(out) != 1 else ''} kept" if out else ""
        threads = f", {self.threads} threads" if self.threads is not None else ""
        return f"median {self.median_ms:.4g} ms, IQR {self.iqr_ms:.3g} ms, n={self.n}{threads}{tail}"


def _check(warmup: int, repeats: int, min_time_s: float) -> None:
    if warmup < 0 or repeats < 1 or not (math.isfinite(min_time_s) and min_time_s >= 0):
        raise UsageError(f"measure: need warmup >= 0, repeats >= 1, min_time_s >= 0; "
                         f"got {warmup}, {repeats}, {min_time_s}")


def _timed(fn: Callable[[], object], inner: int, sync: Callable[[], object] | None) -> int:
    """Wall time of ``inner`` calls plus one sync, in ns (the sync makes asynchronous GPU launches count)."""
    start = time.perf_counter_ns()
    for _ in range(inner):
        fn()
    if sync is not None:
        sync()
    return time.perf_counter_ns() - start


def _calibrate(fn: Callable[[], object], warmup: int, min_time_s: float, sync: Callable[[], object] | None) -> int:
    """Run the warmup calls and pick how many calls one sample needs to last ``min_time_s``."""
    last = 0
    for _ in range(warmup):
        last = _timed(fn, 1, sync)
    if min_time_s <= 0:
        return 1
    if last == 0:
        last = _timed(fn, 1, sync)
    return max(1, math.ceil(min_time_s * 1e9 / max(last, 1)))


def measure(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 15, min_time_s: float = 1e-3,
            sync: Callable[[], object] | None = None, threads: int | None = None) -> Samples:
    """Time ``fn``: ``warmup`` untimed calls, then ``repeats`` samples of at least ``min_time_s`` each.

    A sample shorter than the timer's useful resolution is dominated by overhead, so sub-millisecond
    functions are called ``inner`` times per sample and the per-call mean recorded. ``threads`` is
    whatever the caller configured (OMP/TVM/ORT thread count); it is recorded, not set. The garbage
    collector is paused while timing so a collection cannot land inside one sample.
    """
    return measure_interleaved({"fn": fn}, warmup=warmup, repeats=repeats, min_time_s=min_time_s, sync=sync,
                               threads=threads)["fn"]


def measure_interleaved(fns: Mapping[str, Callable[[], object]], *, warmup: int = 3, repeats: int = 15,
                        min_time_s: float = 1e-3, sync: Callable[[], object] | None = None,
                        threads: int | None = None) -> dict[str, Samples]:
    """Time several functions alternately, one sample each per round, so drift hits all of them equally.

    Rounds alternate direction (A B, B A, A B, ...): plain ABAB would always run B right after A, so
    any cache or clock state A leaves behind would bias B only.
    """
    _check(warmup, repeats, min_time_s)
    if not fns:
        raise UsageError("measure_interleaved: no functions to measure")
    names = list(fns)
    enabled = gc.isenabled()
    gc.disable()
    try:
        inner = {name: _calibrate(fns[name], warmup, min_time_s, sync) for name in names}
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(repeats):
            for name in names if r % 2 == 0 else reversed(names):
                times[name].append(_timed(fns[name], inner[name], sync) / inner[name])
    finally:
        if enabled:
            gc.enable()
    return {name: Samples(tuple(times[name]), inner=inner[name], threads=threads) for name in names}
