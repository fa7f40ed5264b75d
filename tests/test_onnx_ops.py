"""ONNX operators TVM's frontend has no converter for (compiler/onnx_ops.py), against ONNX's reference
implementation, fused and unfused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from fuseguard.compiler.pipeline import CompileOptions, compile_model

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(op: str, opset: int, inputs: list[tuple[str, int, list[int]]], out_shape: list[int],
           initializers: tuple = (), **attrs: Any):
    graph = helper.make_graph(
        [helper.make_node(op, [n for n, _, _ in inputs] + [t.name for t in initializers], ["y"], **attrs)], op,
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info("y", F, out_shape)], list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


POS = np.array([[0, 2, 1, 5]], np.int64)
CASES = {
    "rotary_4d": (_model("RotaryEmbedding", 23, [("x", F, [1, 2, 4, 8]), ("cos", F, [1, 4, 4]), ("sin", F, [1, 4, 4])],
                         [1, 2, 4, 8]), {}),
    "rotary_3d_interleaved_partial_position_ids": (
        _model("RotaryEmbedding", 23, [("x", F, [1, 4, 16]), ("cos", F, [6, 2]), ("sin", F, [6, 2]),
                                       ("pos", I64, [1, 4])], [1, 4, 16],
               num_heads=2, interleaved=1, rotary_embedding_dim=4), {"pos": POS}),
    "swish": (_model("Swish", 24, [("x", F, [3, 5])], [3, 5], alpha=1.5), {}),
    "swiglu": (_model("SwiGLU", 28, [("a", F, [3, 5]), ("b", F, [3, 5])], [3, 5]), {}),
    "celu": (_model("Celu", 28, [("x", F, [3, 5])], [3, 5], alpha=0.7), {}),
    "lp_norm_p1": (_model("LpNormalization", 22, [("x", F, [3, 5])], [3, 5], p=1, axis=1), {}),
    "lp_norm_p2_zero_row": (_model("LpNormalization", 22, [("x", F, [3, 5])], [3, 5], p=2, axis=-1),
                            {"x": np.vstack([np.zeros(5), np.arange(5), -np.arange(5)]).astype(np.float32)}),
    "cumprod_reverse_exclusive": (
        _model("CumProd", 26, [("x", F, [3, 4])], [3, 4], (helper.make_tensor("axis", I64, [], [1]),),
               reverse=1, exclusive=1), {}),
}


@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_the_onnx_reference(name: str, fusion: bool) -> None:
    model, fixed = CASES[name]
    rng = np.random.default_rng(0)
    feeds = {i.name: fixed.get(i.name, rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
                                .astype(np.float32)) for i in model.graph.input}
    if name == "lp_norm_p1":     # the reference sums x, not |x|; the spec (and ONNX Runtime) sum |x|
        expected = feeds["x"] / np.abs(feeds["x"]).sum(axis=1, keepdims=True)
    else:
        expected = ReferenceEvaluator(model).run(None, feeds)[0]
    got = compile_model(model, {k: v.shape for k, v in feeds.items()}, options=CompileOptions(fusion=fusion)).run(feeds)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_model_with_one_of_them_is_no_longer_refused_at_load() -> None:
    """The loader's operator check (compiler/op_support.py) knows fuseguard's own converters."""
    from fuseguard.compiler.op_support import supported_ops

    assert {"RotaryEmbedding", "Swish", "SwiGLU", "Celu", "LpNormalization", "CumProd"} <= supported_ops()
