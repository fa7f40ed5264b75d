"""Reduced precision: the conversion policy, the fp64 reference, and the fused-vs-unfused rule that catches a
fused kernel more wrong than its unfused counterpart when a loose tolerance alone would pass it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from fuseguard.compiler.errors import UsageError
from fuseguard.compiler.pipeline import CompileOptions
from fuseguard.compiler.passes.precision import dtype_census, to_precision
from fuseguard.verify.check.model import SuiteSpec, verify_model
from fuseguard.verify.check.reference import run_onnxruntime
sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantised import quantised as _quantised  # noqa: E402
from fuseguard.verify.check.precision import (Fp64Check, check_against_fp64, fp64_reference, loose_tolerances,
                                              to_float64)

ROOT = Path(__file__).resolve().parent.parent
LOWP_ACCUMULATE = ROOT / "tests" / "plugins" / "lowp_accumulate.py"


def _mlp_with_layernorm() -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 64), "float32"))
    rng = np.random.default_rng(0)
    w = relax.const(rng.standard_normal((64, 64)).astype("float32"))
    g = relax.const(np.ones(64, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w))
            y = bb.emit(relax.op.add(y, g))
            z = bb.emit(relax.op.nn.layer_norm(y, g, g, axes=[-1]))
            s = bb.emit(relax.op.nn.softmax(z))
            m = bb.emit(relax.op.mean(y, axis=[-1]))
            out = bb.emit_output(relax.Tuple([s, m, y]))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("precision,low", [("fp16", "float16"), ("bf16", "bfloat16")])
def test_gemm_operands_go_low_and_accumulate_in_fp32_statistics_stay_fp32(precision: str, low: str) -> None:
    mod = to_precision(_mlp_with_layernorm(), precision)
    census = dtype_census(mod)
    assert census["matmul"] == {"float32": 1}                       # accumulated (and returned) in fp32
    assert census["astype"] == {low: 2}                             # x on entry and the weight, folded later
    for op in ("nn.layer_norm", "nn.softmax", "mean", "add"):       # the epilogue and the statistics
        assert set(census[op]) == {"float32"}, (op, census[op])
    call = next(b.value for b in mod["main"].body.blocks[0].bindings
                if isinstance(b.value, relax.Call) and b.value.op.name == "relax.matmul")
    assert {str(a.ty.dtype) for a in call.args} == {low}
    ret = mod["main"].ret_ty
    assert all(str(f.dtype) == "float32" for f in ret.fields)      # the interface stays fp32
    same = _mlp_with_layernorm()
    assert to_precision(same, "fp32") is same


def test_precision_is_checked_when_the_options_are_made() -> None:
    with pytest.raises(UsageError, match="--precision 'fp8'"):
        CompileOptions(precision="fp8")
    assert CompileOptions(precision="bf16").to_dict()["precision"] == "bf16"    # so it keys the build cache


def _old_softmax_model() -> onnx.ModelProto:
    """Softmax-11 over (1, 10, 1, 1): it coerces to 2-D at axis 1 (10 classes); Softmax-13 would take the last
    axis (size 1, every value 1.0). onnx.reference reads it as 13; converted to opset 13 it is right."""
    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((10, 3, 1, 1)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("GlobalAveragePool", ["c"], ["p"]),
             helper.make_node("Softmax", ["p"], ["y"])]
    graph = helper.make_graph(nodes, "old_softmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10, 1, 1])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])


def test_fp64_reference_must_agree_with_onnxruntime() -> None:
    model = _old_softmax_model()
    x = {"x": np.random.default_rng(2).standard_normal((1, 3, 4, 4)).astype(np.float32)}
    fp32 = run_onnxruntime(model, x)
    assert to_float64(model).graph.initializer[0].data_type == TensorProto.DOUBLE
    gold, engine = fp64_reference(model, x, ["y"], fp32, run_onnxruntime)
    assert gold["y"].dtype == np.float64 and engine.startswith("onnx.reference")  # ORT has no float64 Conv
    np.testing.assert_allclose(gold["y"], fp32["y"], rtol=1e-5, atol=1e-7)
    assert not np.allclose(gold["y"], 1.0)
    with pytest.raises(ValueError, match="disagrees with ONNX Runtime") as err:   # none agrees: said, not used
        fp64_reference(model, x, ["y"], {"y": -fp32["y"]}, run_onnxruntime)
    assert "ONNX Runtime float64" in str(err.value) and "opset as given" in str(err.value)


def test_the_rule_is_relative_to_the_unfused_error_and_scale_aware() -> None:
    gold = {"y": np.linspace(-1, 1, 1000)}
    noise = np.random.default_rng(0).standard_normal(1000)
    unfused = {"y": gold["y"] + 1e-3 * noise}
    assert check_against_fp64("bf16", {"y": gold["y"] + 2.5e-3 * noise}, unfused, gold, "t")
    worse = check_against_fp64("bf16", {"y": gold["y"] + 1e-2 * noise}, unfused, gold, "t")
    assert isinstance(worse, Fp64Check) and not worse and "MORE WRONG" in worse.summary()
    tol = loose_tolerances("bf16", {"y": np.full(4, 10.0, np.float32)})["y"]
    assert tol.atol == pytest.approx(7.5) and tol.rtol == 0.75


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mlp_verifies_in_reduced_precision_fused_as_right_as_unfused(precision: str) -> None:
    verdict = verify_model(SuiteSpec("mlp_gelu"), options=CompileOptions(precision=precision))
    assert verdict, verdict.to_dict()
    check = verdict.fused.fp64
    assert check and check.outputs and verdict.precision == precision
    out = check.outputs[0]
    assert out.unfused_rmse > 1e-5          # really reduced: fp32 would sit near 1e-7
    assert out.fused_rmse <= 1.5 * out.unfused_rmse
    assert "matmul" in verdict.fused.report.dtypes


def test_a_fused_gemm_accumulating_in_fp16_fails_where_a_loose_tolerance_passes(tmp_path: Path) -> None:
    """The plugin makes fused GEMMs accumulate in fp16: every element is within the loose bound of the fp32
    result, but the fused build is several times further from fp64 than the unfused build."""
    verdict = verify_model(SuiteSpec("mlp_gelu"), options=CompileOptions(precision="fp16"))
    assert verdict      # no plugin yet: passes
    proc = subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "verify", "mlp_gelu", "--precision", "fp16",
                           "--plugin", str(LOWP_ACCUMULATE), "--json", str(tmp_path / "v.json"), "--no-cache"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "MORE WRONG than allowed" in proc.stdout + proc.stderr
    import json

    fused = json.loads((tmp_path / "v.json").read_text())["models"][0]["fused"]
    assert fused["compare"]["passed"]                    # the loose tolerance alone would pass it
    assert not fused["fp64"]["passed"] and fused["fp64"]["outputs"][0]["fused_rmse"] > \
        3 * fused["fp64"]["outputs"][0]["unfused_rmse"]


def test_bisect_in_reduced_precision_names_the_group_more_wrong_than_its_parts(tmp_path: Path) -> None:
    """`fuseguard bisect --precision`: each intermediate judged by the fp64 rule, not by fp32 tolerances. A
    correct bf16 build is no drift (fp32 tolerances would blame its first matmul: 94% of elements off); the
    fused GEMM accumulating in fp16 is named (pattern, ONNX nodes, fused vs unfused error against fp64) while
    every element stays inside the loose budget, and its reproducer fails verify on its own."""
    import json

    def bisect(*args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
        out = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        proc = subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "bisect", "mlp_gelu", *args,
                               "--out", str(tmp_path / "repro"), "--json", str(out), "--no-cache"],
                              capture_output=True, text=True, cwd=ROOT, timeout=600)
        return proc, json.loads(out.read_text()) if out.exists() else {}

    clean, result = bisect("--precision", "bf16")
    assert clean.returncode == 0 and result["status"] == "no-drift", clean.stdout + clean.stderr
    assert any("bf16 vs fp64" in n and "within" in n for n in result["notes"])
    wrong, result = bisect("--precision", "fp16", "--plugin", str(LOWP_ACCUMULATE))
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    culprit = result["culprit"]
    assert culprit["blame"] == "fusion" and culprit["pattern"] == "matmul_bias_gelu", culprit
    assert "MatMul" in culprit["onnx_op_types"] and culprit["onnx_inputs"] == ["x"], culprit
    assert culprit["fp64"].startswith("fp16 vs fp64: fused rmse") and culprit["inputs_agree"] is True
    assert culprit["error"]["passed"]                   # inside the loose budget element by element
    assert result["reproducer"]["confirmed"] is True, result["reproducer"]


@pytest.mark.parametrize("name", ["conv_bn_relu", "mlp_gelu"])
def test_int8_qdq_models_verify_within_two_quantisation_steps(tmp_path: Path, name: str) -> None:
    from fuseguard.verify.check.compare import compare_outputs
    from fuseguard.verify.check.precision import is_qdq, output_steps, qdq_tolerances

    path = _quantised(tmp_path, name)
    model = onnx.load(path)
    assert is_qdq(model)
    steps = output_steps(model)
    assert steps and all(s > 0 for s in steps.values())
    verdict = verify_model(str(path))
    assert verdict, verdict.to_dict()
    # for information: each run against the fp32 model (the activation pairs taken out), ORT's int8 kernels too
    quant = verdict.quantisation
    assert quant is not None and quant.pairs_removed >= 2 and quant.summary() in verdict.warnings
    for name, errs in quant.max_abs.items():
        assert set(errs) == {"fused", "unfused", "ORT reference", "ORT int8 kernels"}
        # quantisation moves the outputs (4 calibration draws: conv_bn_relu's output range is clipped, by as much
        # as its scale), alike in every engine
        assert all(0 < e <= 1.001 * quant.scale[name] for e in errs.values()), (name, errs, quant.scale[name])
        assert errs["fused"] < 2 * errs["ORT reference"] + 2 * steps.get(name, 0.0), errs
    assert verdict.to_dict()["quantisation"]["pairs_removed"] == quant.pairs_removed
    tol = qdq_tolerances(model)
    out = next(iter(steps))
    ref = np.zeros(8, np.float32)
    assert compare_outputs({out: ref + 2 * steps[out]}, {out: ref}, per_output=tol)      # two steps: passes
    assert not compare_outputs({out: ref + 3 * steps[out]}, {out: ref}, per_output=tol)  # three: fails


def test_ops_without_a_float64_kernel_run_in_fp32_islands(monkeypatch: pytest.MonkeyPatch) -> None:
    """ORT has no float64 Erf: with ONNX's evaluator unavailable (it fails on bert_tiny's export), the
    reference runs Erf in fp32 between casts and says so."""
    import onnx.reference

    class Broken:
        def __init__(self, *_a, **_k) -> None:
            raise ValueError("cannot reshape array of size 1 into shape (1,64)")

    monkeypatch.setattr(onnx.reference, "ReferenceEvaluator", Broken)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    nodes = [helper.make_node("Erf", ["x"], ["e"]), helper.make_node("GatherElements", ["e", "i"], ["y"], axis=1)]
    idx = numpy_helper.from_array(np.tile(np.arange(8)[::-1], (4, 1)).astype(np.int64), "i")
    model = helper.make_model(helper.make_graph(nodes, "erf", [x], [y], [idx]),
                              opset_imports=[helper.make_opsetid("", 17)])
    feed = {"x": np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)}
    fp32 = run_onnxruntime(model, feed)
    gold, engine = fp64_reference(model, feed, ["y"], fp32, run_onnxruntime)
    assert gold["y"].dtype == np.float64
    np.testing.assert_allclose(gold["y"], fp32["y"], rtol=1e-6, atol=1e-7)
    assert engine == "ONNX Runtime float64 (Erf in fp32)", engine


@pytest.mark.parametrize("name,rule", [("mlp_gelu", "matmul"), ("conv_bn_relu", "conv2d")])
def test_reduced_operands_take_the_same_cpu_schedules_as_fp32(name: str, rule: str) -> None:
    """A GEMM or conv reading Cast(float32, bf16 load) is matched by the fp32 rules (it ran 35-46x ORT on
    TVM's naive loops before), and computes what the unscheduled bf16 build computes."""
    from fuseguard.compiler.pipeline import compile_model
    from fuseguard.suites.models import get_model

    model = get_model(name)
    feed = {k: np.random.default_rng(0).standard_normal(v).astype(np.float32) for k, v in model.input_shapes().items()}
    built = compile_model(model.make(), model.input_shapes(), options=CompileOptions(precision="bf16"))
    fp32 = compile_model(model.make(), model.input_shapes(), options=CompileOptions())
    rules = {r for r in built.report.schedules.values() if r.startswith(rule)}
    assert rules and rules == {r for r in fp32.report.schedules.values() if r.startswith(rule)}, built.report.schedules
    naive = compile_model(model.make(), model.input_shapes(), options=CompileOptions(precision="bf16", schedule=False))
    np.testing.assert_allclose(built.run(feed)[0], naive.run(feed)[0], rtol=1e-4, atol=1e-4)


def test_a_models_own_fp16_gemm_keeps_its_output_type() -> None:
    """An fp16 model's matmul accumulates in fp32 under --precision fp16 but still returns fp16."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float16"))
    w = relax.const(np.ones((8, 8), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w))
            out = bb.emit_output(relax.op.add(y, y))
        bb.emit_func_output(out)
    mod = to_precision(bb.get(), "fp16")
    assert str(mod["main"].ret_ty.dtype) == "float16"
    assert dtype_census(mod)["matmul"] == {"float32": 1} and dtype_census(mod)["add"] == {"float16": 1}
