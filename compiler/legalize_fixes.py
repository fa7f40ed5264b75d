"""Legalisations where TVM's lowering differs from ONNX (and numpy): one entry per op, every target.

- `relax.max` over floats: TOPI's max reduction starts from the lowest finite value, so the max of a row
  of -inf was -3.4e38, not -inf. ONNX's own Attention function body masks a row that has no attendable
  key by testing its ReduceMax for -inf: the test missed, and a fully masked row came out NaN where ONNX
  says 0 (seven node-suite cases). Started from -inf it is exact; the schedules see the same reduction.
- `relax.min` over floats: the mirror image (a row of +inf read 3.4e38); started from +inf.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx

_DEFAULTS = {op: tvm.ir.Op.get(op).get_attr("FLegalize") for op in ("relax.max", "relax.min")}


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


def legalize_map() -> dict[str, object]:
    """`LegalizeOps(customize_legalize_map=...)` entries, for every target."""
    return {"relax.max": _legalize_extremum, "relax.min": _legalize_extremum}
