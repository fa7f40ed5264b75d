"""ONNX's 4- and 2-bit types (INT4, UINT4, INT2, UINT2, FLOAT4E2M1), held one element per byte.

TVM 0.27 cannot pass a tensor of fewer than 8 bits across a function boundary ("dtype.bits % 8 == 0" when a
4-bit input is copied in; "arr_size == nbytes" when one is read back). So before import, `to_containers`
rewrites the model so that each such tensor lives in a byte: INT4/INT2 in int8 and UINT4/UINT2 in uint8
(the value itself, so every integer op is exact on it), FLOAT4E2M1 in uint8 (its 4-bit code, as ml_dtypes
stores it). The ops that define these types, Cast, CastLike, QuantizeLinear and DequantizeLinear, are
converted here as ml_dtypes and ONNX's reference compute them; any other op on a sub-byte tensor is refused
with its name. `CompiledModel.run` converts at the edge: an ml_dtypes input to its container, a container
output back to the ONNX type (`narrow_outputs`).

Semantics (ml_dtypes 0.5, which ONNX's reference casts with): a float cast to an N-bit integer truncates
toward zero and is 0 when that lies outside the type's range (NaN and Inf included); an integer cast wraps
modulo 2**N; QuantizeLinear rounds half to even, adds the zero point and clips to the range.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from tvm import relax, te, tirx

from . import narrow_floats
from ...errors import ModelError
from ...ir.helpers import tensor_dtype

#: ONNX type -> (bits, signed) for the sub-byte integers
INTEGERS: dict[int, tuple[int, bool]] = {
    TensorProto.INT4: (4, True), TensorProto.UINT4: (4, False),
    TensorProto.INT2: (2, True), TensorProto.UINT2: (2, False),
}
SUB_BYTE = frozenset(INTEGERS) | {TensorProto.FLOAT4E2M1}
#: ONNX type -> the container's ONNX type
CONTAINER = {TensorProto.INT4: TensorProto.INT8, TensorProto.INT2: TensorProto.INT8,
             TensorProto.UINT4: TensorProto.UINT8, TensorProto.UINT2: TensorProto.UINT8,
             TensorProto.FLOAT4E2M1: TensorProto.UINT8}
#: the node attributes `to_containers` leaves for the converters (the type a container holds)
SOURCE_ATTR, TARGET_ATTR = "fuseguard_source_type", "fuseguard_target_type"
_DEFINING_OPS = frozenset({"Cast", "CastLike", "QuantizeLinear", "DequantizeLinear"})


def ml_dtype(onnx_type: int) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(onnx_type))


def to_container(array: np.ndarray, onnx_type: int) -> np.ndarray:
    """An ml_dtypes sub-byte array as its container: integers by value, FLOAT4E2M1 by its code."""
    if onnx_type == TensorProto.FLOAT4E2M1:
        return np.ascontiguousarray(array).view(np.uint8)
    return np.asarray(array).astype(ml_dtype(CONTAINER[onnx_type]))


def from_container(array: np.ndarray, onnx_type: int) -> np.ndarray:
    if onnx_type == TensorProto.FLOAT4E2M1:
        return np.ascontiguousarray(array, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn)
    return np.asarray(array).astype(ml_dtype(onnx_type))


def container_input(array: np.ndarray) -> np.ndarray:
    """What the compiled function takes for an input array: sub-byte ml_dtypes arrays in their container."""
    for onnx_type in SUB_BYTE:
        if array.dtype == ml_dtype(onnx_type):
            return to_container(array, onnx_type)
    return array


def output_types(model: onnx.ModelProto) -> dict[int, int]:
    """Output index -> ONNX type, for the outputs of a sub-byte type (returned in their container)."""
    return {i: o.type.tensor_type.elem_type for i, o in enumerate(model.graph.output)
            if o.type.tensor_type.elem_type in SUB_BYTE}


def uses_sub_byte(model: onnx.ModelProto) -> bool:
    g = model.graph
    return any(vi.type.tensor_type.elem_type in SUB_BYTE for vi in [*g.input, *g.output, *g.value_info]) or \
        any(t.data_type in SUB_BYTE for t in g.initializer) or \
        any(a.name in ("to", "output_dtype") and a.i in SUB_BYTE for n in g.node for a in n.attribute)


def to_containers(model: onnx.ModelProto, label: str) -> onnx.ModelProto:
    """A copy of `model` with every sub-byte tensor in its byte container, the defining ops annotated with the
    type their container input or output holds; `model` itself when it has none."""
    if not uses_sub_byte(model):
        return model
    m = onnx.ModelProto.FromString(model.SerializeToString())
    g = m.graph
    types: dict[str, int] = {}
    for vi in [*g.input, *g.output, *g.value_info]:
        t = vi.type.tensor_type
        if t.elem_type in SUB_BYTE:
            types[vi.name] = t.elem_type
            t.elem_type = CONTAINER[t.elem_type]
    for i, init in enumerate(g.initializer):
        if init.data_type in SUB_BYTE:
            types[init.name] = init.data_type
            g.initializer[i].CopyFrom(numpy_helper.from_array(to_container(numpy_helper.to_array(init),
                                                                              init.data_type), init.name))
    for node in g.node:
        what = f"{label}: node '{node.name or node.output[0]}' ({node.op_type})"
        attrs = {a.name: a for a in node.attribute}
        source = types.get(node.input[0]) if node.input else None
        target = None
        if node.op_type == "Cast":
            target = attrs["to"].i if attrs["to"].i in SUB_BYTE else None
        elif node.op_type == "CastLike" and len(node.input) > 1:
            target = types.get(node.input[1])
        elif node.op_type == "QuantizeLinear":
            zero = types.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
            target = zero or (attrs["output_dtype"].i if "output_dtype" in attrs and
                              attrs["output_dtype"].i in SUB_BYTE else None)
        elif node.op_type == "DequantizeLinear":
            pass
        elif any(i in types for i in node.input):
            raise ModelError(f"{what} reads a 4- or 2-bit tensor; fuseguard holds those only at Cast, CastLike, "
                             "QuantizeLinear and DequantizeLinear")
        if node.op_type in _DEFINING_OPS:
            if source is not None:
                node.attribute.append(onnx.helper.make_attribute(SOURCE_ATTR, source))
            if target is not None:
                node.attribute.append(onnx.helper.make_attribute(TARGET_ATTR, target))
                types[node.output[0]] = target
    return m


# ------------------------------------------------------------------------------------------ converters

def _int_cast(value: tirx.PrimExpr, source: str, onnx_type: int) -> tirx.PrimExpr:
    """One element to the N-bit integer, in its container's dtype."""
    bits, signed = INTEGERS[onnx_type]
    container = "int8" if signed else "uint8"
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    if source.startswith(("float", "bfloat")):
        v = value.astype("float32") if source != "float64" else value
        t = tirx.trunc(v)
        # NaN fails both compares as a value, but fast-math may fold them: test it from the bits too
        wide = "float64" if source == "float64" else "float32"
        ubits = "uint64" if wide == "float64" else "uint32"
        exp_all_ones = (0x7FF << 52) if wide == "float64" else (0xFF << 23)
        finite = (tirx.reinterpret(ubits, v) & tirx.const(exp_all_ones, ubits)) != tirx.const(exp_all_ones, ubits)
        inside = tirx.And(finite, tirx.And(t >= tirx.const(lo, wide), t <= tirx.const(hi, wide)))
        return tirx.Select(inside, t, tirx.const(0, wide)).astype(container)
    v = value.astype("int64")
    masked = v & tirx.const((1 << bits) - 1, "int64")
    if signed:
        half = tirx.const(1 << (bits - 1), "int64")
        masked = (masked ^ half) - half                          # sign-extend the low N bits
    return masked.astype(container)


def _to(bb: relax.BlockBuilder, x: relax.Expr, source_type: int | None, onnx_type: int) -> relax.Expr:
    """`x` (of ONNX type `source_type` when it is a container) cast to the sub-byte `onnx_type`."""
    if source_type == TensorProto.FLOAT4E2M1:
        x, source_type = _from_float4(bb, x, "float32"), None
    source = tensor_dtype(x)
    if onnx_type == TensorProto.FLOAT4E2M1:
        return bb.emit_te(lambda t: te.compute(t.shape, lambda *i: narrow_floats.encode(
            t(*i).astype("float32"), narrow_floats.FLOAT4, saturate=True), name="to_float4"),
            x, primfunc_name_hint="cast_to_float4")
    if source == "bool":
        return relax.op.astype(x, "int8" if INTEGERS[onnx_type][1] else "uint8")
    return bb.emit_te(lambda t: te.compute(t.shape, lambda *i: _int_cast(t(*i), source, onnx_type),
                                           name="to_subbyte"), x, primfunc_name_hint="cast_to_subbyte")


def _from_float4(bb: relax.BlockBuilder, x: relax.Expr, target: str) -> relax.Expr:
    def value(t: te.Tensor) -> te.Tensor:
        def one(*i: tirx.PrimExpr) -> tirx.PrimExpr:
            v = narrow_floats.decode(t(*i), narrow_floats.FLOAT4)
            return v if target == "float32" else v.astype(target)
        return te.compute(t.shape, one, name="from_float4")
    return bb.emit_te(value, x, primfunc_name_hint="cast_from_float4")


def _from(bb: relax.BlockBuilder, x: relax.Expr, source_type: int, target: str) -> relax.Expr:
    """A container of `source_type` cast to the (not sub-byte) dtype `target`."""
    if source_type == TensorProto.FLOAT4E2M1:
        if target in narrow_floats.BY_DTYPE:
            return narrow_floats.to_narrow(bb, _from_float4(bb, x, "float32"), narrow_floats.BY_DTYPE[target], True)
        return _from_float4(bb, x, target)
    if target in narrow_floats.BY_DTYPE:
        return narrow_floats.to_narrow(bb, relax.op.astype(x, "float32"), narrow_floats.BY_DTYPE[target], True)
    return relax.op.astype(x, target)        # the container holds the value itself: exact


def _attr(attrs: dict, name: str) -> int | None:
    return int(attrs[name]) if name in attrs else None


def cast(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    source = _attr(attrs, SOURCE_ATTR)
    to = int(attrs["to"]) if "to" in attrs else None
    if to in SUB_BYTE:
        return _to(bb, inputs[0], source, to)
    if source is not None:
        return _from(bb, inputs[0], source, onnx.helper.tensor_dtype_to_np_dtype(to).name
                     if to != TensorProto.BFLOAT16 else "bfloat16")
    return None


def cast_like(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    source, target = _attr(attrs, SOURCE_ATTR), _attr(attrs, TARGET_ATTR)
    if target is not None:
        return _to(bb, inputs[0], source, target)
    if source is not None:
        return _from(bb, inputs[0], source, tensor_dtype(inputs[1]))
    return None


def quantize_linear(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    """To an N-bit integer: clip(round_half_even(x / scale) + zero_point) into the range; to FLOAT4E2M1:
    x / scale + zero_point, cast (the reference adds the float4 zero point, decoded)."""
    target = _attr(attrs, TARGET_ATTR)
    if target is None:
        return None
    if int(attrs.get("block_size", 0)):
        raise ValueError("blocked QuantizeLinear to a 4- or 2-bit type is not supported")
    x, scale = inputs[0], inputs[1]
    zero = inputs[2] if len(inputs) > 2 else None
    axis = int(attrs.get("axis", 1))
    if tensor_dtype(scale) != "float32":
        scale = bb.normalize(relax.op.astype(scale, "float32"))
    xf = x if tensor_dtype(x) == "float32" else bb.normalize(relax.op.astype(x, "float32"))
    scaled = relax.op.divide(xf, narrow_floats.per_axis(scale, xf, axis, "y_scale"))
    if target == TensorProto.FLOAT4E2M1:
        if zero is not None:
            z = bb.normalize(_from_float4(bb, zero, "float32"))
            scaled = relax.op.add(scaled, narrow_floats.per_axis(z, xf, axis, "y_zero_point"))
        return _to(bb, bb.normalize(scaled), None, target)
    bits, signed = INTEGERS[target]
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    q = relax.op.round(scaled)
    if zero is not None:
        z = bb.normalize(relax.op.astype(zero, "float32"))
        q = relax.op.add(q, narrow_floats.per_axis(z, xf, axis, "y_zero_point"))
    clipped = relax.op.clip(q, relax.prim_value(tirx.FloatImm("float32", lo)),
                            relax.prim_value(tirx.FloatImm("float32", hi)))
    return relax.op.astype(clipped, "int8" if signed else "uint8")


def dequantize_linear(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr | None:
    """From FLOAT4E2M1: decoded times the scale (no zero point subtracted, as the reference); the integer
    containers go to TVM's converter, which is exact on them."""
    if _attr(attrs, SOURCE_ATTR) != TensorProto.FLOAT4E2M1:
        return None
    if int(attrs.get("block_size", 0)):
        raise ValueError("blocked DequantizeLinear from FLOAT4E2M1 is not supported")
    x, scale = inputs[0], inputs[1]
    out = (onnx.helper.tensor_dtype_to_np_dtype(int(attrs["output_dtype"])).name
           if int(attrs.get("output_dtype", 0)) else tensor_dtype(scale))
    if tensor_dtype(scale) != "float32":
        scale = bb.normalize(relax.op.astype(scale, "float32"))
    decoded = bb.normalize(_from_float4(bb, x, "float32"))
    product = relax.op.multiply(decoded, narrow_floats.per_axis(scale, decoded, int(attrs.get("axis", 1)), "x_scale"))
    return product if out == "float32" else relax.op.astype(product, out)
