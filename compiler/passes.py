"""fuseguard's own graph passes (the stock TVM ones are used directly in pipeline.py)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import TupleGetItemPattern, is_const, is_op, rewrite_call, wildcard


def _np(const: relax.Constant) -> np.ndarray:
    return const.value.numpy()


@relax.transform.function_pass(opt_level=0, name="FoldBatchNorm")
class FoldBatchNorm:
    """Fold inference BatchNorm into the preceding Conv2d's weights and bias.

    TVM's FoldBatchnormToConv2D only matches a conv feeding batch_norm directly; ONNX convs with a bias
    import as conv2d + add, so that case is folded here too (W' = W*s, b' = (b - mean)*s + beta).
    """

    def __init__(self) -> None:
        self.data = wildcard()
        self.weight = is_const()
        self.conv = is_op("relax.nn.conv2d")(self.data, self.weight)
        self.bias = is_const()
        pre = self.conv | is_op("relax.add")(self.conv, self.bias)
        self.gamma, self.beta, self.mean, self.var = is_const(), is_const(), is_const(), is_const()
        self.bn = is_op("relax.nn.batch_norm")(pre, self.gamma, self.beta, self.mean, self.var)
        self.pattern = TupleGetItemPattern(self.bn, 0)

    def transform_function(self, func: relax.Function, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> relax.Function:
        if func.attrs is not None and "Primitive" in func.attrs:
            return func

        def rewriter(expr: relax.Expr, matches: dict) -> relax.Expr:
            conv = matches[self.conv]
            bn = matches[self.bn]
            attrs = conv.attrs
            if attrs.kernel_layout != "OIHW" or attrs.data_layout != "NCHW" or int(bn.attrs.axis) != 1:
                return expr
            w = _np(matches[self.weight])
            gamma, beta = _np(matches[self.gamma]), _np(matches[self.beta])
            mean, var = _np(matches[self.mean]), _np(matches[self.var])
            eps = float(bn.attrs.epsilon)
            scale = gamma / np.sqrt(var + eps)
            bias = _np(matches[self.bias]).reshape(-1) if self.bias in matches else np.zeros_like(mean)
            if bias.shape != mean.shape:
                return expr
            new_w = (w * scale.reshape(-1, *([1] * (w.ndim - 1)))).astype(w.dtype)
            new_b = ((bias - mean) * scale + beta).astype(w.dtype).reshape(1, -1, 1, 1)
            new_conv = relax.Call(conv.op, [matches[self.data], relax.const(new_w)], attrs)
            return relax.op.add(new_conv, relax.const(new_b))

        return rewrite_call(self.pattern, rewriter, func)
