"""CUDA-only legalizations: ops whose stock TOPI form no real dlight GPU rule can schedule.

A grouped convolution (AlexNet's groups=2, ShuffleNet v1's groups=3) legalizes to `group_conv2d_nchw`, whose
input index `ff // F_g * C_g + rc` mixes the group into the channel: dlight's Matmul rule cannot normalise
it, so the bare conv fell to `Fallback` (AlexNet: 8 bytes of spills per thread on sm_80 and sm_90) and
the fused conv + bias + ReLU to `Reduction` (ShuffleNet: 176 registers and a 4 KiB stack per thread).
Written with the group as its own axis, the reduction is a batched GEMM (C[g, f, p] += A[g, c, p] * W[g, f, c])
that dlight's Matmul schedules; the regrouping of input, weights and output are prologue/epilogue blocks.
Depthwise convolutions (one channel per group) are left to the stock form (dlight's reduction rules).
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax, te, tirx


def _ints(values: Any) -> list[int]:
    return [int(v) for v in values]


def _grouped_conv2d_te(data: te.Tensor, weight: te.Tensor, strides: list[int], padding: list[int],
                       dilation: list[int], groups: int, out_dtype: str) -> te.Tensor:
    n, c, h, w = (int(d) for d in data.shape)
    f, cg, kh, kw = (int(d) for d in weight.shape)
    g, fg = groups, f // groups
    top, left, bottom, right = padding
    sh, sw = strides
    dh, dw = dilation
    hp, wp = h + top + bottom, w + left + right
    oh, ow = (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1
    zero = tirx.const(0, data.dtype)
    pad = te.compute(
        (n, g, cg, hp, wp),
        lambda b, gi, ci, y, x: tirx.if_then_else(
            tirx.all(y >= top, y < h + top, x >= left, x < w + left), data[b, gi * cg + ci, y - top, x - left], zero),
        name="pad_temp")
    wg = te.compute((g, fg, cg, kh, kw), lambda gi, fi, ci, i, j: weight[gi * fg + fi, ci, i, j], name="weight_g")
    rc = te.reduce_axis((0, cg), "rc")
    ry = te.reduce_axis((0, kh), "ry")
    rx = te.reduce_axis((0, kw), "rx")
    conv = te.compute(
        (n, g, fg, oh, ow),
        lambda b, gi, fi, y, x: te.sum(
            pad[b, gi, rc, y * sh + ry * dh, x * sw + rx * dw].astype(out_dtype) * wg[gi, fi, rc, ry, rx].astype(out_dtype),
            axis=[rc, ry, rx]),
        name="group_conv2d_gemm")
    return te.compute((n, f, oh, ow), lambda b, fo, y, x: conv[b, fo // fg, fo % fg, y, x], name="group_conv2d_nchw")


def legalize_conv2d(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """relax.nn.conv2d for CUDA: grouped (not depthwise) NCHW/OIHW convs as a batched GEMM; the rest as TVM does."""
    attrs = call.attrs
    groups = int(attrs.groups)
    data_ty, weight_ty = call.args[0].ty, call.args[1].ty
    static = all(isinstance(t, relax.TensorType) and isinstance(t.shape, relax.ShapeExpr)
                 and all(isinstance(d, tirx.IntImm) for d in t.shape.values) for t in (data_ty, weight_ty))
    channels = int(data_ty.shape.values[1]) if static else 0
    if (groups > 1 and static and groups != channels and attrs.data_layout == "NCHW"
            and attrs.kernel_layout == "OIHW" and attrs.out_layout == "NCHW"):
        out_dtype = str(call.ty.dtype)
        return bb.call_te(_grouped_conv2d_te, call.args[0], call.args[1], _ints(attrs.strides),
                          _ints(attrs.padding), _ints(attrs.dilation), groups, out_dtype,
                          primfunc_name_hint="group_conv2d")
    return tvm.ir.Op.get("relax.nn.conv2d").get_attr("FLegalize")(bb, call)


def legalize_map() -> dict[str, Any]:
    """`LegalizeOps(customize_legalize_map=...)` for CUDA targets."""
    return {"relax.nn.conv2d": legalize_conv2d}
