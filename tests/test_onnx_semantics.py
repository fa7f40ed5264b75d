"""Where TVM's ONNX converters compute something other than ONNX says (compiler/frontend/converters/semantics.py): each case
against ONNX's reference, fused and unfused, on the inputs that exposed it (the node conformance suite's)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from fuseguard.compiler.pipeline import CompileOptions, compile_model

F, I64, I32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32


def _model(nodes: list, inputs: list, outputs: list, initializers: tuple = (), opset: int = 22):
    graph = helper.make_graph(nodes, "case", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs], list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


EDGE_X = np.array([0, -0.0, 0, -0.0, -3, 3, -1, 1, np.inf, -np.inf, 1, 1, 5.5, -5.5, 7, -7], np.float32)
EDGE_Y = np.array([-2, 2, 2, -2, np.inf, np.inf, -np.inf, -np.inf, 2, 2, 0, -0.0, 2, 2, -3, 3], np.float32)

CASES: dict[str, tuple[Any, dict[str, np.ndarray]]] = {
    "mod_fmod0_edges": (_model([helper.make_node("Mod", ["x", "y"], ["z"], fmod=0)],
                               [("x", F, [16]), ("y", F, [16])], [("z", F, [16])]), {"x": EDGE_X, "y": EDGE_Y}),
    "mod_fmod0_broadcast_float64": (
        _model([helper.make_node("Mod", ["x", "y"], ["z"], fmod=0)],
               [("x", TensorProto.DOUBLE, [3, 4]), ("y", TensorProto.DOUBLE, [4])], [("z", TensorProto.DOUBLE, [3, 4])]),
        {"x": np.linspace(-7.3, 9.1, 12).reshape(3, 4), "y": np.array([2.5, -1.5, 3.0, -0.7])}),
    "bitshift_left_out_of_range": (
        _model([helper.make_node("BitShift", ["x", "s"], ["z"], direction="LEFT")],
               [("x", TensorProto.INT8, [6]), ("s", TensorProto.INT8, [6])], [("z", TensorProto.INT8, [6])], opset=26),
        {"x": np.array([-8, 4, -1, 3, 1, 5], np.int8), "s": np.array([-1, 8, 100, 2, 7, 0], np.int8)}),
    "bitshift_right_uint32": (
        _model([helper.make_node("BitShift", ["x", "s"], ["z"], direction="RIGHT")],
               [("x", TensorProto.UINT32, [4]), ("s", TensorProto.UINT32, [4])], [("z", TensorProto.UINT32, [4])]),
        {"x": np.array([16, 4, 0xFFFFFFFF, 9], np.uint32), "s": np.array([1, 32, 31, 40], np.uint32)}),
    "space_to_depth_crd": (_model([helper.make_node("SpaceToDepth", ["x"], ["y"], blocksize=2, mode="CRD")],
                                  [("x", F, [1, 2, 4, 6])], [("y", F, [1, 8, 2, 3])], opset=28),
                           {"x": np.arange(48, dtype=np.float32).reshape(1, 2, 4, 6)}),
    "expand_runtime_shape_two_way": (_model([helper.make_node("Expand", ["x", "s"], ["y"])],
                                            [("x", F, [3, 1]), ("s", I64, [3])], [("y", F, [2, 3, 6])]),
                                     {"x": np.array([[1], [2], [3]], np.float32), "s": np.array([2, 1, 6], np.int64)}),
    "conv_transpose_output_shape": (
        _model([helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[3, 2], output_shape=[10, 8])],
               [("x", F, [1, 1, 3, 3]), ("w", F, [1, 2, 3, 3])], [("y", F, [1, 2, 10, 8])]), {}),
    "batch_norm_training_mode": (
        _model([helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"],
                                 training_mode=1, epsilon=1e-2, momentum=0.8)],
               [("x", F, [2, 3, 4, 5]), ("s", F, [3]), ("b", F, [3]), ("m", F, [3]), ("v", F, [3])],
               [("y", F, [2, 3, 4, 5]), ("rm", F, [3]), ("rv", F, [3])], opset=15),
        {"v": np.array([0.5, 1.0, 2.0], np.float32)}),
    "pow_float_int64": (_model([helper.make_node("Pow", ["x", "e"], ["y"])], [("x", F, [5]), ("e", I64, [5])],
                               [("y", F, [5])]),
                        {"x": np.array([1.5, 2, -3, 0.5, 4], np.float32), "e": np.array([2, 3, 3, -1, 0], np.int64)}),
    "pow_int_int": (_model([helper.make_node("Pow", ["x", "e"], ["y"])], [("x", I32, [4]), ("e", I32, [4])],
                           [("y", I32, [4])]),
                    {"x": np.array([2, -3, 5, 7], np.int32), "e": np.array([10, 3, 0, 2], np.int32)}),
    "one_hot_axis_negative_indices_runtime_values": (
        _model([helper.make_node("OneHot", ["i", "depth", "vals"], ["y"], axis=1)],
               [("i", I64, [2, 3]), ("vals", F, [2])], [("y", F, [2, 5, 3])],
               (helper.make_tensor("depth", I64, [], [5]),)),
        {"i": np.array([[0, -1, 4], [7, -5, 2]], np.int64), "vals": np.array([-2.0, 3.0], np.float32)}),
    "eye_like_other_dtype": (_model([helper.make_node("EyeLike", ["x"], ["y"], dtype=TensorProto.DOUBLE, k=1)],
                                    [("x", I32, [3, 4])], [("y", TensorProto.DOUBLE, [3, 4])]), {}),
    "reduce_max_bool": (
        _model([helper.make_node("ReduceMax", ["x", "axes"], ["y"], keepdims=1)],
               [("x", TensorProto.BOOL, [2, 3])], [("y", TensorProto.BOOL, [2, 1])],
               (helper.make_tensor("axes", I64, [1], [1]),), opset=20),
        {"x": np.array([[True, False, False], [False, False, False]])}),
    "reduce_max_over_an_empty_axis": (
        _model([helper.make_node("ReduceMax", ["x", "axes"], ["y"], keepdims=1)],
               [("x", F, [2, 0, 4])], [("y", F, [2, 1, 4])], (helper.make_tensor("axes", I64, [1], [1]),), opset=20),
        {"x": np.zeros((2, 0, 4), np.float32)}),
    "reduce_prod_over_an_empty_axis_no_keepdims": (
        _model([helper.make_node("ReduceProd", ["x", "axes"], ["y"], keepdims=0)],
               [("x", I32, [2, 0, 4])], [("y", I32, [2, 4])], (helper.make_tensor("axes", I64, [1], [1]),), opset=20),
        {"x": np.zeros((2, 0, 4), np.int32)}),
    # from the legalisation of every reduction (compiler/passes/legalize_fixes.py), not from a Reduce* converter
    "reduce_log_sum_exp_over_an_empty_axis": (
        _model([helper.make_node("ReduceLogSumExp", ["x", "axes"], ["y"], keepdims=0)],
               [("x", F, [3, 0])], [("y", F, [3])], (helper.make_tensor("axes", I64, [1], [1]),), opset=20),
        {"x": np.zeros((3, 0), np.float32)}),
    "reduce_mean_and_l2_over_an_empty_axis": (
        _model([helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=1),
                helper.make_node("ReduceL2", ["x", "axes"], ["l2"], keepdims=1)],
               [("x", F, [2, 0, 4])], [("m", F, [2, 1, 4]), ("l2", F, [2, 1, 4])],
               (helper.make_tensor("axes", I64, [1], [1]),), opset=20),
        {"x": np.zeros((2, 0, 4), np.float32)}),
    "constant_value_ints": (_model([helper.make_node("Constant", [], ["c"], value_ints=[3, 1, 2]),
                                    helper.make_node("Add", ["x", "c"], ["y"])],
                                   [("x", I64, [3])], [("y", I64, [3])]), {}),
    "quantize_blocked_ragged_ties": (     # 5 columns in blocks of 2 (the last block short); x / scale on ties
        _model([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], axis=1, block_size=2)],
               [("x", F, [2, 5]), ("s", F, [2, 3]), ("z", TensorProto.UINT8, [2, 3])], [("y", TensorProto.UINT8, [2, 5])],
               opset=21),
        {"x": np.array([[0.5, 1.5, 2.5, -3.5, 300.0], [-1.0, 7.25, 0.75, 2.25, -0.25]], np.float32),
         "s": np.array([[1.0, 1.0, 0.5], [0.5, 0.5, 0.5]], np.float32),
         "z": np.array([[10, 0, 128], [0, 3, 255]], np.uint8)}),
    "dequantize_blocked_ragged": (
        _model([helper.make_node("DequantizeLinear", ["x", "s", "z"], ["y"], axis=0, block_size=2)],
               [("x", TensorProto.INT8, [3, 2]), ("s", F, [2, 2]), ("z", TensorProto.INT8, [2, 2])], [("y", F, [3, 2])],
               opset=21),
        {"x": np.array([[1, -128], [127, 0], [5, -5]], np.int8), "s": np.array([[0.5, 2.0], [0.25, 1.0]], np.float32),
         "z": np.array([[1, -2], [3, 0]], np.int8)}),
    "dropout_training_ratio_zero_mask_is_bool": (
        _model([helper.make_node("Dropout", ["x", "r", "t"], ["y", "mask"], seed=0)],
               [("x", F, [3, 4]), ("r", F, []), ("t", TensorProto.BOOL, [])],
               [("y", F, [3, 4]), ("mask", TensorProto.BOOL, [3, 4])]),
        {"r": np.array(0.0, np.float32), "t": np.array(True)}),
}


def _feeds(model, fixed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for i in model.graph.input:
        if i.name in fixed:
            out[i.name] = fixed[i.name]
            continue
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        out[i.name] = rng.standard_normal(shape).astype(helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
    return out


@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_the_onnx_reference(name: str, fusion: bool) -> None:
    model, fixed = CASES[name]
    feeds = _feeds(model, fixed)
    expected = ReferenceEvaluator(model).run(None, feeds)
    got = compile_model(model, {k: v.shape for k, v in feeds.items()}, options=CompileOptions(fusion=fusion)).run(feeds)
    assert len(got) == len(expected)
    for g, w in zip(got, expected):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        if w.dtype.kind == "f":
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
            assert (np.signbit(g[g == 0]) == np.signbit(w[g == 0])).all(), "signed zeros differ"
        else:
            np.testing.assert_array_equal(g, w)


def test_training_dropout_drops_about_the_ratio_and_rescales() -> None:
    """ratio 0.3 in training mode: ~30% of 10,000 elements dropped, the rest scaled by 1/0.7, the mask bool and
    consistent with the output (which elements drop is random by definition, so that is what is checked)."""
    model = _model([helper.make_node("Dropout", ["x", "r", "t"], ["y", "mask"], seed=3)],
                   [("x", F, [100, 100])], [("y", F, [100, 100]), ("mask", TensorProto.BOOL, [100, 100])],
                   (helper.make_tensor("r", F, [], [0.3]), helper.make_tensor("t", TensorProto.BOOL, [], [True])))
    x = np.ones((100, 100), np.float32)
    y, mask = compile_model(model, {"x": x.shape}).run({"x": x})
    assert mask.dtype == np.bool_ and 0.27 < 1 - mask.mean() < 0.33
    np.testing.assert_allclose(y[mask], 1 / 0.7, rtol=1e-6)
    assert (y[~mask] == 0).all()


@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
def test_every_reduction_over_an_empty_axis_is_its_identity(fusion: bool) -> None:
    """Reductions that no ONNX Reduce* node wrote (a Relax module: variance, std, sum of int, max of int) over an
    axis of extent 0 legalise to their identity; TVM's kernels returned uninitialised memory there."""
    import tvm
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 0, 3), "float32"))
    i = relax.Var("i", relax.TensorType((0, 4), "int32"))
    with bb.function("main", [x, i]):
        with bb.dataflow():
            outs = [bb.emit(relax.op.variance(x, [1])), bb.emit(relax.op.std(x, [1], keepdims=True)),
                    bb.emit(relax.op.sum(x, [1])), bb.emit(relax.op.sum(i, [0])), bb.emit(relax.op.max(i, [0])),
                    bb.emit(relax.op.min(x, [1, 2]))]
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    got = compile_model(bb.get(), options=CompileOptions(fusion=fusion)).run(
        {"x": np.zeros((2, 0, 3), np.float32), "i": np.zeros((0, 4), np.int32)})
    want = [np.full((2, 3), np.nan, np.float32), np.full((2, 1, 3), np.nan, np.float32), np.zeros((2, 3), np.float32),
            np.zeros(4, np.int32), np.full(4, np.iinfo(np.int32).min, np.int32), np.full(2, np.inf, np.float32)]
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert tvm is not None
