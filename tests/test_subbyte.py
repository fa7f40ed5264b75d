"""4- and 2-bit types held one per byte (compiler/frontend/converters/subbyte.py): casts and QDQ against ONNX's reference, fused and
unfused, the ONNX types restored at the edge, and through the build cache."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from fuseguard.compiler import cache as build_cache
from fuseguard.compiler.errors import ModelError
from fuseguard.compiler.frontend.loader import load
from fuseguard.compiler.pipeline import CompileOptions, compile_model

F = TensorProto.FLOAT


def _model() -> object:
    nodes = [
        helper.make_node("Cast", ["x"], ["i4"], to=TensorProto.INT4),           # trunc; out of range -> 0
        helper.make_node("Cast", ["n"], ["u2"], to=TensorProto.UINT2),          # an integer wraps
        helper.make_node("Cast", ["x"], ["f4"], to=TensorProto.FLOAT4E2M1),     # ties to even, saturates
        helper.make_node("Cast", ["q"], ["back"], to=TensorProto.FLOAT),        # an INT4 input, decoded
        helper.make_node("CastLike", ["f4in", "like"], ["h"]),                  # FLOAT4E2M1 -> float16
        # finite input: for NaN/Inf the reference's int32 cast is undefined (x86 gives INT_MIN, so -8); here it
        # saturates as the operator's spec says
        helper.make_node("QuantizeLinear", ["xq", "scale", "zero"], ["qz"], axis=1),
        helper.make_node("DequantizeLinear", ["qz", "scale", "zero"], ["dq"], axis=1),
    ]
    graph = helper.make_graph(
        nodes, "subbyte",
        [helper.make_tensor_value_info("x", F, [3, 4]), helper.make_tensor_value_info("xq", F, [3, 4]),
         helper.make_tensor_value_info("n", TensorProto.INT32, [6]),
         helper.make_tensor_value_info("q", TensorProto.INT4, [5]),
         helper.make_tensor_value_info("f4in", TensorProto.FLOAT4E2M1, [8]),
         helper.make_tensor_value_info("like", TensorProto.FLOAT16, [0])],
        [helper.make_tensor_value_info("i4", TensorProto.INT4, [3, 4]),
         helper.make_tensor_value_info("u2", TensorProto.UINT2, [6]),
         helper.make_tensor_value_info("f4", TensorProto.FLOAT4E2M1, [3, 4]),
         helper.make_tensor_value_info("back", F, [5]), helper.make_tensor_value_info("h", TensorProto.FLOAT16, [8]),
         helper.make_tensor_value_info("qz", TensorProto.INT4, [3, 4]), helper.make_tensor_value_info("dq", F, [3, 4])],
        [helper.make_tensor("scale", F, [4], [0.5, 1.0, 0.25, 2.0]),
         helper.make_tensor("zero", TensorProto.INT4, [4], [1, -2, 0, 7])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)])


FEEDS = {
    "x": np.array([[7.6, -8.0, 8.0, -9.7], [0.25, 2.5, 5.0, np.nan], [np.inf, -0.75, 1.49, -3.5]], np.float32),
    "xq": np.array([[7.6, -8.0, 8.0, -9.7], [0.25, 2.5, 5.0, 100], [-100, -0.75, 1.49, -3.5]], np.float32),
    "n": np.array([300, -300, 7, -1, 2, 5], np.int32),
    "q": np.array([-8, 7, 0, -3, 5], np.int8).astype(ml_dtypes.int4),
    "f4in": np.arange(0, 16, 2, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn),
    "like": np.zeros(0, np.float16),
}


def _check(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (i, g.dtype, w.dtype)
        gf, wf = g.astype(np.float32), w.astype(np.float32)
        assert ((gf == wf) | (np.isnan(gf) & np.isnan(wf))).all(), (i, gf, wf)


@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
def test_casts_and_qdq_match_the_reference(fusion: bool) -> None:
    model = _model()
    want = ReferenceEvaluator(model).run(None, FEEDS)
    got = compile_model(model, {k: v.shape for k, v in FEEDS.items()}, options=CompileOptions(fusion=fusion)).run(FEEDS)
    _check(got, want)


def test_the_onnx_types_survive_the_build_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build_cache.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(build_cache.ENV_OFF, raising=False)
    loaded = load(_model(), {k: v.shape for k, v in FEEDS.items()}, name="subbyte")
    cold = build_cache.compile_cached(loaded, CompileOptions())
    warm = build_cache.compile_cached(loaded, CompileOptions())
    assert warm.cache_hit
    _check(warm.run(FEEDS), cold.run(FEEDS))


def test_another_op_on_a_4_bit_tensor_is_refused_by_name() -> None:
    graph = helper.make_graph([helper.make_node("Identity", ["q"], ["y"], name="ident")], "g",
                              [helper.make_tensor_value_info("q", TensorProto.INT4, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.INT4, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)])
    with pytest.raises(ModelError, match=r"node 'ident' \(Identity\) reads a 4- or 2-bit tensor"):
        compile_model(model, {"q": (4,)})
