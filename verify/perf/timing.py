"""Latency measurement that keeps every sample and survives a noisy, shared machine.

Why keep all samples: the gate's statistical tests need the distribution, and an outlier (a GPU clock
change, a page fault) is information about the run, so outliers are flagged with Tukey fences and
reported but never dropped. Why interleave: on a 2-core CI host a neighbour's build can slow a whole
stretch of the run; measuring candidate and reference alternately (AB BA AB ...) makes such drift hit
both equally, so the candidate/reference ratio stays honest.

Why count preemptions: on a loaded 2-core host the scheduler takes the CPU away for a whole time
slice (several ms) in the middle of a sample; measured here, 70% of 2.5 ms samples were preempted and
took 2.6-4x as long, which moves the median wherever the load goes and made an unchanged model look
"significantly slower" in almost half the runs. Each sample records the involuntary context switches
(getrusage ru_nivcsw, whole process) it suffered; ``usable_ms`` is the unpreempted samples when there
are enough, and measure() keeps sampling (bounded) until it has ``repeats`` of them. Preempted samples
stay in ``times_ns``; they are set aside, not hidden.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any
from dataclasses import dataclass

import numpy as np

from fuseguard.compiler.errors import UsageError

TUKEY_K = 1.5
MIN_CLEAN = 5
"""Fewest unpreempted samples that are compared on their own; with fewer, all samples are used."""

try:
    import resource

    def _preemptions() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw

except ImportError:  # Windows: no getrusage; samples carry no preemption counts
    _preemptions = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Samples:
    """Per-call latencies of one function, in run order. ``inner`` calls were timed together per sample;
    ``preempted[i]`` is how often the OS preempted the process during sample i (None: not reported)."""

    times_ns: tuple[float, ...]
    inner: int = 1
    threads: int | None = None
    preempted: tuple[int, ...] | None = None

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

    @property
    def n_clean(self) -> int:
        """Samples the OS did not preempt (all of them where it does not report preemptions)."""
        return self.n if self.preempted is None else sum(1 for c in self.preempted if c == 0)

    @property
    def usable_ms(self) -> np.ndarray:
        """What a comparison should use: the unpreempted samples when they are at least MIN_CLEAN and at
        least half of the run, else all samples.

        For a long sample (a 50 ms ResNet-50 run on 2 vCPUs) being preempted is the normal state: the few
        samples that escaped it are the fastest tail, and comparing 5 of those against another run's 7
        called an unchanged model 12% slower in CI. Preemption is then part of the distribution."""
        clean = self.n_clean
        if self.preempted is None or clean == self.n or clean < max(min(MIN_CLEAN, self.n), self.n / 2):
            return self.ms
        return self.ms[np.asarray(self.preempted) == 0]

    def extend(self, other: Samples) -> Samples:
        """This run followed by ``other`` (adaptive sampling appends rounds)."""
        preempted = None if self.preempted is None or other.preempted is None else self.preempted + other.preempted
        return Samples(self.times_ns + other.times_ns, inner=max(self.inner, other.inner),
                       threads=self.threads if self.threads is not None else other.threads, preempted=preempted)

    def summary(self) -> str:
        """One line: median, IQR, n, and how many outliers and preempted samples were kept."""
        out = self.outliers
        tail = f", {len(out)} outlier{'s' if len(out) != 1 else ''} kept" if out else ""
        if self.n_clean < self.n:
            tail += f", {self.n - self.n_clean} preempted"
        threads = f", {self.threads} threads" if self.threads is not None else ""
        return f"median {self.median_ms:.4g} ms, IQR {self.iqr_ms:.3g} ms, n={self.n}{threads}{tail}"


def _check(warmup: int, repeats: int, min_time_s: float, max_rounds: int, min_sampled_s: float = 0.0) -> None:
    if warmup < 0 or repeats < 1 or max_rounds < repeats or not all(
            math.isfinite(v) and v >= 0 for v in (min_time_s, min_sampled_s)):
        raise UsageError(f"measure: need warmup >= 0, repeats >= 1, max_rounds >= repeats, min_time_s >= 0, "
                         f"min_sampled_s >= 0; got {warmup}, {repeats}, {max_rounds}, {min_time_s}, {min_sampled_s}")


def _timed(fn: Callable[[], object], inner: int, sync: Callable[[], object] | None) -> int:
    """Wall time of ``inner`` calls plus one sync, in ns (the sync makes asynchronous GPU launches count)."""
    start = time.perf_counter_ns()
    for _ in range(inner):
        fn()
    if sync is not None:
        sync()
    return time.perf_counter_ns() - start


def _sample(fn: Callable[[], object], inner: int, sync: Callable[[], object] | None) -> tuple[int, int]:
    """One sample: (wall ns, involuntary context switches during it; 0 where not reported)."""
    if _preemptions is None:
        return _timed(fn, inner, sync), 0
    before = _preemptions()
    elapsed = _timed(fn, inner, sync)
    return elapsed, _preemptions() - before


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


def measure(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 15, min_time_s: float = 5e-4,
            sync: Callable[[], object] | None = None, threads: int | None = None,
            max_rounds: int | None = None) -> Samples:
    """Time ``fn``: ``warmup`` untimed calls, then ``repeats`` unpreempted samples of at least ``min_time_s``.

    Preempted samples are kept and sampling continues, up to ``max_rounds`` samples (default 4 x repeats).

    A sample shorter than the timer's useful resolution is dominated by overhead, so sub-millisecond
    functions are called ``inner`` times per sample and the per-call mean recorded. ``threads`` is
    whatever the caller configured (OMP/TVM/ORT thread count); it is recorded, not set. The garbage
    collector is paused while timing so a collection cannot land inside one sample.
    """
    return measure_interleaved({"fn": fn}, warmup=warmup, repeats=repeats, min_time_s=min_time_s, sync=sync,
                               threads=threads, max_rounds=max_rounds)["fn"]


#: Time each contender is sampled for in one timing process at least (rounds beyond `--repeats`): the median
#: of 7 samples carried most of a fast model's interval. `fuseguard bench mlp_gelu shufflenet_v2_x1_0
#: --processes 8 --halfwidth 0`, SPR class: 7 rounds (13 ms of mlp_gelu) gave fused/ORT half-widths of 3-6%,
#: 40 rounds 1.9%; shufflenet 2.6% -> 1.2%, for 2-7 s more timing a model. Ten models, three `bench` runs each
#: way: 21 of 30 model-runs within +-2% against 14 of 30 (docs/measurement.md). Models of >= 30 ms keep --repeats.
SAMPLE_BUDGET_S = 0.2


#: Most rounds a sampling budget (``measure_interleaved(min_sampled_s=...)``) adds: a 0.5 ms sample reaches
#: 0.1 s of samples in 200 rounds.
BUDGET_MAX_ROUNDS = 200


#: Pause before a sample whose contender differs from the previous sample's where pools spin ``brief``ly:
#: five times their spin, so no contender starts beside another's spinning worker.
SWITCH_PAUSE_S = 1e-3


#: Whether `measure_interleaved` calls the contenders from a thread of its own rather than from the process's main
#: thread. Measured (SPR class, 2 vCPUs, `fuseguard bench squeezenet --processes 60 --halfwidth 0`, 60 fresh
#: processes each way): from the main thread 2-3 of 60 processes ran TVM (fused and unfused, not ONNX Runtime)
#: 1.2-1.3x their median, two of its 3x3 convs 3x slower (293 -> 889 us), and the per-process fused/ORT ratios
#: spread 4.8-5.6% (sd); with address-space randomisation off (`setarch -R`) none did and they spread 0.9%;
#: from a thread, randomisation on, none did and they spread 1.1%. A thread's stack starts where mmap put it,
#: page-aligned; the main thread's starts at a random offset within a page, the one placement ASLR randomises
#: below a page. mlp_gelu 3.1% -> 2.0%, ResNet-18 0.9% -> 0.8% (30 processes each way). A deployed runtime is
#: called from a server's worker threads, not its main thread, too.
TIME_ON_OWN_THREAD = True
_timing_thread: Any = None


def on_timing_thread(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)`` called from the process's timing thread (:data:`TIME_ON_OWN_THREAD`): the same thread
    for every call, so TVM's thread pool, one a calling thread, is started once; its errors reach the caller."""
    global _timing_thread
    if not TIME_ON_OWN_THREAD:
        return fn(*args, **kw)
    if _timing_thread is None:
        from concurrent.futures import ThreadPoolExecutor

        _timing_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fuseguard-timing")
    return _timing_thread.submit(fn, *args, **kw).result()


def measure_interleaved(fns: Mapping[str, Callable[[], object]], **kw: Any) -> dict[str, Samples]:
    """Time several functions alternately (`_measure_interleaved`), from the timing thread (`on_timing_thread`)."""
    return on_timing_thread(_measure_interleaved, fns, **kw)


def _measure_interleaved(fns: Mapping[str, Callable[[], object]], *, warmup: int = 3, repeats: int = 15,
                         min_time_s: float = 5e-4, sync: Callable[[], object] | None = None,
                         threads: int | None = None, max_rounds: int | None = None,
                         settle: bool = False, min_sampled_s: float = 0.0,
                         switch_pause_s: float = 0.0) -> dict[str, Samples]:
    """Time several functions alternately, one sample each per round, so drift hits all of them equally.

    Rounds alternate direction (A B, B A, A B, ...): plain ABAB would always run B right after A, so
    any cache or clock state A leaves behind would bias B only. Rounds continue until every function
    has ``repeats`` unpreempted samples or ``max_rounds`` (default 4 x repeats) rounds were run.

    ``min_sampled_s``: rounds also continue (up to ``BUDGET_MAX_ROUNDS``) until every function's samples
    add up to that much time, so a fast model's median rests on as much running as a slow one's
    (:data:`SAMPLE_BUDGET_S` says what that buys).

    ``settle``: before each sample, wait until the process is idle (:func:`wait_until_idle`: the previous
    contender's thread pool has stopped spin-waiting) and make one untimed call, so each contender is timed
    in its own steady state with its runtime's default thread pool, as deployed, and no pool steals from
    another's run (see :data:`NO_SPIN_ENV` for what that theft costs).

    ``switch_pause_s``: a sleep before each sample whose contender differs from the previous one's, so that
    a briefly spinning pool (:data:`BRIEF_SPIN_ENV`) has parked before the next contender starts
    (:data:`SWITCH_PAUSE_S`).
    """
    rounds_cap = 4 * repeats if max_rounds is None else max_rounds
    _check(warmup, repeats, min_time_s, rounds_cap, min_sampled_s)
    budget_cap = max(rounds_cap, BUDGET_MAX_ROUNDS) if min_sampled_s > 0 else 0
    if not fns:
        raise UsageError("measure_interleaved: no functions to measure")
    names = list(fns)
    enabled = gc.isenabled()
    gc.disable()
    try:
        inner = {name: _calibrate(fns[name], warmup, min_time_s, sync) for name in names}
        times: dict[str, list[float]] = {name: [] for name in names}
        switches: dict[str, list[int]] = {name: [] for name in names}
        clean = dict.fromkeys(names, 0)
        spent = dict.fromkeys(names, 0)
        r, previous = 0, None
        while (r < repeats or (r < rounds_cap and min(clean.values()) < repeats)
               or (r < budget_cap and min(spent.values()) < min_sampled_s * 1e9)):
            for name in names if r % 2 == 0 else reversed(names):
                if settle:
                    wait_until_idle()
                    _timed(fns[name], 1, sync)
                elif name != previous and previous is not None and switch_pause_s > 0:
                    time.sleep(switch_pause_s)
                previous = name
                elapsed, preempted = _sample(fns[name], inner[name], sync)
                times[name].append(elapsed / inner[name])
                spent[name] += elapsed
                switches[name].append(preempted)
                clean[name] += preempted == 0
            r += 1
    finally:
        if enabled:
            gc.enable()
    return {name: Samples(tuple(times[name]), inner=inner[name], threads=threads,
                          preempted=None if _preemptions is None else tuple(switches[name]))
            for name in names}


# ------------------------------------------------------------------------------ fair thread pools

#: Both runtimes' thread pools spin-wait after a run by default. Interleaved with each other on a 2-core
#: machine, one's spinning threads steal the cores the other just started on: measured here, TVM's
#: SqueezeNet went from 15.5 ms alone to 50 ms right after an ONNX Runtime run, and with both pools set
#: not to spin each took its alone time again (15.6 ms, ORT 4.3 ms). Set before TVM's runtime starts its
#: pool (worker environment). ``parked`` turns spinning off on both sides: `fuseguard bench` by default, the
#: gate, the stored baselines and pytest's timings run so.
NO_SPIN_ENV = {"TVM_THREAD_POOL_SPIN_COUNT": "0"}

#: ``brief`` (`fuseguard bench --thread-pools brief`): each pool spin-waits up to ~0.2 ms after a parallel
#: region, then parks. Inside one run the next kernel finds the worker still awake; between contenders
#: (`SWITCH_PAUSE_S` apart) every pool has parked. Parked, each of TVM's kernels paid a wake-up of its worker that ORT's
#: dynamically shared loops partly hide (ResNet-50, SPR class: +2.0 ms against +0.6 ms for ORT over their
#: default spinning). TVM counts spins in sched_yield calls: after an idle gap of G us a parallel call took
#: 4 us while G was under the spin and 35-60 us once the worker had parked; 100 spins parked it after 60-100
#: us, 1000 after 100-200 us (SPR class, 2 vCPUs). In ResNet-50 100 spins were too few (fused 34.7 ms against
#: 35.9 parked and 33.5 with 1000; 3000 spins 33.6): a worker that finishes its static share early must
#: outlast the main thread's share too. ORT spins by time (`spin_duration_us`). Not the default: over ten
#: models and two `bench` runs each way, 10 of 20 model-runs reached +-2% against 16 of 20 parked, at 1.3-1.7x
#: the timing cost, and ORT gained more from it than TVM (geomean fused/ORT 1.031x against 1.002x parked;
#: docs/measurement.md, "Brief spinning").
BRIEF_TVM_SPIN_COUNT = 1000
BRIEF_ORT_SPIN_US = 200
BRIEF_SPIN_ENV = {"TVM_THREAD_POOL_SPIN_COUNT": str(BRIEF_TVM_SPIN_COUNT)}

#: How `fuseguard bench` runs the runtimes' thread pools (verify/perf/bench.py's docstring); the first is its default.
THREAD_POOLS = ("parked", "brief", "deployed")
DEFAULT_POOLS = THREAD_POOLS[0]

#: How long an idle process must use no CPU to count as settled, and the most one wait may take. After a run
#: TVM's pool spin-waits ~45 ms and ORT's ~25 ms (ResNet-50, SPR class, `time.process_time` sampled every
#: 5 ms); interleaved with default spinning and no wait, TVM read 46.7 ms against 24.2 ms alone, with a fixed
#: 20 ms pause ORT read 32.0 against 22.6; settled, 24.6 and 23.3.
IDLE_WINDOW_S = 0.005
IDLE_CAP_S = 1.0


def wait_until_idle(window_s: float = IDLE_WINDOW_S, cap_s: float = IDLE_CAP_S) -> float | None:
    """Sleep until a ``window_s`` passes with this process (all its threads) using under a tenth of it in
    CPU time: spinning thread pools have parked. Seconds waited, or None if ``cap_s`` passed first."""
    start = time.perf_counter()
    while time.perf_counter() - start < cap_s:
        cpu = time.process_time()
        time.sleep(window_s)
        if time.process_time() - cpu < 0.1 * window_s:
            return time.perf_counter() - start
    return None


def _check_pools(pools: str) -> None:
    if pools not in THREAD_POOLS:
        raise UsageError(f"thread pools: {pools!r} is not one of {', '.join(THREAD_POOLS)}")


def timing_env(threads: int | None = None, *, against_ort: bool = True, pools: str = "parked") -> dict[str, str]:
    """Environment for a timing worker: TVM's pool pinned to the same thread count ORT gets (TVM's default
    counts physical cores, which halves it on SMT hosts), and where ORT is timed beside TVM, the pool mode
    ``pools`` (:data:`THREAD_POOLS`: no spinning when ``parked``, a short spin when ``brief``, TVM's own when
    ``deployed``). The worker starts tvm without torch (``FUSEGUARD_WORKER_NO_TORCH``: a fresh process
    starts in 1.3 s, not 3.4 s, where torch is installed; a plugin may still import it).

    Where only TVM builds are timed (``against_ort=False``: the per-kernel profile, `tune`, fused vs
    unfused) the pool keeps TVM's default spinning, as a deployed model runs: one pool cannot steal from
    itself, and without spinning every parallel kernel pays a thread wake-up that serial kernels do not.
    Measured on Zen3 (2 vCPUs, `fuseguard profile bert_tiny`): with spinning off its attention kernel read
    91 us against 53 us for its (mostly serial) unfused parts, with TVM's default 34 us against 49 us; the
    whole fused model 1331 vs 766 us. Profiled without spinning, `tune` would have split attention back
    while the whole model ran 4.5% faster with it (interleaved in one process, 3 runs)."""
    _check_pools(pools)
    if threads is None:
        from fuseguard.compiler.hw.hostcpu import usable_cores

        threads = usable_cores()
    spin = {"brief": BRIEF_SPIN_ENV, "parked": NO_SPIN_ENV, "deployed": {}}[pools] if against_ort else {}
    from ..worker import NO_TORCH

    return {**spin, "TVM_NUM_THREADS": str(threads), NO_TORCH: "1"}


def ort_timing_options(threads: int, *, optimize: bool = True, pools: str = "parked"):
    """ONNX Runtime session options for a fair timing: fixed threads, quiet log, and the pool mode ``pools``
    (:data:`THREAD_POOLS`): none (``parked``), a spin of `BRIEF_ORT_SPIN_US` after a parallel region
    (``brief``) or ORT's default (``deployed``, timed settled)."""
    import onnxruntime as ort

    _check_pools(pools)
    options = ort.SessionOptions()
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if pools == "parked":
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    elif pools == "brief":
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        options.add_session_config_entry("session.intra_op.spin_duration_us", str(BRIEF_ORT_SPIN_US))
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.log_severity_level = 3
    return options


# ------------------------------------------------------------------------------ a busy host

def _clock_ticks() -> float:
    """USER_HZ: the unit of /proc/stat's counters."""
    return float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


def _cpu_jiffies() -> tuple[float, float] | None:
    """(busy seconds, steal seconds) of the whole machine from /proc/stat; None where it is unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = _clock_ticks()
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0.0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / hz, steal / hz


class ForeignLoad:
    """How much of the machine other processes (and the hypervisor) used while we measured.

    Two thread pools that synchronise at every parallel region (TVM's and ONNX Runtime's) do not slow
    down alike when a neighbour takes a core, so a same-run reference cannot cancel that noise. Measured
    here: a neighbour's build made an unchanged model look 1.2-2.3x slower against its ORT reference.
    The gate asks this to refuse a "slower" verdict on a busy host.
    """

    def __enter__(self) -> "ForeignLoad":
        import resource

        self._start = (time.perf_counter(), _cpu_jiffies(), resource.getrusage(resource.RUSAGE_SELF))
        self.fraction: float | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        import resource

        t0, j0, r0 = self._start
        wall, j1, r1 = time.perf_counter() - t0, _cpu_jiffies(), resource.getrusage(resource.RUSAGE_SELF)
        if j0 is None or j1 is None or wall <= 0:
            return
        ours = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        cpus = os.cpu_count() or 1
        # /proc/stat counts clock ticks (USER_HZ, 100 a second) per CPU, while getrusage is exact: each CPU's
        # count can be a tick off at each end of the window, so only time beyond that is someone else's.
        # Without this, a quiet machine read 11-24% "other processes" over the 65 ms measurement of a
        # 1.9 ms model (15 rounds of 2 contenders; SPR class, 2 vCPUs: one tick is 7.7% of that window) and
        # the busy-host rule turned 11 of 25 real +10% slowdowns into "inconclusive".
        others = max(0.0, (j1[0] - j0[0]) - ours - 2 * cpus / _clock_ticks())
        self.fraction = min(1.0, others / (wall * cpus))
