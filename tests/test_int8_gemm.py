"""int8 QDQ MatMuls as integer GEMMs on VNNI (compiler/passes/int8_gemm.py, compiler/schedule/cpu_matmul_int8.py):
exact against integer arithmetic, at tile edges, in both activation types, fused and unfused."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from fuseguard.compiler.hw.hostcpu import detect_host, host_from_target
from fuseguard.compiler.frontend.loader import load
from fuseguard.compiler.pipeline import CompileOptions, compile_model
from fuseguard.compiler.schedule.cpu_matmul_int8 import vnni_lanes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantised import quantised as _quantised  # noqa: E402

HOST_LANES = vnni_lanes(detect_host())
needs_vnni = pytest.mark.skipif(not HOST_LANES, reason="the host CPU has no VNNI (AVX512-VNNI or AVX-VNNI): "
                                                        "its QDQ MatMuls keep the fp32 route")


def _qdq_matmul(m: int, k: int, n: int, *, act: int, per_column: bool, transposed: bool, seed: int = 0,
                batch: int = 1) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x -> Q -> DQ -> MatMul(., DQ(W)) -> + bias -> Relu, as ORT's quantiser writes it (W int8, zero point 0);
    with `transposed`, W stored [N, K] and read through a Gemm with transB (2-D x only)."""
    rng = np.random.default_rng(seed)
    w = rng.integers(-128, 128, (n, k) if transposed else (k, n)).astype(np.int8)
    s_w = (rng.random(n).astype(np.float32) * 0.01 + 0.001) if per_column else np.float32(0.004)
    zero = 3 if act == TensorProto.INT8 else 131
    inits = [numpy_helper.from_array(np.float32(0.05), "s"), helper.make_tensor("z", act, [], [zero]),
             numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.asarray(s_w, np.float32), "s_w"),
             numpy_helper.from_array(np.zeros(np.shape(s_w), np.int8), "z_w"),
             numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "bias")]
    axis = 0 if transposed else 1
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["dq"]),
             helper.make_node("DequantizeLinear", ["w", "s_w", "z_w"], ["w_f"], axis=axis)]
    if transposed:
        nodes.append(helper.make_node("Gemm", ["dq", "w_f", "bias"], ["mm"], transB=1))
        shape = [m, k]
    else:
        nodes += [helper.make_node("MatMul", ["dq", "w_f"], ["mm0"]), helper.make_node("Add", ["mm0", "bias"], ["mm"])]
        shape = [batch, m, k]
    nodes.append(helper.make_node("Relu", ["mm"], ["y"]))
    graph = helper.make_graph(nodes, "qmm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*shape[:-1], n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    x.flat[:5] = [1e4, -1e4, 0.025, 0.075, -0.025]         # saturating, and ties (x / s = k + 1/2)
    return model, {"x": x}


def _holds_int_matmul(script: str) -> bool:
    """A kernel with an integer matmul: tensorized (vpdpbusd), or an int32 reduction over uint8 loads."""
    return "vpdpbusd" in script or ('"uint8"' in script and 'T.Cast("int32"' in script
                                    and re.search(r'T\.axis\.(reduce|remap\("S*R)', script) is not None)


def _exact(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The model in integer arithmetic and float64: what the integer GEMM must reproduce to fp32 rounding."""
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    lo, hi = (-128, 127) if init["z"].dtype == np.int8 else (0, 255)
    q = np.clip(np.rint(x / np.float64(init["s"])) + int(init["z"]), lo, hi).astype(np.int64) - int(init["z"])
    w = init["w"].astype(np.int64)
    w = w.T if any(n.op_type == "Gemm" for n in model.graph.node) else w
    acc = q @ w
    y = acc * np.float64(init["s"]) * np.asarray(init["s_w"], np.float64) + init["bias"]
    return np.maximum(y, 0)


@needs_vnni
@pytest.mark.parametrize("m, k, n, act, per_column, transposed", [
    (32, 64, 48, TensorProto.INT8, False, False),        # 3 vectors a row tile, M a whole number of tiles
    (197, 192, 64, TensorProto.UINT8, True, False),     # ViT's 197 tokens: rows padded to whole tiles
    (5, 128, 32, TensorProto.INT8, True, True),          # fewer rows than a tile; Gemm with transB
    (1, 256, 16, TensorProto.UINT8, False, False),       # one row, one vector
])
def test_integer_gemm_matches_integer_arithmetic(m: int, k: int, n: int, act: int, per_column: bool,
                                                 transposed: bool) -> None:
    """Fused and unfused builds reproduce the integer result (to the fp32 rounding of the dequantize and the
    bias) and ONNX Runtime's, with ties and saturation in the input; the report says the MatMul ran on int8."""
    model, feeds = _qdq_matmul(m, k, n, act=act, per_column=per_column, transposed=transposed)
    want = _exact(model, feeds["x"])
    (ort_y,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for options in (CompileOptions(), CompileOptions().unfused()):
        built = compile_model(load(model, None, name="qmm"), options=options)
        assert "1 MatMul(s) on int8 kernels" in built.report.qdq, built.report.qdq
        assert "matmul-int8+vnni" in built.report.to_dict()["schedules"].values()
        (got,) = built.run(feeds)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5 * np.abs(want).max())
        np.testing.assert_allclose(got, ort_y, rtol=1e-5, atol=1e-4 * np.abs(want).max())


@needs_vnni
def test_batched_activation_and_the_switch() -> None:
    """A 3-D activation [batch, rows, K] against a 2-D weight; `int8_kernels=False` keeps the fp32 route and
    computes the same values."""
    model, feeds = _qdq_matmul(7, 96, 32, act=TensorProto.INT8, per_column=True, transposed=False, batch=3)
    want = _exact(model, feeds["x"])
    on = compile_model(load(model, None, name="qmm"))
    off = compile_model(load(model, None, name="qmm"), options=CompileOptions(int8_kernels=False))
    assert "int8 kernels" not in off.report.qdq and "matmul-int8+vnni" not in off.report.to_dict()["schedules"].values()
    for built in (on, off):
        np.testing.assert_allclose(built.run(feeds)[0], want, rtol=1e-5, atol=1e-4 * np.abs(want).max())


def test_shapes_the_kernel_does_not_take_keep_the_fp32_route() -> None:
    """N not a whole number of vectors, K not a whole number of 4-steps, or an asymmetric weight: no rewrite,
    and the model still computes the same thing (fp32 on the dequantised grid)."""
    from fuseguard.compiler.passes.int8_gemm import integer_matmuls
    from fuseguard.compiler.frontend.importer import import_model

    for m, k, n in ((4, 64, 40), (4, 66, 32)):
        model, _ = _qdq_matmul(m, k, n, act=TensorProto.INT8, per_column=False, transposed=False)
        mod = import_model(load(model, None, name="qmm")).mod
        assert integer_matmuls(mod, 16)[1] == 0
    model, _ = _qdq_matmul(4, 64, 32, act=TensorProto.INT8, per_column=False, transposed=False)
    zw = next(t for t in model.graph.initializer if t.name == "z_w")
    zw.CopyFrom(helper.make_tensor("z_w", TensorProto.INT8, [], [1]))
    assert integer_matmuls(import_model(load(model, None, name="qmm")).mod, 16)[1] == 0
    model, _ = _qdq_matmul(4, 64, 32, act=TensorProto.INT8, per_column=False, transposed=False)
    assert integer_matmuls(import_model(load(model, None, name="qmm")).mod, 16)[1:] == (1, 1)


@pytest.mark.parametrize("mcpu, lanes", [("sapphirerapids", 16), ("znver4", 16), ("alderlake", 8),
                                         ("skylake-avx512", 0), ("znver1", 0)])
def test_vnni_detected_from_the_target_and_the_kernel_compiles_for_it(mcpu: str, lanes: int) -> None:
    """Which CPUs get the integer kernel follows the target's features (cross-compilation included), and the
    kernel compiles to vpdpbusd on any host: 512-bit with AVX512-VNNI, 256-bit with AVX-VNNI."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    assert vnni_lanes(host_from_target(target)) == lanes
    if not lanes:
        return
    model, _ = _qdq_matmul(32, 64, 48, act=TensorProto.INT8, per_column=True, transposed=False)
    built = compile_model(load(model, None, name="qmm"), options=CompileOptions(mcpu=mcpu))
    kernel = next(gv for gv, f in built.lowered.functions_items()
                  if isinstance(f, tvm.tirx.PrimFunc) and "matmul-int8" in str(f.attrs.get("fuseguard.cpu_schedule", "")))
    asm = tvm.tirx.build(tvm.IRModule({"k": built.lowered[kernel]}), target=target).inspect_source("asm")
    register = "zmm" if lanes == 16 else "ymm"
    assert any("vpdpbusd" in line and register in line for line in asm.splitlines()), asm[:2000]


@needs_vnni
def test_a_quantised_transformer_runs_its_matmuls_on_int8(tmp_path: Path) -> None:
    """ORT's quantiser on the built-in BERT encoder: every projection and MLP MatMul on the integer kernel (the
    two attention MatMuls read two activations, no int8 weight: fp32), and the model verifies fused and
    unfused. Input draw 19 puts one of 24576 outputs three steps from ONNX Runtime's reference (a rounding
    boundary inside; Sapphire Rapids): it passes by the boundary-flip rule, with a note, not by a looser
    tolerance."""
    from fuseguard.verify.check.model import verify_model

    path = _quantised(tmp_path, "bert_encoder")
    for options in (CompileOptions(), CompileOptions().unfused()):
        built = compile_model(load(str(path), None, name="bert_int8"), options=options)
        assert "6 MatMul(s) on int8 kernels" in built.report.qdq, built.report.qdq
        # every kernel holding an integer matmul is on the VNNI tile, none fell to a generic rule
        rules = [str(f.attrs.get("fuseguard.cpu_schedule", "")) for _, f in built.lowered.functions_items()
                 if isinstance(f, tvm.tirx.PrimFunc) and _holds_int_matmul(f.script())]
        assert rules and set(rules) == {"matmul-int8+vnni"}, rules
    verdict = verify_model(str(path), seed=19)
    assert verdict, verdict.to_dict()
    flips = [w for w in verdict.warnings if "rounding-boundary flips" in w]
    assert all("elements beyond the tolerance" in w for w in flips)


def test_symbolic_rows_keep_the_fp32_route() -> None:
    """A dynamic row count (`--dynamic rows`): the tensorized tile does not lower with symbolic rows in TVM 0.27,
    so the MatMul stays on the fp32 route, and every size computes the integer result."""
    from fuseguard.compiler.dynamic import parse_dynamic

    model, _ = _qdq_matmul(16, 64, 48, act=TensorProto.INT8, per_column=True, transposed=False)
    for vi in (model.graph.input[0], model.graph.output[0]):
        vi.type.tensor_type.shape.dim[1].dim_param = "rows"
    built = compile_model(model, options=CompileOptions(dynamic=parse_dynamic("rows<=64")), name="dyn")
    assert "int8 kernels" not in built.report.qdq
    rng = np.random.default_rng(1)
    for rows in (1, 37, 64):
        x = (rng.standard_normal((1, rows, 64)) * 3).astype(np.float32)
        want = _exact(model, x)
        np.testing.assert_allclose(built.run({"x": x})[0], want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
