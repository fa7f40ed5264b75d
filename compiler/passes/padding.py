"""Pipeline step 4c, first half: conv channels padded to whole blocks, so the layout step can block them.

Why: a conv whose channels do not divide the vector's lanes stays NCHW (compiler/passes/layout.py), with a layout
transform on each side: MobileNet-V2's and EfficientNet's 24-, 40-, 80- and 112-channel stages at 16 lanes
(AVX-512), MNASNet's 72- and 120-channel depthwise convs. ONNX Runtime's NCHWc transformer pads such convs
with zero filters instead; this does the same on the NCHW graph, before ConvertLayout sees it.

How: a conv with ``C`` output channels becomes a conv with ``P = ceil(C / b) * b`` (zero filters), and its
value is ``wide[:, :C]``. The slice is pushed through what commutes with it -- per-channel and elementwise
ops (a [1, C, 1, 1] constant padded with the op's identity), residual adds of two padded tensors, pooling,
a depthwise conv (its groups padded too) -- and cancels into the next conv, whose weights get ``P - C`` zero
input channels. Anything else (a concat, a reshape, the model's output) reads the slice. The padded channels
hold finite values (zero filters, then ops that map finite to finite), and every conv reading them weighs
them by zero, so the result is exact. The unfused build takes the same step, so fused against unfused still
isolates fusion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import tvm
from tvm import relax

from ..ir.rewrite import each_relax_function, rebind
from ..ir.helpers import static_dims

#: Ops that map finite values to finite values, elementwise: the padded channels may pass through them.
#: Not exp, log, sqrt, pow, or a divide by a tensor: a padded zero could become inf or NaN there, and a
#: zero weight times inf is NaN in a real channel.
_UNARY = frozenset({"relax.nn.relu", "relax.nn.silu", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.sigmoid",
                    "relax.tanh", "relax.erf", "relax.negative", "relax.abs", "relax.clip", "relax.astype",
                    "relax.nn.leakyrelu"})
#: Binary ops and the value a constant operand's padded channels take (the op's identity: padded channels
#: stay as small as the conv left them).
_BINARY = {"relax.add": 0.0, "relax.subtract": 0.0, "relax.multiply": 1.0, "relax.divide": 1.0,
           "relax.maximum": 0.0, "relax.minimum": 0.0}
_POOL = frozenset({"relax.nn.max_pool2d", "relax.nn.avg_pool2d", "relax.nn.adaptive_avg_pool2d"})
_REDUCE = frozenset({"relax.mean", "relax.max", "relax.sum"})

#: Padding a conv's outputs costs (P - C) / C more MACs there and in the next conv's input; past this ratio
#: the conv stays NCHW. 1.5 takes 24 -> 32 (1.33x), 40 -> 48, 72 -> 80, 88 -> 96, 120 -> 128 and every
#: channel count above 32; 8 -> 16 or 20 -> 32 only on a 1x1 plane (squeeze-and-excite, negligible MACs).
MAX_PAD_RATIO = 1.5


@dataclass
class PadSummary:
    """What the padding did, for the layout line of the report."""

    convs: int = 0          # convs whose outputs were padded
    extra_macs: int = 0     # multiply-accumulates the zero filters and zero input channels add


def padded_channels(channels: int, block: int, plane: int) -> int | None:
    """The padded channel count for a conv's ``channels`` outputs over ``plane`` pixels, or None (keep)."""
    if channels % block == 0:
        return None
    wide = math.ceil(channels / block) * block
    return wide if wide / channels <= MAX_PAD_RATIO or plane == 1 else None


def _pad_axis(values: np.ndarray, axis: int, to: int, fill: float = 0.0) -> np.ndarray:
    widths = [(0, 0)] * values.ndim
    widths[axis] = (0, to - values.shape[axis])
    return np.pad(values, widths, constant_values=np.asarray(fill).astype(values.dtype))


def _const(values: np.ndarray, like: tvm.ir.Constant) -> tvm.ir.Constant:
    return relax.const(tvm.runtime.tensor(values), str(like.ty.dtype))


def _op(call: relax.Expr) -> str:
    return call.op.name if isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op) else ""


@relax.expr_functor.mutator
class _Pad(relax.PyExprMutator):
    """Rewrites one function: `wide` maps a var to (its padded value, real channels, padded channels)."""

    def __init__(self, mod: tvm.IRModule, block: int) -> None:
        super().__init__(mod)
        self.block = block
        self.wide: dict[relax.Var, tuple[relax.Var, int, int]] = {}
        self.summary = PadSummary()

    # -- helpers
    def _emit_wide(self, binding: relax.VarBinding, value: relax.Expr, real: int, pad: int) -> None:
        """Bind the padded value, and the original var to its real channels (read by whatever does not
        commute with the slice; DCE drops it where nothing does)."""
        wide = self.builder_.emit(value, binding.var.name)
        rebind(self, binding.var, relax.op.strided_slice(wide, axes=[1], begin=[0], end=[real], assume_inbound=True))
        self.wide[binding.var] = (wide, real, pad)

    def _channel_const(self, const: relax.Expr, real: int, pad: int, fill: float) -> relax.Expr | None:
        """A constant broadcast against a padded NCHW tensor, padded along its channel axis (or as is when it
        broadcasts over channels), else None."""
        if not isinstance(const, tvm.ir.Constant):
            return None
        dims = static_dims(const)
        if dims is None or len(dims) > 4:
            return None
        if len(dims) < 3 or dims[-3] == 1:
            return const
        if dims[-3] != real:
            return None
        values = const.value.numpy()
        return _const(_pad_axis(values, values.ndim - 3, pad, fill), const)

    # -- the rewrite
    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        op = _op(value)
        args = list(value.args) if op else []
        first = self.wide.get(args[0]) if args and isinstance(args[0], relax.Var) else None

        if op == "relax.nn.conv2d" and self._conv(binding, value, first):
            return
        if first is not None and self._commutes(op, value, args):
            wide, real, pad = first
            self._emit_wide(binding, relax.Call(value.op, [wide, *args[1:]], value.attrs, value.ty_args), real, pad)
            return
        if op in _BINARY and len(args) == 2 and self._binary(binding, value, args):
            return
        super().visit_var_binding_(binding)

    @staticmethod
    def _commutes(op: str, value: relax.Call, args: list[relax.Expr]) -> bool:
        """A one-tensor op computed per channel: a unary op (its other arguments constants), NCHW pooling, a
        reduction over spatial axes that keeps them."""
        if op in _UNARY:
            return all(not isinstance(a, relax.Var) for a in args[1:])
        if op in _POOL:
            return str(value.attrs.layout) == "NCHW" and str(value.attrs.out_layout) == "NCHW"
        if op in _REDUCE:
            return bool(value.attrs.keepdims) and value.attrs.axis is not None \
                and 1 not in [int(a) % 4 for a in value.attrs.axis]
        return False

    def _binary(self, binding: relax.VarBinding, value: relax.Call, args: list[relax.Expr]) -> bool:
        sides = [self.wide.get(a) if isinstance(a, relax.Var) else None for a in args]
        out = static_dims(value)
        if all(side is None for side in sides) or out is None or len(out) != 4:
            return False
        if _op(value) == "relax.divide" and sides[1] is not None:
            return False        # a padded divisor: its padded zeros would divide
        real, pad = next(side for side in sides if side is not None)[1:]
        new_args = []
        for arg, side in zip(args, sides):
            if side is not None:
                if side[1:] != (real, pad):
                    return False
                new_args.append(side[0])
                continue
            dims = static_dims(arg)
            if isinstance(arg, tvm.ir.Constant):
                padded = self._channel_const(arg, real, pad, _BINARY[_op(value)])
            elif dims is not None and (len(dims) < 3 or dims[-3] == 1):
                padded = self.visit_expr(arg)       # broadcasts over channels
            else:
                padded = None
            if padded is None:
                return False
            new_args.append(padded)
        self._emit_wide(binding, relax.Call(value.op, new_args, value.attrs, value.ty_args), real, pad)
        return True

    def _conv(self, binding: relax.VarBinding, call: relax.Call, source: tuple | None) -> bool:
        """A conv reading a padded value (its weights get zero input channels; a depthwise conv pads its
        groups and stays padded), or one whose output channels are padded here."""
        attrs = call.attrs
        if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCHW", "OIHW", "NCHW") \
                or not isinstance(call.args[1], tvm.ir.Constant):
            return False
        data, weight, out = static_dims(call.args[0]), static_dims(call.args[1]), static_dims(call)
        if data is None or weight is None or out is None:
            return False
        groups, c_in, c_out = int(attrs.groups), data[1], weight[0]
        plane, taps = out[2] * out[3], weight[2] * weight[3]
        values = call.args[1].value.numpy()
        if groups == c_in == c_out and weight[1] == 1:          # depthwise
            if source is None:
                return False
            wide, real, pad = source
            conv = relax.op.nn.conv2d(wide, _const(_pad_axis(values, 0, pad), call.args[1]), attrs.strides,
                                      attrs.padding, attrs.dilation, pad, "NCHW", "OIHW", "NCHW",
                                      attrs.out_dtype or None)
            self.summary.extra_macs += (pad - real) * plane * taps
            self._emit_wide(binding, conv, real, pad)
            return True
        if groups != 1:
            return False
        data_in = self.visit_expr(call.args[0])
        if source is not None:
            data_in, c_in = source[0], source[2]
            values = _pad_axis(values, 1, c_in)
        wide = None
        if c_in % self.block == 0 or c_in < self.block:
            wide = padded_channels(c_out, self.block, plane)
        if wide is None and source is None:
            return False
        if wide is not None:
            values = _pad_axis(values, 0, wide)
        self.summary.extra_macs += plane * taps * ((wide or c_out) * c_in - c_out * data[1])
        conv = relax.Call(call.op, [data_in, _const(values, call.args[1])], attrs, call.ty_args)
        if wide is None:
            rebind(self, binding.var, conv)
            return True
        self.summary.convs += 1
        self._emit_wide(binding, conv, c_out, wide)
        return True


def pad_channels(mod: tvm.IRModule, block: int) -> tuple[tvm.IRModule, PadSummary]:
    """Every conv of ``mod`` whose output channels are not whole blocks padded with zero filters (above).
    Where the padding cannot be carried to a conv (a concat, a reshape, the model's output reads the slice)
    the slice costs the layout step one transform (NCHW{b}c back to NCHW), as many as the conv left in NCHW
    would have cost it."""
    summary = PadSummary()

    def rewrite(func: relax.Function) -> relax.Function:
        mutator = _Pad(mod, block)
        out = mutator.visit_expr(func)
        summary.convs += mutator.summary.convs
        summary.extra_macs += mutator.summary.extra_macs
        return out

    return relax.transform.DeadCodeElimination(["main"])(each_relax_function(mod, rewrite)), summary
