"""int8 QDQ models: each QuantizeLinear -> DequantizeLinear pair as fp32 arithmetic on the integer grid.

ONNX Runtime's quantiser and torch export write int8 models as QDQ: every activation passes through a
`Q(x) -> int8 -> DQ -> fp32` pair (a "fake quant") between the fp32 ops, and the weights' DQs fold to
constants at import. Relax has no layout rule for `relax.quantize`/`relax.dequantize` and FuseOps keeps
them as kernels of their own, so on ResNet-18 (QDQ by `quantize_static`) the layout step put a transform
on each side of every pair and the fused build ran 81 kernels where the fp32 model runs 25, 1.26x slower
than the same model in fp32 (Sapphire Rapids). Written as the elementwise ops they are,

    DQ(Q(x)) = (clip(round(x / s_q) + z_q, lo, hi) - z_dq) * s_dq

the pair is an epilogue like any other: it keeps the channel-blocked layout and fuses into the conv or
matmul that produces `x`. It is exact, not an approximation: round-half-to-even (`relax.round`, as the
legalised quantize uses), the clip to the int8/uint8 range, then the dequantize's own subtraction and
multiply, each an fp32 operation on values the int8 cast would have kept unchanged. Pairs whose quantized
tensor is also read elsewhere keep their Quantize for those readers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from .layout import clip_bound
from ..ir.helpers import numpy_of
from ..ir.rewrite import recognize

#: integer types a pair may pass through, and their ranges (the quantize's clip)
_RANGES = {"int8": (-128, 127), "uint8": (0, 255), "int16": (-32768, 32767), "uint16": (0, 65535)}


@dataclass
class QdqSummary:
    """What `fold_fake_quant` did, for the fusion report."""

    pairs: int = 0           # Q -> DQ pairs written as fp32 arithmetic
    quantize_left: int = 0   # relax.quantize calls left (their int8 tensor leaves the model or is read as int8)
    dequantize_left: int = 0
    int8_matmuls: int = 0    # MatMuls on integer kernels (compiler/passes/int8_gemm.py); their own Q and DQ not counted above

    def line(self) -> str:
        if not (self.pairs or self.quantize_left or self.dequantize_left or self.int8_matmuls):
            return ""
        left = (f"; left as ops: {self.quantize_left} quantize, {self.dequantize_left} dequantize"
                if self.quantize_left or self.dequantize_left else "")
        ints = f"; {self.int8_matmuls} MatMul(s) on int8 kernels (u8 x s8 -> int32, VNNI)" if self.int8_matmuls else ""
        return f"int8 QDQ: {self.pairs} Q->DQ pair(s) computed in fp32 on the integer grid (exact){ints}{left}"


def _qparam(expr: relax.Expr, axis: int, rank: int) -> relax.Expr | None:
    """A scale or zero point as an fp32 operand that broadcasts against the data: a constant scalar as a
    0-d constant; a per-axis constant of C values as shape (1, .., C, .., 1); anything else: None."""
    if not isinstance(expr, tvm.ir.Constant):
        return None
    value = np.asarray(numpy_of(expr), np.float32)
    if value.size == 1:
        return relax.const(value.reshape(()), "float32")
    if value.ndim != 1 or rank == 0:
        return None
    shape = [1] * rank
    shape[axis % rank] = value.size
    return relax.const(value.reshape(shape), "float32")


def _pattern():
    from tvm.relax.dpl import is_op, wildcard

    x, s_q, z_q, s_dq, z_dq = wildcard(), wildcard(), wildcard(), wildcard(), wildcard()
    quant = is_op("relax.quantize")(x, s_q, z_q)
    return is_op("relax.dequantize")(quant, s_dq, z_dq), quant, (x, s_q, z_q, s_dq, z_dq)


def fold_fake_quant(mod: tvm.IRModule) -> tuple[tvm.IRModule, QdqSummary]:
    """Every `dequantize(quantize(x))` with constant quantisation parameters, fp32 in and out, as fp32
    arithmetic (module docstring). The quantize is left to DCE when nothing else reads it."""
    pattern, quant, (x, s_q, z_q, s_dq, z_dq) = _pattern()

    def rewrite(m: dict) -> relax.Expr | None:
        q, dq = m[quant], m[pattern]
        ty = m[x].ty
        out_dtype = str(q.attrs.out_dtype)
        if not isinstance(ty, relax.TensorType) or str(ty.dtype) != "float32" or ty.ndim < 0 \
                or str(dq.attrs.out_dtype) != "float32" or out_dtype not in _RANGES:
            return None
        rank = ty.ndim
        params = [_qparam(m[p], int(a.attrs.axis), rank)
                  for p, a in ((s_q, q), (z_q, q), (s_dq, dq), (z_dq, dq))]
        if any(p is None for p in params):
            return None
        scale_q, zero_q, scale_dq, zero_dq = params
        lo, hi = _RANGES[out_dtype]
        grid = relax.op.add(relax.op.round(relax.op.divide(m[x], scale_q)), zero_q)
        clipped = relax.op.minimum(relax.op.maximum(grid, relax.const(float(lo), "float32")),
                                   relax.const(float(hi), "float32"))
        return relax.op.multiply(relax.op.subtract(clipped, zero_dq), scale_dq)

    dequantize_before = _count(mod, "relax.dequantize")
    mod = relax.transform.DeadCodeElimination(["main"])(recognize(mod, pattern, rewrite, "FakeQuant")[0])
    left = _count(mod, "relax.dequantize")
    return mod, QdqSummary(pairs=dequantize_before - left, quantize_left=_count(mod, "relax.quantize"),
                           dequantize_left=left)


def _chain_pattern():
    """The arithmetic `fold_fake_quant` writes, operands named; after the layout step its constants are
    full rank and its minimum(maximum(.)) a clip (compiler/passes/layout.py), so both spellings."""
    from tvm.relax.dpl import is_const, is_op, wildcard

    x, s_q, z_q, lo, hi, c_lo, c_hi, z_dq, s_dq = (wildcard(), is_const(), is_const(), is_const(), is_const(),
                                                   wildcard(), wildcard(), is_const(), is_const())
    grid = is_op("relax.add")(is_op("relax.round")(is_op("relax.divide")(x, s_q)), z_q)
    clip = is_op("relax.clip")(grid, c_lo, c_hi)
    clipped = is_op("relax.minimum")(is_op("relax.maximum")(grid, lo), hi) | clip
    pattern = is_op("relax.multiply")(is_op("relax.subtract")(clipped, z_dq), s_dq)
    return pattern, clip, (x, s_q, z_q, lo, hi, c_lo, c_hi, z_dq, s_dq)


def scalar_value(e: relax.Expr) -> float | None:
    """A one-element constant's value (any rank), or a clip bound (a PrimValue)."""
    if hasattr(getattr(e, "value", None), "numpy"):      # a tensor constant
        v = np.asarray(numpy_of(e))
        return float(v.reshape(())) if v.size == 1 else None
    return clip_bound(e)


def as_qdq_ops(mod: tvm.IRModule) -> tvm.IRModule:
    """The unfused build, after the layout step: each chain `fold_fake_quant` wrote back to one quantize and
    one dequantize, as the ONNX graph had them. Scalar parameters, so the ops are layout-free and stay in
    the blocked layout. Without this the unfused build would run the pair as seven kernels, and the fused
    build's speed-up would be measured against a fallback made slower for it."""
    pattern, clip, (x, s_q, z_q, lo, hi, c_lo, c_hi, z_dq, s_dq) = _chain_pattern()
    dtypes = {r: t for t, r in _RANGES.items()}

    def rewrite(m: dict) -> relax.Expr | None:
        bounds = (c_lo, c_hi) if clip in m else (lo, hi)
        values = [scalar_value(m[p]) for p in (s_q, z_q, *bounds, z_dq, s_dq)]
        if any(v is None for v in values):
            return None
        scale_q, zero_q, low, high, zero_dq, scale_dq = values
        dtype = dtypes.get((int(low), int(high)))
        if dtype is None or low != int(low) or high != int(high) or zero_q != int(zero_q) \
                or zero_dq != int(zero_dq):
            return None
        quant = relax.op.quantize(m[x], relax.const(np.float32(scale_q)), relax.const(int(zero_q), dtype),
                                  axis=-1, out_dtype=dtype)
        return relax.op.dequantize(quant, relax.const(np.float32(scale_dq)), relax.const(int(zero_dq), dtype),
                                   axis=-1, out_dtype="float32")

    return recognize(mod, pattern, rewrite, "QDQ")[0]


def _legalize_quantize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """relax.quantize with scalar parameters, rounding ties to even as ONNX QuantizeLinear says. TVM's own
    legalisation rounds with `tirx.round` (llvm.round: ties away from zero), so a value on a tie landed one
    step from ONNX Runtime's, and from the fused build's arithmetic form of the same pair."""
    from tvm import te, tirx

    data, scale, zero = call.args
    out_dtype = str(call.attrs.out_dtype)
    if not (isinstance(scale, tvm.ir.Constant) and isinstance(zero, tvm.ir.Constant)) \
            or np.asarray(numpy_of(scale)).size != 1 or np.asarray(numpy_of(zero)).size != 1 or out_dtype not in _RANGES:
        return _DEFAULT_QUANTIZE(bb, call)
    s = float(np.asarray(numpy_of(scale)).reshape(()))
    z = float(np.asarray(numpy_of(zero)).reshape(()))
    lo, hi = _RANGES[out_dtype]

    def compute(x: te.Tensor) -> te.Tensor:
        def element(*i: tirx.Expr) -> tirx.Expr:
            grid = tirx.nearbyint(x(*i) / tirx.const(s, "float32")) + tirx.const(z, "float32")
            return tirx.max(tirx.min(grid, tirx.const(float(hi), "float32")),
                            tirx.const(float(lo), "float32")).astype(out_dtype)
        return te.compute(x.shape, element, name="quantized")

    return bb.call_te(compute, data, primfunc_name_hint="quantize")


_DEFAULT_QUANTIZE = tvm.ir.Op.get("relax.quantize").get_attr("FLegalize")


def legalize_map() -> dict[str, object]:
    """`LegalizeOps(customize_legalize_map=...)` entries, for every target."""
    return {"relax.quantize": _legalize_quantize}


def _count(mod: tvm.IRModule, op: str) -> int:
    """Calls of `op` in the module's Relax functions."""
    found: list[relax.Call] = []

    def visit(e: relax.Expr) -> None:
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == op:
            found.append(e)

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return len(found)
