"""Whole-module analysis of a Relax build: its kernels and their call sites, ops, FLOPs, memory traffic
and planned bytes, and which ONNX nodes each call site computes (what the fusion report and the cost checks read)."""

from __future__ import annotations

import re

import tvm
from tvm import relax

_SUFFIX = re.compile(r"\d+$")


def op_name(call: relax.Call, mod: tvm.IRModule) -> str | None:
    """A readable name for one operator call: the Relax op, or the PrimFunc a call_tir targets."""
    if isinstance(call.op, tvm.ir.Op):
        if call.op.name in ("relax.call_tir", "relax.call_tir_inplace"):
            gv = call.args[0]
            return _SUFFIX.sub("", gv.name_hint).rstrip("_").removeprefix("tir_") if isinstance(gv, relax.GlobalVar) else "call_tir"
        return call.op.name.removeprefix("relax.").removeprefix("nn.")
    return None


def function_ops(func: relax.Function, mod: tvm.IRModule) -> tuple[list[str], list[str]]:
    """(op names, bound var names) of a function body, in order."""
    ops: list[str] = []
    names: list[str] = []

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.SeqExpr):
            for block in expr.blocks:
                for binding in block.bindings:
                    names.append(binding.var.name)
                    if isinstance(binding.value, relax.Call):
                        n = op_name(binding.value, mod)
                        if n is not None:
                            ops.append(n)
                        elif isinstance(binding.value.op, relax.GlobalVar):
                            inner = mod[binding.value.op]
                            if isinstance(inner, relax.Function):
                                sub_ops, sub_names = function_ops(inner, mod)
                                ops.extend(sub_ops)
                                names.extend(sub_names)
            visit(expr.body)

    visit(func.body)
    return ops, names


def count_kernels(mod: tvm.IRModule) -> int:
    """call_tir / extern call sites in every Relax function: the kernels a run launches."""
    count = 0

    def visit(expr: relax.Expr) -> None:
        nonlocal count
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in (
                "relax.call_tir", "relax.call_tir_inplace", "relax.call_dps_packed"):
            count += 1

    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and not (func.attrs and "Primitive" in func.attrs):
            relax.analysis.post_order_visit(func.body, visit)
    return count


def type_bytes(ty: object) -> int:
    if isinstance(ty, relax.TensorType) and ty.shape is not None:
        try:
            dims = [int(d) for d in ty.shape.values]
        except (TypeError, AttributeError):
            return 0
        n = 1
        for d in dims:
            n *= d
        return n * max(1, tvm.runtime.DataType(ty.dtype).bits // 8)
    if isinstance(ty, relax.TupleType):
        return sum(type_bytes(f) for f in ty.fields)
    return 0


def memory_traffic(mod: tvm.IRModule) -> tuple[int, int]:
    """(bytes read + written by all kernels, minimum: inputs + weights + outputs once each).

    Counted at kernel boundaries on the module handed to codegen: each call_tir reads its arguments and
    writes its output once. Traffic inside a kernel (cache re-reads) is not global-memory traffic.
    """
    main = mod["main"]
    total = 0
    weights: list[tuple[relax.Expr, int]] = []

    def visit(expr: relax.Expr) -> None:
        nonlocal total
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in (
                "relax.call_tir", "relax.call_tir_inplace", "relax.call_dps_packed"):
            args = expr.args[1]
            fields = args.fields if isinstance(args, relax.Tuple) else [args]
            for arg in fields:
                total += type_bytes(arg.ty)
                if not isinstance(arg, relax.Var) and not any(w.same_as(arg) for w, _ in weights):
                    weights.append((arg, type_bytes(arg.ty)))
            total += type_bytes(expr.ty)

    relax.analysis.post_order_visit(main.body, visit)
    ins = sum(type_bytes(p.ty) for p in main.params)
    outs = type_bytes(main.body.body.ty) if isinstance(main.body, relax.SeqExpr) else 0
    return total, ins + sum(n for _, n in weights) + outs


def planned_bytes(mod: tvm.IRModule) -> int:
    """Bytes of device storage the static memory plan allocates for `main` (after memory planning): the
    activations' peak as planned, weights excluded. Deterministic, so a growth is a real one."""
    total = 0

    def visit(expr: relax.Expr) -> None:
        nonlocal total
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in (
                "relax.vm.alloc_storage", "relax.memory.alloc_storage") and isinstance(expr.args[0], relax.ShapeExpr):
            dims = expr.args[0].values
            if all(isinstance(d, tvm.tirx.IntImm) for d in dims):
                n = 1
                for d in dims:
                    n *= int(d.value)
                total += n

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return total


def call_tir_sites(mod: tvm.IRModule) -> list[tuple[str, str, int]]:
    """(binding var name, kernel name, bytes its arguments and output take) of every call_tir in `main`,
    in execution order."""
    sites: list[tuple[str, str, int]] = []
    main = mod["main"]
    if isinstance(main.body, relax.SeqExpr):
        for block in main.body.blocks:
            for binding in block.bindings:
                v = binding.value
                if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name == "relax.call_tir":
                    args = v.args[1]
                    fields = args.fields if isinstance(args, relax.Tuple) else [args]
                    nbytes = sum(type_bytes(a.ty) for a in fields) + type_bytes(v.ty)
                    sites.append((binding.var.name, v.args[0].name_hint, nbytes))
    return sites


def kernel_flops(mod: tvm.IRModule) -> dict[str, int]:
    """Floating-point operations per PrimFunc: 2 x the iteration count of every block that reduces
    (a multiply-accumulate per point: matmul, conv, and the cheap row reductions). Elementwise work is
    not counted: it is memory-bound, and GFLOP/s is a figure for compute-bound kernels."""
    import tvm_ffi
    from tvm import s_tir, tirx

    out: dict[str, int] = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        total = [0]

        def visit(node) -> None:  # noqa: ANN001 - an SBlockRealize
            ivs = node.block.iter_vars
            if not any(iv.iter_type == tirx.IterVar.CommReduce for iv in ivs):
                return
            n = 1
            for iv in ivs:
                ext = iv.dom.extent
                n *= int(ext.value) if isinstance(ext, tirx.IntImm) else 1
            total[0] += 2 * n

        tvm_ffi.structural_walk(func, (s_tir.SBlockRealize, visit), order="post")
        out[gv.name_hint] = total[0]
    return out


def count_ops(mod: tvm.IRModule) -> int:
    count = 0

    def visit(expr: relax.Expr) -> None:
        nonlocal count
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            name = expr.op.name
            if name.startswith("relax.") and not name.startswith(("relax.builtin", "relax.vm", "relax.memory")):
                count += 1

    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return count


@relax.expr_functor.mutator
class _UniqueKernels(relax.PyExprMutator):
    """Give every call_tir site in `main` its own copy of the PrimFunc it calls."""

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod_ = mod
        self.owner: dict[str, str] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        v = binding.value
        if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name == "relax.call_tir":
            name = f"__site{len(self.owner)}"
            gv = self.builder_.add_func(self.mod_[v.args[0]].with_attr("global_symbol", name), name)
            self.owner[gv.name_hint] = binding.var.name
            args = [gv] + [self.visit_expr(a) for a in v.args[1:]]
            var = self.builder_.emit(relax.Call(v.op, args, v.attrs, v.ty_args), binding.var.name)
            self.set_var_remap(binding.var, var)
            return
        super().visit_var_binding_(binding)


def call_site_provenance(legalized: tvm.IRModule) -> list[list[str]]:
    """Per group call in `main` (in order), the names of the bindings it absorbed.

    FuseOps shares one function between structurally identical groups (every ResNet bottleneck conv of a
    shape), so a shared function's body cannot say which ONNX nodes one call came from. Running FuseOps
    again on a copy whose every call_tir site has its own PrimFunc keeps groups apart; the grouping
    itself depends only on op patterns and dataflow, so it matches the real build call for call.
    """
    uniq = _UniqueKernels(legalized)
    main = legalized.get_global_var("main")
    uniq.builder_.update_func(main, uniq.visit_expr(legalized["main"]))
    copy = relax.transform.FuseOps()(uniq.builder_.get())
    sites: list[list[str]] = []
    body = copy["main"].body
    for block in body.blocks if isinstance(body, relax.SeqExpr) else []:
        for binding in block.bindings:
            v = binding.value
            if not (isinstance(v, relax.Call) and isinstance(v.op, relax.GlobalVar)):
                continue
            func = copy[v.op]
            if not isinstance(func, relax.Function) or func.attrs is None or "Primitive" not in func.attrs:
                continue
            names: list[str] = []

            def visit(expr: relax.Expr) -> None:
                if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and \
                        expr.op.name == "relax.call_tir" and expr.args[0].name_hint in uniq.owner:
                    names.append(uniq.owner[expr.args[0].name_hint])

            relax.analysis.post_order_visit(func.body, visit)
            sites.append(names)
    return sites
