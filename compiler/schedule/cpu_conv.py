"""Direct CPU schedule for 2-D convolution (NCHW, any groups/stride/dilation) with fused epilogue.

Why this shape: the legalised conv is a 7-deep scalar loop nest (~40x slower than ONNX Runtime).
The micro-kernel treats conv as a GEMM without materialising im2col: output channels are the
vectorised axis (``nr`` = 1-2 SIMD vectors), ``mr`` output columns are unrolled, and the reduction runs
over (in-channel, ky, kx). Weights, being constants, are packed to ``[OC/nr, IC, KH, KW, nr]`` so each
step is one contiguous vector load plus ``mr`` input broadcasts. The accumulator tile is laid out
with channels innermost so it stays in registers; the fused BN/bias/ReLU epilogue runs on the tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.s_tir.schedule import SBlockRV

from ..hw.hostcpu import HostCPU
from .cpu_elementwise import schedule_spatial_block
from .packing import pack_param_layout
from .tir_analysis import (REDUCE, BufferLoad, inline_around, int_or_none, loops_match_iters, simple_index_vars,
                           try_inline_all, widened_load)


@dataclass(frozen=True)
class ConvInfo:
    block: SBlockRV
    n_iter: int
    f_iter: int
    y_iter: int
    x_iter: int
    red_iters: tuple[int, ...]
    w_buffer: object
    f_dim: int  # which dimension of W the output channel indexes
    oc: int | None
    ow: int | None
    ic: int | None = None           # reduction extent over input channels (per group)
    oh: int | None = None
    kernel_area: int | None = None  # kh * kw
    pointwise: bool = False         # 1x1, stride 1, unpadded: O[n, f, y, x] += I[n, rc, y, x] * W[f, rc, 0, 0]
    in_bytes: int | None = None     # the input the conv reads (padded copy included), one image
    group_out: int | None = None    # output channels per group of a grouped conv (input channel f // it * ic + rc)


def match_conv2d(sch: s_tir.Schedule, block_rv: SBlockRV) -> ConvInfo | None:
    """``O[n, f, y, x] += I[...] * W[f, c, ky, kx]`` with 4 spatial and 3 reduction iterators."""
    block = sch.get(block_rv)
    ivs = list(block.iter_vars)
    kinds = ["R" if iv.iter_type == REDUCE else "S" for iv in ivs]
    if kinds != ["S", "S", "S", "S", "R", "R", "R"] or block.init is None:
        return None
    store = block.body
    if not isinstance(store, tirx.BufferStore) or str(store.buffer.dtype) != "float32":
        return None
    val = store.value
    if not isinstance(val, tirx.Add):
        return None
    acc, prod = val.a, val.b
    if not (isinstance(acc, BufferLoad) and acc.source.same_as(store.buffer) and isinstance(prod, tirx.Mul)):
        return None
    out_vars = simple_index_vars(store.indices)
    var_pos = {iv.var: p for p, iv in enumerate(ivs)}
    if out_vars is None or [var_pos.get(v) for v in out_vars] != [0, 1, 2, 3]:
        return None
    for w, d in ((widened_load(prod.b), widened_load(prod.a)), (widened_load(prod.a), widened_load(prod.b))):
        if not (isinstance(w, BufferLoad) and isinstance(d, BufferLoad)):
            continue
        w_vars = simple_index_vars(w.indices)
        if w_vars is None or len(w_vars) != 4:
            continue
        pos = [var_pos.get(v) for v in w_vars]
        unit = {iv.var for iv in ivs if int_or_none(iv.dom.extent) == 1}
        d_pos = [_unit_stride_pos(e, var_pos, unit) for e in d.indices]
        group = _grouped_channel(d.indices[1], ivs[1].var, ivs[4].var) if len(d.indices) == 4 else None
        pointwise = d_pos == [0, 4, 2, 3] or (group is not None and [d_pos[0], *d_pos[2:]] == [0, 2, 3])
        if pos == [1, 4, 5, 6]:
            return ConvInfo(
                block=block_rv,
                n_iter=0,
                f_iter=1,
                y_iter=2,
                x_iter=3,
                red_iters=(4, 5, 6),
                w_buffer=w.source,
                f_dim=0,
                oc=int_or_none(ivs[1].dom.extent),
                ow=int_or_none(ivs[3].dom.extent),
                ic=int_or_none(ivs[4].dom.extent),
                oh=int_or_none(ivs[2].dom.extent),
                kernel_area=_area(int_or_none(ivs[5].dom.extent), int_or_none(ivs[6].dom.extent)),
                pointwise=pointwise and _area(int_or_none(ivs[5].dom.extent), int_or_none(ivs[6].dom.extent)) == 1,
                in_bytes=image_bytes(d.source),
                group_out=group,
            )
    return None


def _unit_stride_pos(expr: object, var_pos: dict, unit: set) -> int | None:
    """The iterator position an index reads with stride 1 (`y`, `y + ry` with ry of extent 1, `y * 1`),
    else None: how a 1x1 stride-1 conv indexes its input, padded or not."""
    if isinstance(expr, tirx.Var):
        return var_pos.get(expr)
    if isinstance(expr, tirx.Add):
        for a, b in ((expr.a, expr.b), (expr.b, expr.a)):
            if isinstance(b, tirx.Var) and b in unit or isinstance(b, tirx.IntImm) and b.value == 0:
                return _unit_stride_pos(a, var_pos, unit)
    if isinstance(expr, tirx.Mul) and isinstance(expr.b, tirx.IntImm) and expr.b.value == 1:
        return _unit_stride_pos(expr.a, var_pos, unit)
    return None


def _grouped_channel(expr: object, f_var: tirx.Var, rc_var: tirx.Var) -> int | None:
    """Output channels per group when the input channel index is TOPI's grouped form ``f // Fg * Cg + rc``."""
    if not isinstance(expr, tirx.Add):
        return None
    for a, b in ((expr.a, expr.b), (expr.b, expr.a)):
        if isinstance(b, tirx.Var) and b.same_as(rc_var) and isinstance(a, tirx.Mul) and \
                isinstance(a.b, tirx.IntImm) and isinstance(a.a, tirx.FloorDiv):
            fd = a.a
            if isinstance(fd.a, tirx.Var) and fd.a.same_as(f_var) and isinstance(fd.b, tirx.IntImm):
                return int(fd.b.value)
    return None


def image_bytes(buffer) -> int | None:  # noqa: ANN001 - a tirx.Buffer
    """Bytes of one image of a float32 NCHW buffer (None with a symbolic dim)."""
    dims = [int_or_none(d) for d in buffer.shape[1:]]
    return None if None in dims else 4 * math.prod(dims)   # type: ignore[arg-type]


def tile_in_group(info: ConvInfo, nr: int) -> bool:
    """A channel tile of ``nr`` stays inside one group (always, for a conv without groups): every lane reads the
    same input channel. Across two groups each lane reads its own, a gather per step (ShuffleNet's grouped
    1x1s ran at 0.5 GFLOP/s so on the channel-vector kernel)."""
    return info.group_out is None or info.group_out % nr == 0


#: Share of L2 the weights of one block of output-channel tiles may take (see :func:`channel_block`).
CHANNEL_BLOCK_L2_SHARE = 0.5


def channel_block(info: ConvInfo, host: HostCPU, nr: int) -> int | None:
    """Output-channel tiles per block when the input image does not stay in L2 while every tile reads it,
    so a block of tiles (their weights within half of L2) shares each input row; None to keep the order
    channel tile outermost.

    Why: with the channel tile outermost, each 8-channel tile streams the whole input from L3: the stride-2
    512 -> 1024 1x1 on 28x28 (800 KB of input read 128 times) ran at 46 GFLOP/s, 1.55x ONNX Runtime (Zen3)."""
    if info.in_bytes is None or info.ic is None or info.kernel_area is None or info.oc is None or not host.l2_bytes:
        return None
    if info.in_bytes <= host.l2_bytes * CHANNEL_BLOCK_L2_SHARE:
        return None
    tiles = info.oc // nr
    panel = nr * info.ic * info.kernel_area * 4
    most = max(1, int(host.l2_bytes * CHANNEL_BLOCK_L2_SHARE // panel))
    block = max(k for k in range(1, min(most, tiles) + 1) if tiles % k == 0)
    return block if block > 1 else None


def _area(kh: int | None, kw: int | None) -> int | None:
    return kh * kw if kh is not None and kw is not None else None


def conv_tiles(info: ConvInfo, host: HostCPU, *, search: bool = False) -> tuple[int, int]:
    """(mr output columns, nr output channels): about half the vector registers as accumulators.

    With ``search`` the pair is chosen jointly (see :func:`search_conv_tiles`).
    """
    if search:
        return search_conv_tiles(info, host)
    lanes = host.fp32_lanes
    nr = 1
    for cand in (2 * lanes, lanes, 8, 4):
        if _channel_tile_fits(info, cand):
            nr = cand
            break
    budget = (host.vector_registers // 2 + 4) // max(1, nr // lanes)  # accumulator vectors per column
    mr = 1
    for cand in (8, 7, 6, 5, 4, 3, 2):
        if cand <= budget and info.ow is not None and info.ow % cand == 0:
            mr = cand
            break
    return mr, nr


def _channel_tile_fits(info: ConvInfo, nr: int) -> bool:
    """``nr`` output channels a tile: they divide the channels, and a group's (:func:`tile_in_group`). Chosen
    by the channels alone, RegNetY-400MF's grouped 3x3 convs (8 channels a group, 48 and 208 channels) took
    16-channel tiles, which no group holds, and fell to the per-plane rule at 7-13 GFLOP/s: 1666 and 886 us
    against ORT's 560 and 183 (SPR class); its 104-channel stage, where 16 does not divide, took 8 and ran at
    ORT's speed. A grouped conv's tile is at least MIN_GROUP_TILE channels: narrower ones were never measured
    on the dense kernel, and the per-plane rule keeps such groups (ShuffleNet's 12 a group on AVX2)."""
    if info.oc is None or info.oc % nr or not tile_in_group(info, nr):
        return False
    return info.group_out is None or nr >= MIN_GROUP_TILE


#: See _channel_tile_fits.
MIN_GROUP_TILE = 8


def search_conv_tiles(info: ConvInfo, host: HostCPU) -> tuple[int, int]:
    """Joint (mr, nr) choice maximising the accumulator tile ``mr * nr`` within the register budget.

    Why: picking ``nr`` first, then the largest ``mr`` dividing the output width, collapses to
    ``mr = 1`` on odd widths (13x13 in SqueezeNet, where a 1000x512 1x1 conv is a quarter of the
    FLOPs): one FMA per weight load, 6x slower than ``nr = 8, mr = 13``. Accumulators may use 5/8
    of the registers (3/4 measured slower at 55x55); ties prefer the wider ``nr``.
    """
    oc, ow = info.oc, info.ow
    if oc is None or ow is None:
        return conv_tiles(info, host)
    lanes = host.fp32_lanes
    acc_budget = host.vector_registers * 5 // 8
    best: tuple[int, int, int] | None = None  # (mr * nr, nr, mr)
    for nr in (2 * lanes, lanes, lanes // 2, 8, 4):
        if nr < 4 or not _channel_tile_fits(info, nr):
            continue
        vectors = -(-nr // lanes)
        max_mr = max(1, acc_budget // vectors)
        mr = max(m for m in range(1, min(max_mr, ow) + 1) if ow % m == 0)
        if mr == 1 and vectors == 1:
            # No divisor of the width fits the budget (13 on AVX2's 16 registers): a one-vector column may
            # take every register but the weight vector, the broadcast and a spare. SqueezeNet's 1000x512
            # 1x1 conv on 13x13: 15.6 -> 6.4 ms, the model 2.66x -> 1.98x ORT (Zen3).
            mr = max(m for m in range(1, min(host.vector_registers - 3, ow) + 1) if ow % m == 0)
        if best is None or (mr * nr, nr) > best[:2]:
            best = (mr * nr, nr, mr)
    return (best[2], best[1]) if best is not None else conv_tiles(info, host)


#: Share of L1D the weights of one reduction block may take (the input rows and the tile need the rest).
RC_BLOCK_L1_SHARE = 0.5


def reduction_block(info: ConvInfo, host: HostCPU, nr: int) -> int | None:
    """Input channels per reduction block so one block's packed weights (nr x rcb x kh x kw floats) stay
    in L1 while every column tile of the output row reuses them; None when all of them fit already.

    Why: with the reduction innermost per column tile, each tile streams the fo block's whole weight
    panel (147 KB for 128 channels 3x3 at nr 32) from L2: a stride-2 3x3 conv ran at 99 GFLOP/s against
    ONNX Runtime's 209 (Zen4, 2 threads)."""
    block = None
    ic, kh_kw = info.ic, info.kernel_area
    if ic is None or kh_kw is None or not host.l1d_bytes:
        return None
    budget = host.l1d_bytes * RC_BLOCK_L1_SHARE
    if nr * ic * kh_kw * 4 <= budget:
        return None
    for cand in range(ic - 1, 0, -1):
        if ic % cand == 0 and nr * cand * kh_kw * 4 <= budget:
            block = cand
            break
    return block if block and block >= 4 else None


#: Share of L1D one output plane's accumulators (oh x ow x nr floats) may take for the whole plane to be
#: the tile a weight block is reused over (see :func:`_plane_fits`).
PLANE_TILE_L1_SHARE = 0.5


def _plane_fits(sch: s_tir.Schedule, y_loop, info: ConvInfo, nr: int, host: HostCPU) -> bool:  # noqa: ANN001
    """A small output plane (ResNet's 14x14 and 7x7 stages) whose ``nr``-channel accumulators fit in half of L1
    becomes the tile each reduction block of weights is reused over: every row of the plane reads one L1-resident
    block before the next block is loaded. With the row as the tile (the default order), each of the plane's rows
    re-read every weight block from L2, and a 7-wide row has a single column tile to reuse it over."""
    oh = int_or_none(sch.get(y_loop).extent)
    if oh is None or info.ow is None or not host.l1d_bytes:
        return False
    return oh * info.ow * nr * 4 <= host.l1d_bytes * PLANE_TILE_L1_SHARE


def schedule_conv2d(
    sch: s_tir.Schedule,
    info: ConvInfo,
    host: HostCPU,
    *,
    num_threads: int,
    pack_w: bool = False,
    keep_producers: bool = True,
    tile_search: bool = False,
    rc_block: bool = False,
    plane_tile: bool = False,
    channel_blocks: bool = False,
) -> bool:
    mr, nr = conv_tiles(info, host, search=tile_search)
    if nr < 4:
        return False
    conv = info.block
    name = sch.get(conv).name_hint
    # Producers (the zero-padding block) stay materialised: inlined, every input broadcast in the
    # micro-kernel becomes a bounds-checked select (measured ~2x slower than one extra pass).
    producers = [sch.get(b).name_hint for b in sch.get_producers(conv)] if keep_producers else []
    blocks = try_inline_all(sch, keep=[conv, *[sch.get_sblock(p) for p in producers]])
    conv = sch.get_sblock(name)
    others = [b for b in blocks if sch.get(b).name_hint not in (name, *producers)]
    if len(others) > 1:
        return False
    if others:
        epilogue = others[0]
    else:
        epilogue = sch.cache_write(conv, 0, "global")
    if not loops_match_iters(sch, conv):
        return False
    n, f, y, x, rc, ry, rx = sch.get_loops(conv)
    fo, fi = sch.split(f, [None, nr])
    xo, xi = sch.split(x, [None, mr])
    rcb = reduction_block(info, host, nr) if rc_block else None
    plane = plane_tile and rcb is not None and _plane_fits(sch, y, info, nr, host)
    cb = channel_block(info, host, nr) if channel_blocks and not plane else None
    if cb is not None:
        fob, fo = sch.split(fo, [None, cb])
        outer: tuple = (n, fob, y, fo)   # a block of channel tiles shares each input row
    else:
        outer = (n, fo, y)
    if rcb is not None:
        rco, rci = sch.split(rc, [None, rcb])
        if plane:
            sch.reorder(n, fo, rco, y, xo, rci, ry, rx, xi, fi)
            sch.reverse_compute_at(epilogue, fo, preserve_unit_loops=True)
        else:
            sch.reorder(*outer, rco, xo, rci, ry, rx, xi, fi)
            sch.reverse_compute_at(epilogue, outer[-1], preserve_unit_loops=True)
    else:
        sch.reorder(*outer, xo, rc, ry, rx, xi, fi)
        sch.reverse_compute_at(epilogue, xo, preserve_unit_loops=True)
    # Accumulator tile with channels innermost: [.., x, f % nr] keeps vector lanes contiguous.
    sch.transform_layout(conv, ("write", 0), lambda a, b, c, d: (a, b // nr, c, d, b % nr))
    if pack_w:
        pack_param_layout(sch, conv, info.w_buffer, info.f_dim, nr)
    if num_threads > 1:
        sch.parallel(sch.fuse(n, fo) if plane else sch.fuse(*outer[:3]))
    sch.unroll(xi)
    sch.vectorize(fi)
    eloops = sch.get_loops(epilogue)
    # Epilogue loops under xo: (.., f_tile, .., x_tile); vectorise the contiguous output columns.
    if rcb is not None:
        sch.vectorize(eloops[-1])   # a whole output row of one channel
    else:
        sch.vectorize(eloops[-1]) if mr in (4, 8, 16) else sch.unroll(eloops[-1])
    for prod in producers:
        schedule_spatial_block(sch, sch.get_sblock(prod), host, num_threads=num_threads)
    init = sch.decompose_reduction(conv, rco if rcb is not None else rc)
    iloops = sch.get_loops(init)
    if sch.get(iloops[-1]).kind != tirx.ForKind.VECTORIZED:
        sch.vectorize(iloops[-1])
    return True


# ----------------------------------------------------------------------------- pointwise (1x1) convs

#: Vector registers the pointwise tile may hold as accumulators.
POINTWISE_ACC_SHARE = 0.75


def _channel_vectors_fit(info: ConvInfo, host: HostCPU) -> bool:
    """The channel-vector kernel's tile is whole vectors and stays inside a group."""
    nr = search_conv_tiles(info, host)[1]
    return nr % host.fp32_lanes == 0 and tile_in_group(info, nr)


def _plane_tiles(sch: s_tir.Schedule, conv: SBlockRV, plane, extent: int, nr: int) -> None:  # noqa: ANN001
    """The pointwise reduction over a flattened plane: ``nr``-column steps (channels unrolled, columns one or
    two vectors), and the columns no step fills as a tail loop of their own (a guarded split made the
    vectorised loop scalar)."""
    main = extent - extent % nr
    parts = sch.loop_partition(plane, [main, None]) if main < extent else [plane]
    blocks = [conv] if len(parts) == 1 else [sch.get_child_blocks(part)[0] for part in parts]
    for part, blk in zip(parts, blocks):
        loops = sch.get_loops(blk)
        p, rc, ry, rx, fi = loops[-5:]
        if sch.get(part).extent.value >= nr:
            xo, xi = sch.split(p, [None, nr])
            sch.reorder(xo, rc, ry, rx, fi, xi)
        else:
            sch.reorder(rc, ry, rx, fi, p)
            xi = p
        _unroll_vectorize_and_init(sch, blk, fi, xi, rc)


def _unroll_vectorize_and_init(sch: s_tir.Schedule, blk: SBlockRV, fi, xi, rc) -> None:  # noqa: ANN001
    """The pointwise tile's last steps: channels unrolled, columns vectorised, the init split off (vectorised)."""
    sch.unroll(fi)
    sch.vectorize(xi)
    init = sch.decompose_reduction(blk, rc)
    iloops = sch.get_loops(init)
    if sch.get(iloops[-1]).kind != tirx.ForKind.VECTORIZED:
        sch.vectorize(iloops[-1])


def pointwise_tiles(info: ConvInfo, host: HostCPU) -> tuple[int, int] | None:
    """(mr output channels, nr output columns) for the pointwise kernel, or None when neither the row width
    nor the plane has a usable divisor. nr runs along the contiguous output row (1-2 vectors), or along the
    whole plane where the row fits no whole vector (it is contiguous too: 1x1, stride 1, unpadded); mr
    channels are broadcast."""
    oc, ow = info.oc, info.ow
    if oc is None or ow is None:
        return None
    lanes = host.fp32_lanes
    # Whole vectors, or one row filling most of a vector (14 of 16 lanes: one masked vector). Odd
    # multi-vector widths (28 = 16 + 8 + 4 lanes) split every accumulator into pieces and spill (56- and
    # 28-wide rows ran at 8-18 GFLOP/s), and 7 of 16 lanes wastes half the machine (1.25-1.47x slower
    # than the channel-vector kernel at 7x7): those stay with it. Measured interleaved (Zen4, 2 threads):
    # 112-wide 0.31-0.93x and 14-wide 0.83-0.96x of the channel-vector kernel's time.
    nr = next((c for c in (2 * lanes, lanes) if ow % c == 0), ow if lanes * 3 // 4 <= ow <= lanes else None)
    if nr is None and info.oh is not None and info.oh * ow >= 4 * lanes and not _channel_vectors_fit(info, host):
        # the plane as one row, its last columns a tail of their own (schedule_pointwise), where the
        # channel-vector kernel has no whole vector either: ShuffleNetV2's 58-channel 1x1s at 28x28 ran at
        # 13 GFLOP/s on the per-plane rule; 80 channels a group at 14x14 ran 0.77x ORT channel-vector and
        # 1.06x over the plane (Zen3)
        plane = info.oh * ow
        nr = next((c for c in (2 * lanes, lanes) if plane % c == 0), lanes)
    if nr is None:
        return None
    vectors = -(-nr // lanes)
    budget = max(1, int(host.vector_registers * POINTWISE_ACC_SHARE) // vectors)
    per_group = info.group_out or oc    # a grouped conv's tile stays inside one group: one input row per step
    mr = next((m for m in range(min(budget, per_group), 1, -1) if per_group % m == 0), None)
    return (mr, nr) if mr else None


def schedule_pointwise(sch: s_tir.Schedule, info: ConvInfo, host: HostCPU, *, num_threads: int,
                       pack_w: bool = False, channel_blocks: bool = False) -> bool:
    """A 1x1 conv as the GEMM ``O[f, p] = W[f, c] X[c, p]`` on NCHW: the output row is the vector axis.

    Why: the channel-vector tile of :func:`schedule_conv2d` leaves its accumulators channel-innermost,
    so the epilogue reads them back with a stride of ``nr`` (a gather per output) and writes NCHW; with
    few input channels (MobileNet/EfficientNet expansions: 16 -> 96 at 112x112) that epilogue, not the
    16-step reduction, is the kernel's time (69 GFLOP/s, 34% of sgemm). Here the tile is ``mr``
    channels x ``nr`` columns of one output row: one contiguous input load per (channel, vector),
    ``mr`` broadcast weights (packed ``[OC/mr, IC, 1, 1, mr]`` so they are adjacent), and the epilogue
    reads and writes whole rows. Where a row fits no whole vector (28, 14 wide) the plane is the row, its
    last columns a tail loop: ShuffleNetV2's 1x1s at 58/116 channels ran 3.2x/1.4x ORT on the rules
    before, 1.1x/0.95x so (Zen3)."""
    tiles = pointwise_tiles(info, host)
    if tiles is None or not info.pointwise:
        return False
    mr, nr = tiles
    around = inline_around(sch, info.block)
    if around is None:
        return False
    conv, epilogue = around
    epilogue = epilogue or sch.cache_write(conv, 0, "global")
    if not loops_match_iters(sch, conv):
        return False
    if info.ow % nr:    # the plane as one contiguous row (pointwise_tiles)
        # one iterator over the plane (a fused loop's quasi-affine binding could not be partitioned); the
        # epilogue runs once per channel tile over its whole plane (mr planes, L2-resident): computed at a
        # column step, its bounding box over a flattened index covered whole rows
        ow = info.ow
        sch.transform_block_layout(conv, lambda n, f, y, x, rc, ry, rx: (n, f, y * ow + x, rc, ry, rx))
        n, f, plane, rc, ry, rx = sch.get_loops(conv)
        fo, fi = sch.split(f, [None, mr])
        sch.reorder(n, fo, plane, rc, ry, rx, fi)
        sch.reverse_compute_at(epilogue, fo, preserve_unit_loops=True)
        if pack_w:
            pack_param_layout(sch, conv, info.w_buffer, info.f_dim, mr)
        if num_threads > 1:
            sch.parallel(sch.fuse(n, fo))
        _plane_tiles(sch, conv, plane, info.oh * info.ow, nr)
        eloops = sch.get_loops(epilogue)
        sch.vectorize(eloops[-1])
        return True
    n, f, y, x, rc, ry, rx = sch.get_loops(conv)
    fo, fi = sch.split(f, [None, mr])
    xo, xi = sch.split(x, [None, nr])
    cb = channel_block(info, host, mr) if channel_blocks else None
    if cb is not None:
        fob, fo = sch.split(fo, [None, cb])
        outer = (n, fob, y, xo, fo)   # a block of channel tiles shares each input row
    else:
        outer = (n, fo, y, xo)
    sch.reorder(*outer, rc, ry, rx, fi, xi)
    sch.reverse_compute_at(epilogue, outer[-1], preserve_unit_loops=True)
    if pack_w:
        pack_param_layout(sch, conv, info.w_buffer, info.f_dim, mr)
    if num_threads > 1:
        sch.parallel(sch.fuse(*outer[:4]))
    eloops = sch.get_loops(epilogue)
    sch.vectorize(eloops[-1])
    _unroll_vectorize_and_init(sch, conv, fi, xi, rc)
    return True
