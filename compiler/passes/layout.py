"""Pipeline step 4c: convolutions in a channel-blocked layout (NCHW{b}c), ONNX Runtime's NCHWc idea.

Why: in NCHW a conv's output channels are ``H*W`` floats apart, so the micro-kernel's channel-vector tile is
stored with a stride and every epilogue reads it back strided; a depthwise conv vectorises along a row, and a
7- or 14-wide row wastes most of a 16-lane vector (MobileNet's 7x7 depthwise convs ran 2.5-4x ORT). In
NCHW{b}c (``b`` = the vector's fp32 lanes) the ``b`` channels of one pixel are adjacent: the output tile is
whole vector stores, a depthwise conv is one vector per tap, and weights, being constants, are reordered once
at compile time (OIHW{b}i{b}o, depthwise OIHW{b}o).

How: Relax's ConvertLayout with a per-call choice (a conv whose channels do not divide ``b`` -- the first conv
of an RGB image, MobileNet's 24-channel stages at b=16 -- stays NCHW), which propagates the layout through the
elementwise ops, residual adds, pooling, concat and mean, and inserts ``layout_transform`` only where a
consumer needs NCHW; the weights are then packed in numpy (passes.FoldConstantMoves). TVM's default
legaliser refuses blocked convs: :func:`legalize_conv2d` lowers them to the TE computes below, which the CPU
rules of ``compiler/schedule/cpu_conv_blocked.py`` recognise. The unfused build takes the same layout decision, so fused
against unfused still isolates fusion.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

import tvm
from tvm import relax, te, topi

from .padding import PadSummary, pad_channels
from .normalize import FoldConstantMoves
from ..ir.rewrite import each_relax_function
from ..ir.helpers import static_dims

_CONV = "relax.nn.conv2d"
_TRANSFORM = tvm.ir.Op.get("relax.layout_transform")
_BLOCKED = re.compile(r"^NCHW(\d+)c$")


@dataclass
class LayoutSummary:
    """What the layout step did, for the report."""

    block: int = 0          # channels per block; 0: the step was off
    blocked_convs: int = 0
    convs: int = 0
    transforms: int = 0     # layout_transform calls left on activations (weights are folded away)
    macs: int = 0           # multiply-accumulates of the blocked convs
    moved: int = 0          # elements the transforms at the model's edges (its inputs and outputs) copy
    kept_nchw: str = ""     # why the blocked module was not used
    padded: int = 0         # convs whose output channels were padded to whole blocks (compiler/passes/padding.py)
    pad_macs: int = 0       # multiply-accumulates the padding adds

    def line(self) -> str:
        if not self.block:
            return "layout: NCHW (step off)"
        if self.kept_nchw:
            return f"layout: NCHW ({self.kept_nchw})"
        padded = (f" ({self.padded} padded to whole blocks, +{100 * self.pad_macs / max(self.macs, 1):.1f}% MACs)"
                  if self.padded else "")
        return (f"layout: NCHW{self.block}c for {self.blocked_convs} of {self.convs} convs{padded}, "
                f"{self.transforms} layout transforms on activations")


#: Blocked-conv multiply-accumulates each element transformed at the model's edges must pay for. A transform
#: costs ~0.55 ns an element (a strided gather: 144x56x56 in 272 us) and blocking saves ~10% of a dense conv
#: at ~125 GMAC/s (0.008 ns a MAC): ~690 MACs an element break even (Zen5, 2 threads). Measured: conv_bn_relu
#: (one 64-channel 3x3 conv at 56x56, NCHW in and out: 115 M MACs for 400 K moved) ran 1.23x ORT blocked and
#: 0.97x in NCHW. Transforms inside the network are not counted: MobileNet-V2's around its 24-channel stages
#: move 1.6 M elements for 260 M MACs, and it still ran 1.26x ORT blocked vs 1.39x in NCHW (its depthwise
#: convs gain far more than 10%); ResNet-18/50 and SqueezeNet read their 3-channel input directly.
MIN_MACS_PER_MOVED = 700


def conv_layout(call: relax.Call, block: int) -> list[str] | None:
    """[data, kernel(, output)] layouts for one NCHW conv in blocks of ``block`` channels, or None to keep it NCHW:
    a dense conv needs both channel counts divisible, a depthwise conv (groups == channels, multiplier 1) its
    channels, a grouped conv both per-group counts; other grouped convs and symbolic channel or spatial sizes
    stay NCHW."""
    attrs = call.attrs
    if attrs.data_layout != "NCHW" or attrs.kernel_layout != "OIHW" or attrs.out_layout != "NCHW":
        return None
    data, weight = (static_dims(a) for a in call.args[:2])
    if data is None or weight is None or len(data) != 4:
        return None
    c_in, c_out, groups = data[1], weight[0], int(attrs.groups)
    if groups == 1 and c_in % block == 0 and c_out % block == 0:
        return [f"NCHW{block}c", f"OIHW{block}i{block}o"]
    if groups == 1 and c_in < block and c_out % block == 0:
        # the first conv of an image (3 channels): NCHW read directly, NCHW{b}c written, as MLAS does; a
        # transform after it fed ResNet's max pool through an index map no pool rule took (3.5 ms of 16)
        return ["NCHW", f"OIHW{block}o", f"NCHW{block}c"]
    if groups == c_in == c_out and c_in % block == 0:
        return [f"NCHW{block}c", f"OIHW{block}o"]
    if groups > 1 and c_in % groups == 0 and (c_in // groups) % block == 0 and (c_out // groups) % block == 0:
        # a grouped conv whose groups are whole blocks (RegNetX: 16 channels a group, ResNeXt's later stages):
        # the dense blocked kernel, each output block reading only its group's input blocks
        return [f"NCHW{block}c", f"OIHW{block}i{block}o"]
    return None


def clip_bound(arg: relax.Expr) -> float | None:
    """A clip bound given as a constant PrimValue, else None."""
    value = getattr(arg, "value", None)       # FloatImm.value, or PrimValue.value.value
    value = value if isinstance(value, (int, float)) else getattr(value, "value", None)
    return float(value) if isinstance(value, (int, float)) else None


_BINARY = frozenset({"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum",
                     "relax.minimum"})


def _full_rank_constants(call: relax.Call) -> relax.Call:
    """A constant operand of lower rank than the NCHW tensor beside it (ONNX broadcasting: a BatchNorm exported
    as Mul/Add by a [C, 1, 1] constant) reshaped to rank 4: ConvertLayout's broadcast rule needs equal ranks
    and put a transform on each side of every such op (DenseNet-121: 239 transforms, 1.35x ORT vs 0.91x)."""
    a, b = call.args[0], call.args[1]
    dims_a, dims_b = static_dims(a), static_dims(b)
    if dims_a is None or dims_b is None:
        return call
    for const, dims, other in ((b, dims_b, dims_a), (a, dims_a, dims_b)):
        if isinstance(const, tvm.ir.Constant) and len(other) == 4 and 0 < len(dims) < 4:
            full = relax.const(const.value.numpy().reshape([1] * (4 - len(dims)) + list(dims)))
            args = [a, full] if const is b else [full, b]
            return relax.Call(call.op, args, call.attrs, call.ty_args)
    return call


@relax.expr_functor.mutator
class _ClipAsMinMax(relax.PyExprMutator):
    """clip(x, lo, hi) on an NCHW tensor -> minimum(maximum(x, lo), hi), the bounds as [1, C, 1, 1] constants
    (a rank-0 operand fails ConvertLayout's broadcast rule): ConvertLayout has no layout rule for clip and
    put two transforms around every ReLU6 (MobileNet-V2: 64 transforms, the model 2.6x ORT). Call-level
    mutators, not rewrite_call: that also canonicalised bindings and could leave a DataflowVar as a block's
    output (ill-formed)."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 - visitor API
        call = super().visit_call_(call)
        if isinstance(call.op, tvm.ir.Op) and call.op.name in _BINARY:
            return _full_rank_constants(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.clip"):
            return call
        lo, hi = clip_bound(call.args[1]), clip_bound(call.args[2])
        x = call.args[0]
        dims = static_dims(x)
        if lo is None or hi is None or dims is None or len(dims) != 4:
            return call
        dtype, shape = str(x.ty.dtype), (1, dims[1], 1, 1)
        low = self.builder_.emit(relax.op.maximum(x, relax.const(np.full(shape, lo, dtype))))
        return relax.op.minimum(low, relax.const(np.full(shape, hi, dtype)))


@relax.expr_functor.mutator
class _MinMaxAsClip(relax.PyExprMutator):
    """The inverse, after the layout is chosen: the conv patterns match ReLU6 and HardSwish by their clip.
    The maximum left unused is removed by the DeadCodeElimination after it."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 - visitor API
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.minimum" and _uniform(call.args[1]) is not None):
            return call
        inner = self.lookup_binding(call.args[0]) if isinstance(call.args[0], relax.Var) else None
        if not (isinstance(inner, relax.Call) and isinstance(inner.op, tvm.ir.Op)
                and inner.op.name == "relax.maximum" and _uniform(inner.args[1]) is not None):
            return call
        lo, hi = (float(_uniform(c).flat[0]) for c in (inner.args[1], call.args[1]))  # type: ignore[union-attr]
        dtype = str(call.ty.dtype)
        return relax.op.clip(inner.args[0], relax.prim_value(tvm.tirx.FloatImm(dtype, lo)),
                             relax.prim_value(tvm.tirx.FloatImm(dtype, hi)))


def _uniform(expr: relax.Expr) -> np.ndarray | None:
    """The values of a constant whose elements are all equal (a clip bound), else None."""
    if not isinstance(expr, tvm.ir.Constant):
        return None
    values = expr.value.numpy()
    return values if values.size and (values == values.flat[0]).all() else None


def _each(mutator: type, mod: tvm.IRModule) -> tvm.IRModule:
    visitor = mutator(mod)
    return each_relax_function(mod, visitor.visit_expr)


def to_blocked(mod: tvm.IRModule, block: int, pad: bool = True) -> tuple[tvm.IRModule, LayoutSummary]:
    """Every convertible conv in NCHW{block}c (with ``pad``, convs whose channels are not whole blocks padded
    first), the layout propagated, weights packed at compile time; the NCHW module back when its transforms
    would cost more than blocking saves (MIN_MACS_PER_MOVED)."""
    if summarise(mod, block).convs == 0:
        return mod, LayoutSummary(block=block, kept_nchw="no conv")
    try:
        blocked, pads = _convert(mod, block, pad)
        summary = summarise(blocked, block)
    except Exception as err:  # noqa: BLE001 - TVM's ConvertLayout failing on a graph: NCHW is always right
        first = str(err).strip().splitlines()[-1][:160] if str(err).strip() else type(err).__name__
        return mod, LayoutSummary(block=block, kept_nchw=f"ConvertLayout failed: {first}")
    summary.padded, summary.pad_macs = pads.convs, pads.extra_macs
    if summary.blocked_convs == 0:
        summary.kept_nchw = "no conv has channels in whole blocks of " + str(block)
        return mod, summary
    if summary.macs < MIN_MACS_PER_MOVED * summary.moved:
        summary.kept_nchw = (f"NCHW{block}c would transform {summary.moved / 1e3:.0f} K elements for "
                             f"{summary.macs / 1e6:.0f} M conv MACs, under {MIN_MACS_PER_MOVED} a element")
        return mod, summary
    return blocked, summary


def _convert(mod: tvm.IRModule, block: int, pad: bool) -> tuple[tvm.IRModule, PadSummary]:
    def choose(call: relax.Call) -> dict[str, list[str]]:
        if not isinstance(call.op, tvm.ir.Op) or call.op.name != _CONV:
            return {}
        # A conv kept in NCHW says so: with no layout asked, ConvertLayout carried a blocked input into it and
        # failed ("Layouts must have the same size": MobileNet's 96 -> 24 conv after a blocked ReLU6).
        return {_CONV: conv_layout(call, block) or ["NCHW", "OIHW"]}

    mod = _each(_ClipAsMinMax, mod)
    pads = PadSummary()
    if pad:
        mod, pads = pad_channels(mod, block)
    mod = relax.transform.ConvertLayout({}, choose)(mod)
    # the weights packed in numpy, then FoldConstant only propagates the constants into their uses (cheap now)
    mod = relax.transform.FoldConstant()(FoldConstantMoves(relax.transform.Normalize()(mod)))
    return relax.transform.DeadCodeElimination(["main"])(_each(_MinMaxAsClip, mod)), pads


def summarise(mod: tvm.IRModule, block: int) -> LayoutSummary:
    """Count blocked convs, all convs and the layout transforms left on activations."""
    summary = LayoutSummary(block=block)
    conv_op = tvm.ir.Op.get(_CONV)

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            if expr.op.same_as(conv_op):
                summary.convs += 1
                if _BLOCKED.match(str(expr.attrs.out_layout)):
                    summary.blocked_convs += 1
                    out, weight = static_dims(expr), static_dims(expr.args[1])
                    if out is not None and weight is not None:   # every output element: C_in/g * kh * kw MACs
                        per_out = math.prod(weight[1:4]) * (weight[4] if len(weight) == 6 else 1)
                        summary.macs += math.prod(out) * per_out
            elif expr.op.same_as(_TRANSFORM) and not isinstance(expr.args[0], tvm.ir.Constant):
                summary.transforms += 1

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
            summary.moved += _edge_elements(func)
    return summary


def _edge_elements(func: relax.Function) -> int:
    """Elements copied by transforms of a parameter (or a cast of one: reduced-precision builds cast inputs
    first) or into a value leaving the dataflow block: the model's inputs and outputs, costs nothing inside
    the network amortises."""
    params = {p for p in func.params}
    astype = tvm.ir.Op.get("relax.astype")
    total = 0
    for block in getattr(func.body, "blocks", []):
        casts_of_params = set()
        for binding in block.bindings:
            value = binding.value
            if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)):
                continue
            if value.op.same_as(astype) and (value.args[0] in params or value.args[0] in casts_of_params):
                casts_of_params.add(binding.var)
            elif value.op.same_as(_TRANSFORM) and (value.args[0] in params or value.args[0] in casts_of_params
                                                   or not isinstance(binding.var, relax.DataflowVar)):
                dims = static_dims(value)
                total += math.prod(dims) if dims is not None else 0
    return total


# ----------------------------------------------------------------------------- legalisation

def _blocked_conv_te(data: te.Tensor, weight: te.Tensor, strides, padding, dilation,  # noqa: ANN001
                     depthwise: bool, out_dtype: str, groups: int = 1) -> te.Tensor:
    """``O[n, f, y, x, fi] = sum I[n, rc, ., ., ri] * W[f, rc, ky, kx, ri, fi]`` (dense; grouped: input block
    ``g(f) * rc_blocks + rc``) or ``O[n, c, y, x, ci] = sum I[n, c, ., ., ci] * W[c, 0, ky, kx, ci]``
    (depthwise), zero padding as its own stage (the rules keep it materialised: inlined, every input read is
    a bounds-checked select)."""
    nchw_in = len(data.shape) == 4     # the first conv: NCHW in, NCHW{b}c out, weights OIHW{b}o
    n, ico, h, w = data.shape[:4]
    bi = data.shape[4] if not nchw_in else None
    pt, pl, pb, pr = (int(p) for p in padding)
    sh, sw = (int(s) for s in strides)
    dh, dw = (int(d) for d in dilation)
    kh, kw = weight.shape[2], weight.shape[3]
    tail = [] if nchw_in else [0]
    pad = topi.nn.pad(data, [0, 0, pt, pl, *tail], [0, 0, pb, pr, *tail], name="pad") if pt or pl or pb or pr else data
    oh = (h + pt + pb - (kh - 1) * dh - 1) // sh + 1
    ow = (w + pl + pr - (kw - 1) * dw - 1) // sw + 1

    def cast(v):  # noqa: ANN001, ANN202 - reduced operands accumulate in out_dtype (compiler/passes/precision.py)
        return v if str(v.dtype) == out_dtype else v.astype(out_dtype)

    ry = te.reduce_axis((0, kh), name="ry")
    rx = te.reduce_axis((0, kw), name="rx")
    if depthwise:
        return te.compute(
            (n, ico, oh, ow, bi),
            lambda b, c, y, x, ci: te.sum(cast(pad[b, c, y * sh + ry * dh, x * sw + rx * dw, ci])
                                          * cast(weight[c, 0, ry, rx, ci]), axis=[ry, rx]),
            name="depthwise_conv2d_NCHWc")
    oco, bo = weight.shape[0], weight.shape[-1]
    rc = te.reduce_axis((0, weight.shape[1]), name="rc")     # input channels (blocks) of one group
    if nchw_in:
        return te.compute(
            (n, oco, oh, ow, bo),
            lambda b, f, y, x, fi: te.sum(cast(pad[b, rc, y * sh + ry * dh, x * sw + rx * dw])
                                          * cast(weight[f, rc, ry, rx, fi]), axis=[rc, ry, rx]),
            name="conv2d_NCHWc")
    ri = te.reduce_axis((0, bi), name="ri")
    out_blocks = int(oco) // groups      # output blocks per group; the weight's rc extent is its input blocks

    def block_in(f, rc):  # noqa: ANN001, ANN202
        if groups == 1:
            return rc
        return (f if out_blocks == 1 else f // out_blocks) * weight.shape[1] + rc

    return te.compute(
        (n, oco, oh, ow, bo),
        lambda b, f, y, x, fi: te.sum(cast(pad[b, block_in(f, rc), y * sh + ry * dh, x * sw + rx * dw, ri])
                                      * cast(weight[f, rc, ry, rx, ri, fi]), axis=[rc, ry, rx, ri]),
        name="conv2d_NCHWc")


def legalize_conv2d(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """A blocked conv (this step's output) to its TE compute; every other conv to TVM's own legaliser."""
    attrs = call.attrs
    if not _BLOCKED.match(str(attrs.out_layout)) or attrs.data_layout not in (attrs.out_layout, "NCHW"):
        return _DEFAULT_CONV(bb, call)
    groups = int(attrs.groups)
    depthwise = groups > 1 and len(call.args[1].ty.shape) == 5      # OIHW{b}o; grouped weights are OIHW{b}i{b}o
    out_dtype = str(call.ty.dtype)     # the conv's result type: out_dtype, else the data's
    return bb.call_te(_blocked_conv_te, call.args[0], call.args[1], attrs.strides, attrs.padding, attrs.dilation,
                      depthwise, out_dtype, 1 if depthwise else groups,
                      primfunc_name_hint="depthwise_conv2d_NCHWc" if depthwise else "conv2d_NCHWc")


_DEFAULT_CONV = tvm.ir.Op.get(_CONV).get_attr("FLegalize")


def legalize_map() -> dict[str, object]:
    return {_CONV: legalize_conv2d}
