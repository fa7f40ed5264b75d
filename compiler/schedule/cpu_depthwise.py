"""CPU schedule for depthwise 2-D convolution (NCHW, one input channel per output channel) with epilogue.

Why its own rule: the dense conv micro-kernel vectorises over output channels and broadcasts one input
value to all of them, which needs every output channel to read the same input. In a depthwise conv each
channel reads its own plane, so that kernel degenerates to scalar work: measured on mobilenet_v2 (Zen4,
2 threads) its depthwise layers ran at 0.7-2.2 GFLOP/s, 1-3% of an sgemm, and were ~85% of the model's
time (`fuseguard profile mobilenet_v2`).

Here each parallel task owns one (batch, channel) plane: the padded input plane is built once per task
(a few KiB, stays in L1/L2), and every output row is computed as `ow` lanes at a time: for each tap
(ky, kx) one vector load of the input row (contiguous when the stride is 1) times a broadcast weight,
accumulated in registers; the fused bias/BN/activation epilogue runs on the finished row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.schedule import SBlockRV

from ..hw.hostcpu import HostCPU
from .tir_analysis import (REDUCE, BufferLoad, int_or_none, is_spatial, loads_in, root_blocks, simple_index_vars,
                           try_inline_all, widened_load)


#: Widest padded row vectorised whole when its width is not a multiple of the vector length.
ROW_VECTOR_MAX = 256
#: Largest output plane whose epilogue runs on the whole plane at once (narrow rows only).
PLANE_EPILOGUE_MAX = 1024
DEINTERLEAVE_MAX_WIDTH = 64
#: A padded plane smaller than this is written together with its neighbours' before the first is convolved.
#: Written and read back one plane at a time, the conv's row vectors load what the padding loop stored a few
#: dozen instructions before, across two or more of its stores: each such load waits for those stores to
#: leave the store buffer (a failed store-to-load forward, ~15 cycles on the FMA chain). Measured (SPR,
#: 2 threads, `vm.time_evaluator`), one plane a task against two or more: 232ch 14x14 stride 2 (1 KiB
#: de-interleaved plane) 160 -> 10.4 us (ORT 16-18 through its Python API), 232ch 12x12 stride 2
#: 26 -> 6.6 us, 232ch 7x7 stride 1 8.1 -> 6.6 us, 116ch 14x14 stride 1 10.1 -> 9.2 us; large planes
#: (96ch 112x112, 144ch 56x56) ran 5-10% slower grouped, so they stay one a task.
PAD_BLOCK_BYTES = 2048
PAD_BLOCK_MAX = 8


@dataclass(frozen=True)
class DepthwiseInfo:
    block: SBlockRV
    channels: int
    out_w: int
    depthwise: bool = True


def match_depthwise(sch: s_tir.Schedule, block_rv: SBlockRV, *, any_conv: bool = False) -> DepthwiseInfo | None:
    """`O[n, c, y, x] += I[n, c + rc, ...] * W[c, rc, ky, kx]` with rc of extent 1 (groups == channels).

    With `any_conv`, also a dense or grouped conv (`I[n, rc, ...]`): the fallback for channel counts the
    dense micro-kernel cannot tile (ShuffleNet's 58, 116, 232: no multiple of 4 divides them), which
    otherwise fall to the generic row-reduction rule (measured 2.3x slower than this). Grouped convs
    (the input channel follows the output channel, rc over a group) always match."""
    block = sch.get(block_rv)
    ivs = list(block.iter_vars)
    kinds = ["R" if iv.iter_type == REDUCE else "S" for iv in ivs]
    if kinds != ["S", "S", "S", "S", "R", "R", "R"] or block.init is None:
        return None
    depthwise = int_or_none(ivs[4].dom.extent) == 1
    store = block.body
    if not isinstance(store, tirx.BufferStore) or str(store.buffer.dtype) != "float32":
        return None
    val = store.value
    if not (isinstance(val, tirx.Add) and isinstance(val.b, tirx.Mul)):
        return None
    out_vars = simple_index_vars(store.indices)
    var_pos = {iv.var: p for p, iv in enumerate(ivs)}
    if out_vars is None or [var_pos.get(v) for v in out_vars] != [0, 1, 2, 3]:
        return None
    prod = val.b
    for w, d in ((widened_load(prod.b), widened_load(prod.a)), (widened_load(prod.a), widened_load(prod.b))):
        if not (isinstance(w, BufferLoad) and isinstance(d, BufferLoad)):
            continue
        w_vars = simple_index_vars(w.indices)
        if w_vars is None or [var_pos.get(v) for v in w_vars] != [1, 4, 5, 6]:
            continue
        # depthwise: the input's channel index follows the output channel (c + rc)
        if len(d.indices) != 4:
            continue
        # grouped (ShuffleNet's groups=4 1x1 convs): the input channel follows the output channel too, and
        # the dense micro-kernel ran them at 0.5 GFLOP/s (1.6 ms each, 32 of them: 10x ORT)
        follows = _mentions(d.indices[1], ivs[1].var)
        if not follows and not any_conv:
            continue
        area = (int_or_none(ivs[5].dom.extent) or 0) * (int_or_none(ivs[6].dom.extent) or 0)
        if follows and not depthwise and area > 1 and not any_conv:
            # A grouped conv with a real kernel (AlexNet's 5x5 and 3x3, 2 groups of 48-192 channels) has
            # every output read ic x area taps through this per-plane kernel: 275 ms for AlexNet's conv2
            # against 9 ms on the dense micro-kernel (Zen3). Only 1x1 grouped convs gain here.
            return None
        channels, out_w = int_or_none(ivs[1].dom.extent), int_or_none(ivs[3].dom.extent)
        if channels is None or out_w is None:
            return None
        return DepthwiseInfo(block=block_rv, channels=channels, out_w=out_w, depthwise=depthwise and follows)
    return None


def _mentions(expr: object, var: tirx.Var) -> bool:
    if isinstance(expr, tirx.Var):
        return expr.same_as(var)
    return any(_mentions(getattr(expr, f), var) for f in ("a", "b") if hasattr(expr, f))


def _column_stride(sch: s_tir.Schedule, conv: SBlockRV, producers: list[SBlockRV]) -> int | None:
    """The stride of the conv's column index into its padded input (`x * s + rx`), when it is plain."""
    block = sch.get(conv)
    x_var = block.iter_vars[3].var
    pads = [sch.get(p).writes[0].source for p in producers]
    for load in loads_in(block.body):
        if any(load.source.same_as(b) for b in pads):
            idx = load.indices[-1]
            for term in (idx.a, idx.b) if isinstance(idx, tirx.Add) else (idx,):
                if isinstance(term, tirx.Mul) and isinstance(term.a, tirx.Var) and term.a.same_as(x_var) \
                        and isinstance(term.b, tirx.IntImm):
                    return int(term.b.value)
                if isinstance(term, tirx.Var) and term.same_as(x_var):
                    return 1
    return None


def _planes_per_task(info: DepthwiseInfo, pads: list) -> int:
    """Channels whose padded planes one task writes before it convolves the first of them (a divisor of the
    channel count up to :data:`PAD_BLOCK_MAX`), so a small plane's stores have left the store buffer when the
    conv's loads read them back (:data:`PAD_BLOCK_BYTES`)."""
    if not info.depthwise or len(pads) != 1:
        return 1
    dims = [int_or_none(d) for d in pads[0].shape[2:]]
    if any(d is None for d in dims):
        return 1
    plane = math.prod(dims) * tvm.DataType(str(pads[0].dtype)).bits // 8
    if plane >= PAD_BLOCK_BYTES:
        return 1
    want = min(PAD_BLOCK_MAX, -(-PAD_BLOCK_BYTES // plane))
    return max(d for d in range(1, want + 1) if info.channels % d == 0)


def _row_vector(width: int, lanes: int) -> int:
    """Lanes per vector step along an output row: the largest divisor of the width up to one register
    (no tail loop: a predicated tail keeps TVM from vectorising), else the whole row when it is short."""
    for d in range(min(width, lanes), 3, -1):
        if width % d == 0:
            return d
    return width if width <= 2 * lanes else 1


def schedule_depthwise(sch: s_tir.Schedule, info: DepthwiseInfo, host: HostCPU, *, num_threads: int,
                       deinterleave: bool = True) -> bool:
    """Schedule the conv block, its padding producer and its elementwise epilogue (module docstring)."""
    conv = info.block
    read = [r.source for r in sch.get(conv).reads]
    producers = [b for b in root_blocks(sch) if is_spatial(sch.get(b))
                 and any(wr.source.same_as(buf) for wr in sch.get(b).writes for buf in read)]
    keep = [conv] + producers
    try_inline_all(sch, keep=keep)
    blocks = root_blocks(sch)
    consumers = [b for b in blocks if not sch.get(b).same_as(sch.get(conv)) and
                 not any(sch.get(b).same_as(sch.get(p)) for p in producers)]
    if len(consumers) > 1:
        return False
    stride = _column_stride(sch, conv, producers)
    deinterleaved = False
    padded_w = int_or_none(sch.get(producers[0]).iter_vars[-1].dom.extent) if producers else None
    if deinterleave and stride == 2 and info.depthwise and len(producers) == 1 \
            and padded_w is not None and padded_w <= DEINTERLEAVE_MAX_WIDTH:
        # Stride 2 reads every other column: each tap's vector would be a gather. The padded plane is
        # written de-interleaved instead ([.., y, x % 2, x // 2]: even columns, then odd), so tap kx
        # reads plane kx % 2 from column x + kx // 2, contiguous. Measured interleaved against the
        # gather (Zen4, 2 threads): 0.57-0.61x the time for 240ch 28x28 5x5, 0.84-0.86x for 144ch 56x56
        # 3x3, but 1.6-1.8x for 96ch 112x112 3x3 (a 114-wide padded row): hence the width limit.
        try:
            sch.transform_layout(producers[0], ("write", 0), lambda a, b, y, x: (a, b, y, x % 2, x // 2))
            deinterleaved = True
            # ... and the padding loop walks the new layout, so its stores are contiguous (the strided
            # side moves to its reads, once per input element instead of once per tap).
            sch.transform_block_layout(producers[0], lambda a, b, y, x: (a, b, y, x % 2, x // 2))
        except Exception:  # noqa: BLE001 - an odd padded width the map cannot cover: keep the gather
            pass
    n, c, h, w, rc, ry, rx = sch.get_loops(conv)
    lanes = host.fp32_lanes
    vec = _row_vector(info.out_w, lanes)
    wo, wi = sch.split(w, [None, vec])
    sch.reorder(n, c, h, wo, rc, ry, rx, wi)
    nc = sch.fuse(n, c)
    pad_at = nc
    per_task = _planes_per_task(info, [sch.get(p).writes[0].source for p in producers])
    if per_task > 1:
        pad_at, nc = sch.split(nc, [None, per_task])
    # Every loop annotation goes on before decompose_reduction: the update block alone is no longer a
    # complete reduction, and compute_at / vectorize refuse subtrees that hold it.
    if num_threads > 1:
        sch.parallel(pad_at)
    for p in producers:
        if info.depthwise:      # a few channels' padded planes per task; a dense conv needs every channel
            sch.compute_at(p, pad_at, preserve_unit_loops=True)
        elif num_threads > 1:
            sch.parallel(sch.fuse(*sch.get_loops(p)[:2]))
        inner = sch.get_loops(p)[-1]
        extent = int_or_none(sch.get(inner).extent)
        if deinterleaved:
            pass    # stride-2 reads: a vector would be a gather per lane; scalar copies measured faster
        elif extent and extent % lanes == 0:
            _, pi = sch.split(inner, [None, lanes])
            sch.vectorize(pi)
        elif extent and extent <= ROW_VECTOR_MAX:
            sch.vectorize(inner)    # an odd padded width (9, 11, 58): one row-wide vector, not scalars
    plane = info.out_w * (int_or_none(sch.get(h).extent) or 0)
    for epi in consumers:
        if info.depthwise and info.out_w < lanes and 0 < plane <= PLANE_EPILOGUE_MAX:
            # Narrow rows (7, 14): a 7-lane vector costs as many instructions as a 16-lane one (LLVM
            # splits it 4+2+1), so a row-at-a-time SiLU epilogue made the fused 1152x7x7 depthwise conv
            # 2x slower than conv + separate SiLU kernel (0.197 vs 0.097 ms, Zen4). The whole plane is
            # contiguous in NCHW: run the epilogue on it at once.
            sch.reverse_compute_at(epi, nc, preserve_unit_loops=True)
            eloops = sch.get_loops(epi)
            flat = sch.fuse(*eloops[-2:])
            sch.vectorize(flat)
            continue
        sch.reverse_compute_at(epi, h, preserve_unit_loops=True)
        inner = sch.get_loops(epi)[-1]
        extent = int_or_none(sch.get(inner).extent)
        if extent:
            _, ei = sch.split(inner, [None, _row_vector(extent, lanes)])
            sch.vectorize(ei)
    sch.unroll(ry)
    sch.unroll(rx)
    sch.vectorize(wi)
    init = sch.decompose_reduction(conv, rc)
    sch.vectorize(sch.get_loops(init)[-1])
    return True
