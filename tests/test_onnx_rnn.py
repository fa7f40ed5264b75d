"""LSTM, GRU and RNN (compiler/frontend/converters/rnn.py) against ONNX Runtime, fused and unfused, with the attributes ONNX's
own reference ignores (clip, activations with parameters, sequence_lens, input_forget, linear_before_reset)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fuseguard.compiler.pipeline import CompileOptions, compile_model

F = TensorProto.FLOAT
T, N, I, H = 5, 3, 4, 6


def _model(kind: str, directions: int, extra_inputs: list[str], n_out: int, **attrs: Any):
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[kind]
    layout = attrs.get("layout", 0)
    x_shape = [N, T, I] if layout else [T, N, I]
    state = [N, directions, H] if layout else [directions, N, H]
    shapes = {"X": x_shape, "W": [directions, gates * H, I], "R": [directions, gates * H, H],
              "B": [directions, 2 * gates * H], "sequence_lens": [N], "initial_h": state, "initial_c": state,
              "P": [directions, 3 * H]}
    names = ["X", "W", "R"] + extra_inputs
    inputs = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]
    node_inputs = [n if n in names else "" for n in inputs[:max(inputs.index(n) for n in names) + 1]]
    outs = ["Y", "Y_h", "Y_c"][:n_out]
    node = helper.make_node(kind, node_inputs, outs, hidden_size=H, **attrs)
    y_shape = [N, T, directions, H] if layout else [T, directions, N, H]
    graph = helper.make_graph(
        [node], kind, [helper.make_tensor_value_info(n, TensorProto.INT32 if n == "sequence_lens" else F, shapes[n])
                       for n in names],
        [helper.make_tensor_value_info(o, F, y_shape if o == "Y" else state) for o in outs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)]), shapes, names


CASES = {
    "lstm_bidirectional_everything": ("LSTM", 2, ["B", "sequence_lens", "initial_h", "initial_c", "P"], 3,
                                      dict(direction="bidirectional", clip=0.9)),
    "lstm_forward_sequence_lens_input_forget": ("LSTM", 1, ["B", "sequence_lens", "initial_h", "initial_c"], 3,
                                                dict(input_forget=1)),
    "lstm_activations_with_parameters": ("LSTM", 1, ["B"], 3,       # (ORT has no layout=1 LSTM to compare with)
                                     dict(activations=["HardSigmoid", "ScaledTanh", "Softsign"],
                                          activation_alpha=[0.3, 0.8], activation_beta=[0.4, 1.2])),
    "gru_linear_before_reset_reverse": ("GRU", 1, ["B", "sequence_lens", "initial_h"], 2,
                                        dict(linear_before_reset=1, direction="reverse")),
    "gru_bidirectional": ("GRU", 2, ["B"], 2, dict(direction="bidirectional")),
    "rnn_leaky_relu_clip": ("RNN", 1, ["B", "sequence_lens", "initial_h"], 2,
                            dict(activations=["LeakyRelu"], activation_alpha=[0.2], clip=1.5)),
}


@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_onnx_runtime(name: str, fusion: bool) -> None:
    kind, directions, extra, n_out, attrs = CASES[name]
    model, shapes, names = _model(kind, directions, extra, n_out, **attrs)
    rng = np.random.default_rng(0)
    feeds = {n: (rng.standard_normal(shapes[n]) * 0.7).astype(np.float32) for n in names if n != "sequence_lens"}
    if "sequence_lens" in names:    # ragged: the state stops at each sequence's end, a reverse pass starts there
        feeds["sequence_lens"] = np.array([T, 2, 4], np.int32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = compile_model(model, {k: v.shape for k, v in feeds.items()}, options=CompileOptions(fusion=fusion)).run(feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
