"""Fused scaled-dot-product attention as one TIR PrimFunc (FlashAttention-style online softmax).

``out[b,h,i,:] = softmax_j(scale * Q[b,h,i,:].K[b,h,j,:] + mask[...,i,j]) @ V[b,h,j,:]``

The unfused Relax path materialises the ``Sq x Sk`` score matrix per head (and again after the
softmax), so its memory grows quadratically with the sequence. Here each parallel task owns a
block of query rows and streams K/V in tiles while keeping a running row maximum ``m``, a
running denominator ``l`` and an output accumulator: scratch is ``O(block_q * (block_k + D))``
whatever the sequence length.

Two code generators share the semantics:

* CPU (LLVM): one parallel task per (b, h, q-block). Everything is laid out "query-major in the
  vector lanes" (Q^T, S^T, acc^T), so the score matmul, the row max/sum of the softmax and the
  P.V matmul are all vertical vector operations over query rows with scalar broadcasts of K and
  V elements read straight from their rows: no transposed copy of K, no horizontal reductions.
  ``exp`` is a Cody-Waite + polynomial approximation written in TIR so it vectorises (LLVM
  would otherwise scalarise ``expf`` inside vector loops).
* CUDA: one thread block per (b, h, q-block); the Q tile, the K/V tiles, the score and
  probability tiles live in shared memory, each phase maps a 2-D index space onto the threads,
  and the running m/l and the output accumulator stay in the registers of the thread that owns
  those rows/elements. Phases only communicate through shared memory, so TVM's ``ThreadSync``
  pass places the barriers, and the same kernel with serial loops instead of thread bindings
  (``emulate_cuda=True``) runs on the CPU: that is how its numerics are tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from ..hw.hardware import CUDA_STATIC_SHARED_BYTES

if TYPE_CHECKING:
    from ..hw.hardware import Hardware

__all__ = [
    "CUDA_DEFAULT_SHARED_BYTES",
    "CPU_DEFAULT_SCRATCH_BYTES",
    "SYMBOLIC_SEQ_TILE_AT",
    "allocated_buffers",
    "attention_call",
    "attention_primfunc",
    "attention_scratch_bytes",
    "attention_smem_bytes",
    "choose_tiles",
    "cuda_max_shared_bytes",
    "host_target",
]

#: Static shared memory a CUDA block may use without opting in: the hardware table's figure.
CUDA_DEFAULT_SHARED_BYTES = CUDA_STATIC_SHARED_BYTES
#: Per-task scratch the CPU kernel aims to keep in L1/L2 (a budget, not a hard limit).
CPU_DEFAULT_SCRATCH_BYTES = 256 * 1024

#: A symbolic sequence: the CPU tiles are chosen as for this length (or the cost model's size, if
#: smaller). A block longer than the sequence wastes its excess rows; a short one costs only some K/V
#: reuse. Measured (Zen4, 2 threads, 12 heads, D=64, masked; dynamic build against static at each
#: size): tiles for 16 -> 1.00-1.06x at seq 16..384, for 32 -> 1.46x at seq 16, for 128 -> 2.84x at 16.
SYMBOLIC_SEQ_TILE_AT = 16

_SUPPORTED_DTYPES = ("float32", "float16")
_CUDA_THREADS = 128


def _dtype_bytes(dtype: str) -> int:
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"attention kernel supports {_SUPPORTED_DTYPES}, got {dtype!r}")
    return 4 if dtype == "float32" else 2


def host_target() -> tvm.target.Target:
    """LLVM target for this host's CPU: the generic x86-64 target has no AVX and is ~10x slower."""
    from ..hw.hostcpu import host_target as detected

    return detected()


def cuda_max_shared_bytes(target: tvm.target.Target) -> int:
    """Largest per-block shared memory the kernel may request on ``target`` (opt-in included): the
    architecture table's figure (compiler/hw/hardware.py), 48 KiB for a target without an arch."""
    from ..hw.hardware import for_target

    arch = str(target.attrs.get("arch", "")) if "arch" in target.attrs else ""
    return for_target("cuda", arch).smem_per_block_bytes if arch.startswith("sm_") else CUDA_DEFAULT_SHARED_BYTES


#: Resident blocks per SM the CUDA tile leaves room for. The kernel runs scalar FMAs out of shared memory
#: behind a barrier per phase: with one 4-warp block per SM every barrier idles the SM, with two one
#: block's loads overlap the other's arithmetic (unvalidated: no GPU has timed it yet).
CUDA_BLOCKS_PER_SM = 2


def cuda_tile_budget(hw: "Hardware") -> int:
    """Shared memory one attention block may take on `hw`: the opt-in per-block limit, capped so that
    CUDA_BLOCKS_PER_SM blocks fit an SM (sm_86 49 KiB, sm_80 81 KiB, sm_90 113 KiB)."""
    per_sm = hw.smem_per_sm_bytes // CUDA_BLOCKS_PER_SM - hw.smem_reserved_per_block
    return max(CUDA_DEFAULT_SHARED_BYTES, min(hw.smem_per_block_bytes, per_sm))


# ----------------------------------------------------------------------------------------------
# Memory model and tile choice (used by the cost model)


def attention_smem_bytes(block_q: int, block_k: int, head_dim: int, dtype: str = "float32") -> int:
    """Shared memory of one CUDA block: Q, K, V tiles in ``dtype``; S, P, corr, l in fp32.

    Mirrors the shared allocations of the CUDA kernel exactly, so a tile pair accepted by
    :func:`choose_tiles` really fits.
    """
    esize = _dtype_bytes(dtype)
    tiles = (block_q * head_dim + 2 * block_k * head_dim) * esize
    fp32 = 2 * block_q * block_k + 2 * block_q
    return tiles + 4 * fp32


def attention_scratch_bytes(block_q: int, block_k: int, head_dim: int, value_dim: int | None = None) -> int:
    """Per-task scratch of the CPU kernel (all fp32): Q^T, S^T, acc^T tiles and m/l/corr rows."""
    value_dim = head_dim if value_dim is None else value_dim
    return 4 * ((head_dim + value_dim) * block_q + block_k * block_q + 4 * block_q)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def choose_tiles(
    seq_q: int,
    seq_k: int,
    head_dim: int,
    dtype: str = "float32",
    target_kind: str = "llvm",
    max_shared_bytes: int | None = None,
    value_dim: int | None = None,
) -> tuple[int, int] | None:
    """Largest (block_q, block_k) whose scratch fits ``max_shared_bytes``; None if none fits.

    None tells the caller to keep the unfused path. Larger query blocks reuse each K/V tile over
    more rows; the blocks never exceed the (rounded) sequence so short sequences waste little.
    """
    if min(seq_q, seq_k, head_dim) < 1:
        raise ValueError(f"attention dims must be >= 1, got seq_q={seq_q} seq_k={seq_k} D={head_dim}")
    _dtype_bytes(dtype)
    if target_kind == "cuda":
        budget = CUDA_DEFAULT_SHARED_BYTES if max_shared_bytes is None else max_shared_bytes
        cap_q, cap_k = _round_up(seq_q, 8), _round_up(seq_k, 8)
        candidates = [(bq, bk) for bq in (64, 32, 16, 8) for bk in (64, 32, 16, 8)]
        candidates.sort(key=lambda t: (-min(t[0], cap_q) * min(t[1], cap_k), -t[0]))
        for bq, bk in candidates:
            bq, bk = min(bq, cap_q), min(bk, cap_k)
            if attention_smem_bytes(bq, bk, head_dim, dtype) <= budget:
                return bq, bk
        return None
    if target_kind in ("llvm", "c"):
        budget = CPU_DEFAULT_SCRATCH_BYTES if max_shared_bytes is None else max_shared_bytes
        cap_q, cap_k = _round_up(seq_q, 8), _round_up(seq_k, 4)
        for bq in (64, 32, 16, 8):
            for bk in (64, 32, 16, 8, 4):
                bq_, bk_ = min(bq, cap_q), min(bk, cap_k)
                if attention_scratch_bytes(bq_, bk_, head_dim, value_dim) <= budget:
                    return bq_, bk_
        return None
    raise ValueError(f"no attention kernel for target kind {target_kind!r}")


# ----------------------------------------------------------------------------------------------
# Shared helpers for both generators


def _normalize_mask_shape(
    mask_shape: Sequence[int] | None, batch: int, heads: int, seq_q: int, seq_k: int
) -> tuple[int, ...] | None:
    """Validate numpy-style broadcastability to [B, H, Sq, Sk]; returns the shape as given."""
    if mask_shape is None:
        return None
    shape = tuple(_dim(s) for s in mask_shape)
    full = (batch, heads, seq_q, seq_k)
    if not 1 <= len(shape) <= 4:
        raise ValueError(f"mask rank must be 1..4, got shape {shape}")
    for got, want in zip(shape[::-1], full[::-1]):
        if not (_is_one(got) or _same_dim(got, want)):
            raise ValueError(f"mask shape {shape} does not broadcast to {full}")
    return shape


def _dim(d: object) -> "int | tirx.Expr":
    """A dim as an int when static, else the (symbolic) PrimExpr itself."""
    if isinstance(d, int):
        return d
    if isinstance(d, tirx.IntImm):
        return int(d.value)
    return d


def _is_one(d: object) -> bool:
    return isinstance(d, int) and d == 1


def _same_dim(a: object, b: object) -> bool:
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int) and a == b
    import tvm_ffi

    return bool(tvm_ffi.structural_equal(a, b))


Index = tirx.Expr | int


def _mask_load(mask: tirx.Buffer, shape: tuple[int, ...], b: Index, h: Index, i: Index, j: Index) -> tirx.Expr:
    """mask[b, h, i, j] with broadcast dims indexed at 0, cast to fp32."""
    full_idx = (b, h, i, j)[4 - len(shape):]
    idx = [0 if extent == 1 else v for extent, v in zip(shape, full_idx)]
    return tirx.Cast("float32", tirx.BufferLoad(mask, idx))


def _fast_exp(x: tirx.Expr) -> tirx.Expr:
    """exp(x) for fp32 x <= ~88, max rel. error ~2 ulp; exactly 0 below -87 (no denormals).

    n = round(x / ln2), r = x - n ln2 (two-constant Cody-Waite), exp(r) by a degree-6 Taylor
    polynomial (|r| <= ln2/2, truncation 1.2e-7), 2^n assembled in the exponent bits. Pure
    arithmetic, so TVM's vectoriser and LLVM turn it into straight-line SIMD code.
    """
    f32 = "float32"
    xc = tirx.max(tirx.min(x, tirx.const(88.0, f32)), tirx.const(-87.0, f32))
    n = tirx.floor(xc * tirx.const(1.4426950408889634, f32) + tirx.const(0.5, f32))
    r = xc - n * tirx.const(0.693359375, f32) - n * tirx.const(-2.12194440e-4, f32)
    p = tirx.const(1.0 / 720.0, f32)
    for coeff in (1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        p = p * r + tirx.const(coeff, f32)
    two_n = tirx.reinterpret(f32, tirx.shift_left(tirx.Cast("int32", n) + 127, 23))
    return tirx.Select(x < tirx.const(-87.0, f32), tirx.const(0.0, f32), p * two_n)


def _cpu_vector_lanes(target: tvm.target.Target) -> int:
    """fp32 lanes of the widest vector unit ``target`` enables (4 = plain SSE)."""
    try:
        features = set(tvm.target.codegen.llvm_get_cpu_features(target))
    except Exception:  # pylint: disable=broad-exception-caught
        return 4  # non-x86 or a target LLVM cannot describe: assume 128-bit vectors
    if "avx512f" in features:
        return 16
    if "avx" in features or "avx2" in features:
        return 8
    return 4


def _with_attrs(func: tirx.PrimFunc, name: str) -> tirx.PrimFunc:
    # is_scheduled keeps Relax's default GPU pipeline (dlight) from re-scheduling the kernel.
    return func.with_attr({"global_symbol": name, "tir.noalias": True, "tir.is_scheduled": True})


# ----------------------------------------------------------------------------------------------
# CPU kernel


def _cpu_primfunc(
    batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, dtype: str,
    mask_shape: tuple[int, ...] | None, scale: float, block_q: int, block_k: int, lanes: int,
    value_dim: int,
) -> tirx.PrimFunc:
    B, H, Sq, Sk, D, Bq, Bk = batch, heads, seq_q, seq_k, head_dim, block_q, block_k
    DV = value_dim      # V's and the output's head size (LeViT: 4x the key size)
    if Bq % 8:
        raise ValueError(f"CPU block_q must be a multiple of 8, got {Bq}")
    # IL: query lanes per register tile (two vectors when they divide the block), JR/DR: K rows /
    # head dims per register tile. JR x IL (and DR x IL) accumulators stay in vector registers.
    IL = next(w for w in (2 * lanes, lanes, 8) if Bq % w == 0)
    JR = 4 if Bk % 4 == 0 else (2 if Bk % 2 == 0 else 1)
    DR = 4 if DV % 4 == 0 else (2 if DV % 2 == 0 else 1)
    NQB, NKB = (Sq + Bq - 1) // Bq, (Sk + Bk - 1) // Bk      # ints, or PrimExprs for symbolic seqs
    NEG_INF, LOWEST, SCALE = float("-inf"), float(np.finfo(np.float32).min), float(scale)
    has_mask = mask_shape is not None
    per_row_mask = has_mask and len(mask_shape) >= 2 and not _is_one(mask_shape[-2])

    def bias(M: tirx.Buffer | None, b: Index, h: Index, i: Index, j: Index) -> tirx.Expr:
        """Additive mask for (query i, key j); i may be a vector lane index (gathered)."""
        if not has_mask:
            return tirx.const(0.0, "float32")
        ii = tirx.min(i, Sq - 1) if per_row_mask else 0
        return _mask_load(M, mask_shape, b, h, ii, tirx.min(j, Sk - 1))

    @T.macro
    def body(Q, K, V, M, O):
        for t in T.parallel(B * H * NQB):
            # Scope "global" + constant size: small buffers become stack allocas that LLVM
            # promotes to registers (c, c2); the tiles become per-task workspace.
            qT = T.alloc_buffer((D, Bq), "float32")
            sT = T.alloc_buffer((Bk, Bq), "float32")
            accT = T.alloc_buffer((DV, Bq), "float32")
            m = T.alloc_buffer((Bq,), "float32")
            mn = T.alloc_buffer((Bq,), "float32")
            corr = T.alloc_buffer((Bq,), "float32")
            lsum = T.alloc_buffer((Bq,), "float32")
            c = T.alloc_buffer((JR, IL), "float32")
            c2 = T.alloc_buffer((DR, IL), "float32")
            b: T.let = t // (H * NQB)
            h: T.let = t // NQB % H
            q0: T.let = t % NQB * Bq
            for i, d in T.grid(Bq, D):
                qT[d, i] = T.if_then_else(q0 + i < Sq, T.Cast("float32", Q[b, h, q0 + i, d]) * T.float32(SCALE), T.float32(0))
            for i in T.vectorized(Bq):
                m[i] = T.float32(NEG_INF)
                lsum[i] = T.float32(0)
            for d in range(DV):
                for i in T.vectorized(Bq):
                    accT[d, i] = T.float32(0)
            for kb in range(NKB):
                k0: T.let = kb * Bk
                # S^T[j, i] = K[j, :] . (scale Q[i, :]) + mask; rows past Sk get -inf (p = 0).
                for j0, i0 in T.grid(Bk // JR, Bq // IL):
                    for jr in T.unroll(JR):
                        for il in T.vectorized(IL):
                            c[jr, il] = T.float32(0)
                    for d in range(D):
                        for jr in T.unroll(JR):
                            for il in T.vectorized(IL):
                                c[jr, il] = c[jr, il] + T.Cast("float32", K[b, h, T.min(k0 + j0 * JR + jr, Sk - 1), d]) * qT[d, i0 * IL + il]
                    for jr in T.unroll(JR):
                        for il in T.vectorized(IL):
                            sT[j0 * JR + jr, i0 * IL + il] = T.Select(
                                k0 + j0 * JR + jr < Sk,
                                c[jr, il] + bias(M, b, h, q0 + i0 * IL + il, k0 + j0 * JR + jr),
                                T.float32(NEG_INF),
                            )
                # Online softmax, vectorised over query rows.
                for i0 in range(Bq // IL):
                    for il in T.vectorized(IL):
                        mn[i0 * IL + il] = m[i0 * IL + il]
                    for j in range(Bk):
                        for il in T.vectorized(IL):
                            mn[i0 * IL + il] = T.max(mn[i0 * IL + il], sT[j, i0 * IL + il])
                    for il in T.vectorized(IL):
                        # subtract the running max, or 0 while it is still -inf (no finite score yet):
                        # -inf - -inf would be NaN, and a row whose scores are all finfo.min (HF's
                        # mask value) is an ordinary row, not an empty one, as in an unfused softmax
                        corr[i0 * IL + il] = _fast_exp(m[i0 * IL + il] - T.Select(
                            mn[i0 * IL + il] < T.float32(LOWEST), T.float32(0), mn[i0 * IL + il]))
                        m[i0 * IL + il] = mn[i0 * IL + il]
                        mn[i0 * IL + il] = T.Select(mn[i0 * IL + il] < T.float32(LOWEST), T.float32(0),
                                                    mn[i0 * IL + il])
                        lsum[i0 * IL + il] = lsum[i0 * IL + il] * corr[i0 * IL + il]
                    for j in range(Bk):
                        for il in T.vectorized(IL):
                            sT[j, i0 * IL + il] = _fast_exp(sT[j, i0 * IL + il] - mn[i0 * IL + il])
                            lsum[i0 * IL + il] = lsum[i0 * IL + il] + sT[j, i0 * IL + il]
                # acc^T[d, i] = acc^T[d, i] * corr[i] + sum_j V[j, d] P^T[j, i] (valid j only).
                for d0, i0 in T.grid(DV // DR, Bq // IL):
                    for dr in T.unroll(DR):
                        for il in T.vectorized(IL):
                            c2[dr, il] = T.float32(0)
                    for j in range(T.min(Bk, Sk - k0)):
                        for dr in T.unroll(DR):
                            for il in T.vectorized(IL):
                                c2[dr, il] = c2[dr, il] + T.Cast("float32", V[b, h, k0 + j, d0 * DR + dr]) * sT[j, i0 * IL + il]
                    for dr in T.unroll(DR):
                        for il in T.vectorized(IL):
                            accT[d0 * DR + dr, i0 * IL + il] = (
                                accT[d0 * DR + dr, i0 * IL + il] * corr[i0 * IL + il] + c2[dr, il]
                            )
            for i in range(Bq):
                if q0 + i < Sq:
                    for d in range(DV):
                        O[b, h, q0 + i, d] = T.Cast(dtype, accT[d, i] / lsum[i])

    if has_mask:
        @T.prim_func
        def attn_mask(
            Q: T.Buffer((B, H, Sq, D), dtype), K: T.Buffer((B, H, Sk, D), dtype),
            V: T.Buffer((B, H, Sk, DV), dtype), M: T.Buffer(mask_shape, dtype),
            O: T.Buffer((B, H, Sq, DV), dtype),
        ):
            body(Q, K, V, M, O)

        return attn_mask

    @T.prim_func
    def attn(
        Q: T.Buffer((B, H, Sq, D), dtype), K: T.Buffer((B, H, Sk, D), dtype),
        V: T.Buffer((B, H, Sk, DV), dtype), O: T.Buffer((B, H, Sq, DV), dtype),
    ):
        body(Q, K, V, None, O)

    return attn


# ----------------------------------------------------------------------------------------------
# CUDA kernel


def _cuda_primfunc(
    batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, dtype: str,
    mask_shape: tuple[int, ...] | None, scale: float, block_q: int, block_k: int,
    dynamic_shared: bool, emulate: bool,
) -> tirx.PrimFunc:
    B, H, Sq, Sk, D, Bq, Bk = batch, heads, seq_q, seq_k, head_dim, block_q, block_k
    NT = _CUDA_THREADS
    NQB, NKB = -(-Sq // Bq), -(-Sk // Bk)
    # Steps per thread of each 2-D phase. Indices past the end are clamped to the last element:
    # the spare threads redo it (identical values), so no phase needs a branch. ThreadSync cannot
    # place a barrier inside a branch, and with shared.dyn it must assume all tiles alias.
    NQD, NKD, NS, NR = -(-Bq * D // NT), -(-Bk * D // NT), -(-Bq * Bk // NT), -(-Bq // NT)
    NEG_INF, LOWEST, SCALE = float("-inf"), float(np.finfo(np.float32).min), float(scale)
    has_mask = mask_shape is not None
    # emulate: same phases as serial loops in plain memory, compiled for the CPU in tests.
    smem = "global" if emulate else ("shared.dyn" if dynamic_shared else "shared")
    reg = "global" if emulate else "local"
    exp = tirx.exp

    def blocks(n: int):  # -> a TVMScript loop frame
        return T.serial(n) if emulate else T.thread_binding(n, thread="blockIdx.x")

    def threads():  # -> a TVMScript loop frame
        return T.serial(NT) if emulate else T.thread_binding(NT, thread="threadIdx.x")

    def bias(M: tirx.Buffer | None, b: Index, h: Index, i: Index, j: Index) -> tirx.Expr:
        if not has_mask:
            return tirx.const(0.0, "float32")
        return _mask_load(M, mask_shape, b, h, tirx.min(i, Sq - 1), tirx.min(j, Sk - 1))

    @T.macro
    def body(Q, K, V, M, O):
        for bx in blocks(B * H * NQB):
            Qs = T.alloc_buffer((Bq, D), dtype, scope=smem)
            Ks = T.alloc_buffer((Bk, D), dtype, scope=smem)
            Vs = T.alloc_buffer((Bk, D), dtype, scope=smem)
            Ss = T.alloc_buffer((Bq, Bk), "float32", scope=smem)
            Ps = T.alloc_buffer((Bq, Bk), "float32", scope=smem)
            corr = T.alloc_buffer((Bq,), "float32", scope=smem)
            lsum = T.alloc_buffer((Bq,), "float32", scope=smem)
            # Thread-owned state, indexed [thread, step]; TVM compacts it to [step] per thread.
            acc = T.alloc_buffer((NT, NQD), "float32", scope=reg)
            m_r = T.alloc_buffer((NT, NR), "float32", scope=reg)
            l_r = T.alloc_buffer((NT, NR), "float32", scope=reg)
            b: T.let = bx // (H * NQB)
            h: T.let = bx // NQB % H
            q0: T.let = bx % NQB * Bq
            for tx in threads():
                for it in range(NQD):
                    Qs[T.min(it * NT + tx, Bq * D - 1) // D, T.min(it * NT + tx, Bq * D - 1) % D] = T.Cast(dtype, T.Select(
                        q0 + T.min(it * NT + tx, Bq * D - 1) // D < Sq,
                        T.Cast("float32", Q[b, h, T.min(q0 + T.min(it * NT + tx, Bq * D - 1) // D, Sq - 1), T.min(it * NT + tx, Bq * D - 1) % D]) * T.float32(SCALE),
                        T.float32(0)))
                    acc[tx, it] = T.float32(0)
                for it in range(NR):
                    m_r[tx, it] = T.float32(NEG_INF)
                    l_r[tx, it] = T.float32(0)
            for kb in range(NKB):
                # Stage the K/V tile (coalesced along D); rows past Sk are zero-filled.
                for tx in threads():
                    for it in range(NKD):
                        Ks[T.min(it * NT + tx, Bk * D - 1) // D, T.min(it * NT + tx, Bk * D - 1) % D] = T.Select(
                            kb * Bk + T.min(it * NT + tx, Bk * D - 1) // D < Sk,
                            K[b, h, T.min(kb * Bk + T.min(it * NT + tx, Bk * D - 1) // D, Sk - 1), T.min(it * NT + tx, Bk * D - 1) % D],
                            T.Cast(dtype, T.float32(0)))
                        Vs[T.min(it * NT + tx, Bk * D - 1) // D, T.min(it * NT + tx, Bk * D - 1) % D] = T.Select(
                            kb * Bk + T.min(it * NT + tx, Bk * D - 1) // D < Sk,
                            V[b, h, T.min(kb * Bk + T.min(it * NT + tx, Bk * D - 1) // D, Sk - 1), T.min(it * NT + tx, Bk * D - 1) % D],
                            T.Cast(dtype, T.float32(0)))
                # Scores: one (i, j) per thread and step; consecutive threads take consecutive j.
                for tx in threads():
                    dot = T.alloc_buffer((1,), "float32", scope=reg)
                    for it in range(NS):
                        dot[0] = T.float32(0)
                        for d in range(D):
                            dot[0] = dot[0] + T.Cast("float32", Qs[T.min(it * NT + tx, Bq * Bk - 1) // Bk, d]) * T.Cast(
                                "float32", Ks[T.min(it * NT + tx, Bq * Bk - 1) % Bk, d])
                        Ss[T.min(it * NT + tx, Bq * Bk - 1) // Bk, T.min(it * NT + tx, Bq * Bk - 1) % Bk] = T.Select(
                            kb * Bk + T.min(it * NT + tx, Bq * Bk - 1) % Bk < Sk,
                            dot[0] + bias(M, b, h, q0 + T.min(it * NT + tx, Bq * Bk - 1) // Bk, kb * Bk + T.min(it * NT + tx, Bq * Bk - 1) % Bk),
                            T.float32(NEG_INF))
                # Online softmax: one query row per thread; m and l stay in that thread's registers.
                # Scores subtract the running max, or 0 while it is still -inf (no finite score yet:
                # -inf - -inf would be NaN); a row all finfo.min (HF's mask value) is an ordinary row.
                for tx in threads():
                    mx = T.alloc_buffer((1,), "float32", scope=reg)
                    base = T.alloc_buffer((1,), "float32", scope=reg)
                    rs = T.alloc_buffer((1,), "float32", scope=reg)
                    for it in range(NR):
                        mx[0] = m_r[tx, it]
                        for j in range(Bk):
                            mx[0] = T.max(mx[0], Ss[T.min(it * NT + tx, Bq - 1), j])
                        base[0] = T.Select(mx[0] < T.float32(LOWEST), T.float32(0), mx[0])
                        rs[0] = T.float32(0)
                        for j in range(Bk):
                            Ps[T.min(it * NT + tx, Bq - 1), j] = exp(Ss[T.min(it * NT + tx, Bq - 1), j] - base[0])
                            rs[0] = rs[0] + Ps[T.min(it * NT + tx, Bq - 1), j]
                        l_r[tx, it] = l_r[tx, it] * exp(m_r[tx, it] - base[0]) + rs[0]
                        corr[T.min(it * NT + tx, Bq - 1)] = exp(m_r[tx, it] - base[0])
                        lsum[T.min(it * NT + tx, Bq - 1)] = l_r[tx, it]
                        m_r[tx, it] = mx[0]
                # acc = acc * corr + P V: one (i, d) per thread and step, coalesced along d.
                for tx in threads():
                    pv = T.alloc_buffer((1,), "float32", scope=reg)
                    for it in range(NQD):
                        pv[0] = T.float32(0)
                        for j in range(Bk):
                            pv[0] = pv[0] + Ps[T.min(it * NT + tx, Bq * D - 1) // D, j] * T.Cast(
                                "float32", Vs[j, T.min(it * NT + tx, Bq * D - 1) % D])
                        acc[tx, it] = acc[tx, it] * corr[T.min(it * NT + tx, Bq * D - 1) // D] + pv[0]
            for tx in threads():
                for it in range(NQD):
                    if it * NT + tx < Bq * D and q0 + (it * NT + tx) // D < Sq:
                        O[b, h, q0 + (it * NT + tx) // D, (it * NT + tx) % D] = T.Cast(
                            dtype, acc[tx, it] / lsum[(it * NT + tx) // D])

    if has_mask:
        @T.prim_func
        def attn_mask(
            Q: T.Buffer((B, H, Sq, D), dtype), K: T.Buffer((B, H, Sk, D), dtype),
            V: T.Buffer((B, H, Sk, D), dtype), M: T.Buffer(mask_shape, dtype),
            O: T.Buffer((B, H, Sq, D), dtype),
        ):
            body(Q, K, V, M, O)

        return attn_mask

    @T.prim_func
    def attn(
        Q: T.Buffer((B, H, Sq, D), dtype), K: T.Buffer((B, H, Sk, D), dtype),
        V: T.Buffer((B, H, Sk, D), dtype), O: T.Buffer((B, H, Sq, D), dtype),
    ):
        body(Q, K, V, None, O)

    return attn


# ----------------------------------------------------------------------------------------------
# Public entry points


def attention_primfunc(
    batch: int,
    heads: int,
    seq_q: int,
    seq_k: int,
    head_dim: int,
    *,
    dtype: str = "float32",
    mask_shape: Sequence[int] | None = None,
    scale: float,
    target: tvm.target.Target,
    block_q: int | None = None,
    block_k: int | None = None,
    max_shared_bytes: int | None = None,
    emulate_cuda: bool = False,
    tile_sizes: tuple[int, int] | None = None,
    value_dim: int | None = None,
) -> tirx.PrimFunc:
    """Build the fused attention PrimFunc ``(Q, K, V[, mask], O)`` for ``target``.

    Q: [B, H, Sq, D]; K: [B, H, Sk, D]; V: [B, H, Sk, Dv], O: [B, H, Sq, Dv] (``value_dim`` Dv, default D;
    another than D on CPU only); mask (optional): any shape broadcastable to
    [B, H, Sq, Sk], same dtype. Tiles default to :func:`choose_tiles` under ``max_shared_bytes``
    (CUDA: 48 KiB unless given; pass :func:`cuda_max_shared_bytes` to use the sm_80/sm_90
    opt-in); raises ValueError when no tile fits, so callers should ask ``choose_tiles`` first.
    ``emulate_cuda`` builds the CUDA algorithm with serial loops for a CPU target (testing only).
    On CPU, batch, heads and the sequences may be symbolic (PrimExprs): the kernel's bounds checks
    cover any size, and the tiles are chosen at ``tile_sizes`` (seq_q, seq_k), the cost model's sizes.
    """
    batch, heads, seq_q, seq_k = (_dim(d) for d in (batch, heads, seq_q, seq_k))
    value_dim = head_dim if value_dim is None else value_dim
    symbolic = not all(isinstance(d, int) for d in (batch, heads, seq_q, seq_k))
    if min(d for d in (batch, heads, seq_q, seq_k, head_dim, value_dim) if isinstance(d, int)) < 1:
        raise ValueError("attention dims must all be >= 1")
    _dtype_bytes(dtype)
    if isinstance(target, (str, dict)):
        target = tvm.target.Target(target)
    shape = _normalize_mask_shape(mask_shape, batch, heads, seq_q, seq_k)
    kind = "cuda" if (target.kind.name == "cuda" or emulate_cuda) else target.kind.name
    if symbolic and kind == "cuda":
        raise ValueError("the CUDA attention kernel is specialised per shape: no symbolic dims")
    if value_dim != head_dim and kind == "cuda":
        raise ValueError(f"the CUDA attention kernel needs V's head size ({value_dim}) equal to Q's ({head_dim})")
    if block_q is None or block_k is None:
        at_q, at_k = tile_sizes if tile_sizes is not None else (seq_q, seq_k)
        if not (isinstance(at_q, int) and isinstance(at_k, int)):
            raise ValueError("symbolic sequence lengths need tile_sizes to choose tiles at")
        tiles = choose_tiles(at_q, at_k, head_dim, dtype, kind, max_shared_bytes, value_dim)
        if tiles is None:
            raise ValueError(
                f"no attention tile fits {max_shared_bytes} bytes for D={head_dim} {dtype} on {kind}")
        block_q = tiles[0] if block_q is None else block_q
        block_k = tiles[1] if block_k is None else block_k
    if block_q < 1 or block_k < 1:
        raise ValueError(f"tiles must be positive, got ({block_q}, {block_k})")
    if kind == "cuda":
        smem = attention_smem_bytes(block_q, block_k, head_dim, dtype)
        limit = max_shared_bytes if max_shared_bytes is not None else (
            cuda_max_shared_bytes(target) if target.kind.name == "cuda" else CUDA_DEFAULT_SHARED_BYTES)
        if smem > limit:
            raise ValueError(f"tiles ({block_q}, {block_k}) need {smem} B of shared memory > {limit}")
        func = _cuda_primfunc(batch, heads, seq_q, seq_k, head_dim, dtype, shape, scale,
                              block_q, block_k, smem > CUDA_DEFAULT_SHARED_BYTES, emulate_cuda)
    elif kind in ("llvm", "c"):
        func = _cpu_primfunc(batch, heads, seq_q, seq_k, head_dim, dtype, shape, scale,
                             block_q, block_k, _cpu_vector_lanes(target), value_dim)
    else:
        raise ValueError(f"no attention kernel for target kind {kind!r}")
    return _with_attrs(func, "fused_attention")


def allocated_buffers(func: tirx.PrimFunc) -> list[tirx.Buffer]:
    """Every buffer a PrimFunc allocates (AllocBuffer statements), walking the whole body.

    TVM 0.27 has no Python ``post_order_visit`` for TIR, hence this small structural walk.
    """
    found: list[tirx.Buffer] = []
    stack: list[object] = [func.body]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if isinstance(node, tirx.AllocBuffer):
            found.append(node.buffer)
        if isinstance(node, tirx.SeqStmt):
            stack.extend(node.seq)
            continue
        for field in ("body", "then_case", "else_case"):
            child = getattr(node, field, None)
            if isinstance(child, tirx.Stmt):
                stack.append(child)
    return found


def _shape_of(expr: relax.Expr, what: str) -> tuple[tuple, str]:
    """A tensor's dims (ints, or PrimExprs where symbolic) and dtype."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        raise ValueError(f"attention {what} needs a tensor with known shape, got {ty}")
    return tuple(_dim(d) for d in ty.shape.values), str(ty.dtype)


def attention_call(
    bb: relax.BlockBuilder | None,
    q: relax.Expr,
    k: relax.Expr,
    v: relax.Expr,
    mask: relax.Expr | None,
    scale: float,
    target: tvm.target.Target,
    *,
    max_shared_bytes: int | None = None,
    name: str = "fused_attention",
    tile_sizes: tuple[int, int] | None = None,
) -> relax.Call:
    """Add the fused kernel to ``bb``'s module and return ``call_tir`` computing attention.

    ``bb`` None means the innermost active BlockBuilder. Symbolic shapes need ``tile_sizes`` (and a
    CPU target): the kernel is then one for every size. The caller emits the returned call.
    """
    bb = bb if bb is not None else relax.BlockBuilder.current()
    if bb is None:
        raise ValueError("attention_call needs a BlockBuilder (none given and none active)")
    (qb, qh, sq, d), dtype = _shape_of(q, "Q")
    (kb_, kh, sk, kd), _ = _shape_of(k, "K")
    vshape, _ = _shape_of(v, "V")
    if not isinstance(d, int):
        raise ValueError(f"attention needs a static head size, got {d}")
    same = len(vshape) == 4 and all(_same_dim(a, b) for a, b in zip((kb_, kh, kd, *vshape[:3]),
                                                                     (qb, qh, d, kb_, kh, sk)))
    if not same or not isinstance(vshape[3], int):
        raise ValueError(f"attention shapes disagree: Q {(qb, qh, sq, d)} K {(kb_, kh, sk, kd)} V {vshape}")
    mask_shape = _shape_of(mask, "mask")[0] if mask is not None else None
    func = attention_primfunc(qb, qh, sq, sk, d, dtype=dtype, mask_shape=mask_shape, scale=scale,
                              target=target, max_shared_bytes=max_shared_bytes, tile_sizes=tile_sizes,
                              value_dim=vshape[3])
    gvar = bb.add_func(func.without_attr("global_symbol"), name)
    args = [q, k, v] + ([mask] if mask is not None else [])
    return relax.call_tir(gvar, args, relax.TensorType((qb, qh, sq, vshape[3]), dtype))
