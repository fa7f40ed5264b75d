"""Per-group profile: every kernel of the fused and of the unfused build timed on the same inputs.

`fuseguard profile MODEL` prints, per fused kernel: its time, the summed time of the unfused kernels that
compute the same ONNX nodes, bytes at its boundary, GFLOP/s and its share of what numpy's BLAS sgemm
reaches in the same run (the stand-in for the machine's peak: TVM's packed matmul can pass it, as
OpenBLAS on Zen4 does not reach the FMA peak), and the fusion decision's reason. It is the measurement behind the
cost model's claims: a fused group slower than its parts shows up here as a speedup below 1.

Timing: the VM's instrument hook records `perf_counter` around every call (TVM 0.27's VM has no
profiler); kernel calls are tied to the build's call sites by execution order (`FusionReport.call_sites`).
The hook's own cost, measured on the VM's trivial builtin calls in the same run, is subtracted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

#: Calibration: an n x n x n float32 matmul through numpy's BLAS, the best this CPU does on the same
#: threads; 1024 takes ~20-40 ms on 2 Zen4 cores, long enough to time and short enough to repeat.
PEAK_SGEMM_N = 1024


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

    @property
    def fused_total_us(self) -> float:
        return sum(s.us for s in self.fused)

    @property
    def unfused_total_us(self) -> float:
        return sum(s.us for s in self.unfused)

    def slower_groups(self, margin: float = 0.05) -> list[GroupProfile]:
        """Fused kernels slower than their parts by more than `margin`."""
        return [g for g in self.groups if g.parts and g.fused_us > g.parts_us * (1 + margin)]

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
                            f"{self.overhead_us:.1f} us/call subtracted)")
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
            table.add_row(g.kernel[:48], g.pattern, nodes, f"{g.fused_us:.1f}",
                          f"{g.parts_us:.1f}" if g.parts else "-", ratio, f"{g.bytes / 1e6:.2f}",
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

    def medians(self) -> tuple[list[float], float]:
        overhead = float(np.median(self.trivial)) if self.trivial else 0.0
        return [max(0.0, float(np.median(s)) - overhead) if any(s) else 0.0 for s in self.per_site], overhead


def time_call_sites(builds: Sequence[Any], inputs: Mapping[str, np.ndarray], *, repeats: int = 20,
                    warmup: int = 3) -> list[tuple[list[float], float]]:
    """Per build: median microseconds per kernel call site (in `compiled.report.call_sites` order), and the
    hook's own per-call cost (median duration of the VM's trivial builtins), already subtracted.

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


def _sites(compiled: Any, times: Sequence[float]) -> list[SiteTime]:
    return [SiteTime(kernel=s["kernel"], pattern=s["pattern"], nodes=list(s["nodes"]), us=t, bytes=s["bytes"],
                     flops=s["flops"], reason=s.get("reason", ""), key=s.get("key", ""),
                     predicted_us=s.get("predicted_us", 0.0))
            for s, t in zip(compiled.report.call_sites, times)]


def group_parts(fused: Sequence[SiteTime], unfused: Sequence[SiteTime]) -> list[GroupProfile]:
    """Each fused kernel with the unfused kernels whose ONNX nodes it computes.

    An unfused kernel is a part of the fused kernel that lists all its nodes; one whose nodes no single fused
    kernel covers spans groups and is counted nowhere. Several kernels list a node when its op became more
    than one kernel (a conv's layout transforms and views carry the conv's node): the part goes to the one of
    the same kind (the same kernel name), else to the one doing the most work for a kernel that does work,
    the least for one that does none. Given to the first kernel listing a node, Wav2Vec2's conv + GELU
    kernels lost their conv to the expand_dims view before them and read 3x slower than their parts."""
    covering = [set(site.nodes) for site in fused]
    parts_us = [0.0] * len(fused)
    parts_n = [0] * len(fused)
    for site in unfused:
        nodes = set(site.nodes)
        cands = [i for i, cover in enumerate(covering) if nodes and nodes <= cover]
        if not cands:
            continue
        same = [i for i in cands if _kind(fused[i].kernel) == _kind(site.kernel)]
        if same:
            i = same[0]
        elif site.flops > 0:
            i = max(cands, key=lambda c: fused[c].flops)
        else:
            i = min(cands, key=lambda c: fused[c].flops)
        parts_us[i] += site.us
        parts_n[i] += 1
    return [GroupProfile(kernel=f.kernel, pattern=f.pattern, nodes=f.nodes, fused_us=f.us, parts_us=parts_us[i],
                         parts=parts_n[i], bytes=f.bytes, flops=f.flops, reason=f.reason, key=f.key,
                         predicted_us=f.predicted_us)
            for i, f in enumerate(fused)]


def _kind(kernel: str) -> str:
    """A kernel's name without the numbering TVM adds to copies (`te_layout_transform1`)."""
    return kernel.rstrip("0123456789")


def profile_model(source: Any, *, shapes: Mapping[str, Sequence[int]] | None = None, options: Any = None,
                  threads: int | None = None, repeats: int = 20, seed: int = 0,
                  name: str | None = None) -> ProfileResult:
    """Build fused and unfused, time every kernel of both on the same inputs, pair them by ONNX node."""
    from fuseguard.compiler.onnx_loader import load
    from fuseguard.compiler.cache import compile_cached
    from fuseguard.compiler.pipeline import CompileOptions
    from fuseguard.compiler.plugins import load_env_plugins
    from fuseguard.compiler.target import host_cores

    from .core import SuiteSpec
    from .inputs import make_inputs

    load_env_plugins()
    options = options or CompileOptions()
    if isinstance(source, SuiteSpec):
        name = name or source.label
        source = source.build()
    loaded = load(source, shapes, name=name)
    inputs = make_inputs(loaded.model, loaded.input_shapes, seed=seed)
    threads = threads or host_cores()
    fused = compile_cached(loaded, options)
    unfused = compile_cached(loaded, options.unfused())
    (fused_t, overhead), (unfused_t, _) = time_call_sites([fused, unfused], inputs, repeats=repeats)
    result = ProfileResult(model=loaded.name, cpu=fused.target.label, threads=threads, repeats=repeats,
                           peak_gflops=measure_peak_gflops(threads), overhead_us=overhead,
                           fused=_sites(fused, fused_t), unfused=_sites(unfused, unfused_t))
    result.groups = group_parts(result.fused, result.unfused)
    return result
