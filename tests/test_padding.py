"""Channel padding before the layout step (compiler/passes/padding.py): convs whose channels are not whole blocks padded
with zero filters, the padding carried through per-channel ops, exact, and dropped where it cannot be carried."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuseguard.compiler.passes import layout
from fuseguard.compiler.frontend.loader import load
from fuseguard.compiler.passes.padding import padded_channels
from fuseguard.compiler.pipeline import CompileOptions, compile_model

RTOL, ATOL = 1e-4, 1e-4
C, WIDE, HW = 28, 168, 14      # 28 channels: whole blocks neither of 8 nor of 16 lanes (both pad to 32)


@pytest.fixture
def always_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout, "MIN_MACS_PER_MOVED", 0)


def _mbconv() -> onnx.ModelProto:
    """An inverted residual block as torchvision exports them, at 28 channels: conv + BatchNorm-as-ops + ReLU,
    1x1 expansion + ReLU6, depthwise + SiLU, squeeze-and-excite, 1x1 projection, residual add, a divide by a
    per-channel constant; then three consumers: a 1x1 conv, a global pool + flatten (the padding must be
    sliced off before the flatten) and a Log (a padded zero would become -inf there and NaN in the conv
    after it, so the padding must stop before it)."""
    rng = np.random.default_rng(0)

    def w(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    inits = {"w1": w(C, 32, 3, 3), "b1": w(C), "s": w(C, 1, 1) + 1, "t": w(C, 1, 1),
             "w2": w(WIDE, C, 1, 1), "b2": w(WIDE), "lo": np.array(0, np.float32), "hi": np.array(6, np.float32),
             "wd": w(WIDE, 1, 3, 3), "bd": w(WIDE), "we1": w(8, WIDE, 1, 1), "be1": w(8),
             "we2": w(WIDE, 8, 1, 1), "be2": w(WIDE), "w3": w(C, WIDE, 1, 1), "b3": w(C),
             "d": np.abs(w(1, C, 1, 1)) + 0.5, "w4": w(32, C, 1, 1), "w5": w(16, C, 1, 1)}
    n = helper.make_node
    nodes = [
        n("Conv", ["x", "w1", "b1"], ["c1"], pads=[1] * 4, kernel_shape=[3, 3]),
        n("Mul", ["c1", "s"], ["m1"]), n("Add", ["m1", "t"], ["a1"]), n("Relu", ["a1"], ["a"]),
        n("Conv", ["a", "w2", "b2"], ["c2"], kernel_shape=[1, 1]), n("Clip", ["c2", "lo", "hi"], ["b"]),
        n("Conv", ["b", "wd", "bd"], ["c3"], pads=[1] * 4, kernel_shape=[3, 3], group=WIDE),
        n("Sigmoid", ["c3"], ["sg"]), n("Mul", ["c3", "sg"], ["dw"]),
        n("GlobalAveragePool", ["dw"], ["gp"]), n("Conv", ["gp", "we1", "be1"], ["e1"], kernel_shape=[1, 1]),
        n("Relu", ["e1"], ["r1"]), n("Conv", ["r1", "we2", "be2"], ["e2"], kernel_shape=[1, 1]),
        n("Sigmoid", ["e2"], ["se"]), n("Mul", ["dw", "se"], ["ex"]),
        n("Conv", ["ex", "w3", "b3"], ["c4"], kernel_shape=[1, 1]), n("Add", ["c4", "a"], ["res"]),
        n("Div", ["res", "d"], ["g"]),
        n("Conv", ["g", "w4"], ["out"], kernel_shape=[1, 1]),
        n("GlobalAveragePool", ["g"], ["pool"]), n("Flatten", ["pool"], ["flat"]),
        n("Abs", ["g"], ["ab"]), n("Log", ["ab"], ["lg"]), n("Conv", ["lg", "w5"], ["logs"], kernel_shape=[1, 1]),
    ]
    outs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 32, HW, HW]),
            helper.make_tensor_value_info("flat", TensorProto.FLOAT, [1, C]),
            helper.make_tensor_value_info("logs", TensorProto.FLOAT, [1, 16, HW, HW])]
    graph = helper.make_graph(nodes, "mbconv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, HW, HW])],
                              outs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_padded_channel_counts() -> None:
    assert padded_channels(24, 16, 196) == 32
    assert padded_channels(24, 8, 196) is None          # whole blocks already
    assert padded_channels(72, 16, 196) == 80
    assert padded_channels(20, 16, 196) is None         # 1.6x the MACs
    assert padded_channels(8, 16, 1) == 16              # a squeeze-and-excite conv on a 1x1 plane: free
    assert padded_channels(4, 16, 49) is None


def test_padded_convs_are_exact_blocked_and_stop_where_the_padding_cannot_pass(always_block: None) -> None:
    model = _mbconv()
    x = np.random.default_rng(1).standard_normal((1, 32, HW, HW)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert all(np.isfinite(o).all() for o in want)
    lines = {}
    for options in (CompileOptions(), CompileOptions().unfused(), CompileOptions(channel_padding=False)):
        built = compile_model(load(model, None, name="mbconv"), options=options)
        got = built.run({"x": x})
        np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(got[1], want[1], rtol=RTOL, atol=ATOL)
        # the log of values near zero amplifies the fast sigmoid's 1e-6 into 1e-3; a padded zero reaching it
        # would be NaN
        assert np.isfinite(got[2]).all()
        np.testing.assert_allclose(got[2], want[2], rtol=1e-3, atol=3e-3)
        lines[options.config_label, options.channel_padding] = built.report.layout
    padded, unfused, off = lines[("fused", True)], lines[("unfused", True)], lines[("fused", False)]
    # every conv blocked but the one after the Log, whose input the padding must not reach
    assert " for 7 of 8 convs" in padded and "padded to whole blocks" in padded, padded
    assert unfused == padded                        # the unfused build takes the same decision
    assert "padded" not in off and " for 7 of 8 convs" not in off, off
