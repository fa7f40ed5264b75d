"""fuseguard's own graph passes (the stock TVM ones are used directly in pipeline.py)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax


def _np(const: relax.Expr) -> np.ndarray:
    return const.value.numpy()


def _is_const(expr: relax.Expr) -> bool:
    return hasattr(expr, "value") and isinstance(expr, relax.Expr) and not isinstance(expr, relax.Var) \
        and hasattr(expr.value, "numpy")


@relax.expr_functor.mutator
class _BatchNormFolder(relax.PyExprMutator):
    """Rewrites `conv2d(x, W) [+ b] -> batch_norm -> [0]` into `conv2d(x, W*s) + ((b - mean)*s + beta)`.

    A binding-level mutator rather than a pattern rewrite so the new bindings keep the provenance names
    of the nodes they replace (the conv keeps the Conv's, the bias add takes the BatchNorm's).
    """

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.values: dict[relax.Var, relax.Expr] = {}

    def _lookup(self, expr: relax.Expr) -> relax.Expr | None:
        return self.values.get(expr) if isinstance(expr, relax.Var) else None

    def _match(self, item: relax.Expr):
        if not (isinstance(item, relax.TupleGetItem) and item.index == 0):
            return None
        bn = self._lookup(item.tuple_value) if isinstance(item.tuple_value, relax.Var) else item.tuple_value
        if not (isinstance(bn, relax.Call) and isinstance(bn.op, tvm.ir.Op) and bn.op.name == "relax.nn.batch_norm"):
            return None
        if int(bn.attrs.axis) != 1 or not all(_is_const(a) for a in bn.args[1:5]):
            return None
        pre_var = bn.args[0]
        pre = self._lookup(pre_var)
        bias = None
        conv_var = pre_var
        if isinstance(pre, relax.Call) and pre.op.name == "relax.add" and _is_const(pre.args[1]):
            bias, conv_var = pre.args[1], pre.args[0]
            pre = self._lookup(conv_var)
        if not (isinstance(pre, relax.Call) and isinstance(pre.op, tvm.ir.Op) and pre.op.name == "relax.nn.conv2d"):
            return None
        if pre.attrs.kernel_layout != "OIHW" or pre.attrs.data_layout != "NCHW" or not _is_const(pre.args[1]):
            return None
        return bn, pre, conv_var, bias

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.values[binding.var] = binding.value
        found = self._match(binding.value)
        if found is None:
            super().visit_var_binding_(binding)
            return
        bn, conv, conv_var, bias = found
        w = _np(conv.args[1])
        gamma, beta, mean, var = (_np(a) for a in bn.args[1:5])
        scale = gamma / np.sqrt(var + float(bn.attrs.epsilon))
        b = _np(bias).reshape(-1) if bias is not None else np.zeros_like(mean)
        if b.shape != mean.shape or w.shape[0] != mean.shape[0]:
            super().visit_var_binding_(binding)
            return
        new_w = (w * scale.reshape(-1, *([1] * (w.ndim - 1)))).astype(w.dtype)
        new_b = ((b - mean) * scale + beta).astype(w.dtype).reshape(1, -1, *([1] * (w.ndim - 2)))
        data = self.visit_expr(conv.args[0])
        new_conv = self.builder_.emit(relax.Call(conv.op, [data, relax.const(new_w)], conv.attrs),
                                      conv_var.name)
        folded = self.builder_.emit(relax.op.add(new_conv, relax.const(new_b)), binding.var.name)
        self.set_var_remap(binding.var, folded)


@tvm.transform.module_pass(opt_level=0, name="FoldBatchNorm")
def FoldBatchNorm(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:  # noqa: N802 - TVM pass style
    """Fold inference BatchNorm into the preceding Conv2d (with or without bias); DCE removes the originals."""
    folder = _BatchNormFolder(mod)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and not (func.attrs and "Primitive" in func.attrs):
            folder.builder_.update_func(gv, folder.visit_expr(func))
    return folder.builder_.get()
