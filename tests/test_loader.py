"""compiler.frontend.loader and compiler.frontend.importer on hand-made models: --shape parsing, shape pinning
and its defaults, memory refusals, external-data containment, file sniffing, operator checks, and
the importer's shape-folding retry. No CLI here (tests/test_bad_models.py does that)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuseguard.compiler.errors import ModelError, ShapeError, UnsupportedOperatorError
from fuseguard.compiler.frontend.loader import (AUTO_OTHER, AUTO_SPATIAL, MAX_PROTOBUF_BYTES, load, load_model,
                                                parse_shape_spec, pin_shapes)


def _vi(name: str, dims, elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, dims)


def _model(nodes, inputs, outputs, inits=(), opset: int = 17, ir: int = 8, functions=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], functions=list(functions))
    model.ir_version = ir
    return model


def _identity(*dims_per_input) -> onnx.ModelProto:
    names = [f"x{i}" for i in range(len(dims_per_input))]
    nodes = [helper.make_node("Identity", [n], [f"y{i}"], name=f"id{i}") for i, n in enumerate(names)]
    return _model(nodes, [_vi(n, d) for n, d in zip(names, dims_per_input)],
                  [_vi(f"y{i}", None) for i in range(len(names))])


# ----------------------------------------------------------------------------- parse_shape_spec

@pytest.mark.parametrize("spec, expected", [
    ("input=1x3x224x224", ("input", (1, 3, 224, 224))),
    ("input:1,3,224,224", ("input", (1, 3, 224, 224))),
    ("input_ids=2x 128", ("input_ids", (2, 128))),
    ("serving_default:x=1x4", ("serving_default:x", (1, 4))),   # TF-style names keep their ':'
    ("scalar=", ("scalar", ())),
])
def test_parse_shape_spec(spec: str, expected) -> None:
    assert parse_shape_spec(spec) == expected


@pytest.mark.parametrize("spec, fragment", [
    ("input", "expected NAME=DIMS"),
    ("=1x3", "missing input name"),
    ("x=1xAx3", "must be integers"),
    ("x=1x-3", "negative dimension"),
    ("x=1x99999999999999999999", "64-bit"),
])
def test_parse_shape_spec_rejects(spec: str, fragment: str) -> None:
    with pytest.raises(ShapeError, match=fragment) as info:
        parse_shape_spec(spec)
    assert repr(spec) in str(info.value)


# ----------------------------------------------------------------------------- pin_shapes

def test_dynamic_dims_get_role_based_defaults_and_are_reported_as_guessed() -> None:
    model = _identity(["N", 3, "H", "W"], ["N", "H", "W", 3], ["batch", "sequence"], [2, 5], ["n"])
    guessed: dict[str, tuple[int, ...]] = {}
    pinned, dtypes = pin_shapes(model, guessed=guessed)
    assert pinned == {"x0": (1, 3, AUTO_SPATIAL, AUTO_SPATIAL), "x1": (1, AUTO_SPATIAL, AUTO_SPATIAL, 3),
                      "x2": (1, AUTO_OTHER), "x3": (2, 5), "x4": (AUTO_OTHER,)}
    assert AUTO_SPATIAL % 32 == 0  # DBNet-style detectors downsample by 32
    assert set(guessed) == {"x0", "x1", "x2", "x4"} and dtypes["x0"] == "float32"
    # The pinned shapes are written into the model, so ORT and TVM see the same static shapes.
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [1, 3, AUTO_SPATIAL, AUTO_SPATIAL]


def test_default_dim_overrides_every_dynamic_dim_and_must_be_positive() -> None:
    pinned, _ = pin_shapes(_identity(["N", 3, "H", "W"], ["b", "s"]), default_dim=8)
    assert pinned == {"x0": (8, 3, 8, 8), "x1": (8, 8)}
    with pytest.raises(ShapeError, match="--default-dim must be at least 1"):
        pin_shapes(_identity(["b"]), default_dim=0)


def test_negative_declared_dims_are_dynamic() -> None:
    """Paddle exports write -1 for dynamic dims; --shape must be able to pin them."""
    model = _identity([-1, 3, -1, -1])
    assert pin_shapes(model, {"x0": (2, 3, 48, 192)})[0] == {"x0": (2, 3, 48, 192)}
    assert pin_shapes(_identity([-1, 3, -1, -1]))[0] == {"x0": (1, 3, AUTO_SPATIAL, AUTO_SPATIAL)}


def test_declared_zero_dim_is_refused_unless_pinned() -> None:
    with pytest.raises(ShapeError, match=r"input 'x0' is declared with a zero-size dimension \[0, 4\]"):
        pin_shapes(_identity([0, 4]), label="m.onnx")
    assert pin_shapes(_identity([0, 4]), {"x0": (2, 4)})[0] == {"x0": (2, 4)}
    # pinned to 0 on purpose (the ONNX node suite's empty reductions, CastLike's dtype-only `like`): verified
    assert pin_shapes(_identity(["n", 4]), {"x0": (0, 4)})[0] == {"x0": (0, 4)}


@pytest.mark.parametrize("shapes, fragment", [
    ({"nope": (1, 4)}, "--shape names 'nope', which is not an input; inputs are: x0"),
    ({"x0": (1, 4, 4)}, r"--shape x0=1x4x4 has rank 3, but the model's input 'x0' has rank 2 \[n, 4\]"),
    ({"x0": (1, 5)}, r"dimension 1 is fixed to 4 in the model \[n, 4\], got 5"),
])
def test_shapes_that_do_not_fit(shapes, fragment: str) -> None:
    with pytest.raises(ShapeError, match=fragment):
        pin_shapes(_identity(["n", 4]), shapes, label="m.onnx")


def test_shape_hints_pin_dynamic_dims_where_they_fit() -> None:
    """Arrays from --inputs FILE.npz pin dynamic dims; one that does not fit is left to the input check."""
    pinned, _ = pin_shapes(_identity(["n", 4], ["n", 4]), shape_hints={"x0": (3, 4), "x1": (3, 5), "zz": (1,)})
    assert pinned == {"x0": (3, 4), "x1": (1, 4)}
    # --shape wins over a hint.
    assert pin_shapes(_identity(["n", 4]), {"x0": (2, 4)}, shape_hints={"x0": (3, 4)})[0] == {"x0": (2, 4)}


def test_inputs_without_shape_or_tensor_type() -> None:
    no_shape = _identity(["n"])
    no_shape.graph.input[0].type.tensor_type.ClearField("shape")
    with pytest.raises(ShapeError, match="input 'x0' has no shape in the model; pass --shape x0="):
        pin_shapes(no_shape)
    assert pin_shapes(no_shape, {"x0": (5,)})[0] == {"x0": (5,)}
    seq = _identity(["n"])
    seq.graph.input[0].type.CopyFrom(helper.make_sequence_type_proto(helper.make_tensor_type_proto(1, [2])))
    with pytest.raises(ModelError, match="input 'x0' is not a tensor"):
        pin_shapes(seq)


def test_memory_limits_name_the_size_before_anything_is_allocated() -> None:
    with pytest.raises(ShapeError, match=r"input 'x0' of shape 100000x100000x3x3 needs 335.3 GiB, over the 8.0 GiB"):
        pin_shapes(_identity(["a", "b", 3, 3]), {"x0": (100000, 100000, 3, 3)})
    weights = numpy_helper.from_array(np.zeros((256, 256), np.float32), "w")  # 256 KiB
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [_vi("x", ["n", 256])],
                   [_vi("y", ["n", 256])], [weights])
    with pytest.raises(ShapeError, match="inputs and weights need"):
        pin_shapes(model, {"x": (1, 256)}, memory_limit_bytes=200 * 1024)
    # The largest intermediate tensor counts too: 1x256 in, 4096x256 out through a broadcast.
    wide = lambda: _model([helper.make_node("Add", ["x", "col"], ["y"], name="widen")],  # noqa: E731
                          [_vi("x", [1, "n"]), _vi("col", ["m", 1])], [_vi("y", ["m", "n"])])
    with pytest.raises(ShapeError, match=r"tensor 'y' \(output of node 'widen'\) of shape 4096x4096 needs 64.0 MiB"):
        pin_shapes(wide(), {"x": (1, 4096), "col": (4096, 1)}, memory_limit_bytes=32 * 1024**2)
    assert pin_shapes(wide(), {"x": (1, 64), "col": (64, 1)}, memory_limit_bytes=32 * 1024**2)[0]["x"] == (1, 64)


# ----------------------------------------------------------------------------- external data

def _external_model(folder: Path, location: str, *, in_subgraph: bool = False, offset: str = "0") -> Path:
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    tensor = numpy_helper.from_array(w, "w")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", str(w.nbytes))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    if in_subgraph:
        branch = lambda name, inits: helper.make_graph(  # noqa: E731
            [helper.make_node("MatMul", ["x", "w"], [f"{name}_y"], name=f"{name}_mm")], name, [],
            [_vi(f"{name}_y", [1, 4])], inits)
        plain = numpy_helper.from_array(w, "w")
        node = helper.make_node("If", ["c"], ["y"], name="branch", then_branch=branch("t", [tensor]),
                                else_branch=branch("e", [plain]))
        model = _model([node], [_vi("c", [], TensorProto.BOOL), _vi("x", [1, 4])], [_vi("y", [1, 4])])
    else:
        model = _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [_vi("x", [1, 4])],
                       [_vi("y", [1, 4])], [tensor])
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def _weights(path: Path, nbytes: int = 64) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(np.arange(nbytes // 4, dtype=np.float32).tobytes())
    return path


def test_external_data_inside_the_folder_loads(tmp_path: Path) -> None:
    _weights(tmp_path / "data" / "w.bin")
    loaded = load(_external_model(tmp_path, "data/w.bin"), check_ops=False)
    (w,) = loaded.model.graph.initializer
    assert w.data_location == TensorProto.DEFAULT
    np.testing.assert_array_equal(numpy_helper.to_array(w), np.arange(16, dtype=np.float32).reshape(4, 4))


@pytest.mark.parametrize("case, fragment", [
    ("dotdot", "'..' leads outside the model folder"),
    ("absolute", "absolute paths are not allowed"),
    ("symlink", "symbolic links are not followed"),
    ("symlink_dir", "symbolic links are not followed"),
    ("missing", "file not found next to the model"),
    ("short", r"offset/length \(0, 64\) past the end of a 8-byte file"),
    ("bad_offset", "offset/length are not integers"),
    ("hardlink", "several hard links"),
    ("subgraph", "'..' leads outside the model folder"),
])
def test_external_data_that_leaves_the_folder_is_refused(tmp_path: Path, case: str, fragment: str) -> None:
    folder, outside = tmp_path / "model", tmp_path / "outside"
    folder.mkdir()
    secret = _weights(outside / "secret.bin")
    location, kwargs = "w.bin", {}
    if case == "dotdot":
        location = "../outside/secret.bin"
    elif case == "absolute":
        location = str(secret)
    elif case == "symlink":
        os.symlink(secret, folder / "w.bin")
    elif case == "symlink_dir":
        os.symlink(outside, folder / "sub")
        location = "sub/secret.bin"
    elif case == "short":
        (folder / "w.bin").write_bytes(b"\0" * 8)
    elif case == "bad_offset":
        _weights(folder / "w.bin")
        kwargs = {"offset": "zero"}
    elif case == "hardlink":
        os.link(secret, folder / "w.bin")
    elif case == "subgraph":
        location, kwargs = "../outside/secret.bin", {"in_subgraph": True}
    path = _external_model(folder, location, **kwargs)
    with pytest.raises(ModelError, match=fragment) as info:
        load(path, check_ops=False)
    assert str(info.value).startswith(f"{path}: initializer 'w' external data {location!r}")


def test_external_data_without_a_path_is_refused(tmp_path: Path) -> None:
    data = _external_model(tmp_path, "w.bin").read_bytes()
    with pytest.raises(ModelError, match="uses external data, which needs the model's file path"):
        load(data, name="m", check_ops=False)


# ----------------------------------------------------------------------------- files that are not ONNX

@pytest.mark.parametrize("data, fragment", [
    (b"\x89PNG\r\n\x1a\n" + bytes(40), "looks like a PNG image"),
    (b"\xff\xd8\xff\xe0" + bytes(40), "looks like a JPEG image"),
    (b"PK\x03\x04" + bytes(40), "looks like a zip archive"),
    (b"\x80\x04\x95" + bytes(40), "looks like a Python pickle"),
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 12\n", "Git LFS pointer"),
    (len(b'{"w": {}}').to_bytes(8, "little") + b'{"w": {}}', "safetensors"),
    (b"hello, this is text\n" * 5, "looks like a text file"),
    (bytes([0xF3, 0xFF, 0x13, 0x07]) * 50, "not an ONNX model (200 bytes; does not parse as an ONNX protobuf)"),
], ids=["png", "jpeg", "zip", "pickle", "git-lfs", "safetensors", "text", "garbage"])
def test_files_that_are_not_onnx_say_what_they_look_like(tmp_path: Path, data: bytes, fragment: str) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(data)
    with pytest.raises(ModelError, match=re.escape(fragment)) as info:
        load_model(path, check_ops=False)
    assert str(info.value).startswith(f"{path}: ")


def test_truncated_model_is_called_truncated(tmp_path: Path) -> None:
    weight = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    data = _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [_vi("x", [1, 64])],
                  [_vi("y", [1, 64])], [weight]).SerializeToString()
    path = tmp_path / "model.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match=r"truncated or corrupt ONNX file \(\d+ bytes\)"):
        load_model(path, check_ops=False)


def test_empty_missing_directory_and_oversized(tmp_path: Path) -> None:
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(ModelError, match="empty file"):
        load_model(tmp_path / "empty.onnx")
    with pytest.raises(ModelError, match="no such file"):
        load_model(tmp_path / "absent.onnx")
    with pytest.raises(ModelError, match="is a directory"):
        load_model(tmp_path)
    big = tmp_path / "big.onnx"
    with open(big, "wb") as f:  # sparse: no disk space used
        f.truncate(MAX_PROTOBUF_BYTES + 1)
    with pytest.raises(ModelError, match="larger than any ONNX protobuf can be"):
        load_model(big)


def test_versions_are_checked() -> None:
    model = _identity([1])
    model.ir_version = 99
    with pytest.raises(ModelError, match="IR version 99 is newer"):
        load_model(model, name="m", check_ops=False)
    model = _identity([1])
    model.opset_import[0].version = 99
    with pytest.raises(ModelError, match="opset 99 is newer"):
        load_model(model, name="m", check_ops=False)


# ----------------------------------------------------------------------------- graph checks

def test_duplicate_names_are_ours_not_the_checkers() -> None:
    w = numpy_helper.from_array(np.ones((1, 4), np.float32), "w")
    model = _model([helper.make_node("Relu", ["x"], ["w"], name="relu"), helper.make_node("Add", ["w", "x"], ["y"])],
                   [_vi("x", [1, 4])], [_vi("y", [1, 4])], [w])
    with pytest.raises(ModelError, match="duplicate tensor name 'w' \\(node 'relu' redefines an initializer\\)"):
        load_model(model, name="m", check_ops=False)


def test_checker_errors_keep_the_node_on_one_line() -> None:
    model = _model([helper.make_node("Relu", ["nothere"], ["y"], name="lonely")], [_vi("x", [1])], [_vi("y", [1])])
    with pytest.raises(ModelError) as info:
        load_model(model, name="m", check_ops=False)
    message = str(info.value)
    assert "\n" not in message and "fails onnx.checker" in message and "lonely" in message


def test_local_functions_are_inlined() -> None:
    fn = helper.make_function("local", "DoubleRelu", ["a"], ["b"],
                              [helper.make_node("Relu", ["a"], ["t"]), helper.make_node("Relu", ["t"], ["b"])],
                              [helper.make_opsetid("", 17)])
    graph = helper.make_graph([helper.make_node("DoubleRelu", ["x"], ["y"], domain="local", name="call")], "g",
                              [_vi("x", [1, 4])], [_vi("y", [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
                              functions=[fn])
    model.ir_version = 8
    loaded = load(model)
    assert [n.op_type for n in loaded.model.graph.node] == ["Relu", "Relu"]


def test_nan_and_inf_weights_warn() -> None:
    w = numpy_helper.from_array(np.array([[np.nan, np.inf, 1.0, 2.0]], np.float32), "w")
    model = _model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], [_vi("x", [1, 4])], [_vi("y", [1, 4])], [w])
    (warning,) = load(model, name="m").warnings
    assert "initializer 'w' has 1 NaN and 1 Inf values" in warning


# ----------------------------------------------------------------------------- operators and import

def _if_with(op_node: onnx.NodeProto) -> onnx.ModelProto:
    then = helper.make_graph([op_node], "then", [], [_vi(op_node.output[0], None)])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["z"], name="same")], "else", [], [_vi("z", None)])
    return _model([helper.make_node("If", ["c"], ["y"], name="outer", then_branch=then, else_branch=other)],
                  [_vi("c", [], TensorProto.BOOL), _vi("x", [2, 4])], [_vi("y", None)])


def test_unsupported_operators_are_named_with_their_node_and_place() -> None:
    model = _if_with(helper.make_node("Det", ["x"], ["s"], name="det"))
    with pytest.raises(UnsupportedOperatorError,
                       match=r"^m: unsupported operator Det \(node 'det' in then_branch of If 'outer'\): "
                             r"TVM's ONNX frontend has no converter for it$"):
        load_model(model, name="m")


def test_every_unsupported_operator_is_listed_once() -> None:
    nodes = [helper.make_node("FusedConv", ["x"], ["a"], name="fc", domain="com.microsoft"),
             helper.make_node("FusedConv", ["a"], ["b"], name="fc2", domain="com.microsoft"),
             helper.make_node("Frobnicate", ["b"], ["y"], name="frob", domain="com.example")]
    graph = helper.make_graph(nodes, "g", [_vi("x", [1, 4])], [_vi("y", [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in
                                                    (("", 17), ("com.microsoft", 1), ("com.example", 1))])
    with pytest.raises(UnsupportedOperatorError) as info:
        load_model(model, name="m")
    assert str(info.value) == (
        "m: unsupported operator com.microsoft::FusedConv (node 'fc'): TVM's ONNX frontend imports only the "
        "default ONNX domain (an ONNX Runtime contrib op: export the model without ORT graph optimisations); "
        "also unsupported: com.example::Frobnicate")


def test_frontend_failure_names_the_node() -> None:
    from fuseguard.compiler.frontend.importer import FrontendError, import_model

    model = _model([helper.make_node("TopK", ["x", "k"], ["v", "i"], name="topk", axis=1)],
                   [_vi("x", ["n", 8]), _vi("k", [1], TensorProto.INT64)],
                   [_vi("v", ["n", "k"]), _vi("i", ["n", "k"], TensorProto.INT64)])
    loaded = load(model, {"x": (4, 8)}, name="m")
    with pytest.raises(FrontendError, match=r"^m: TVM's ONNX frontend cannot convert node 'topk' \(TopK\): "
                                            r"ValueError: TopK k must be a constant"):
        import_model(loaded)


def test_shape_folding_retry_rescues_computed_reshape_targets() -> None:
    """Shape -> Mul -> Reshape: the frontend wants a constant shape; ORT folds it once shapes are pinned."""
    from fuseguard.compiler.frontend.importer import import_model
    from fuseguard.compiler.pipeline import CompileOptions, compile_model
    from fuseguard.verify.check.reference import run_onnxruntime

    one = numpy_helper.from_array(np.array([1, 1, 1], np.int64), "one")
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Mul", ["s", "one"], ["target"], name="scale_shape"),
             helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Reshape", ["r", "target"], ["y"], name="reshape")]
    model = _model(nodes, [_vi("x", ["n", 3, 4])], [_vi("y", ["n", 3, 4])], [one])
    loaded = load(model, {"x": (2, 3, 4)}, name="m")
    result = import_model(loaded)
    assert result.prepared
    compiled = compile_model(loaded, options=CompileOptions(schedule=False))
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    (out,) = compiled.run({"x": x})
    np.testing.assert_allclose(out, run_onnxruntime(loaded.model, {"x": x})["y"], rtol=1e-6)
