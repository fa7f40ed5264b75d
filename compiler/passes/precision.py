"""Reduced-precision builds: GEMM and convolution operands in fp16 or bf16, accumulated in fp32.

The policy, per Relax op (AMP's, with the epilogue kept in fp32):

- **lowp operands** (`ALWAYS`: matmul, conv*): float inputs are cast to the reduced type (constant weights
  once, at compile time: FoldConstant folds the cast) and the op accumulates in fp32 (`out_dtype`).
- **follow** (`FOLLOW`: elementwise and data-movement ops): computed in the reduced type when every float
  input already is, else in fp32 with the reduced inputs cast up.
- **fp32** (every other op: reductions, softmax, layer_norm, exp/erf/tanh-based activations): reduced inputs
  are cast up, so statistics are never accumulated in half precision.

Why not TVM's `ToMixedPrecision` as is: it down-casts each GEMM's fp32 accumulator straight away and then
runs bias, GELU and residual adds in fp16, so the *unfused* build already evaluates the epilogue after the
down-cast. A fused kernel that does the same would then be no worse than its reference and the fp64
comparison could not catch it. Here the accumulator stays fp32 through the epilogue, exactly what a fused
GEMM+epilogue kernel computes, and the down-cast happens where the next GEMM reads it (FuseOps folds that
cast into the producing kernel, so tensors between kernels are stored in the reduced type). The fused and
the unfused build compute the same function; fusion must not change its error against fp64.

The interface is the model's own: inputs are cast where a GEMM reads them, and every tensor the pass
creates in the reduced type is a GEMM operand, so outputs keep their types (a model's own fp16 GEMM keeps
its fp16 output, accumulated in fp32). The harness, ONNX Runtime and the fp64 reference all see the same
interface.
"""

from __future__ import annotations

from collections import Counter

import tvm
from tvm import relax

from ..errors import UsageError
from ..ir.helpers import tensor_dtype

#: --precision values and the element type each computes GEMM operands in.
PRECISIONS: dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

#: Ops whose float operands go to the reduced type, accumulating in fp32.
ALWAYS = frozenset({"relax.matmul", "relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d",
                    "relax.nn.conv1d_transpose", "relax.nn.conv2d_transpose"})
#: Ops computed in the reduced type when all their float inputs are in it (exact or rounding-only: adds,
#: multiplies, max/min, relu, data movement). Everything else runs in fp32.
FOLLOW = frozenset({
    "relax.add", "relax.subtract", "relax.multiply", "relax.negative", "relax.maximum", "relax.minimum",
    "relax.nn.relu", "relax.clip", "relax.reshape", "relax.permute_dims", "relax.concat", "relax.split",
    "relax.strided_slice", "relax.take", "relax.squeeze", "relax.expand_dims", "relax.flatten",
    "relax.broadcast_to", "relax.tile", "relax.repeat", "relax.nn.max_pool2d", "relax.where",
    "relax.layout_transform", "relax.nn.pad", "relax.image.resize2d", "relax.collapse_sum_to",
})
FP32 = "float32"


def check(precision: str) -> str:
    """The precision name, or a one-line UsageError naming the choices."""
    if precision not in PRECISIONS:
        raise UsageError(f"--precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    return precision


def _is_float(dtype: str | None) -> bool:
    return dtype is not None and (dtype.startswith("float") or dtype == "bfloat16")


@relax.expr_functor.mutator
class _Convert(relax.PyExprMutator):
    """Rewrites one function's calls by the policy above (dataflow order, so inputs are converted first)."""

    def __init__(self, mod: tvm.IRModule, low: str) -> None:
        super().__init__(mod)
        self.low = low

    def _cast(self, expr: relax.Expr, dtype: str) -> relax.Expr:
        if tensor_dtype(expr) == dtype or not _is_float(tensor_dtype(expr)):
            return expr
        return self.builder_.normalize(relax.op.astype(expr, dtype))

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        op = getattr(call.op, "name", None)
        if op is None or op == "relax.astype":
            return call
        args = list(call.args)
        floats = [tensor_dtype(a) for a in args if _is_float(tensor_dtype(a))]
        if not floats:
            return call
        if op in ALWAYS:
            if any(d != FP32 and d != self.low for d in floats):    # fp64 and friends: not ours to lower
                return call
            new_args = [self._cast(a, self.low) for a in args]
            widened = relax.Call(call.op, new_args, _with_out_dtype(call.attrs, FP32), call.ty_args)
            native = tensor_dtype(call)       # a model's own fp16 GEMM keeps its output type (fp32 accumulation)
            return widened if native in (None, FP32) else relax.op.astype(self.builder_.normalize(widened), native)
        if op in FOLLOW and all(d == self.low for d in floats):
            return call
        if self.low in floats:
            return relax.Call(call.op, [self._cast(a, FP32) if tensor_dtype(a) == self.low else a for a in args],
                              call.attrs, call.ty_args)
        return call


def _with_out_dtype(attrs: tvm.ir.Attrs, dtype: str) -> tvm.ir.Attrs:
    """A copy of a matmul/conv attrs node with `out_dtype` replaced."""
    info = type(attrs).__tvm_ffi_type_info__
    values = {f.name: getattr(attrs, f.name) for f in info.fields}
    values["out_dtype"] = dtype
    return tvm.ir.make_node(info.type_key, **values)


def to_precision(mod: tvm.IRModule, precision: str) -> tvm.IRModule:
    """`mod` with every Relax function computed in `precision` by the policy above; fp32 returns it unchanged."""
    low = PRECISIONS[check(precision)]
    if low == FP32:
        return mod
    out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            body = _Convert(out, low).visit_expr(func.body)
            out[gv] = relax.Function(func.params, body, None, func.is_pure, func.attrs, func.span)
    return relax.transform.Normalize()(out)


def dtype_census(mod: tvm.IRModule) -> dict[str, dict[str, int]]:
    """{op name: {output dtype: count}} over `main`'s calls: which ops run in which type (for the report)."""
    seen: Counter[tuple[str, str]] = Counter()

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            dtype = tensor_dtype(expr)
            if dtype is not None:
                seen[(expr.op.name.removeprefix("relax."), dtype)] += 1

    relax.analysis.post_order_visit(mod["main"].body, visit)
    out: dict[str, dict[str, int]] = {}
    for (op, dtype), n in sorted(seen.items()):
        out.setdefault(op, {})[dtype] = n
    return out
