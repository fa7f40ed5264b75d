"""The built-in model suite: ONNX graphs built at test time, each exercising known fusion patterns.

Models are built with ``onnx.helper`` from a seed instead of being stored as binaries, so the
repository stays small and every free dimension (batch, sequence length, image size) can be
drawn by hypothesis. Graph shapes follow what real exporters emit (PyTorch's decomposed GELU
and LayerNorm, HuggingFace's BERT attention), because those are the subgraphs the fusion
patterns must recognise.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fuseguard.suites import light

Dims = dict[str, int]
Shape = tuple[int, ...]
InputSampler = Callable[[Shape, np.random.Generator], np.ndarray]
GeluForm = Literal["erf", "tanh"]

OPSET = 17
"""Default opset: the first with the LayerNormalization op, and what current exporters target."""

GELU_OP_OPSET = 20
"""The Gelu op only exists from opset 20."""

MASKED_BIAS = -10000.0
"""Additive attention bias for padded positions, as BERT exporters write it."""

FUSION_TAGS: frozenset[str] = frozenset({
    "conv_bn_relu",          # Conv -> BatchNormalization -> Relu
    "conv_bn_affine_relu",   # Conv -> BatchNormalization -> Mul -> Add -> Relu (caffe2 exports)
    "conv_relu",             # Conv (+bias) -> Relu, no BatchNormalization
    "matmul_bias_gelu",      # MatMul -> Add bias -> GELU (erf or tanh, decomposed)
    "gelu_tanh",             # ... where the GELU is the tanh approximation
    "gemm_gelu",             # Gemm -> Gelu op (opset 20)
    "layernorm",             # LayerNormalization, op or decomposed
    "layernorm_decomposed",  # ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add chain
    "softmax",               # a Softmax worth fusing with its producer or consumer
    "attention",             # MatMul(Q, K^T) -> scale -> (+mask) -> Softmax -> MatMul(V)
    "conv_relu6",            # Conv -> Clip(0, 6)
    "conv_silu",             # Conv -> x * Sigmoid(x)
    "conv_hardswish",        # Conv -> HardSwish
    "conv_leaky_relu",       # Conv -> LeakyRelu
    "conv_narrow",           # Conv with fewer than 16 output channels (vector-width tails)
})
"""Every tag a suite model may carry; each names a fusion pattern (or variant) it exercises."""


# --------------------------------------------------------------------------------------------
# Input samplers: what the harness should feed each input so that results mean something.
# --------------------------------------------------------------------------------------------


def standard_normal(shape: Shape, rng: np.random.Generator) -> np.ndarray:
    """Unit-scale float32 activations: the default for every data input."""
    return rng.standard_normal(shape, dtype=np.float32)


def _kept_lengths(batch: int, seq: int, rng: np.random.Generator) -> np.ndarray:
    """Per-row count of real (unpadded) tokens; at least one, so no row is masked entirely."""
    return rng.integers(1, seq + 1, size=batch)


def padding_mask(shape: Shape, rng: np.random.Generator) -> np.ndarray:
    """BERT ``attention_mask`` [batch, seq]: 1.0 for real tokens, then 0.0 for right padding."""
    batch, seq = shape
    lengths = _kept_lengths(batch, seq, rng)
    return (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float32)


def additive_padding_mask(shape: Shape, rng: np.random.Generator) -> np.ndarray:
    """Additive attention bias [batch, 1, 1, seq]: 0 for real tokens, -10000 for right padding."""
    batch, seq = shape[0], shape[-1]
    keep = padding_mask((batch, seq), rng)
    return ((1.0 - keep) * MASKED_BIAS).astype(np.float32).reshape(shape)


# --------------------------------------------------------------------------------------------
# The registry entry.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SuiteModel:
    """One suite model: how to build it, which dims it takes, and what it exercises.

    ``build(**dims, seed=...)`` returns a fresh ModelProto with static shapes for those dims.
    ``dim_ranges`` bounds what strategies draw (inclusive); explicit dims may go beyond.
    """

    name: str
    build: Callable[..., onnx.ModelProto]
    default_dims: Mapping[str, int]
    dim_ranges: Mapping[str, tuple[int, int]]
    tags: frozenset[str]
    shapes: Callable[[Dims], dict[str, Shape]]
    slow: bool = False
    samplers: Mapping[str, InputSampler] = field(default_factory=dict)
    description: str = ""
    #: dims the ONNX itself names (`dim_param`, a torch `dynamic_axes` export): `--dynamic` keeps them
    #: symbolic without relabelling; their draw ranges are in `dim_ranges`
    dynamic_dims: tuple[str, ...] = ()

    def resolve_dims(self, dims: Mapping[str, int] | None = None) -> Dims:
        """Defaults overlaid with ``dims``; unknown names and non-positive sizes are rejected."""
        given = dict(dims or {})
        unknown = sorted(set(given) - set(self.default_dims))
        if unknown:
            raise ValueError(f"{self.name}: unknown dims {unknown}; it takes {sorted(self.default_dims)}")
        bad = {k: v for k, v in given.items() if isinstance(v, bool) or not isinstance(v, Integral) or v < 1}
        if bad:
            raise ValueError(f"{self.name}: dims must be positive ints, got {bad}")
        return {**self.default_dims, **{k: int(v) for k, v in given.items()}}

    def input_shapes(self, dims: Mapping[str, int] | None = None) -> dict[str, Shape]:
        """Graph input name -> static shape for ``dims`` (missing dims take their defaults)."""
        return self.shapes(self.resolve_dims(dims))

    def make(self, dims: Mapping[str, int] | None = None, seed: int = 0) -> onnx.ModelProto:
        """Build the model for ``dims`` (defaults filled in) with weights drawn from ``seed``."""
        return self.build(**self.resolve_dims(dims), seed=seed)

    def dynamic_axes(self, names: Sequence[str]) -> dict[str, dict[int, str]]:
        """{input or output: {axis: dim name}} for the axes that the dims `names` size, as
        `torch.onnx.export(dynamic_axes=...)` writes them: found by building the model at the default dims
        and with each dim one larger (every axis that changes is that dim's)."""
        if all(n in self.dynamic_dims for n in names):
            return {}       # already named in the export

        def io_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
            return {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
                    for vi in list(model.graph.input) + list(model.graph.output)}

        base_dims = self.resolve_dims()
        base = io_shapes(self.make(base_dims))
        out: dict[str, dict[int, str]] = {}
        for name in names:
            bumped = io_shapes(self.make({**base_dims, name: base_dims[name] + 1}))
            for tensor, dims in base.items():
                for axis, (a, b) in enumerate(zip(dims, bumped.get(tensor, dims))):
                    if a != b:
                        out.setdefault(tensor, {})[axis] = name
        return out

    def random_inputs(self, dims: Mapping[str, int] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
        """Inputs for one run; masks get realistic padding instead of noise."""
        rng = np.random.default_rng(seed)
        return {
            name: self.samplers.get(name, standard_normal)(shape, rng)
            for name, shape in self.input_shapes(dims).items()
        }


# --------------------------------------------------------------------------------------------
# Graph construction helpers.
# --------------------------------------------------------------------------------------------


class _GraphBuilder:
    """Accumulates nodes and seeded initializers; every op gets a fresh, readable output name."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set()

    def _fresh(self, hint: str) -> str:
        name, n = hint, 1
        while name in self._names:
            n += 1
            name = f"{hint}_{n}"
        self._names.add(name)
        return name

    def const(self, name: str, values: np.ndarray | float | Sequence[int]) -> str:
        """An initializer; Python floats become float32 scalars, int sequences int64 vectors."""
        if isinstance(values, float):
            array = np.array(values, dtype=np.float32)
        elif isinstance(values, np.ndarray):
            array = values
        else:
            array = np.array(values, dtype=np.int64)
        name = self._fresh(name)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def normal(self, name: str, shape: Shape, std: float) -> str:
        return self.const(name, (self.rng.standard_normal(shape) * std).astype(np.float32))

    def uniform(self, name: str, shape: Shape, low: float, high: float) -> str:
        return self.const(name, self.rng.uniform(low, high, shape).astype(np.float32))

    def op(self, op_type: str, inputs: Sequence[str], out: str | None = None, **attrs: object) -> str:
        """Append one single-output node; ``out`` fixes the output name (graph outputs)."""
        out = self._fresh(out or op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=f"{out}_node", **attrs))
        return out

    def model(
        self,
        name: str,
        inputs: Mapping[str, Shape],
        outputs: Mapping[str, Shape],
        opset: int = OPSET,
    ) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            name,
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in inputs.items()],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in outputs.items()],
            initializer=self.initializers,
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="fuseguard")


def _linear(g: _GraphBuilder, x: str, prefix: str, fan_in: int, fan_out: int) -> str:
    """MatMul + bias Add, the form exporters emit for nn.Linear on 3-D activations."""
    w = g.normal(f"{prefix}.weight", (fan_in, fan_out), 1.0 / math.sqrt(fan_in))
    b = g.normal(f"{prefix}.bias", (fan_out,), 0.02)
    return g.op("Add", [g.op("MatMul", [x, w]), b])


def _gelu(g: _GraphBuilder, x: str, form: GeluForm, out: str | None = None) -> str:
    """GELU as PyTorch exports it below opset 20, exact (erf) or tanh-approximated."""
    if form == "erf":
        scaled = g.op("Div", [x, g.const("sqrt_2", math.sqrt(2.0))])
        cdf = g.op("Add", [g.op("Erf", [scaled]), g.const("one", 1.0)])
    elif form == "tanh":
        cubic = g.op("Mul", [g.op("Pow", [x, g.const("three", 3.0)]), g.const("gelu_kappa", 0.044715)])
        inner = g.op("Mul", [g.op("Add", [x, cubic]), g.const("sqrt_2_over_pi", math.sqrt(2.0 / math.pi))])
        cdf = g.op("Add", [g.op("Tanh", [inner]), g.const("one", 1.0)])
    else:
        raise ValueError(f"unknown GELU form {form!r}; use 'erf' or 'tanh'")
    return g.op("Mul", [g.op("Mul", [x, cdf]), g.const("half", 0.5)], out=out)


def _layernorm_op(g: _GraphBuilder, x: str, prefix: str, width: int, eps: float) -> str:
    gamma = g.uniform(f"{prefix}.weight", (width,), 0.5, 1.5)
    beta = g.normal(f"{prefix}.bias", (width,), 0.1)
    return g.op("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=eps)


def _layernorm_decomposed(g: _GraphBuilder, x: str, prefix: str, width: int, eps: float, out: str) -> str:
    """LayerNorm as exported below opset 17: ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add."""
    centered = g.op("Sub", [x, g.op("ReduceMean", [x], axes=[-1], keepdims=1)])
    variance = g.op("ReduceMean", [g.op("Pow", [centered, g.const("two", 2.0)])], axes=[-1], keepdims=1)
    std = g.op("Sqrt", [g.op("Add", [variance, g.const(f"{prefix}.eps", eps)])])
    gamma = g.uniform(f"{prefix}.weight", (width,), 0.5, 1.5)
    beta = g.normal(f"{prefix}.bias", (width,), 0.1)
    return g.op("Add", [g.op("Mul", [g.op("Div", [centered, std]), gamma]), beta], out=out)


def _conv(g: _GraphBuilder, x: str, prefix: str, c_in: int, c_out: int, *, bias: bool) -> str:
    """3x3, stride 1, same padding; He-normal weights so a ReLU stack keeps unit scale."""
    w = g.normal(f"{prefix}.weight", (c_out, c_in, 3, 3), math.sqrt(2.0 / (c_in * 9)))
    inputs = [x, w] + ([g.normal(f"{prefix}.bias", (c_out,), 0.1)] if bias else [])
    return g.op("Conv", inputs, kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])


def _batchnorm(g: _GraphBuilder, x: str, prefix: str, channels: int) -> str:
    """Inference BatchNormalization with positive scale and variance, small shift and mean."""
    scale = g.uniform(f"{prefix}.weight", (channels,), 0.5, 1.5)
    shift = g.normal(f"{prefix}.bias", (channels,), 0.1)
    mean = g.normal(f"{prefix}.running_mean", (channels,), 0.1)
    var = g.uniform(f"{prefix}.running_var", (channels,), 0.5, 1.5)
    return g.op("BatchNormalization", [x, scale, shift, mean, var], epsilon=1e-5)


def _attention_core(g: _GraphBuilder, q: str, k_t: str, v: str, scale: float, mask: str | None, out: str | None) -> str:
    """softmax(Q @ K^T * scale + mask) @ V, with K already transposed."""
    scores = g.op("Mul", [g.op("MatMul", [q, k_t]), g.const("attention_scale", scale)])
    if mask is not None:
        scores = g.op("Add", [scores, mask])
    return g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v], out=out)


# --------------------------------------------------------------------------------------------
# Transformer-style models.
# --------------------------------------------------------------------------------------------

BERT_HIDDEN = 768
BERT_HEADS = 12
BERT_HEAD_DIM = 64
BERT_FFN = 3072
BERT_LN_EPS = 1e-12
SOFTMAX_LN_WIDTH = 256
SOFTMAX_LN_EPS = 1e-5


def build_mlp_gelu(*, batch: int = 1, seq: int = 16, gelu: GeluForm = "erf", seed: int = 0) -> onnx.ModelProto:
    """BERT's feed-forward block: Linear(768->3072) -> GELU -> Linear(3072->768) on x[batch, seq, 768]."""
    g = _GraphBuilder(seed)
    hidden = _gelu(g, _linear(g, "x", "fc1", BERT_HIDDEN, BERT_FFN), gelu)
    w2 = g.normal("fc2.weight", (BERT_FFN, BERT_HIDDEN), 1.0 / math.sqrt(BERT_FFN))
    g.op("Add", [g.op("MatMul", [hidden, w2]), g.normal("fc2.bias", (BERT_HIDDEN,), 0.02)], out="y")
    shape = (batch, seq, BERT_HIDDEN)
    return g.model(f"mlp_gelu_{gelu}", {"x": shape}, {"y": shape})


def build_bert_encoder(*, batch: int = 1, seq: int = 32, seed: int = 0) -> onnx.ModelProto:
    """One BERT-base encoder layer as HuggingFace exports it at opset 17.

    Reshapes use ``[0, 0, heads, head_dim]`` / ``[0, 0, hidden]`` so batch and sequence length
    are never baked into the graph, only into the input shapes.
    """
    g = _GraphBuilder(seed)
    x = "hidden_states"
    heads_shape = g.const("heads_shape", [0, 0, BERT_HEADS, BERT_HEAD_DIM])

    def split_heads(t: str, perm: Sequence[int]) -> str:
        return g.op("Transpose", [g.op("Reshape", [t, heads_shape])], perm=list(perm))

    mask = g.op("Unsqueeze", ["attention_mask", g.const("mask_axes", [1, 2])])
    mask_bias = g.op("Mul", [g.op("Sub", [g.const("one", 1.0), mask]), g.const("masked_bias", MASKED_BIAS)])

    q = split_heads(_linear(g, x, "attention.query", BERT_HIDDEN, BERT_HIDDEN), (0, 2, 1, 3))
    k_t = split_heads(_linear(g, x, "attention.key", BERT_HIDDEN, BERT_HIDDEN), (0, 2, 3, 1))
    v = split_heads(_linear(g, x, "attention.value", BERT_HIDDEN, BERT_HIDDEN), (0, 2, 1, 3))
    context = _attention_core(g, q, k_t, v, 1.0 / math.sqrt(BERT_HEAD_DIM), mask_bias, None)
    merged = g.op("Reshape", [g.op("Transpose", [context], perm=[0, 2, 1, 3]),
                              g.const("merged_shape", [0, 0, BERT_HIDDEN])])
    attended = g.op("Add", [_linear(g, merged, "attention.output", BERT_HIDDEN, BERT_HIDDEN), x])
    attended = _layernorm_op(g, attended, "attention.layernorm", BERT_HIDDEN, BERT_LN_EPS)

    ffn = _gelu(g, _linear(g, attended, "intermediate", BERT_HIDDEN, BERT_FFN), "erf")
    ffn_out = g.op("Add", [_linear(g, ffn, "output", BERT_FFN, BERT_HIDDEN), attended])
    gamma = g.uniform("output.layernorm.weight", (BERT_HIDDEN,), 0.5, 1.5)
    beta = g.normal("output.layernorm.bias", (BERT_HIDDEN,), 0.1)
    g.op("LayerNormalization", [ffn_out, gamma, beta], out="output", axis=-1, epsilon=BERT_LN_EPS)

    hidden = (batch, seq, BERT_HIDDEN)
    return g.model("bert_encoder", {x: hidden, "attention_mask": (batch, seq)}, {"output": hidden})


def build_softmax_layernorm(*, batch: int = 1, seq: int = 16, seed: int = 0) -> onnx.ModelProto:
    """Softmax over the last axis, normalised twice: decomposed LayerNorm and the opset-17 op.

    Both branches read the same Softmax, so a fusion that folds the Softmax into one branch
    must still leave a correct value for the other.
    """
    g = _GraphBuilder(seed)
    probs = g.op("Softmax", ["x"], axis=-1)
    _layernorm_decomposed(g, probs, "ln_decomposed", SOFTMAX_LN_WIDTH, SOFTMAX_LN_EPS, out="layernorm_decomposed")
    gamma = g.uniform("ln_op.weight", (SOFTMAX_LN_WIDTH,), 0.5, 1.5)
    beta = g.normal("ln_op.bias", (SOFTMAX_LN_WIDTH,), 0.1)
    g.op("LayerNormalization", [probs, gamma, beta], out="layernorm_op", axis=-1, epsilon=SOFTMAX_LN_EPS)
    shape = (batch, seq, SOFTMAX_LN_WIDTH)
    return g.model("softmax_layernorm", {"x": shape}, {"layernorm_decomposed": shape, "layernorm_op": shape})


def build_attention(
    *, batch: int = 1, seq: int = 64, heads: int = BERT_HEADS, head_dim: int = BERT_HEAD_DIM,
    masked: bool = False, seed: int = 0,
) -> onnx.ModelProto:
    """Scaled dot-product attention on q, k, v [batch, heads, seq, head_dim]; the fused-attention target.

    With ``masked`` an additive ``mask`` [batch, 1, 1, seq] (0 keep, -10000 pad) joins the scores.
    ``seed`` is accepted for a uniform signature; the graph has no random weights.
    """
    del seed
    g = _GraphBuilder(0)
    k_t = g.op("Transpose", ["k"], perm=[0, 1, 3, 2])
    _attention_core(g, "q", k_t, "v", 1.0 / math.sqrt(head_dim), "mask" if masked else None, out="output")
    qkv = (batch, heads, seq, head_dim)
    inputs = {"q": qkv, "k": qkv, "v": qkv} | ({"mask": (batch, 1, 1, seq)} if masked else {})
    return g.model("attention_masked" if masked else "attention", inputs, {"output": qkv})


# --------------------------------------------------------------------------------------------
# Convolutional models.
# --------------------------------------------------------------------------------------------

CONV_BN_CHANNELS = 64
PATTERN_CHANNELS = 16
NARROW_IN_CHANNELS = 3
NARROW_OUT_CHANNELS = 6
PATTERN_GEMM_IN = 64
PATTERN_GEMM_OUT = 256


def build_conv_bn_relu(*, batch: int = 1, size: int = 16, seed: int = 0) -> onnx.ModelProto:
    """Two Conv3x3 -> BatchNorm -> ReLU stages (64 -> 64 channels); the first Conv has a bias, the second not."""
    g = _GraphBuilder(seed)
    c = CONV_BN_CHANNELS
    h = g.op("Relu", [_batchnorm(g, _conv(g, "x", "conv1", c, c, bias=True), "bn1", c)])
    g.op("Relu", [_batchnorm(g, _conv(g, h, "conv2", c, c, bias=False), "bn2", c)], out="y")
    shape = (batch, c, size, size)
    return g.model("conv_bn_relu", {"x": shape}, {"y": shape})


ConvActivation = Literal["relu6", "silu", "hardswish", "leaky_relu"]


def build_pattern_conv_activation(
    *, activation: ConvActivation, batch: int = 1, size: int = 16, seed: int = 0
) -> onnx.ModelProto:
    """Conv3x3 (16 -> 16, bias) followed by one activation in the form exporters emit for it."""
    g = _GraphBuilder(seed)
    c = PATTERN_CHANNELS
    conv = _conv(g, "x", "conv", c, c, bias=True)
    match activation:
        case "relu6":
            g.op("Clip", [conv, g.const("clip_min", 0.0), g.const("clip_max", 6.0)], out="y")
        case "silu":
            g.op("Mul", [conv, g.op("Sigmoid", [conv])], out="y")
        case "hardswish":
            g.op("HardSwish", [conv], out="y")
        case "leaky_relu":
            g.op("LeakyRelu", [conv], out="y", alpha=0.1)
        case _:
            raise ValueError(f"unknown activation {activation!r}")
    shape = (batch, c, size, size)
    return g.model(f"pattern_conv_{activation}", {"x": shape}, {"y": shape})


def build_pattern_conv_narrow(*, batch: int = 1, size: int = 16, seed: int = 0) -> onnx.ModelProto:
    """An RGB stem: Conv3x3 3 -> 6 channels -> BatchNorm -> ReLU; channel counts below any vector width."""
    g = _GraphBuilder(seed)
    conv = _conv(g, "x", "conv", NARROW_IN_CHANNELS, NARROW_OUT_CHANNELS, bias=True)
    g.op("Relu", [_batchnorm(g, conv, "bn", NARROW_OUT_CHANNELS)], out="y")
    return g.model(
        "pattern_conv_narrow",
        {"x": (batch, NARROW_IN_CHANNELS, size, size)},
        {"y": (batch, NARROW_OUT_CHANNELS, size, size)},
    )


def build_pattern_gemm_gelu(*, tokens: int = 64, seed: int = 0) -> onnx.ModelProto:
    """Gemm(x[tokens, 64], W[64, 256]) + bias -> the opset-20 Gelu op (exact form)."""
    g = _GraphBuilder(seed)
    w = g.normal("fc.weight", (PATTERN_GEMM_IN, PATTERN_GEMM_OUT), 1.0 / math.sqrt(PATTERN_GEMM_IN))
    b = g.normal("fc.bias", (PATTERN_GEMM_OUT,), 0.02)
    g.op("Gelu", [g.op("Gemm", ["x", w, b])], out="y", approximate="none")
    return g.model(
        "pattern_gemm_gelu", {"x": (tokens, PATTERN_GEMM_IN)}, {"y": (tokens, PATTERN_GEMM_OUT)}, opset=GELU_OP_OPSET
    )


def build_pattern_matmul_gelu_tanh(*, batch: int = 1, seq: int = 16, seed: int = 0) -> onnx.ModelProto:
    """MatMul(x[batch, seq, 64], W[64, 256]) + bias -> decomposed tanh GELU (GPT-2's ``gelu_new``)."""
    g = _GraphBuilder(seed)
    _gelu(g, _linear(g, "x", "fc", PATTERN_GEMM_IN, PATTERN_GEMM_OUT), "tanh", out="y")
    return g.model(
        "pattern_matmul_gelu_tanh",
        {"x": (batch, seq, PATTERN_GEMM_IN)},
        {"y": (batch, seq, PATTERN_GEMM_OUT)},
    )


# --------------------------------------------------------------------------------------------
# Registry.
# --------------------------------------------------------------------------------------------

_BATCH = (1, 2)


def _image(channels: int, input_name: str = "x") -> Callable[[Dims], dict[str, Shape]]:
    return lambda d: {input_name: (d["batch"], channels, d["size"], d["size"])}


def _tokens(width: int, input_name: str = "x") -> Callable[[Dims], dict[str, Shape]]:
    return lambda d: {input_name: (d["batch"], d["seq"], width)}


def _bert_shapes(d: Dims) -> dict[str, Shape]:
    return {"hidden_states": (d["batch"], d["seq"], BERT_HIDDEN), "attention_mask": (d["batch"], d["seq"])}


def _attention_shapes(masked: bool) -> Callable[[Dims], dict[str, Shape]]:
    def shapes(d: Dims) -> dict[str, Shape]:
        qkv = (d["batch"], BERT_HEADS, d["seq"], BERT_HEAD_DIM)
        return {"q": qkv, "k": qkv, "v": qkv} | ({"mask": (d["batch"], 1, 1, d["seq"])} if masked else {})

    return shapes


def _light_entry(arch: light.LightArchitecture) -> SuiteModel:
    input_name = light.light_input_name(arch.name)
    hw = light.LIGHT_INPUT_HW
    return SuiteModel(
        name=arch.name,
        build=functools.partial(light.build_light_model, arch.name),
        default_dims={"batch": 1},
        dim_ranges={"batch": _BATCH},
        tags=arch.tags,
        shapes=lambda d: {input_name: (d["batch"], 3, hw, hw)},
        slow=arch.slow,
        description=f"{arch.filename} from the onnx wheel, weights randomised, plus a 'logits' output",
    )


def _pattern_conv_entry(activation: ConvActivation, tag: str) -> SuiteModel:
    return SuiteModel(
        name=f"pattern_conv_{activation}",
        build=functools.partial(build_pattern_conv_activation, activation=activation),
        default_dims={"batch": 1, "size": 16},
        dim_ranges={"batch": _BATCH, "size": (8, 32)},
        tags=frozenset({tag}),
        shapes=_image(PATTERN_CHANNELS),
        description=f"Conv3x3 16->16 + {activation}",
    )


@functools.lru_cache(maxsize=1)
def _registry() -> tuple[SuiteModel, ...]:
    models = [
        SuiteModel(
            name="mlp_gelu",
            build=functools.partial(build_mlp_gelu, gelu="erf"),
            default_dims={"batch": 1, "seq": 16},
            dim_ranges={"batch": _BATCH, "seq": (1, 64)},
            tags=frozenset({"matmul_bias_gelu"}),
            shapes=_tokens(BERT_HIDDEN),
            description="768 -> 3072 -> 768 MLP with the erf GELU decomposed",
        ),
        SuiteModel(
            name="mlp_gelu_tanh",
            build=functools.partial(build_mlp_gelu, gelu="tanh"),
            default_dims={"batch": 1, "seq": 16},
            dim_ranges={"batch": _BATCH, "seq": (1, 64)},
            tags=frozenset({"matmul_bias_gelu", "gelu_tanh"}),
            shapes=_tokens(BERT_HIDDEN),
            description="768 -> 3072 -> 768 MLP with the tanh-approximated GELU decomposed",
        ),
        SuiteModel(
            name="conv_bn_relu",
            build=build_conv_bn_relu,
            default_dims={"batch": 1, "size": 16},
            dim_ranges={"batch": _BATCH, "size": (8, 56)},
            tags=frozenset({"conv_bn_relu"}),
            shapes=_image(CONV_BN_CHANNELS),
            description="2 x (Conv3x3 -> BatchNorm -> ReLU), 64 channels",
        ),
        SuiteModel(
            name="bert_encoder",
            build=build_bert_encoder,
            default_dims={"batch": 1, "seq": 32},
            dim_ranges={"batch": _BATCH, "seq": (1, 128)},
            tags=frozenset({"attention", "softmax", "layernorm", "matmul_bias_gelu"}),
            shapes=_bert_shapes,
            samplers={"attention_mask": padding_mask},
            description="BERT-base encoder layer (12 heads) with a padding mask",
        ),
        SuiteModel(
            name="softmax_layernorm",
            build=build_softmax_layernorm,
            default_dims={"batch": 1, "seq": 16},
            dim_ranges={"batch": _BATCH, "seq": (1, 128)},
            tags=frozenset({"softmax", "layernorm", "layernorm_decomposed"}),
            shapes=_tokens(SOFTMAX_LN_WIDTH),
            description="Softmax -> LayerNorm, once decomposed and once as the op",
        ),
        SuiteModel(
            name="attention",
            build=functools.partial(build_attention, masked=False),
            default_dims={"batch": 1, "seq": 64},
            dim_ranges={"batch": _BATCH, "seq": (16, 256)},
            tags=frozenset({"attention", "softmax"}),
            shapes=_attention_shapes(masked=False),
            description="softmax(Q K^T / 8) V on [batch, 12, seq, 64]",
        ),
        SuiteModel(
            name="attention_masked",
            build=functools.partial(build_attention, masked=True),
            default_dims={"batch": 1, "seq": 64},
            dim_ranges={"batch": _BATCH, "seq": (16, 256)},
            tags=frozenset({"attention", "softmax"}),
            shapes=_attention_shapes(masked=True),
            samplers={"mask": additive_padding_mask},
            description="softmax(Q K^T / 8 + mask) V with an additive padding mask",
        ),
        _pattern_conv_entry("relu6", "conv_relu6"),
        _pattern_conv_entry("silu", "conv_silu"),
        _pattern_conv_entry("hardswish", "conv_hardswish"),
        _pattern_conv_entry("leaky_relu", "conv_leaky_relu"),
        SuiteModel(
            name="pattern_conv_narrow",
            build=build_pattern_conv_narrow,
            default_dims={"batch": 1, "size": 16},
            dim_ranges={"batch": _BATCH, "size": (8, 32)},
            tags=frozenset({"conv_bn_relu", "conv_narrow"}),
            shapes=_image(NARROW_IN_CHANNELS),
            description="Conv3x3 3->6 -> BatchNorm -> ReLU",
        ),
        SuiteModel(
            name="pattern_gemm_gelu",
            build=build_pattern_gemm_gelu,
            default_dims={"tokens": 64},
            dim_ranges={"tokens": (1, 128)},
            tags=frozenset({"gemm_gelu"}),
            shapes=lambda d: {"x": (d["tokens"], PATTERN_GEMM_IN)},
            description="Gemm 64->256 + bias -> Gelu op (opset 20)",
        ),
        SuiteModel(
            name="pattern_matmul_gelu_tanh",
            build=build_pattern_matmul_gelu_tanh,
            default_dims={"batch": 1, "seq": 16},
            dim_ranges={"batch": _BATCH, "seq": (1, 64)},
            tags=frozenset({"matmul_bias_gelu", "gelu_tanh"}),
            shapes=_tokens(PATTERN_GEMM_IN),
            description="MatMul 64->256 + bias -> decomposed tanh GELU",
        ),
    ]
    models += [_light_entry(arch) for arch in light.LIGHT_ARCHITECTURES]
    return tuple(models)


def _zoo_entry(entry, peaked: bool = False) -> SuiteModel:
    from fuseguard.suites import zoo

    shapes = {name: shape for name, (shape, _) in entry.inputs.items()}
    return SuiteModel(
        name=entry.name + ("_peaked" if peaked else ""),
        build=lambda seed=0, _name=entry.name: zoo.load_zoo_model(_name, seed=seed, peaked=peaked),
        default_dims={},
        dim_ranges={},
        tags=frozenset(entry.tags),
        shapes=lambda d, _shapes=shapes: dict(_shapes),
        slow=entry.slow,
        description=f"{entry.source}, {entry.exporter} export, weights redrawn (suites/zoo)"
                    + (", attention-score weights scaled up (peaked softmax)" if peaked else ""),
    )


#: Draw ranges of the `_dyn` exports' symbolic dims: the configs' max_position_embeddings is 128.
DYNAMIC_ZOO_RANGES = {"batch": (1, 4), "seq": (1, 128)}


@functools.lru_cache(maxsize=1)
def dynamic_zoo_models() -> tuple[SuiteModel, ...]:
    """The zoo's exports with symbolic dims (`*_dyn.onnx`), for `--dynamic` builds only."""
    from fuseguard.suites import zoo

    out = []
    for e in zoo.zoo_entries():
        if e.dynamic:
            base = _zoo_entry(e)
            out.append(dataclasses.replace(base, dynamic_dims=tuple(e.dynamic),
                                           dim_ranges={d: DYNAMIC_ZOO_RANGES.get(d, (1, 128)) for d in e.dynamic}))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def zoo_models() -> tuple[SuiteModel, ...]:
    """The real-export zoo (suites/zoo): torch.onnx.export output committed without weights."""
    from fuseguard.suites import zoo

    # Each TorchScript transformer also as a peaked variant: large attention logits, where the online
    # softmax of a fused attention kernel differs most from the reference's.
    # The `_dyn` exports (symbolic batch and sequence) are for symbolic builds (dynamic_zoo_models): pinned
    # they are the static exports again.
    static = [e for e in zoo.zoo_entries() if not e.dynamic]
    plain = [_zoo_entry(e) for e in static]
    peaked = [_zoo_entry(e, peaked=True) for e in static
              if "attention" in e.tags and "dynamo" not in e.exporter and not e.slow]
    return tuple(plain + peaked)


#: Models verified and timed under pytest only with `--models-full` (the nightly run): each is the costliest
#: of a family the default run keeps a cheaper member of. Measured cold on a 2-core Zen3, `pytest
#: --durations`: DenseNet-121 172 s (ResNet-50 31 s and SqueezeNet keep the conv-BN-ReLU family), ViT-B/16
#: 107 s (vit_tiny), AlexNet's fusion-pays run 102 s and its verification 13 s (SqueezeNet), EfficientNet-B0
#: 57 s (mobilenet_v2), Inception v1 50 s and v2 44 s (SqueezeNet's and ShuffleNet's concats), the peaked
#: ViT 18 s and GPT-2 10 s (the peaked BERT and LLaMA stay). With them the default run took 40 of its ~30
#: minutes.
FULL_RUN_ONLY = frozenset({"densenet121", "inception_v1", "inception_v2", "alexnet", "vit_b_16", "efficientnet_b0",
                           "gpt2_tiny_peaked", "vit_tiny_peaked"})


def full_run_only(name: str) -> bool:
    """True for a model whose pytest cases run only with `--models-full` (see FULL_RUN_ONLY)."""
    return name in FULL_RUN_ONLY


def suite_models(*, include_slow: bool = True, tag: str | None = None) -> list[SuiteModel]:
    """All suite models in registry order, optionally without the slow ones or only those with ``tag``."""
    if tag is not None and tag not in FUSION_TAGS:
        raise KeyError(f"unknown tag {tag!r}; known: {', '.join(sorted(FUSION_TAGS))}")
    return [
        m for m in _registry()
        if (include_slow or not m.slow) and (tag is None or tag in m.tags)
    ]


def get_model(name: str) -> SuiteModel:
    """The suite model called ``name``; the KeyError lists every known name."""
    every = _registry() + zoo_models() + dynamic_zoo_models()
    for model in every:
        if model.name == name:
            return model
    raise KeyError(f"unknown suite model {name!r}; known: {', '.join(m.name for m in every)}")
