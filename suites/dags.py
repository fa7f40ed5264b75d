"""Random DAGs over the ops the fusion patterns match, built as ONNX models from a plain recipe.

A recipe is a list of steps `(op, operand indices)`; step i's operands index earlier values (value 0
is the graph input). Sharing a value between steps makes the fan-out and reconvergence (residuals,
pre-LN blocks) where an illegal fusion group can form. Every value no step consumes becomes a graph
output, so nothing is dead and intermediates escape groups the way real models' do.

Two families keep shapes compatible: "seq" ([1, S, D] tensors: MatMul, Add, LayerNorm, GELU, Softmax,
attention) and "image" ([1, C, H, W]: Conv, BatchNorm, ReLU, Clip, Add). The hypothesis strategy that
draws recipes is `suites.strategies.dag_recipes`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: op -> number of tensor operands, per family.
SEQ_OPS: dict[str, int] = {"matmul": 1, "add_const": 1, "add": 2, "mul_const": 1, "layernorm": 1,
                           "layernorm_decomposed": 1, "rmsnorm_decomposed": 1, "silu_gated_mlp": 1, "gelu_erf": 1, "softmax": 1,
                           "relu": 1, "attention": 3}
IMAGE_OPS: dict[str, int] = {"conv": 1, "conv_bias": 1, "batchnorm": 1, "relu": 1, "clip": 1, "add": 2,
                             "add_const": 1}
FAMILIES = {"seq": SEQ_OPS, "image": IMAGE_OPS}


@dataclass(frozen=True)
class Recipe:
    family: str
    steps: tuple[tuple[str, tuple[int, ...]], ...]

    def __post_init__(self) -> None:
        ops = FAMILIES.get(self.family)
        if ops is None:
            raise ValueError(f"unknown DAG family {self.family!r}; families: {', '.join(FAMILIES)}")
        for i, (op, operands) in enumerate(self.steps):
            if op not in ops:
                raise ValueError(f"step {i}: op {op!r} is not in the {self.family} family")
            if len(operands) != ops[op] or not all(0 <= j <= i for j in operands):
                raise ValueError(f"step {i}: {op} needs {ops[op]} operands among values 0..{i}, got {operands}")


def build_dag(recipe: Recipe, *, seed: int = 0, seq: int = 8, dim: int = 16, channels: int = 16,
              size: int = 8) -> onnx.ModelProto:
    """The recipe as an ONNX model with seeded weights (opset 17)."""
    rng = np.random.default_rng(seed)
    shape = [1, seq, dim] if recipe.family == "seq" else [1, channels, size, size]
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    counter = [0]

    def name(prefix: str) -> str:
        counter[0] += 1
        return f"{prefix}{counter[0]}"

    def const(arr: np.ndarray) -> str:
        n = name("w")
        inits.append(numpy_helper.from_array(np.asarray(arr, np.float32), n))
        return n

    def node(op: str, inputs: Sequence[str], **attrs) -> str:
        out = name(op.lower() + "_")
        nodes.append(helper.make_node(op, list(inputs), [out], name=out, **attrs))
        return out

    width = shape[-1] if recipe.family == "seq" else channels
    values = ["x"]
    for op, operands in recipe.steps:
        a = [values[j] for j in operands]
        if op == "matmul":
            out = node("MatMul", [a[0], const(rng.normal(size=(width, width)) / math.sqrt(width))])
        elif op == "add_const" and recipe.family == "seq":
            out = node("Add", [a[0], const(rng.normal(size=(width,)) * 0.1)])
        elif op == "add_const":
            out = node("Add", [a[0], const(rng.normal(size=(channels, 1, 1)) * 0.1)])
        elif op == "add":
            out = node("Add", a)
        elif op == "mul_const":
            out = node("Mul", [a[0], const(rng.uniform(0.5, 1.5, size=(width,)))])
        elif op == "layernorm":
            out = node("LayerNormalization", [a[0], const(rng.uniform(0.5, 1.5, size=(width,))),
                                              const(rng.normal(size=(width,)) * 0.1)], axis=-1, epsilon=1e-5)
        elif op == "layernorm_decomposed":      # what the TorchScript exporter emits before opset 17
            mean = node("ReduceMean", [a[0]], axes=[-1], keepdims=1)
            centred = node("Sub", [a[0], mean])
            var = node("ReduceMean", [node("Pow", [centred, const(np.array(2.0))])], axes=[-1], keepdims=1)
            normed = node("Div", [centred, node("Sqrt", [node("Add", [var, const(np.array(1e-5))])])])
            out = node("Add", [node("Mul", [normed, const(rng.uniform(0.5, 1.5, size=(width,)))]),
                               const(rng.normal(size=(width,)) * 0.1)])
        elif op == "rmsnorm_decomposed":        # HF's LlamaRMSNorm as exported
            ms = node("ReduceMean", [node("Pow", [a[0], const(np.array(2.0))])], axes=[-1], keepdims=1)
            inv = node("Div", [const(np.array(1.0)), node("Sqrt", [node("Add", [ms, const(np.array(1e-6))])])])
            out = node("Mul", [const(rng.uniform(0.5, 1.5, size=(width,))), node("Mul", [a[0], inv])])
        elif op == "silu_gated_mlp":            # LLaMA's MLP gate, SiLU as TorchScript exports it
            gate = node("MatMul", [a[0], const(rng.normal(size=(width, width)) / math.sqrt(width))])
            up = node("MatMul", [a[0], const(rng.normal(size=(width, width)) / math.sqrt(width))])
            out = node("Mul", [node("Mul", [gate, node("Sigmoid", [gate])]), up])
        elif op == "gelu_erf":
            erf = node("Erf", [node("Div", [a[0], const(np.array(math.sqrt(2.0)))])])
            out = node("Mul", [node("Mul", [a[0], node("Add", [erf, const(np.array(1.0))])]),
                               const(np.array(0.5))])
        elif op == "softmax":
            out = node("Softmax", a, axis=-1)
        elif op == "relu":
            out = node("Relu", a)
        elif op == "attention":
            scores = node("MatMul", [a[0], node("Transpose", [a[1]], perm=[0, 2, 1])])
            probs = node("Softmax", [node("Mul", [scores, const(np.array(1.0 / math.sqrt(width)))])], axis=-1)
            out = node("MatMul", [probs, a[2]])
        elif op in ("conv", "conv_bias"):
            weight = const(rng.normal(size=(channels, channels, 3, 3)) * math.sqrt(2.0 / (9 * channels)))
            inputs = [a[0], weight] + ([const(rng.normal(size=(channels,)) * 0.1)] if op == "conv_bias" else [])
            out = node("Conv", inputs, pads=[1, 1, 1, 1], kernel_shape=[3, 3])
        elif op == "batchnorm":
            out = node("BatchNormalization", [a[0], const(rng.uniform(0.5, 1.5, channels)),
                                              const(rng.normal(size=channels) * 0.1),
                                              const(rng.normal(size=channels) * 0.1),
                                              const(rng.uniform(0.5, 1.5, channels))], epsilon=1e-5)
        elif op == "clip":
            out = node("Clip", [a[0], const(np.array(0.0)), const(np.array(6.0))])
        else:  # pragma: no cover - Recipe validates ops
            raise ValueError(op)
        values.append(out)
    consumed = {i for n in nodes for i in n.input}
    outputs = [v for v in values[1:] if v not in consumed] or [values[-1]]
    graph = helper.make_graph(
        nodes, "dag", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)
