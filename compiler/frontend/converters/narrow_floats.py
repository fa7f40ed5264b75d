"""ONNX's 8-bit floats (FLOAT8E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ, E8M0) converted exactly as ONNX says.

TVM 0.27 holds these dtypes but converts them wrongly for ONNX: measured on its LLVM backend, float32 500 ->
e4m3fn gave -0.0078 (ONNX: NaN without saturation, 448 with it), NaN gave 1.5, -1e9 gave -0.23, the FNUZ types
decoded with the FN bias (every value half what it is), and float32 -> float8 inside a Cast failed to compile.
So every conversion to or from these types is written here as integer and power-of-two arithmetic on the bits
(one elementwise kernel each way, `tirx.reinterpret` at the typed edge): round to nearest even, subnormals,
the types' NaN and Inf codes, saturation (clip to the largest finite value, Inf included, NaN kept) and FNUZ's
lack of a negative zero, matching `ml_dtypes` (which ONNX's reference casts with) bit for bit. E8M0 (scale
exponents, opset 24) follows `onnx.numpy_helper.to_float8e8m0`, rounding modes included.

Cast, CastLike, QuantizeLinear and DequantizeLinear to or from these types come here (compiler/frontend/importer.py);
every other cast stays TVM's.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
from tvm import relax, te, tirx

from ...ir.helpers import static_dims, tensor_dtype


@dataclass(frozen=True)
class NarrowFloat:
    """One narrow float format: `kind` is "fn" (no Inf, all-ones is NaN), "ieee" (Inf and NaN as IEEE),
    "fnuz" (no Inf, no -0: 0x80 is the only NaN), "e8m0" (an exponent only) or "e2m1" (4 bits, no Inf or
    NaN: every cast saturates; held one code per byte, compiler/frontend/converters/subbyte.py)."""

    dtype: str            # TVM's name
    exp_bits: int
    man_bits: int
    bias: int
    kind: str

    @property
    def max_finite(self) -> float:
        return float(ml_dtypes.finfo(getattr(ml_dtypes, self.dtype)).max)

    @property
    def sign(self) -> int:
        """The sign bit's value in the code."""
        return 1 << (self.exp_bits + self.man_bits)

    @property
    def emin(self) -> int:
        """The exponent of the smallest normal value."""
        return 1 - self.bias


FORMATS: dict[int, NarrowFloat] = {
    onnx.TensorProto.FLOAT8E4M3FN: NarrowFloat("float8_e4m3fn", 4, 3, 7, "fn"),
    onnx.TensorProto.FLOAT8E4M3FNUZ: NarrowFloat("float8_e4m3fnuz", 4, 3, 8, "fnuz"),
    onnx.TensorProto.FLOAT8E5M2: NarrowFloat("float8_e5m2", 5, 2, 15, "ieee"),
    onnx.TensorProto.FLOAT8E5M2FNUZ: NarrowFloat("float8_e5m2fnuz", 5, 2, 16, "fnuz"),
    onnx.TensorProto.FLOAT8E8M0: NarrowFloat("float8_e8m0fnu", 8, 0, 127, "e8m0"),
}
#: the 4-bit float, held in a uint8 (TVM cannot pass 4-bit tensors): its code in the low nibble, as ml_dtypes
FLOAT4 = NarrowFloat("float4_e2m1fn", 2, 1, 1, "e2m1")
BY_DTYPE: dict[str, NarrowFloat] = {f.dtype: f for f in FORMATS.values()}


def _u32(value: int | tirx.PrimExpr) -> tirx.PrimExpr:
    return tirx.const(value, "uint32") if isinstance(value, int) else value.astype("uint32")


def _pow2(k: tirx.PrimExpr) -> tirx.PrimExpr:
    """2**k as float32, exact, for integer k in [-126, 127] (built from the bits, no libm call)."""
    return tirx.reinterpret("float32", ((k + 127).astype("uint32") << tirx.const(23, "uint32")))


def encode(x: tirx.PrimExpr, fmt: NarrowFloat, saturate: bool, round_mode: str = "up") -> tirx.PrimExpr:
    """float32 `x` -> the format's code (uint8; a 4-bit code in the low nibble)."""
    if fmt.kind == "e2m1":
        saturate = True                 # no Inf or NaN to overflow to (ml_dtypes saturates)
    if fmt.kind == "e8m0":
        return _encode_e8m0(x, saturate, round_mode)
    bits = tirx.reinterpret("uint32", x)
    negative = (bits >> _u32(31)) == _u32(1)
    a = tirx.abs(x)
    # from the bits: LLVM's fast-math flags on TVM's CPU target fold `x != x` to false
    magnitude = bits & _u32(0x7FFFFFFF)
    is_nan = magnitude > _u32(0x7F800000)
    is_inf = magnitude == _u32(0x7F800000)
    big = tirx.const(fmt.max_finite, "float32")
    if saturate:
        a = tirx.Select(is_nan, tirx.const(0.0, "float32"), tirx.min(a, big))
    else:
        # keep the arithmetic below finite; Inf and NaN are selected at the end
        a = tirx.Select(tirx.Or(is_nan, is_inf), tirx.const(0.0, "float32"), a)
    e = ((tirx.reinterpret("uint32", a) >> _u32(23)) & _u32(0xFF)).astype("int32") - 127
    emin = tirx.const(fmt.emin, "int32")
    step = _pow2(tirx.max(e, emin) - fmt.man_bits)           # the format's spacing at a's binade
    n = tirx.nearbyint(a / step)                             # exact: step is a power of two; ties to even
    r = n * step
    r_bits = tirx.reinterpret("uint32", r)
    r_exp = ((r_bits >> _u32(23)) & _u32(0xFF)).astype("int32") - 127
    man_mask = (1 << fmt.man_bits) - 1
    normal = ((r_exp + fmt.bias).astype("uint32") << _u32(fmt.man_bits)) | \
        ((r_bits >> _u32(23 - fmt.man_bits)) & _u32(man_mask))
    code = tirx.Select(r < _pow2(emin), n.astype("uint32"), normal)   # subnormal: n steps of 2**(emin-man)
    all_ones = fmt.sign - 1
    nan_code = {"fn": all_ones, "ieee": all_ones, "fnuz": 0x80, "e2m1": 0}[fmt.kind]
    overflow_code = (((1 << fmt.exp_bits) - 1) << fmt.man_bits) if fmt.kind == "ieee" else nan_code   # Inf
    code = tirx.Select(r > big, _u32(overflow_code), code)
    if fmt.kind == "fnuz":
        signed = tirx.Select(tirx.And(negative, code != _u32(0)), code | _u32(0x80), code)   # no -0
    else:
        signed = tirx.Select(negative, code | _u32(fmt.sign), code)
    if not saturate:
        inf_code = _u32(overflow_code) if fmt.kind == "fnuz" else \
            tirx.Select(negative, _u32(overflow_code | 0x80), _u32(overflow_code))
        signed = tirx.Select(is_inf, inf_code, signed)
    if fmt.kind == "e2m1":
        # ml_dtypes 0.5 writes a NaN as a zero of the opposite sign (NaN -> 0x8, -NaN -> 0x0): matched bit for bit
        nan = tirx.Select(negative, _u32(0), _u32(fmt.sign))
    else:
        nan = _u32(nan_code)
    signed = tirx.Select(is_nan, nan, signed)
    return signed.astype("uint8")


def _encode_e8m0(x: tirx.PrimExpr, saturate: bool, round_mode: str) -> tirx.PrimExpr:
    """As onnx.numpy_helper.to_float8e8m0: the float32 exponent, rounded by the mantissa per `round_mode`."""
    bits = tirx.reinterpret("uint32", x)
    exponent = (bits >> _u32(23)) & _u32(0xFF)
    special = exponent == _u32(0xFF)
    if round_mode == "nearest":
        g = (bits & _u32(0x400000)) != _u32(0)
        r = (bits & _u32(0x200000)) != _u32(0)
        s = (bits & _u32(0x1FFFFF)) != _u32(0)
        lsb = exponent > _u32(0)
        up = tirx.And(g, tirx.Or(tirx.Or(r, s), lsb))
    elif round_mode == "up":
        up = (bits & _u32(0x7FFFFF)) != _u32(0)
    elif round_mode == "down":
        up = tirx.const(False, "bool")
    else:
        raise ValueError(f"round_mode {round_mode!r}: expected up, down or nearest")
    if saturate:
        up = tirx.And(up, exponent != _u32(0xFE))
    rounded = exponent + tirx.Select(up, _u32(1), _u32(0))
    return tirx.Select(special, _u32(0xFF), rounded & _u32(0xFF)).astype("uint8")


def decode(u: tirx.PrimExpr, fmt: NarrowFloat) -> tirx.PrimExpr:
    """The format's code (uint8) -> float32, exact."""
    u = u.astype("int32")
    nan = tirx.const(np.nan, "float32")
    if fmt.kind == "e8m0":
        tiny = tirx.reinterpret("float32", _u32(0x00400000))            # 2**-127, a float32 subnormal
        return tirx.Select(u == 255, nan, tirx.Select(u == 0, tiny, _pow2(u - 127)))
    man_mask = (1 << fmt.man_bits) - 1
    exp_mask = (1 << fmt.exp_bits) - 1
    fe = (u >> fmt.man_bits) & exp_mask
    fm = u & man_mask
    sub = fm.astype("float32") * _pow2(tirx.const(fmt.emin - fmt.man_bits, "int32"))
    norm = (fm + (1 << fmt.man_bits)).astype("float32") * _pow2(fe - fmt.bias - fmt.man_bits)
    mag = tirx.Select(fe == 0, sub, norm)
    if fmt.kind == "fnuz":
        return tirx.Select(u == 0x80, nan, tirx.Select(u >= 0x80, -mag, mag))
    value = tirx.Select(u >= fmt.sign, -mag, mag)
    if fmt.kind == "e2m1":
        return value
    if fmt.kind == "fn":
        return tirx.Select(tirx.And(fe == exp_mask, fm == man_mask), nan, value)
    inf = tirx.Select(u >= 0x80, tirx.const(-np.inf, "float32"), tirx.const(np.inf, "float32"))
    return tirx.Select(fe == exp_mask, tirx.Select(fm == 0, inf, nan), value)


# ------------------------------------------------------------------------------------------ relax side

def to_narrow(bb: relax.BlockBuilder, x: relax.Expr, fmt: NarrowFloat, saturate: bool,
              round_mode: str = "up") -> relax.Expr:
    """Any real tensor -> `fmt` (through float32, exact for every source type ONNX casts from)."""
    source = tensor_dtype(x)
    if source in BY_DTYPE:
        x = from_narrow(bb, x, BY_DTYPE[source], "float32")

    def kernel(t: te.Tensor) -> te.Tensor:
        return te.compute(t.shape, lambda *i: tirx.reinterpret(fmt.dtype, encode(
            t(*i).astype("float32") if t.dtype != "float32" else t(*i), fmt, saturate, round_mode)),
            name=f"to_{fmt.dtype}")

    return bb.emit_te(kernel, x, primfunc_name_hint=f"cast_to_{fmt.dtype}")


def from_narrow(bb: relax.BlockBuilder, x: relax.Expr, fmt: NarrowFloat, target: str) -> relax.Expr:
    """`fmt` -> `target` (decoded to float32 exactly, then cast as any float32 would be)."""
    if target in BY_DTYPE:
        return to_narrow(bb, from_narrow(bb, x, fmt, "float32"), BY_DTYPE[target], saturate=True)

    def kernel(t: te.Tensor) -> te.Tensor:
        def value(*i: tirx.PrimExpr) -> tirx.PrimExpr:
            v = decode(tirx.reinterpret("uint8", t(*i)), fmt)
            return v if target == "float32" else v.astype(target)
        return te.compute(t.shape, value, name=f"from_{fmt.dtype}")

    return bb.emit_te(kernel, x, primfunc_name_hint=f"cast_from_{fmt.dtype}")


def _flag(attrs: dict, name: str, default: int = 1) -> bool:
    return bool(int(attrs.get(name, default)))


def _mode(attrs: dict) -> str:
    mode = attrs.get("round_mode", b"up")
    return mode.decode() if isinstance(mode, bytes) else str(mode)


def cast(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    """Cast to or from an 8-bit float; None (TVM's converter) for every other cast."""
    source = tensor_dtype(inputs[0])
    fmt = FORMATS.get(int(attrs["to"]))
    if fmt is not None:
        return to_narrow(bb, inputs[0], fmt, _flag(attrs, "saturate"), _mode(attrs))
    if source in BY_DTYPE:
        return from_narrow(bb, inputs[0], BY_DTYPE[source],
                           onnx.helper.tensor_dtype_to_np_dtype(int(attrs["to"])).name)
    return None


def cast_like(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    target = tensor_dtype(inputs[1])
    if target in BY_DTYPE:
        return to_narrow(bb, inputs[0], BY_DTYPE[target], _flag(attrs, "saturate"), _mode(attrs))
    if tensor_dtype(inputs[0]) in BY_DTYPE:
        return from_narrow(bb, inputs[0], BY_DTYPE[tensor_dtype(inputs[0])], target)
    return None


def per_axis(value: relax.Expr, like: relax.Expr, axis: int, what: str) -> relax.Expr:
    """A scalar or a 1-D per-axis `value` shaped to broadcast against `like` along `axis`."""
    dims = static_dims(value)
    if dims is None:
        raise ValueError(f"{what} must have a static shape")
    if len(dims) == 0 or int(np.prod(dims)) == 1:
        return relax.op.reshape(value, ()) if len(dims) else value
    if len(dims) != 1:
        raise ValueError(f"{what} of shape {tuple(dims)}: blocked quantisation to 8-bit floats is not supported")
    rank = len(static_dims(like) or ())
    shape = [1] * rank
    shape[axis % rank] = dims[0]
    return relax.op.reshape(value, shape)


def quantize_linear(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    """QuantizeLinear to an 8-bit float: x / scale, then the saturating cast (the zero point must be 0)."""
    zero = inputs[2] if len(inputs) > 2 else None
    target = tensor_dtype(zero) if zero is not None else None
    if target is None and "output_dtype" in attrs:
        fmt = FORMATS.get(int(attrs["output_dtype"]))
    else:
        fmt = BY_DTYPE.get(target) if target else None
    if fmt is None:
        return None
    if int(attrs.get("block_size", 0)):
        raise ValueError("blocked QuantizeLinear to an 8-bit float is not supported")
    x, scale = inputs[0], inputs[1]
    if tensor_dtype(scale) != tensor_dtype(x):
        scale = bb.normalize(relax.op.astype(scale, tensor_dtype(x)))
    scaled = bb.normalize(relax.op.divide(x, per_axis(scale, x, int(attrs.get("axis", 1)), "y_scale")))
    return to_narrow(bb, scaled, fmt, _flag(attrs, "saturate"))


def dequantize_linear(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    """DequantizeLinear from an 8-bit float: decoded, times the scale (the zero point must be 0)."""
    x = inputs[0]
    fmt = BY_DTYPE.get(tensor_dtype(x))
    if fmt is None:
        return None
    if int(attrs.get("block_size", 0)):
        raise ValueError("blocked DequantizeLinear from an 8-bit float is not supported")
    scale = inputs[1]
    out = (onnx.helper.tensor_dtype_to_np_dtype(int(attrs["output_dtype"])).name
           if int(attrs.get("output_dtype", 0)) else tensor_dtype(scale))
    if tensor_dtype(scale) != "float32":
        scale = bb.normalize(relax.op.astype(scale, "float32"))
    decoded = from_narrow(bb, x, fmt, "float32")
    product = relax.op.multiply(decoded, per_axis(scale, x, int(attrs.get("axis", 1)), "x_scale"))
    return product if out == "float32" else relax.op.astype(product, out)
