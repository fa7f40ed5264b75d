"""Converters replacing TVM's where its result differs from what ONNX specifies (found by the node conformance
suite, `fuseguard conformance`; each checked against ONNX's reference in tests/test_onnx_semantics.py).

Each takes `(bb, inputs, attrs)` and returns a Relax expression, or None to keep TVM's converter (the case it
already gets right, or one this cannot decide statically). What each fixes, measured on TVM 0.27:
- Mod with fmod=0 on floats: every result NaN; ONNX takes NumPy's `mod` (the divisor's sign, Inf divisors).
- BitShift by a negative amount or by the bit width or more: LLVM's undefined shift; ONNX (NumPy) gives 0.
- SpaceToDepth in CRD mode: computed as DCR.
Two adjust the inputs or attributes TVM's converter then reads (`expand_inputs`, `conv_transpose_pads`):
- Expand with a run-time shape tensor: the target's 1s kept ((3, 1) to [2, 1, 6] gave (2, 1, 6), not (2, 3, 6)).
- ConvTranspose's `output_shape`: ignored (the pads it implies were never derived).
The rest replace the converter:
- BatchNormalization with training_mode=1: normalised by the running statistics instead of the batch's.
- Pow with a base and exponent of different types: refused; with integers: failed in FoldConstant.
- OneHot: refused unless `values` were constants, and TVM's call itself mistyped `depth`.
- EyeLike with a dtype unlike its input's: refused. ReduceMax/ReduceMin of bool: failed in FoldConstant.
- Reduce* over an axis of size 0: uninitialised memory.
- Constant given as value_int(s)/value_float(s): "no value in Constant".
- Dropout in training mode: a float32 mask (ONNX: bool).
- Blocked QuantizeLinear/DequantizeLinear (block_size, opset 21) of 8/16-bit integers: refused.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from tvm import relax, te, tirx

from ...ir.helpers import const_values, static_dims, tensor_dtype




def _broadcast(bb: relax.BlockBuilder, *xs: relax.Expr) -> list[relax.Expr] | None:
    """The operands broadcast to their common static shape (None when a shape is not static)."""
    dims = [static_dims(x) for x in xs]
    if any(d is None for d in dims):
        return None
    shape = list(np.broadcast_shapes(*(tuple(d) for d in dims)))
    return [x if d == shape else bb.normalize(relax.op.broadcast_to(x, shape)) for x, d in zip(xs, dims)]


def _sign_bit(v: tirx.PrimExpr, bits: int) -> tirx.PrimExpr:
    """A float's sign bit (`bits` wide) as 0 or 1 (an unsigned int: TVM 0.27 lowers bool != bool to fcmp)."""
    u = f"uint{bits}"
    return tirx.reinterpret(u, v) >> tirx.const(bits - 1, u)


def _is_zero(v: tirx.PrimExpr, bits: int) -> tirx.PrimExpr:
    """+0 or -0, read from the bits."""
    u = f"uint{bits}"
    return (tirx.reinterpret(u, v) & tirx.const((1 << (bits - 1)) - 1, u)) == tirx.const(0, u)


def mod(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    """Float Mod with fmod=0: NumPy's `mod`, the remainder taking the divisor's sign. From C's exact fmod:
    a non-zero remainder of the other sign gets the divisor added (so -3 mod Inf is Inf, 3 mod -Inf is -Inf),
    a zero one takes the divisor's sign; the signs read from the bits (fast-math folds float compares)."""
    dtype = tensor_dtype(inputs[0])
    if int(attrs.get("fmod", 0)) or dtype not in ("float16", "float32", "float64"):
        return None
    operands = _broadcast(bb, inputs[0], inputs[1])
    if operands is None:
        return None
    work = "float32" if dtype == "float16" else dtype

    def kernel(a: te.Tensor, b: te.Tensor) -> te.Tensor:
        def value(*i: tirx.PrimExpr) -> tirx.PrimExpr:
            x, y = a(*i).astype(work), b(*i).astype(work)
            r = tirx.call_pure_extern(work, "fmod" if work == "float64" else "fmodf", x, y)   # C's, exact
            bits = 64 if work == "float64" else 32
            # the divisor's signed zero from its sign bit (TVM folds Select(c, -0.0, 0.0): the two compare equal)
            zero = tirx.reinterpret(work, _sign_bit(y, bits) << tirx.const(bits - 1, f"uint{bits}"))
            flip = _sign_bit(r, bits) != _sign_bit(y, bits)
            fixed = tirx.Select(_is_zero(r, bits), zero, tirx.Select(flip, r + y, r))
            return fixed.astype(dtype) if work != dtype else fixed
        return te.compute(a.shape, value, name="py_mod")

    return bb.emit_te(kernel, *operands, primfunc_name_hint="mod")


def bit_shift(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    """Shifts by < 0 or >= the bit width give 0 (left) or the sign fill (right), as NumPy does."""
    dtype = tensor_dtype(inputs[0])
    operands = _broadcast(bb, inputs[0], inputs[1])
    if dtype is None or operands is None:
        return None
    direction = attrs.get("direction", b"LEFT")
    left = (direction.decode() if isinstance(direction, bytes) else str(direction)) == "LEFT"
    width = int(dtype.removeprefix("u").removeprefix("int"))
    shift_dtype = tensor_dtype(operands[1])

    def kernel(a: te.Tensor, b: te.Tensor) -> te.Tensor:
        def value(*i: tirx.PrimExpr) -> tirx.PrimExpr:
            x, s = a(*i), b(*i)
            below = s < tirx.const(width, shift_dtype)
            inside = below if shift_dtype.startswith("uint") else tirx.And(s >= tirx.const(0, shift_dtype), below)
            # in range by masking (a Select here trips TVM 0.27's unsigned simplifier); the outer Select decides
            safe = (s & tirx.const(width - 1, shift_dtype)).astype(dtype)
            shifted = (x << safe) if left else (x >> safe)
            fill = tirx.const(0, dtype) if left or dtype.startswith("uint") else \
                tirx.Select(x < tirx.const(0, dtype), tirx.const(-1, dtype), tirx.const(0, dtype))
            return tirx.Select(inside, shifted, fill)
        return te.compute(a.shape, value, name="bit_shift")

    return bb.emit_te(kernel, *operands, primfunc_name_hint="bit_shift")


def space_to_depth(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    """CRD: output channel c * bs * bs + (bh * bs + bw) (DCR, TVM's only mode: (bh * bs + bw) * C + c)."""
    mode = attrs.get("mode", b"DCR")
    if (mode.decode() if isinstance(mode, bytes) else str(mode)) != "CRD":
        return None
    dims = static_dims(inputs[0])
    if dims is None or len(dims) != 4:
        return None
    n, c, h, w = dims
    bs = int(attrs["blocksize"])
    x = relax.op.reshape(inputs[0], [n, c, h // bs, bs, w // bs, bs])
    x = relax.op.permute_dims(x, [0, 1, 3, 5, 2, 4])
    return relax.op.reshape(x, [n, c * bs * bs, h // bs, w // bs])


def expand_inputs(bb: relax.BlockBuilder, inputs: list) -> list | None:
    """A run-time shape tensor of static length: each 1 in it replaced by the data's dim (the two-way
    broadcast) before TVM's converter reads it (a constant shape is compiler/frontend/importer.py's `_expand_static`)."""
    if len(inputs) != 2 or not isinstance(inputs[1], relax.Var):
        return None
    dims, shape_len = static_dims(inputs[0]), static_dims(inputs[1])
    if dims is None or shape_len is None or len(shape_len) != 1 or tensor_dtype(inputs[1]) != "int64":
        return None
    n = shape_len[0]
    if n < len(dims):
        return None
    padded = relax.const(np.array([1] * (n - len(dims)) + dims, np.int64), "int64")
    one = relax.const(1, "int64")
    return [inputs[0], bb.normalize(relax.op.where(relax.op.equal(inputs[1], one), padded, inputs[1]))]


def conv_transpose_pads(inputs: list, attrs: dict) -> dict | None:
    """`output_shape` as the pads and output_padding ONNX derives from it (total = stride * (in - 1) +
    output_padding + (k - 1) * dilation + 1 - out; start = total - total // 2 unless SAME_UPPER); a negative
    end pad becomes output padding. None when there is nothing to derive."""
    if "output_shape" not in attrs:
        return None
    dims = static_dims(inputs[0])
    wdims = static_dims(inputs[1])
    if dims is None or wdims is None:
        return None
    spatial = len(dims) - 2
    out = list(attrs["output_shape"])[-spatial:]
    strides = list(attrs.get("strides", [1] * spatial))
    dil = list(attrs.get("dilations", [1] * spatial))
    opad = list(attrs.get("output_padding", [0] * spatial))
    auto = attrs.get("auto_pad", b"NOTSET")
    upper = (auto.decode() if isinstance(auto, bytes) else str(auto)) == "SAME_UPPER"
    begin, end = [0] * spatial, [0] * spatial
    for i in range(spatial):
        total = strides[i] * (dims[2 + i] - 1) + opad[i] + (wdims[2 + i] - 1) * dil[i] + 1 - int(out[i])
        begin[i] = total // 2 if upper else total - total // 2
        end[i] = total - begin[i]
        if begin[i] < 0:
            raise ValueError(f"ConvTranspose output_shape {out}: implies a negative leading pad")
        if end[i] < 0:
            opad[i] -= end[i]
            end[i] = 0
    new = {k: v for k, v in attrs.items() if k not in ("output_shape", "auto_pad")}
    new.update(pads=begin + end, output_padding=opad)
    return new


def batch_norm_training(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    """training_mode=1: normalised by the batch's mean and (population) variance; the running statistics
    as momentum * running + (1 - momentum) * batch, as ONNX's reference computes them."""
    if not int(attrs.get("training_mode", 0)):
        return None
    x, scale, bias, mean, var = inputs[:5]
    dims = static_dims(x)
    if dims is None or tensor_dtype(x) not in ("float32", "float64", "float16"):
        return None
    axes = [a for a in range(len(dims)) if a != 1]
    eps = float(attrs.get("epsilon", 1e-5))
    momentum = float(attrs.get("momentum", 0.9))
    dtype = tensor_dtype(x)
    batch_mean = relax.op.mean(x, axes)
    batch_var = relax.op.variance(x, axes)
    shape = [1, dims[1]] + [1] * (len(dims) - 2)
    c = lambda v: relax.const(np.asarray(v, dtype), dtype)  # noqa: E731
    inv = relax.op.divide(relax.op.reshape(scale, shape),
                          relax.op.sqrt(relax.op.add(relax.op.reshape(batch_var, shape), c(eps))))
    y = relax.op.add(relax.op.multiply(relax.op.subtract(x, relax.op.reshape(batch_mean, shape)), inv),
                     relax.op.reshape(bias, shape))
    running_mean = relax.op.add(relax.op.multiply(mean, c(momentum)), relax.op.multiply(batch_mean, c(1 - momentum)))
    running_var = relax.op.add(relax.op.multiply(var, c(momentum)), relax.op.multiply(batch_var, c(1 - momentum)))
    outputs = attrs.get("tvm_custom", {}).get("num_outputs", 1)
    return relax.Tuple([y, running_mean, running_var][:max(outputs, 1)])


def pow_(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    """The result has the base's type. A float base takes the exponent cast to it; an integer base is
    computed in float64 and truncated back (NumPy's integer power, exact for the values that fit)."""
    base, exponent = inputs
    bt, et = tensor_dtype(base), tensor_dtype(exponent)
    if bt is None or et is None or (bt == et and bt.startswith("float")):
        return None
    if bt.startswith(("float", "bfloat")):
        value = const_values(exponent)      # a constant stays one (power(x, 2) -> x * x matches constants)
        cast = relax.const(value.astype(bt)) if value is not None and bt != "bfloat16" else \
            relax.op.astype(exponent, bt)
        return relax.op.power(base, cast)
    wide = relax.op.power(relax.op.astype(base, "float64"), relax.op.astype(exponent, "float64"))
    return relax.op.astype(relax.op.trunc(wide), bt)


def one_hot(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    """indices == arange(depth) along `axis` (a negative index counts from depth; one out of range is a row
    of off values), then where(on, off): `values` may be a run-time tensor. `depth` must be a constant."""
    indices, depth, values = inputs
    depth_value = const_values(depth)
    dims = static_dims(indices)
    if depth_value is None or dims is None:
        return None
    d = int(depth_value.reshape(-1)[0])
    rank = len(dims) + 1
    axis = int(attrs.get("axis", -1)) % rank
    idx = relax.op.astype(indices, "int64")
    idx = relax.op.where(relax.op.less(idx, relax.const(0, "int64")), relax.op.add(idx, relax.const(d, "int64")), idx)
    idx = relax.op.expand_dims(idx, [axis])
    shape = [1] * rank
    shape[axis] = d
    positions = relax.op.reshape(relax.op.arange(0, d, 1, "int64"), shape)
    hot = relax.op.equal(idx, positions)
    off = relax.op.take(values, relax.const(0, "int64"), axis=0)
    on = relax.op.take(values, relax.const(1, "int64"), axis=0)
    return relax.op.where(hot, on, off)


def eye_like(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    dims = static_dims(inputs[0])
    if dims is None or len(dims) != 2:
        return None
    dtype = (onnx.helper.tensor_dtype_to_np_dtype(int(attrs["dtype"])).name if "dtype" in attrs
             else tensor_dtype(inputs[0]))
    return relax.op.eye(dims[0], dims[1], int(attrs.get("k", 0)), dtype)


def _reduce_axes(inputs: list, attrs: dict, rank: int) -> list[int] | None:
    """A Reduce*'s axes (from its constant input or attribute), or None when they are not known statically."""
    axes_value = const_values(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else None
    if axes_value is not None:
        return [int(a) % rank for a in axes_value.reshape(-1)]
    if "axes" in attrs:
        return [int(a) % rank for a in attrs["axes"]]
    if len(inputs) > 1 and inputs[1] is not None:
        return None
    return [] if int(attrs.get("noop_with_empty_axes", 0)) else list(range(rank))


def bool_extremum(kind: str) -> Callable[[relax.BlockBuilder, list, dict], relax.Expr | None]:
    """ReduceMax/ReduceMin of bool: any/all, computed as the max/min of uint8 and compared back (TVM failed in
    FoldConstant: no min_value for bool). A reduction over an axis of size 0 is legalised to its identity
    wherever it comes from (compiler/passes/legalize_fixes.py)."""
    def convert(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
        x = inputs[0]
        dims, dtype = static_dims(x), tensor_dtype(x)
        if dims is None or dtype != "bool":
            return None
        axes = _reduce_axes(inputs, attrs, len(dims))
        if axes is None:
            return None
        if not axes:
            return x
        keep = bool(int(attrs.get("keepdims", 1)))
        as_int = relax.op.astype(x, "uint8")
        reduced = (relax.op.max if kind == "max" else relax.op.min)(as_int, axes, keep)
        return relax.op.not_equal(reduced, relax.const(0, "uint8"))
    return convert


def constant(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    """Constant given by value_int / value_ints / value_float / value_floats (TVM reads `value` only)."""
    for name, dtype in (("value_int", "int64"), ("value_ints", "int64"), ("value_float", "float32"),
                        ("value_floats", "float32")):
        if name in attrs:      # the dtype spelled out: relax.const makes an int64 array int32 otherwise
            return relax.const(np.asarray(attrs[name], dtype=dtype), dtype)
    return None


def dropout_is_identity(inputs: list) -> bool:
    """Dropout at inference: no training_mode, a constant false one, or a constant ratio of 0 (the one test
    both the importer's removal of the op and `dropout_training` ask)."""
    training = inputs[2] if len(inputs) > 2 else None
    if training is None:
        return True
    fixed = const_values(training)
    ratio = const_values(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else None
    return (fixed is not None and not bool(fixed.reshape(()))) or \
        (ratio is not None and ratio.size == 1 and float(ratio.reshape(())) == 0.0)


def dropout_training(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    """Dropout whose training_mode is true or decided at run time: y = x * mask / (1 - ratio) with a bool mask
    (u >= ratio, u uniform in [0, 1) from a counter-based hash of the element's index and `seed`), the
    identity where training_mode is false at run time. Which elements drop is random by definition (ONNX
    Runtime's choice differs too); a ratio of 0 keeps every element, exactly. TVM's converter returned a
    float32 mask. The inference forms (no training_mode, a constant false, a constant ratio of 0) are
    compiler/frontend/importer.py's, which removes the op."""
    x = inputs[0]
    training = inputs[2] if len(inputs) > 2 else None
    ratio = inputs[1] if len(inputs) > 1 else None
    dtype = tensor_dtype(x)
    dims = static_dims(x)
    if dims is None or dtype is None or not dtype.startswith("float") or dropout_is_identity(inputs):
        return None
    if ratio is None:
        ratio = relax.const(0.5, "float32")
    seed = int(attrs.get("seed", 0)) & 0xFFFFFFFF

    def kernel(xt: te.Tensor, rt: te.Tensor, tt: te.Tensor) -> list[te.Tensor]:
        def uniform(*i: tirx.PrimExpr) -> tirx.PrimExpr:
            flat = tirx.const(0, "uint32")
            for axis, d in zip(i, dims):
                flat = flat * tirx.const(d, "uint32") + axis.astype("uint32")
            h = flat ^ tirx.const(seed, "uint32")
            for mult in (0x7FEB352D, 0x846CA68B):          # lowbias32 (Chris Wellons): a full-avalanche mixer
                h = (h ^ (h >> tirx.const(16, "uint32"))) * tirx.const(mult, "uint32")
            h = h ^ (h >> tirx.const(16, "uint32"))
            return (h >> tirx.const(8, "uint32")).astype("float32") * tirx.const(2.0 ** -24, "float32")

        r = rt().astype("float32")
        on = tt().astype("bool")
        keep = te.compute(xt.shape, lambda *i: tirx.Or(tirx.Not(on), uniform(*i) >= r), name="dropout_mask")
        one = tirx.const(1.0, "float32")
        scale = tirx.Select(on, one / (one - r), one)
        y = te.compute(xt.shape, lambda *i: tirx.Select(keep(*i), (xt(*i).astype("float32") * scale).astype(dtype),
                                                       tirx.const(0, dtype)), name="dropout")
        return [y, keep]

    out = bb.emit_te(kernel, x, ratio, training, primfunc_name_hint="dropout_training")
    y, mask = bb.normalize(relax.TupleGetItem(out, 0)), bb.normalize(relax.TupleGetItem(out, 1))
    outputs = attrs.get("tvm_custom", {}).get("num_outputs", 1)
    return relax.Tuple([y, mask] if outputs > 1 else [y])


_INT_RANGES = {"int8": (-128, 127), "uint8": (0, 255), "int16": (-32768, 32767), "uint16": (0, 65535)}


def _unblock(bb: relax.BlockBuilder, v: relax.Expr, axis: int, block: int, n: int) -> relax.Expr:
    """A blocked scale or zero point (dim ceil(n / block) on `axis`) repeated to `n` along it."""
    full = relax.op.repeat(v, block, axis)
    dims = static_dims(bb.normalize(full))
    if dims is not None and dims[axis] != n:
        full = relax.op.strided_slice(full, [axis], [0], [n])
    return bb.normalize(full)


def _blocked_operands(bb: relax.BlockBuilder, inputs: list, attrs: dict
                      ) -> tuple[relax.Expr, relax.Expr | None, int] | None:
    block = int(attrs.get("block_size", 0))
    dims = static_dims(inputs[0])
    if not block or dims is None:
        return None
    axis = int(attrs.get("axis", 1)) % len(dims)
    scale = _unblock(bb, inputs[1], axis, block, dims[axis])
    zero = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    if zero is not None:
        zero = _unblock(bb, zero, axis, block, dims[axis])
    return scale, zero, axis


def blocked_dequantize_linear(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    """Blocked DequantizeLinear (opset 21: one scale per `block_size` elements along `axis`) of an 8/16-bit
    integer: (x - zero_point) * scale with both repeated to full size. TVM refuses block_size."""
    operands = _blocked_operands(bb, inputs, attrs)
    if operands is None or tensor_dtype(inputs[0]) not in _INT_RANGES:
        return None
    scale, zero, _ = operands
    x = relax.op.astype(inputs[0], "float32")
    if zero is not None:
        x = relax.op.subtract(x, relax.op.astype(zero, "float32"))
    out = (onnx.helper.tensor_dtype_to_np_dtype(int(attrs["output_dtype"])).name
           if int(attrs.get("output_dtype", 0)) else tensor_dtype(inputs[1]))
    y = relax.op.multiply(x, relax.op.astype(scale, "float32") if tensor_dtype(scale) != "float32" else scale)
    return y if out == "float32" else relax.op.astype(y, out)


def blocked_quantize_linear(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    """Blocked QuantizeLinear to an 8/16-bit integer: clip(round_half_even(x / scale) + zero_point)."""
    operands = _blocked_operands(bb, inputs, attrs)
    if operands is None:
        return None
    scale, zero, _ = operands
    target = tensor_dtype(zero) if zero is not None else (
        onnx.helper.tensor_dtype_to_np_dtype(int(attrs["output_dtype"])).name
        if int(attrs.get("output_dtype", 0)) else "uint8")
    if target not in _INT_RANGES:
        return None
    lo, hi = _INT_RANGES[target]
    x = relax.op.astype(inputs[0], "float32") if tensor_dtype(inputs[0]) != "float32" else inputs[0]
    q = relax.op.round(relax.op.divide(x, relax.op.astype(scale, "float32") if tensor_dtype(scale) != "float32"
                                       else scale))
    if zero is not None:
        q = relax.op.add(q, relax.op.astype(zero, "float32"))
    clipped = relax.op.clip(q, relax.prim_value(tirx.FloatImm("float32", lo)),
                            relax.prim_value(tirx.FloatImm("float32", hi)))
    return relax.op.astype(clipped, target)


#: op type -> converter (None: TVM's converter)
CONVERTERS: dict[str, Callable[[relax.BlockBuilder, list, dict], relax.Expr | None]] = {
    "Mod": mod,
    "BitShift": bit_shift,
    "SpaceToDepth": space_to_depth,
    "BatchNormalization": batch_norm_training,
    "Pow": pow_,
    "OneHot": one_hot,
    "EyeLike": eye_like,
    "ReduceMax": bool_extremum("max"),
    "ReduceMin": bool_extremum("min"),
    "Constant": constant,
    "Dropout": dropout_training,
}
