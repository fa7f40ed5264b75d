"""Register-tiled CPU schedule for matmul / dense / batched matmul with a fused elementwise epilogue.

Why this shape: the untuned legalised matmul is a scalar triple loop (~290x slower than ONNX Runtime).
The micro-kernel keeps an ``mr x nr`` accumulator tile in vector registers (``nr`` a multiple of the
SIMD width, ``mr * nr / lanes`` accumulators leaving registers for the B row and A broadcasts),
streams K, and computes the fused epilogue (bias, GELU, residual) on the tile while it is hot.
Constant weights may be pre-packed into ``[N / w, K, w]`` panels, ``w`` a cache line of columns (or ``nr``
where that is less: :func:`panel_width`), so each panel the tile spans is read as one sequential stream;
the packing is a pure permutation, so results are bit-identical.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.schedule import SBlockRV

from ..hw.hostcpu import HostCPU
from .cpu_elementwise import schedule_spatial_block
from .packing import pack_param_layout
from .tir_analysis import (REDUCE, BufferLoad, inline_around, int_or_none, loads_in, loops_match_iters, simple_index_vars,
                           widened_load)


@dataclass(frozen=True)
class MatmulInfo:
    """Roles of a matmul block's iterators and operands (positions in block.iter_vars / reads)."""

    block: SBlockRV
    batch_iters: tuple[int, ...]
    i_iter: int
    j_iter: int
    k_iter: int
    a_buffer: tvm.ir.Var
    b_buffer: tvm.ir.Var
    b_indices: tuple[int, ...]  # iterator positions indexing B, in B's dimension order
    m: int | None
    n: int | None
    k: int | None
    #: batch iterators directly before the row (block order), of A only and static: rows in all but name
    row_batch: tuple[int, ...] = ()
    #: those iterators merged into the row by `merge_rows` (m is then the merged count)
    rows_merged: bool = False


def match_matmul(sch: s_tir.Schedule, block_rv: SBlockRV, *, integer: bool = False) -> MatmulInfo | None:
    """Recognise ``C[.., i, j] += A[.., i, k] * B[.., k, j]`` (any operand dim order, one reduction); with
    ``integer``, the int32 form ``C += int32(A) * int32(B)`` of 8-bit operands instead of a float one."""
    block = sch.get(block_rv)
    ivs = list(block.iter_vars)
    red = [p for p, iv in enumerate(ivs) if iv.iter_type == REDUCE]
    if len(red) != 1 or block.init is None or not isinstance(block.body, tirx.BufferStore):
        return None
    store = block.body
    if store.buffer.dtype not in (("int32",) if integer else ("float32", "float64")):
        return None
    val = store.value
    if not isinstance(val, tirx.Add):
        return None
    lhs, rhs = val.a, val.b
    if isinstance(rhs, BufferLoad) and rhs.source.same_as(store.buffer):
        lhs, rhs = rhs, lhs
    if not (isinstance(lhs, BufferLoad) and lhs.source.same_as(store.buffer) and isinstance(rhs, tirx.Mul)):
        return None
    unwrap = _int8_load if integer else widened_load
    a, b = unwrap(rhs.a), unwrap(rhs.b)
    if not (isinstance(a, BufferLoad) and isinstance(b, BufferLoad)):
        return None
    var_pos = {iv.var: p for p, iv in enumerate(ivs)}
    c_vars = simple_index_vars(store.indices)
    a_vars = simple_index_vars(a.indices)
    b_vars = simple_index_vars(b.indices)
    if c_vars is None or a_vars is None or b_vars is None or len(c_vars) < 2:
        return None
    if any(v not in var_pos for v in (*c_vars, *a_vars, *b_vars)):
        return None
    k_var = ivs[red[0]].var
    if k_var not in a_vars or k_var not in b_vars or k_var in c_vars:
        return None
    i_var, j_var = c_vars[-2], c_vars[-1]
    # i must index A only, j B only; swap operands when written as B * A.
    if i_var in b_vars and j_var in a_vars and i_var not in a_vars and j_var not in b_vars:
        a, b = b, a
        a_vars, b_vars = b_vars, a_vars
    if not (i_var in a_vars and i_var not in b_vars and j_var in b_vars and j_var not in a_vars):
        return None
    if len(set(c_vars)) != len(c_vars) or set(var_pos) - set(c_vars) != {k_var}:
        return None
    ext = {p: int_or_none(iv.dom.extent) for p, iv in enumerate(ivs)}
    i_var = _row_var(i_var, c_vars[:-2], a_vars, b_vars, {v: ext[var_pos[v]] for v in c_vars})
    batch = tuple(var_pos[v] for v in c_vars if var_pos[v] not in (var_pos[i_var], var_pos[j_var]))
    row_batch: list[int] = []
    if i_var is c_vars[-2]:
        for p in range(var_pos[i_var] - 1, -1, -1):
            v = ivs[p].var
            if p not in batch or v not in a_vars or v in b_vars or ext[p] is None:
                break
            row_batch.insert(0, p)
    return MatmulInfo(
        block=block_rv,
        batch_iters=batch,
        i_iter=var_pos[i_var],
        j_iter=var_pos[j_var],
        k_iter=red[0],
        a_buffer=a.source,
        b_buffer=b.source,
        b_indices=tuple(var_pos[v] for v in b_vars),
        m=ext[var_pos[i_var]],
        n=ext[var_pos[j_var]],
        k=ext[red[0]],
        row_batch=tuple(row_batch),
    )


def merge_rows(sch: s_tir.Schedule, info: MatmulInfo, host: HostCPU, *, pad_columns: bool = False) -> MatmulInfo:
    """The matmul as one with its A-only batch iterators merged into the rows, where the row tile divides the
    row count (a tile never straddles two batch entries).

    An NHWC activation times a weight ([1, 7, 7, 768] x [768, 3072]: ConvNeXt's pointwise MLP) otherwise tiles
    the 7-wide W and runs the B panel once per H: 7 x 9.4 MB of weights a call, 89 GFLOP/s against 186 at
    14x14 (ConvNeXt-T, 2-core Sapphire Rapids); merged, each B panel serves all 49 rows."""
    if not info.row_batch or info.m is None or info.rows_merged:
        return info
    ivs = sch.get(info.block).iter_vars
    rows = info.m * math.prod(int(ivs[p].dom.extent) for p in info.row_batch)     # static: match_matmul
    merged = replace(info, m=rows, batch_iters=tuple(p for p in info.batch_iters if p not in info.row_batch),
                     rows_merged=True)
    tiles = choose_tiles(merged, host, pad_columns=pad_columns)
    if tiles.pad_n or info.m % tiles.mr or rows_padded(merged, tiles):
        return info
    return merged


def _int8_load(expr: object) -> object:
    """The 8-bit load under an int32 cast (an integer matmul's operand), else `expr`."""
    if isinstance(expr, tirx.Cast) and isinstance(expr.value, BufferLoad) \
            and str(expr.value.source.dtype) in ("int8", "uint8") and str(expr.ty.dtype) == "int32":
        return expr.value
    return expr


#: Fewest rows a matmul's row iterator must have to stay the tile's row; below it a batch iterator that the
#: weight does not depend on takes the role. A sequence-first activation ([tokens, batch 1, hidden] x a
#: [hidden, N] weight: torchvision's MultiheadAttention in-projection) tiled its 1-row M: one row a tile, B
#: reloaded for each of the 197 tokens, 42 GFLOP/s against 130 for the model's other matmuls (ViT-B/16, Zen3).
MIN_TILE_ROWS = 4


def _row_var(i_var: tirx.Var, batch: Sequence[tirx.Var], a_vars: Sequence[tirx.Var], b_vars: Sequence[tirx.Var],
             ext: dict[tirx.Var, int | None]) -> tirx.Var:
    """The iterator the register tile runs its rows over: the output's row, or, when that has fewer than
    MIN_TILE_ROWS, the longest batch iterator of A that B does not depend on (rows of A all the same)."""
    rows = ext[i_var]
    if rows is None or rows >= MIN_TILE_ROWS:
        return i_var
    shared = [v for v in batch if v in a_vars and v not in b_vars and (ext[v] or 0) > rows]
    return max(shared, key=lambda v: ext[v] or 0) if shared else i_var


@dataclass(frozen=True)
class MatmulTiles:
    mr: int  # unrolled output rows
    nr: int  # vectorised output columns (a multiple of the SIMD width when N allows)
    pad_n: bool = False     # a static N padded to whole column tiles (see choose_tiles)


#: Bytes of one packed weight panel's row: a cache line. A tile wider than a line reads one line a reduction
#: step from each of several panels, so a weight streamed from L3 or DRAM comes in as that many sequential
#: streams. Packed as one 32-column panel (one stream, two lines a step), a chain of M=16 768x3072 MatMuls with
#: 75 MB of weights ran 1.23x ONNX Runtime (14 GB/s against 18); as two 16-column panels 1.03x, and 0.94x of
#: the one-panel time at M=128 (SPR class, 2 threads, interleaved in one process). AVX2's 16-column tile is
#: one line already.
PANEL_BYTES = 64


def panel_width(nr: int, bits: int = 32) -> int:
    """Columns a packed panel holds for an ``nr``-column tile: one cache line of them where the tile is a
    whole number of lines, else the tile (:data:`PANEL_BYTES`)."""
    line = PANEL_BYTES * 8 // bits
    return line if nr > line and nr % line == 0 else nr


def b_panel_width(info: MatmulInfo, nr: int) -> int:
    """:func:`panel_width` for the matmul's B operand at its element width."""
    return panel_width(nr, tvm.DataType(str(info.b_buffer.dtype)).bits)


def choose_tiles(info: MatmulInfo, host: HostCPU, *, pad_columns: bool = False) -> MatmulTiles:
    """Register tile from the vector ISA: accumulators use about half the registers.

    Measured on Zen 4 (AVX-512, 32 registers) and Zen 1 (AVX2, 16): 4x(2*lanes) was the best
    single shape for the BERT/MLP sizes; smaller N or M shrink the tile to divide the extents.

    With ``pad_columns`` (B is not a constant, so its copy padded to whole tiles costs a pass over one
    operand, not a weight per call), a static N no full vector divides is padded: ViT's 197-token scores
    ``Q K^T`` got 1-column tiles, scalar code at 20 GFLOP/s, 5.9 ms a layer in the unfused build (Zen3).
    """
    lanes = host.fp32_lanes
    nr_pref = 2 * lanes
    mr_pref = 6 if host.vector_registers >= 32 else 4
    n, m = info.n, info.m

    nr = 1
    for cand in (nr_pref, lanes, lanes // 2 or 1, 8, 4, 2):
        if cand and n is not None and n % cand == 0:
            nr = cand
            break
    else:
        nr = lanes if n is None else 1
    pad_n = pad_columns and n is not None and nr < lanes and n > lanes
    if pad_n:
        nr = nr_pref if n >= nr_pref else lanes
    # A row count with no divisor of 3 or more up to the preferred height (197 tokens) keeps the preferred
    # height and is padded to whole tiles (rows_padded): a 1-row tile reloads B for every row (2.9x ORT).
    mr = mr_pref
    for cand in (mr_pref, 8, 4, 7, 6, 3):     # 7: 7x7 maps (ConvNeXt's last stage)
        if m is not None and m % cand == 0 and cand <= mr_pref + 2:
            mr = cand
            break
    return MatmulTiles(mr=mr, nr=nr, pad_n=pad_n)


def _divisible(extent: int | None, factor: int) -> bool:
    return extent is not None and extent % factor == 0


def schedule_matmul(
    sch: s_tir.Schedule,
    info: MatmulInfo,
    host: HostCPU,
    *,
    tiles: MatmulTiles | None = None,
    pack_b: bool = False,
    parallel: bool = True,
    pad_columns: bool = False,
) -> bool:
    """Apply the register-tiled schedule; ``pack_b`` also rewrites B's parameter layout to panels."""
    tiles = tiles or choose_tiles(info, host, pad_columns=pad_columns)
    # Inline producers (transposes, pads) and the elementwise chain after the matmul; keep the matmul.
    around = inline_around(sch, info.block)
    if around is None:
        return False
    mm, epilogue = around
    given = epilogue is not None
    padded_n = False
    if info.m is None or info.n is None or rows_padded(info, tiles) or tiles.pad_n:
        mm, epilogue, padded_n = _pad_symbolic(sch, mm, epilogue, info, tiles)
    if epilogue is None:
        # Accumulate into a tile-local buffer; writing the output in place per k-step would go to memory.
        epilogue = sch.cache_write(mm, 0, "global")
    elif not elementwise_on(sch, epilogue, mm):
        return False
    tile_out, apart = epilogue, None
    if given and padded_n and not parallel and info.n is not None and info.n % tiles.nr and info.n > tiles.nr:
        # Serial, columns padded (LLaMA-tiny's 344): the epilogue as its own loop over the real columns, rows
        # in whole vectors and a tail, the tiles storing whole padded vectors. Bounded inside the tile, every
        # vector of it was gcd(344, 32) = 8 lanes wide and the SiLU-gated kernel ran 62 us against 56 for its
        # unfused parts (SPR class).
        tile_out, apart = sch.cache_write(mm, 0, "global"), epilogue

    loops = sch.get_loops(mm)
    if not loops_match_iters(sch, mm):
        return False
    batch = [loops[p] for p in info.batch_iters]
    li, lj, lk = loops[info.i_iter], loops[info.j_iter], loops[info.k_iter]
    if info.rows_merged:        # merge_rows: the A-only batch loops and the row loop as one
        li = sch.fuse(*[loops[p] for p in info.row_batch], li)
    mr = tiles.mr if info.m is None or tiles.mr <= info.m else info.m
    nr = tiles.nr
    io, ii = sch.split(li, [None, mr])
    jo, ji = sch.split(lj, [None, nr])
    # K blocking (ko outside the tile loops) was measured: no gain at BERT/MLP sizes, so none.
    sch.reorder(*batch, jo, io, lk, ii, ji)
    k_loop = lk
    sch.reverse_compute_at(tile_out, io, preserve_unit_loops=True)
    panel = b_panel_width(info, nr) if pack_b else nr
    if pack_b:
        pack_param_layout(sch, mm, info.b_buffer, info.b_indices.index(info.j_iter), panel)
    # Loop annotations go on before decompose_reduction: the update block alone is no longer a
    # complete reduction and vectorize/parallel refuse subtrees holding it.
    vec = _divisible(info.n, nr) or padded_n
    if parallel:
        sch.parallel(sch.fuse(*batch, jo, io))
    _vectorize_tile(sch, mm, tile_out, info, nr, vec=vec, bounded=padded_n and apart is None, panel=panel)
    if apart is not None:
        schedule_spatial_block(sch, apart, host, num_threads=1)
    return True


def _vectorize_tile(sch: s_tir.Schedule, mm: SBlockRV, epilogue: SBlockRV, info: MatmulInfo, nr: int, *,
                    vec: bool, bounded: bool, panel: int | None = None) -> None:
    """Unroll the tile's rows, vectorise its columns (a vector per packed panel where a tile spans several,
    :func:`panel_width`), the copy-out's too (in whole gcd(n, nr) vectors where it is bounded by the real
    columns: a vector no bound splits needs no per-lane test), then hoist the init."""
    loops = sch.get_loops(mm)
    k_loop, ii, ji = loops[-3], loops[-2], loops[-1]
    sch.unroll(ii)
    if vec and panel is not None and panel < nr:
        jp, jl = sch.split(ji, [None, panel])
        sch.reorder(jp, ii)
        sch.unroll(jp)
        sch.vectorize(jl)
    elif vec:
        sch.vectorize(ji)
    tile_loops = sch.get_loops(epilogue)[-2:]
    whole = math.gcd(info.n, nr) if bounded and info.n is not None else nr
    if vec and 4 <= whole < nr:
        sch.vectorize(sch.split(tile_loops[-1], [None, whole])[1])
    elif vec:
        sch.vectorize(tile_loops[-1])
    init = sch.decompose_reduction(mm, k_loop)
    iloops = sch.get_loops(init)
    if vec and sch.get(iloops[-1]).kind != tirx.ForKind.VECTORIZED:
        sch.vectorize(iloops[-1])


def rows_padded(info: MatmulInfo, tiles: MatmulTiles) -> bool:
    """A static row count that is not a whole number of row tiles (ViT's 197 tokens) is padded as a
    symbolic one is: split with a predicate, the tail test sat in the micro-kernel and a 197-row MLP ran
    2.9x ONNX Runtime against 1.04x at 196 rows (Zen3)."""
    return info.m is not None and info.m > tiles.mr and info.m % tiles.mr != 0


def _pad_symbolic(sch: s_tir.Schedule, mm: SBlockRV, epilogue: SBlockRV | None, info: MatmulInfo,
                  tiles: MatmulTiles) -> tuple[SBlockRV, SBlockRV | None, bool]:
    """A symbolic row (or column) count: pad the matmul's domain to whole tiles (`pad_einsum`), so the
    micro-kernel runs without a bound check and its accumulator tile stays in registers; only the copy out
    (inlined into the epilogue) is bounded. Split with a predicate instead, the tile was not compacted and
    the 768x768 projection of BERT ran 2.3x slower than its static build (seq 128, Zen4).

    Padded rows read A as 0 (the pad producer is inlined: one select per broadcast A element); padded
    columns read a zero-padded copy of B (a vector select per load would cost more than the copy)."""
    block = sch.get(mm)
    pads = [1] * len(block.iter_vars)
    if info.m is None or rows_padded(info, tiles):
        pads[info.i_iter] = tiles.mr
    padded_n = info.n is None or tiles.pad_n
    if padded_n:
        pads[info.j_iter] = tiles.nr
    name = block.name_hint
    sch.pad_einsum(mm, pads)
    mm = sch.get_sblock(name)
    # a constant B widened at compile time (`widen_param`) needs no copy: pad_einsum's is a plain one
    b_wide = padded_n and info.n is not None and \
        int_or_none(info.b_buffer.shape[info.b_indices.index(info.j_iter)]) == round_up(info.n, tiles.nr)
    for producer in sch.get_producers(mm):
        reads_b = any(r.source.same_as(info.b_buffer) for r in sch.get(producer).reads)
        if padded_n and reads_b and not b_wide:
            _schedule_pad_copy(sch, producer, tiles.nr)
            continue
        sch.compute_inline(producer)
    (copy,) = sch.get_consumers(mm)
    if epilogue is None:
        return mm, copy, padded_n
    sch.compute_inline(copy)
    return mm, epilogue, padded_n


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def widen_param(func: tirx.PrimFunc, buffer: tirx.Buffer, dim: int, extent: int) -> tirx.PrimFunc:
    """``func`` with parameter ``buffer`` ``extent`` long along ``dim`` (its reads unchanged): a constant
    weight whose columns no vector divides is zero-padded to whole column tiles at compile time
    (`packing.pad_columns`), so the padded matmul reads it with no copy and no bound check. At 8-column
    tiles (the widest dividing 344), LLaMA-tiny's 128 -> 344 gate and up projections ran 86 GFLOP/s
    against 155 at 352 columns (one core, SPR class)."""
    shape = list(buffer.shape)
    shape[dim] = tirx.IntImm(str(shape[dim].ty), extent)
    wide = tirx.decl_buffer(shape, buffer.dtype, buffer.name, elem_offset=buffer.elem_offset,
                            data_alignment=buffer.data_alignment, offset_factor=buffer.offset_factor)

    def _swap(var: tvm.ir.expr.Var, mutator) -> tvm.ir.expr.Var:  # noqa: ANN001 - tvm_ffi mutator handle
        return wide if var.same_as(buffer) else var

    return tvm_ffi.structural_mutate(func, (tvm.ir.expr.Var, _swap))


def _schedule_pad_copy(sch: s_tir.Schedule, copy: SBlockRV, nr: int) -> None:
    """B's zero-padded copy: rows in parallel, the padded columns (whole tiles) as vectors. Left as TVM made
    it, the copy of ViT's K^T (12 x 64 x 208) ran serial and scalar."""
    loops = sch.get_loops(copy)
    if len(loops) > 1:
        sch.parallel(sch.fuse(*loops[:-1]))
    if _divisible(int_or_none(sch.get(loops[-1]).extent), nr):
        sch.vectorize(sch.split(loops[-1], [None, nr])[1])


def clamp_padded_rows(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`if_then_else(i < m, A[.., i, ..], 0)` (a padded row's read, inlined by `_pad_symbolic`) ->
    `A[.., min(i, m - 1), ..]`. A padded row then computes row m-1 again instead of zeros; its results
    are never stored (the copy out is bounded), and the read needs no branch. With the select, LLVM
    branched per row per k-step and spilled the broadcasts: the symbolic MLP ran 2.4x its static build
    (Zen3, AVX2; Zen4's masked AVX-512 loads hid it)."""
    def _call(call: tvm.ir.expr.Call, mutator) -> tvm.ir.PrimExpr:  # noqa: ANN001 - tvm_ffi mutator handle
        args = [mutator.mutate(a) for a in call.args]
        if getattr(call.op, "name", "") == "prim.if_then_else" and len(args) == 3:
            cond, then, other = args
            if isinstance(cond, tirx.LT) and isinstance(then, BufferLoad) and isinstance(other, tirx.FloatImm) \
                    and other.value == 0.0:
                hits = [p for p, e in enumerate(then.indices) if e.same_as(cond.a)]
                if len(hits) == 1:
                    idx = list(then.indices)
                    idx[hits[0]] = tirx.min(cond.a, cond.b - 1)
                    return tirx.BufferLoad(then.source, idx)
        if all(a.same_as(b) for a, b in zip(args, call.args)):
            return call
        return tvm.ir.expr.Call(call.op, args, call.attrs, call.ty_args, call.span, ret_ty=call.ty)

    return tvm_ffi.structural_mutate(func, (tvm.ir.expr.Call, _call))


def elementwise_on(sch: s_tir.Schedule, epi: SBlockRV, mm: SBlockRV) -> bool:
    """The epilogue must read the matmul result at the point it writes (so it fits the tile)."""
    eb = sch.get(epi)
    mb = sch.get(mm)
    if not all(iv.iter_type == tirx.IterVar.DataPar for iv in eb.iter_vars):
        return False
    if not isinstance(eb.body, tirx.BufferStore):
        return False
    out_vars = simple_index_vars(eb.body.indices)
    if out_vars is None:
        return False
    for load in loads_in(eb.body.value):
        if load.source.same_as(mb.body.buffer):
            if simple_index_vars(load.indices) != out_vars:
                return False
    return True
