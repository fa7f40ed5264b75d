"""Legalisations where TVM's lowering differs from ONNX (and numpy): one entry per op, every target.

- `relax.max` over floats: TOPI's max reduction starts from the lowest finite value, so the max of a row
  of -inf was -3.4e38, not -inf. ONNX's own Attention function body masks a row that has no attendable
  key by testing its ReduceMax for -inf: the test missed, and a fully masked row came out NaN where ONNX
  says 0 (seven node-suite cases). Started from -inf it is exact; the schedules see the same reduction.
- `relax.min` over floats: the mirror image (a row of +inf read 3.4e38); started from +inf.
- Every reduction (sum, prod, mean, max, min, variance, std) over an axis of static extent 0: TVM's kernel
  skips its init when the reduced extent is 0 and returned uninitialised memory (measured: 0.0 and 4.2e-43
  where -inf was due). Such a reduction is its identity, as a constant: sum 0, prod 1, max -inf (an integer
  type's least value), min +inf, mean / variance / std NaN (numpy's and ONNX's reference values). Here, not in
  the ONNX converters, so a reduction written by any converter or pass (a LogSumExp, an L2 norm) is covered.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx

from .passes import each_relax_function, static_dims, tensor_dtype

#: a reduction of no elements: its identity (float types; integers and bool in `_empty_value`)
_EMPTY = {"relax.sum": 0.0, "relax.prod": 1.0, "relax.max": -np.inf, "relax.min": np.inf, "relax.mean": np.nan,
          "relax.variance": np.nan, "relax.std": np.nan}
_DEFAULTS = {op: tvm.ir.Op.get(op).get_attr("FLegalize") for op in _EMPTY}


def _empty_value(op: str, dtype: str) -> float | int | bool | None:
    """What `op` over no elements is in `dtype`, or None when TVM's own answer stands (an integer mean)."""
    value = _EMPTY[op]
    if dtype == "bool":           # any / all, and the sum and product of no bools
        return {"relax.max": False, "relax.sum": False, "relax.min": True, "relax.prod": True}.get(op)
    if dtype.startswith(("float", "bfloat")):
        return value
    if np.isnan(value):
        return None
    if np.isinf(value):
        info = np.iinfo(dtype)
        return info.min if value < 0 else info.max
    return int(value)


def _legalize_empty(bb: relax.BlockBuilder | None, call: relax.Call) -> relax.Expr | None:
    """A reduction over a reduced axis of static extent 0, as its identity; None when it is not one."""
    dims = static_dims(call.args[0])
    if not dims:
        return None
    ndim = len(dims)
    axes = {int(a) % ndim for a in call.attrs.axis} if call.attrs.axis is not None else set(range(ndim))
    if not any(dims[a] == 0 for a in axes):
        return None
    dtype = tensor_dtype(call.args[0])
    value = _empty_value(call.op.name, dtype)
    if value is None:
        return None
    shape = [1 if a in axes else d for a, d in enumerate(dims)] if call.attrs.keepdims else \
        [d for a, d in enumerate(dims) if a not in axes]
    # a constant array: relax.op.full fails in FoldConstant on TVM 0.27 ("PrimType is not iterable")
    return relax.const(np.full(shape, value, dtype=dtype), dtype)


def _legalize_reduction(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    empty = _legalize_empty(bb, call)
    if empty is not None:
        return empty
    if call.op.name in ("relax.max", "relax.min"):
        return _legalize_extremum(bb, call)
    return _DEFAULTS[call.op.name](bb, call)


def _legalize_extremum(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """max / min over floats, started from -inf / +inf (TOPI starts from the lowest / largest finite value)."""
    data = call.args[0]
    ty = data.ty
    op = call.op.name
    if not isinstance(ty, relax.TensorType) or not str(ty.dtype).startswith(("float", "bfloat")) \
            or ty.shape is None or ty.ndim < 1:
        return _DEFAULTS[op](bb, call)
    is_max = op == "relax.max"
    ndim = ty.ndim
    axes = sorted({int(a) % ndim for a in call.attrs.axis} if call.attrs.axis is not None else set(range(ndim)))
    keepdims = bool(call.attrs.keepdims)

    def compute(x: te.Tensor) -> te.Tensor:
        reducer = te.comm_reducer((lambda a, b: tirx.max(a, b)) if is_max else (lambda a, b: tirx.min(a, b)),
                                  lambda t: tirx.const(float("-inf") if is_max else float("inf"), t),
                                  name="max" if is_max else "min")
        out_shape = [1 if i in axes else x.shape[i] for i in range(ndim)] if keepdims else \
            [x.shape[i] for i in range(ndim) if i not in axes]
        raxes = {i: te.reduce_axis((0, x.shape[i]), name=f"k{i}") for i in axes}

        def element(*idx: tirx.Expr) -> tirx.Expr:
            out = iter(idx)
            full = []
            for i in range(ndim):
                if i in axes:
                    if keepdims:
                        next(out)
                    full.append(raxes[i].var)
                else:
                    full.append(next(out))
            return reducer(x(*full), axis=[raxes[i] for i in axes])

        return te.compute(out_shape, element, name=f"{'max' if is_max else 'min'}_red")

    return bb.call_te(compute, data, primfunc_name_hint="max" if is_max else "min")


@relax.expr_functor.mutator
class _EmptyReductionFolder(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 - visitor API
        call = super().visit_call_(call)
        if isinstance(call.op, tvm.ir.Op) and call.op.name in _EMPTY:
            folded = _legalize_empty(None, call)
            if folded is not None:
                return folded
        return call


@tvm.transform.module_pass(opt_level=0, name="FoldEmptyReductions")
def FoldEmptyReductions(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:  # noqa: N802
    """The same identities before FoldConstant: a reduction of a zero-size constant (an importer turns a 0-size
    input into one) is folded there with TVM's own legalisation, which divides by the extent 0 for a mean
    ("Divide by zero") and fails the build."""
    return each_relax_function(mod, _EmptyReductionFolder(mod).visit_expr)


def legalize_map() -> dict[str, object]:
    """`LegalizeOps(customize_legalize_map=...)` entries, for every target."""
    return {op: _legalize_reduction for op in _EMPTY}
