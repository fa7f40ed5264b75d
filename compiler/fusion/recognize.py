"""Pipeline steps 5a and 5c: decomposed ops recognised as one (LayerNorm, RMSNorm, so a rule matches them
whatever form the exporter wrote), and fused groups replaced by hand-written kernels (attention)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..ir.helpers import numpy_of
from ..ir.rewrite import recognize


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
        if sq.op.name == "relax.power" and float(np.asarray(numpy_of(sq.args[1]))) != 2.0:
            return None
        gamma, beta, eps = numpy_of(m[parts["gamma"]]), numpy_of(m[parts["beta"]]), numpy_of(m[parts["eps"]])
        channels = int(x.ty.shape.values[-1])
        if eps.size != 1 or gamma.size != channels or beta.size != channels:
            return None
        return relax.op.nn.layer_norm(x, relax.const(gamma.reshape(channels)), relax.const(beta.reshape(channels)),
                                      axes=[-1], epsilon=float(eps.reshape(())))

    return recognize(mod, out, rewrite, "LayerNormalization")


def _rmsnorm_pattern():
    from tvm.relax.dpl import is_const, is_op, wildcard

    def comm(op: str, a, b):
        return is_op(op)(a, b) | is_op(op)(b, a)

    x = wildcard()
    square = is_op("relax.power")(x, is_const()) | is_op("relax.multiply")(x, x)
    mean = is_op("relax.mean")(square)
    eps = is_const()
    den = comm("relax.add", mean, eps)
    one = is_const()
    inv = is_op("relax.divide")(one, is_op("relax.sqrt")(den)) | is_op("relax.rsqrt")(den)
    normed = comm("relax.multiply", x, inv) | is_op("relax.divide")(x, is_op("relax.sqrt")(den))
    gamma = is_const()
    out = comm("relax.multiply", normed, gamma)
    return out, dict(x=x, mean=mean, square=square, eps=eps, one=one, gamma=gamma)


def recognize_rmsnorm(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[list[str]]]:
    """x * 1/sqrt(mean(x^2) + eps) * gamma (HF's LlamaRMSNorm, T5's LayerNorm, as exported) -> one rms_norm op.

    Only the exact semantics: mean over the last axis with keepdims, power 2, a numerator of exactly 1,
    and a per-channel gamma over that axis.
    """
    out, parts = _rmsnorm_pattern()

    def rewrite(m: dict) -> relax.Expr | None:
        x = m[parts["x"]]
        if not isinstance(x.ty, relax.TensorType) or x.ty.shape is None:
            return None
        ndim = len(x.ty.shape.values)
        call = m[parts["mean"]]
        axes = [int(a) for a in call.attrs.axis] if call.attrs.axis is not None else []
        if not call.attrs.keepdims or [a % ndim for a in axes] != [ndim - 1]:
            return None
        sq = m[parts["square"]]
        if sq.op.name == "relax.power" and float(np.asarray(numpy_of(sq.args[1])).reshape(())) != 2.0:
            return None
        if parts["one"] in m and np.asarray(numpy_of(m[parts["one"]])).size == 1 and \
                float(np.asarray(numpy_of(m[parts["one"]])).reshape(())) != 1.0:
            return None
        gamma, eps = numpy_of(m[parts["gamma"]]), numpy_of(m[parts["eps"]])
        try:
            channels = int(x.ty.shape.values[-1])
        except TypeError:
            return None
        if eps.size != 1 or gamma.size != channels or gamma.shape[-1:] != (channels,) or \
                str(gamma.dtype) != str(x.ty.dtype):
            return None
        return relax.op.nn.rms_norm(x, relax.const(gamma.reshape(channels)), axes=[-1],
                                    epsilon=float(eps.reshape(())))

    return recognize(mod, out, rewrite, "RMSNorm")


@relax.expr_functor.mutator
class _Replacer(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, replacements: dict, spec) -> None:
        super().__init__(mod)
        self.mod_ = mod
        self.replacements, self.spec = replacements, spec
        self.calls: list[tuple[str, str]] = []      # (kernel, composite) per replaced call, in order
        self.refused: list[str] = []                # composites whose replacement returned None

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        call = binding.value
        if isinstance(call, relax.Call) and isinstance(call.op, relax.GlobalVar) \
                and call.op.name_hint in self.replacements:
            args = [self.visit_expr(a) for a in call.args]
            new = self.replacements[call.op.name_hint](self.builder_, self.mod_[call.op], args, self.spec)
            if new is not None:
                var = self.builder_.emit(new, binding.var.name)
                if (kernel := self._kernel_of(new)) is not None:
                    self.calls.append((kernel, call.op.name_hint))
                self.set_var_remap(binding.var, var)
                return
            self.refused.append(call.op.name_hint)
        super().visit_var_binding_(binding)

    def _kernel_of(self, expr: relax.Expr) -> str | None:
        """The hand-written kernel a replacement calls: its call_tir, or the one under the reshapes around it
        (rank-3 attention, [batch * heads, seq, d], is squeezed back from the kernel's 4-D output)."""
        for _ in range(4):
            if isinstance(expr, relax.Var):
                expr = self.builder_.lookup_binding(expr)
            if not (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)):
                return None
            if expr.op.name == "relax.call_tir":
                return expr.args[0].name_hint
            expr = expr.args[0]
        return None


def apply_replacements(mod: tvm.IRModule, replacements: dict,
                       spec) -> tuple[tvm.IRModule, list[tuple[str, str]], list[str]]:
    """Replace calls of composite functions by hand-written kernels.

    `replacements` maps a composite function name to `fn(builder, function, args, spec) -> expr | None`.
    Returns the module (unused composites removed), (kernel PrimFunc name, composite name) per replaced
    call in `main`'s order: identical calls share one kernel (ViT's 12 attention layers), so only the
    order tells which composite, and so which ONNX nodes, a call stands for; and the composites whose
    replacement refused them (left as they were).
    """
    if not replacements:
        return mod, [], []
    rep = _Replacer(mod, replacements, spec)
    main = mod.get_global_var("main")
    rep.builder_.update_func(main, rep.visit_expr(mod["main"]))
    out = rep.builder_.get()
    for name, composite in dict(rep.calls).items():
        gv = out.get_global_var(name)
        out[gv] = out[gv].with_attr("tirx.is_scheduled", True).with_attr("fuseguard.kernel", composite)
    out = relax.transform.DeadCodeElimination(["main"])(out)
    return out, rep.calls, rep.refused
