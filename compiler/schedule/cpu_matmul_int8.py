"""int8 GEMM on VNNI: u8 activations times s8 weights, four products summed into each int32 lane by one
`vpdpbusd`, for the integer matmuls of QDQ models (compiler/passes/int8_gemm.py writes them).

Why: in fp32 on the dequantised grid a QDQ transformer runs at its fp32 model's speed, and ONNX Runtime's
u8s8 kernels ran the QDQ BERT encoder 2.3x faster than that (Sapphire Rapids). `vpdpbusd` does 64
multiply-adds an instruction against 16 for an fp32 FMA; a 128x768x768 GEMM measured 670 GOP/s with this
tile on two Sapphire Rapids cores against ~300 GFLOP/s for fuseguard's fp32 micro-kernel.

The tile: ``mr`` rows x ``nt`` vectors of ``lanes`` int32 accumulators, K in steps of 4. The weight is
packed at compile time as ``[N / lanes, K / 4, lanes, 4]`` so each step loads one vector of 4*lanes
int8 and broadcasts 4 bytes of a row of A. The epilogue (the dequantize, bias, activation ...) runs on
the tile while it is in registers, as the fp32 micro-kernel's does.

TVM ships this dot product (`tvm.s_tir.tensor_intrin.x86`), but its implementation calls
`llvm.x86.avx512.vpdpbusd.512` with `<16 x i32>` operands, which the LLVM in the 0.27 wheel refuses
("Call parameter type does not match function signature": the intrinsic takes `<64 x i8>` now), and binds
its operands to named values, which TVMScript turns into stack buffers (the 128x768x768 GEMM ran 4x
slower). The implementation here is one expression.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx
from tvm.script import tirx as T
from tvm.s_tir import TensorIntrin

from ..hw.hostcpu import HostCPU, host_from_target
from .cpu_matmul import MatmulInfo, elementwise_on, match_matmul
from .tir_analysis import inline_around, int_or_none, loops_match_iters

#: products summed into one int32 lane by a vpdpbusd
K_STEP = 4


def vnni_lanes(host: HostCPU) -> int:
    """int32 lanes of the host's vpdpbusd: 16 with AVX512-VNNI, 8 with AVX-VNNI (256-bit), 0 without."""
    if {"avx512_vnni", "avx512f"} <= host.features:
        return 16
    if "avx_vnni" in host.features or {"avx512_vnni", "avx512vl"} <= host.features:
        return 8
    return 0


@functools.cache
def intrinsic(lanes: int) -> str:
    """Register (once) the `lanes` x 4 u8*s8 -> i32 dot product; its name for `tensorize`."""
    llvm_name = {16: "llvm.x86.avx512.vpdpbusd.512", 8: "llvm.x86.avx512.vpdpbusd.256"}[lanes]
    width = K_STEP * lanes

    @T.prim_func(s_tir=True)
    def desc(a: T.Buffer((K_STEP,), "uint8", offset_factor=1), b: T.Buffer((lanes, K_STEP), "int8", offset_factor=1),
             c: T.Buffer((lanes,), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(c[0:lanes], a[0:K_STEP], b[0:lanes, 0:K_STEP])
            T.writes(c[0:lanes])
            for i in T.serial(0, lanes):
                for k in T.serial(0, K_STEP):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        c[vi] = c[vi] + T.cast(a[vk], "int32") * T.cast(b[vi, vk], "int32")

    @T.prim_func(s_tir=True)
    def impl(a: T.Buffer((K_STEP,), "uint8", offset_factor=1), b: T.Buffer((lanes, K_STEP), "int8", offset_factor=1),
             c: T.Buffer((lanes,), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(c[0:lanes], a[0:K_STEP], b[0:lanes, 0:K_STEP])
            T.writes(c[0:lanes])
            c[T.ramp(T.int32(0), 1, lanes)] = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id(llvm_name), c.vload([0], dtype=f"int32x{lanes}"),
                T.reinterpret(T.broadcast(T.reinterpret(a.vload([0], "uint8x4"), dtype="int32"), lanes),
                              dtype=f"int8x{width}"),
                b.vload([0, 0], dtype=f"int8x{width}"), dtype=f"int32x{lanes}")

    name = f"fuseguard_vnni_{lanes}x{K_STEP}"
    TensorIntrin.register(name, desc, impl, override=True)
    return name


@dataclass(frozen=True)
class Int8Tiles:
    mr: int          # rows of the register tile
    nt: int          # accumulator vectors per row
    lanes: int       # int32 lanes of a vector
    pad_rows: bool   # M padded to whole row tiles (A copied into a padded buffer first)

    @property
    def nr(self) -> int:
        return self.nt * self.lanes


def match_int8_matmul(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> MatmulInfo | None:
    """`C[.., i, j] += int32(A[.., i, k]) * int32(B[k, j])` with A uint8 and a 2-D int8 B."""
    info = match_matmul(sch, block, integer=True)
    if info is None or str(info.a_buffer.dtype) != "uint8" or str(info.b_buffer.dtype) != "int8" \
            or len(info.b_indices) != 2:
        return None
    return info


def choose_int8_tiles(info: MatmulInfo, host: HostCPU) -> Int8Tiles | None:
    """None when the shapes do not fit the kernel (K not whole steps, N not whole vectors, any symbolic).

    Measured on Sapphire Rapids (2 cores, 128x768x768, GOP/s): 8x3 673, 4x3 666, 8x2 660, 4x4 641, 4x2 587,
    2x4 567: 24 accumulators of 32 registers, as the fp32 tile. AVX-VNNI's 16 registers take 4x2."""
    lanes = vnni_lanes(host)
    if not lanes or info.m is None or info.k is None or info.n is None or info.k % K_STEP or info.n % lanes:
        return None
    vectors = info.n // lanes
    big = host.vector_registers >= 32
    nt = next(t for t in ((3, 2, 1) if big else (2, 1)) if vectors % t == 0)
    mr_pref = 8 if big else 4
    m = info.m
    if m is not None and m <= mr_pref:
        return Int8Tiles(mr=m, nt=nt, lanes=lanes, pad_rows=False)
    for cand in ((8, 6, 4) if big else (4, 3)):
        if m is not None and m % cand == 0:
            return Int8Tiles(mr=cand, nt=nt, lanes=lanes, pad_rows=False)
    return Int8Tiles(mr=mr_pref, nt=nt, lanes=lanes, pad_rows=True)


def vnni_index_map(k_dim: int, lanes: int):  # noqa: ANN201 - an index-map lambda
    """B[k, j] (or B[j, k]) -> Bp[j // lanes, k // 4, j % lanes, k % 4]: one vector load per k-step."""
    def index_map(d0: tirx.Var, d1: tirx.Var) -> list[tirx.Expr]:
        k, j = (d0, d1) if k_dim == 0 else (d1, d0)
        return [j // lanes, k // K_STEP, j % lanes, k % K_STEP]

    return index_map


def schedule_matmul_int8(sch: s_tir.Schedule, info: MatmulInfo, tiles: Int8Tiles, *, parallel: bool = True) -> bool:
    """The VNNI tile (module docstring); B's parameter is re-laid out (compiler/schedule/packing.py packs
    the constant to match)."""
    around = inline_around(sch, info.block)
    if around is None:
        return False
    mm, epilogue = around
    if tiles.pad_rows:
        mm, epilogue = _pad_rows(sch, mm, epilogue, info, tiles.mr)
    if epilogue is None:
        epilogue = sch.cache_write(mm, 0, "global")
    elif not elementwise_on(sch, epilogue, mm):
        return False
    if not loops_match_iters(sch, mm):
        return False
    b_read = next(i for i, r in enumerate(sch.get(mm).reads) if r.source.same_as(info.b_buffer))
    k_dim = info.b_indices.index(info.k_iter)
    sch.transform_layout(mm, ("read", b_read), vnni_index_map(k_dim, tiles.lanes))
    loops = sch.get_loops(mm)
    batch = [loops[p] for p in info.batch_iters]
    li, lj, lk = loops[info.i_iter], loops[info.j_iter], loops[info.k_iter]
    io, ii = sch.split(li, [None, tiles.mr])
    jo, jt, ji = sch.split(lj, [None, tiles.nt, tiles.lanes])
    ko, ki = sch.split(lk, [None, K_STEP])
    sch.reorder(*batch, jo, io, ko, ii, jt, ji, ki)
    sch.reverse_compute_at(epilogue, io, preserve_unit_loops=True)
    if parallel:
        sch.parallel(sch.fuse(*batch, jo, io))
    init = sch.decompose_reduction(mm, ko)
    sch.tensorize(sch.blockize(ji), intrinsic(tiles.lanes))
    sch.unroll(ii)
    sch.unroll(jt)
    sch.vectorize(sch.get_loops(epilogue)[-1])
    sch.vectorize(sch.get_loops(init)[-1])
    return True


def _pad_rows(sch: s_tir.Schedule, mm, epilogue, info: MatmulInfo, mr: int):  # noqa: ANN001, ANN202 - block RVs
    """M (no divisor near the tile height: ViT's 197 tokens) padded to whole row tiles: A is copied
    into a zero-padded buffer (M*K bytes, against the M*N*K work) and the copy out is inlined into the
    epilogue. The copy cannot be inlined into the kernel as the fp32 tile's is: a select around A's load is
    not the dot product `tensorize` matches."""
    block = sch.get(mm)
    pads = [1] * len(block.iter_vars)
    pads[info.i_iter] = mr
    name = block.name_hint
    sch.pad_einsum(mm, pads)
    mm = sch.get_sblock(name)
    for producer in sch.get_producers(mm):
        # serial: M*K bytes copy in a few microseconds, and a parallel region of its own cost each call a
        # second wake-up of the pool (ViT int8, 197 rows: 0.80 ms a model with the copies parallel, pools
        # not spinning, against 0.38 spinning; Sapphire Rapids)
        loops = sch.get_loops(producer)
        if (int_or_none(sch.get(loops[-1]).extent) or 0) % 64 == 0:
            sch.vectorize(sch.split(loops[-1], [None, 64])[1])
    (copy,) = sch.get_consumers(mm)
    if epilogue is None:
        return mm, copy
    sch.compute_inline(copy)
    return mm, epilogue


def supported(target: tvm.target.Target) -> int:
    """vpdpbusd lanes of the CPU `target` names (0: no integer kernel, the fp32 route stays)."""
    return vnni_lanes(host_from_target(target))
