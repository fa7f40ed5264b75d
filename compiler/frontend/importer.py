"""ONNX -> Relax import, with provenance and a shape-folding retry.

Provenance: every Relax binding that an ONNX node's converter produces is bound to a var
named `n<index>` so that, after fusion, a fused group can name the ONNX nodes it came from
(`provenance_of`). Var names survive FuseOpsByPattern, LegalizeOps and FuseOps.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as _frontend

from .converters import attention as onnx_attention, ops as onnx_ops, semantics as onnx_semantics, subbyte
from ..ir import tags
from ..dynamic import DynamicDim, check_names, symbolic_shapes, upper_bounds
from ..errors import ModelError, UnsupportedOperatorError
from .loader import LoadedModel, error_line
from .op_support import DEFAULT_DOMAINS as _DEFAULT_DOMAINS
from ..ir.helpers import static_dims
from .op_support import check_supported, supported_ops

#: What may not appear in a C identifier (an input name becomes one: see _Importer._sanitize_name).
_IDENTIFIER_BAD = re.compile(r"[^0-9A-Za-z_]")


@dataclass
class ImportResult:
    mod: tvm.IRModule
    node_names: list[str]        # index -> ONNX node name, for the tags `n<index>`
    node_ops: list[str]          # index -> ONNX op_type
    prepared: bool               # True when the shape-folding retry was needed


#: The bound assumed for a dynamic dim given without one (``seq`` rather than ``seq<=N``): far below int64's
#: maximum, so that min(2^63 - 1, seq) simplifies to seq.
_UNBOUNDED_DIM = 2**62


def _bounded_analyzer(dim_bounds: Mapping[tvm.tirx.Var, int | None]) -> "tvm.sym.Analyzer":
    """An analyzer that knows each dynamic dim is >= 1 and at most its bound."""
    from tvm.sym import Analyzer, ConstIntBound

    analyzer = Analyzer()
    for var, upper in dim_bounds.items():
        analyzer.update(var, ConstIntBound(1, upper if upper is not None else _UNBOUNDED_DIM), override=True)
    return analyzer


def _shape_lost(bb: relax.BlockBuilder, sym: object) -> bool:
    """True for a tensor result whose rank is known and its shape not (a converter could not prove its
    inputs' symbolic extents equal)."""
    if not isinstance(sym, relax.Expr) or isinstance(sym, relax.ShapeExpr):
        return False
    ty = bb.normalize(sym).ty
    return isinstance(ty, relax.TensorType) and ty.shape is None and ty.ndim > 0


class _TracingImporter(_frontend.ONNXGraphImporter):
    """The stock importer, binding each converted node's result to a var tagged with its index."""

    def __init__(self, *args, node_index: dict[str, int], shape_ok: frozenset[str] = frozenset(),
                 dim_bounds: Mapping[tvm.tirx.Var, int | None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._node_index = node_index
        self._shape_ok = shape_ok
        self._analyzer = _bounded_analyzer(dim_bounds) if dim_bounds else None

    def _convert_operator(self, op_name, inputs, attrs, opset):  # noqa: ANN001 - frontend signature
        # The stock method normalises the converter's result, which binds multi-output ops (BatchNorm's
        # tuple) to anonymous vars; tag first, then normalise (same converter lookup as the original).
        sym = self._convert(op_name, inputs, attrs, opset)
        if self._analyzer is not None and _shape_lost(self.bb, sym):
            settled = [self._settle(x) for x in inputs]
            if any(a is not b for a, b in zip(settled, inputs)):
                sym = self._convert(op_name, settled, attrs, opset)
        index = self._node_index.get(attrs.get("tvm_custom", {}).get("name", ""))
        if index is not None and isinstance(sym, relax.Expr):
            sym = self._tag(sym, tags.tag(index, op_name), [])
        return self.bb.normalize(sym) if isinstance(sym, relax.Expr) else sym

    def _settle(self, x: object) -> object:
        """``x`` reshaped to its shape simplified under the dynamic dims' bounds (each >= 1, <= its --dynamic
        bound), or ``x`` itself where that changes nothing. MobileBERT's trigram embedding concatenates
        x[:, 1:] padded by one, x, and x[:, :-1] padded by one: extents min(2^63 - 1, seq) + 1 - min(1, seq),
        seq and min(max(seq - 1, 0), seq) + 1, equal for every seq >= 1 but not provably so without the
        bound, so Concat's result had no shape and the next Shape -> Gather failed to import. The reshape is
        a view, checked at run time (element counts); a match_cast in its place segfaulted in TVM's
        RemoveRedundantReshape and later in the `dce` stage."""
        ty = getattr(x, "ty", None) if isinstance(x, relax.Expr) and not isinstance(x, relax.ShapeExpr) else None
        if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
            return x
        values = list(ty.shape.values)
        simple = [self._analyzer.simplify(v) for v in values]
        if all(tvm_ffi.structural_equal(a, b) for a, b in zip(values, simple)):
            return x
        return self.bb.normalize(relax.op.reshape(x, simple))

    def _convert(self, op_name, inputs, attrs, opset):  # noqa: ANN001 - frontend signature
        """The converter's result for one node (fuseguard's own where it has one), not yet tagged."""
        convert_map = _frontend._get_convert_map()
        if op_name in onnx_ops.BUILDER_CONVERTERS and op_name not in convert_map:
            sym = onnx_ops.BUILDER_CONVERTERS[op_name](self.bb, inputs, attrs)
        elif op_name in onnx_ops.CONVERTERS and op_name not in convert_map:
            # an op TVM has no converter for; `_opset` for defaults that changed between versions (DFT's axis)
            sym = onnx_ops.CONVERTERS[op_name](inputs, {**attrs, "_opset": opset})
        elif op_name not in convert_map:
            raise UnsupportedOperatorError(f"unsupported operator {op_name}")
        elif op_name in onnx_ops.OVERRIDES:
            sym = onnx_ops.OVERRIDES[op_name](inputs, attrs)         # None: TVM's converter below
        else:
            override = onnx_ops.BUILDER_OVERRIDES.get(op_name)
            sym = override(self.bb, inputs, attrs) if override is not None else None
            if sym is None:
                sym = _fuseguard_converter(op_name, inputs, attrs)
        if sym is None and op_name == "Gather" and len(inputs) == 2 and \
                attrs.get("tvm_custom", {}).get("name", "") in self._shape_ok:
            sym = _gather_shape(inputs, attrs)
        if sym is None and op_name == "Gather" and len(inputs) == 2 and self._analyzer is not None:
            sym = _gather_static_dims(inputs, attrs)
        if sym is None and op_name == "Tile" and len(inputs) == 2 and self._analyzer is not None:
            sym = _tile_symbolic(inputs[0], self._shape_values(inputs[1]))
        if sym is None:
            if op_name == "Resize":
                inputs, attrs = onnx_ops.resize_inputs(inputs, attrs)
            elif op_name == "Expand":
                inputs = onnx_semantics.expand_inputs(self.bb, inputs) or inputs
            elif op_name == "ConvTranspose":
                attrs = onnx_semantics.conv_transpose_pads(inputs, attrs) or attrs
            op_function = convert_map[op_name].get_converter(opset)
            sym = op_function(self.bb, inputs, attrs, [self._nodes, self._params])
        if self._analyzer is not None and isinstance(sym, relax.ShapeExpr) \
                and attrs.get("tvm_custom", {}).get("name", "") not in self._shape_ok:
            # A shape some reader cannot take as one (DeBERTa's Tile repeats): TVM's frontend refuses it there.
            sym = relax.op.shape_to_tensor(sym)
        return sym

    def _shape_values(self, x: object) -> list | None:
        """The dims of a shape that reached a tensor as `shape_to_tensor(ShapeExpr)` (above), else None."""
        expr = self.bb.lookup_binding(x) if isinstance(x, relax.Var) else x
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.shape_to_tensor" \
                and isinstance(expr.args[0], relax.ShapeExpr):
            return list(expr.args[0].values)
        return None

    def _check_for_unsupported_ops(self, graph) -> None:  # noqa: ANN001 - frontend signature
        """The stock check, knowing fuseguard's own converters (compiler/frontend/converters/ops.py)."""
        unknown = {n.op_type for n in graph.node} - supported_ops()
        if unknown:
            raise tvm.error.OpNotImplemented("The following operators are not supported for frontend ONNX: "
                                             + ", ".join(sorted(unknown)))

    def _tag(self, expr: relax.Expr, name: str, done: list[tuple[relax.Expr, relax.Var]]) -> relax.Expr:
        """Bind operator calls (and tuple items of multi-output ops) to vars carrying the node tag."""
        for seen, var in done:
            if seen.same_as(expr):
                return var
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            # Nested operator calls (a Conv converter returns add(conv2d(...), bias)) are tagged too.
            args = [self._tag(a, name, done) if isinstance(a, relax.Call) and isinstance(a.op, tvm.ir.Op)
                    and a.op.name != "relax.call_tir" else a for a in expr.args]
            if any(not a.same_as(b) for a, b in zip(args, expr.args)):
                expr = relax.Call(expr.op, args, expr.attrs, expr.ty_args)
            var = self.bb.emit(expr, name)
        elif isinstance(expr, relax.TupleGetItem) and isinstance(expr.tuple_value, (relax.Call, relax.TupleGetItem)):
            inner = self._tag(expr.tuple_value, name, done)
            var = self.bb.emit(relax.TupleGetItem(inner, expr.index), name)
        elif isinstance(expr, relax.Tuple):
            return relax.Tuple([self._tag(f, name, done) for f in expr.fields])
        else:
            return expr
        done.append((expr, var))
        return var


class _Importer(_TracingImporter):
    """Remembers the node being converted, so that a frontend failure can name it."""

    current: tuple[str, str] | None = None  # (node name, op type) while its converter runs

    def _sanitize_name(self, name: str) -> str:
        """Input names become kernel parameter names in the generated C/CUDA: the stock sanitiser only
        replaces '.', so caffe2's `gpu_0/data_0` reached nvcc as `float* gpu_0/data_0_ptr` (a syntax
        error in every kernel reading it: ResNet-50 and ShuffleNet did not compile to SASS)."""
        return super()._sanitize_name(_IDENTIFIER_BAD.sub("_", name) if name else name)

    def _convert_operator(self, op_name, inputs, attrs, opset):  # noqa: ANN001 - frontend signature
        self.current = (attrs.get("tvm_custom", {}).get("name", ""), op_name)
        sym = super()._convert_operator(op_name, inputs, attrs, opset)
        self.current = None
        return sym


class FrontendError(ModelError):
    """TVM's ONNX frontend failed on a model that onnx.checker accepts; names the node when known."""


def _layer_norm_with_stats(inputs: list, attrs: dict) -> relax.Expr | None:
    """LayerNormalization with its Mean and InvStdDev outputs, shaped as ONNX says (the reduced axes kept
    as 1s); the stock converter returns two scalar placeholders for them."""
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    dims = static_dims(x)
    if dims is None or str(x.ty.dtype) != "float32":
        return None
    axis = int(attrs.get("axis", -1)) % len(dims)
    axes = list(range(axis, len(dims)))
    eps = relax.const(float(attrs.get("epsilon", 1e-5)), "float32")
    mean = relax.op.mean(x, axes, keepdims=True)
    centred = relax.op.subtract(x, mean)
    var = relax.op.mean(relax.op.multiply(centred, centred), axes, keepdims=True)
    inv = relax.op.divide(relax.const(1.0, "float32"), relax.op.sqrt(relax.op.add(var, eps)))
    if bias is None:
        bias = relax.op.zeros_like(scale)
    y = relax.op.nn.layer_norm(x, scale, bias, axes, float(attrs.get("epsilon", 1e-5)))
    return relax.Tuple([y, mean, inv])


def _expand_static(inputs: list) -> relax.Expr | None:
    """Expand with a constant target shape: ONNX broadcasts both ways (data (3, 1) to shape (2, 1, 6) is
    (2, 3, 6)); the stock converter keeps the target's 1s (measured: (2, 1, 6))."""
    data, shape = inputs
    dims = static_dims(data)
    if dims is None:
        return None
    if isinstance(shape, relax.ShapeExpr):
        try:
            target = [int(d) for d in shape.values]
        except (TypeError, AttributeError):
            return None
    elif hasattr(getattr(shape, "value", None), "numpy") and not isinstance(shape, relax.Var):
        target = [int(v) for v in shape.value.numpy().reshape(-1)]
    else:
        return None
    import numpy as np

    try:
        out = list(np.broadcast_shapes(tuple(dims), tuple(target)))
    except ValueError:
        return None
    return relax.op.broadcast_to(data, out) if out != dims else data


def _int_scalar(x: object) -> "int | tvm.tirx.PrimExpr | None":
    """A Range bound as an int (constant) or a PrimExpr (a symbolic dim read off a Shape); else None."""
    if tvm.ir.is_prim_expr(x):
        return int(x.value) if isinstance(x, tvm.tirx.IntImm) else x
    arr = _const_array(x)
    if arr is not None and arr.size == 1 and arr.dtype.kind in "iu":
        return int(arr.reshape(()))
    return None


def _picked_dims(inputs: list, attrs: dict) -> tuple[list, tuple[int, ...]] | None:
    """The dims `Gather(Shape(x), idx)` picks, and idx's shape: a constant integer index of rank >= 1 on axis
    0 of a ShapeExpr, every entry in range; else None."""
    data, indices = inputs
    if not isinstance(data, relax.ShapeExpr) or int(attrs.get("axis", 0)) != 0:
        return None
    arr = _const_array(indices)
    values = list(data.values)
    if arr is None or arr.ndim == 0 or arr.dtype.kind not in "iu" \
            or not all(-len(values) <= int(i) < len(values) for i in arr.reshape(-1)):
        return None
    return [values[int(i)] for i in arr.reshape(-1)], arr.shape


def _gather_shape(inputs: list, attrs: dict) -> relax.Expr | None:
    """`Gather(Shape(x), [i, j, ...])` (a constant index vector: ORT's transpose optimiser writes the
    permuted shape of a transposed tensor so) stays a ShapeExpr of x's dims. The stock converter keeps
    only a 0-D index symbolic and materialises any other as an int64 tensor, so every Reshape behind it
    (LLaMA's attention heads with a symbolic batch and sequence) had a tensor-valued, unimportable shape."""
    picked = _picked_dims(inputs, attrs)
    if picked is None or len(picked[1]) != 1:
        return None
    return relax.ShapeExpr(picked[0])


def _gather_static_dims(inputs: list, attrs: dict) -> relax.Expr | None:
    """`Gather(Shape(x), [i, ...])` selecting only static dims of x -> an int64 constant (symbolic builds).

    The stock converter gathers a non-0-D index from the shape at run time; ShuffleNetV2's `chunk(2, dim=1)`
    computes its Slice bounds as (Gather(Shape(x), [1]) + 1) / 2 * k, so with a symbolic batch every Slice had
    tensor bounds, no output shape, and the model did not import. A constant folds through that arithmetic
    (TVM's converters compute constant inputs) and the Slice comes out static."""
    picked = _picked_dims(inputs, attrs)
    if picked is None or not all(isinstance(v, tvm.tirx.IntImm) for v in picked[0]):
        return None
    values, shape = picked
    return relax.const(np.array([int(v.value) for v in values], dtype="int64").reshape(shape))


def _tile_symbolic(data: relax.Expr, repeats: list | None) -> relax.Expr | None:
    """Tile with repeats that are symbolic dims: x (d0, d1, ...) reshaped to (1, d0, 1, d1, ...), broadcast to
    (r0, d0, r1, d1, ...) and merged to (r0 * d0, r1 * d1, ...), the order Tile repeats in. DeBERTa-v2 tiles
    its relative-position projections by batch * heads / heads-per-row, a count TVM's Tile (static repeats
    only) could not take with a symbolic batch."""
    ty = getattr(data, "ty", None)
    if repeats is None or not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr) \
            or len(repeats) != len(ty.shape.values) or all(isinstance(r, tvm.tirx.IntImm) for r in repeats):
        return None
    dims = list(ty.shape.values)
    spread = relax.op.reshape(data, [v for d in dims for v in (1, d)])
    tiled = relax.op.broadcast_to(spread, [v for r, d in zip(repeats, dims) for v in (r, d)])
    return relax.op.reshape(tiled, [r * d for r, d in zip(repeats, dims)])


_const_array = onnx_ops.const_values      # the value of a relax constant, else None (a Var or a computed tensor)


def _range_symbolic(inputs: list) -> relax.Expr | None:
    """`Range(0, Shape(x)[1], 1)` (BERT's and GPT-2's position ids) with a symbolic sequence: `arange` with
    the PrimExpr bound, so the output has shape (seq,). The stock converter reads the count back from a
    tensor into a fresh shape var that VMShapeLower could not compute (BERT's dynamic export failed at
    memory planning)."""
    start, limit, delta = (_int_scalar(x) for x in inputs)
    if any(v is None for v in (start, limit, delta)) or all(isinstance(v, int) for v in (start, limit, delta)):
        return None
    if not (isinstance(start, int) and isinstance(delta, int) and delta > 0):
        return None
    first = inputs[0]
    dtype = str(first.ty.dtype) if isinstance(getattr(first, "ty", None), relax.TensorType) else "int64"
    if not dtype.startswith("int"):
        return None
    return relax.op.arange(start, limit, delta, dtype)


def _fuseguard_converter(op_name: str, inputs: list, attrs: dict) -> relax.Expr | None:
    """Conversions that keep ops fusable where the stock frontend does not (None: use the stock one).

    - `Dropout` at inference (no training_mode, a constant false, or a constant ratio of 0) is the identity
      and its mask all true (bool, as ONNX says): removed at import. Kept, relax's dropout op sat inside AlexNet's
      classifier groups as a second output, so the packed matmul schedule refused them and the fused
      build ran 12x slower than the unfused one.
    - `Sum` of N inputs: the stock converter stacks them and reduces, copying every input once more and
      hiding ResNet's residual add from the Conv+Add+ReLU pattern; a chain of adds computes the same.
    - `Clip` with constant bounds: the stock converter emits opaque TE calls that no pattern can see;
      `relax.op.clip` keeps ReLU6 / HardSwish / HardSigmoid recognisable.
    - ONNX semantics the stock converters get wrong (the node conformance suite, `fuseguard conformance`):
      LayerNormalization's Mean/InvStdDev outputs, Expand's two-way broadcast, IsInf's detect_* flags;
      ONNX's own Attention op (opset 23+; TVM maps the name to Microsoft's contrib op), compiler/frontend/converters/attention.py.
    Ops TVM has no converter for at all (RotaryEmbedding, Swish, SwiGLU, Celu, LpNormalization, CumProd) are
    in compiler/frontend/converters/ops.py, called from `_TracingImporter._convert_operator`.
    """
    if op_name == "Dropout" and inputs and isinstance(inputs[0], relax.Expr):
        if not onnx_semantics.dropout_is_identity(inputs):
            return None         # training mode (or unknown): compiler/frontend/converters/semantics.py's dropout_training
        if attrs.get("tvm_custom", {}).get("num_outputs", 1) < 2:
            return relax.Tuple([inputs[0]])
        return relax.Tuple([inputs[0], relax.op.ones_like(inputs[0], dtype="bool")])
    if op_name == "Attention" and onnx_attention.is_onnx_attention(attrs) and len(inputs) >= 3:
        return onnx_attention.convert(inputs, attrs)
    if op_name == "LayerNormalization" and attrs.get("tvm_custom", {}).get("num_outputs", 1) > 1:
        return _layer_norm_with_stats(inputs, attrs)
    if op_name == "Expand" and len(inputs) == 2:
        return _expand_static(inputs)
    if op_name == "IsInf" and inputs and isinstance(inputs[0], relax.Expr):
        x = inputs[0]
        pos, neg = int(attrs.get("detect_positive", 1)), int(attrs.get("detect_negative", 1))
        if pos and neg:
            return None
        inf = relax.op.isinf(x)
        zero = relax.const(0, str(x.ty.dtype))
        if not pos and not neg:
            return relax.op.logical_and(inf, relax.op.less(zero, zero))      # all false, same shape
        return relax.op.logical_and(inf, relax.op.greater(x, zero) if pos else relax.op.less(x, zero))
    if op_name == "Cast" and inputs and isinstance(inputs[0], relax.Expr) and "to" in attrs:
        # softmax(x, dtype=float32).to(q.dtype) in HF exports: a float32 -> float32 Cast that would sit
        # between the attention softmax and its PV matmul. A same-type Cast is the identity.
        try:
            target = onnx.helper.tensor_dtype_to_np_dtype(int(attrs["to"])).name
        except (KeyError, ValueError, TypeError):
            return None
        ty = inputs[0].ty
        if isinstance(ty, relax.TensorType) and ty.dtype == target:
            return inputs[0]
        return None
    if op_name == "Range" and len(inputs) == 3:
        return _range_symbolic(inputs)
    if op_name == "Sum" and len(inputs) >= 1 and all(isinstance(i, relax.Expr) for i in inputs):
        out = inputs[0]
        for other in inputs[1:]:
            out = relax.op.add(out, other)
        return out
    if op_name == "Clip" and inputs and isinstance(inputs[0], relax.Expr):
        bounds = []
        for i, key, default in ((1, "min", float("-inf")), (2, "max", float("inf"))):
            if len(inputs) > i and inputs[i] is not None:
                value = inputs[i]
                if not hasattr(value, "value") or isinstance(value, relax.Var):
                    return None
                arr = value.value.numpy()
                if arr.size != 1 or arr != arr:  # non-scalar or NaN bound: leave it to the stock converter
                    return None
                bounds.append(float(arr.reshape(())))
            else:
                bounds.append(float(attrs.get(key, default)))
        dtype = str(inputs[0].ty.dtype)
        if not dtype.startswith("float"):
            return None
        lo, hi = (tvm.tirx.FloatImm(dtype, b) for b in bounds)
        return relax.op.clip(inputs[0], relax.prim_value(lo), relax.prim_value(hi))
    return None


@relax.expr_functor.mutator
class _OutputTagger(relax.PyExprMutator):
    """`gv = n36_LayerNormalization` (the frontend's output alias) -> an output var carrying the tag."""

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if not isinstance(binding.var, relax.DataflowVar) and isinstance(value, relax.DataflowVar) \
                and tags.is_tagged(value.name):
            var = self.builder_.emit_output(self.visit_expr(value), value.name)
            self.set_var_remap(binding.var, var)
            return
        super().visit_var_binding_(binding)


def _tag_outputs(mod: tvm.IRModule) -> tvm.IRModule:
    """Keep the provenance tag on the model's output bindings: after CanonicalizeBindings folds the alias,
    the last op would otherwise be bound to `gv` and its ONNX node lost to reports and profiles."""
    tagger = _OutputTagger(mod)
    gv = mod.get_global_var("main")
    tagger.builder_.update_func(gv, tagger.visit_expr(mod["main"]))
    return tagger.builder_.get()


def _input_shapes(loaded: LoadedModel, dynamic: Sequence[DynamicDim]) -> dict[str, list]:
    """The pinned shapes, with the dims named in `dynamic` as shared symbolic vars."""
    if not dynamic:
        return {k: list(v) for k, v in loaded.input_shapes.items()}
    label = str(loaded.path) if loaded.path else loaded.name
    return symbolic_shapes(loaded.input_shapes, check_names(loaded.model, dynamic, label))


#: The ops TVM's frontend lets a ShapeExpr reach (`ONNXGraphImporter._construct_nodes` keeps this list
#: local; any other op given one raises "cannot handle ShapeExpr inputs").
SHAPE_COMPATIBLE_OPS = frozenset({"Reshape", "Resize", "ConstantOfShape", "Gather", "Slice", "Shape", "Expand",
                                  "Concat", "Equal", "Where", "Cast", "CastLike", "Squeeze"})


def _shape_consumed(model: onnx.ModelProto) -> frozenset[str]:
    """Names of the nodes whose every output is read only by ops that take a ShapeExpr (and is no graph
    output): their result may stay symbolic."""
    readers: dict[str, set[str]] = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, set()).add(n.op_type)
    outputs = {o.name for o in model.graph.output}
    return frozenset(n.name for n in model.graph.node
                     if all(o not in outputs and o in readers and readers[o] <= SHAPE_COMPATIBLE_OPS
                            for o in n.output))


def _raw_import(model: onnx.ModelProto, loaded: LoadedModel, label: str,
                dynamic: Sequence[DynamicDim] = ()) -> ImportResult:
    model = subbyte.to_containers(model, label)      # 4- and 2-bit tensors held one per byte
    dtypes = dict(loaded.input_dtypes)
    for vi in model.graph.input:
        if vi.name in dtypes and vi.type.tensor_type.elem_type in subbyte.CONTAINER.values():
            dtypes[vi.name] = subbyte.ml_dtype(vi.type.tensor_type.elem_type).name
    node_index = {n.name: i for i, n in enumerate(model.graph.node)}
    opset = next((o.version for o in model.opset_import if o.domain in _DEFAULT_DOMAINS), 1)
    shapes = _input_shapes(loaded, dynamic)
    uppers = upper_bounds(dynamic)
    importer = _Importer(
        shapes,
        dtypes,
        keep_params_in_input=False,
        sanitize=True,
        node_index=node_index,
        shape_ok=_shape_consumed(model),
        dim_bounds={d: uppers.get(d.name) for dims in shapes.values() for d in dims
                    if isinstance(d, tvm.tirx.Var)},
    )
    # The frontend prints "Error converting operator ..." with whole Relax expressions before re-raising.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            mod = importer.from_onnx(model.graph, opset)
        except UnsupportedOperatorError:
            raise
        except Exception as err:
            if importer.current is not None:
                name, op = importer.current
                raise FrontendError(f"{label}: TVM's ONNX frontend cannot convert node '{name}' ({op}): "
                                    f"{error_line(err)}") from err
            raise FrontendError(f"{label}: TVM's ONNX frontend cannot import this model: {error_line(err)}") from err
    mod = _tag_outputs(mod)
    return ImportResult(mod=mod, node_names=[n.name for n in model.graph.node],
                        node_ops=[n.op_type for n in model.graph.node], prepared=False)


#: ORT BASIC rewrites that are not shape folding and that would hide fusion opportunities: MatMul + Add
#: became Gemm + Reshape (BERT's matmul_bias_gelu never matched after the fold step).
FOLD_DISABLED_OPTIMIZERS = ("MatMulAddFusion",)


def read_static_dims(model: onnx.ModelProto) -> onnx.ModelProto:
    """`Gather(Shape(x), i)` -> a Constant where ONNX shape inference knows dim i of x statically.

    With a dim left symbolic, ONNX Runtime folds no `Shape` of a tensor that has it, so every shape
    computation behind one stayed at run time, even the ones reading a static dim: LLaMA's rotate_half
    slices at `x.shape[-1] // 2`, whose tensor-valued bounds left the rotary embedding of unknown shape
    and its dynamic export unimportable. Reading the static dims first lets the ORT fold finish the job.
    A copy is returned; the input is untouched.
    """
    from onnx import numpy_helper

    from .shapes import weightless_copy

    try:
        inferred = onnx.shape_inference.infer_shapes(weightless_copy(model), strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - no inference, nothing to read
        return model
    g = inferred.graph
    dims: dict[str, list[int | None]] = {}
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            dims[vi.name] = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in t.shape.dim]
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    shapes = {}
    for n in model.graph.node:
        if n.op_type == "Shape" and n.input[0] in dims:
            attrs = {a.name: a.i for a in n.attribute}
            rank = len(dims[n.input[0]])
            start, end = attrs.get("start", 0), attrs.get("end", rank)
            shapes[n.output[0]] = dims[n.input[0]][slice(start, end)]
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = []
    changed = False
    for n in out.graph.node:
        index = consts.get(n.input[1]) if n.op_type == "Gather" and len(n.input) == 2 else None
        read = shapes.get(n.input[0]) if index is not None else None
        if read is not None and index.size == 1 and index.dtype.kind in "iu":
            i = int(index.reshape(()))
            value = read[i] if -len(read) <= i < len(read) else None
            if value is not None:
                arr = np.asarray(value, dtype=np.int64).reshape(index.shape)
                nodes.append(onnx.helper.make_node("Constant", [], [n.output[0]], name=n.name,
                                                   value=numpy_helper.from_array(arr)))
                changed = True
                continue
        nodes.append(n)
    if not changed:
        return model
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def fold_shape_computations(model: onnx.ModelProto) -> onnx.ModelProto:
    """Fold Shape->Gather->Concat->Reshape chains with ONNX Runtime's BASIC optimiser.

    BASIC level keeps standard ONNX ops only (constant folding, redundant node removal), so the
    result still imports with the stock frontend; with shapes pinned, computed shapes become constants.
    """
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="fuseguard-prep-") as tmp:
        out = os.path.join(tmp, "prepared.onnx")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = out
        options.log_severity_level = 3
        ort.InferenceSession(read_static_dims(model).SerializeToString(), options, providers=["CPUExecutionProvider"],
                             disabled_optimizers=list(FOLD_DISABLED_OPTIMIZERS))
        prepared = onnx.load(out, load_external_data=True)
    # ORT renames nothing it keeps, but may drop names of nodes it created.
    from .loader import name_nodes

    name_nodes(prepared)
    return prepared


def import_folded(loaded: LoadedModel, dynamic: Sequence[DynamicDim] = ()) -> ImportResult:
    """Import after folding shape computations with ONNX Runtime (the retry path, said in the report)."""
    label = str(loaded.path) if loaded.path else loaded.name
    try:
        prepared = fold_shape_computations(loaded.model)
    except Exception as err:
        raise FrontendError(f"{label}: folding shape computations with ONNX Runtime failed: {error_line(err)}"
                            f"{loaded.shape_hint()}") from err
    check_supported(prepared, label)
    result = _raw_import(prepared, loaded, label, dynamic)
    result.prepared = True
    return result


def import_model(loaded: LoadedModel, dynamic: Sequence[DynamicDim] = ()) -> ImportResult:
    """Import a loaded model; on failure, fold shape computations with ONNX Runtime and retry once.

    Exporters (PaddlePaddle, torch.onnx) compute reshape targets from `Shape` at run time; the
    frontend wants them constant. With every input shape pinned, ORT's BASIC constant folding
    turns those chains into constants, which is usually all the retry needs. Dims named in `dynamic`
    stay symbolic in both tries (the loader left them as `dim_param`s, so ORT folds around them).
    """
    label = str(loaded.path) if loaded.path else loaded.name
    check_supported(loaded.model, label)
    try:
        return _raw_import(loaded.model, loaded, label, dynamic)
    except UnsupportedOperatorError:
        raise
    except FrontendError as first:
        try:
            prepared = fold_shape_computations(loaded.model)
        except Exception as err:
            raise FrontendError(f"{first} (folding shape computations with ONNX Runtime to retry also "
                                f"failed: {error_line(err)}){loaded.shape_hint()}") from first
        check_supported(prepared, label)
        try:
            result = _raw_import(prepared, loaded, label, dynamic)
        except FrontendError as second:
            raise FrontendError(f"{second} (also after folding shape computations with ONNX Runtime)"
                                f"{loaded.shape_hint()}") from second
        result.prepared = True
        return result


def provenance_of(var_names: list[str], result: ImportResult) -> list[str]:
    """ONNX node names for a list of Relax var names (tags `n<index>_...`), in graph order."""
    indices = sorted({i for v in var_names for i in tags.indices(v)})
    return [result.node_names[i] for i in indices if i < len(result.node_names)]
