"""Reduced-precision verification: both builds against an fp64 run of the same model.

A bf16 build is never bit-close to ONNX Runtime's fp32 result, so a tolerance loose enough to pass the
unfused build passes a fused kernel that is several times more wrong. The rule users trust is PyTorch
dynamo's `same()`: against an fp64 run, the fused result may be as wrong as its unfused counterpart in the
same precision, not more: ``RMSE(fused, fp64) <= mult * RMSE(unfused, fp64) + tol / 10``.

The fp64 run is ONNX Runtime on a float64 copy of the graph where ORT has float64 kernels for every node
(MatMul, Gemm, Softmax, elementwise ops), else ONNX's own numpy reference evaluator on that copy (ORT's CPU
Conv and Erf are float only; TVM's layer_norm refuses float64). Neither shares fuseguard's code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from .compare import Tolerance, rmse_of

#: dynamo's `same()` multiplier for half types (2.0 for fp32): the fused build may be this many times as
#: far from fp64 as the unfused build.
HALF_MULT = 3.0
#: The loose per-element check of each reduced build against ONNX Runtime's fp32 result, scaled by each
#: output's RMS: |got - ref| <= B * (|ref| + rms(ref)). A sanity bound (the fp64 rule is what separates a
#: wrong kernel from rounding; B catches a grossly wrong conversion). Measured, Zen4, the worst element of a
#: whole model as max|d| / (|ref| + rms): fp16 1.2e-3 - 5.3e-2 (ResNet-50 worst), bf16 1.0e-2 - 0.28
#: (gpt2_tiny_peaked worst, ResNet-50's softmax 0.25); B is 2.7-2.8x the worst.
BUDGET: dict[str, float] = {"fp16": 0.15, "bf16": 0.75}
#: Unit roundoff of each type: the fp64 rule's additive slack is one rounding of the output at its RMS
#: (dynamo's tol / 10 in spirit, scale-aware so a softmax output of RMS 0.006 gets no free 5x).
UNIT_ROUNDOFF: dict[str, float] = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


def loose_tolerances(precision: str, reference: Mapping[str, np.ndarray]) -> dict[str, Tolerance]:
    """Per float output of `reference`: Tolerance(rtol=B, atol=B * rms) for this precision's budget B."""
    b = BUDGET[precision]
    out = {}
    for name, ref in reference.items():
        if np.issubdtype(np.asarray(ref).dtype, np.floating) and np.size(ref):
            rms = rms_of(ref)
            out[name] = Tolerance(rtol=b, atol=max(b * rms, 1e-30))
    return out


def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` computing in float64: float32 initializers, constants, casts and I/O types."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    F, D = TensorProto.FLOAT, TensorProto.DOUBLE

    def tensor(t: TensorProto) -> None:
        if t.data_type == F:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))

    def graph(g: onnx.GraphProto) -> None:
        for t in g.initializer:
            tensor(t)
        for vi in [*g.input, *g.output, *g.value_info]:
            if vi.type.tensor_type.elem_type == F:
                vi.type.tensor_type.elem_type = D
        for node in g.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    tensor(a.t)
                elif a.type == onnx.AttributeProto.GRAPH:
                    graph(a.g)
                elif a.name == "to" and node.op_type in ("Cast", "CastLike") and a.i == F:
                    a.i = D
                elif a.name == "dtype" and a.type == onnx.AttributeProto.INT and a.i == F:
                    a.i = D

    graph(m.graph)
    return m


#: A float64 run must agree with ONNX Runtime's fp32 result this closely (RMSE relative to the output's RMS)
#: to be used. Loose on purpose: a reference that reads an operator differently is off by O(1) or more
#: (onnx.reference applies Softmax-13's axis to a Softmax-11 model: SqueezeNet's output all 1.0, 160x its
#: RMS), while ill-conditioned models put ORT's own fp32 result far from fp64 (the suite's random-weight
#: ShuffleNet and ResNet-50: 0.19-0.23, from the first BatchNorm on, where ORT's folded x*scale + bias
#: cancels). Past AGREE_NOTE the verdict says how far, so a user can tell which it is.
AGREE_RTOL = 0.5
AGREE_NOTE = 1e-3


#: Op types ORT may run in fp32 inside a float64 reference before the attempt gives up.
MAX_ISLAND_OPS = 6


def _fp32_islands(model64: onnx.ModelProto, op_types: list[str]) -> onnx.ModelProto:
    """A copy of a float64 model where nodes of `op_types` read their float64 inputs cast to float32 and
    their outputs are cast back (ONNX Runtime's CPU Conv and Erf have no float64 kernel)."""
    if not op_types:
        return model64
    m = onnx.ModelProto()
    m.CopyFrom(model64)
    typed = onnx.shape_inference.infer_shapes(m)
    dtype = {v.name: v.type.tensor_type.elem_type for v in [*typed.graph.value_info, *typed.graph.input,
                                                              *typed.graph.output]}
    dtype.update({t.name: t.data_type for t in m.graph.initializer})
    nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(m.graph.node):
        if node.op_type not in op_types:
            nodes.append(node)
            continue
        for j, name in enumerate(node.input):
            if name and dtype.get(name) == TensorProto.DOUBLE:
                cast = f"{name}__fp32_{i}"
                nodes.append(onnx.helper.make_node("Cast", [name], [cast], to=TensorProto.FLOAT))
                node.input[j] = cast
        outs = list(node.output)
        for j, name in enumerate(outs):
            node.output[j] = f"{name}__fp32"
        nodes.append(node)
        nodes.extend(onnx.helper.make_node("Cast", [f"{name}__fp32"], [name], to=TensorProto.DOUBLE) for name in outs)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def _disagreement(got: Mapping[str, np.ndarray], fp32: Mapping[str, np.ndarray]) -> float:
    """The worst float output's RMSE against ORT's fp32 result relative to its RMS (inf on a shape mismatch)."""
    worst = 0.0
    for name, ref in fp32.items():
        if name not in got or np.shape(got[name]) != np.shape(ref):
            return math.inf
        if np.issubdtype(np.asarray(ref).dtype, np.floating) and np.size(ref):
            scale = rms_of(ref)
            worst = max(worst, rmse_of(got[name], ref) / max(scale, 1e-30))
    return worst


def fp64_reference(model: onnx.ModelProto, inputs: Mapping[str, np.ndarray], output_names: list[str],
                   fp32_reference: Mapping[str, np.ndarray],
                   run_onnxruntime: Callable[..., dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], str]:
    """(outputs of a float64 run that agrees with ONNX Runtime's fp32 one, which engine ran it).

    Tried in order: ONNX Runtime; ONNX's reference evaluator on the graph converted to opset 13 or later
    (whose operator versions it implements most faithfully); ONNX Runtime with the ops it has no float64
    kernel for in fp32 (the evaluator has bugs of its own: GatherElements on bert_tiny's export); the
    evaluator on the graph as given. Raises ValueError naming each attempt when none agrees."""
    model64 = to_float64(model)
    feed = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in inputs.items()}
    tried: list[str] = []

    def ort() -> dict[str, np.ndarray]:
        return run_onnxruntime(model64, feed)

    islands: list[str] = []

    def ort_islands() -> dict[str, np.ndarray]:
        """ORT in float64 with the node types it has no float64 kernel for run in fp32 between casts (found by
        trying: its error names the op). fp32 there costs ~1e-7 relative, far below fp16/bf16 rounding."""
        import re

        for _ in range(MAX_ISLAND_OPS):
            try:
                return run_onnxruntime(_fp32_islands(model64, islands), feed)
            except Exception as err:
                found = re.search(r"implementation for (\w+)\(", str(err))
                if not found or found.group(1) in islands:
                    raise
                islands.append(found.group(1))
        raise RuntimeError(f"more than {MAX_ISLAND_OPS} op types lack a float64 kernel")

    def evaluator(m: onnx.ModelProto) -> dict[str, np.ndarray]:
        from onnx.reference import ReferenceEvaluator

        return dict(zip(output_names, ReferenceEvaluator(m).run(None, feed)))

    def converted() -> dict[str, np.ndarray]:
        from onnx import version_converter

        opset = max((o.version for o in model64.opset_import if o.domain in ("", "ai.onnx")), default=13)
        return evaluator(version_converter.convert_version(model64, max(opset, 13)) if opset < 13 else model64)

    for label, run in (("ONNX Runtime float64", ort), ("onnx.reference float64", converted),
                       ("ONNX Runtime float64 (fp32 islands)", ort_islands),
                       ("onnx.reference float64 (opset as given)", lambda: evaluator(model64))):
        try:
            got = run()
        except Exception as err:     # no float64 kernel for some node (ORT's CPU Conv and Erf), ...
            tried.append(f"{label}: {type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}")
            continue
        off = _disagreement(got, fp32_reference)
        if label.endswith("(fp32 islands)"):
            label = f"ONNX Runtime float64 ({', '.join(islands)} in fp32)"
        if off <= AGREE_RTOL:
            return got, label + (f", {off:.2g} relative RMSE from ONNX Runtime fp32" if off > AGREE_NOTE else "")
        tried.append(f"{label}: disagrees with ONNX Runtime fp32 by {off:.3g} relative RMSE (> {AGREE_RTOL:g})")
    raise ValueError("; ".join(tried))


def rms_of(x: np.ndarray) -> float:
    """Root mean square in float64 (0 for an empty array): the scale every bound here is relative to."""
    return rmse_of(np.asarray(x), np.zeros(np.shape(x))) if np.size(x) else 0.0


@dataclass
class Fp64Output:
    name: str
    fused_rmse: float
    unfused_rmse: float
    bound: float

    @property
    def passed(self) -> bool:
        return math.isfinite(self.fused_rmse) and self.fused_rmse <= self.bound

    @property
    def ratio(self) -> float:
        return self.fused_rmse / self.unfused_rmse if self.unfused_rmse > 0 else math.inf


@dataclass
class Fp64Check:
    """The fused build's error against fp64 beside the unfused build's (truthy when no worse than allowed)."""

    precision: str
    engine: str
    mult: float
    outputs: list[Fp64Output] = field(default_factory=list)

    def __bool__(self) -> bool:
        return all(o.passed for o in self.outputs)

    def summary(self) -> str:
        worst = max(self.outputs, key=lambda o: o.fused_rmse / o.bound if o.bound else math.inf, default=None)
        if worst is None:
            return f"{self.precision} vs fp64: no float outputs"
        verdict = "within" if self else "MORE WRONG than allowed:"
        return (f"{self.precision} vs fp64 ({self.engine}): fused {verdict} rmse {worst.fused_rmse:.3g} vs unfused "
                f"{worst.unfused_rmse:.3g} ({worst.ratio:.2f}x; allowed {self.mult:g}x + slack) on {worst.name}")

    def to_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "engine": self.engine, "mult": self.mult, "passed": bool(self),
                "summary": self.summary(),
                "outputs": [{**asdict(o), "passed": o.passed} for o in self.outputs]}


def check_against_fp64(precision: str, fused: Mapping[str, np.ndarray], unfused: Mapping[str, np.ndarray],
                       gold: Mapping[str, np.ndarray], engine: str) -> Fp64Check:
    """dynamo's rule per float output: rmse(fused, fp64) <= HALF_MULT * rmse(unfused, fp64) + u * rms(fp64), u the type's
    unit roundoff."""
    check = Fp64Check(precision=precision, engine=engine, mult=HALF_MULT)
    for name, g in gold.items():
        if name not in fused or name not in unfused or not np.issubdtype(np.asarray(g).dtype, np.floating):
            continue
        f_err, u_err = rmse_of(fused[name], g), rmse_of(unfused[name], g)
        slack = UNIT_ROUNDOFF[precision] * rms_of(g)
        check.outputs.append(Fp64Output(name=name, fused_rmse=f_err, unfused_rmse=u_err,
                                        bound=HALF_MULT * u_err + slack))
    return check


# ------------------------------------------------------------------------------------------ int8 QDQ models

#: Ops between an output and the DequantizeLinear it reads that keep its values (so its step).
_VALUE_PRESERVING = frozenset({"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
#: Quantisation steps of the output allowed: a value on a rounding boundary of any QuantizeLinear may land one
#: step apart in each engine, and a flip inside the network moves later outputs. Measured (ORT's
#: quantize_static, int8 QDQ, fused and unfused alike): SqueezeNet, bert_encoder, resnet18, mobilenet_v2,
#: gpt2_tiny and vit_tiny within one step of the output; mlp_gelu (768 -> 3072 -> 768) two steps on 9 of
#: 12288 elements fused, 1 unfused. With integer GEMMs (compiler/passes/int8_gemm.py, exact where fp32 rounds) and
#: more input draws, bert_encoder and gpt2_tiny reach three steps on up to 0.06% of elements, as the fp32
#: route did on bert_encoder: such sparse flips pass by verify/compare.rescue_boundary_flips, not by more steps.
QDQ_STEPS = 2
#: Float slack on top of the steps: the step itself is a float32 scale, and the dequantized value is
#: (q - zero_point) * scale in float32 on both sides.
STEP_SLACK = 1e-3


def is_qdq(model: onnx.ModelProto) -> bool:
    """A model quantised in QDQ form (ORT's quantiser, torch's export): QuantizeLinear/DequantizeLinear pairs."""
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers and Constant-node tensors by name."""
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].type == onnx.AttributeProto.TENSOR:
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return consts


def output_steps(model: onnx.ModelProto) -> dict[str, float]:
    """Graph output -> the quantisation step (largest scale) of the DequantizeLinear it reads, through
    value-preserving ops only; outputs computed in float after the last dequantize are left out."""
    producer = {o: n for n in model.graph.node for o in n.output}
    consts = _constants(model)
    steps: dict[str, float] = {}
    for out in model.graph.output:
        node = producer.get(out.name)
        while node is not None and node.op_type in _VALUE_PRESERVING:
            node = producer.get(node.input[0])
        if node is not None and node.op_type == "DequantizeLinear" and node.input[1] in consts:
            steps[out.name] = float(np.max(np.abs(consts[node.input[1]])))
    return steps


def qdq_tolerances(model: onnx.ModelProto) -> dict[str, Tolerance]:
    """QDQ_STEPS quantisation steps per dequantized output: fuseguard and ONNX Runtime (optimisations off)
    both compute a QDQ graph's Q/DQ pairs in float; they differ only where a value sits on a rounding
    boundary."""
    return {name: Tolerance(atol=QDQ_STEPS * step * (1 + STEP_SLACK), rtol=0.0)
            for name, step in output_steps(model).items()}


def without_activation_quant(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """The model with every activation's QuantizeLinear -> DequantizeLinear pair taken out (the DQ's output is
    the Q's input again); the weights' DQs (of constants) stay, as their fp32 originals are not in the file.
    Returns the copy and the number of pairs removed."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    consts = _constants(model)
    producer = {o: n for n in graph.node for o in n.output}
    removed = 0
    for pos, node in enumerate(list(graph.node)):
        if node.op_type != "DequantizeLinear":
            continue
        q = producer.get(node.input[0])
        if q is None or q.op_type != "QuantizeLinear" or q.input[0] in consts:
            continue
        graph.node[pos].CopyFrom(onnx.helper.make_node("Identity", [q.input[0]], [node.output[0]],
                                                       name=(node.name or node.output[0]) + "/fp32"))
        removed += 1
    return out, removed


@dataclass
class QuantisationError:
    """Information only, for int8 QDQ models: each build and ONNX Runtime's int8 run against the fp32 model
    (activation quantisation removed, ONNX Runtime), per float output. No verdict depends on it."""

    pairs_removed: int
    #: output -> {"fused" | "unfused" | "onnxruntime int8": max abs error vs the fp32 model}
    max_abs: dict[str, dict[str, float]] = field(default_factory=dict)
    #: output -> max abs value of the fp32 model's output (the scale the errors are read against)
    scale: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        if not self.max_abs:
            return "vs the fp32 model: no float outputs"
        name = max(self.max_abs, key=lambda n: self.max_abs[n].get("fused", 0.0) / (self.scale[n] or 1.0))
        errs = ", ".join(f"{k} {v:.3g}" for k, v in self.max_abs[name].items())
        return (f"quantisation error vs the fp32 model ({self.pairs_removed} activation Q/DQ pairs removed, "
                f"information only), max abs on {name} (|fp32| <= {self.scale[name]:.3g}): {errs}")

    def to_dict(self) -> dict[str, Any]:
        return {"pairs_removed": self.pairs_removed, "max_abs": self.max_abs, "scale": self.scale,
                "summary": self.summary()}


def quantisation_error(model: onnx.ModelProto, inputs: Mapping[str, np.ndarray], runs: Mapping[str, Mapping[str, np.ndarray]],
                       run_onnxruntime: Any) -> QuantisationError | None:
    """`runs`: {"fused": outputs, "unfused": outputs, "onnxruntime int8": outputs}, each by output name. None when
    the model has no activation Q/DQ pair to take out."""
    fp32_model, removed = without_activation_quant(model)
    if not removed:
        return None
    gold = run_onnxruntime(fp32_model, inputs)
    result = QuantisationError(pairs_removed=removed)
    for name, g in gold.items():
        g = np.asarray(g)
        if not np.issubdtype(g.dtype, np.floating):
            continue
        result.scale[name] = float(np.max(np.abs(g))) if g.size else 0.0
        result.max_abs[name] = {label: float(np.max(np.abs(np.asarray(out[name], np.float64) - g))) if g.size else 0.0
                                for label, out in runs.items() if name in out}
    return result
