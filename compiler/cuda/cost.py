"""The GPU cost model that knows registers: is a fused kernel, at the occupancy ptxas gave it, faster than
its parts at theirs? Unvalidated until a GPU measurement confirms it (the report says so).

Memory-bound kernels need enough loads in flight to cover DRAM latency (Little's law: bandwidth x latency
bytes per GPU). Below the occupancy that keeps that many loads in flight, achievable bandwidth falls in
proportion; above it, more occupancy buys nothing. A kernel's time is its boundary bytes over the derated
bandwidth plus one launch. A fused group is vetoed when that predicts it slower than its parts: the
traffic it saves must pay for the occupancy its registers or shared memory cost (a flash-attention kernel
at 17% occupancy still wins on the scores matrix it never writes; an epilogue that halves a GEMM's
occupancy does not).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..hw.hardware import Hardware
from .occupancy import WARP

#: Global-load latency under load, ns: 470-650 cycles at 1.4-1.8 GHz on Ampere/Hopper microbenchmarks
#: (Jia et al., "Dissecting the NVIDIA Volta/Ampere GPU architecture through microbenchmarking").
DRAM_LATENCY_NS = 600.0
#: Bytes one warp has in flight per load instruction: a 16-byte vector load per thread.
BYTES_PER_WARP_LOAD = 16 * WARP


def saturation(hw: Hardware) -> float:
    """The occupancy at which in-flight loads cover bandwidth x latency (A100 0.35, H100 0.46, A10 0.2)."""
    if not (hw.sm_count and hw.max_threads_per_sm):
        return 0.0
    per_sm = hw.mem_bandwidth_gbs * DRAM_LATENCY_NS / hw.sm_count      # GB/s x ns = bytes
    warps = per_sm / BYTES_PER_WARP_LOAD
    return min(1.0, warps / (hw.max_threads_per_sm // WARP))


def effective_occupancy(hw: Hardware, occupancy: float, threads: int, grid: int | None) -> float:
    """Occupancy over the whole GPU: a grid of fewer blocks than the SMs can hold leaves warp slots empty
    however few registers it uses (None: a symbolic grid, assumed large)."""
    if grid is None or not (hw.sm_count and hw.max_threads_per_sm):
        return occupancy
    warps = -(-max(threads, 1) // WARP)
    return min(occupancy, grid * warps / (hw.sm_count * (hw.max_threads_per_sm // WARP)))


def kernel_us(hw: Hardware, nbytes: int, occupancy: float) -> float:
    """Predicted time of one memory-bound kernel: bytes over bandwidth derated by occupancy, plus a launch."""
    sat = saturation(hw)
    derate = 1.0 if sat <= 0 or occupancy >= sat else max(occupancy, 1e-3) / sat
    return nbytes / (hw.mem_bandwidth_gbs * 1e3 * derate) + hw.launch_overhead_us


@dataclass(frozen=True)
class GroupVerdict:
    kernel: str
    fused_us: float
    parts_us: float
    fused_occupancy: float
    parts_occupancy: float        # of the heaviest part (the loop nest the fused kernel extends)
    parts: int

    @property
    def slower(self) -> bool:
        return self.fused_us > self.parts_us

    def reason(self, hw: Hardware) -> str:
        return (f"on {hw.arch} the fused kernel's occupancy ({self.fused_occupancy:.0%}, from ptxas) costs more "
                f"bandwidth than its fusion saves: predicted {self.fused_us:.1f} us vs {self.parts_us:.1f} us for "
                f"its {self.parts} parts at up to {self.parts_occupancy:.0%} (unvalidated GPU cost model)")


def compare(hw: Hardware, kernel: str, fused_bytes: int, fused_occupancy: float,
            parts: Sequence[tuple[int, float, int]]) -> GroupVerdict:
    """`parts`: (bytes, occupancy, flops) of each kernel the group replaces."""
    heaviest = max(parts, key=lambda p: (p[2], p[0]))
    return GroupVerdict(kernel=kernel, fused_us=kernel_us(hw, fused_bytes, fused_occupancy),
                        parts_us=sum(kernel_us(hw, b, o) for b, o, _ in parts),
                        fused_occupancy=fused_occupancy, parts_occupancy=heaviest[1], parts=len(parts))


def parts_of(nodes: Sequence[str], sites: Sequence[Mapping]) -> list[Mapping]:
    """The call sites of an unfused build that compute only ONNX nodes of `nodes` (a group's parts)."""
    wanted = set(nodes)
    return [s for s in sites if s.get("nodes") and set(s["nodes"]) <= wanted]
