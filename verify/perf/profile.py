"""Per-group profile: every kernel of the fused and of the unfused build timed on the same inputs.

`fuseguard profile MODEL` prints, per fused kernel: its time, the summed time of the unfused kernels that
compute the same ONNX nodes, bytes at its boundary, GFLOP/s and its share of what numpy's BLAS sgemm
reaches in the same run (the stand-in for the machine's peak: TVM's packed matmul can pass it, as
OpenBLAS on Zen4 does not reach the FMA peak), and the fusion decision's reason. It is the measurement behind the
cost model's claims: a fused group slower than its parts shows up here as a speedup below 1.

Timing: the VM's instrument hook records `perf_counter` around every call (TVM 0.27's VM has no
profiler); kernel calls are tied to the build's call sites by execution order (`FusionReport.call_sites`).
The hook's own cost, measured on the VM's trivial builtin calls in the same run, is subtracted, and the VM's
own cost of a kernel call, which neither reading sees, is added to every call (`measure_call_us`). The reading
resolves about a microsecond: the hook's cost grows with the call's argument count, so one constant does
not fit every kernel. A group whose kernels' summed hook error (`HOOK_ERROR_US` a call) exceeds
`RESOLUTION` of its time is therefore timed by replay instead, fused kernel and parts alike: each kernel run
alone on its own arguments, in TVM's C++ timing loop (`time_evaluator`), at the point of the model run where
it is called. Only `call_tir` sites are replayed (a kernel that updates its input in place would change it
on every loop; fuseguard's pipeline makes none).

A group is also replayed where the two builds' memory plans, not the fusion, set its in-model time: where the
fused kernel and its parts write (or read) different amounts of memory whose last touch lies further back than
the cores' L2s hold (`trace_cold_bytes`: pages first touched in this run, or touched last before more distinct
bytes than those caches hold). Such a write pays a read for ownership from memory in whichever kernel the plan
gives that storage; splitting the group back moves it, it does not remove it (MobileNet-V2, SPR class: two
depthwise groups read 40 and 15 us slower than their parts with 1.6-1.8 MB more cold output, and 70-105 us
faster where the parts had it; replayed, 31-45 us faster, against 48-54 predicted, and `regret.py --confirm`
finds the whole model no faster split).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

_log = logging.getLogger(__name__)

#: Calibration: an n x n x n float32 matmul through numpy's BLAS, the best this CPU does on the same
#: threads; 1024 takes ~20-40 ms on 2 Zen4 cores, long enough to time and short enough to repeat.
PEAK_SGEMM_N = 1024
#: The hook's error on one kernel call, and the share of a group's time that error may take before the group is
#: timed by replay. Measured on vit_tiny (SPR class, 2 threads): the hook read an Add + LayerNorm kernel 1.12 us
#: fused against 0.09 us for its two parts (12x), replay 0.64 against 0.79 us; the error is ~0.5-1 us a call.
#: Per group, not per kernel: a 20 us cutoff on any kernel replayed ResNet-18's 800 us convs for their small
#: parts, and replay reads such a conv with its weights hot.
HOOK_ERROR_US = 1.0
RESOLUTION = 0.05
#: Replay: each repeat loops the kernel for at least this long; the median of the repeats is taken.
REPLAY_MIN_MS = 1
#: ... and for at least this many calls at the kernel's model-run time: a repeat of 1 ms held one or two calls
#: of ResNet-18's ~750 us convs, so its median was of single calls. (The two sides of a group are still timed
#: apart, not paired by round: see `PLAN_BOUND_SHARE`.)
REPLAY_MIN_CALLS = 20
REPLAY_REPEATS = 5
#: Memory a trace counts in: a page is cold when more distinct bytes than the cores' L2s hold were touched since
#: its last touch. Pages, not tensors: a memory plan's tensors share storages at different offsets.
TRACE_PAGE = 4096
#: The VM's own cost of one kernel call (dispatch, its output's allocation, the packed call), which neither the
#: hook (its subtracted cost includes a call) nor replay (a C++ loop) sees, and which a fused group saves once
#: for every kernel it removes: measured in each profile run as a chain of this many trivial kernels against
#: one (0.21-0.24 us a call, SPR class; ViT-tiny's unfused build makes ~100 more calls than its fused one).
CALL_CHAIN = 64


@dataclass
class SiteTime:
    kernel: str
    pattern: str
    nodes: list[str]
    us: float
    bytes: int
    flops: int
    reason: str = ""
    key: str = ""
    predicted_us: float = 0.0
    replay_us: float | None = None      # the kernel alone on its own arguments, looped (None: not replayed)
    #: bytes of its arguments a model run finds out of the cores' L2s at this call (`trace_cold_bytes`; for an
    #: unfused kernel, of those crossing its group's boundary, `boundary_cold`)
    cold_bytes: int = 0
    #: per timed round, hook cost subtracted (rounds of the fused and unfused builds alternate, so round i of
    #: one build pairs with round i of the other)
    samples: list[float] = field(default_factory=list)


@dataclass
class GroupProfile:
    """One fused kernel against the unfused kernels computing the same ONNX nodes."""

    kernel: str
    pattern: str
    nodes: list[str]
    fused_us: float
    parts_us: float
    parts: int
    bytes: int
    flops: int
    reason: str
    key: str = ""
    predicted_us: float = 0.0        # the cost model's predicted saving for this group
    timing: str = "model run"        # how fused_us and parts_us were read: "model run" or "replay"
    #: 95% interval of the saving (parts - fused), from the paired rounds of a model-run reading (None: replayed,
    #: or no rounds)
    saving_ci: tuple[float, float] | None = None
    #: the saving (parts - fused) in each paired round of a model-run reading, the calls included (empty: replayed)
    rounds: list[float] = field(default_factory=list)
    #: bytes out of the cores' L2s at the fused kernel's call and, summed, at its parts' (`trace_cold_bytes`)
    cold_fused: int = 0
    cold_parts: int = 0
    #: whether those differ by enough to set its in-model reading (`plan_bound`): then it was read from replays
    plan_bound: bool = False

    @property
    def saving_us(self) -> float:
        """Measured saving: unfused parts minus fused (negative: fusing lost time)."""
        return self.parts_us - self.fused_us

    @property
    def speedup(self) -> float:
        return self.parts_us / self.fused_us if self.fused_us > 0 else float("nan")

    def gflops(self) -> float:
        return self.flops / (self.fused_us * 1e3) if self.fused_us > 0 else 0.0


@dataclass
class ProfileResult:
    model: str
    cpu: str
    threads: int
    repeats: int
    peak_gflops: float
    overhead_us: float
    fused: list[SiteTime] = field(default_factory=list)
    unfused: list[SiteTime] = field(default_factory=list)
    groups: list[GroupProfile] = field(default_factory=list)

    #: the VM's cost of one kernel call, measured in this run (:func:`measure_call_us`): part of every call's
    #: time in the groups and the totals
    call_us: float = 0.0

    @property
    def fused_total_us(self) -> float:
        return sum(s.us for s in self.fused) + self.call_us * sum(map(is_call, self.fused))

    @property
    def unfused_total_us(self) -> float:
        return sum(s.us for s in self.unfused) + self.call_us * sum(map(is_call, self.unfused))

    def slower_groups(self, margin: float = 0.05) -> list[GroupProfile]:
        """Fused kernels slower than their parts by more than `margin`."""
        return [g for g in self.groups if g.parts and g.fused_us > g.parts_us * (1 + margin)]

    def sure_losses(self) -> list[GroupProfile]:
        """Groups slower than their parts beyond noise: the saving's interval over the paired rounds lies below
        0, or (replayed, no rounds) the fused kernel is slower by more than RESOLUTION."""
        return [g for g in self.groups if g.parts and g.saving_us < 0
                and (g.saving_ci[1] < 0 if g.saving_ci is not None else g.fused_us > g.parts_us * (1 + RESOLUTION))]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fused_total_us"], d["unfused_total_us"] = self.fused_total_us, self.unfused_total_us
        for g, out in zip(self.groups, d["groups"]):
            # A group with no unfused parts has no ratio: null, not NaN (which is not JSON).
            out["speedup"], out["gflops"] = (g.speedup if math.isfinite(g.speedup) else None), g.gflops()
        return d

    def render(self, *, max_rows: int = 60) -> Any:
        from rich.table import Table

        table = Table(title=f"fuseguard profile: {self.model} ({self.cpu}, {self.threads} threads, median of "
                            f"{self.repeats}; numpy BLAS sgemm {self.peak_gflops:.0f} GFLOP/s in this run; hook "
                            f"{self.overhead_us:.1f} us/call subtracted, the VM's {self.call_us:.2f} us a call "
                            f"added; r: replayed, the group's kernels looped alone; c: replayed, the two memory "
                            f"plans leaving different amounts of its memory cold)")
        for col, justify in (("kernel", "left"), ("pattern", "left"), ("ONNX nodes", "left"),
                             ("fused us", "right"), ("unfused parts us", "right"), ("parts / fused", "right"),
                             ("MB moved", "right"), ("GFLOP/s", "right"), ("% of sgemm", "right"), ("why", "left")):
            table.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
        ranked = sorted(self.groups, key=lambda g: -g.fused_us)
        for g in ranked[:max_rows]:
            nodes = ", ".join(g.nodes[:3]) + (f" (+{len(g.nodes) - 3})" if len(g.nodes) > 3 else "")
            gf = g.gflops()
            ratio = f"{g.speedup:.2f}x" if g.parts else "-"
            if g.parts and g.speedup < 0.95:
                ratio = f"[red]{ratio}[/]"
            mark = (" c" if g.plan_bound else " r") if g.timing == "replay" else ""
            table.add_row(g.kernel[:48], g.pattern, nodes, f"{g.fused_us:.1f}{mark}",
                          f"{g.parts_us:.1f}{mark}" if g.parts else "-", ratio, f"{g.bytes / 1e6:.2f}",
                          f"{gf:.1f}" if g.flops else "-",
                          f"{100 * gf / self.peak_gflops:.0f}%" if g.flops and self.peak_gflops else "-",
                          g.reason[:90])
        table.add_row("total", "", f"{len(self.fused)} fused / {len(self.unfused)} unfused kernels",
                      f"{self.fused_total_us:.1f}", f"{self.unfused_total_us:.1f}",
                      f"{self.unfused_total_us / self.fused_total_us:.2f}x" if self.fused_total_us else "-",
                      "", "", "", "")
        return table


def measure_peak_gflops(threads: int, n: int = PEAK_SGEMM_N, repeats: int = 5) -> float:
    """Best GFLOP/s of a float32 BLAS matmul (numpy) on this machine now: the "peak" a kernel is shared of."""
    try:
        from threadpoolctl import threadpool_limits  # type: ignore[import-not-found]
    except ImportError:                              # numpy's BLAS then uses its own default pool
        threadpool_limits = None
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)

    def run() -> float:
        best = float("inf")
        a @ b
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        return 2 * n ** 3 / best / 1e9

    if threadpool_limits is not None:
        with threadpool_limits(limits=threads):
            return run()
    return run()


def measure_call_us(calls: int = CALL_CHAIN, repeats: int = 7) -> float:
    """Microseconds the VM spends on one kernel call beyond the kernel: a chain of `calls` negations of 8
    floats against a single one, timed interleaved (`timing.measure_interleaved`, `repeats` rounds; see
    :data:`CALL_CHAIN`)."""
    import tvm
    from tvm import relax, topi

    from .timing import measure_interleaved

    def build(n: int) -> Any:
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType((1, 8), "float32"))
        with bb.function("main", [x]):
            with bb.dataflow():
                y = x
                for _ in range(n):
                    y = bb.emit_te(topi.negative, y)
                out = bb.emit_output(y)
            bb.emit_func_output(out)
        exe = tvm.compile(bb.get(), target=tvm.target.Target({"kind": "llvm"}))
        return relax.VirtualMachine(exe, tvm.cpu())["main"]

    arg = tvm.runtime.tensor(np.zeros((1, 8), np.float32))
    one, chain = build(1), build(calls)
    ms = measure_interleaved({"one": lambda: one(arg), "chain": lambda: chain(arg)}, repeats=repeats)
    return max(0.0, (ms["chain"].median_ms - ms["one"].median_ms) * 1e3 / (calls - 1))


class _SiteRecorder:
    """One build's kernel calls, timed by the VM's instrument hook and tied to its call sites."""

    def __init__(self, compiled: Any, inputs: Mapping[str, np.ndarray]) -> None:
        import tvm

        self.compiled = compiled
        self.sites = compiled.report.call_sites
        self.vm = compiled.vm()
        self.run = compiled.time_fn(inputs)
        self.marks: list[tuple[str, bool, float]] = []
        self.per_site: list[list[float]] = [[] for _ in self.sites]
        self.trivial: list[float] = []

        def hook(func: Any, symbol: str, before: bool, ret: Any, *args: Any) -> int:
            self.marks.append((symbol, bool(before), time.perf_counter()))
            return 0

        self.vm.set_instrument(tvm.runtime.convert(hook) if hasattr(tvm.runtime, "convert") else hook)

    def round(self, keep: bool) -> None:
        self.marks.clear()
        self.run()
        if not keep:
            return
        calls: list[tuple[str, float]] = []
        stack: list[tuple[str, float]] = []
        for symbol, before, t in self.marks:
            if before:
                stack.append((symbol, t))
            elif stack:
                name, start = stack.pop()
                calls.append((name, (t - start) * 1e6))
        # builtins and (symbolic builds) the VM's shape functions are not kernels of the model
        kernels = [(n, us) for n, us in calls if not n.startswith(("vm.builtin", "shape_func"))]
        self.trivial += [us for n, us in calls if n in ("vm.builtin.check_tensor_info", "vm.builtin.match_shape")]
        # Sites and calls in the same order; a site with no call became a view after scheduling
        # (RewriteDataflowReshape turns reshape kernels into no-ops): it costs nothing.
        j = 0
        for slot, site in zip(self.per_site, self.sites):
            if j < len(kernels) and kernels[j][0] == site["kernel"]:
                slot.append(kernels[j][1])
                j += 1
            else:
                slot.append(0.0)
        if j != len(kernels):
            raise RuntimeError(f"{self.compiled.name}: kernel call {kernels[j][0]!r} does not line up with the "
                               f"build's call sites")

    def medians(self) -> tuple[list[float], float, list[list[float]]]:
        overhead = float(np.median(self.trivial)) if self.trivial else 0.0
        medians = [max(0.0, float(np.median(s)) - overhead) if any(s) else 0.0 for s in self.per_site]
        samples = [[t - overhead if t else 0.0 for t in s] for s in self.per_site]
        return medians, overhead, samples


def time_call_sites(builds: Sequence[Any], inputs: Mapping[str, np.ndarray], *, repeats: int = 20,
                    warmup: int = 3) -> list[tuple[list[float], float, list[list[float]]]]:
    """Per build: median microseconds per kernel call site (in `compiled.report.call_sites` order), the
    hook's own per-call cost (median duration of the VM's trivial builtins), already subtracted, and each
    site's per-round times.

    The builds run interleaved, one run each a round, the order reversed every other round: timed one after
    the other, a machine that drifted between them (a neighbour's job, a frequency step) showed as a fused
    group slower than its parts (EfficientNet-B0, Zen3: 46 kernels 5-12% slower than their parts, among them
    conv + bias kernels whose TIR was the unfused conv's plus one bias load)."""
    recorders: list[_SiteRecorder] = []
    try:
        for compiled in builds:
            recorders.append(_SiteRecorder(compiled, inputs))
        for i in range(warmup + repeats):
            for rec in (recorders if i % 2 == 0 else recorders[::-1]):
                rec.round(keep=i >= warmup)
    finally:
        for rec in recorders:
            rec.vm.set_instrument(None)
    return [rec.medians() for rec in recorders]


def kernel_library(executable: Any) -> Any:
    """The module holding a build's compiled kernels: the VM executable's first import (a build loaded from
    the cache is the executable module itself; one built in this process wraps it as ``.mod``)."""
    mod = getattr(executable, "mod", executable)
    imports = list(getattr(mod, "imports", []) or [])
    return imports[0] if imports else mod


def replay_call_sites(compiled: Any, inputs: Mapping[str, np.ndarray], wanted: set[int], *,
                      min_repeat_ms: int = REPLAY_MIN_MS, repeats: int = REPLAY_REPEATS,
                      model_us: Mapping[int, float] | None = None) -> dict[int, float]:
    """Microseconds per call of each wanted call site, replayed: one model run whose instrument hook, before
    each wanted kernel, loops that kernel on the very arguments the VM passes it (TVM's `time_evaluator`: a
    C++ loop of at least `min_repeat_ms` a repeat, and of `REPLAY_MIN_CALLS` calls at the site's model-run time
    in `model_us`; the median of `repeats`). Caches are as the loop leaves
    them (hot); a kernel that cannot be replayed (not in the library, an error) is left out, and its group is
    read from the model run."""
    import tvm

    if not wanted:
        return {}
    lib = kernel_library(compiled.executable)
    dev = compiled.device()
    sites = compiled.report.call_sites
    vm = compiled.vm()
    run = compiled.time_fn(inputs)
    out: dict[int, float] = {}
    evaluators: dict[tuple[str, int], Any] = {}
    pos = [0]

    def hook(func: Any, symbol: str, before: bool, ret: Any, *args: Any) -> int:
        if not before or symbol.startswith(("vm.builtin", "shape_func")):
            return 0
        j = pos[0]
        while j < len(sites) and sites[j]["kernel"] != symbol:      # sites with no call became views
            j += 1
        if j >= len(sites):
            return 0
        pos[0] = j + 1
        if j in wanted and j not in out:
            try:
                ms = max(min_repeat_ms, math.ceil(REPLAY_MIN_CALLS * (model_us or {}).get(j, 0.0) / 1e3))
                if (symbol, ms) not in evaluators:
                    evaluators[symbol, ms] = lib.time_evaluator(symbol, dev, number=1, repeat=repeats,
                                                                min_repeat_ms=ms)
                out[j] = float(np.median(evaluators[symbol, ms](*args).results)) * 1e6
            except Exception as exc:    # noqa: BLE001 - TVM raises its own error types; the model run's time stays
                _log.debug("replay of %s failed: %s", symbol, exc)
        return 0

    vm.set_instrument(tvm.runtime.convert(hook) if hasattr(tvm.runtime, "convert") else hook)
    try:
        run()
    finally:
        vm.set_instrument(None)
    return out


def cold_bytes_per_call(calls: Sequence[Sequence[tuple[int, int]]], capacity: int,
                        page: int = TRACE_PAGE) -> list[list[int]]:
    """For each call (its arguments as (address, bytes) ranges, in execution order), for each argument: the bytes
    of its pages that are cold there, never touched before or touched last before more than `capacity` distinct
    bytes of other pages (an LRU cache of that size no longer holds them)."""
    ranges = [[np.arange(a // page, (a + max(n, 1) + page - 1) // page) for a, n in call] for call in calls]
    flat = [r for call in ranges for r in call]
    if not flat:
        return [[] for _ in calls]
    pages = np.unique(np.concatenate(flat))
    ids = [[np.searchsorted(pages, r) for r in call] for call in ranges]
    touched = [np.unique(np.concatenate(call)) if call else np.array([], dtype=np.int64) for call in ids]
    last = np.full(len(pages), -1)
    limit = capacity // page
    out = []
    for k, call in enumerate(ids):
        per_arg = []
        for arg in call:
            before, cold = last[arg], 0
            for when in np.unique(before):
                if when >= 0:       # distinct pages touched since, counted back until they exceed the caches
                    seen, distinct, j = np.zeros(len(pages), dtype=bool), 0, k - 1
                    while j > when and distinct <= limit:
                        fresh = touched[j][~seen[touched[j]]]
                        distinct += len(fresh)
                        seen[fresh] = True
                        j -= 1
                    if distinct <= limit:
                        continue
                cold += int((before == when).sum()) * page
            per_arg.append(cold)
        last[touched[k]] = k
        out.append(per_arg)
    return out


#: One traced argument of a kernel call: (address, bytes, bytes cold at the call)
TracedArg = tuple[int, int, int]


def trace_cold_bytes(compiled: Any, inputs: Mapping[str, np.ndarray], capacity: int) -> list[list[TracedArg]]:
    """Per call site of `compiled`, its kernel's arguments (outputs last, as the VM passes them) with the bytes of
    each out of a `capacity`-byte cache at the call, in a model run that follows another (`cold_bytes_per_call`
    on the addresses the VM passes; none for a site with no call). A storage the plan first writes at a call,
    last touched near the end of the previous run, is cold there; one that a tensor freed just before is warm."""
    import tvm

    vm = compiled.vm()
    run = compiled.time_fn(inputs)
    calls: list[tuple[str, list[tuple[int, int]]]] = []

    def hook(func: Any, symbol: str, before: bool, ret: Any, *args: Any) -> int:
        if before and not symbol.startswith(("vm.builtin", "shape_func")):
            spans = []
            for a in args:
                if hasattr(a, "data_ptr") and hasattr(a, "dtype"):
                    numel = int(np.prod(a.shape)) if len(a.shape) else 1
                    spans.append((int(a.data_ptr()), (numel * a.dtype.bits * a.dtype.lanes + 7) // 8))
            calls.append((symbol, spans))
        return 0

    vm.set_instrument(tvm.runtime.convert(hook) if hasattr(tvm.runtime, "convert") else hook)
    try:
        run()
        first = len(calls)
        run()
    finally:
        vm.set_instrument(None)
    cold = cold_bytes_per_call([spans for _, spans in calls], capacity)[first:]
    out: list[list[TracedArg]] = []
    j = 0
    for site in compiled.report.call_sites:       # sites with no call became views
        if j < len(cold) and calls[first + j][0] == site["kernel"]:
            out.append([(a, n, c) for (a, n), c in zip(calls[first + j][1], cold[j])])
            j += 1
        else:
            out.append([])
    return out


def boundary_cold(parts: Sequence[Sequence[TracedArg]]) -> list[int]:
    """Per part of a group (its traced arguments, in execution order, outputs last): the cold bytes of those
    arguments that cross the group's boundary. A part's output that a later part reads is an intermediate the
    fused kernel does not have: whether it is cold (an unfused attention's scores, larger than any cache) is
    part of what fusing saves, not of where the plans put the group's inputs and output."""
    inner = {(a, n) for k, args in enumerate(parts) if args for a, n, _ in args[-1:]
             if any((a, n) == (b, m) for later in parts[k + 1:] for b, m, _ in later)}
    return [sum(c for a, n, c in args if (a, n) not in inner) for args in parts]


#: The share of a group's time the two plans' cold bytes must set before replays read it better than the model
#: run: the two sides' replays are not paired by round and move ~3% each between profiles (ResNet-18's ~750 us
#: convs: a 40 us saving read -28 to +31 us over five profiles, the model run's paired rounds +67 to +70 us).
#: MobileNet-V2's plan-bound depthwise groups differ by 40-90% of their time; ResNet-18's conv groups by 5%.
PLAN_BOUND_SHARE = 0.2


def plan_bound(cold_fused: int, cold_parts: int, shorter_us: float, *, gbs: float | None = None,
               share: float = PLAN_BOUND_SHARE) -> bool:
    """Whether a group's in-model reading is set by the memory plans: its fused kernel and its parts find
    amounts of memory cold that differ, at memory's rate (`hardware.CPU_DRAM_GBS`; MobileNet-V2's cold 1.8 MB
    output cost its depthwise kernel ~80 us, 23 GB/s), by more than `share` of the shorter side's time."""
    from fuseguard.compiler.hw.hardware import CPU_DRAM_GBS

    return abs(cold_fused - cold_parts) / ((gbs or CPU_DRAM_GBS) * 1e3) > share * shorter_us


def _sites(compiled: Any, times: Sequence[float], samples: Sequence[Sequence[float]]) -> list[SiteTime]:
    return [SiteTime(kernel=s["kernel"], pattern=s["pattern"], nodes=list(s["nodes"]), us=t, bytes=s["bytes"],
                     flops=s["flops"], reason=s.get("reason", ""), key=s.get("key", ""),
                     predicted_us=s.get("predicted_us", 0.0), samples=[round(x, 3) for x in per_round])
            for s, t, per_round in zip(compiled.report.call_sites, times, samples)]


def is_call(site: SiteTime) -> bool:
    """Whether the VM called this site's kernel: a site with no call in any round became a view (0 us)."""
    return site.replay_us is not None or any(site.samples)


def saving_rounds(fused: SiteTime, parts: Sequence[SiteTime], offset_us: float = 0.0) -> list[float]:
    """The paired saving (parts - fused) of each round, `offset_us` added to each (the VM calls the group saves);
    empty without rounds on every kernel."""
    rounds = len(fused.samples)
    if rounds < 3 or any(len(p.samples) != rounds for p in parts):
        return []
    return [sum(p.samples[r] for p in parts) - fused.samples[r] + offset_us for r in range(rounds)]


def saving_interval(rounds: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """Interval of the median paired saving over `rounds` (`saving_rounds`) by a percentile bootstrap; None
    without rounds. Why: the profile's regret summed every group's shortfall, and a group whose
    true saving is 0 reads a shortfall half the time: on ResNet-18's seventeen ~800 us conv groups that was
    0.3-2.9% of the model from run to run."""
    diffs = np.array(rounds)
    if not len(diffs):
        return None
    rounds_n = len(diffs)
    rng = np.random.default_rng(0)
    boot = np.median(diffs[rng.integers(0, rounds_n, size=(1000, rounds_n))], axis=1)
    lo, hi = np.percentile(boot, [50 * (1 - confidence), 50 * (1 + confidence)])
    return float(lo), float(hi)


def assign_parts(fused: Sequence[SiteTime], unfused: Sequence[SiteTime]) -> list[int | None]:
    """For each unfused kernel, the index of the fused kernel it is a part of (None: part of no group).

    An unfused kernel is a part of the fused kernel that lists all its nodes; one whose nodes no single fused
    kernel covers spans groups and is counted nowhere. Several kernels list a node when its op became more
    than one kernel (a conv's layout transforms and views carry the conv's node): the part goes to the one of
    the same kind (the same kernel name), else to the one doing the most work for a kernel that does work,
    the least for one that does none. Given to the first kernel listing a node, Wav2Vec2's conv + GELU
    kernels lost their conv to the expand_dims view before them and read 3x slower than their parts."""
    covering = [set(site.nodes) for site in fused]
    owners: list[int | None] = []
    for site in unfused:
        nodes = set(site.nodes)
        cands = [i for i, cover in enumerate(covering) if nodes and nodes <= cover]
        if not cands:
            owners.append(None)
            continue
        same = [i for i in cands if _kind(fused[i].kernel) == _kind(site.kernel)]
        if same:
            owners.append(same[0])
        elif site.flops > 0:
            owners.append(max(cands, key=lambda c: fused[c].flops))
        else:
            owners.append(min(cands, key=lambda c: fused[c].flops))
    return owners


def replay_wanted(fused: Sequence[SiteTime], unfused: Sequence[SiteTime], *, hook_error_us: float = HOOK_ERROR_US,
                  resolution: float = RESOLUTION) -> tuple[set[int], set[int]]:
    """Sites to replay (fused, unfused): every kernel of a group whose calls' hook error (`hook_error_us` each)
    is more than `resolution` of the shorter side's time (fused kernel or summed parts), or whose in-model times
    the memory plans set (`plan_bound`)."""
    owners = assign_parts(fused, unfused)
    members: dict[int, list[int]] = {}
    for j, i in enumerate(owners):
        if i is not None:
            members.setdefault(i, []).append(j)
    want_f: set[int] = set()
    want_u: set[int] = set()
    for i, f in enumerate(fused):
        parts = members.get(i, [])
        if not parts:
            continue
        shorter = min(f.us, sum(unfused[j].us for j in parts))
        if (1 + len(parts)) * hook_error_us > resolution * shorter \
                or plan_bound(f.cold_bytes, sum(unfused[j].cold_bytes for j in parts), shorter):
            want_f.add(i)
            want_u.update(parts)
    return want_f, want_u


def group_parts(fused: Sequence[SiteTime], unfused: Sequence[SiteTime], call_us: float = 0.0) -> list[GroupProfile]:
    """Each fused kernel with the unfused kernels whose ONNX nodes it computes (see `assign_parts`).

    A group whose fused kernel and every part were replayed is read from the replay times, both sides alike;
    any other group from the model run (a mix would compare a hot-cache loop with an in-model call). Each
    side's time includes the VM's `call_us` for every kernel it calls."""
    owners = assign_parts(fused, unfused)
    parts: list[list[SiteTime]] = [[] for _ in fused]
    for site, i in zip(unfused, owners):
        if i is not None:
            parts[i].append(site)
    groups = []
    for f, mine in zip(fused, parts):
        replayed = bool(mine) and f.replay_us is not None and all(p.replay_us is not None for p in mine)
        fused_us = (f.replay_us if replayed else f.us) or 0.0
        parts_us = sum((p.replay_us if replayed else p.us) or 0.0 for p in mine)
        calls_us = call_us * is_call(f), call_us * sum(map(is_call, mine))      # fused, parts
        rounds = [] if replayed or not mine else saving_rounds(f, mine, offset_us=calls_us[1] - calls_us[0])
        cold_parts = sum(p.cold_bytes for p in mine)
        groups.append(GroupProfile(kernel=f.kernel, pattern=f.pattern, nodes=f.nodes, fused_us=fused_us + calls_us[0],
                                   parts_us=parts_us + calls_us[1], parts=len(mine), bytes=f.bytes, flops=f.flops,
                                   reason=f.reason, key=f.key, predicted_us=f.predicted_us,
                                   timing="replay" if replayed else "model run", saving_ci=saving_interval(rounds),
                                   rounds=[round(x, 3) for x in rounds], cold_fused=f.cold_bytes,
                                   cold_parts=cold_parts,
                                   plan_bound=bool(mine) and plan_bound(f.cold_bytes, cold_parts,
                                                                        min(f.us, sum(p.us for p in mine)))))
    return groups


def split_half_reliability(groups: Sequence[GroupProfile]) -> float | None:
    """How well the profile ranks these groups' savings against itself: the rank correlation between the savings
    of the odd and of the even rounds (each the median paired saving), stepped up to all rounds by the
    Spearman-Brown formula. No estimate can rank-correlate with the measurement much beyond its square root:
    ResNet-18's seventeen conv groups save 1-10% of ~800 us kernels whose in-model times move +-3% a round, so
    a rho under 0.8 there can be the profile's noise, not the estimate's. Over the groups read from the model
    run only (a replayed group has no rounds); None with fewer than 3 of them."""
    timed = [g for g in groups if g.rounds]
    if len(timed) < 3:
        return None
    odd = [float(np.median(g.rounds[0::2])) for g in timed]
    even = [float(np.median(g.rounds[1::2])) for g in timed]
    from scipy import stats

    r = float(stats.spearmanr(odd, even).statistic)
    return 2 * r / (1 + r) if math.isfinite(r) and r > -1 else None


def _kind(kernel: str) -> str:
    """A kernel's name without the numbering TVM adds to copies (`te_layout_transform1`)."""
    return kernel.rstrip("0123456789")


def profile_model(source: Any, *, shapes: Mapping[str, Sequence[int]] | None = None, options: Any = None,
                  threads: int | None = None, repeats: int = 20, seed: int = 0,
                  name: str | None = None, replay: bool = True) -> ProfileResult:
    """Build fused and unfused, time every kernel of both on the same inputs, pair them by ONNX node; groups
    too short for the hook's resolution, or whose in-model times the memory plans set, are read from replays
    (`replay=False`: none)."""
    from fuseguard.compiler.cache import compile_cached
    from fuseguard.compiler.pipeline import CompileOptions
    from fuseguard.compiler.hw.target import host_cores

    from ..check.model import load_with_inputs

    options = options or CompileOptions()
    loaded, inputs = load_with_inputs(source, shapes, name=name, seed=seed)
    threads = threads or host_cores()
    fused = compile_cached(loaded, options)
    unfused = compile_cached(loaded, options.unfused())
    from .timing import on_timing_thread

    (fused_t, overhead, fused_s), (unfused_t, _, unfused_s) = on_timing_thread(time_call_sites, [fused, unfused],
                                                                               inputs, repeats=repeats)
    result = ProfileResult(model=loaded.name, cpu=fused.target.label, threads=threads, repeats=repeats,
                           peak_gflops=0.0, overhead_us=overhead,
                           fused=_sites(fused, fused_t, fused_s), unfused=_sites(unfused, unfused_t, unfused_s))
    if replay:
        from fuseguard.compiler.hw.hardware import host_cpu

        hw = host_cpu()
        capacity = hw.l2_bytes * max(1, hw.cores)
        traced_f, traced_u = (trace_cold_bytes(build, inputs, capacity) for build in (fused, unfused))
        for site, args in zip(result.fused, traced_f):
            site.cold_bytes = sum(c for _, _, c in args)
        owners = assign_parts(result.fused, result.unfused)
        for i in set(owners) - {None}:
            mine = [j for j, owner in enumerate(owners) if owner == i]
            for j, cold in zip(mine, boundary_cold([traced_u[j] for j in mine])):
                result.unfused[j].cold_bytes = cold
        wanted = replay_wanted(result.fused, result.unfused)
        for build, sites, want in zip((fused, unfused), (result.fused, result.unfused), wanted):
            for j, us in on_timing_thread(replay_call_sites, build, inputs, want,
                                          model_us={j: sites[j].us for j in want}).items():
                sites[j].replay_us = us
    # Last: the BLAS pool spins on after its sgemm and took a core from TVM's pool (a replay read 4 ms, a
    # scheduler quantum, for a 4 us kernel when it came after this).
    result.call_us = measure_call_us()
    result.peak_gflops = measure_peak_gflops(threads)
    result.groups = group_parts(result.fused, result.unfused, result.call_us)
    return result
