"""int8 QDQ models: Quantize->Dequantize pairs as exact fp32 arithmetic (compiler/passes/qdq.py), fused into their
producers; the unfused build runs them as their two ops again, in the same layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuseguard.compiler.frontend.loader import load
from fuseguard.compiler.pipeline import CompileOptions, compile_model

import sys

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantised import quantised as _quantised  # noqa: E402


def _fake_quant_model(scale: float, zero: int, dtype: int = TensorProto.INT8) -> onnx.ModelProto:
    """x -> QuantizeLinear -> DequantizeLinear -> Relu -> y: the pair alone, so every value can be checked."""
    inits = [numpy_helper.from_array(np.array(scale, np.float32), "s"),
             helper.make_tensor("z", dtype, [], [zero])]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["dq"]),
             helper.make_node("Relu", ["dq"], ["y"])]
    graph = helper.make_graph(nodes, "fq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("dtype, zero, lo, hi", [(TensorProto.INT8, 3, -128, 127), (TensorProto.UINT8, 128, 0, 255)])
def test_a_pair_rounds_ties_to_even_and_saturates_like_onnx(dtype: int, zero: int, lo: int, hi: int) -> None:
    """Ties (x / s = k + 0.5) go to the even integer, as ONNX QuantizeLinear says and ONNX Runtime does; TVM's
    own quantize legalisation rounded them away from zero, one step off. Out-of-range values saturate."""
    scale = 0.5
    ties = (np.arange(-100, 100, dtype=np.float32) + 0.5) * scale     # every one a tie
    x = np.concatenate([ties, np.array([-1e4, 1e4, 0.0, -0.0, 63.1, -63.9] * 2, np.float32),
                        np.linspace(-80, 80, 44, dtype=np.float32)]).reshape(4, 64)
    want = np.maximum((np.clip(np.rint(x / scale) + zero, lo, hi) - zero) * scale, 0)
    model = _fake_quant_model(scale, zero, dtype)
    (ort_y,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(ort_y, want)
    for options in (CompileOptions(), CompileOptions().unfused()):
        built = compile_model(load(model, None, name="fq"), options=options)
        (got,) = built.run({"x": x})
        np.testing.assert_array_equal(got, want, err_msg=f"fusion={options.fusion}")
        assert "1 Q->DQ pair(s)" in built.report.qdq


def _quantize_calls(report) -> int:  # noqa: ANN001
    return sum("quantize" in c["kernel"] and "dequantize" not in c["kernel"] for c in report.call_sites)


def _transforms(report) -> int:  # noqa: ANN001
    return sum("layout_transform" in c["kernel"] for c in report.call_sites)


def test_pairs_fuse_into_the_conv_and_keep_its_layout(tmp_path: Path) -> None:
    """In a QDQ conv model every pair but the one on the model's input (no producer to fuse into) runs
    inside a conv kernel, and the blocked layout passes through the pairs: one transform in, one out. The
    unfused build runs each pair as a quantize and a dequantize kernel, in the same layout. With the step
    off (`qdq=False`) the pairs are kernels of their own in the fused build too (the build before it)."""
    path = _quantised(tmp_path, "conv_bn_relu")
    fused = compile_model(load(str(path), None, name="int8"))
    pairs = int(fused.report.qdq.split("int8 QDQ: ")[1].split(" ")[0])
    kernels = [c["kernel"] for c in fused.report.call_sites]
    assert pairs >= 4 and "NCHW16c for 2 of 2" in fused.report.layout or "NCHW8c for 2 of 2" in fused.report.layout
    assert _quantize_calls(fused.report) == 0
    alone = [k for k in kernels if "round" in k and "conv2d" not in k]
    assert len(alone) == 1, kernels                    # the input's pair
    assert sum(k.count("round") for k in kernels if "conv2d" in k) == pairs - 1
    assert _transforms(fused.report) == 2, kernels

    unfused = compile_model(load(str(path), None, name="int8"), options=CompileOptions().unfused())
    assert _quantize_calls(unfused.report) == pairs and _transforms(unfused.report) == 2

    off = compile_model(load(str(path), None, name="int8"), options=CompileOptions(qdq=False))
    assert off.report.qdq == "" and any("quantize" in c["kernel"] for c in off.report.call_sites)
    assert _transforms(off.report) > 2 and off.report.kernels > fused.report.kernels


def test_sparse_rounding_boundary_flips_pass_and_dense_errors_do_not() -> None:
    """The boundary-flip rule (verify/compare.rescue_boundary_flips): a few elements a step or two beyond the
    QDQ tolerance pass, with a note; the same error on many elements, an error larger than both bounds, or a
    shape mismatch does not."""
    from fuseguard.verify.check.compare import FLIP_FRACTION, Tolerance, compare_outputs, rescue_boundary_flips

    step = 0.05
    tol = {"y": Tolerance(atol=2 * step * 1.001, rtol=0.0)}
    ref = np.zeros(10_000, np.float32)
    sparse = ref.copy()
    sparse[:5] = 3 * step
    dense = ref.copy()
    dense[: int(3 * FLIP_FRACTION * ref.size)] = 3 * step
    huge = ref.copy()
    huge[0] = 9 * step

    def rescued(actual: np.ndarray, ort_int8_err: float) -> object:
        result = compare_outputs({"y": actual}, {"y": ref}, per_output=tol)
        assert not result
        return rescue_boundary_flips(result, {"y": ort_int8_err})

    ok = rescued(sparse, 0.0)
    assert ok and "passed as rounding-boundary flips: 5 of 10000" in ok["y"].note
    assert not rescued(dense, 0.0)
    assert not rescued(huge, 0.0)
    assert rescued(huge, 10 * step)                  # ONNX Runtime's own int8 kernels are further off
    shape = compare_outputs({"y": sparse[:10]}, {"y": ref}, per_output=tol)
    assert not rescue_boundary_flips(shape, {"y": 1.0})
