"""The compiler pipeline: fusion happens, can be switched off, is explained, and compiles for CUDA on CPU."""

from __future__ import annotations

import numpy as np
import pytest

from fuseguard.compiler import patterns
from fuseguard.compiler.errors import UsageError
from fuseguard.compiler.pipeline import CompileOptions, compile_model, register_pass, unregister_pass
from fuseguard.suites.models import get_model
from fuseguard.verify.check.reference import run_onnxruntime
from fuseguard.verify.check.inputs import make_inputs

NO_SCHED = CompileOptions(schedule=False)


@pytest.fixture(scope="module")
def resnet50():
    m = get_model("resnet50")
    return m.make(dict(m.default_dims), seed=0)


@pytest.fixture(scope="module")
def resnet_builds(resnet50):
    fused = compile_model(resnet50, options=NO_SCHED)
    unfused = compile_model(resnet50, options=NO_SCHED.unfused())
    return fused, unfused


def test_resnet50_fused_has_far_fewer_kernels(resnet_builds) -> None:
    fused, unfused = resnet_builds
    # Conv-BN-ReLU groups alone remove two kernels each from the ~170 of the unfused build.
    assert fused.report.kernels * 2 <= unfused.report.kernels, (fused.report.kernels, unfused.report.kernels)
    assert not unfused.report.groups
    conv_groups = [g for g in fused.report.groups if g.pattern == "conv2d_bias_act"]
    assert len(conv_groups) >= 30
    assert all(g.ops[0] in ("conv2d", "conv2d_NCHWc") for g in conv_groups)
    # Provenance: the groups name the ONNX Conv/BatchNormalization/Relu nodes they came from.
    node_ops = {n.name: n.op_type for n in get_model("resnet50").make({}, seed=0).graph.node}
    named = [g for g in conv_groups if g.onnx_nodes]
    assert len(named) == len(conv_groups)
    assert {node_ops[n] for g in named for n in g.onnx_nodes} >= {"Conv", "BatchNormalization", "Relu"}


def test_every_decision_has_a_reason(resnet_builds) -> None:
    fused, _ = resnet_builds
    assert fused.report.decisions
    for d in fused.report.decisions:
        assert d.reason
        if d.fused:
            assert d.bytes_saved > 0 and "saves" in d.reason


def test_disable_one_pattern(resnet50) -> None:
    build = compile_model(resnet50, options=CompileOptions(schedule=False,
                                                           disabled_patterns=frozenset({"conv2d_bias_act"})))
    assert build.report.count("conv2d_bias_act") == 0
    rejected = [d for d in build.report.decisions if d.pattern == "conv2d_bias_act"]
    assert rejected and all(not d.fused and "disabled" in d.reason for d in rejected)


def test_unknown_pattern_is_a_usage_error(resnet50) -> None:
    with pytest.raises(UsageError, match="unknown pattern"):
        compile_model(resnet50, options=CompileOptions(disabled_patterns=frozenset({"no_such_rule"})))


def test_narrow_conv_not_fused_with_reason() -> None:
    m = get_model("pattern_conv_narrow")
    build = compile_model(m.make({}, seed=0), options=NO_SCHED)
    narrow = [d for d in build.report.decisions if not d.fused]
    assert narrow and "output channels (< 16)" in narrow[0].reason


def test_matmul_gelu_pattern_matches_erf_and_tanh_forms() -> None:
    for name in ("mlp_gelu", "mlp_gelu_tanh", "pattern_gemm_gelu"):
        m = get_model(name)
        build = compile_model(m.make({}, seed=0), options=NO_SCHED)
        assert build.report.count("matmul_bias_gelu") >= 1, (name, [g.ops for g in build.report.groups])


def test_fused_matches_onnxruntime() -> None:
    m = get_model("conv_bn_relu")
    model = m.make({}, seed=1)
    build = compile_model(model, options=NO_SCHED)
    from fuseguard.compiler.frontend.loader import load

    loaded = load(model)
    inputs = make_inputs(loaded.model, loaded.input_shapes, seed=1)
    ref = run_onnxruntime(loaded.model, inputs)
    out = build.run(inputs)
    for got, want in zip(out, ref.values()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_user_pass_runs_at_its_stage() -> None:
    seen: list[int] = []

    def count_functions(mod):
        seen.append(len(mod.functions))
        return mod

    register_pass("after_fusion", count_functions, name="count_functions")
    try:
        compile_model(get_model("conv_bn_relu").make({}, seed=0), options=NO_SCHED)
    finally:
        unregister_pass("after_fusion", "count_functions")
    assert seen and seen[0] >= 2          # main plus at least one fused composite function


def test_user_pattern_registration() -> None:
    from tvm.relax.dpl import is_const, is_op, wildcard

    def variants():
        mm = is_op("relax.matmul")(wildcard(), is_const())
        root = is_op("relax.add")(mm, is_const())
        return [("matmul_add", root, {"root": root})]

    patterns.register_pattern(patterns.PatternRule(name="test_matmul_add", description="test", variants=variants),
                              before="conv2d_bias_act")
    try:
        build = compile_model(get_model("mlp_gelu").make({}, seed=0),
                              options=CompileOptions(schedule=False, disabled_patterns=frozenset({"matmul_bias_gelu"})))
        assert build.report.count("test_matmul_add") >= 1
    finally:
        patterns.unregister_pattern("test_matmul_add")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_codegen_without_gpu(arch: str) -> None:
    """TVM emits CUDA source without a GPU: every kernel is there, with real thread bindings."""
    build = compile_model(get_model("mlp_gelu").make({}, seed=0), options=CompileOptions(gpu_arch=arch))
    source = build.cuda_source()
    assert "__global__" in source
    assert "threadIdx." in source and "blockIdx." in source
    assert build.report.count("matmul_bias_gelu") >= 1


def test_bad_gpu_arch() -> None:
    with pytest.raises(UsageError, match="sm_XX"):
        compile_model(get_model("mlp_gelu").make({}, seed=0), options=CompileOptions(gpu_arch="ampere"))


def test_normalising_rewrites_keep_provenance() -> None:
    """reshape(Gemm(reshape(x))) -> MatMul and x^3 -> x*x*x keep their ONNX nodes in every new binding's
    name: an untagged `lv` matmul drops out of the profile's unfused parts (a phantom 4x slowdown)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from tvm import relax

    from fuseguard.compiler.frontend.importer import import_model, provenance_of
    from fuseguard.compiler.frontend.loader import load
    from fuseguard.compiler.passes.normalize import ExpandSmallPowers, NormalizeFlattenedGemm

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b")
    flat = numpy_helper.from_array(np.array([-1, 8], np.int64), "flat")
    back = numpy_helper.from_array(np.array([1, 4, 16], np.int64), "back")
    three = numpy_helper.from_array(np.array(3.0, np.float32), "three")
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["x2"], name="flatten"),
             helper.make_node("Gemm", ["x2", "w", "b"], ["y2"], name="conv1d"),
             helper.make_node("Reshape", ["y2", "back"], ["y"], name="unflatten"),
             helper.make_node("Pow", ["y", "three"], ["z"], name="cube")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4, 16])],
                              [w, b, flat, back, three])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    imported = import_model(load(model, None, name="provenance"))
    mod = ExpandSmallPowers(NormalizeFlattenedGemm(relax.transform.FoldConstant()(imported.mod)))
    mod = relax.transform.DeadCodeElimination()(mod)
    calls = {}
    for binding in mod["main"].body.blocks[0].bindings:
        if isinstance(binding.value, relax.Call):
            calls.setdefault(binding.value.op.name, []).append(binding.var.name)
    assert "relax.reshape" not in calls, calls
    assert calls["relax.matmul"] and calls["relax.multiply"], calls
    for op, names in calls.items():
        for name in names:
            assert provenance_of([name], imported), f"{op} bound to untagged {name!r}"
    assert set(provenance_of(calls["relax.matmul"], imported)) >= {"conv1d"}
    assert set(provenance_of(calls["relax.multiply"], imported)) == {"cube"}


@pytest.mark.parametrize("exponent", [0.5, 0.25, 0.75, 1.5])
def test_fractional_powers_become_square_roots_and_match_powf(exponent: float) -> None:
    """x^0.5, x^0.25, x^0.75 and x^1.5 (AlexNet's and GoogLeNet's LRN raise to 0.75) become square roots and
    a multiply in one kernel, vector instructions, where powf is a libm call a lane; against ONNX Runtime's
    powf within a few ulp, NaN where it is NaN (negative bases), +inf at -inf, no overflow where x^0.75 has
    none."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from fuseguard.compiler.frontend.loader import load
    from fuseguard.compiler.pipeline import CompileOptions, compile_model

    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(0, 10, 50), rng.uniform(0, 1e-30, 4), [0.0, -0.0, 1.0, 3e38, 1e30, 2.5e-43,
                                                                          -1.0, -np.inf, np.inf, np.nan]])
    x = x.astype(np.float32).reshape(1, -1)
    c = numpy_helper.from_array(np.array(exponent, np.float32), "c")
    graph = helper.make_graph([helper.make_node("Pow", ["x", "c"], ["y"])], "pow",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(x.shape))], [c])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    compiled = compile_model(load(model, None, name="pow"), options=CompileOptions())
    assert "T.pow(" not in compiled.lowered.script() and len(compiled.report.call_sites) == 1
    got = compiled.run({"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=3e-7, atol=0, equal_nan=True)


def _scan_sort_model() -> "onnx.ModelProto":
    """RoBERTa's position ids (CumSum over a padding mask) and a TopK: ops with no LegalizeOps rule."""
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Constant", [], ["pad"], value=helper.make_tensor("pad", TensorProto.INT64, [], [1])),
        helper.make_node("Constant", [], ["axis"], value=helper.make_tensor("axis", TensorProto.INT64, [], [1])),
        helper.make_node("Constant", [], ["k"], value=helper.make_tensor("k", TensorProto.INT64, [1], [3])),
        helper.make_node("Equal", ["ids", "pad"], ["is_pad"]),
        helper.make_node("Not", ["is_pad"], ["keep"]),
        helper.make_node("Cast", ["keep"], ["keep_i"], to=TensorProto.INT32),
        helper.make_node("CumSum", ["keep_i", "axis"], ["csum"]),
        helper.make_node("Mul", ["csum", "keep_i"], ["positions"]),
        helper.make_node("TopK", ["scores", "k"], ["top", "top_i"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "scan_sort",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 16]),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, [2, 10])],
        [helper.make_tensor_value_info("positions", TensorProto.INT32, [2, 16]),
         helper.make_tensor_value_info("top", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("top_i", TensorProto.INT64, [2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("fusion", [True, False])
def test_scans_and_sorts_build_and_match(fusion: bool) -> None:
    """CumSum and TopK reach their TE kernels through TVM's dispatchers (a RoBERTa export failed codegen on an
    unlowered R.cumsum) and agree with ONNX Runtime."""
    from fuseguard.compiler.frontend.loader import load

    model = _scan_sort_model()
    rng = np.random.default_rng(0)
    inputs = {"ids": rng.integers(0, 4, (2, 16)).astype(np.int64),
              "scores": rng.permutation(20).reshape(2, 10).astype(np.float32)}   # distinct: a unique top 3
    ref = run_onnxruntime(load(model).model, inputs)
    out = compile_model(load(model), options=CompileOptions(fusion=fusion)).run(inputs)
    for got, want in zip(out, ref.values()):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case", [
    dict(c_in=1, c_out=32, k=10, stride=5, pads=(0, 0), groups=1, dilation=1),     # Wav2Vec2's first conv
    dict(c_in=32, c_out=32, k=3, stride=2, pads=(1, 1), groups=1, dilation=1),     # Whisper's second
    dict(c_in=32, c_out=32, k=8, stride=1, pads=(4, 3), groups=4, dilation=1),     # positional conv, grouped
    dict(c_in=16, c_out=24, k=3, stride=1, pads=(2, 2), groups=1, dilation=2),
])
def test_conv1d_runs_as_conv2d_and_matches(case: dict) -> None:
    """Conv1d (+bias, GELU by Erf) becomes a height-1 conv2d: no CPU rule scheduled conv1d (Wav2Vec2 30x ORT)."""
    from onnx import TensorProto, helper, numpy_helper

    from fuseguard.compiler.frontend.loader import load

    rng = np.random.default_rng(0)
    length = 97
    w = (rng.standard_normal((case["c_out"], case["c_in"] // case["groups"], case["k"])) * 0.3).astype(np.float32)
    out_len = (length + sum(case["pads"]) - case["dilation"] * (case["k"] - 1) - 1) // case["stride"] + 1
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(rng.standard_normal(case["c_out"]).astype(np.float32), "b"),
             numpy_helper.from_array(np.array(np.sqrt(2.0), np.float32), "s2")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[case["k"]], strides=[case["stride"]],
                              pads=list(case["pads"]), group=case["groups"], dilations=[case["dilation"]]),
             helper.make_node("Div", ["y", "s2"], ["d"]), helper.make_node("Erf", ["d"], ["e"])]
    graph = helper.make_graph(nodes, "conv1d", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, case["c_in"], length])],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, case["c_out"], out_len])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = {"x": rng.standard_normal((1, case["c_in"], length)).astype(np.float32)}
    ref = run_onnxruntime(load(model).model, x)
    for fusion in (True, False):
        built = compile_model(load(model), options=CompileOptions(fusion=fusion))
        np.testing.assert_allclose(built.run(x)[0], list(ref.values())[0], rtol=1e-4, atol=1e-5)
        assert not any("conv1d" in k for k in built.report.schedules), built.report.schedules
        assert any("conv2d" in k for k in built.report.schedules), built.report.schedules


def test_verify_imports_the_model_once_for_both_builds(monkeypatch) -> None:
    """Fused and unfused start from one Relax import (each gets its own copy of the module)."""
    import fuseguard.compiler.frontend.importer as importer
    from fuseguard.verify.check.model import SuiteSpec, verify_model

    monkeypatch.setenv("FUSEGUARD_NO_CACHE", "1")
    calls = []
    raw = importer._raw_import
    monkeypatch.setattr(importer, "_raw_import", lambda *a, **k: calls.append(1) or raw(*a, **k))
    verdict = verify_model(SuiteSpec("conv_bn_relu"))
    assert verdict.passed and verdict.fused.kernels < verdict.unfused.kernels
    assert len(calls) == 1


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_max_of_a_row_of_minus_inf_is_minus_inf(keepdims: int, op: str) -> None:
    """TOPI's max starts from the lowest finite value (a row of -inf read -3.4e38), its min from the largest;
    ONNX and numpy say -inf (+inf)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node(op, ["x", "axes"], ["m"], keepdims=keepdims)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info("m", TensorProto.FLOAT, [3, 1] if keepdims else [3])],
                              [helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.array([[-np.inf] * 4, [0, -np.inf, 2, -1], [np.finfo(np.float32).min] * 4], np.float32)
    if op == "ReduceMin":
        x = -x
    for fusion in (True, False):
        got = compile_model(model, {"x": x.shape}, options=CompileOptions(fusion=fusion)).run({"x": x})[0]
        want = x.max(axis=1, keepdims=bool(keepdims)) if op == "ReduceMax" else x.min(axis=1, keepdims=bool(keepdims))
        np.testing.assert_array_equal(got, want)
