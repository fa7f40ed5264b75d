"""A shipped build re-verified without compiling; a tampered library or model is caught."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuseguard.verify.cli import main


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("art")
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
                          "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 8])], [w])
    path = tmp / "tiny.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert main(["compile", str(path), "--out", str(tmp / "out")]) == 0
    (d,) = [p for p in (tmp / "out").iterdir() if p.is_dir()]
    return d


def test_manifest_traces_the_build(artifact: Path) -> None:
    m = json.loads((artifact / "manifest.json").read_text())
    assert m["verification"]["passed"] and m["model_sha256"] and m["library_sha256"]
    assert {"tvm", "tvm_ffi", "fuseguard", "compiler_sources"} <= set(m["versions"])
    assert m["target"]["class_id"] == artifact.name and m["fusion"]["groups"]


def test_reverified_without_compiling(artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--artifact", str(artifact.parent)]) == 0
    assert "PASS" in capsys.readouterr().out


def test_tampered_library_is_refused(artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    copy = tmp_path / artifact.name
    shutil.copytree(artifact, copy)
    lib = copy / "model.so"
    lib.write_bytes(lib.read_bytes() + b"\0")
    assert main(["verify", "--artifact", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "does not match its manifest" in err and "Traceback" not in err
