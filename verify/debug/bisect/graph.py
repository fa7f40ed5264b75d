"""ONNX graph surgery and per-tensor comparison for bisection: expose intermediates as outputs, cut
sub-models, compare one tensor with its tolerance."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...check.compare import OutputCompareResult, Tolerance, Tolerances, compare_outputs, resolve_tolerance

if TYPE_CHECKING:
    import onnx

_SUFFIX = re.compile(r"\d+$")


def close(actual: np.ndarray, reference: np.ndarray, tol: Tolerance) -> bool:
    """The comparator's rule (|a - r| <= atol + rtol |r|, NaN never passes), cheaply, for scanning."""
    if actual.shape != reference.shape:
        return False
    if actual.size == 0:
        return True
    if actual.dtype.kind in "biu" and reference.dtype.kind in "biu" and tol.exact:
        return bool(np.array_equal(actual, reference))
    with np.errstate(invalid="ignore", over="ignore"):
        return bool(np.isclose(actual.astype(np.float64), reference.astype(np.float64), rtol=tol.rtol,
                               atol=tol.atol, equal_nan=False).all())


def max_abs(actual: np.ndarray, reference: np.ndarray) -> float | None:
    if actual.shape != reference.shape or actual.size == 0:
        return None
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.max(np.abs(actual.astype(np.float64) - reference.astype(np.float64))))


def compare_one(name: str, actual: np.ndarray, reference: np.ndarray, tolerances: Tolerances,
                per_output: Mapping[str, Tolerance] | None = None) -> OutputCompareResult:
    own = {name: per_output[name]} if per_output and name in per_output else None
    return compare_outputs({name: actual}, {name: reference}, tolerances=tolerances, per_output=own)[name]


def tolerance_for(name: str, reference: np.ndarray, tolerances: Tolerances,
                  per_output: Mapping[str, Tolerance] | None = None) -> Tolerance:
    return resolve_tolerance(name, reference.dtype, tolerances, per_output)


def stem(function: str) -> str:
    return _SUFFIX.sub("", function).rstrip("_")


class OnnxGraph:
    """ONNX graph facts the bisector needs: producers, initializers, tensor names per node."""

    def __init__(self, model: "onnx.ModelProto") -> None:
        g = model.graph
        self.model = model
        self.nodes = list(g.node)
        self.initializers = {i.name for i in g.initializer}
        self.inputs = [i.name for i in g.input if i.name not in self.initializers]
        self.outputs = [o.name for o in g.output]
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = {}
        for i, n in enumerate(self.nodes):
            for t in n.output:
                if t:
                    self.producer[t] = i
            for t in n.input:
                if t:
                    self.consumers.setdefault(t, []).append(i)

    def is_constant(self, tensor: str) -> bool:
        if tensor in self.initializers:
            return True
        p = self.producer.get(tensor)
        return p is not None and self.nodes[p].op_type == "Constant"

    def node_tensor(self, index: int, folded_bn: bool) -> str | None:
        """The ONNX tensor a var tagged with node `index` holds, when that is unambiguous."""
        if not 0 <= index < len(self.nodes):
            return None
        node = self.nodes[index]
        outs = [t for t in node.output if t]
        if len(outs) != 1:
            return None
        if folded_bn and node.op_type == "Conv":
            # FoldBatchNorm keeps the Conv's name on the conv with scaled weights: not the Conv's value.
            if any(self.nodes[c].op_type == "BatchNormalization" for c in self.consumers.get(outs[0], [])):
                return None
        return outs[0]

    def frontier(self, k: int) -> list[str]:
        """Tensors made by nodes[0..k] that later nodes read or the graph returns (and node k's own)."""
        made = [t for n in self.nodes[:k + 1] for t in n.output if t]
        live = []
        for t in made:
            later = any(c > k for c in self.consumers.get(t, []))
            if later or t in self.outputs or self.producer.get(t) == k:
                live.append(t)
        return [t for t in dict.fromkeys(live) if not self.is_constant(t)]


def expose(model: "onnx.ModelProto", names: Sequence[str]) -> "onnx.ModelProto":
    """A copy of the model with these intermediate tensors added to graph.output (typed by shape inference)."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(copy)
    except Exception:  # best effort: tensors without a type are not exposed
        inferred = copy
    typed = {vi.name: vi for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    present = {o.name for o in copy.graph.output}
    for name in names:
        if name in present or name not in typed or not typed[name].type.HasField("tensor_type"):
            continue
        copy.graph.output.append(typed[name])
        present.add(name)
    return copy


def extract(model: "onnx.ModelProto", inputs: Sequence[str], outputs: Sequence[str]) -> "onnx.ModelProto":
    """The sub-model from `inputs` to `outputs`; inputs it still lacks are added until it checks."""
    import onnx
    import onnx.utils

    try:
        model = onnx.shape_inference.infer_shapes(model)  # the extractor types cut tensors from value_info
    except Exception:  # noqa: BLE001 - inference is a help to the extractor, not needed by it
        pass
    extractor = onnx.utils.Extractor(model)
    inputs = list(dict.fromkeys(inputs))
    for _ in range(8):
        sub = extractor.extract_model(inputs, list(outputs))
        produced = {t for n in sub.graph.node for t in n.output}
        known = produced | {i.name for i in sub.graph.input} | {i.name for i in sub.graph.initializer}
        missing = [t for n in sub.graph.node for t in n.input if t and t not in known]
        if not missing:
            onnx.checker.check_model(sub)
            return sub
        inputs += list(dict.fromkeys(missing))
    raise ValueError(f"cannot cut a self-contained sub-model for outputs {list(outputs)}")


