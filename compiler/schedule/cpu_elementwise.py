"""CPU schedules for injective (elementwise, broadcast, layout) and row-reduction kernels.

Why: after fusion most non-matmul PrimFuncs are chains of elementwise blocks or a row reduction
(softmax, layer norm, mean) that otherwise run as single-threaded scalar loops. Injective chains are
inlined into one loop nest, fused, split into parallel chunks, and vectorised on the innermost
(contiguous) axis; reductions take the stock dlight CPU rule (rows parallel, injective parts
vectorised), which this module drives and checks.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight

from ..hw.hostcpu import HostCPU
from . import approx
from .tir_analysis import (BufferLoad, realize_of, int_or_none, is_spatial, loops_match_iters, root_blocks,
                           try_inline_all)

# Below this many output elements a parallel region costs more than it saves (thread wake-up ~µs).
PARALLEL_MIN_ELEMS = 16384
#: Widest innermost axis vectorised whole when its width is not a multiple of the vector length.
ROW_VECTOR_MAX = 256


def schedule_injective(sch: s_tir.Schedule, host: HostCPU, *, num_threads: int) -> bool:
    """Schedule a function whose blocks are all spatial; False when it is not such a function."""
    blocks = root_blocks(sch)
    if not blocks or not all(is_spatial(sch.get(b)) for b in blocks):
        return False
    blocks = try_inline_all(sch)
    for blk in blocks:
        cut = _concat_cuts(sch, blk)
        if cut is None:
            schedule_spatial_block(sch, blk, host, num_threads=num_threads)
            continue
        axis, offsets = cut
        loop = sch.get_loops(blk)[axis]
        extent = int(sch.get(loop).extent)
        sizes = [b - a for a, b in zip([0, *offsets], [*offsets, extent])]
        for part in sch.loop_partition(loop, [*sizes[:-1], None]):
            schedule_spatial_block(sch, sch.get_child_blocks(part)[0], host, num_threads=num_threads,
                                   from_loop=axis)
    return True


#: Most inputs a concatenation is cut into (one loop nest each, one parallel region each).
CONCAT_MAX_PARTS = 64


def _concat_cuts(sch: s_tir.Schedule, blk: s_tir.schedule.SBlockRV) -> tuple[int, list[int]] | None:
    """(loop, offsets) of a concatenation inlined into ``blk``: its ``if_then_else(off <= v_axis, ...)`` chain,
    whose every branch a vector loaded and then selected from. Cut at the offsets, each input is its own
    loop nest and the conditions fold away: torchvision DenseNet-121's concat (up to 25 inputs) + BN + ReLU
    kernels ran at 0.5 GB/s, 2-3 ms each (Zen3)."""
    if not loops_match_iters(sch, blk):
        return None
    block = sch.get(blk)
    pos = {iv.var: p for p, iv in enumerate(block.iter_vars)}
    cuts: dict[int, set[int]] = {}

    def visit(call: tvm.ir.expr.Call) -> None:
        if getattr(call.op, "name", "") not in ("prim.if_then_else", "tir.if_then_else"):
            return
        cond = call.args[0]
        if isinstance(cond, tirx.LE) and isinstance(cond.a, tirx.IntImm) and cond.b in pos:
            cuts.setdefault(pos[cond.b], set()).add(int(cond.a.value))

    tvm_ffi.structural_walk(block.body, (tvm.ir.expr.Call, visit), order="post")
    if len(cuts) != 1:
        return None
    axis, offsets = next(iter(cuts.items()))
    extent = int_or_none(block.iter_vars[axis].dom.extent)
    if extent is None:
        return None
    inside = sorted(o for o in offsets if 0 < o < extent)
    return (axis, inside) if inside and len(inside) < CONCAT_MAX_PARTS else None


def schedule_spatial_block(sch: s_tir.Schedule, blk: s_tir.schedule.SBlockRV, host: HostCPU, *, num_threads: int,
                           from_loop: int = 0) -> None:
    """Fuse, vectorise and parallelise the block's loops (those from ``from_loop`` in: the ones above are
    shared with sibling loop nests)."""
    loops = sch.get_loops(blk)[from_loop:]
    if not loops:
        return
    extents = [int_or_none(sch.get(lp).extent) for lp in loops]
    if any(e is None for e in extents):
        # Symbolic shapes: parallelise the outermost loop only.
        if num_threads > 1:
            sch.parallel(loops[0])
        return
    total = 1
    for e in extents:
        total *= e  # type: ignore[operator]
    lanes = host.fp32_lanes
    do_par = num_threads > 1 and total >= PARALLEL_MIN_ELEMS
    last = extents[-1]
    assert last is not None
    if len(loops) > 1 and last % lanes and last <= ROW_VECTOR_MAX:
        # Rows of an odd width (58 for a padded 56, 28, 7): vectors run along one row, never across
        # rows. Fused across rows, every lane of a vector needed its own div/mod and a gather: the
        # zero-padding of a 128x56x56 stride-2 conv took more time than the conv (2.4 ms vs 1.15 ms
        # without padding; Zen4, 2 threads). LLVM splits the odd-width vector into legal pieces.
        outer = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
        sch.vectorize(loops[-1])
        if do_par:
            sch.parallel(outer)
        return
    if len(loops) > 1 and last % lanes:
        # Long rows of an odd width (a 3199-sample audio frame): whole vectors along each row and the
        # last few columns as a loop of their own. Fused across rows instead, the vectors straddled row
        # ends and every lane needed a div/mod and a gather: Wav2Vec2's GroupNorm-scale + GELU kernel,
        # 128 x 3199, 1.49 ms (3.6 ns an element; Zen3).
        outer = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
        body, tail = sch.loop_partition(loops[-1], [last - last % lanes, None])
        sch.vectorize(sch.split(body, [None, lanes])[1])
        sch.vectorize(tail)
        if do_par:
            sch.parallel(outer)
        return
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    inner_vec = lanes if total % lanes == 0 else 1
    if inner_vec > 1:
        # Chunks of 4 vectors per inner iteration; outer loop split for the thread pool.
        vec_chunk = inner_vec * 4 if total % (inner_vec * 4) == 0 else inner_vec
        outer, vec = sch.split(fused, [None, vec_chunk])
        if vec_chunk > inner_vec:
            vo, vi = sch.split(vec, [None, inner_vec])
            sch.vectorize(vi)
            sch.unroll(vo)
        else:
            sch.vectorize(vec)
    else:
        outer = fused
    if do_par:
        sch.parallel(outer)


def schedule_row_reduction(func: tirx.PrimFunc, target: tvm.target.Target) -> s_tir.Schedule | None:
    """Softmax / layer norm / mean-style kernels via dlight's CPU reduction rule (rows in parallel)."""
    try:
        res = dlight.cpu.Reduction().apply(func, target, False)
    except Exception:  # noqa: BLE001 - rule raises on shapes it does not cover; caller falls back
        return None
    if isinstance(res, list):
        res = res[0] if res else None
    return res


def schedule_vector_row_reduction(func: tirx.PrimFunc, host: HostCPU, *, num_threads: int) -> s_tir.Schedule | None:
    """Softmax / layer norm / RMSNorm rows with their sums and maxima in vector registers.

    dlight's CPU rule (the fallback) leaves each row's reduction a scalar chain: one add per element,
    each waiting on the last (4 cycles), ~3000 cycles for a 768-wide row, and a [384, 768] LayerNorm plus
    Softmax ran 2.5x ONNX Runtime (Zen3). Here each row reduction is split (rfactor) into `lanes`
    independent partial results accumulated as one vector, then the lanes are combined (a row no vector
    divides is padded first, `pad_row_reductions`: ViT's [2364, 197] softmax 1156 -> 302 us, Wav2Vec2's
    GroupNorm over 3199 frames 3.5 -> 0.55 ms, Zen3); everything else as dlight does (rows parallel,
    elementwise parts vectorised, every block computed per row). The sum is reassociated (lane-wise partial
    sums): results move by rounding only.
    None when the function is not a row-wise kernel of that form."""
    sch = s_tir.Schedule(func)
    blocks = try_inline_all(sch, keep=_shared_transcendentals(sch))
    if len(blocks) < 2 or not is_spatial(sch.get(blocks[-1])):
        return None
    lanes = host.fp32_lanes
    leading = None
    for blk in blocks:
        iters = sch.get(blk).iter_vars
        kinds = [iv.iter_type == tirx.IterVar.DataPar for iv in iters]
        n = next((i for i, k in enumerate(kinds) if not k), len(kinds))
        if n < len(kinds):
            # a keepdims reduction ([1, C, 1] of [1, C, T]) has its unit axis where the rows have their
            # columns: counted as a row axis it put the whole row loop nest, columns too, around the
            # reduction (Wav2Vec2's GroupNorm: the mean recomputed per element, 640x the work)
            while n > 0 and int_or_none(iters[n - 1].dom.extent) == 1:
                n -= 1
        if n == 0 or len(sch.get_loops(blk)) != len(kinds):
            return None
        leading = n if leading is None else min(leading, n)
    assert leading is not None
    reductions = [b for b in blocks if not is_spatial(sch.get(b))]
    if not reductions:
        return None
    widths: dict[str, int] = {}
    for blk in reductions:
        block = sch.get(blk)
        if len(block.writes) != 1 or str(block.writes[0].source.dtype) != "float32":
            return None
        loops = sch.get_loops(blk)
        reduce_at = [p for p, iv in enumerate(block.iter_vars) if iv.iter_type != tirx.IterVar.DataPar]
        if reduce_at != [len(loops) - 1] or not loops_match_iters(sch, blk):
            return None
        ext = int_or_none(sch.get(loops[-1]).extent)
        if ext is None or ext < 2 * lanes:
            return None
        widths[block.name_hint] = ext
    odd = {name: ext for name, ext in widths.items() if ext % lanes}
    if odd:
        # padded before inlining: the inlined fast-math lets, copied into two blocks, would not pass the
        # well-formedness check of a new Schedule
        padded = pad_row_reductions(func, odd, lanes)
        if padded is None:
            return None
        names = [sch.get(b).name_hint for b in blocks]
        sch = s_tir.Schedule(padded)
        blocks = try_inline_all(sch, keep=_shared_transcendentals(sch))
        if [sch.get(b).name_hint for b in blocks] != names:
            return None
        reductions = [b for b in blocks if not is_spatial(sch.get(b))]
    factored = []
    for blk in reductions:
        block = sch.get(blk)
        _, ri = sch.split(sch.get_loops(blk)[-1], [None, lanes])
        factored.append((sch.rfactor(ri, factor_axis=len(block.writes[0].region)), widths[block.name_hint]))
    last = blocks[-1]
    loops = sch.get_loops(last)
    spatial = sch.fuse(*loops[:leading]) if leading > 1 else loops[0]
    rows = int_or_none(sch.get(spatial).extent)
    if num_threads > 1 and (rows is None or rows > 1):
        sch.parallel(spatial)
    params = list(sch.mod["main"].params)       # buffers are their own vars here: a param is an output or input
    standalone: set[str] = set()
    for blk in reversed(root_blocks(sch)[:-1]):
        block = sch.get(blk)
        if is_spatial(block) and any(w.source.same_as(p) for w in block.writes for p in params):
            # a second output (a pre-LN block's residual sum, kept for the next layer) cannot move under
            # the row loop: its own loop nest first, the rows read it back (Whisper's add + LayerNorm ran
            # on the generic reduction rule, 2.5x slower than its unfused parts, Zen3)
            standalone.add(block.name_hint)
            continue
        sch.compute_at(blk, spatial, preserve_unit_loops=True)
    for rf, ext in factored:
        # the lane loop (bound to the rf block's new spatial iter) innermost and vectorised, the rest of
        # the row outside it, its init hoisted before the row loop
        realize = realize_of(sch, rf)
        block = sch.get(rf)
        lane_iter = block.writes[0].region[-1].min        # rfactor appended the lane axis last
        by_var = {str(sch.get(lp).loop_var): lp for lp in sch.get_loops(rf)}
        lane_loop = red_loop = None
        for iv, value in zip(block.iter_vars, realize.iter_values):
            loop = by_var.get(str(value)) if isinstance(value, tirx.Var) else None
            if iv.var.same_as(lane_iter):
                lane_loop = loop
            elif iv.iter_type != tirx.IterVar.DataPar:
                red_loop = loop
        if lane_loop is None or red_loop is None:
            return None
        sch.reorder(red_loop, lane_loop)
        sch.vectorize(lane_loop)
        sch.decompose_reduction(rf, red_loop)
        if ext % lanes:
            # A row no vector divides (ViT's 197 keys, Wav2Vec2's 3199 frames): the split's predicate made
            # the whole row scalar. Partitioned after the init is hoisted (a partition copies the block, and
            # a copy with its own init would restart the sum), the whole vectors run without it and the
            # last, partial vector is its own loop.
            sch.loop_partition(red_loop, [ext // lanes, None])
    for blk in blocks[:-1]:
        if sch.get(blk).name_hint in standalone:
            schedule_spatial_block(sch, blk, host, num_threads=num_threads)
        elif is_spatial(sch.get(blk)):
            _vectorize_inner(sch, blk, lanes)
    _vectorize_inner(sch, last, lanes)      # last: a partitioned row no longer covers what compute_at needs
    return sch


def tree_lane_combines(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc:
    """The final combine of each rfactor'd row reduction (``acc = op(acc, rf[.., l])`` over the `lanes` partial
    results, op + or max) as one balanced tree of `lanes` leaves instead of a loop: the loop is a chain of
    dependent scalar adds (16 x 4 cycles at 16 lanes), twice a row for a softmax or a LayerNorm, and a [1, 4,
    64, 64] softmax (4 vectors a row) spent most of its 14 us there against 7 for ONNX Runtime (SPR class).
    The sum's order changes (rfactor already reassociated it); max is exact either way."""
    dropped: list[tirx.Var] = []

    def _realize(realize: s_tir.SBlockRealize) -> s_tir.SBlockRealize:
        block = realize.block
        store = block.body
        red = [k for k, iv in enumerate(block.iter_vars) if iv.iter_type != tirx.IterVar.DataPar]
        if block.init is None or len(red) != 1 or not isinstance(store, tirx.BufferStore) \
                or int_or_none(block.iter_vars[red[0]].dom.extent) != lanes \
                or not isinstance(realize.iter_values[red[0]], tirx.Var) \
                or not isinstance(store.value, (tirx.Add, tirx.Max)):
            return realize
        k_var = block.iter_vars[red[0]].var
        value = store.value
        acc, x = value.a, value.b
        if not (isinstance(acc, BufferLoad) and acc.source.same_as(store.buffer)):
            acc, x = x, acc
        if not (isinstance(acc, BufferLoad) and acc.source.same_as(store.buffer)) or \
                not isinstance(x, BufferLoad) or x.source.same_as(store.buffer):
            return realize
        index = str(block.iter_vars[red[0]].dom.extent.ty)

        def at(lane: int) -> tirx.Expr:
            return tvm_ffi.structural_map(x, (tirx.Var, lambda v: tirx.IntImm(index, lane) if v.same_as(k_var) else v),
                                          order="post")

        leaves = [at(lane) for lane in range(lanes)]
        while len(leaves) > 1:      # lane l with lane l + half: the halves of a vector, as a shuffle tree pairs them
            half = len(leaves) // 2
            leaves = [type(value)(leaves[i], leaves[i + half]) for i in range(half)] + leaves[2 * half:]
        reads = []
        for region in block.reads:
            if region.source.same_as(store.buffer):
                continue
            reads.append(tirx.BufferRegion(region.source, [
                tvm.ir.Range.from_min_extent(tirx.IntImm(index, 0), tirx.IntImm(index, lanes))
                if rg.min.same_as(k_var) else rg for rg in region.region]))
        keep = [k for k in range(len(block.iter_vars)) if k != red[0]]
        new_block = s_tir.SBlock([block.iter_vars[k] for k in keep], reads, block.writes, block.name_hint,
                                 tirx.BufferStore(store.buffer, leaves[0], store.indices), None,
                                 block.alloc_buffers, block.match_buffers, block.annotations)
        dropped.append(realize.iter_values[red[0]])
        return s_tir.SBlockRealize([realize.iter_values[k] for k in keep], realize.predicate, new_block)

    out = tvm_ffi.structural_map(func, (s_tir.SBlockRealize, _realize), order="post")
    if not dropped:
        return func

    def _loop(loop: tirx.For) -> tirx.Stmt:
        if not any(loop.loop_var.same_as(v) for v in dropped):
            return loop
        uses: list[bool] = []
        tvm_ffi.structural_walk(loop.body, (tirx.Var, lambda v: uses.append(v.same_as(loop.loop_var))), order="post")
        # nothing else under the loop reads its variable: the combine, computed once, is all it ran
        return loop if any(uses) else loop.body

    return tvm_ffi.structural_map(out, (tirx.For, _loop), order="post")


def multiply_by_row_reciprocal(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """A softmax's normalisation ``e / s[row]``, `e` an exp block's output and `s` read at indices without the
    block's last iterator -> ``e * (1 / s[row])``: one scalar division a row instead of a vector division per
    vector (10-16 cycles each on AVX-512), as ONNX Runtime's softmax does. Two roundings instead of one: within
    1.5 ulp. Only over exps: their row sum holds exp(0) = 1 (the max subtracted), so its reciprocal cannot
    overflow, as it would for a sum under float32's smallest normal."""
    exps: list[tirx.Buffer] = []

    def _collect(block: s_tir.SBlock) -> None:
        if isinstance(block.body, tirx.BufferStore) and approx.has_fast_math(block.body):
            exps.append(block.body.buffer)

    tvm_ffi.structural_walk(func, (s_tir.SBlock, _collect), order="post")

    def _block(block: s_tir.SBlock) -> s_tir.SBlock:
        store = block.body
        if not (isinstance(store, tirx.BufferStore) and isinstance(store.value, tirx.Div)
                and str(store.value.ty) == "float32" and is_spatial(block) and block.iter_vars):
            return block
        num, den = store.value.a, store.value.b
        last = block.iter_vars[-1].var
        uses: list[bool] = []
        tvm_ffi.structural_walk(den, (tirx.Var, lambda v: uses.append(v.same_as(last))), order="post")
        if not isinstance(den, BufferLoad) or any(uses) or not isinstance(num, BufferLoad) \
                or not any(num.source.same_as(b) for b in exps):
            return block
        value = num * (tirx.const(1.0, "float32") / den)
        return s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint,
                            tirx.BufferStore(store.buffer, value, store.indices), block.init,
                            block.alloc_buffers, block.match_buffers, block.annotations)

    return tvm_ffi.structural_map(func, (s_tir.SBlock, _block), order="post")


def _shared_transcendentals(sch: s_tir.Schedule) -> list[s_tir.schedule.SBlockRV]:
    """Spatial blocks computing a fast-math exp/erf/tanh (a Let chain, compiler/schedule/approx.py) that two
    or more blocks read: inlined, each reader recomputes it. Softmax's exp is read by its sum and by the
    normalisation; kept as its own block per row, it is computed once (a [2364, 200] softmax, 2 threads,
    interleaved: 512 -> 367 us, Zen3)."""
    keep = []
    for blk in root_blocks(sch):
        block = sch.get(blk)
        if is_spatial(block) and len(sch.get_consumers(blk)) >= 2 and approx.has_fast_math(block.body):
            keep.append(blk)
    return keep


def pad_row_reductions(func: tirx.PrimFunc, widths: dict[str, int], lanes: int) -> tirx.PrimFunc | None:
    """Each named reduction block's row (its innermost loop, of ``widths[name]`` elements) padded to whole
    vectors: the padded iterations add the reduction's identity (its init value) and read the row's last
    element (the index clamped, so nothing past the row is touched). None when a block's update is not
    ``acc = f(acc, value)``.

    Why not split with a predicate: rfactor drops the split's predicate (TVM 0.27), so the lane-wise partial
    results read past each row, into the next row or past the buffer. The guard costs the last vector
    (scalarised); loop_partition leaves the whole vectors without it (their bounds prove it away)."""
    done: set[str] = set()

    def pad(loop: tirx.For) -> tirx.For:
        realize = loop.body
        if not isinstance(realize, s_tir.SBlockRealize) or realize.block.name_hint not in widths:
            return loop
        block, ext = realize.block, widths[realize.block.name_hint]
        store, init = block.body, block.init
        red = block.iter_vars[-1]
        if not (isinstance(store, tirx.BufferStore) and isinstance(init, tirx.BufferStore)
                and int_or_none(loop.extent) == ext and realize.iter_values[-1].same_as(loop.loop_var)):
            return loop
        value = store.value
        sides = [getattr(value, "a", None), getattr(value, "b", None)]

        def is_acc(e: object) -> bool:
            return isinstance(e, BufferLoad) and e.source.same_as(store.buffer) and \
                tvm_ffi.structural_equal(list(e.indices), list(store.indices))

        if sides[0] is None or sides[1] is None or is_acc(sides[0]) == is_acc(sides[1]):
            return loop
        index = str(red.dom.extent.ty)
        clamped = tirx.min(red.var, tirx.const(ext - 1, index))

        def clamp(e):  # noqa: ANN001, ANN202 - any TIR node
            return tvm_ffi.structural_map(e, (tirx.Var, lambda v: clamped if v.same_as(red.var) else v), order="post")

        k = 1 if is_acc(sides[0]) else 0
        # if_then_else: the partial vector is scalarised. A Select kept it a vector, but LLVM rejected the
        # clamped 6-lane load TVM made of it ("Invalid shufflevector operands", a 30-wide softmax)
        guarded = tirx.if_then_else(red.var < tirx.const(ext, index), clamp(sides[k]), init.value)
        new_value = type(value)(sides[0], guarded) if k == 1 else type(value)(guarded, sides[1])
        padded = (ext + lanes - 1) // lanes * lanes
        iter_vars = [*block.iter_vars[:-1],
                     tirx.IterVar(tvm.ir.Range(0, tirx.const(padded, index)), red.var, red.iter_type)]
        reads = [tirx.BufferRegion(r.source, [tvm.ir.Range.from_min_extent(clamp(rg.min), rg.extent)
                                              for rg in r.region]) for r in block.reads]
        new_block = s_tir.SBlock(iter_vars, reads, block.writes, block.name_hint,
                                 tirx.BufferStore(store.buffer, new_value, store.indices), init,
                                 block.alloc_buffers, block.match_buffers, block.annotations)
        done.add(block.name_hint)
        return tirx.For(loop.loop_var, loop.min, tirx.const(padded, str(loop.extent.ty)), loop.kind,
                        s_tir.SBlockRealize(realize.iter_values, realize.predicate, new_block),
                        loop.thread_binding, loop.annotations)

    out = tvm_ffi.structural_map(func, (tirx.For, pad), order="post")
    return out if done == set(widths) else None


def _vectorize_inner(sch: s_tir.Schedule, blk: s_tir.schedule.SBlockRV, lanes: int) -> None:
    """Vectorise a block's innermost loop below the row loop (split to the vector length when longer)."""
    loops = sch.get_loops(blk)
    if len(loops) <= 1:
        return
    ext = int_or_none(sch.get(loops[-1]).extent)
    if ext is None:
        return
    if ext > lanes and ext % lanes == 0:
        _, vec = sch.split(loops[-1], [None, lanes])
        sch.vectorize(vec)
    elif ext > lanes:
        # whole vectors, the last columns a scalar loop: vectorised at 6 lanes, a softmax's fast exp made
        # LLVM reject the module ("Invalid shufflevector operands", TVM 0.27)
        body, _ = sch.loop_partition(loops[-1], [ext - ext % lanes, None])
        sch.vectorize(sch.split(body, [None, lanes])[1])
    elif 2 <= ext <= lanes:
        sch.vectorize(loops[-1])


def schedule_generic_reduction(sch: s_tir.Schedule, host: HostCPU, *, num_threads: int) -> bool:
    """Fallback for any function with reductions: inline what can be, parallelise each block's outer
    spatial loops (reductions stay serial inside), vectorise trailing spatial loops of injective blocks.

    Covers pooling, global average pooling and reductions over leading axes that the row rule rejects.
    """
    blocks = try_inline_all(sch)
    if not blocks:
        return False
    did = False
    for blk in blocks:
        block = sch.get(blk)
        if is_spatial(block):
            schedule_spatial_block(sch, blk, host, num_threads=num_threads)
            did = True
            continue
        loops = sch.get_loops(blk)
        kinds = [iv.iter_type for iv in block.iter_vars]
        if len(loops) != len(kinds):
            continue
        lead = 0
        while lead < len(kinds) and kinds[lead] == tirx.IterVar.DataPar:
            lead += 1
        if lead == 0:
            continue
        # Put all spatial loops outside the reduction loops when they are separated by reduce loops.
        spatial_loops = [lp for lp, k in zip(loops, kinds) if k == tirx.IterVar.DataPar]
        red_loops = [lp for lp, k in zip(loops, kinds) if k != tirx.IterVar.DataPar]
        try:
            sch.reorder(*spatial_loops, *red_loops)
        except Exception:  # noqa: BLE001 - keep the original order when reordering is illegal
            spatial_loops = loops[:lead]
        fused = sch.fuse(*spatial_loops) if len(spatial_loops) > 1 else spatial_loops[0]
        ext = int_or_none(sch.get(fused).extent)
        if num_threads > 1 and (ext is None or ext >= 2):
            sch.parallel(fused)
        did = True
    return did
