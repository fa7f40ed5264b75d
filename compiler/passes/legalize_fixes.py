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
- `relax.power` of a float tensor to a constant 0.5, 0.25, 0.75 or 1.5: square roots and a multiply in the
  one kernel (x^0.75 = sqrt(x) * sqrt(sqrt(x)), which cannot overflow where x^0.75 does not). LLVM lowers
  `powf` in a vectorised loop to a libm call a lane: AlexNet's two LRNs (`(bias + alpha / size * sum x^2) ^
  0.75`, 280k and 180k values) took 0.9-1.0 ms unfused, 1.1-1.5 ms fused (`fuseguard profile`, SPR class).
  Each square root is correctly rounded (within a few ulp of powf together); powf(-inf, y) is +inf for these
  y where a square root gives NaN, kept with a select; powf(-0, 0.5) is +0, sqrt -0 (equal).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx

from ..ir.rewrite import each_relax_function
from ..ir.helpers import static_dims, tensor_dtype

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


#: exponents whose power is square roots and at most one multiply (`_legalize_power`)
ROOT_POWERS = (0.5, 0.25, 0.75, 1.5)
_POWER_DEFAULT = tvm.ir.Op.get("relax.power").get_attr("FLegalize")


def _legalize_power(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    base, exponent = call.args
    ty = base.ty
    e = None
    if isinstance(exponent, tvm.ir.Constant) and isinstance(ty, relax.TensorType) and ty.shape is not None \
            and str(ty.dtype).startswith(("float", "bfloat")):
        value = exponent.value.numpy()
        if value.size == 1 and value.ndim <= ty.ndim:
            e = float(value.reshape(()))
    if e not in ROOT_POWERS:
        return _POWER_DEFAULT(bb, call)
    dtype = str(ty.dtype)

    def compute(x: te.Tensor) -> te.Tensor:
        def element(*idx: tirx.Expr) -> tirx.Expr:
            v = x(*idx)
            root = tirx.sqrt(v)
            out = {0.5: root, 0.25: tirx.sqrt(root), 0.75: root * tirx.sqrt(root), 1.5: v * root}[e]
            return tirx.Select(v == tirx.const(float("-inf"), dtype), tirx.const(float("inf"), dtype), out)

        return te.compute(x.shape, element, name="root_power")

    return bb.call_te(compute, base, primfunc_name_hint="root_power")


def legalize_map() -> dict[str, object]:
    """`LegalizeOps(customize_legalize_map=...)` entries, for every target."""
    return {**{op: _legalize_reduction for op in _EMPTY}, "relax.power": _legalize_power}
