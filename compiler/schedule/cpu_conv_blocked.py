"""CPU schedules for the channel-blocked convs of the layout step (compiler/passes/layout.py), with fused epilogue.

Dense ``O[n, f, y, x, fi] += I[n, rc, ., ., ri] * W[f, rc, ky, kx, ri, fi]``: the tile is ``mr`` output columns
x ``nb`` channel blocks, each accumulator one vector of the block's ``b`` channels (the layout's innermost
axis, so the tile is stored whole). Every reduction step (one input channel of one tap) is ``nb`` contiguous
weight vectors and ``mr`` broadcast inputs for ``mr * nb`` FMAs: MLAS's NCHWc kernel (4 blocks x 6 columns
in 24 zmm) in TIR. 1x1 convs are the same loop nest with a unit tap.

Depthwise ``O[n, c, y, x, ci] += I[n, c, ., ., ci] * W[c, 0, ky, kx, ci]``: one vector per tap and column,
``mr`` columns accumulated in registers, the tap's weight vector reused over them; a 7-wide row uses every
lane (in NCHW it used 7 of 16).

The zero-padding stage stays materialised and is scheduled as a spatial block (inlined, every input read would
be a bounds-checked select).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.schedule import SBlockRV

from ..hw.hostcpu import HostCPU
from .cpu_conv import CHANNEL_BLOCK_L2_SHARE, image_bytes
from .tir_analysis import (REDUCE, BufferLoad, int_or_none, loads_in, loops_match_iters, simple_index_vars, try_inline_all,
                           widened_load)

#: Channel blocks one dense tile may span. MLAS takes 4; 5 divides SqueezeNet's 125 blocks of 8 (1000 classes),
#: where 2 columns x 5 blocks ran 0.98x ORT and the best 1-block tile 1.39x (Zen3).
MAX_CHANNEL_BLOCKS = 8
#: Share of the vector registers the accumulators may take; the rest hold weight vectors and the broadcast.
ACC_SHARE = 0.75
#: FMAs issued a cycle and the FMA latency in cycles (2 and 4 on Zen3, Skylake and later): a tile step takes
#: at least ``acc / FMA_PER_CYCLE`` cycles, and at least FMA_LATENCY for the dependent accumulator chains.
FMA_PER_CYCLE = 2
FMA_LATENCY = 4
#: Cycles a dense tile step spends per weight vector: a tile's weights (``nb`` blocks x C_in x taps, 36 KiB and
#: up) stream from L2, one vector a cycle. Its broadcasts read an input row in L1, ``host.vector_loads_per_cycle``
#: a cycle. Counted at one a cycle (the old estimate, Zen3's fit), SPR's 7- and 14-wide planes took 4-block
#: tiles and ran 1.35-1.57x ORT where 7 columns x 2 blocks ran 1.05-1.20x (interleaved, 2 threads: 3x3 256->256
#: at 14x14 937 vs 761 us, 1x1 1024->256 at 14x14 678 vs 547 us, 1x1 2048->512 at 7x7 707 vs 539 us, 3x3
#: 512->512 at 7x7 1263 vs 943 us; at 28 and 56 wide the two tiles were within 3%).
WEIGHT_LOAD_CYCLES = 1.0
#: Share of L1D one reduction block's weights may take, and share the accumulators of the rows reusing it may
#: take (the input rows need the rest); see :func:`reduction_blocking`.
RC_BLOCK_L1_SHARE = 0.5
ROWS_L1_SHARE = 0.5


@dataclass(frozen=True)
class BlockedConvInfo:
    block: SBlockRV
    depthwise: bool
    blocks: int | None      # output channel blocks (f extent)
    ow: int | None
    lanes: int | None       # channels per block
    pool: bool = False      # max/average pooling: the depthwise nest, no weights
    #: a grouped conv: output blocks per group (a tile's channel blocks must share their group's input)
    group_blocks: int | None = None
    nchw_in: bool = False   # the first conv: NCHW input (a scalar broadcast per column and tap)
    in_bytes: int | None = None     # one image of the input the conv reads (its padded copy)


def match_blocked_conv(sch: s_tir.Schedule, block_rv: SBlockRV) -> BlockedConvInfo | None:
    """The two computes of compiler/passes/layout.py, recognised by iterator kinds and access pattern."""
    block = sch.get(block_rv)
    ivs = list(block.iter_vars)
    kinds = "".join("R" if iv.iter_type == REDUCE else "S" for iv in ivs)
    if kinds not in ("SSSSSRRRR", "SSSSSRRR", "SSSSSRR") or block.init is None:
        return None
    store = block.body
    if not isinstance(store, tirx.BufferStore) or str(store.buffer.dtype) != "float32":
        return None
    val = store.value
    var_pos = {iv.var: p for p, iv in enumerate(ivs)}
    out_vars = simple_index_vars(store.indices)
    if out_vars is None or [var_pos.get(v) for v in out_vars] != [0, 1, 2, 3, 4]:
        return None
    if not (isinstance(val, (tirx.Add, tirx.Max)) and isinstance(val.a, BufferLoad)
            and val.a.source.same_as(store.buffer)):
        return None
    if kinds == "SSSSSRR" and not isinstance(val.b, tirx.Mul):
        # pooling in the blocked layout (max, or the sum of an average): the depthwise loop nest without weights
        loads = loads_in(val.b)      # the input, or an inline-padded read of it
        if len(loads) != 1 or len(loads[0].indices) != 5 or not loads[0].indices[4].same_as(ivs[4].var):
            return None
        return BlockedConvInfo(block=block_rv, depthwise=True, blocks=int_or_none(ivs[1].dom.extent),
                               ow=int_or_none(ivs[3].dom.extent), lanes=int_or_none(ivs[4].dom.extent), pool=True)
    if not (isinstance(val, tirx.Add) and isinstance(val.b, tirx.Mul)):
        return None
    data, weight = widened_load(val.b.a), widened_load(val.b.b)
    if not (isinstance(data, BufferLoad) and isinstance(weight, BufferLoad)):
        return None
    depthwise = kinds == "SSSSSRR"
    w_pos = [var_pos.get(v) if isinstance(v, tirx.Var) else int_or_none(v) for v in weight.indices]
    if depthwise and (w_pos != [1, 0, 5, 6, 4] or not isinstance(weight.indices[1], tirx.IntImm)):
        return None
    nchw_in = kinds == "SSSSSRRR"     # the first conv: NCHW input, weights [f, rc, ky, kx, fi]
    if not depthwise and w_pos != ([1, 5, 6, 7, 4] if nchw_in else [1, 5, 6, 7, 8, 4]):
        return None
    if len(data.indices) != (4 if nchw_in else 5):
        return None
    return BlockedConvInfo(block=block_rv, depthwise=depthwise, blocks=int_or_none(ivs[1].dom.extent),
                           ow=int_or_none(ivs[3].dom.extent), lanes=int_or_none(ivs[4].dom.extent),
                           group_blocks=None if depthwise or nchw_in else _group_blocks(data.indices[1], ivs[5].var),
                           nchw_in=nchw_in, in_bytes=image_bytes(data.source))


def _group_blocks(channel: tirx.Expr, rc: tirx.Var) -> int | None:
    """Output blocks per group of a grouped blocked conv, read off its input block index (``f // M * K + rc``,
    or ``f * K + rc`` with one block a group); None for a dense conv (the index is ``rc``)."""
    if isinstance(channel, tirx.Var) and channel.same_as(rc):
        return None
    divisors: list[int] = []
    tvm_ffi.structural_walk(channel, (tirx.FloorDiv, lambda e: divisors.append(int_or_none(e.b) or 1)), order="post")
    return divisors[0] if divisors else 1


def blocked_tiles(info: BlockedConvInfo, host: HostCPU) -> tuple[int, int] | None:
    """(mr output columns, nb channel blocks) with the most useful FMAs a cycle within the register budget.

    A tile step issues ``mr * nb`` FMAs for ``mr`` broadcast loads and ``nb`` weight-vector loads; the estimate
    is ``useful / max(acc / 2, nb * WEIGHT_LOAD_CYCLES + mr / loads_per_cycle, 4)`` with ``useful`` the
    accumulators a step keeps busy on average over the tail (depthwise: ``mr`` input vectors and one weight,
    a cycle each). Measured interleaved against
    ORT (Zen3, 2 threads): 3x3 64->64 at 56x56 3x4 1.04x, 4x2 1.12x, 2x4 1.15x, 8x1 1.31x, 12x1 1.47x; 1x1
    512->1024 at 12x12 3x4 0.88x, 6x2 1.25x, 12x1 1.32x (the old rule, most accumulators then most columns,
    took 12x1). Columns need not divide the width (a guarded tail step: SqueezeNet's 13-wide planes allowed only
    1x1 tiles before, its 512->1000 conv ran 4.1x ORT), channel blocks must divide theirs: a guarded block tail
    ran 2.2x slower than the even tile (125 vs 128 blocks), and so did a column tail on the first conv's NCHW
    input (ResNet's 7x7 stem: 3x4 with a tail 1.67x ORT, 4x2 0.79x; a 3x3 stem 1.14x vs 0.75x): there the
    columns divide too. Depthwise tiles have ``nb`` = 1; a grouped conv's blocks stay within one group."""
    if info.ow is None or info.blocks is None or info.lanes is None:
        return None
    vectors = -(-info.lanes // host.fp32_lanes)      # an 8-lane block on AVX-512 is one (half) register
    budget = int(host.vector_registers * ACC_SHARE) // vectors
    best: tuple[float, bool, int, int, int] | None = None
    for nb in (1,) if info.depthwise else range(1, min(MAX_CHANNEL_BLOCKS, info.blocks) + 1):
        if info.blocks % nb or (info.group_blocks is not None and info.group_blocks % nb):
            continue
        for mr in range(1, min(budget // nb, info.ow) + 1):
            if info.nchw_in and info.ow % mr:
                continue
            useful = info.ow * nb / -(-info.ow // mr)
            loads = mr + nb if info.depthwise else nb * WEIGHT_LOAD_CYCLES + mr / host.vector_loads_per_cycle
            cycles = max(mr * nb / FMA_PER_CYCLE, loads, FMA_LATENCY)
            # ties: the tile that divides the row, then the most accumulators (3x4 beat 4x2 by 8% on Zen3)
            key = (round(useful / cycles, 6), info.ow % mr == 0, 0 if info.depthwise else mr * nb, -(mr + nb), mr, nb)
            if best is None or key > best:
                best = key
    return (best[-2], best[-1]) if best is not None else None


def reduction_blocking(rc_blocks: int, taps: int, lanes_in: int, mr: int, nb: int, lanes: int, oh: int, ow: int,
                       host: HostCPU) -> tuple[int, int] | None:
    """(input-channel blocks per reduction block, output rows reusing it) so that one block's weights stay in
    L1 while every column tile of those rows reads them, or None when the tile's weights fit L1 already.

    Why: with the whole reduction inside each column tile, each tile streams its ``nb`` blocks' weights
    (``nb`` x C_in x taps x ``lanes``, 64-147 KiB for ResNet-50's convs) from L2. Not for a tile with a column
    tail (``mr`` not dividing ``ow``): its guard inside the reduction kept LLVM from holding the accumulators in
    registers once they outlive the tile (a load and a store every step), and AVX2's 3-column tiles on 56-wide
    rows ran 1.3-1.5x slower blocked."""
    if not host.l1d_bytes or ow % mr:
        return None
    per_block = nb * taps * lanes_in * lanes * 4
    budget = host.l1d_bytes * RC_BLOCK_L1_SHARE
    if per_block * rc_blocks <= budget:
        return None
    rcb = next((d for d in range(rc_blocks - 1, 0, -1) if rc_blocks % d == 0 and d * per_block <= budget), 1)
    row_bytes = ow * nb * lanes * 4
    rows = next((d for d in range(oh, 0, -1) if oh % d == 0 and d * row_bytes <= host.l1d_bytes * ROWS_L1_SHARE), 1)
    return rcb, rows


def channel_tile_block(info: BlockedConvInfo, nb: int, weight_bytes: int, host: HostCPU) -> int | None:
    """Channel tiles per block when the input image does not stay in L2 while every tile reads it: a block of
    tiles (their weights within half of L2) then shares each input row, read once; None keeps the channel tile
    outermost (the weights read once, the input once per tile).

    Why: ResNet-50's 256 -> 128 1x1 at 56x56 read its 3.2 MiB input twice and ran 819 us against ORT's 553."""
    if info.in_bytes is None or info.blocks is None or not host.l2_bytes:
        return None
    if info.in_bytes <= host.l2_bytes * CHANNEL_BLOCK_L2_SHARE:
        return None
    tiles = info.blocks // nb
    most = max(1, int(host.l2_bytes * CHANNEL_BLOCK_L2_SHARE // (weight_bytes * nb // info.blocks)))
    block = max(k for k in range(1, min(most, tiles) + 1) if tiles % k == 0)
    return block if block > 1 else None


def schedule_blocked_conv(sch: s_tir.Schedule, info: BlockedConvInfo, host: HostCPU, *, num_threads: int,
                          rc_block: bool = True) -> bool:
    tiles = blocked_tiles(info, host)
    if tiles is None:
        return False
    mr, nb = tiles
    name = sch.get(info.block).name_hint
    producers = [sch.get(b).name_hint for b in sch.get_producers(info.block)]
    blocks = try_inline_all(sch, keep=[info.block, *[sch.get_sblock(p) for p in producers]])
    conv = sch.get_sblock(name)
    others = [b for b in blocks if sch.get(b).name_hint not in (name, *producers)]
    if len(others) > 1:
        return False
    epilogue = others[0] if others else sch.cache_write(conv, 0, "global")
    if not loops_match_iters(sch, conv):
        return False
    loops = sch.get_loops(conv)
    blocking = None
    if info.depthwise:
        n, f, y, x, fi, ry, rx = loops
        xo, xi = sch.split(x, [None, mr])
        sch.reorder(n, f, y, xo, ry, rx, xi, fi)
        first_red = ry
        inner: tuple = (xi,)
    else:
        n, f, y, x, fi, *red = loops      # red: rc, ry, rx (, ri)
        fo, fb = sch.split(f, [None, nb])
        xo, xi = sch.split(x, [None, mr])
        extents = [int_or_none(sch.get(lp).extent) for lp in (y, *red)]
        cb = None
        if rc_block and not info.nchw_in and None not in extents:
            oh, rc_blocks, kh, kw, lanes_in = extents
            blocking = reduction_blocking(rc_blocks, kh * kw, lanes_in, mr, nb, info.lanes, oh, info.ow, host)
            cb = channel_tile_block(info, nb, info.blocks * rc_blocks * kh * kw * lanes_in * info.lanes * 4, host)
        if blocking is not None:
            yo, yi = sch.split(y, [None, blocking[1]])
            rco, rci = sch.split(red[0], [None, blocking[0]])
        if cb is not None:
            fob, fo = sch.split(fo, [None, cb])
            outer = [n, fob, yo if blocking else y, fo]
        else:
            outer = [n, fo, yo if blocking else y]
        if blocking is not None:
            sch.reorder(*outer, rco, yi, xo, rci, *red[1:], fb, xi, fi)
            tile_at, first_red = outer[-1], rco
        else:
            sch.reorder(*outer, xo, *red, fb, xi, fi)
            tile_at, first_red = xo, red[0]
        inner = (fb, xi)
    # A dense tile's epilogue runs on the tile while it is in registers. A depthwise tile is one block wide, and
    # its epilogue inside the column loop shared the registers with the taps' hoisted weights: a SiLU there
    # (13 constants) made LLVM spill the 5x5 weights, and the fused kernel ran slower than conv + separate
    # SiLU (240ch 5x5 at 28: 1.04-1.11x of its parts; at row level 0.77-0.79x; 144ch 5x5 s2 at 56: 1.14-1.23x
    # -> 0.96-0.98x; 3x3 and ReLU unchanged; Zen3, interleaved: `benchmarks/conv_kernels.py --unfused`).
    sch.reverse_compute_at(epilogue, y if info.depthwise else tile_at, preserve_unit_loops=True)
    if num_threads > 1:
        sch.parallel(sch.fuse(*((n, f, y) if info.depthwise else outer)))
    for lp in inner:
        sch.unroll(lp)
    sch.vectorize(fi)
    eloops = sch.get_loops(epilogue)
    sch.vectorize(eloops[-1])      # the epilogue's tile loops stay rolled: unrolled, LLVM took 0.4 s longer
    if not info.depthwise and blocking is not None:
        # under the row block, one loop over its vectors: as a nest of constant loops LLVM unrolled it whole
        # (224 vectors for a 1x1 at 28x28), and GoogLeNet compiled in 5.8 s against 4.9 s (5.1 s rolled)
        own = eloops[1 if num_threads > 1 else len(outer):-1]
        if len(own) > 1:
            sch.fuse(*own)
    for prod in producers:
        pad = sch.get_sblock(prod)
        if info.depthwise and num_threads > 1:
            # The padded rows one output row reads (kh x padded width x lanes, a few KiB), built per row in
            # the parallel task and read from L1: a materialised pad was a full extra pass, more time than
            # the depthwise conv itself (144 channels 3x3 s2 at 56x56: 244 us of kernel, Zen5).
            sch.compute_at(pad, sch.get_loops(conv)[0], preserve_unit_loops=True)
            sch.vectorize(sch.get_loops(pad)[-1])
        elif info.depthwise:
            sch.compute_at(pad, sch.get_loops(conv)[2], preserve_unit_loops=True)
            sch.vectorize(sch.get_loops(pad)[-1])
        else:
            _schedule_blocked_copy(sch, pad, num_threads)
    init = sch.decompose_reduction(conv, first_red)
    iloops = sch.get_loops(init)
    if sch.get(iloops[-1]).kind != tirx.ForKind.VECTORIZED:
        sch.vectorize(iloops[-1])
    return True


def _schedule_blocked_copy(sch: s_tir.Schedule, blk: SBlockRV, num_threads: int) -> None:
    """A 5-D blocked copy (the zero padding): the lanes axis vectorised alone, rows in parallel. Fused with the
    rest, each vector's index needed a div/mod chain per lane."""
    loops = sch.get_loops(blk)
    sch.vectorize(loops[-1])
    if num_threads > 1 and len(loops) > 2:
        sch.parallel(sch.fuse(*loops[:-2]))
