"""ONNX operators TVM's frontend has no converter for (compiler/frontend/converters/ops.py), against ONNX's reference
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
    "hann_window": (_model("HannWindow", 17, [], [10], (helper.make_tensor("size", I64, [], [10]),)), {}),
    "hamming_window_symmetric": (_model("HammingWindow", 17, [], [10], (helper.make_tensor("size", I64, [], [10]),),
                                        periodic=0), {}),
    "blackman_window": (_model("BlackmanWindow", 17, [], [10], (helper.make_tensor("size", I64, [], [10]),)), {}),
    "cosh": (_model("Cosh", 9, [("x", F, [3, 5])], [3, 5]), {}),
    "sinh": (_model("Sinh", 9, [("x", F, [3, 5])], [3, 5]), {}),
    "rms_norm_every_axis": (_model("RMSNormalization", 23, [("x", F, [2, 3, 4]), ("scale", F, [2, 3, 4])], [2, 3, 4],
                                   axis=0), {}),
    "center_crop_pad": (_model("CenterCropPad", 18, [("x", F, [5, 4, 3])], [3, 7, 3],
                               (helper.make_tensor("shape", I64, [2], [3, 7]),), axes=[0, 1]), {}),
    "tensor_scatter_circular": (
        _model("TensorScatter", 24, [("cache", F, [2, 3, 5, 4]), ("update", F, [2, 3, 3, 4]), ("w", I64, [2])],
               [2, 3, 5, 4], mode="circular"), {"w": np.array([1, 4], np.int64)}),
    "resize_axes_not_larger": (
        _model("Resize", 19, [("x", F, [1, 2, 4, 6])], [1, 2, 2, 3],
               (helper.make_tensor("roi", F, [0], []), helper.make_tensor("scales", F, [0], []),
                helper.make_tensor("sizes", I64, [2], [3, 3])), axes=[3, 2], keep_aspect_ratio_policy="not_larger"),
        {}),
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
    """The loader's operator check (compiler/frontend/op_support.py) knows fuseguard's own converters."""
    from fuseguard.compiler.frontend.op_support import supported_ops

    assert {"RotaryEmbedding", "Swish", "SwiGLU", "Celu", "LpNormalization", "CumProd"} <= supported_ops()


def _run_both(model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return [compile_model(model, {k: v.shape for k, v in feeds.items()}, options=CompileOptions(fusion=f)).run(feeds)[0]
            for f in (True, False)]


@pytest.mark.parametrize("dtype", [TensorProto.UINT8, TensorProto.INT8], ids=["uint8", "int8"])
def test_qlinear_matmul_is_exact_against_the_reference(dtype: int) -> None:
    """Integer results: every element equal, ties included (a scale product of 0.5 puts many on a tie)."""
    np_dtype = np.uint8 if dtype == TensorProto.UINT8 else np.int8
    names = ["a", "a_scale", "a_zero", "b", "b_scale", "b_zero", "y_scale", "y_zero"]
    graph = helper.make_graph(
        [helper.make_node("QLinearMatMul", names, ["y"])], "qlm",
        [helper.make_tensor_value_info("a", dtype, [4, 6]), helper.make_tensor_value_info("b", dtype, [6, 5])],
        [helper.make_tensor_value_info("y", dtype, [4, 5])],
        [helper.make_tensor("a_scale", F, [], [0.5]), helper.make_tensor("a_zero", dtype, [], [3]),
         helper.make_tensor("b_scale", F, [], [0.25]), helper.make_tensor("b_zero", dtype, [], [1]),
         helper.make_tensor("y_scale", F, [], [0.25]), helper.make_tensor("y_zero", dtype, [], [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    info = np.iinfo(np_dtype)
    rng = np.random.default_rng(0)
    feeds = {"a": rng.integers(info.min, info.max, (4, 6)).astype(np_dtype),
             "b": rng.integers(info.min, info.max, (6, 5)).astype(np_dtype)}
    expected = ReferenceEvaluator(model).run(None, feeds)[0]
    for got in _run_both(model, feeds):
        assert got.dtype == np_dtype
        np.testing.assert_array_equal(got, expected)


def test_bitcast_reinterprets_the_bits() -> None:
    model = _model("BitCast", 26, [("x", F, [7])], [7], to=TensorProto.INT32)
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.INT32
    x = np.array([0.0, -0.0, 1.0, -2.5, np.inf, np.nan, 1e-40], np.float32)
    for got in _run_both(model, {"x": x}):
        np.testing.assert_array_equal(got, x.view(np.int32))


def test_a_resize_policy_tvm_cannot_sample_is_refused_with_the_reason() -> None:
    """not_larger on 4x6 to at most 3x4: the common scale 2/3 rounds to 3x4, whose per-axis ratios (3/4, 4/6)
    differ; TVM samples at the per-axis ratio, so the build is refused rather than silently off."""
    from fuseguard.compiler.errors import FuseguardError

    model = _model("Resize", 19, [("x", F, [1, 2, 4, 6])], [1, 2, 3, 4],
                   (helper.make_tensor("roi", F, [0], []), helper.make_tensor("scales", F, [0], []),
                    helper.make_tensor("sizes", I64, [2], [4, 3])), axes=[3, 2], keep_aspect_ratio_policy="not_larger")
    with pytest.raises(FuseguardError, match="do not keep the common scale"):
        compile_model(model, {"x": (1, 2, 4, 6)})


@pytest.mark.parametrize("inverse,onesided,length,complex_in", [
    (0, 0, None, False), (0, 1, None, False), (0, 0, 12, True), (0, 1, 6, False),
    (1, 0, None, True), (1, 1, None, True), (1, 1, 10, True)])
@pytest.mark.parametrize("opset", [19, 20])
def test_dft_matches_numpy_fft(inverse: int, onesided: int, length: int | None, complex_in: bool, opset: int) -> None:
    """DFT against numpy's fft/ifft/rfft/irfft, each axis default of its opset (1 up to 19, -2 from 20), with
    dft_length padding and truncating."""
    shape = [2, 8, 5, 2 if complex_in else 1]
    inputs = [("x", F, shape)]
    inits = []
    names = ["x"]
    if length is not None:
        inits.append(helper.make_tensor("n", I64, [], [length]))
    names.append("n" if length is not None else "")
    node = helper.make_node("DFT", names, ["y"], inverse=inverse, onesided=onesided)
    graph = helper.make_graph([node], "dft", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info("y", F, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", F, list(expected.shape)))
    for got in _run_both(model, {"x": x}):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_reverse_sequence_with_run_time_lengths() -> None:
    model = _model("ReverseSequence", 10, [("x", F, [5, 3, 2]), ("lens", I64, [3])], [5, 3, 2],
                   batch_axis=1, time_axis=0)
    feeds = {"x": np.arange(30, dtype=np.float32).reshape(5, 3, 2), "lens": np.array([5, 1, 3], np.int64)}
    expected = ReferenceEvaluator(model).run(None, feeds)[0]
    for got in _run_both(model, feeds):
        np.testing.assert_array_equal(got, expected)
