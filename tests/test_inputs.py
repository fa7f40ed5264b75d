"""verify.check.inputs: valid seeded inputs for small ONNX models, user overrides, .npz loading."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuseguard.compiler.errors import InputError, ModelError, ShapeError, UsageError
from fuseguard.verify.check.inputs import load_npz, make_inputs, model_inputs

VOCAB, HIDDEN, POSITIONS = 50, 4, 12


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
           initializers: list[onnx.TensorProto] = ()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _bert_embedding() -> onnx.ModelProto:
    """Word + position + token-type embeddings with an additive attention mask, BERT style."""
    rng = np.random.default_rng(0)
    table = lambda name, rows: numpy_helper.from_array(rng.standard_normal((rows, HIDDEN)).astype(np.float32), name)
    nodes = [
        helper.make_node("Gather", ["word", "input_ids"], ["w"]),
        helper.make_node("Cast", ["position_ids"], ["pos64"], to=TensorProto.INT64),
        helper.make_node("Gather", ["position", "pos64"], ["p"]),
        helper.make_node("Gather", ["token_type", "token_type_ids"], ["t"]),
        helper.make_node("Add", ["w", "p"], ["wp"]),
        helper.make_node("Add", ["wp", "t"], ["emb"]),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "mask_f"], ["inv"]),
        helper.make_node("Mul", ["inv", "neg"], ["bias"]),
        helper.make_node("Unsqueeze", ["bias", "last"], ["bias3"]),
        helper.make_node("Add", ["emb", "bias3"], ["out"]),
    ]
    ids = lambda name, elem=TensorProto.INT64: helper.make_tensor_value_info(name, elem, ["batch", "seq"])
    return _model(
        nodes,
        [ids("input_ids"), ids("position_ids", TensorProto.INT32), ids("token_type_ids"), ids("attention_mask")],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "seq", HIDDEN])],
        [table("word", VOCAB), table("position", POSITIONS), table("token_type", 2),
         numpy_helper.from_array(np.array(1.0, np.float32), "one"),
         numpy_helper.from_array(np.array(-1e4, np.float32), "neg"),
         numpy_helper.from_array(np.array([-1], np.int64), "last")],
    )


SHAPES = {name: (2, 7) for name in ("input_ids", "position_ids", "token_type_ids", "attention_mask")}


def _run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


# --- value ranges ---------------------------------------------------------------------------------

def test_embedding_inputs_stay_in_range_and_run_in_ort() -> None:
    model = _bert_embedding()
    feeds = make_inputs(model, SHAPES, seed=0)
    assert list(feeds) == ["input_ids", "position_ids", "token_type_ids", "attention_mask"]
    assert all(a.shape == (2, 7) for a in feeds.values())
    assert feeds["input_ids"].dtype == np.int64 and feeds["position_ids"].dtype == np.int32
    assert 0 <= feeds["input_ids"].min() and feeds["input_ids"].max() < VOCAB
    assert feeds["input_ids"].max() >= 16  # drawn from the whole table, not the small-int default
    assert 0 <= feeds["position_ids"].min() and feeds["position_ids"].max() < POSITIONS  # traced via Cast
    assert set(np.unique(feeds["token_type_ids"])) == {0, 1}  # both rows of the 2-row table
    assert np.all(feeds["attention_mask"] == 1)
    (out,) = _run_ort(model, feeds)
    assert out.shape == (2, 7, HIDDEN) and np.isfinite(out).all()


def test_many_seeds_all_run_in_ort() -> None:
    model = _bert_embedding()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seed in range(20):
        session.run(None, make_inputs(model, {n: (3, 11) for n in SHAPES}, seed=seed))


def test_gather_through_reshape_uses_axis_and_inferred_table_size() -> None:
    """Indices into a non-constant tensor along axis 1: the size comes from shape inference."""
    nodes = [
        helper.make_node("Cast", ["idx"], ["idx64"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["idx64", "flat"], ["idx_flat"]),
        helper.make_node("Gather", ["x", "idx_flat"], ["y"], axis=1),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "m"]),
         helper.make_tensor_value_info("idx", TensorProto.INT32, [4, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "k"])],
        [numpy_helper.from_array(np.array([-1], np.int64), "flat")],
    )
    feeds = make_inputs(model, {"x": (3, 5)}, seed=1)  # idx is fully static: no shape needed
    assert feeds["idx"].shape == (4, 5) and feeds["idx"].max() < 5 and feeds["idx"].min() >= 0
    assert set(np.unique(feeds["idx"])) == set(range(5))
    assert feeds["x"].dtype == np.float32
    _run_ort(model, feeds)


def test_mask_detected_by_structure_and_plain_ints_are_small() -> None:
    nodes = [
        helper.make_node("Cast", ["m"], ["mf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "mf"], ["xm"]),
        helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["xm", "kf"], ["y"]),
    ]
    vi = lambda name, elem: helper.make_tensor_value_info(name, elem, [64])
    model = _model(nodes, [vi("x", TensorProto.FLOAT), vi("m", TensorProto.INT64), vi("k", TensorProto.UINT8)],
                   [vi("y", TensorProto.FLOAT)])
    feeds = make_inputs(model, {}, seed=0)
    assert np.all(feeds["m"] == 1)
    assert feeds["k"].dtype == np.uint8 and feeds["k"].max() < 16 and len(np.unique(feeds["k"])) > 4
    _run_ort(model, feeds)


def test_float_and_bool_dtypes() -> None:
    elems = {"f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16, "f64": TensorProto.DOUBLE,
             "bf16": TensorProto.BFLOAT16, "flag": TensorProto.BOOL, "key_mask": TensorProto.FLOAT}
    nodes = [helper.make_node("Identity", [n], [f"{n}_out"]) for n in elems]
    model = _model(nodes, [helper.make_tensor_value_info(n, e, [1000]) for n, e in elems.items()],
                   [helper.make_tensor_value_info(f"{n}_out", e, [1000]) for n, e in elems.items()])
    feeds = make_inputs(model, {}, seed=5)
    assert {n: a.dtype for n, a in feeds.items()} == {
        "f32": np.float32, "f16": np.float16, "f64": np.float64, "bf16": np.dtype(ml_dtypes.bfloat16),
        "flag": np.bool_, "key_mask": np.float32}
    for name in ("f32", "f16", "f64", "bf16"):  # standard normal
        values = feeds[name].astype(np.float64)
        assert abs(values.mean()) < 0.15 and 0.85 < values.std() < 1.15 and values.min() < 0
    assert 300 < feeds["flag"].sum() < 700
    assert np.all(feeds["key_mask"] == 1.0)


# --- reproducibility and user inputs --------------------------------------------------------------

def test_seeds_reproduce_exactly_and_differ() -> None:
    model = _bert_embedding()
    first, again = make_inputs(model, SHAPES, seed=7), make_inputs(model, SHAPES, seed=7)
    assert all(np.array_equal(first[n], again[n]) for n in first)
    other = make_inputs(model, SHAPES, seed=8)
    assert not np.array_equal(first["input_ids"], other["input_ids"])


def test_user_inputs_override_without_changing_the_others() -> None:
    model = _bert_embedding()
    ids = np.arange(14, dtype=np.int32).reshape(2, 7)  # int32 -> int64 is a safe cast
    feeds = make_inputs(model, SHAPES, seed=3, user={"input_ids": ids})
    assert feeds["input_ids"].dtype == np.int64 and np.array_equal(feeds["input_ids"], ids)
    plain = make_inputs(model, SHAPES, seed=3)
    assert np.array_equal(feeds["position_ids"], plain["position_ids"])
    _run_ort(model, feeds)


def test_user_input_pins_a_dynamic_shape() -> None:
    model = _bert_embedding()
    shapes = {n: (1, 3) for n in SHAPES if n != "input_ids"}
    feeds = make_inputs(model, shapes, user={"input_ids": np.zeros((1, 3), np.int64)})
    assert feeds["input_ids"].shape == (1, 3)
    with pytest.raises(InputError, match=r"'input_ids'.*\[batch, seq\].*\(3,\)"):
        make_inputs(model, shapes, user={"input_ids": np.zeros(3, np.int64)})


def test_unknown_user_input_names_the_key_and_the_inputs() -> None:
    with pytest.raises(InputError, match=r"'input_idz'.*input_ids, position_ids, token_type_ids, attention_mask"):
        make_inputs(_bert_embedding(), SHAPES, user={"input_idz": np.zeros((2, 7), np.int64)})


def test_user_input_with_wrong_shape() -> None:
    with pytest.raises(InputError, match=r"'input_ids'.*expected shape \(2, 7\), got \(2, 8\)"):
        make_inputs(_bert_embedding(), SHAPES, user={"input_ids": np.zeros((2, 8), np.int64)})


@pytest.mark.parametrize("name, value", [("input_ids", np.zeros((2, 7), np.float64)),
                                         ("position_ids", np.zeros((2, 7), np.int64)),
                                         ("input_ids", np.full((2, 7), "a"))])
def test_user_input_with_unsafe_dtype(name: str, value: np.ndarray) -> None:
    with pytest.raises(InputError, match=rf"'{name}'.*expected dtype int(64|32), got {value.dtype.name}"):
        make_inputs(_bert_embedding(), SHAPES, user={name: value})


def test_user_indices_outside_the_table_are_rejected() -> None:
    ids = np.full((2, 7), VOCAB, np.int64)
    with pytest.raises(InputError, match=rf"'input_ids'.*table of {VOCAB}.*\[{VOCAB}, {VOCAB}\]"):
        make_inputs(_bert_embedding(), SHAPES, user={"input_ids": ids})


def test_initializer_backed_inputs_are_not_generated() -> None:
    """Inputs with an initializer of the same name have defaults (IR >= 4) and are not fed."""
    nodes = [helper.make_node("Add", ["x", "bias"], ["y"])]
    vi = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [3])
    model = _model(nodes, [vi("x"), vi("bias")], [vi("y")],
                   [numpy_helper.from_array(np.ones(3, np.float32), "bias")])
    assert [v.name for v in model_inputs(model)] == ["x"]
    assert list(make_inputs(model, {})) == ["x"]
    with pytest.raises(InputError, match="'bias'"):
        make_inputs(model, {}, user={"bias": np.ones(3, np.float32)})


# --- shape and argument errors --------------------------------------------------------------------

def test_unpinned_dynamic_input_is_a_shape_error() -> None:
    shapes = {n: s for n, s in SHAPES.items() if n != "token_type_ids"}
    with pytest.raises(ShapeError, match=r"'token_type_ids'.*\[batch, seq\].*--shape token_type_ids:1,1"):
        make_inputs(_bert_embedding(), shapes)


@pytest.mark.parametrize("shapes, message", [
    ({**SHAPES, "ids": (2, 7)}, r"unknown input 'ids'"),
    ({**SHAPES, "input_ids": (2, 7, 1)}, r"'input_ids'.*rank 3.*rank 2"),
    ({**SHAPES, "input_ids": (2, -7)}, r"'input_ids'.*negative"),
])
def test_bad_pinned_shapes(shapes: dict[str, tuple[int, ...]], message: str) -> None:
    with pytest.raises(ShapeError, match=message):
        make_inputs(_bert_embedding(), shapes)


def test_pinned_shape_must_match_fixed_dims() -> None:
    model = _model([helper.make_node("Identity", ["x"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])])
    assert make_inputs(model, {"x": (2, 3)})["x"].shape == (2, 3)
    with pytest.raises(ShapeError, match=r"'x'.*4 at axis 1.*fixes it to 3"):
        make_inputs(model, {"x": (2, 4)})


def test_bad_seed_and_unsupported_input_type() -> None:
    with pytest.raises(UsageError, match="seed"):
        make_inputs(_bert_embedding(), SHAPES, seed=-1)
    model = _model([helper.make_node("Identity", ["s"], ["t"])],
                   [helper.make_tensor_value_info("s", TensorProto.STRING, [2])],
                   [helper.make_tensor_value_info("t", TensorProto.STRING, [2])])
    with pytest.raises(ModelError, match="'s'.*STRING"):
        make_inputs(model, {})


# --- .npz files -----------------------------------------------------------------------------------

def test_load_npz_roundtrip_including_bfloat16(tmp_path: Path) -> None:
    path = tmp_path / "inputs.npz"
    bf16 = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)
    np.savez(path, input_ids=np.arange(14).reshape(2, 7), b=bf16)
    loaded = load_npz(path)
    assert sorted(loaded) == ["b", "input_ids"] and np.array_equal(loaded["input_ids"], np.arange(14).reshape(2, 7))
    model = _model([helper.make_node("Identity", ["b"], ["c"])],
                   [helper.make_tensor_value_info("b", TensorProto.BFLOAT16, [2])],
                   [helper.make_tensor_value_info("c", TensorProto.BFLOAT16, [2])])
    fed = make_inputs(model, {}, user={"b": loaded["b"]})["b"]  # stored as raw |V2, viewed back
    assert fed.dtype == np.dtype(ml_dtypes.bfloat16) and np.array_equal(fed.astype(np.float32), [1.5, -2.0])


def test_load_npz_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="missing.npz.*does not exist"):
        load_npz(tmp_path / "missing.npz")
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(b"PK\x03\x04 this is not a zip archive")
    with pytest.raises(InputError, match="corrupt.npz.*not a readable"):
        load_npz(corrupt)
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(InputError, match="pickled.npz"):  # object arrays need unpickling: refused
        load_npz(pickled)
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    with pytest.raises(InputError, match="single.npy.*single array"):
        load_npz(single)


def test_narrow_types_are_drawn_over_their_range() -> None:
    """4/2-bit integers over the type's whole range, 8-bit floats rounded to the format (compiler/frontend/converters/subbyte.py and
    narrow_floats.py compile them; ml_dtypes holds them one per byte)."""
    graph = helper.make_graph(
        [helper.make_node("Cast", ["q"], ["a"], to=TensorProto.FLOAT),
         helper.make_node("Cast", ["f"], ["b"], to=TensorProto.FLOAT)], "g",
        [helper.make_tensor_value_info("q", TensorProto.INT4, [4000]),
         helper.make_tensor_value_info("f", TensorProto.FLOAT8E4M3FN, [100])],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [4000]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [100])])
    feeds = make_inputs(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)]), {}, seed=0)
    q, f = feeds["q"], feeds["f"]
    assert q.dtype == ml_dtypes.int4 and {int(v) for v in q.astype(np.int8)} == set(range(-8, 8))
    wide = f.astype(np.float32)
    assert f.dtype == ml_dtypes.float8_e4m3fn and np.isfinite(wide).all() and wide.std() > 0.5
