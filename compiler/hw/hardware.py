"""What the cost model knows about each target: one row per architecture.

Numbers are vendor datasheet figures (per-SM shared memory is the configurable maximum; per-block is
the opt-in maximum; the default static limit is 48 KiB). The host CPU row is read from this machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import tvm

from . import hostcpu

KiB, MiB = 1024, 1024 * 1024
#: Static shared memory a CUDA block may use without opting in (``cudaFuncSetAttribute``); every
#: architecture's `smem_static_limit`.
CUDA_STATIC_SHARED_BYTES = 48 * KiB


@dataclass(frozen=True)
class Hardware:
    name: str
    kind: str                       # "cuda" or "cpu"
    arch: str                       # sm_80 ... or the LLVM mcpu
    mem_bandwidth_gbs: float        # DRAM/HBM bandwidth
    l2_bytes: int
    launch_overhead_us: float       # per kernel (CUDA launch, or CPU parallel-region fork/join)
    #: per kernel too small to run in parallel (a CPU row-sized kernel: the VM's call); 0: launch_overhead_us
    call_overhead_us: float = 0.0
    #: CPU: read + write bandwidth of all cores together for a tensor that stays in L2 / L3 (0: as DRAM)
    l2_bandwidth_gbs: float = 0.0
    l3_bandwidth_gbs: float = 0.0
    #: CPU: one core reading a tensor all cores just wrote (half of it in the others' L2), and writing its
    #: own output: a kernel too small to run in parallel after one that did (0: not modelled)
    cross_core_gbs: float = 0.0
    sm_count: int = 0
    smem_per_sm_bytes: int = 0
    smem_per_block_bytes: int = 48 * 1024
    regs_per_sm: int = 0
    cores: int = 0
    l1d_bytes: int = 0
    l3_bytes: int = 0
    vector_regs: int = 16           # architectural SIMD registers (AVX2: 16 ymm)
    # GPU occupancy limits (CUDA C Programming Guide, "Technical Specifications per Compute Capability")
    max_threads_per_sm: int = 0
    max_blocks_per_sm: int = 0
    max_regs_per_thread: int = 255
    reg_alloc_unit: int = 256       # registers are allocated per warp in units of 256
    smem_alloc_unit: int = 128      # shared memory is allocated per block in units of 128 bytes
    smem_reserved_per_block: int = 1024   # the system reserves 1 KiB of shared memory per block (sm_80+)
    smem_static_limit: int = CUDA_STATIC_SHARED_BYTES    # static __shared__ beyond this needs the dynamic opt-in

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"

    @property
    def small_kernel_us(self) -> float:
        """What a kernel over a handful of values costs (a GPU launch costs the same at any size)."""
        return self.call_overhead_us or self.launch_overhead_us



GPU_TABLE: dict[str, Hardware] = {
    # A100 SXM4 80 GB
    "sm_80": Hardware("NVIDIA A100", "cuda", "sm_80", 2039.0, 40 * MiB, 4.0, sm_count=108,
                      smem_per_sm_bytes=164 * KiB, smem_per_block_bytes=163 * KiB, regs_per_sm=65536,
                      max_threads_per_sm=2048, max_blocks_per_sm=32),
    # A10 / RTX 3090 class
    "sm_86": Hardware("NVIDIA A10", "cuda", "sm_86", 600.0, 6 * MiB, 4.0, sm_count=72,
                      smem_per_sm_bytes=100 * KiB, smem_per_block_bytes=99 * KiB, regs_per_sm=65536,
                      max_threads_per_sm=1536, max_blocks_per_sm=16),
    # L4 (Ada)
    "sm_89": Hardware("NVIDIA L4", "cuda", "sm_89", 300.0, 48 * MiB, 4.0, sm_count=58,
                      smem_per_sm_bytes=100 * KiB, smem_per_block_bytes=99 * KiB, regs_per_sm=65536,
                      max_threads_per_sm=1536, max_blocks_per_sm=24),
    # H100 SXM5
    "sm_90": Hardware("NVIDIA H100", "cuda", "sm_90", 3350.0, 50 * MiB, 3.0, sm_count=132,
                      smem_per_sm_bytes=228 * KiB, smem_per_block_bytes=227 * KiB, regs_per_sm=65536,
                      max_threads_per_sm=2048, max_blocks_per_sm=32),
    # H200: Hopper sm_90 with HBM3e
    "h200": Hardware("NVIDIA H200", "cuda", "sm_90", 4800.0, 50 * MiB, 3.0, sm_count=132,
                     smem_per_sm_bytes=228 * KiB, smem_per_block_bytes=227 * KiB, regs_per_sm=65536,
                     max_threads_per_sm=2048, max_blocks_per_sm=32),
}

SUPPORTED_GPU_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")


#: What an unfused elementwise kernel costs on a CPU, measured as a chain of 41 Neg/Relu kernels against one
#: (TVM VM, 2 threads, pool spinning as deployed; SPR class, 2 vCPUs, 2 MiB L2 a core): per kernel 0.26 us at
#: 64 floats (the VM call; serial), 1.74 us at 16K floats of which ~0.9 us is the data, so a kernel with a
#: parallel loop costs ~1 us fixed: not the 5 us of a parked worker's wake-up the estimate used before (which
#: had a 0.7 us LayerNorm group "save" 6 us, and summed ViT-tiny's savings to 192 us against 15 measured).
#: Data moved (read + write, both cores): 64 KiB-1 MiB tensors 145 GB/s (L2), 4-16 MiB 53-57 GB/s (L3);
#: numpy on one core: 70-87 GB/s from L1/L2, 29 from L3, 13-23 from DRAM. A tensor counts as in a level when
#: it fills at most half of it (the kernel's input and output share it). Per core, so they scale with cores.
CPU_LAUNCH_US = 1.0
#: ... and a kernel on a few rows' worth of values (a LayerNorm's means, its eps added, its square root) costs
#: the VM call alone: 0.26 us at 64 floats in that chain (`fuseguard profile` reads 0.22-0.24 us a call).
CPU_CALL_US = 0.26
CPU_L2_GBS_PER_CORE = 70.0
CPU_L3_GBS_PER_CORE = 28.0
#: A serial kernel (under the scheduler's parallel thresholds) reading what a parallel kernel wrote: in
#: ResNet-18's unfused build (dynamo export, 2 threads, SPR class, `fuseguard profile`) the ReLUs after a conv
#: moved their 0.2-1.6 MB (read + write) at 26-45 GB/s, 40 typical, and the ReLUs after a serial add at
#: 82-164 GB/s: the conv's output sits half in the other core's L2.
CPU_CROSS_CORE_GBS = 40.0
#: DRAM: a conservative per-socket DDR4 figure (a shared host's neighbours take their share of it).
CPU_DRAM_GBS = 20.0


@lru_cache(maxsize=None)
def host_cpu(mcpu: str = "generic") -> Hardware:
    """The host CPU as the cost model sees it (cores and caches as compiler/hw/hostcpu.py detected them; the
    bandwidths of :data:`CPU_L2_GBS_PER_CORE` and the rest, per core)."""
    host = hostcpu.detect_host()
    cores = max(1, host.cores)
    return Hardware("host CPU", "cpu", mcpu, CPU_DRAM_GBS, host.l2_bytes or 512 * KiB, CPU_LAUNCH_US,
                    call_overhead_us=CPU_CALL_US, cores=host.cores,
                    l1d_bytes=host.l1d_bytes or 32 * KiB, l3_bytes=host.l3_bytes or 8 * MiB,
                    vector_regs=_vector_registers(mcpu), l2_bandwidth_gbs=CPU_L2_GBS_PER_CORE * cores,
                    l3_bandwidth_gbs=CPU_L3_GBS_PER_CORE * cores,
                    cross_core_gbs=CPU_CROSS_CORE_GBS if cores > 1 else 0.0)


def _vector_registers(mcpu: str) -> int:
    """SIMD registers of ``mcpu`` by LLVM's feature query, as the schedules decide (hostcpu.host_from_target):
    a list of CPU names here had missed znver5 (16 instead of 32)."""
    try:
        target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    except Exception:  # noqa: BLE001 - a name LLVM does not know: the host's own registers
        return hostcpu.detect_host().vector_registers
    return hostcpu.host_from_target(target).vector_registers


def for_target(kind: str, arch: str, device_name: str | None = None) -> Hardware:
    if kind == "cuda":
        if device_name and "H200" in device_name:
            return GPU_TABLE["h200"]
        if arch in GPU_TABLE:
            return GPU_TABLE[arch]
        # Unknown arch: nearest lower known one, renamed.
        known = sorted(SUPPORTED_GPU_ARCHS)
        base = max((a for a in known if a <= arch), default=known[0])
        return replace(GPU_TABLE[base], arch=arch, name=f"{GPU_TABLE[base].name} (as {arch})")
    return host_cpu(arch)
