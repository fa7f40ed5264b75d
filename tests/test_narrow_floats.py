"""ONNX's 8-bit floats (compiler/frontend/converters/narrow_floats.py) bit for bit against ml_dtypes and ONNX's own helpers."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
import tvm
from tvm import relax

from fuseguard.compiler.frontend.converters import narrow_floats as nf


def _probe(npdt: type) -> np.ndarray:
    """Random values over 10 decades, the edges (Inf, NaN, +-0, the largest finite and past it), every
    finite value of the format and every midpoint between two of them (the ties)."""
    rng = np.random.default_rng(0)
    every = np.arange(256, dtype="uint8").view(npdt).astype("float32")
    finite = np.sort(every[np.isfinite(every)])
    mids = ((finite[1:].astype("float64") + finite[:-1]) / 2).astype("float32")
    edges = np.array([0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 448, 464, 465, 480, 57344, 61440, 1e-9, -1e-9,
                      2 ** -9, 2 ** -10, 3 * 2 ** -11, 3e38], "float32")
    spread = [rng.standard_normal(500).astype("float32") * s for s in (1e-4, 1e-2, 1, 100, 1e4, 1e6)]
    return np.concatenate([*spread, edges, mids, -mids, every]).astype("float32")


def _run(fmt: nf.NarrowFloat, x: np.ndarray, saturate: bool, round_mode: str = "up") -> tuple[np.ndarray, np.ndarray]:
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType((len(x),), "float32"))
    with bb.function("main", [xv]):
        y = nf.to_narrow(bb, xv, fmt, saturate, round_mode)
        bb.emit_func_output(relax.Tuple([y, nf.from_narrow(bb, y, fmt, "float32")]))
    out = relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())["main"](tvm.runtime.tensor(x))
    return out[0].numpy().view("uint8"), out[1].numpy()


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a == b) | (np.isnan(a) & np.isnan(b))


@pytest.mark.parametrize("fmt", list(nf.FORMATS.values()), ids=lambda f: f.dtype)
@pytest.mark.parametrize("saturate", [True, False], ids=["saturate", "no_saturate"])
def test_encode_and_decode_match_ml_dtypes(fmt: nf.NarrowFloat, saturate: bool) -> None:
    npdt = getattr(ml_dtypes, fmt.dtype)
    x = _probe(npdt)
    modes = ("up", "down", "nearest") if fmt.kind == "e8m0" else ("up",)
    for mode in modes:
        got, decoded = _run(fmt, x, saturate, mode)
        if fmt.kind == "e8m0":
            want = onnx.numpy_helper.to_float8e8m0(x, saturate, mode).view("uint8")
        else:
            want = (onnx.numpy_helper.saturate_cast(x, npdt) if saturate else x.astype(npdt)).view("uint8")
        g, w = got.view(npdt).astype("float32"), want.view(npdt).astype("float32")
        bad = ~_same(g, w)
        assert not bad.any(), (f"{fmt.dtype} {mode}: {int(bad.sum())} values differ, e.g. x={x[bad][:4]} -> "
                               f"{got[bad][:4]}, expected {want[bad][:4]}")
        assert _same(decoded, g).all(), f"{fmt.dtype}: decoding differs from ml_dtypes"


def test_onnx_casts_and_qdq_through_the_compiler_match_the_reference() -> None:
    """Through the importer and both pipelines: Cast to E4M3FN without saturation (overflow is NaN), CastLike
    to E5M2FNUZ from a zero-size `like`, an E5M2 graph input decoded to float16, and a per-channel QDQ pair in
    E4M3FN; each against ONNX's reference, bit for bit."""
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    from fuseguard.compiler.pipeline import CompileOptions, compile_model

    F = TensorProto.FLOAT
    nodes = [
        helper.make_node("Cast", ["x"], ["a"], to=TensorProto.FLOAT8E4M3FN, saturate=0),
        helper.make_node("CastLike", ["x", "like"], ["b"]),
        helper.make_node("Cast", ["h"], ["c"], to=TensorProto.FLOAT16),
        helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["q"], axis=1),
        helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["d"], axis=1),
    ]
    graph = helper.make_graph(
        nodes, "narrow",
        [helper.make_tensor_value_info("x", F, [4, 3]),
         helper.make_tensor_value_info("like", TensorProto.FLOAT8E5M2FNUZ, [0]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT8E5M2, [6])],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT8E4M3FN, [4, 3]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT8E5M2FNUZ, [4, 3]),
         helper.make_tensor_value_info("c", TensorProto.FLOAT16, [6]),
         helper.make_tensor_value_info("d", F, [4, 3])],
        [helper.make_tensor("scale", F, [3], [0.5, 2.0, 0.03125]),
         helper.make_tensor("zero", TensorProto.FLOAT8E4M3FN, [3], [0, 0, 0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    feeds = {"x": np.array([[1e3, -500, 3.3], [np.nan, -np.inf, 0.07], [-0.0, 240.1, 1e-3], [17, -17, 2]], np.float32),
             "like": np.zeros(0, ml_dtypes.float8_e5m2fnuz),
             "h": np.array([0x00, 0x7C, 0xFC, 0x7E, 0x01, 0x83], np.uint8).view(ml_dtypes.float8_e5m2)}
    expected = ReferenceEvaluator(model).run(None, feeds)
    for fusion in (True, False):
        shapes = {k: v.shape for k, v in feeds.items()}
        got = compile_model(model, shapes, options=CompileOptions(fusion=fusion)).run(feeds)
        for name, g, w in zip("abcd", got, expected):
            assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
            g32, w32 = g.astype(np.float32), w.astype(np.float32)
            assert _same(g32, w32).all(), (name, fusion, g32, w32)
