"""ONNX -> Relax import, with provenance and a shape-folding retry.

Provenance: every Relax binding that an ONNX node's converter produces is bound to a var
named `n<index>` so that, after fusion, a fused group can name the ONNX nodes it came from
(`provenance_of`). Var names survive FuseOpsByPattern, LegalizeOps and FuseOps.
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from dataclasses import dataclass

import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as _frontend

from .errors import ModelError, UnsupportedOperatorError
from .onnx_loader import LoadedModel

_TAG = re.compile(r"^n(\d+(?:\+\d+)*)(?:_|$)")


@dataclass
class ImportResult:
    mod: tvm.IRModule
    node_names: list[str]        # index -> ONNX node name, for the tags `n<index>`
    node_ops: list[str]          # index -> ONNX op_type
    prepared: bool               # True when the shape-folding retry was needed


class _TracingImporter(_frontend.ONNXGraphImporter):
    """The stock importer, binding each converted node's result to a var tagged with its index."""

    def __init__(self, *args, node_index: dict[str, int], **kwargs):
        super().__init__(*args, **kwargs)
        self._node_index = node_index

    def _convert_operator(self, op_name, inputs, attrs, opset):  # noqa: ANN001 - frontend signature
        # The stock method normalises the converter's result, which binds multi-output ops (BatchNorm's
        # tuple) to anonymous vars; tag first, then normalise (same converter lookup as the original).
        convert_map = _frontend._get_convert_map()
        if op_name not in convert_map:
            raise UnsupportedOperatorError(f"unsupported operator {op_name}")
        op_function = convert_map[op_name].get_converter(opset)
        sym = op_function(self.bb, inputs, attrs, [self._nodes, self._params])
        index = self._node_index.get(attrs.get("tvm_custom", {}).get("name", ""))
        if index is not None and isinstance(sym, relax.Expr):
            sym = self._tag(sym, f"n{index}_{op_name}", [])
        return self.bb.normalize(sym) if isinstance(sym, relax.Expr) else sym

    def _tag(self, expr: relax.Expr, name: str, done: list[tuple[relax.Expr, relax.Var]]) -> relax.Expr:
        """Bind operator calls (and tuple items of multi-output ops) to vars carrying the node tag."""
        for seen, var in done:
            if seen.same_as(expr):
                return var
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
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


def supported_ops() -> set[str]:
    return set(_frontend._get_convert_map()) | {"If", "Constant"}


def check_supported(model: onnx.ModelProto, label: str) -> None:
    """Name the first unsupported operator and its node before TVM fails somewhere deep inside."""
    known = supported_ops()
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            raise UnsupportedOperatorError(
                f"{label}: unsupported operator {node.domain}::{node.op_type} (node '{node.name}'): "
                f"only the default ONNX domain is supported")
        if node.op_type not in known:
            raise UnsupportedOperatorError(
                f"{label}: unsupported operator {node.op_type} (node '{node.name}')")


def _raw_import(model: onnx.ModelProto, loaded: LoadedModel) -> ImportResult:
    node_index = {n.name: i for i, n in enumerate(model.graph.node)}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    importer = _TracingImporter(
        {k: list(v) for k, v in loaded.input_shapes.items()},
        dict(loaded.input_dtypes),
        keep_params_in_input=False,
        sanitize=True,
        node_index=node_index,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = importer.from_onnx(model.graph, opset)
    return ImportResult(mod=mod, node_names=[n.name for n in model.graph.node],
                        node_ops=[n.op_type for n in model.graph.node], prepared=False)


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
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        prepared = onnx.load(out, load_external_data=True)
    # ORT renames nothing it keeps, but may drop names of nodes it created.
    from .onnx_loader import name_nodes

    name_nodes(prepared)
    return prepared


def import_model(loaded: LoadedModel) -> ImportResult:
    """Import a loaded model; on failure, fold shape computations and retry once."""
    label = str(loaded.path) if loaded.path else loaded.name
    check_supported(loaded.model, label)
    try:
        return _raw_import(loaded.model, loaded)
    except Exception as first:  # the frontend raises assorted errors for computed shapes
        try:
            prepared = fold_shape_computations(loaded.model)
        except Exception as err:
            raise ModelError(f"{label}: import failed ({_one_line(first)}); folding shapes with ONNX Runtime "
                             f"also failed ({_one_line(err)})") from None
        try:
            check_supported(prepared, label)
            result = _raw_import(prepared, loaded)
        except UnsupportedOperatorError:
            raise
        except Exception as second:
            raise ModelError(f"{label}: TVM's ONNX frontend cannot import this model: {_one_line(second)}") from None
        result.prepared = True
        return result


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    msg = text[-1] if text else ""
    return f"{type(err).__name__}: {msg}"[:300]


def provenance_of(var_names: list[str], result: ImportResult) -> list[str]:
    """ONNX node names for a list of Relax var names (tags `n<index>_...`), in graph order."""
    indices = sorted({int(i) for v in var_names if (m := _TAG.match(v)) for i in m.group(1).split("+")})
    return [result.node_names[i] for i in indices if i < len(result.node_names)]
