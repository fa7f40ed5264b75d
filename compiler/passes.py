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


# ------------------------------------------------------------------------ recognising decomposed ops

def merged_tag(names: list[str], op: str) -> str:
    """A provenance tag naming every ONNX node a rewritten binding stands for: `n1+2+9_LayerNorm`."""
    import re

    indices = sorted({int(i) for n in names if (m := re.match(r"^n(\d+(?:\+\d+)*)_", n))
                      for i in m.group(1).split("+")})
    return f"n{'+'.join(map(str, indices))}_{op}" if indices else op


@relax.expr_functor.mutator
class _Recognizer(relax.PyExprMutator):
    """Replace every binding matching `pattern` by `rewrite(matches)`; the new var carries a merged tag."""

    def __init__(self, mod: tvm.IRModule, pattern, rewrite, label: str) -> None:
        super().__init__(mod)
        self.pattern, self.rewrite, self.label = pattern, rewrite, label
        self.var2val: dict[relax.Var, relax.Expr] = {}
        self.val2var: dict[relax.Expr, relax.Var] = {}
        self.rewritten: list[list[str]] = []

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.var2val[binding.var] = binding.value
        self.val2var[binding.value] = binding.var
        matches = self.pattern.extract_matched_expr(binding.value, self.var2val)
        new = self.rewrite(matches) if matches else None
        if new is None:
            super().visit_var_binding_(binding)
            return
        names = sorted({self.val2var[e].name for e in matches.values() if e in self.val2var} | {binding.var.name})
        new = relax.expr_functor.PyExprMutator.visit_expr(self, new)
        var = self.builder_.emit(new, merged_tag(names, self.label))
        self.rewritten.append(names)
        self.set_var_remap(binding.var, var)


def recognize(mod: tvm.IRModule, pattern, rewrite, label: str) -> tuple[tvm.IRModule, list[list[str]]]:
    rec = _Recognizer(mod, pattern, rewrite, label)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and not (func.attrs and "Primitive" in func.attrs):
            rec.builder_.update_func(gv, rec.visit_expr(func))
    return rec.builder_.get(), rec.rewritten


def _layernorm_pattern():
    from tvm.relax.dpl import is_const, is_op, wildcard

    x = wildcard()
    mean = is_op("relax.mean")(x)
    centred = is_op("relax.subtract")(x, mean)
    square = is_op("relax.power")(centred, is_const()) | is_op("relax.multiply")(centred, centred)
    var = is_op("relax.mean")(square)
    eps = is_const()
    std = is_op("relax.sqrt")(is_op("relax.add")(var, eps))
    normed = is_op("relax.divide")(centred, std)
    gamma, beta = is_const(), is_const()
    out = is_op("relax.add")(is_op("relax.multiply")(normed, gamma), beta)
    return out, dict(x=x, mean=mean, var=var, square=square, eps=eps, gamma=gamma, beta=beta)


def recognize_layernorm(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[list[str]]]:
    """ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add (what exporters emit) -> one layer_norm op.

    Only rewrites the exact semantics: both means over the last axis with keepdims, power 2, and
    per-channel gamma/beta over that axis.
    """
    out, parts = _layernorm_pattern()

    def rewrite(m: dict) -> relax.Expr | None:
        x = m[parts["x"]]
        ndim = len(x.ty.shape.values) if isinstance(x.ty, relax.TensorType) and x.ty.shape is not None else -1
        for key in ("mean", "var"):
            call = m[parts[key]]
            axes = [int(a) for a in call.attrs.axis] if call.attrs.axis is not None else []
            if not call.attrs.keepdims or [a % ndim for a in axes] != [ndim - 1]:
                return None
        sq = m[parts["square"]]
        if sq.op.name == "relax.power" and float(np.asarray(_np(sq.args[1]))) != 2.0:
            return None
        gamma, beta, eps = _np(m[parts["gamma"]]), _np(m[parts["beta"]]), _np(m[parts["eps"]])
        channels = int(x.ty.shape.values[-1])
        if eps.size != 1 or gamma.size != channels or beta.size != channels:
            return None
        return relax.op.nn.layer_norm(x, relax.const(gamma.reshape(channels)), relax.const(beta.reshape(channels)),
                                      axes=[-1], epsilon=float(eps.reshape(())))

    return recognize(mod, out, rewrite, "LayerNormalization")


# ------------------------------------------------------------------------ replacement kernels

@relax.expr_functor.mutator
class _Replacer(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, replacements: dict, spec) -> None:
        super().__init__(mod)
        self.mod_ = mod
        self.replacements, self.spec = replacements, spec
        self.replaced: dict[str, str] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        call = binding.value
        if isinstance(call, relax.Call) and isinstance(call.op, relax.GlobalVar) \
                and call.op.name_hint in self.replacements:
            args = [self.visit_expr(a) for a in call.args]
            new = self.replacements[call.op.name_hint](self.builder_, self.mod_[call.op], args, self.spec)
            if new is not None:
                var = self.builder_.emit(new, binding.var.name)
                if isinstance(new, relax.Call) and new.op.name == "relax.call_tir":
                    self.replaced[new.args[0].name_hint] = call.op.name_hint
                self.set_var_remap(binding.var, var)
                return
        super().visit_var_binding_(binding)


def apply_replacements(mod: tvm.IRModule, replacements: dict, spec) -> tuple[tvm.IRModule, dict[str, str]]:
    """Replace calls of composite functions by hand-written kernels.

    `replacements` maps a composite function name to `fn(builder, function, args, spec) -> expr | None`.
    Returns the module (unused composites removed) and {kernel PrimFunc name: composite name}.
    """
    if not replacements:
        return mod, {}
    rep = _Replacer(mod, replacements, spec)
    main = mod.get_global_var("main")
    rep.builder_.update_func(main, rep.visit_expr(mod["main"]))
    out = rep.builder_.get()
    for name in rep.replaced:
        gv = out.get_global_var(name)
        out[gv] = out[gv].with_attr("tirx.is_scheduled", True).with_attr("fuseguard.kernel", rep.replaced[name])
    out = relax.transform.DeadCodeElimination(["main"])(out)
    return out, rep.replaced
