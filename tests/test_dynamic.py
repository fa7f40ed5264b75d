"""Symbolic dims: parsing, naming, one build at many sizes, bounds, and the verifier's search and shrink."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from fuseguard.compiler.dynamic import DynamicDim, parse_dynamic, relabel
from fuseguard.compiler.errors import ShapeError, UsageError
from fuseguard.compiler.pipeline import CompileOptions, compile_model
from fuseguard.suites.models import get_model
from fuseguard.verify.check.model import SuiteSpec
from fuseguard.verify.check.dynamic import edge_sizes, verify_dynamic

ROOT = Path(__file__).resolve().parent.parent


def test_parse_dynamic_names_bounds_and_errors() -> None:
    assert parse_dynamic("seq<=512, batch") == (DynamicDim("seq", 512), DynamicDim("batch"))
    assert parse_dynamic(["seq", "seq"]) == (DynamicDim("seq"),)
    for bad, needle in (("seq<=0", "bound"), ("seq<=x", "bound"), ("1seq", "NAME"),
                        ("seq<=4,seq<=8", "twice")):
        with pytest.raises(UsageError, match=needle):
            parse_dynamic(bad)


def test_edge_sizes_are_the_tile_edges() -> None:
    assert edge_sizes(1, 20) == [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 20]
    assert edge_sizes(16, 40) == [16, 17, 31, 32, 33, 40]


def test_suite_dynamic_axes_find_inputs_and_outputs() -> None:
    axes = get_model("bert_encoder").dynamic_axes(["seq"])
    assert axes == {"hidden_states": {1: "seq"}, "attention_mask": {1: "seq"}, "output": {1: "seq"}}


def _softmax_ln(dims: str = "seq") -> tuple:
    entry = get_model("softmax_layernorm")
    model = relabel(entry.make(), entry.dynamic_axes([d.name for d in parse_dynamic(dims)]))
    return entry, model


def test_one_symbolic_build_matches_static_builds_and_refuses_beyond_its_bound() -> None:
    entry, model = _softmax_ln()
    dyn = compile_model(model, options=CompileOptions(dynamic=parse_dynamic("seq<=40")), name="sln")
    assert dyn.report.dynamic == ["seq<=40"] and dyn.dynamic_axes == {"seq": [("x", 1)]}
    assert any("symbolic dims estimated at seq=40 (its bound)" in d.reason for d in dyn.report.decisions)
    for seq in (1, 17, 40):
        x = entry.random_inputs({"seq": seq}, seed=seq)
        static = compile_model(entry.make({"seq": seq}), name="sln")
        np.testing.assert_allclose(dyn.run(x)[0], static.run(x)[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ShapeError, match=r"seq=41 at axis 1, beyond the build's bound --dynamic seq<=40"):
        dyn.run(entry.random_inputs({"seq": 41}))


def test_a_name_the_model_lacks_is_one_line_naming_its_dims() -> None:
    _, model = _softmax_ln()
    with pytest.raises(UsageError, match=r"no input dimension is named 'batch'.*seq \(x\[1\]\)"):
        compile_model(model, options=CompileOptions(dynamic=parse_dynamic("batch")), name="sln")


def test_a_size_that_fails_is_found_and_shrunk_to_the_smallest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused build that goes wrong from seq 23 on (a remainder path, say) fails at exactly 23."""
    import fuseguard.verify.check.dynamic as vd

    real = vd.build_and_run

    def broken_from_23(loaded, options, config, *args, **kwargs):
        result, compiled = real(loaded, options, config, *args, **kwargs)
        if options.fusion and compiled is not None:
            run = compiled.run

            def wrong(inputs):
                outs = run(inputs)
                return [o + 1e-2 if inputs["x"].shape[1] >= 23 else o for o in outs]

            compiled.run = wrong
        return result, compiled

    monkeypatch.setattr(vd, "build_and_run", broken_from_23)
    verdict = verify_dynamic(SuiteSpec("softmax_layernorm"), options=CompileOptions(dynamic=parse_dynamic("seq")),
                             draws=40, seed=3)
    assert not verdict and verdict.status == "FAIL"
    assert verdict.failing is not None and verdict.failing.sizes == {"seq": 23}
    assert verdict.failing.unfused and not verdict.failing.fused        # the fused side is named
    assert verdict.builds <= 2 and verdict.sizes_checked > 1


def test_cli_verify_dynamic_json_counts_builds_and_sizes(tmp_path: Path) -> None:
    out = tmp_path / "dyn.json"
    proc = subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "verify", "softmax_layernorm", "--dynamic", "seq<=64",
                           "--draws", "12", "--no-cache", "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    (model,) = json.loads(out.read_text())["models"]
    assert model["status"] == "PASS" and model["builds"] == 2 and model["dynamic"] == "seq<=64"
    assert 6 <= model["sizes_checked"] <= 12 and all(1 <= c["sizes"]["seq"] <= 64 for c in model["checks"])
    assert "checked against 2 build(s)" in proc.stderr


@pytest.mark.parametrize("value", ["seq<=0", "se q"])
def test_cli_refuses_a_bad_dynamic_at_parse_time(value: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "verify", "softmax_layernorm", "--dynamic", value],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("fuseguard: error: argument --dynamic: ")


def test_a_symbolic_cuda_build_compiles_to_sass_without_spills() -> None:
    """CUDA builds with a symbolic sequence: dlight schedules symbolic extents; ptxas accepts every kernel."""
    from fuseguard.compiler.cuda import sass

    if sass.find_toolkit() is None:
        pytest.skip("no CUDA toolkit (nvcc): pip install -e '.[cuda-tools]'")
    _, model = _softmax_ln()
    for arch in ("sm_80", "sm_90"):
        built = compile_model(model, options=CompileOptions(gpu_arch=arch, dynamic=parse_dynamic("seq<=256"),
                                                            sass="require"), name="sln")
        kernels = built.report.sass["kernels"]
        assert kernels and all(k["spill_stores"] == 0 and not k["problems"] for k in kernels), kernels


def test_static_dims_read_off_a_shape_become_constants() -> None:
    """`Gather(Shape(x), 2)` of a static dim folds even though dim 1 is symbolic (LLaMA's rotate_half)."""
    import onnx
    from onnx import TensorProto, helper
    from fuseguard.compiler.frontend.importer import read_static_dims

    g = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["s"]),
         helper.make_node("Gather", ["s", "i2"], ["d2"], axis=0),
         helper.make_node("Gather", ["s", "i1"], ["d1"], axis=0)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", 32])],
        [helper.make_tensor_value_info("d2", TensorProto.INT64, []),
         helper.make_tensor_value_info("d1", TensorProto.INT64, [])],
        initializer=[helper.make_tensor("i2", TensorProto.INT64, [], [2]),
                     helper.make_tensor("i1", TensorProto.INT64, [], [1])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    out = read_static_dims(model)
    ops = {n.output[0]: n.op_type for n in out.graph.node}
    assert ops["d2"] == "Constant" and ops["d1"] == "Gather"      # the symbolic dim stays a run-time read
    assert onnx.numpy_helper.to_array(next(n for n in out.graph.node if n.output[0] == "d2").attribute[0].t) == 32
    assert [n.op_type for n in model.graph.node] == ["Shape", "Gather", "Gather"]    # the input is untouched


def test_a_permuted_shape_stays_symbolic_where_only_shape_ops_read_it() -> None:
    """`Gather(Shape(x), [0, 2, 1, 3])` (ORT's transpose optimiser writes a transposed tensor's shape so)
    feeds a Reshape: it imports as a ShapeExpr, so one symbolic build runs every sequence length; the same
    index read by a Mul stays a tensor (TVM's frontend refuses a ShapeExpr there)."""
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1, 3]),
         helper.make_node("Shape", ["x"], ["s"]),
         helper.make_node("Gather", ["s", "perm"], ["ts"], axis=0),
         helper.make_node("Gather", ["ts", "zero"], ["b"], axis=0),
         helper.make_node("Gather", ["ts", "one"], ["n"], axis=0),
         helper.make_node("Unsqueeze", ["b", "axis0"], ["b1"]),
         helper.make_node("Unsqueeze", ["n", "axis0"], ["n1"]),
         helper.make_node("Concat", ["b1", "n1", "minus1"], ["shape"], axis=0),
         helper.make_node("Reshape", ["t", "shape"], ["y"]),
         helper.make_node("Gather", ["s", "sel"], ["seqv"], axis=0),
         helper.make_node("Cast", ["seqv"], ["seqf"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["seqf", "two"], ["z"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", 4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, "m"]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [1])],
        initializer=[helper.make_tensor("perm", TensorProto.INT64, [4], [0, 2, 1, 3]),
                     helper.make_tensor("sel", TensorProto.INT64, [1], [1]),
                     helper.make_tensor("zero", TensorProto.INT64, [], [0]),
                     helper.make_tensor("one", TensorProto.INT64, [], [1]),
                     helper.make_tensor("axis0", TensorProto.INT64, [1], [0]),
                     helper.make_tensor("minus1", TensorProto.INT64, [1], [-1]),
                     helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    dyn = parse_dynamic("seq")
    compiled = compile_model(model, options=CompileOptions(dynamic=dyn), name="permuted")
    for seq in (1, 7, 33):
        x = np.random.default_rng(seq).standard_normal((1, seq, 4, 8)).astype("float32")
        y, z = compiled.run({"x": x})
        np.testing.assert_array_equal(y, x.transpose(0, 2, 1, 3).reshape(1, 4, -1))
        np.testing.assert_array_equal(z, np.array([2.0 * seq], dtype="float32"))


def test_an_error_hint_does_not_blame_a_guess_of_a_symbolic_dim() -> None:
    """"the dynamic input dims were guessed ... pass --shape" is advice for a pinned build; a dim kept
    symbolic by --dynamic is not pinned at all, so the hint must not name it."""
    from onnx import TensorProto, helper

    from fuseguard.compiler.frontend.loader import load

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    assert "were guessed (x=1x16x8)" in load(model).shape_hint()
    assert load(model, dynamic=parse_dynamic("batch,seq")).shape_hint() == ""
    assert "were guessed" in load(model, dynamic=parse_dynamic("seq")).shape_hint()    # batch is still a guess


def test_a_conv_with_a_symbolic_image_size_builds_and_verifies() -> None:
    """`--dynamic size` on a convnet: the dense conv rule vectorised its row epilogue over the symbolic width,
    which LLVM refuses on a fixed-width ISA (the build failed); such loops now run serial."""
    verdict = verify_dynamic(SuiteSpec("conv_bn_relu"), options=CompileOptions(dynamic=parse_dynamic("size")),
                             draws=6)
    assert verdict.fused.error is None and verdict.unfused.error is None, verdict.fused.error or verdict.unfused.error
    assert verdict.failing is None and verdict.sizes_checked >= 3


def test_extents_equal_only_for_a_positive_dim_are_settled_at_import() -> None:
    """MobileBERT's trigram embedding: concat(pad(x[:, 1:]), x, pad(x[:, :-1])) along the features. The three
    extents along seq (min(2^63 - 1, seq) + 1 - min(1, seq), seq, min(max(seq - 1, 0), seq) + 1) are equal for
    every seq >= 1 but not provably so for any int: Concat's result had no shape and the Shape -> Gather
    behind it did not import. Simplified under the dims' bounds (>= 1, <= their --dynamic bound), they are."""
    from onnx import TensorProto, helper

    big = 2**63 - 1
    g = helper.make_graph(
        [helper.make_node("Slice", ["x", "one", "big", "axis1"], ["a"]),
         helper.make_node("Pad", ["a", "pad_end"], ["ap"]),
         helper.make_node("Slice", ["x", "zero", "minus1", "axis1"], ["b"]),
         helper.make_node("Pad", ["b", "pad_start"], ["bp"]),
         helper.make_node("Concat", ["ap", "x", "bp"], ["c"], axis=2),
         helper.make_node("Shape", ["c"], ["s"]),
         helper.make_node("Gather", ["s", "one_scalar"], ["n"], axis=0),
         helper.make_node("Unsqueeze", ["n", "axis0"], ["n1"]),
         helper.make_node("Concat", ["n1", "three_four"], ["shape"], axis=0),
         helper.make_node("Reshape", ["c", "shape"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["seq", 3, 4])],
        initializer=[helper.make_tensor("one", TensorProto.INT64, [1], [1]),
                     helper.make_tensor("big", TensorProto.INT64, [1], [big]),
                     helper.make_tensor("axis1", TensorProto.INT64, [1], [1]),
                     helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
                     helper.make_tensor("minus1", TensorProto.INT64, [1], [-1]),
                     helper.make_tensor("pad_end", TensorProto.INT64, [6], [0, 0, 0, 0, 1, 0]),
                     helper.make_tensor("pad_start", TensorProto.INT64, [6], [0, 1, 0, 0, 0, 0]),
                     helper.make_tensor("one_scalar", TensorProto.INT64, [], [1]),
                     helper.make_tensor("axis0", TensorProto.INT64, [1], [0]),
                     helper.make_tensor("three_four", TensorProto.INT64, [2], [3, 4])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    for spec in ("seq<=64", "seq"):
        compiled = compile_model(model, options=CompileOptions(dynamic=parse_dynamic(spec)), name="trigram")
        for seq in (1, 5, 16):
            x = np.random.default_rng(seq).standard_normal((1, seq, 4)).astype("float32")
            zeros = np.zeros((1, 1, 4), "float32")
            want = np.concatenate([np.concatenate([x[:, 1:], zeros], 1), x,
                                   np.concatenate([zeros, x[:, :-1]], 1)], 2).reshape(seq, 3, 4)
            (y,) = compiled.run({"x": x})
            np.testing.assert_array_equal(y, want)


def test_slice_bounds_computed_from_a_static_dim_stay_static_under_a_symbolic_batch() -> None:
    """ShuffleNetV2's `chunk(2, dim=1)`: Slice(x, 0, (Gather(Shape(x), [1]) + 1) / 2, axis 1). With the batch
    symbolic, TVM's frontend gathered the channel count at run time, the Slice had tensor bounds and no
    shape, and the model did not import (nor after ORT's folding, which cannot read that dim where a
    computed Reshape made it: ShuffleNet); the gathered static dim is a constant, imported directly here."""
    from onnx import TensorProto, helper

    def const(name: str, values: list[int]) -> onnx.TensorProto:
        return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)

    g = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["s"]),
         helper.make_node("Gather", ["s", "one"], ["c"], axis=0),
         helper.make_node("Add", ["c", "one"], ["c1"]),
         helper.make_node("Div", ["c1", "two"], ["half"]),
         helper.make_node("Slice", ["x", "zero", "half", "one"], ["y"]),
         helper.make_node("Relu", ["y"], ["z"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6, 3])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 3, 3])],
        initializer=[const("one", [1]), const("two", [2]), const("zero", [0])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    compiled = compile_model(model, options=CompileOptions(dynamic=parse_dynamic("batch<=4")), name="chunk")
    assert compiled.report.imported_via == "onnx"       # not through ONNX Runtime's shape folding
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 6, 3)).astype("float32")
        (z,) = compiled.run({"x": x})
        np.testing.assert_array_equal(z, np.maximum(x[:, :3], 0))


def test_tile_repeats_read_off_a_symbolic_dim() -> None:
    """DeBERTa-v2 tiles its relative-position projections by a count computed from the batch: the repeats come
    out of Concat as a shape, which TVM's frontend refuses for Tile (and its Tile takes static repeats only),
    so the model did not import with a symbolic batch, nor after ORT's folding. The shape becomes a tensor
    where a reader cannot take it, and Tile by symbolic dims is broadcast + reshape."""
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["s"]),
         helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
         helper.make_node("Unsqueeze", ["b", "axis0"], ["b1"]),
         helper.make_node("Concat", ["b1", "ones"], ["reps"], axis=0),
         helper.make_node("Tile", ["w", "reps"], ["t"]),
         helper.make_node("Add", ["t", "x"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 3])],
        initializer=[helper.make_tensor("zero", TensorProto.INT64, [], [0]),
                     helper.make_tensor("axis0", TensorProto.INT64, [1], [0]),
                     helper.make_tensor("ones", TensorProto.INT64, [2], [1, 1]),
                     helper.make_tensor("w", TensorProto.FLOAT, [1, 2, 3], [float(i) for i in range(6)])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    compiled = compile_model(model, options=CompileOptions(dynamic=parse_dynamic("batch<=4")), name="tile")
    w = np.arange(6, dtype="float32").reshape(1, 2, 3)
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 2, 3)).astype("float32")
        (y,) = compiled.run({"x": x})
        np.testing.assert_array_equal(y, np.tile(w, (batch, 1, 1)) + x)
