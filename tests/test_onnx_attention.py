"""ONNX's own Attention operator (opset 23-25) imported as Relax ops, against ONNX's reference implementation,
fused and unfused, and fused into the tiled attention kernel where the pattern allows."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from fuseguard.compiler.pipeline import CompileOptions, compile_model

B, H, S, D = 1, 4, 6, 8


def _model(opset: int, inputs: dict[str, tuple[int, list[int]]], outputs: dict[str, list[int]], **attrs: Any):
    names = [n if n in inputs else "" for n in ("Q", "K", "V", "attn_mask", "past_key", "past_value",
                                                 "nonpad_kv_seqlen")]
    while names and not names[-1]:
        names.pop()
    node = helper.make_node("Attention", names, list(outputs), **attrs)
    graph = helper.make_graph(
        [node], "attention",
        [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _feeds(model, rng: np.random.Generator, **fixed: np.ndarray) -> dict[str, np.ndarray]:
    out = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        out[i.name] = fixed[i.name] if i.name in fixed else rng.standard_normal(shape).astype(np.float32)
    return out


F = TensorProto.FLOAT
QKV4 = {"Q": (F, [B, H, S, D]), "K": (F, [B, H, S, D]), "V": (F, [B, H, S, D])}
FULLY_MASKED = np.array([[True] * S] * (S - 1) + [[False] * S])            # the last query sees no key

CASES = {
    "4d": (23, QKV4, {"Y": [B, H, S, D]}, {}, {}),
    "4d_causal_scaled_softcap": (23, QKV4, {"Y": [B, H, S, D]}, {"is_causal": 1, "scale": 0.3, "softcap": 2.0}, {}),
    "3d_gqa_causal_past_present": (
        23, {"Q": (F, [B, S, H * D]), "K": (F, [B, S, 2 * D]), "V": (F, [B, S, 2 * D]),
             "past_key": (F, [B, 2, 3, D]), "past_value": (F, [B, 2, 3, D])},
        {"Y": [B, S, H * D], "present_key": [B, 2, S + 3, D], "present_value": [B, 2, S + 3, D]},
        {"is_causal": 1, "q_num_heads": H, "kv_num_heads": 2}, {}),
    "bool_mask_fully_masked_row": (23, {**QKV4, "attn_mask": (TensorProto.BOOL, [S, S])}, {"Y": [B, H, S, D]}, {},
                                   {"attn_mask": FULLY_MASKED}),
    "short_float_mask_padded_qk_mode3": (
        23, {**QKV4, "attn_mask": (F, [B, 1, S, S - 2])},
        {"Y": [B, H, S, D], "present_key": [B, H, S, D], "present_value": [B, H, S, D], "qk": [B, H, S, S]},
        {"qk_matmul_output_mode": 3}, {}),
    "nonpad_kv_seqlen_causal": (24, {**QKV4, "nonpad_kv_seqlen": (TensorProto.INT64, [B])}, {"Y": [B, H, S, D]},
                                {"is_causal": 1}, {"nonpad_kv_seqlen": np.array([S - 1], np.int64)}),
    "sliding_window": (25, QKV4, {"Y": [B, H, S, D]}, {"left_window_size": 2, "right_window_size": 1}, {}),
}


@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_the_onnx_reference(name: str, fusion: bool) -> None:
    opset, inputs, outputs, attrs, fixed = CASES[name]
    model = _model(opset, inputs, outputs, **attrs)
    feeds = _feeds(model, np.random.default_rng(0), **fixed)
    expected = ReferenceEvaluator(model).run(None, feeds)
    compiled = compile_model(model, {k: v.shape for k, v in feeds.items()}, options=CompileOptions(fusion=fusion))
    got = compiled.run(feeds)
    assert len(got) == len(expected)
    for out, ref, info in zip(got, expected, model.graph.output):
        assert out.shape == ref.shape, info.name
        assert not np.isnan(out).any(), f"{info.name}: NaN (a fully masked row must give 0)"
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5, err_msg=info.name)


@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
def test_only_minus_inf_masks_a_key_and_a_row_of_finfo_min_is_ordinary(fusion: bool) -> None:
    """A mask of large negative finite values (HF writes finfo.min) is attendable, as in ONNX's reference;
    only -inf masks a key. Fused, the tiled kernel once took scores below -3e38 for empty rows (0) while
    the unfused softmax averaged them; both now follow the reference."""
    model = _model(23, {**QKV4, "attn_mask": (F, [S, S])}, {"Y": [B, H, S, D]})
    mask = np.zeros((S, S), np.float32)
    mask[-1] = np.finfo(np.float32).min
    mask[-2] = -np.inf
    feeds = _feeds(model, np.random.default_rng(1), attn_mask=mask)
    got = compile_model(model, {k: v.shape for k, v in feeds.items()},
                        options=CompileOptions(fusion=fusion)).run(feeds)[0]
    np.testing.assert_allclose(got[:, :, -2], 0.0)
    np.testing.assert_allclose(got[:, :, -1], feeds["V"].mean(axis=2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("three_d", [False, True], ids=["4d", "3d-gqa"])
def test_becomes_the_tiled_attention_kernel(three_d: bool) -> None:
    if three_d:
        inputs = {"Q": (F, [B, S, H * D]), "K": (F, [B, S, 2 * D]), "V": (F, [B, S, 2 * D])}
        model = _model(23, inputs, {"Y": [B, S, H * D]}, is_causal=1, q_num_heads=H, kv_num_heads=2)
    else:
        model = _model(23, QKV4, {"Y": [B, H, S, D]}, is_causal=1)
    feeds = _feeds(model, np.random.default_rng(2))
    compiled = compile_model(model, {k: v.shape for k, v in feeds.items()})
    assert [g.pattern for g in compiled.report.groups].count("attention") == 1, compiled.report.groups
    np.testing.assert_allclose(compiled.run(feeds)[0], ReferenceEvaluator(model).run(None, feeds)[0],
                               rtol=1e-4, atol=1e-5)


def test_what_it_cannot_convert_is_one_line_naming_the_node() -> None:
    from fuseguard.compiler.errors import FuseguardError

    inputs = {"Q": (F, [B, S, H * D]), "K": (F, [B, S, H * D]), "V": (F, [B, S, H * D])}
    model = _model(23, inputs, {"Y": [B, S, H * D]})                 # 3D without q_num_heads / kv_num_heads
    with pytest.raises(FuseguardError) as err:
        compile_model(model, {n: s for n, (_, s) in inputs.items()})
    message = str(err.value)
    assert "Attention" in message and "q_num_heads and kv_num_heads" in message and "\n" not in message
