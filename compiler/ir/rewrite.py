"""Rewriting Relax in place: every binding matching a pattern replaced (the recogniser the normalising,
QDQ and fusion steps share), a var rebound where it was bound, a rewrite applied to every Relax function."""

from __future__ import annotations

import tvm
from tvm import relax

from . import tags


@relax.expr_functor.mutator
class _Recognizer(relax.PyExprMutator):
    """Replace every binding matching `pattern` by `rewrite(matches)`; the new var carries a merged tag."""

    def __init__(self, mod: tvm.IRModule, pattern, rewrite, label: str) -> None:
        super().__init__(mod)
        self.pattern, self.rewrite, self.label = pattern, rewrite, label
        self.var2val: dict[relax.Var, relax.Expr] = {}
        self.val2var: dict[relax.Expr, relax.Var] = {}
        self.rewritten: list[list[str]] = []

    _in_dataflow = False

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
        self._in_dataflow = True
        try:
            return super().visit_dataflow_block_(block)
        finally:
            self._in_dataflow = False

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.var2val[binding.var] = binding.value
        self.val2var[binding.value] = binding.var
        matches = self.pattern.extract_matched_expr(binding.value, self.var2val)
        new = self.rewrite(matches) if matches else None
        if new is None:
            super().visit_var_binding_(binding)
            return
        new = self._reuse_vars(new)
        inputs = _leaf_vars(new)
        names = sorted({self.val2var[e].name for e in matches.values()
                        if e in self.val2var and self.val2var[e] not in inputs} | {binding.var.name})
        new = relax.expr_functor.PyExprMutator.visit_expr(self, self._emit_nested(new, names))
        if isinstance(binding.var, relax.DataflowVar) or not self._in_dataflow:
            var = self.builder_.emit(new, tags.merged(names, self.label))
        else:   # the block's output (e.g. the model's last op): must stay visible outside the block
            var = self.builder_.emit_output(new, tags.merged(names, self.label))
        self.rewritten.append(names)
        self.set_var_remap(binding.var, var)


    def _reuse_vars(self, expr: relax.Expr) -> relax.Expr:
        """The rewrite's operands are matched *values*; a value some binding already holds is that var
        (else the producer of the op's input would be emitted a second time)."""
        if not isinstance(expr, relax.Call):
            return expr
        args = [self.val2var[a] if a in self.val2var else self._reuse_vars(a) for a in expr.args]
        return relax.Call(expr.op, args, expr.attrs, expr.ty_args)

    def _emit_nested(self, expr: relax.Expr, names: list[str]) -> relax.Expr:
        """Bind a rewrite's inner calls (matmul inside add(matmul, b)) under tags naming the same nodes."""
        if not isinstance(expr, relax.Call):
            return expr
        args = []
        for a in expr.args:
            if isinstance(a, relax.Call):
                inner = relax.expr_functor.PyExprMutator.visit_expr(self, self._emit_nested(a, names))
                label = a.op.name.rsplit(".", 1)[-1].capitalize() if isinstance(a.op, tvm.ir.Op) else self.label
                a = self.builder_.emit(inner, tags.merged(names, label))
            args.append(a)
        return relax.Call(expr.op, args, expr.attrs, expr.ty_args)


def _leaf_vars(expr: relax.Expr) -> set[relax.Var]:
    """The vars a (possibly nested) rewritten call reads."""
    if isinstance(expr, relax.Var):
        return {expr}
    if isinstance(expr, relax.Call):
        return set().union(*(_leaf_vars(a) for a in expr.args)) if expr.args else set()
    return set()


def recognize(mod: tvm.IRModule, pattern, rewrite, label: str) -> tuple[tvm.IRModule, list[list[str]]]:
    rec = _Recognizer(mod, pattern, rewrite, label)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and not (func.attrs and "Primitive" in func.attrs):
            rec.builder_.update_func(gv, rec.visit_expr(func))
    return rec.builder_.get(), rec.rewritten


def each_relax_function(mod: tvm.IRModule, fn) -> tvm.IRModule:  # noqa: ANN001 - Function -> Function
    """A copy of `mod` with `fn` applied to every Relax function (a rewrite_call over the whole module). A copy:
    the layout step hands its input back unchanged when it keeps NCHW."""
    out = mod.clone()
    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            out[gv] = fn(func)
    return out


def rebind(mutator: relax.PyExprMutator, var: relax.Var, value: relax.Expr) -> relax.Var:
    """Bind ``value`` in place of ``var`` as ``var`` was bound (a dataflow var, or the block's output, which
    must stay visible outside it), under its name, and send ``var``'s uses to it."""
    emit = mutator.builder_.emit if isinstance(var, relax.DataflowVar) else mutator.builder_.emit_output
    new = emit(value, var.name)
    mutator.set_var_remap(var, new)
    return new
