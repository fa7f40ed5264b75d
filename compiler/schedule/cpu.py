"""Rule-based CPU scheduling of a fused Relax module (the default pipeline otherwise runs naive loops).

Entry point: :func:`schedule_cpu_module`, run inside ``with target:`` after
``LegalizeOps -> AnnotateTIROpPattern -> FoldConstant -> FuseOps -> FuseTIR`` and before the stock
lowering.  Each PrimFunc is classified by structure (iterator kinds, access patterns) and handed to
one rule, tried in order: matmul, conv2d, row reduction, generic reduction, injective.  A rule that
raises or declines leaves the function untouched for the next; a function no rule takes is left
as it was (correct, just slow) and listed in the report.  Every optimisation has a switch in
:class:`CpuScheduleOptions`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.s_tir.schedule import SBlockRV

from .. import settings
from ..hw.hostcpu import HostCPU, host_from_target
from . import approx
from .cpu_conv import (MIN_GROUP_TILE, conv_tiles, match_conv2d, pointwise_tiles, schedule_conv2d,
                       schedule_pointwise, tile_in_group)
from .cpu_conv_blocked import match_blocked_conv, schedule_blocked_conv
from .cpu_depthwise import match_depthwise, schedule_depthwise
from .cpu_elementwise import (schedule_generic_reduction, schedule_injective, schedule_row_reduction,
                              multiply_by_row_reciprocal, schedule_vector_row_reduction, tree_lane_combines)
from .cpu_matmul import (b_panel_width, choose_tiles, clamp_padded_rows, match_matmul, merge_rows, round_up,
                         rows_padded, schedule_matmul, widen_param)
from .cpu_matmul_int8 import K_STEP, choose_int8_tiles, match_int8_matmul, schedule_matmul_int8
from .packing import PackPlan
from .tir_analysis import executed_block_instances, is_reduction, is_spatial, root_blocks

SCHEDULE_ATTR = "fuseguard.cpu_schedule"
# Functions doing less work than this (summed block iteration counts) run single-threaded: a parallel
# region costs microseconds when cores are idle but milliseconds when they are shared (the pool's
# barrier waits for a descheduled worker), measured 0.2 ms serial vs 4-12 ms parallel for LayerNorm.
# Re-measured lower with the A/B gate (SPR class, 2 threads, both pools not spinning): 1 << 19 made
# MobileNet-V2 0.93x (its 0.5-4 M-iteration depthwise and pooling kernels) but ViT-tiny 1.18x and
# MobileNetV3-small 1.17x slower; 1 << 21 MobileNetV3-small 1.22x slower, the rest unchanged. Kept.
PARALLEL_MIN_WORK = 1 << 22
#: ... unless their buffers hold this many bytes: such a kernel is bound by reading them, ~100 us or more on
#: one core, and a second core's bandwidth pays for the wake-up many times over. Serial, ResNet-50's
#: 2048 -> 1000 classifier (2 M multiply-adds over 8 MB of weights) ran 541 us against ORT's 213, and its
#: 3x3 max pool over 3.2 MB 217 us against 74 (SPR class, 2 threads, in the model).
PARALLEL_MIN_BYTES = 2 << 20


@dataclass(frozen=True)
class CpuScheduleOptions:
    """Switches for each optimisation (all numerically exact except ``fast_math``)."""

    matmul: bool = True
    pack_weights: bool = True  # constant matmul B operands re-laid out as [N/w, K, w] panels (w: a cache line)
    # A constant B whose columns no full vector divides (344, 1000) zero-padded to whole tiles at compile
    # time rather than tiled at 8 columns or fewer (cpu_matmul.widen_param).
    pad_weight_columns: bool = True
    conv: bool = True
    # Conv register tile (mr columns x nr channels) chosen jointly to maximise mr * nr: odd widths
    # (13, 27, 55) no longer fall back to mr = 1 or tiny tiles.
    conv_tile_search: bool = True
    # Input channels split into L1-sized weight blocks, every column tile of a row reusing one block
    # before the next (cpu_conv.reduction_block).
    conv_rc_block: bool = True
    # A small output plane is the tile each of those weight blocks is reused over (cpu_conv._plane_fits).
    conv_plane_tile: bool = True
    # An input image bigger than half of L2 is read once per L2-sized block of output-channel tiles, not once
    # per tile (cpu_conv.channel_block).
    conv_channel_block: bool = True
    # The same for the channel-blocked convs of the layout step: input-channel blocks of L1-sized weights,
    # each reused by the column tiles of several output rows (cpu_conv_blocked.reduction_blocking).
    blocked_rc_block: bool = True
    # 1x1 stride-1 convs as a GEMM with the output row as the vector axis (cpu_conv.schedule_pointwise).
    conv_pointwise: bool = True
    # Grouped 1x1 convs on that kernel too, a tile within one group, instead of the per-plane rule (ShuffleNet).
    grouped_pointwise: bool = True
    # Stride-2 depthwise convs read a de-interleaved padded plane (even columns, then odd): contiguous taps.
    depthwise_deinterleave: bool = True
    reduction: bool = True
    # Row sums and maxima in vector registers (rfactor by the vector length; cpu_elementwise).
    vector_reductions: bool = True
    injective: bool = True
    parallel: bool = True
    # Symbolic functions choose parallel or serial per call by their work (`_parallel_when_worth`).
    parallel_when_worth: bool = True
    # Padded rows of a symbolic matmul read row m-1 again instead of a select (cpu_matmul.clamp_padded_rows).
    clamp_padded_rows: bool = True
    # Polynomial exp/erf/tanh that stay vectorised: <= 3.3e-7 abs error (a few float32 ulp), inf/NaN kept.
    fast_math: bool = True

    @classmethod
    def from_env(cls) -> CpuScheduleOptions:
        """``FUSEGUARD_CPU_SCHEDULE_OFF=pack_weights,conv`` turns switches off, ``..._ON=fast_math`` on."""
        opts = cls()
        off = set(settings.items("FUSEGUARD_CPU_SCHEDULE_OFF"))
        on = set(settings.items("FUSEGUARD_CPU_SCHEDULE_ON"))
        known = set(cls.__dataclass_fields__)
        bad = (off | on) - known
        if bad:
            raise ValueError(f"unknown CPU schedule switch(es) {sorted(bad)}; known: {sorted(known)}")
        return replace(opts, **{k: False for k in off}, **{k: True for k in on})


@dataclass
class ScheduleReport:
    """Which rule took each PrimFunc; ``left_alone`` maps a function to why no rule applied."""

    scheduled: dict[str, str] = field(default_factory=dict)
    left_alone: dict[str, str] = field(default_factory=dict)
    packed_weights: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"{name}: {rule}" for name, rule in sorted(self.scheduled.items())]
        lines += [f"{name}: left alone ({why})" for name, why in sorted(self.left_alone.items())]
        return "\n".join(lines)


def schedule_cpu_module(
    mod: tvm.IRModule,
    target: tvm.target.Target,
    *,
    enabled: bool = True,
    num_threads: int | None = None,
    options: CpuScheduleOptions | None = None,
) -> tvm.IRModule:
    """Schedule every PrimFunc of a fused module for ``target``; a no-op when ``enabled`` is False."""
    return schedule_cpu_module_with_report(mod, target, enabled=enabled, num_threads=num_threads, options=options)[0]


def schedule_cpu_module_with_report(
    mod: tvm.IRModule,
    target: tvm.target.Target,
    *,
    enabled: bool = True,
    num_threads: int | None = None,
    options: CpuScheduleOptions | None = None,
) -> tuple[tvm.IRModule, ScheduleReport]:
    report = ScheduleReport()
    if not enabled:
        return mod, report
    opts = options or CpuScheduleOptions.from_env()
    host = host_from_target(target)
    threads = int(num_threads or host.cores)
    if not opts.parallel:
        threads = 1
    call_sites = _collect_call_sites(mod)
    updates: dict[tvm.ir.GlobalVar, tirx.PrimFunc] = {}
    packs: dict[tvm.ir.GlobalVar, PackPlan] = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        if func.attrs is not None and ("tirx.is_scheduled" in func.attrs or SCHEDULE_ATTR in func.attrs):
            report.left_alone[gv.name_hint] = "already scheduled"
            continue
        if opts.fast_math:
            func = approx.rewrite_fast_math(func)
        fthreads = threads if _work(func) >= PARALLEL_MIN_WORK or _param_bytes(func) >= PARALLEL_MIN_BYTES else 1
        result = _schedule_one(func, target, host, opts, fthreads, call_sites.get(gv, []))
        if result is None:
            report.left_alone[gv.name_hint] = "no rule matched"
            if opts.fast_math:
                updates[gv] = func
            continue
        new_func, rule, pack = result
        new_func = _serial_symbolic_vectors(new_func)
        if fthreads > 1 and opts.parallel_when_worth:
            new_func = _parallel_when_worth(new_func, _work_expr(func))
        updates[gv] = new_func.with_attr(SCHEDULE_ATTR, rule).with_attr("tirx.is_scheduled", True)
        report.scheduled[gv.name_hint] = rule
        if pack is not None:
            packs[gv] = pack
            report.packed_weights.append(gv.name_hint)
    for gv, func in updates.items():
        if gv not in packs:
            mod = _with_function(mod, gv, func)
    if packs:
        mod = _repack_constants(mod, {gv: (updates[gv], plan) for gv, plan in packs.items()})
    return mod, report


#: A block evaluating a fast-math exp/erf/tanh/sigmoid (a Let chain, compiler/schedule/approx.py) counts
#: this many iterations per element: ~20 vector operations against one or two for an add or a ReLU. Counted
#: as one, ViT's [2364, 197] softmax (1.9 M iterations) ran serial: 670 us against 302 us on two threads.
TRANSCENDENTAL_WORK = 8


def _work(func: tirx.PrimFunc) -> int:
    """Iterations summed over blocks (symbolic extents count as large), a transcendental block's weighted:
    a cheap estimate of the work."""
    total = 0
    sch = s_tir.Schedule(func)
    for blk in root_blocks(sch):
        n = 1
        block = sch.get(blk)
        for iv in block.iter_vars:
            ext = iv.dom.extent
            n *= int(ext.value) if isinstance(ext, tirx.IntImm) else 1 << 20
        total += n * (TRANSCENDENTAL_WORK if approx.has_fast_math(block.body) else 1)
    return total


def _param_bytes(func: tirx.PrimFunc) -> int:
    """Bytes of the function's static parameters (inputs, weights, outputs); symbolic ones count nothing
    (their functions choose per call, `_parallel_when_worth`)."""
    total = 0
    for param in func.params:
        shape = getattr(param, "shape", None)
        if not shape or not all(isinstance(d, tirx.IntImm) for d in shape):
            continue
        total += math.prod(int(d) for d in shape) * tvm.DataType(str(param.dtype)).bits // 8
    return total


def _work_expr(func: tirx.PrimFunc) -> tirx.PrimExpr | None:
    """`_work` as an expression of the symbolic dims; None when every extent is static."""
    total: tirx.PrimExpr = tirx.IntImm("int64", 0)
    symbolic = False
    sch = s_tir.Schedule(func)
    for blk in root_blocks(sch):
        n: tirx.PrimExpr = tirx.IntImm("int64", 1)
        for iv in sch.get(blk).iter_vars:
            ext = iv.dom.extent
            symbolic |= not isinstance(ext, tirx.IntImm)
            n = n * tirx.Cast("int64", ext)
        total = total + n
    return total if symbolic else None


def _parallel_when_worth(func: tirx.PrimFunc, work: tirx.PrimExpr | None) -> tirx.PrimFunc:
    """A symbolic function runs its parallel loops in parallel only when the call's work reaches
    PARALLEL_MIN_WORK, serial below (the same loop nest, chosen per call): a symbolic extent counted as
    large made every such kernel parallel, and at small sizes the pool's wake-up was the whole cost
    (softmax_layernorm at seq 5: 4.0x the static build's time; serial, 1.1x; Zen3)."""
    if work is None:
        return func
    cond = work >= tirx.IntImm("int64", PARALLEL_MIN_WORK)
    # Buffers go to where they are used first (as lowering would place them): a tile accumulator allocated
    # at the root and read in both branches stayed whole-size, in memory, and the matmuls ran 2.4x slower.
    # (that pass wants reduction inits lowered first, as lowering does.)
    func = tvm.ir.transform.Sequential([s_tir.transform.LowerInitBlock(),
                                        s_tir.transform.PlanAndUpdateBufferAllocationLocation()])(
        tvm.IRModule({"main": func}))["main"]

    def _branch(loop: tirx.For, mutator) -> tirx.Stmt:  # noqa: ANN001 - tvm_ffi mutator handle
        if loop.kind != tirx.ForKind.PARALLEL:
            return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, mutator.mutate(loop.body),
                            loop.thread_binding, loop.annotations, loop.step, loop.span)
        return tirx.IfThenElse(cond, loop, _own_buffers(_serialise(loop)))

    out = tvm_ffi.structural_mutate(func, (tirx.For, _branch))
    # both branches hold the same loop and block vars: give each definition its own
    return tirx.transform.ConvertSSA()(tvm.IRModule({"main": out}))["main"]


def _own_buffers(stmt: tirx.Stmt) -> tirx.Stmt:
    """The buffers allocated inside `stmt` replaced by fresh ones (buffers are Vars in this TVM), for a
    copy of a loop nest that sits beside the original: one definition per buffer."""
    allocated: list[tvm.ir.expr.Var] = []

    def _collect(block: s_tir.SBlock) -> None:
        allocated.extend(block.alloc_buffers)

    tvm_ffi.structural_walk(stmt, (s_tir.SBlock, _collect), order="post")
    if not allocated:
        return stmt
    fresh = {b: tirx.decl_buffer(b.shape, b.dtype, b.name, strides=b.strides, elem_offset=b.elem_offset,
                                 scope=b.scope(), data_alignment=b.data_alignment, offset_factor=b.offset_factor)
             for b in allocated}

    def _swap(var: tvm.ir.expr.Var, mutator) -> tvm.ir.expr.Var:  # noqa: ANN001 - tvm_ffi mutator handle
        for old, new in fresh.items():
            if var.same_as(old):
                return new
        return var

    return tvm_ffi.structural_mutate(stmt, (tvm.ir.expr.Var, _swap))


def _with_function(mod: tvm.IRModule, gv: tvm.ir.GlobalVar, func: tirx.PrimFunc) -> tvm.IRModule:
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    mod[gv] = func
    return mod


def _schedule_one(
    func: tirx.PrimFunc,
    target: tvm.target.Target,
    host: HostCPU,
    opts: CpuScheduleOptions,
    threads: int,
    sites: list[relax.Call],
) -> tuple[tirx.PrimFunc, str, PackPlan | None] | None:
    """Try the rules in order on fresh copies of ``func``; first success wins."""
    sch0 = s_tir.Schedule(func)
    blocks = root_blocks(sch0)
    if not blocks:
        return None
    kinds = [sch0.get(b) for b in blocks]
    has_red = any(is_reduction(b) for b in kinds)

    if opts.matmul and has_red:
        res = _try_matmul_int8(func, host, threads, sites)
        if res is not None:
            return res
        res = _try_matmul(func, host, opts, threads, sites)
        if res is not None:
            return res
    if opts.conv and has_red:
        res = _try_blocked(func, host, threads, rc_block=opts.blocked_rc_block)
        if res is not None:
            return res
        res = _try_depthwise(func, host, threads, deinterleave=opts.depthwise_deinterleave,
                             defer_grouped=opts if opts.grouped_pointwise else None)
        if res is not None:
            return res
        res = _try_conv(func, host, opts, threads, sites)
        if res is not None:
            return res
        res = _try_depthwise(func, host, threads, any_conv=True)
        if res is not None:
            return res
    if opts.reduction and has_red and opts.vector_reductions:
        try:
            sch = schedule_vector_row_reduction(func, host, num_threads=threads)
        except Exception:  # noqa: BLE001 - a form rfactor or compute_at refuses: dlight's rule below
            sch = None
        if sch is not None and not _recomputes(func, sch.mod["main"]):
            out = multiply_by_row_reciprocal(tree_lane_combines(sch.mod["main"], host.fp32_lanes))
            return out, "row-reduction+vector", None
    if opts.reduction and has_red:
        sch = schedule_row_reduction(func, target)
        if sch is not None and _recomputes(func, sch.mod["main"]):
            sch = None      # dlight's rule nested a [1, 1000] softmax's reductions under the 1000 columns:
                            # O(n^2), 1.7 ms for 1000 values (shufflenet's final softmax)
        if sch is not None and _annotated_parallel(sch.mod["main"]):
            out = sch.mod["main"] if threads > 1 else _serialise(sch.mod["main"])
            return out, "row-reduction", None
        sch = s_tir.Schedule(func)
        try:
            if schedule_generic_reduction(sch, host, num_threads=threads):
                return sch.mod["main"], "reduction", None
        except Exception:  # noqa: BLE001
            pass
    if opts.injective and not has_red and all(is_spatial(b) for b in kinds):
        sch = s_tir.Schedule(func)
        try:
            if schedule_injective(sch, host, num_threads=threads):
                return sch.mod["main"], "injective", None
        except Exception:  # noqa: BLE001
            pass
    return None


def _recomputes(before: tirx.PrimFunc, after: tirx.PrimFunc, slack: float = 1.5) -> bool:
    """Does the schedule run noticeably more block instances than the function computes?"""
    a, b = executed_block_instances(before), executed_block_instances(after)
    return a is not None and b is not None and b > slack * a


def _try_matmul_int8(func: tirx.PrimFunc, host: HostCPU, threads: int,
                     sites: list[relax.Call]) -> tuple[tirx.PrimFunc, str, PackPlan] | None:
    """The integer matmuls of QDQ models (compiler/passes/int8_gemm.py) on the VNNI tile; B must be a constant
    (it is packed at compile time). Anything else falls through to the generic rules."""
    sch = s_tir.Schedule(func)
    infos = [i for i in (match_int8_matmul(sch, b) for b in root_blocks(sch)) if i is not None]
    if len(infos) != 1:
        return None
    info = infos[0]
    tiles = choose_int8_tiles(info, host)
    if tiles is None or not _constant_param(func, info.b_buffer, sites):
        return None
    try:
        if not schedule_matmul_int8(sch, info, tiles, parallel=threads > 1):
            return None
    except Exception:  # noqa: BLE001 - a form tensorize or the epilogue does not take: the generic rules
        return None
    param = next(p for p, v in enumerate(func.params) if v.same_as(info.b_buffer))
    return sch.mod["main"], "matmul-int8+vnni", PackPlan(param, info.b_indices.index(info.j_iter), tiles.lanes, K_STEP)


def _try_matmul(
    func: tirx.PrimFunc,
    host: HostCPU,
    opts: CpuScheduleOptions,
    threads: int,
    sites: list[relax.Call],
) -> tuple[tirx.PrimFunc, str, PackPlan | None] | None:
    sch = s_tir.Schedule(func)
    infos = [i for i in (match_matmul(sch, b) for b in root_blocks(sch)) if i is not None]
    if len(infos) != 1:
        return None
    info = infos[0]
    original = func
    constant_b = _constant_param(func, info.b_buffer, sites)
    j_dim = info.b_indices.index(info.j_iter)
    pack = widened = None
    if constant_b and opts.pad_weight_columns:
        tiles = choose_tiles(info, host, pad_columns=True)
        if tiles.pad_n and info.n is not None:
            # whole column tiles from a weight zero-padded at compile time (`widen_param`)
            extent = round_up(info.n, tiles.nr)
            param = next(p for p, v in enumerate(func.params) if v.same_as(info.b_buffer))
            func = widen_param(func, info.b_buffer, j_dim, extent)
            widened = PackPlan(param, j_dim, pad_to=extent)
            if opts.pack_weights:
                pack = PackPlan(param, j_dim, b_panel_width(info, tiles.nr), pad_to=extent)
    if widened is None and opts.pack_weights:
        nr = choose_tiles(info, host).nr
        pack = _pack_plan(func, info.b_buffer, j_dim, nr, info.n, host, sites)
        if pack is not None:
            pack = replace(pack, nr=b_panel_width(info, nr))     # as schedule_matmul packs it
    for attempt_pack in ((True, False) if pack else (False,)):
        sch = s_tir.Schedule(func)
        info = next(i for i in (match_matmul(sch, b) for b in root_blocks(sch)) if i is not None)
        pad_columns = widened is not None or not constant_b
        info = merge_rows(sch, info, host, pad_columns=pad_columns)
        try:
            ok = schedule_matmul(sch, info, host, pack_b=attempt_pack, parallel=threads > 1,
                                 pad_columns=pad_columns)
        except Exception:  # noqa: BLE001 - e.g. an epilogue that cannot follow the tile
            ok = False
        if ok:
            rule = "matmul+packed" if attempt_pack else "matmul"
            padded = info.m is None or rows_padded(info, choose_tiles(info, host, pad_columns=pad_columns))
            out = clamp_padded_rows(sch.mod["main"]) if padded and opts.clamp_padded_rows else sch.mod["main"]
            return out, rule, (pack if attempt_pack else widened)
    if widened is not None:     # a form the padded tile does not take: the weight as it is
        return _try_matmul(original, host, replace(opts, pad_weight_columns=False), threads, sites)
    return None


def _try_blocked(func: tirx.PrimFunc, host: HostCPU, threads: int,
                 rc_block: bool = True) -> tuple[tirx.PrimFunc, str, None] | None:
    """The channel-blocked convs of the layout step (compiler/passes/layout.py)."""
    sch = s_tir.Schedule(func)
    infos = [i for i in (match_blocked_conv(sch, b) for b in root_blocks(sch)) if i is not None]
    if len(infos) != 1:
        return None
    try:
        ok = schedule_blocked_conv(sch, infos[0], host, num_threads=threads, rc_block=rc_block)
    except Exception:  # noqa: BLE001 - a form the rule does not take: the next rule gets a fresh copy
        return None
    rule = "pool-NCHWc" if infos[0].pool else "depthwise-conv2d-NCHWc" if infos[0].depthwise else "conv2d-NCHWc"
    return (sch.mod["main"], rule, None) if ok else None


def _try_depthwise(func: tirx.PrimFunc, host: HostCPU, threads: int, any_conv: bool = False,
                   deinterleave: bool = True, defer_grouped: CpuScheduleOptions | None = None,
                   ) -> tuple[tirx.PrimFunc, str, None] | None:
    """The per-plane rule; with `defer_grouped`, a grouped 1x1 conv the dense kernels can take is left to them."""
    sch = s_tir.Schedule(func)
    infos = [i for i in (match_depthwise(sch, b, any_conv=any_conv) for b in root_blocks(sch)) if i is not None]
    if len(infos) != 1:
        return None
    if defer_grouped is not None and not infos[0].depthwise and _grouped_dense(sch, infos[0].block, host,
                                                                                defer_grouped):
        return None
    try:
        ok = schedule_depthwise(sch, infos[0], host, num_threads=threads, deinterleave=deinterleave)
    except Exception:  # noqa: BLE001 - a form the rule does not take: the dense conv rule gets a fresh copy
        ok = False
    rule = "depthwise-conv2d" if infos[0].depthwise else ("conv2d-row" if any_conv else "grouped-conv2d")
    return (sch.mod["main"], rule, None) if ok else None


def _grouped_dense(sch: s_tir.Schedule, block: SBlockRV, host: HostCPU, opts: CpuScheduleOptions) -> bool:
    """A grouped 1x1 conv the dense kernels can tile within a group (ShuffleNet's 3-group 1x1s): the pointwise
    GEMM kernel (channels unrolled, a tile inside one group) or the channel-vector one (a channel tile inside
    one group, so every lane reads the same input channel). Asked on the per-plane rule's schedule, so convs
    that rule does not match pay nothing (a schedule of its own per conv cost SqueezeNet 20% compile time)."""
    info = match_conv2d(sch, block)
    if info is None or info.group_out is None or info.kernel_area != 1:
        return False
    if opts.conv_pointwise and info.pointwise and pointwise_tiles(info, host) is not None:
        return True
    _, nr = conv_tiles(info, host, search=opts.conv_tile_search)
    return nr >= 4 and tile_in_group(info, nr)


def _try_conv(
    func: tirx.PrimFunc,
    host: HostCPU,
    opts: CpuScheduleOptions,
    threads: int,
    sites: list[relax.Call],
) -> tuple[tirx.PrimFunc, str, PackPlan | None] | None:
    sch = s_tir.Schedule(func)
    infos = [i for i in (match_conv2d(sch, b) for b in root_blocks(sch)) if i is not None]
    if len(infos) != 1:
        return None
    if opts.conv_pointwise and infos[0].pointwise and pointwise_tiles(infos[0], host) is not None:
        mr = pointwise_tiles(infos[0], host)[0]  # type: ignore[index]
        pw_pack = _pack_plan(func, infos[0].w_buffer, infos[0].f_dim, mr, infos[0].oc, host, sites) \
            if opts.pack_weights else None
        for attempt_pack in ((True, False) if pw_pack else (False,)):
            sch = s_tir.Schedule(func)
            info = next(i for i in (match_conv2d(sch, b) for b in root_blocks(sch)) if i is not None)
            try:
                ok = schedule_pointwise(sch, info, host, num_threads=threads, pack_w=attempt_pack,
                                        channel_blocks=opts.conv_channel_block)
            except Exception:  # noqa: BLE001 - the channel-vector rule below gets a fresh copy
                ok = False
            if ok:
                return sch.mod["main"], "conv2d-1x1+packed" if attempt_pack else "conv2d-1x1", \
                    (pw_pack if attempt_pack else None)
    pack = None
    _, nr = conv_tiles(infos[0], host, search=opts.conv_tile_search)
    if not tile_in_group(infos[0], nr) or (infos[0].group_out is not None and nr < MIN_GROUP_TILE):
        return None     # the per-plane rule takes it
    if opts.pack_weights:
        pack = _pack_plan(func, infos[0].w_buffer, infos[0].f_dim, nr, infos[0].oc, host, sites)
    for attempt_pack in ((True, False) if pack else (False,)):
        sch = s_tir.Schedule(func)
        info = next(i for i in (match_conv2d(sch, b) for b in root_blocks(sch)) if i is not None)
        try:
            ok = schedule_conv2d(
                sch, info, host, num_threads=threads, pack_w=attempt_pack, tile_search=opts.conv_tile_search,
                rc_block=opts.conv_rc_block, plane_tile=opts.conv_plane_tile,
                channel_blocks=opts.conv_channel_block,
            )
        except Exception:  # noqa: BLE001 - rule declined mid-way; the next rule gets a fresh copy
            ok = False
        if ok:
            rule = "conv2d+packed" if attempt_pack else "conv2d"
            return sch.mod["main"], rule, (pack if attempt_pack else None)
    return None


def _pack_plan(
    func: tirx.PrimFunc,
    buffer_var: object,
    j_dim: int,
    nr: int,
    j_extent: int | None,
    host: HostCPU,
    sites: list[relax.Call],
) -> PackPlan | None:
    """Pack a weight when it is a parameter fed by a Relax constant at every call site and splits evenly."""
    if j_extent is None or nr < 4 or j_extent % nr or not _constant_param(func, buffer_var, sites):
        return None
    return PackPlan(next(p for p, v in enumerate(func.params) if v.same_as(buffer_var)), j_dim, nr)


def _constant_param(func: tirx.PrimFunc, buffer_var: object, sites: list[relax.Call]) -> bool:
    """Is this parameter fed by a Relax constant at every call site (a weight)?"""
    idx = next((p for p, v in enumerate(func.params) if v.same_as(buffer_var)), None)
    if idx is None or not sites:
        return False
    for call in sites:
        args = call.args[1].fields if call is not None and isinstance(call.args[1], relax.Tuple) else None
        if args is None or idx >= len(args) or not isinstance(args[idx], tvm.ir.GenericConst):
            return False
    return True


_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _collect_call_sites(mod: tvm.IRModule) -> dict[tvm.ir.GlobalVar, list[relax.Call]]:
    sites: dict[tvm.ir.GlobalVar, list[relax.Call]] = {}
    by_name = {gv.name_hint: gv for gv in mod.get_global_vars()}

    def _visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Call) and expr.op.same_as(_CALL_TIR) and isinstance(expr.args[0], tvm.ir.GlobalVar):
            gv = by_name.get(expr.args[0].name_hint)
            if gv is not None:
                sites.setdefault(gv, []).append(expr)
        elif isinstance(expr, tvm.ir.GlobalVar) and expr.name_hint in by_name:
            # A PrimFunc referenced other than by call_tir: never change its signature.
            sites.setdefault(by_name[expr.name_hint], []).append(None)  # type: ignore[arg-type]

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, _visit)
    # Each call_tir's GlobalVar is also visited on its own; drop those duplicates, keep foreign uses.
    cleaned: dict[tvm.ir.GlobalVar, list[relax.Call]] = {}
    for gv, lst in sites.items():
        calls = [c for c in lst if c is not None]
        foreign = len(lst) - len(calls) - len(calls)
        cleaned[gv] = calls if foreign <= 0 else []
    return cleaned


def _repack_constants(
    mod: tvm.IRModule, packs: dict[tvm.ir.GlobalVar, tuple[tirx.PrimFunc, PackPlan]]
) -> tvm.IRModule:
    """Install re-laid-out PrimFuncs and feed each call site the panel-major copy of its constant.

    A changed signature needs a fresh GlobalVar (its type is derived when the builder adds it), so the
    old functions are dropped and call sites are pointed at the new ones.
    """
    rest = tvm.IRModule({g: f for g, f in mod.functions_items() if g not in packs}, attrs=mod.attrs)
    bb = relax.BlockBuilder(rest)
    plan_by_name: dict[str, tuple[tvm.ir.GlobalVar, PackPlan]] = {}
    for old_gv, (func, plan) in packs.items():
        plan_by_name[old_gv.name_hint] = (bb.add_func(func, old_gv.name_hint), plan)
    staged = bb.get()

    @relax.expr_functor.mutator
    class _Repack(relax.PyExprMutator):
        def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 - visitor API
            call = super().visit_call_(call)
            if not (call.op.same_as(_CALL_TIR) and isinstance(call.args[0], tvm.ir.GlobalVar)):
                return call
            entry = plan_by_name.get(call.args[0].name_hint)
            if entry is None:
                return call
            new_gv, plan = entry
            fields = list(call.args[1].fields)
            packed = plan.apply(fields[plan.param].value.numpy())
            fields[plan.param] = relax.const(packed, str(packed.dtype))
            return relax.Call(call.op, [new_gv, relax.Tuple(fields), *call.args[2:]], call.attrs, call.ty_args)

    mutator = _Repack(staged)
    for gv, func in staged.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get()


def _serial_symbolic_vectors(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """A vectorised loop whose extent is symbolic runs serial: LLVM cannot vectorise it on a fixed-width ISA
    ("Failed to vectorize loop with extent size"), and a conv with a symbolic image size (`--dynamic size`)
    failed to build in the dense conv rule's row epilogue."""
    return _loops_serial(func, lambda loop: loop.kind == tirx.ForKind.VECTORIZED
                         and not isinstance(loop.extent, tirx.IntImm))


def _serialise(node: tirx.PrimFunc | tirx.Stmt) -> tirx.PrimFunc | tirx.Stmt:
    """Turn parallel loops serial (for functions too small to amortise a parallel region)."""
    return _loops_serial(node, lambda loop: loop.kind == tirx.ForKind.PARALLEL)


def _loops_serial(node: tirx.PrimFunc | tirx.Stmt, which: Callable[[tirx.For], bool]) -> tirx.PrimFunc | tirx.Stmt:
    """`node` with the loops `which` picks made serial (the rest untouched)."""

    def _loop(loop: tirx.For, mutator) -> tirx.For:  # noqa: ANN001 - tvm_ffi mutator handle
        body = mutator.mutate(loop.body)
        kind = tirx.ForKind.SERIAL if which(loop) else loop.kind
        return tirx.For(loop.loop_var, loop.min, loop.extent, kind, body, loop.thread_binding, loop.annotations,
                        loop.step, loop.span)

    return tvm_ffi.structural_mutate(node, (tirx.For, _loop))


def _annotated_parallel(func: tirx.PrimFunc) -> bool:
    found: list[bool] = []

    def _visit(loop: tirx.For) -> None:
        if loop.kind == tirx.ForKind.PARALLEL:
            found.append(True)

    tvm_ffi.structural_walk(func, (tirx.For, _visit), order="post")
    return bool(found)


def describe_module(mod: tvm.IRModule) -> dict[str, str]:
    """Rule recorded on each PrimFunc (``'-'`` when none): lets tests and tools check coverage."""
    out: dict[str, str] = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            rule = func.attrs.get(SCHEDULE_ATTR) if func.attrs is not None else None
            out[gv.name_hint] = str(rule) if rule is not None else "-"
    return out


__all__ = [
    "CpuScheduleOptions",
    "ScheduleReport",
    "describe_module",
    "schedule_cpu_module",
    "schedule_cpu_module_with_report",
]
