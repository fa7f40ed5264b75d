"""The built-in model suite: valid ONNX, runnable in ONNX Runtime, computing what it claims.

Numpy references pin the synthetic models' math (a wrong transpose or mask sign would
otherwise go unnoticed, since ORT is the harness's reference too); structural checks pin the
fusion tags to the graph; the light models are checked for the randomisation that keeps their
outputs from being degenerate.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import sliding_window_view
from onnx import numpy_helper
from scipy.special import erf

from fuseguard.suites import light
from fuseguard.suites.models import (
    FUSION_TAGS,
    MASKED_BIAS,
    SuiteModel,
    additive_padding_mask,
    get_model,
    padding_mask,
    suite_models,
)
from fuseguard.suites.strategies import batch_sizes, image_sizes, model_cases, seeds, seq_lens, tile_edges

REQUIRED_MODELS = {
    "mlp_gelu", "mlp_gelu_tanh", "conv_bn_relu", "bert_encoder", "softmax_layernorm", "attention",
    "attention_masked", "resnet50", "squeezenet", "shufflenet", "inception_v1", "inception_v2", "densenet121",
}
HEAVY = {"alexnet"}  # ~240 MB of weights: built and run only in the slow test below
QUICK_MODELS = [m for m in suite_models() if m.name not in HEAVY]
LIGHT_NAMES = [a.name for a in light.LIGHT_ARCHITECTURES if a.name not in HEAVY]
RTOL = ATOL = 1e-4


def _ids(model: SuiteModel) -> str:
    return model.name


@functools.lru_cache(maxsize=None)
def _serialized(name: str, dims: tuple[tuple[str, int], ...] = (), seed: int = 0) -> bytes:
    """Builds are shared between tests: a ResNet-50 build draws 25M weights."""
    return get_model(name).make(dict(dims), seed=seed).SerializeToString()


def _built(name: str, seed: int = 0, **dims: int) -> onnx.ModelProto:
    return onnx.load_from_string(_serialized(name, tuple(sorted(dims.items())), seed))


@functools.lru_cache(maxsize=None)
def _session(name: str, dims: tuple[tuple[str, int], ...] = (), seed: int = 0) -> ort.InferenceSession:
    return ort.InferenceSession(_serialized(name, dims, seed), providers=["CPUExecutionProvider"])


def _outputs(session: ort.InferenceSession, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs)))


def _run(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return _outputs(ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]), inputs)


def _run_built(name: str, inputs: dict[str, np.ndarray], seed: int = 0, **dims: int) -> dict[str, np.ndarray]:
    """Run a cached build of a suite model in a cached session."""
    return _outputs(_session(name, tuple(sorted(dims.items())), seed), inputs)


def _weights(model: onnx.ModelProto, dtype: type = np.float64) -> dict[str, np.ndarray]:
    return {init.name: numpy_helper.to_array(init).astype(dtype) for init in model.graph.initializer}


def _graph_input_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    return {
        inp.name: tuple(d.dim_value for d in inp.type.tensor_type.shape.dim)
        for inp in model.graph.input
    }


# ---------------------------------------------------------------------------------------------
# Numpy references.
# ---------------------------------------------------------------------------------------------


def gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def layernorm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def conv3x3_same(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    windows = sliding_window_view(np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1))), (3, 3), axis=(2, 3))
    y = np.einsum("nchwij,ocij->nohw", windows, w)
    return y if b is None else y + b[None, :, None, None]


def batchnorm(x: np.ndarray, w: dict[str, np.ndarray], prefix: str) -> np.ndarray:
    def per_channel(key: str) -> np.ndarray:
        return w[f"{prefix}.{key}"][None, :, None, None]

    normed = (x - per_channel("running_mean")) / np.sqrt(per_channel("running_var") + 1e-5)
    return normed * per_channel("weight") + per_channel("bias")


def linear(x: np.ndarray, w: dict[str, np.ndarray], prefix: str) -> np.ndarray:
    return x @ w[f"{prefix}.weight"] + w[f"{prefix}.bias"]


def attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    scores = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    return softmax(scores if mask is None else scores + mask) @ v


def bert_reference(w: dict[str, np.ndarray], hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    batch, seq, width = hidden.shape

    def heads(t: np.ndarray) -> np.ndarray:
        return t.reshape(batch, seq, 12, width // 12).transpose(0, 2, 1, 3)

    q, k, v = (heads(linear(hidden, w, f"attention.{p}")) for p in ("query", "key", "value"))
    context = attention_reference(q, k, v, ((1.0 - mask) * MASKED_BIAS)[:, None, None, :])
    merged = context.transpose(0, 2, 1, 3).reshape(batch, seq, width)
    attended = layernorm(linear(merged, w, "attention.output") + hidden,
                         w["attention.layernorm.weight"], w["attention.layernorm.bias"], 1e-12)
    ffn = linear(gelu_erf(linear(attended, w, "intermediate")), w, "output") + attended
    return layernorm(ffn, w["output.layernorm.weight"], w["output.layernorm.bias"], 1e-12)


# ---------------------------------------------------------------------------------------------
# Graph structure: each tag names a chain of ops that must be in the graph.
# ---------------------------------------------------------------------------------------------


def has_chain(model: onnx.ModelProto, ops: Sequence[str]) -> bool:
    """Whether some path of producer -> consumer nodes has exactly these op types."""
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            consumers[name].append(node)

    def continues(node: onnx.NodeProto, rest: Sequence[str]) -> bool:
        return not rest or any(
            nxt.op_type == rest[0] and continues(nxt, rest[1:]) for out in node.output for nxt in consumers[out]
        )

    return any(node.op_type == ops[0] and continues(node, ops[1:]) for node in model.graph.node)


def _has_narrow_conv(model: onnx.ModelProto) -> bool:
    inits = {init.name: init for init in model.graph.initializer}
    return any(n.op_type == "Conv" and inits[n.input[1]].dims[0] < 16 for n in model.graph.node)


def _any_chain(*chains: Sequence[str]) -> Callable[[onnx.ModelProto], bool]:
    return lambda model: any(has_chain(model, chain) for chain in chains)


GELU_ERF_CHAIN = ("MatMul", "Add", "Div", "Erf", "Add", "Mul", "Mul")
GELU_TANH_CHAIN = ("MatMul", "Add", "Pow", "Mul", "Add", "Mul", "Tanh", "Add", "Mul", "Mul")
LAYERNORM_DECOMPOSED_CHAIN = ("ReduceMean", "Sub", "Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul", "Add")

TAG_SIGNATURES: dict[str, Callable[[onnx.ModelProto], bool]] = {
    "conv_bn_relu": _any_chain(("Conv", "BatchNormalization", "Relu")),
    "conv_bn_affine_relu": _any_chain(("Conv", "BatchNormalization", "Mul", "Add", "Relu")),
    "conv_relu": _any_chain(("Conv", "Relu")),
    "matmul_bias_gelu": _any_chain(GELU_ERF_CHAIN, GELU_TANH_CHAIN),
    "gelu_tanh": _any_chain(GELU_TANH_CHAIN),
    "gemm_gelu": _any_chain(("Gemm", "Gelu")),
    "layernorm": _any_chain(("LayerNormalization",), LAYERNORM_DECOMPOSED_CHAIN),
    "layernorm_decomposed": _any_chain(LAYERNORM_DECOMPOSED_CHAIN),
    "softmax": _any_chain(("Softmax",)),
    "attention": _any_chain(("MatMul", "Mul", "Softmax", "MatMul"), ("MatMul", "Mul", "Add", "Softmax", "MatMul")),
    "conv_relu6": _any_chain(("Conv", "Clip")),
    "conv_silu": _any_chain(("Conv", "Sigmoid", "Mul")),
    "conv_hardswish": _any_chain(("Conv", "HardSwish")),
    "conv_leaky_relu": _any_chain(("Conv", "LeakyRelu")),
    "conv_narrow": _has_narrow_conv,
}


# ---------------------------------------------------------------------------------------------
# Registry.
# ---------------------------------------------------------------------------------------------


def test_registry_holds_the_required_models_once() -> None:
    names = [m.name for m in suite_models()]
    assert len(names) == len(set(names))
    assert REQUIRED_MODELS <= set(names)
    assert {n for n in names if n.startswith("pattern_")}


def test_get_model_unknown_name_lists_known_names() -> None:
    assert get_model("bert_encoder").name == "bert_encoder"
    with pytest.raises(KeyError, match="known: .*mlp_gelu.*resnet50"):
        get_model("resnet51")


def test_suite_models_filters_by_slowness_and_tag() -> None:
    fast = {m.name for m in suite_models(include_slow=False)}
    assert "resnet50" not in fast and {"mlp_gelu", "squeezenet"} <= fast
    assert {m.name for m in suite_models(tag="attention")} == {"bert_encoder", "attention", "attention_masked"}
    with pytest.raises(KeyError, match="unknown tag"):
        suite_models(tag="conv_bn_gelu")


def test_every_tag_has_a_structural_signature() -> None:
    assert set(TAG_SIGNATURES) == FUSION_TAGS


@pytest.mark.parametrize("model", suite_models(), ids=_ids)
def test_entry_metadata_is_consistent(model: SuiteModel) -> None:
    assert model.tags and model.tags <= FUSION_TAGS
    assert set(model.dim_ranges) == set(model.default_dims)
    for dim, (lo, hi) in model.dim_ranges.items():
        assert 1 <= lo <= model.default_dims[dim] <= hi
    with pytest.raises(ValueError, match="unknown dims"):
        model.input_shapes({"channels": 3})
    first_dim = next(iter(model.default_dims))
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="positive"):
            model.input_shapes({first_dim: bad})
    assert model.input_shapes({first_dim: np.int64(2)}) == model.input_shapes({first_dim: 2})


# ---------------------------------------------------------------------------------------------
# Every model: valid, runnable, tagged truthfully.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", QUICK_MODELS, ids=_ids)
def test_model_is_valid_and_runs_in_onnxruntime(model: SuiteModel) -> None:
    onnx.checker.check_model(_serialized(model.name), full_check=True)  # bytes: skips a re-serialisation
    assert _graph_input_shapes(_built(model.name)) == model.input_shapes()
    outputs = _run_built(model.name, model.random_inputs(seed=1))
    for name, value in outputs.items():
        assert np.isfinite(value).all(), name
        assert np.ptp(value) > 0, f"{name} is constant"


@pytest.mark.parametrize("model", QUICK_MODELS, ids=_ids)
def test_tags_match_graph_structure(model: SuiteModel) -> None:
    proto = _built(model.name)
    found = {tag for tag, signature in TAG_SIGNATURES.items() if signature(proto)}
    assert model.tags == found  # every tag is backed by the graph, every pattern in it is tagged


@pytest.mark.slow
def test_alexnet_is_valid_and_runs_in_onnxruntime() -> None:
    model = get_model("alexnet")
    proto = model.make()
    onnx.checker.check_model(proto, full_check=True)
    outputs = _run(proto, model.random_inputs())
    assert set(outputs) == {"prob_1", light.LOGITS_OUTPUT}
    assert all(np.isfinite(v).all() for v in outputs.values())
    assert outputs[light.LOGITS_OUTPUT].std() > 0.1


# ---------------------------------------------------------------------------------------------
# Synthetic models compute what their docstrings say.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "gelu"), [("mlp_gelu", gelu_erf), ("mlp_gelu_tanh", gelu_tanh)])
def test_mlp_matches_numpy_reference(name: str, gelu: Callable[[np.ndarray], np.ndarray]) -> None:
    model = get_model(name)
    proto = _built(name, batch=2, seq=3)
    x = model.random_inputs({"batch": 2, "seq": 3})["x"]
    w = _weights(proto)
    expected = linear(gelu(linear(x.astype(np.float64), w, "fc1")), w, "fc2")
    np.testing.assert_allclose(_run_built(name, {"x": x}, batch=2, seq=3)["y"], expected, rtol=RTOL, atol=ATOL)


def test_gelu_forms_share_weights_but_not_math() -> None:
    erf_form, tanh_form = _built("mlp_gelu"), _built("mlp_gelu_tanh")
    assert _weights(erf_form)["fc1.weight"].tobytes() == _weights(tanh_form)["fc1.weight"].tobytes()
    x = get_model("mlp_gelu").random_inputs()
    gap = np.abs(_run_built("mlp_gelu", x)["y"] - _run_built("mlp_gelu_tanh", x)["y"]).max()
    assert 1e-5 < gap < 1e-2  # the tanh form approximates erf to ~1e-3


def test_conv_bn_relu_matches_numpy_reference() -> None:
    proto = _built("conv_bn_relu", batch=2, size=9)
    x = get_model("conv_bn_relu").random_inputs({"batch": 2, "size": 9})["x"]
    w = _weights(proto)
    h = np.maximum(batchnorm(conv3x3_same(x, w["conv1.weight"], w["conv1.bias"]), w, "bn1"), 0)
    expected = np.maximum(batchnorm(conv3x3_same(h, w["conv2.weight"], None), w, "bn2"), 0)
    actual = _run_built("conv_bn_relu", {"x": x}, batch=2, size=9)["y"]
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL)


def test_softmax_layernorm_matches_numpy_reference() -> None:
    proto = _built("softmax_layernorm", batch=2, seq=5)
    x = get_model("softmax_layernorm").random_inputs({"batch": 2, "seq": 5})["x"]
    w = _weights(proto)
    probs = softmax(x.astype(np.float64))
    outputs = _run_built("softmax_layernorm", {"x": x}, batch=2, seq=5)
    for out, prefix in [("layernorm_decomposed", "ln_decomposed"), ("layernorm_op", "ln_op")]:
        expected = layernorm(probs, w[f"{prefix}.weight"], w[f"{prefix}.bias"], 1e-5)
        np.testing.assert_allclose(outputs[out], expected, rtol=RTOL, atol=ATOL, err_msg=out)


@pytest.mark.parametrize("name", ["attention", "attention_masked"])
def test_attention_matches_numpy_reference(name: str) -> None:
    model = get_model(name)
    dims = {"batch": 2, "seq": 17}
    inputs = model.random_inputs(dims, seed=4)
    expected = attention_reference(inputs["q"], inputs["k"], inputs["v"], inputs.get("mask"))
    np.testing.assert_allclose(_run_built(name, inputs, **dims)["output"], expected, rtol=RTOL, atol=ATOL)


def test_bert_encoder_matches_numpy_reference() -> None:
    dims = {"batch": 2, "seq": 7}
    proto = _built("bert_encoder", **dims)
    inputs = get_model("bert_encoder").random_inputs(dims, seed=2)
    inputs["attention_mask"][1, 4:] = 0.0  # make sure some padding is exercised
    expected = bert_reference(_weights(proto), inputs["hidden_states"].astype(np.float64), inputs["attention_mask"])
    actual = _run_built("bert_encoder", inputs, **dims)["output"]
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL)


def test_bert_encoder_ignores_padded_tokens() -> None:
    dims = {"batch": 1, "seq": 8}
    inputs = get_model("bert_encoder").random_inputs(dims)
    inputs["attention_mask"][:] = [[1, 1, 1, 1, 1, 0, 0, 0]]
    kept = [0, 1, 3, 4]

    def output_after_bumping(tokens: slice | int) -> np.ndarray:
        hidden = inputs["hidden_states"].copy()
        hidden[:, tokens] += 3.0
        return _run_built("bert_encoder", {**inputs, "hidden_states": hidden}, **dims)["output"]

    base = _run_built("bert_encoder", inputs, **dims)["output"]
    np.testing.assert_allclose(output_after_bumping(slice(5, None))[:, :5], base[:, :5], rtol=1e-5, atol=1e-5)
    assert np.abs(output_after_bumping(2)[:, kept] - base[:, kept]).max() > 1e-3


def test_reshapes_do_not_bake_in_batch_or_seq() -> None:
    proto = _built("bert_encoder")
    inits = _weights(proto)
    targets = [inits[n.input[1]] for n in proto.graph.node if n.op_type == "Reshape"]
    assert targets and all(list(t[:2]) == [0, 0] for t in targets)


# ---------------------------------------------------------------------------------------------
# Determinism and inputs.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp_gelu", "conv_bn_relu", "squeezenet"])
def test_weights_are_a_function_of_the_seed(name: str) -> None:
    model = get_model(name)
    assert model.make(seed=5).SerializeToString() == model.make(seed=5).SerializeToString()
    assert model.make(seed=5).SerializeToString() != model.make(seed=6).SerializeToString()


def test_random_inputs_are_seeded() -> None:
    model = get_model("attention_masked")
    a, b, c = model.random_inputs(seed=1), model.random_inputs(seed=1), model.random_inputs(seed=2)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["q"], c["q"])


@given(batch=st.integers(1, 4), seq=st.integers(1, 40), seed=seeds())
@settings(max_examples=30, deadline=None)
def test_padding_masks_keep_a_prefix_of_each_row(batch: int, seq: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    mask = padding_mask((batch, seq), rng)
    assert set(np.unique(mask)) <= {0.0, 1.0}
    assert (mask[:, 0] == 1.0).all()
    assert (np.diff(mask, axis=1) <= 0).all()  # never a real token after padding
    additive = additive_padding_mask((batch, 1, 1, seq), rng)
    assert set(np.unique(additive)) <= {0.0, MASKED_BIAS} and (additive[..., 0] == 0.0).all()


# ---------------------------------------------------------------------------------------------
# Strategies.
# ---------------------------------------------------------------------------------------------


def test_tile_edges() -> None:
    assert tile_edges(1, 64) == [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64]
    assert tile_edges(16, 20) == [16, 17, 20]


@pytest.mark.parametrize("bad", [lambda: seq_lens(0), lambda: image_sizes(9, 8), lambda: batch_sizes(0)])
def test_strategy_pieces_reject_empty_ranges(bad: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        bad()


@given(case=model_cases(suite_models()))
@settings(max_examples=60, deadline=None)
def test_drawn_cases_stay_in_range(case: tuple[SuiteModel, dict[str, int], int]) -> None:
    model, dims, seed = case
    assert set(dims) == set(model.default_dims)
    assert all(model.dim_ranges[d][0] <= v <= model.dim_ranges[d][1] for d, v in dims.items())
    assert 0 <= seed < 2**32


@given(case=model_cases(suite_models(include_slow=False)))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_drawn_dims_build_models_with_those_shapes(case: tuple[SuiteModel, dict[str, int], int]) -> None:
    model, dims, seed = case
    proto = model.make(dims, seed=seed)
    assert _graph_input_shapes(proto) == model.input_shapes(dims)
    outputs = _run(proto, model.random_inputs(dims, seed=seed))
    declared = {o.name: tuple(d.dim_value for d in o.type.tensor_type.shape.dim) for o in proto.graph.output}
    assert {k: v.shape for k, v in outputs.items()} == declared
    assert all(np.isfinite(v).all() for v in outputs.values())


# ---------------------------------------------------------------------------------------------
# Light models: randomised weights, exposed logits, variable batch.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LIGHT_NAMES)
def test_light_weights_are_random_initializers_with_sane_statistics(name: str) -> None:
    proto = _built(name)
    graph = proto.graph
    assert not [n for n in graph.node if n.op_type == "ConstantOfShape"]
    assert [i.name for i in graph.input] == [light.light_input_name(name)]
    w = _weights(proto, np.float32)
    checked = 0
    for node in graph.node:
        params = {i: w[x] for i, x in enumerate(node.input) if i > 0 and x in w}
        if node.op_type == "BatchNormalization":
            assert 0.5 <= params[1].min() and params[1].max() <= 1.5
            assert params[4].min() >= light.BN_VARIANCE_FLOOR
        if node.op_type == "Conv" and params[1].size >= 4096:
            fan_in = math.prod(params[1].shape[1:])
            assert params[1].std() == pytest.approx(math.sqrt(2 / fan_in), rel=0.15), node.input[1]
            checked += 1
        for value in params.values():
            assert np.unique(value).size > 1 or value.size == 1
    assert checked


def test_uncalibrated_batchnorm_statistics_follow_the_drawn_distributions() -> None:
    proto = light.build_light_model("shufflenet", calibrate=False)
    w = _weights(proto, np.float32)
    batchnorms = [n for n in proto.graph.node if n.op_type == "BatchNormalization"]
    means = np.concatenate([w[n.input[3]] for n in batchnorms])
    variances = np.concatenate([w[n.input[4]] for n in batchnorms])
    assert 0.5 <= variances.min() and variances.max() <= 1.5
    assert abs(means.mean()) < 0.02 and means.std() == pytest.approx(0.1, rel=0.1)


def test_calibrated_batchnorms_see_unit_scale_inputs_on_fresh_images() -> None:
    """Each BN's stored variance matches what its input shows on an image it was not calibrated on."""
    proto = _built("shufflenet")
    batchnorms = [n for n in proto.graph.node if n.op_type == "BatchNormalization"]
    proto.graph.output.extend(onnx.helper.make_tensor_value_info(n.input[0], onnx.TensorProto.FLOAT, None)
                              for n in batchnorms)
    observed = _run(proto, get_model("shufflenet").random_inputs(seed=9))
    w = _weights(proto, np.float32)
    ratios = np.concatenate([
        observed[n.input[0]].var(axis=(0, 2, 3)) / w[n.input[4]] for n in batchnorms
    ])
    assert 0.7 < np.median(ratios) < 1.4
    assert np.quantile(ratios, 0.95) < 3.0


@pytest.mark.parametrize("name", LIGHT_NAMES)
def test_light_models_expose_logits_iff_they_end_in_softmax(name: str) -> None:
    proto = _built(name)
    producers = {out: n.op_type for n in proto.graph.node for out in n.output}
    outputs = [o.name for o in proto.graph.output]
    if producers[outputs[0]] != "Softmax":
        assert light.LOGITS_OUTPUT not in outputs
        return
    assert outputs[1] == light.LOGITS_OUTPUT
    shapes = [tuple(d.dim_value for d in o.type.tensor_type.shape.dim) for o in proto.graph.output]
    assert shapes[0] == shapes[1]


def test_resnet50_logits_have_a_healthy_spread() -> None:
    model = get_model("resnet50")
    first, second = (_run_built("resnet50", model.random_inputs(seed=s)) for s in (1, 2))
    logits = first[light.LOGITS_OUTPUT]
    assert logits.std() > 0.1 and np.ptp(logits) > 0
    assert np.abs(logits).max() < 100  # calibrated: residual sums do not blow up
    assert 0.0011 < first["gpu_0/softmax_1"].max() < 0.9  # neither uniform nor saturated
    # The output depends on the image, not just on the weights.
    assert (logits - second[light.LOGITS_OUTPUT]).std() > 0.05 * logits.std()


@pytest.mark.parametrize("name", ["shufflenet", "inception_v1"])
def test_light_batch_of_two_equals_two_batches_of_one(name: str) -> None:
    """The caffe2 Reshapes bake in batch 1: shufflenet's channel shuffle must not mix rows at batch 2,
    and inception_v1's weight Reshape (no batch in it) must be left alone."""
    model = get_model(name)
    pair = model.random_inputs({"batch": 2}, seed=3)
    ((input_name, images),) = pair.items()
    together = _run_built(name, pair, batch=2)
    for row in range(2):
        alone = _run_built(name, {input_name: images[row : row + 1]})
        for out, value in alone.items():
            np.testing.assert_allclose(together[out][row : row + 1], value, rtol=1e-5, atol=1e-6, err_msg=out)


def test_unknown_light_architecture() -> None:
    with pytest.raises(KeyError, match="resnet50"):
        light.light_architecture("vgg19")
