"""Real CNN architectures from the onnx wheel's ``light`` test models, made numerically useful.

The ``light_*.onnx`` files keep the real topology but replace (almost) every weight by
``ConstantOfShape(0.02)``. With constant weights each channel carries the same value, so
outputs are degenerate (ResNet-50's softmax is 0.001 everywhere) and a fused kernel that
mixes up channels, taps or batch rows would still match the reference. We therefore swap
every parameter tensor for seeded random values with sane statistics, drop the
``ConstantOfShape`` plumbing, and expose the pre-softmax logits as an extra output so that a
wrong kernel cannot hide behind a saturated softmax.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

import numpy as np
import onnx
import onnx.backend.test
import onnxruntime as ort
from onnx import helper, numpy_helper

LOGITS_OUTPUT = "logits"
"""Name of the extra graph output holding the input of the final Softmax."""

LIGHT_INPUT_HW = 224
"""Every light model is an ImageNet classifier with a fixed 3x224x224 input."""

_PASS_THROUGH_OPS = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"})
"""Shape-only ops that may sit between a parameter source and the op that consumes it."""

_MIN_IR_VERSION = 4
"""IR 4 lets initializers live outside ``graph.input`` so the data tensor is the only input."""

BN_VARIANCE_FLOOR = 1e-2
"""Smallest measured BatchNormalization variance kept; activations are unit-scale by then."""


class ParamRole(Enum):
    """What a parameter tensor does for its consumer; decides the distribution we draw from."""

    CONV_WEIGHT = "conv_weight"
    DENSE_WEIGHT = "dense_weight"
    BIAS = "bias"
    SCALE = "scale"
    MEAN = "mean"
    VARIANCE = "variance"


@dataclass(frozen=True)
class LightArchitecture:
    """One file of the light suite and the facts about it the registry needs."""

    name: str
    filename: str
    slow: bool
    tags: frozenset[str]


LIGHT_ARCHITECTURES: tuple[LightArchitecture, ...] = (
    LightArchitecture("resnet50", "light_resnet50.onnx", True, frozenset({"conv_bn_relu", "softmax"})),
    LightArchitecture("squeezenet", "light_squeezenet.onnx", False, frozenset({"conv_relu", "softmax"})),
    LightArchitecture("shufflenet", "light_shufflenet.onnx", True, frozenset({"conv_bn_relu", "softmax"})),
    LightArchitecture("inception_v1", "light_inception_v1.onnx", True, frozenset({"conv_relu", "softmax"})),
    # caffe2's SpatialBN exports as BatchNormalization followed by a per-channel Mul and Add.
    LightArchitecture("inception_v2", "light_inception_v2.onnx", True, frozenset({"conv_bn_affine_relu", "softmax"})),
    LightArchitecture("densenet121", "light_densenet121.onnx", True, frozenset({"conv_bn_affine_relu"})),
    # AlexNet carries 61M parameters (~240 MB fp32): kept for its Gemm/LRN head, marked slow.
    # VGG-19 (143M) and ZFNet-512 (~90M) add no pattern AlexNet lacks, so they are left out.
    LightArchitecture("alexnet", "light_bvlc_alexnet.onnx", True, frozenset({"conv_relu", "softmax"})),
)


def light_data_dir() -> str:
    """Folder of the light models inside the installed onnx wheel."""
    return os.path.join(os.path.dirname(onnx.backend.test.__file__), "data", "light")


def light_architecture(name: str) -> LightArchitecture:
    """Look up a light architecture by its suite name."""
    for arch in LIGHT_ARCHITECTURES:
        if arch.name == name:
            return arch
    known = ", ".join(a.name for a in LIGHT_ARCHITECTURES)
    raise KeyError(f"unknown light architecture {name!r}; known: {known}")


@functools.lru_cache(maxsize=None)
def _load_serialized(filename: str) -> bytes:
    """Read a light file once; callers get fresh protos from the cached bytes."""
    with open(os.path.join(light_data_dir(), filename), "rb") as f:
        return f.read()


def load_light_model(filename: str) -> onnx.ModelProto:
    """Load a pristine (constant-weight) light model."""
    return onnx.load_from_string(_load_serialized(filename))


def _int_attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for attr in node.attribute:
        if attr.name == name:
            return int(helper.get_attribute_value(attr))
    return default


def _role_for_slot(node: onnx.NodeProto, slot: int) -> ParamRole | None:
    """Role of a constant fed into ``node`` at input ``slot``; None when it is not a parameter."""
    match node.op_type, slot:
        case "Conv", 1:
            return ParamRole.CONV_WEIGHT
        case "Gemm", 1:
            return ParamRole.DENSE_WEIGHT
        case ("Conv" | "Gemm"), 2:
            return ParamRole.BIAS
        case "BatchNormalization", 1:
            return ParamRole.SCALE
        case "BatchNormalization", 2:
            return ParamRole.BIAS
        case "BatchNormalization", 3:
            return ParamRole.MEAN
        case "BatchNormalization", 4:
            return ParamRole.VARIANCE
        case "Mul", _:
            return ParamRole.SCALE  # caffe2's affine channel scale after a BatchNormalization
        case "Add", _:
            return ParamRole.BIAS  # ... and its channel shift
    return None


def _fan_in(role: ParamRole, shape: tuple[int, ...], consumer: onnx.NodeProto) -> int:
    """Fan-in of a weight; reshapes in between only merge/split leading dims, so use the ends."""
    if role is ParamRole.CONV_WEIGHT:
        return math.prod(shape[1:])
    if _int_attr(consumer, "transB", 0):
        return shape[-1]
    return math.prod(shape[:-1])


def _draw(role: ParamRole, shape: tuple[int, ...], fan_in: int, rng: np.random.Generator) -> np.ndarray:
    """Random values for one parameter: He-normal weights, well-conditioned normalisation stats."""
    f32 = np.float32
    match role:
        case ParamRole.CONV_WEIGHT | ParamRole.DENSE_WEIGHT:
            return rng.standard_normal(shape, dtype=f32) * f32(math.sqrt(2.0 / fan_in))
        case ParamRole.BIAS | ParamRole.MEAN:
            return rng.standard_normal(shape, dtype=f32) * f32(0.1)
        case ParamRole.SCALE | ParamRole.VARIANCE:
            # Strictly positive: no sign-flipped channels, no sqrt of a negative variance.
            return rng.random(shape, dtype=f32) + f32(0.5)
    raise AssertionError(role)


@dataclass(frozen=True)
class _ParamSource:
    """A parameter tensor and the op that finally consumes it."""

    name: str
    role: ParamRole
    consumer: onnx.NodeProto


def _parameter_sources(graph: onnx.GraphProto, constant_shapes: dict[str, tuple[int, ...]]) -> list[_ParamSource]:
    """Every constant tensor (initializer or ConstantOfShape output) used as a model parameter.

    ``constant_shapes`` maps each candidate name to its shape. The walk follows shape-only
    pass-through ops forward so a weight reshaped before its Gemm still gets the Gemm role.
    """
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for slot, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, slot))

    def final_uses(name: str) -> Iterable[tuple[onnx.NodeProto, int]]:
        for node, slot in consumers.get(name, []):
            if node.op_type in _PASS_THROUGH_OPS and slot == 0:
                yield from final_uses(node.output[0])
            else:
                yield node, slot

    sources: list[_ParamSource] = []
    for name in constant_shapes:
        uses = [(role, node) for node, slot in final_uses(name) if (role := _role_for_slot(node, slot))]
        if not uses:
            continue
        roles = {role for role, _ in uses}
        if len(roles) > 1:
            raise ValueError(f"parameter {name!r} plays several roles: {sorted(r.value for r in roles)}")
        role, consumer = uses[0]
        sources.append(_ParamSource(name, role, consumer))
    return sources


def randomize_weights(model: onnx.ModelProto, seed: int, *, calibrate: bool = True) -> onnx.ModelProto:
    """Replace every parameter (ConstantOfShape output or float initializer) by seeded random values.

    Initializers that already hold real values are redrawn too: the light files keep a few
    pretrained BatchNormalization statistics (variances down to 6e-45, up to 5e4) that only
    make sense with the pretrained convolutions, and next to random convolutions they would
    squash or blow up whole channels.

    With ``calibrate`` the BatchNormalization means and variances are then measured instead of
    drawn (see ``batchnorm_statistics``): drawn ones leave residual sums to grow unchecked, and
    ResNet-50's logits reach 1e4-1e5, where fp32 cancellation alone breaks a 1e-4 tolerance.
    """
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}

    fills = {node.output[0]: node for node in graph.node if node.op_type == "ConstantOfShape"}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, node in fills.items():
        if node.input[0] not in inits:
            raise ValueError(f"ConstantOfShape {name!r} has a non-constant shape input {node.input[0]!r}")
        shapes[name] = tuple(int(d) for d in numpy_helper.to_array(inits[node.input[0]]))
    for name, init in inits.items():
        if init.data_type == onnx.TensorProto.FLOAT:
            shapes[name] = tuple(init.dims)

    rng = np.random.default_rng(seed)
    params: dict[str, np.ndarray] = {}
    # Sorted names: the draw order, hence the values, must not depend on node order quirks.
    for source in sorted(_parameter_sources(graph, shapes), key=lambda s: s.name):
        shape = shapes[source.name]
        params[source.name] = _draw(source.role, shape, _fan_in(source.role, shape, source.consumer), rng)

    leftover_fills = sorted(set(fills) - set(params))
    if leftover_fills:
        raise ValueError(f"ConstantOfShape outputs with no recognised parameter role: {leftover_fills}")

    kept_nodes = [node for node in graph.node if node.op_type != "ConstantOfShape"]
    del graph.node[:]
    graph.node.extend(kept_nodes)
    _prune(model, params)
    if calibrate:
        (data,) = graph.input
        image_shape = tuple(d.dim_value for d in data.type.tensor_type.shape.dim)
        params.update(batchnorm_statistics(model, params, rng.standard_normal(image_shape, dtype=np.float32)))
    graph.initializer.extend(numpy_helper.from_array(params[name], name) for name in sorted(params))
    return model


def _prune(model: onnx.ModelProto, params: Mapping[str, np.ndarray]) -> None:
    """Drop dead initializers (ConstantOfShape shapes, unused blobs) and ``params``; keep only data inputs.

    Raises the IR version to 4 if needed, since older IRs demand every initializer be an input.
    """
    graph = model.graph
    used = {name for node in graph.node for name in node.input} | {out.name for out in graph.output}
    kept = [init for init in graph.initializer if init.name in used and init.name not in params]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    constants = {init.name for init in kept} | set(params)
    data_inputs = [inp for inp in graph.input if inp.name in used and inp.name not in constants]
    del graph.input[:]
    graph.input.extend(data_inputs)
    model.ir_version = max(model.ir_version, _MIN_IR_VERSION)


def _float_attr(node: onnx.NodeProto, name: str, default: float) -> float:
    for attr in node.attribute:
        if attr.name == name:
            return float(helper.get_attribute_value(attr))
    return default


def batchnorm_statistics(
    model: onnx.ModelProto, params: Mapping[str, np.ndarray], image: np.ndarray
) -> dict[str, np.ndarray]:
    """Running mean and variance for every (NCHW) BatchNormalization, measured on ``image``.

    One ONNX Runtime pass over a copy of the graph in which each BatchNormalization normalises
    with its own batch statistics (training-mode BN), so each statistic is taken with every BN
    upstream already normalising: the inference graph then reproduces that pass exactly, and
    every BN sees unit-scale input, as in a trained network. Variances are floored at
    ``BN_VARIANCE_FLOOR`` so a channel that is dead on ``image`` is not amplified 300x on
    another input. ``params`` (the weights, absent from ``model``'s initializers) are fed as
    inputs, which spares serialising 100 MB of weights for one run.
    """
    graph = model.graph
    nodes: list[onnx.NodeProto] = []
    consts: list[onnx.TensorProto] = [numpy_helper.from_array(np.float32(BN_VARIANCE_FLOOR), "calib/floor")]
    fetches: dict[str, str] = {}  # statistic tensor -> the BN input it replaces

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    axes_consts: dict[str, onnx.TensorProto] = {}

    def emit(op: str, inputs: list[str], out: str, **attrs: object) -> str:
        # ReduceMean takes axes as an input from opset 18, Unsqueeze from opset 13.
        if "axes" in attrs and ((op == "ReduceMean" and opset >= 18) or (op == "Unsqueeze" and opset >= 13)):
            axes = list(attrs.pop("axes"))  # type: ignore[call-overload]
            key = "calib/axes_" + "_".join(map(str, axes))
            if key not in axes_consts:
                axes_consts[key] = numpy_helper.from_array(np.asarray(axes, np.int64), key)
                consts.append(axes_consts[key])
            inputs = [*inputs, key]
        nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    for node in graph.node:
        if node.op_type != "BatchNormalization":
            nodes.append(node)
            continue
        x, scale, bias, mean_param, var_param = node.input
        at = f"calib/{node.output[0]}"
        eps = numpy_helper.from_array(np.float32(_float_attr(node, "epsilon", 1e-5)), f"{at}/eps")
        consts.append(eps)
        mean = emit("ReduceMean", [x], f"{at}/mean", axes=[0, 2, 3], keepdims=1)
        centered = emit("Sub", [x, mean], f"{at}/centered")
        raw_var = emit("ReduceMean", [emit("Mul", [centered, centered], f"{at}/sq")], f"{at}/raw_var",
                       axes=[0, 2, 3], keepdims=1)
        var = emit("Max", [raw_var, "calib/floor"], f"{at}/var")
        std = emit("Sqrt", [emit("Add", [var, eps.name], f"{at}/var_eps")], f"{at}/std")
        scaled = emit("Mul", [emit("Div", [centered, std], f"{at}/normed"),
                              emit("Unsqueeze", [scale], f"{at}/scale", axes=[1, 2])], f"{at}/scaled")
        emit("Add", [scaled, emit("Unsqueeze", [bias], f"{at}/bias", axes=[1, 2])], node.output[0])
        fetches[mean], fetches[var] = mean_param, var_param
    if not fetches:
        return {}

    used = {name for node in nodes for name in node.input}
    fed = {name: value for name, value in params.items() if name in used}
    initialized = {t.name for t in graph.initializer}
    (data,) = [i for i in graph.input if i.name not in initialized]
    calibration = helper.make_model(
        helper.make_graph(
            nodes,
            "batchnorm_calibration",
            [data] + [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, v.shape) for n, v in fed.items()],
            [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in fetches],
            initializer=list(graph.initializer) + consts,
        ),
        opset_imports=list(model.opset_import),
        ir_version=model.ir_version,
    )
    session = ort.InferenceSession(calibration.SerializeToString(), providers=["CPUExecutionProvider"])
    measured = session.run(list(fetches), {data.name: image, **fed})
    return {fetches[name]: value.reshape(-1) for name, value in zip(fetches, measured)}


def _activation_tensors(graph: onnx.GraphProto) -> set[str]:
    """Names of tensors computed from a graph input (as opposed to folded from constants)."""
    live = {inp.name for inp in graph.input}
    for node in graph.node:  # ONNX graphs are topologically sorted
        if any(name in live for name in node.input):
            live.update(node.output)
    return live


def set_batch(model: onnx.ModelProto, batch: int) -> None:
    """Give the model a static batch size: data input, outputs, and the activation Reshape targets.

    The caffe2 exports bake batch 1 into every activation Reshape shape (e.g. ``[1, 2048]``,
    shufflenet's channel shuffle ``[1, 4, 28, 56, 56]``); their leading 1 becomes ``batch``.
    """
    graph = model.graph
    for value in list(graph.input) + list(graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = batch
    if batch == 1:
        return
    live = _activation_tensors(graph)
    inits = {init.name: init for init in graph.initializer}
    shape_users: dict[str, list[bool]] = {}
    for node in graph.node:
        if node.op_type == "Reshape":
            shape_users.setdefault(node.input[1], []).append(node.input[0] in live)
    for name, on_activation in shape_users.items():
        if not any(on_activation):
            continue  # a weight reshape, independent of the batch
        if not all(on_activation) or name not in inits:
            raise ValueError(f"Reshape shape {name!r} cannot be rewritten for batch {batch}")
        target = numpy_helper.to_array(inits[name]).copy()
        if target[0] != 1:
            raise ValueError(f"Reshape shape {name!r} = {target.tolist()} does not lead with the batch")
        target[0] = batch
        inits[name].CopyFrom(numpy_helper.from_array(target, name))


def expose_logits(model: onnx.ModelProto) -> onnx.ModelProto:
    """If an output comes straight from a Softmax, also output that Softmax's input as ``logits``.

    The pre-softmax tensor is renamed rather than copied through an Identity, so the graph
    that the fusion passes see is unchanged.
    """
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    softmax = next(
        (producers[o.name] for o in graph.output if o.name in producers and producers[o.name].op_type == "Softmax"),
        None,
    )
    if softmax is None:
        return model
    old = softmax.input[0]
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = LOGITS_OUTPUT
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = LOGITS_OUTPUT
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    info = next(v for v in inferred.graph.value_info if v.name == LOGITS_OUTPUT)
    graph.output.append(info)
    return model


def build_light_model(name: str, *, batch: int = 1, seed: int = 0, calibrate: bool = True) -> onnx.ModelProto:
    """A light architecture with seeded random weights, static ``batch`` and a ``logits`` output.

    The weights depend on ``seed`` only (calibration runs at batch 1), never on ``batch``.
    """
    arch = light_architecture(name)
    # Logits first: shape inference is cheap on the constant-weight file, slow on 100 MB of weights.
    model = randomize_weights(expose_logits(load_light_model(arch.filename)), seed, calibrate=calibrate)
    set_batch(model, batch)
    model.graph.name = arch.name
    return model


@functools.lru_cache(maxsize=None)
def light_input_name(name: str) -> str:
    """Name of the image input of a light architecture (``data_0`` or ``gpu_0/data_0``)."""
    graph = load_light_model(light_architecture(name).filename).graph
    init_names = {init.name for init in graph.initializer}
    (data,) = [inp.name for inp in graph.input if inp.name not in init_names]
    return data
