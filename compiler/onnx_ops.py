"""Converters for ONNX operators TVM's frontend has none for (each against ONNX's reference implementation,
onnx/reference/ops). `CONVERTERS` maps the op type to `convert(inputs, attrs) -> relax.Expr`; a converter
raises ValueError for what it cannot convert, and the importer names the node in its one-line error.

RotaryEmbedding (opset 23) is what LLM exports carry; Swish, SwiGLU (24) and Celu are activations;
LpNormalization a reduction; CumProd TVM has a Relax op for but no converter.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tvm import relax

from .passes import static_dims


def _scalar(value: float, like: relax.Expr) -> relax.Expr:
    dtype = str(like.ty.dtype)
    if dtype == "bfloat16":
        return relax.op.astype(relax.const(np.float32(value)), dtype)
    return relax.const(np.asarray(value, dtype=dtype), dtype)


def _const_int(x: object, what: str) -> int:
    data = getattr(x, "value", None) if not isinstance(x, relax.Var) else None    # a relax constant
    if data is not None and hasattr(data, "numpy"):
        arr = data.numpy()
        if arr.size == 1:
            return int(arr.reshape(()))
    raise ValueError(f"{what} must be a constant scalar")


def rotary_embedding(inputs: list, attrs: dict) -> relax.Expr:
    x, cos, sin = inputs[0], inputs[1], inputs[2]
    position_ids = inputs[3] if len(inputs) > 3 else None
    dims = static_dims(x)
    if dims is None or len(dims) not in (3, 4):
        raise ValueError("the input needs a static 3D or 4D shape")
    if len(dims) == 4:                                        # [B, H, S, D] -> [B, S, H, D]
        b, h, s, d = dims
        x4 = relax.op.permute_dims(x, [0, 2, 1, 3])
    else:
        heads = int(attrs.get("num_heads", 0))
        if not heads:
            raise ValueError("a 3D input needs the num_heads attribute")
        b, s, hidden = dims
        h, d = heads, hidden // heads
        x4 = relax.op.reshape(x, (b, s, h, d))
    rot = int(attrs.get("rotary_embedding_dim", 0)) or d
    half = rot // 2
    if position_ids is not None:
        cos, sin = relax.op.take(cos, position_ids, axis=0), relax.op.take(sin, position_ids, axis=0)
    cos, sin = relax.op.expand_dims(cos, 2), relax.op.expand_dims(sin, 2)          # [B, S, 1, rot/2]
    rotate = relax.op.strided_slice(x4, [3], [0], [rot]) if rot < d else x4
    if int(attrs.get("interleaved", 0)):
        x1 = relax.op.strided_slice(rotate, [3], [0], [rot], [2])
        x2 = relax.op.strided_slice(rotate, [3], [1], [rot], [2])
    else:
        x1 = relax.op.strided_slice(rotate, [3], [0], [half])
        x2 = relax.op.strided_slice(rotate, [3], [half], [rot])
    real = relax.op.subtract(relax.op.multiply(cos, x1), relax.op.multiply(sin, x2))
    imag = relax.op.add(relax.op.multiply(sin, x1), relax.op.multiply(cos, x2))
    if int(attrs.get("interleaved", 0)):
        pairs = relax.op.concat([relax.op.expand_dims(real, -1), relax.op.expand_dims(imag, -1)], axis=-1)
        rotated = relax.op.reshape(pairs, (b, s, h, rot))
    else:
        rotated = relax.op.concat([real, imag], axis=-1)
    out = relax.op.concat([rotated, relax.op.strided_slice(x4, [3], [rot], [d])], axis=-1) if rot < d else rotated
    return relax.op.reshape(out, dims) if len(dims) == 3 else relax.op.permute_dims(out, [0, 2, 1, 3])


def _swish(x: relax.Expr, alpha: float) -> relax.Expr:
    gate = relax.op.sigmoid(x if alpha == 1.0 else relax.op.multiply(x, _scalar(alpha, x)))
    return relax.op.multiply(x, gate)


def swish(inputs: list, attrs: dict) -> relax.Expr:
    return _swish(inputs[0], float(attrs.get("alpha", 1.0)))


def swiglu(inputs: list, attrs: dict) -> relax.Expr:
    a, b = inputs[0], inputs[1]
    if static_dims(a) != static_dims(b):
        raise ValueError("A and B must have the same shape (SwiGLU does not broadcast)")
    return relax.op.multiply(_swish(a, float(attrs.get("alpha", 1.0))), b)


def celu(inputs: list, attrs: dict) -> relax.Expr:
    x = inputs[0]
    alpha = float(attrs.get("alpha", 1.0))
    zero = _scalar(0.0, x)
    expm1 = relax.op.subtract(relax.op.exp(relax.op.divide(x, _scalar(alpha, x))), _scalar(1.0, x))
    return relax.op.add(relax.op.maximum(x, zero), relax.op.minimum(relax.op.multiply(expm1, _scalar(alpha, x)), zero))


def lp_normalization(inputs: list, attrs: dict) -> relax.Expr:
    x = inputs[0]
    p, axis = int(attrs.get("p", 2)), int(attrs.get("axis", -1))
    if p not in (1, 2):
        raise ValueError(f"p must be 1 or 2, got {p}")
    norm = relax.op.sum(relax.op.abs(x), axis=[axis], keepdims=True) if p == 1 else \
        relax.op.sqrt(relax.op.sum(relax.op.multiply(x, x), axis=[axis], keepdims=True))
    zero = _scalar(0.0, x)
    return relax.op.where(relax.op.equal(norm, zero), zero, relax.op.divide(x, norm))


def cumprod(inputs: list, attrs: dict) -> relax.Expr:
    x = inputs[0]
    axis = _const_int(inputs[1], "axis")
    reverse, exclusive = bool(attrs.get("reverse", 0)), bool(attrs.get("exclusive", 0))
    if reverse:
        x = relax.op.flip(x, axis)
    out = relax.op.cumprod(x, axis=axis, exclusive=exclusive)
    return relax.op.flip(out, axis) if reverse else out


CONVERTERS: dict[str, Callable[[list, dict], relax.Expr]] = {
    "RotaryEmbedding": rotary_embedding,
    "Swish": swish,
    "SwiGLU": swiglu,
    "Celu": celu,
    "LpNormalization": lp_normalization,
    "CumProd": cumprod,
}
