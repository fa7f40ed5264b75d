"""GPU occupancy from a kernel's resources, as NVIDIA's occupancy calculator computes it.

Occupancy is the fraction of an SM's warp slots a kernel's resident blocks fill. Registers, shared memory,
the block size and the per-SM block limit each cap how many blocks fit; the tightest cap wins and is named
(`limit`). A fused kernel holds its parts' live values at once, so fusion can raise registers per thread
and lower occupancy: that, not the memory traffic it saves, is how a fused GPU kernel ends up slower than
its parts. The figures are unvalidated until a GPU measurement confirms them (issue 19).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hw.hardware import Hardware

WARP = 32
MAX_THREADS_PER_BLOCK = 1024


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    warps_per_sm: int
    max_warps_per_sm: int
    limit: str                    # what caps it: "registers", "shared memory", "threads", "blocks" or "launch"

    @property
    def fraction(self) -> float:
        return self.warps_per_sm / self.max_warps_per_sm if self.max_warps_per_sm else 0.0


def launch_problems(hw: Hardware, threads: int, registers: int, static_smem: int, dynamic_smem: int) -> list[str]:
    """Why a kernel with these resources cannot launch on `hw` (empty when it can)."""
    out = []
    if threads > MAX_THREADS_PER_BLOCK:
        out.append(f"{threads} threads per block exceed the limit of {MAX_THREADS_PER_BLOCK}")
    if registers > hw.max_regs_per_thread:
        out.append(f"{registers} registers per thread exceed {hw.max_regs_per_thread}")
    regs_per_block = _round_up(registers * WARP, hw.reg_alloc_unit) * -(-threads // WARP)
    if hw.regs_per_sm and regs_per_block > hw.regs_per_sm:
        out.append(f"{registers} registers x {threads} threads = {regs_per_block} registers per block exceed "
                   f"the {hw.regs_per_sm} of an SM")
    if static_smem > hw.smem_static_limit:
        out.append(f"{static_smem} bytes of static shared memory exceed the {hw.smem_static_limit}-byte static limit")
    if static_smem + dynamic_smem > hw.smem_per_block_bytes:
        out.append(f"{static_smem + dynamic_smem} bytes of shared memory per block exceed {hw.arch}'s "
                   f"{hw.smem_per_block_bytes}")
    return out


def occupancy(hw: Hardware, threads: int, registers: int, smem_bytes: int) -> Occupancy:
    """Resident blocks and warps per SM for a kernel of `threads` per block using `registers` per thread
    and `smem_bytes` of shared memory (static + dynamic) per block."""
    max_warps = hw.max_threads_per_sm // WARP
    warps = -(-max(threads, 1) // WARP)
    if launch_problems(hw, threads, registers, 0, smem_bytes):
        return Occupancy(0, 0, max_warps, "launch")
    caps: dict[str, int] = {"blocks": hw.max_blocks_per_sm, "threads": max_warps // warps}
    if registers:
        regs_per_warp = _round_up(registers * WARP, hw.reg_alloc_unit)
        caps["registers"] = (hw.regs_per_sm // regs_per_warp) // warps
    if smem_bytes:
        per_block = _round_up(smem_bytes + hw.smem_reserved_per_block, hw.smem_alloc_unit)
        caps["shared memory"] = hw.smem_per_sm_bytes // per_block
    # ties name the resource a fusion changes (registers, shared memory) before the fixed limits
    order = ("registers", "shared memory", "threads", "blocks")
    limit = min(order, key=lambda k: (caps.get(k, 1 << 30), order.index(k)))
    blocks = caps[limit]
    if blocks == 0:
        return Occupancy(0, 0, max_warps, "launch")
    return Occupancy(blocks, blocks * warps, max_warps, limit)
