"""Converters for ONNX operators TVM's frontend has none for (each against ONNX's reference implementation,
onnx/reference/ops). `CONVERTERS` maps the op type to `convert(inputs, attrs) -> relax.Expr`; a converter
raises ValueError for what it cannot convert, and the importer names the node in its one-line error.

RotaryEmbedding (opset 23) is what LLM exports carry; Swish, SwiGLU (24) and Celu are activations;
LpNormalization a reduction; CumProd TVM has a Relax op for but no converter; QLinearMatMul the int8 matmul
of ONNX Runtime's quantiser (QOperator format); the window functions of audio front ends (their size a
constant); BitCast. `OVERRIDES` replace TVM's converter where it is wrong or cannot compile (Cosh/Sinh: no
LLVM intrinsic; RMSNormalization over every axis: fails in FoldConstant).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from tvm import relax, te, tirx

from . import narrow_floats, rnn as onnx_rnn, semantics as onnx_semantics, subbyte
from ...ir.helpers import const_values, static_dims


def _scalar(value: float, like: relax.Expr | str) -> relax.Expr:
    """A scalar constant of `like`'s dtype (a normalised expression's, or the dtype itself: an expression
    just built is not normalised and has no dtype yet)."""
    dtype = like if isinstance(like, str) else str(like.ty.dtype)
    if dtype == "bfloat16":
        return relax.op.astype(relax.const(np.float32(value)), dtype)
    return relax.const(np.asarray(value, dtype=dtype), dtype)


def _const_int(x: object, what: str) -> int:
    arr = const_values(x)
    if arr is None or arr.size != 1:
        raise ValueError(f"{what} must be a constant scalar")
    return int(arr.reshape(()))


def _const_ints(x: object, what: str) -> list[int]:
    arr = const_values(x)
    if arr is None:
        raise ValueError(f"{what} must be a constant")
    return [int(v) for v in arr.reshape(-1)]


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


def center_crop_pad(inputs: list, attrs: dict) -> relax.Expr:
    """Crop (start (dim - size) // 2) or zero-pad (before (size - dim) // 2) each axis to `shape`."""
    x = inputs[0]
    dims = static_dims(x)
    if dims is None:
        raise ValueError("the input needs a static shape")
    shape = _const_ints(inputs[1], "shape")
    axes = [int(a) % len(dims) for a in attrs.get("axes", range(len(dims)))]
    pads = [0] * (2 * len(dims))
    for axis, size in zip(axes, shape):
        dim = dims[axis]
        if size < dim:
            start = (dim - size) // 2
            x = relax.op.strided_slice(x, [axis], [start], [start + size])
        elif size > dim:
            pads[2 * axis], pads[2 * axis + 1] = (size - dim) // 2, size - dim - (size - dim) // 2
    return relax.op.nn.pad(x, pads) if any(pads) else x


def tensor_scatter(inputs: list, attrs: dict) -> relax.Expr:
    """The KV-cache update (opset 24): `update` written into `past_cache` along `axis` from each batch's
    write index (mode "circular": wrapping at the cache length). Each cache position p reads update[p - w]
    where 0 <= p - w < S, else keeps the cache."""
    past, update = inputs[0], inputs[1]
    write = inputs[2] if len(inputs) > 2 else None
    cdims, udims = static_dims(past), static_dims(update)
    if cdims is None or udims is None:
        raise ValueError("the cache and the update need static shapes")
    rank = len(cdims)
    axis = int(attrs.get("axis", -2)) % rank
    length, seq = cdims[axis], udims[axis]
    mode = attrs.get("mode", b"linear")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    pos = relax.const(np.arange(length, dtype="int64").reshape([length if i == axis else 1 for i in range(rank)]),
                      "int64")
    if write is None:
        rel = pos
    else:
        w = relax.op.reshape(relax.op.astype(write, "int64"), [cdims[0]] + [1] * (rank - 1))
        rel = relax.op.subtract(pos, w)
        if mode == "circular":
            rel = relax.op.floor_mod(rel, relax.const(length, "int64"))
    valid = relax.op.logical_and(relax.op.greater_equal(rel, relax.const(0, "int64")),
                                 relax.op.less(rel, relax.const(seq, "int64")))
    index = relax.op.broadcast_to(relax.op.clip(rel, 0, seq - 1), cdims)
    taken = relax.op.gather_elements(update, index, axis=axis)
    return relax.op.where(relax.op.broadcast_to(valid, cdims), taken, past)


def _window(kind: str) -> Callable[[list, dict], relax.Expr]:
    def convert(inputs: list, attrs: dict) -> relax.Expr:
        size = _const_int(inputs[0], "size")
        dtype = onnx.helper.tensor_dtype_to_np_dtype(int(attrs.get("output_datatype", onnx.TensorProto.FLOAT)))
        n = np.arange(size, dtype=np.float64)
        period = size if int(attrs.get("periodic", 1)) == 1 else size - 1
        if kind == "hann":
            w = np.sin(n * np.pi / period) ** 2
        elif kind == "hamming":
            alpha = 25.0 / 46.0
            w = alpha - np.cos(n * np.pi * 2 / period) * (1 - alpha)
        else:
            w = 0.42 - 0.5 * np.cos(n * np.pi * 2 / period) + 0.08 * np.cos(n * np.pi * 4 / period)
        return relax.const(w.astype(dtype), np.dtype(dtype).name)
    return convert


def qlinear_matmul(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr:
    """As ONNX's reference: the int32 product of the zero-point-shifted operands, times
    a_scale * b_scale / y_scale (in the scales' type), in float64; plus y's zero point, rounded half to
    even and saturated."""
    a, sa, za, b, sb, zb, sy, zy = (inputs[i] if len(inputs) > i else None for i in range(8))

    def shifted(q: relax.Expr, zero: relax.Expr | None) -> relax.Expr:
        q32 = relax.op.astype(q, "int32")
        return q32 if zero is None else relax.op.subtract(q32, relax.op.astype(zero, "int32"))

    product = relax.op.matmul(shifted(a, za), shifted(b, zb), out_dtype="int32")
    multiplier = relax.op.divide(relax.op.multiply(sa, sb), sy)
    d = relax.op.multiply(relax.op.astype(product, "float64"), relax.op.astype(multiplier, "float64"))
    out_dtype = str((zy if zy is not None else a).ty.dtype)
    if zy is not None:
        d = relax.op.add(d, relax.op.astype(zy, "float64"))
    info = np.iinfo(out_dtype)
    # np.rint: tirx.nearbyint (ties to even), as the QuantizeLinear legalisation rounds (compiler/passes/qdq.py)
    rounded = bb.call_te(lambda t: te.compute(t.shape, lambda *i: tirx.nearbyint(t(*i)), name="rint"),
                         bb.normalize(d), primfunc_name_hint="rint")
    clipped = relax.op.clip(rounded, float(info.min), float(info.max))
    return relax.op.astype(clipped, out_dtype)


def cosh_sinh(kind: str) -> Callable[[list, dict], relax.Expr]:
    def convert(inputs: list, attrs: dict) -> relax.Expr:
        x = inputs[0]
        e, inv = relax.op.exp(x), relax.op.exp(relax.op.negative(x))
        both = relax.op.add(e, inv) if kind == "cosh" else relax.op.subtract(e, inv)
        return relax.op.multiply(both, _scalar(0.5, x))
    return convert


def rms_normalization(inputs: list, attrs: dict) -> relax.Expr | None:
    """Over every axis (axis 0): TVM's rms_norm then fails in FoldConstant; written out as the reference
    does (mean of squares in stash_type float32, then the scale). Other axes: TVM's converter (None)."""
    x, scale = inputs[0], inputs[1]
    dims = static_dims(x)
    if dims is None or int(attrs.get("axis", -1)) % len(dims) != 0:
        return None
    dtype = str(x.ty.dtype)
    x32 = relax.op.astype(x, "float32") if dtype != "float32" else x
    axes = list(range(len(dims)))
    mean = relax.op.mean(relax.op.multiply(x32, x32), axes, keepdims=True)
    eps = relax.const(np.float32(attrs.get("epsilon", 1e-5)))
    y = relax.op.divide(x32, relax.op.sqrt(relax.op.add(mean, eps)))
    y = relax.op.astype(y, dtype) if dtype != "float32" else y
    return relax.op.multiply(y, scale)


def bitcast(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr:
    x = inputs[0]
    target = onnx.helper.tensor_dtype_to_np_dtype(int(attrs["to"])).name
    source = str(x.ty.dtype)
    if np.dtype(source if source != "bool" else "bool").itemsize != np.dtype(target).itemsize:
        raise ValueError(f"BitCast from {source} to {target}: the bit widths differ")
    return bb.call_te(lambda t: te.compute(t.shape, lambda *i: tirx.reinterpret(target, t(*i)), name="bitcast"),
                      x, primfunc_name_hint="bitcast")


def resize_inputs(inputs: list, attrs: dict) -> tuple[list, dict]:
    """Resize's `axes` and `keep_aspect_ratio_policy` (opset 18), which TVM's converter ignores (it then read
    a per-axis `sizes` as a full-rank one and failed), folded into full-rank constant scales or sizes as
    ONNX's reference computes them; the rest is TVM's converter."""
    policy = attrs.get("keep_aspect_ratio_policy", b"stretch")
    policy = policy.decode() if isinstance(policy, bytes) else str(policy)
    scales = const_values(inputs[2]) if len(inputs) > 2 else None
    sizes = const_values(inputs[3]) if len(inputs) > 3 else None
    if scales is not None and scales.size == 0 and len(inputs) > 3 and inputs[3] is not None:
        # an empty `scales` beside `sizes` (as exporters write it) means "no scales": TVM asserts on both
        inputs = [*inputs[:2], None, *inputs[3:]]
        scales = None
    if "axes" not in attrs and policy == "stretch":
        return inputs, attrs
    dims = static_dims(inputs[0])
    if dims is None or (scales is None and sizes is None) or (scales is not None and scales.size == 0 and sizes is None):
        return inputs, attrs
    rank = len(dims)
    axes = [int(a) % rank for a in attrs.get("axes", range(rank))]
    out = list(inputs) + [None] * (4 - len(inputs))
    if sizes is not None and sizes.size:
        full = list(dims)
        for i, a in enumerate(axes):
            full[a] = int(sizes[i])
        if policy != "stretch":
            ratios = [full[a] / dims[a] for a in axes]
            scale = min(ratios) if policy == "not_larger" else max(ratios)
            full = [int(scale * dims[i] + 0.5) if i in axes else dims[i] for i in range(rank)]
            if any(abs(full[a] / dims[a] - scale) > 1e-6 for a in axes):
                # TVM samples at output / input size per axis; the policy samples at `scale` on every axis
                raise ValueError(f"keep_aspect_ratio_policy={policy}: the rounded sizes {full} do not keep the "
                                 f"common scale {scale:.6g}, which TVM's resize cannot sample at")
        out[2], out[3] = None, relax.const(np.asarray(full, dtype="int64"), "int64")
    else:
        full_scales = [1.0] * rank
        for i, a in enumerate(axes):
            full_scales[a] = float(scales[i])
        out[2] = relax.const(np.asarray(full_scales, dtype="float32"), "float32")
    attrs = {k: v for k, v in attrs.items() if k not in ("axes", "keep_aspect_ratio_policy")}
    return out, attrs


def dft(inputs: list, attrs: dict) -> relax.Expr:
    """DFT (opset 17/20) as matmuls with cos/sin tables (float64-computed constants): forward and inverse,
    onesided (rfft, and irfft: a one-sided spectrum to a real signal, as numpy's irfft), dft_length padding or
    truncating. O(N^2) per signal: for the short windows of audio front ends, where a matmul is fast."""
    x = inputs[0]
    dims = static_dims(x)
    if dims is None:
        raise ValueError("DFT needs a static input shape")
    length = _const_int(inputs[1], "dft_length") if len(inputs) > 1 and inputs[1] is not None else None
    if len(inputs) > 2 and inputs[2] is not None:
        axis = _const_int(inputs[2], "axis")
    else:       # an attribute up to opset 19 (default 1), an input from 20 (default -2)
        axis = int(attrs.get("axis", 1 if int(attrs.get("_opset", 20)) < 20 else -2))
    rank = len(dims)
    axis %= rank
    if axis == rank - 1:
        raise ValueError("DFT axis is the real/imaginary axis")
    inverse, onesided = bool(int(attrs.get("inverse", 0))), bool(int(attrs.get("onesided", 0)))
    n_in = dims[axis]
    if length is None:
        length = 2 * (n_in - 1) if inverse and onesided else n_in
    dtype = str(x.ty.dtype)

    def part(k: int) -> relax.Expr:
        v = relax.op.squeeze(relax.op.strided_slice(x, [rank - 1], [k], [k + 1]), [rank - 1])
        return relax.op.permute_dims(v, [d for d in range(rank - 1) if d != axis] + [axis])   # signal last

    real = part(0)
    imag = part(1) if dims[-1] == 2 else None
    if inverse and onesided:                            # irfft: Hermitian half-spectrum -> real signal
        m = min(n_in, length // 2 + 1)
        k = np.arange(m)[:, None].astype(np.float64)
        n = np.arange(length)[None, :]
        weight = np.where((k == 0) | ((length % 2 == 0) & (k == length // 2)), 1.0, 2.0)
        cos = weight * np.cos(2 * np.pi * k * n / length) / length
        sin = -weight * np.sin(2 * np.pi * k * n / length) / length
        cut = lambda v: relax.op.strided_slice(v, [rank - 2], [0], [m]) if n_in > m else v  # noqa: E731
        out = relax.op.matmul(cut(real), relax.const(cos.astype(dtype), dtype))
        if imag is not None:
            out = relax.op.add(out, relax.op.matmul(cut(imag), relax.const(sin.astype(dtype), dtype)))
        parts = [out]
    else:
        used = min(n_in, length)                        # numpy pads with zeros (or truncates) to dft_length
        freqs = length // 2 + 1 if onesided else length
        n = np.arange(used)[:, None].astype(np.float64)
        k = np.arange(freqs)[None, :]
        cos, sin = np.cos(2 * np.pi * n * k / length), np.sin(2 * np.pi * n * k / length)
        scale = 1.0 / length if inverse else 1.0
        sign = 1.0 if inverse else -1.0                 # e^{sign 2 pi i n k / L}
        c = relax.const((cos * scale).astype(dtype), dtype)
        s_ = relax.const((sin * scale * sign).astype(dtype), dtype)
        cut = (lambda v: relax.op.strided_slice(v, [rank - 2], [0], [used])) if n_in > used else (lambda v: v)
        re, im = cut(real), (cut(imag) if imag is not None else None)
        # (re + i im)(cos + i s) = re cos - im s + i (re s + im cos)
        out_re = relax.op.matmul(re, c)
        out_im = relax.op.matmul(re, s_)
        if im is not None:
            out_re = relax.op.subtract(out_re, relax.op.matmul(im, s_))
            out_im = relax.op.add(out_im, relax.op.matmul(im, c))
        parts = [out_re, out_im]
    order = [d for d in range(rank - 1) if d != axis] + [axis]
    back = [order.index(d) for d in range(rank - 1)]
    parts = [relax.op.expand_dims(relax.op.permute_dims(v, back), [rank - 1]) for v in parts]
    return parts[0] if len(parts) == 1 else relax.op.concat(parts, axis=rank - 1)


def reverse_sequence(inputs: list, attrs: dict) -> relax.Expr:
    """ReverseSequence: each batch entry's first sequence_lens[b] steps along time_axis reversed, the rest
    kept (a gather along the time axis with per-batch indices; lengths may be a run-time tensor)."""
    x, lens = inputs
    dims = static_dims(x)
    if dims is None:
        raise ValueError("ReverseSequence needs a static input shape")
    batch_axis, time_axis = int(attrs.get("batch_axis", 1)), int(attrs.get("time_axis", 0))
    rank, steps = len(dims), dims[time_axis]
    shape_t = [1] * rank
    shape_t[time_axis] = steps
    shape_b = [1] * rank
    shape_b[batch_axis] = dims[batch_axis]
    t = relax.const(np.arange(steps, dtype=np.int64).reshape(shape_t), "int64")
    length = relax.op.reshape(relax.op.astype(lens, "int64"), shape_b)
    last = relax.op.subtract(length, relax.const(1, "int64"))
    index = relax.op.where(relax.op.less(t, length), relax.op.subtract(last, t), t)
    return relax.op.gather_elements(x, relax.op.broadcast_to(index, dims), axis=time_axis)


#: converters that need the block builder (they emit a PrimFunc of their own)
BUILDER_CONVERTERS: dict[str, Callable[[relax.BlockBuilder, list, dict], relax.Expr]] = {
    "BitCast": bitcast,
    "QLinearMatMul": qlinear_matmul,
    **onnx_rnn.CONVERTERS,          # LSTM, GRU, RNN (compiler/frontend/converters/rnn.py)
}

#: TVM has a converter, but it is wrong or does not compile for these: ours first, None falls back to TVM's
OVERRIDES: dict[str, Callable[[list, dict], relax.Expr | None]] = {
    "Cosh": cosh_sinh("cosh"),
    "Sinh": cosh_sinh("sinh"),
    "RMSNormalization": rms_normalization,
}

#: the same, for converters that need the block builder: 8-bit floats (compiler/frontend/converters/narrow_floats.py), 4- and
#: 2-bit types (compiler/frontend/converters/subbyte.py), ONNX semantics TVM gets wrong (compiler/frontend/converters/semantics.py)
def _first(*converters: Callable[[relax.BlockBuilder, list, dict], relax.Expr | None]
           ) -> Callable[[relax.BlockBuilder, list, dict], relax.Expr | None]:
    """The first converter's result that is not None."""
    def convert(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
        for c in converters:
            out = c(bb, inputs, attrs)
            if out is not None:
                return out
        return None
    return convert


BUILDER_OVERRIDES: dict[str, Callable[[relax.BlockBuilder, list, dict], relax.Expr | None]] = {
    "Cast": _first(subbyte.cast, narrow_floats.cast),
    "CastLike": _first(subbyte.cast_like, narrow_floats.cast_like),
    "QuantizeLinear": _first(onnx_semantics.blocked_quantize_linear, subbyte.quantize_linear,
                             narrow_floats.quantize_linear),
    "DequantizeLinear": _first(onnx_semantics.blocked_dequantize_linear, subbyte.dequantize_linear,
                               narrow_floats.dequantize_linear),
    **onnx_semantics.CONVERTERS,
}

CONVERTERS: dict[str, Callable[[list, dict], relax.Expr]] = {
    "RotaryEmbedding": rotary_embedding,
    "Swish": swish,
    "SwiGLU": swiglu,
    "Celu": celu,
    "LpNormalization": lp_normalization,
    "CumProd": cumprod,
    "HannWindow": _window("hann"),
    "HammingWindow": _window("hamming"),
    "BlackmanWindow": _window("blackman"),
    "CenterCropPad": center_crop_pad,
    "TensorScatter": tensor_scatter,
    "DFT": dft,
    "ReverseSequence": reverse_sequence,
}
