"""The harness never lets one model's failure end the run, and never shows a traceback without --debug.

One multi-model `fuseguard verify` run feeds it every failure kind (tests/plugins/faults.py injects
them by model name); every model gets its row, the run finishes, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from fuseguard.verify.check.compare import DEFAULT_TOLERANCES, compare_outputs
from fuseguard.verify.check.results import BuildResult
from fuseguard.verify.options import (PYTEST_PREFIX, add_build_options, add_compare_options, add_model_options, dest,
                            option_names, tolerances)

ROOT = Path(__file__).resolve().parent.parent
FAULTS = Path(__file__).resolve().parent / "plugins" / "faults.py"
KINDS = ("build", "shape", "dtype", "missing", "nan", "crash")


def _two_output_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Sigmoid", ["x"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 8])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_every_failure_kind_in_one_run_gets_its_row(tmp_path: Path) -> None:
    paths = []
    for name in [f"fault_{k}" for k in KINDS] + ["healthy"]:
        path = tmp_path / f"{name}.onnx"
        onnx.save(_two_output_model(), path)
        paths.append(str(path))
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "verify", *paths, "--plugin", str(FAULTS),
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    models = {Path(m["model"]).stem: m for m in json.loads(out.read_text())["models"]}
    assert set(models) == {f"fault_{k}" for k in KINDS} | {"healthy"}
    assert models["healthy"]["status"] == "PASS"
    assert models["fault_build"]["status"] == "ERROR" and "injected fault" in models["fault_build"]["fused"]["error"]
    for kind in ("shape", "dtype", "missing", "nan"):
        assert models[f"fault_{kind}"]["status"] == "FAIL", kind
    assert models["fault_crash"]["status"] == "ERROR" and "injected fault" in models["fault_crash"]["error"]
    # a failed build's row shows no group count or compile time that reads like a result
    build_row = next(line for line in proc.stdout.splitlines() if "fault_build" in line)
    assert "0 (0 pattern)" not in build_row and "0.0 /" not in build_row, build_row


def test_max_abs_error_skips_outputs_without_one() -> None:
    ref = {"a": np.ones((2, 2), np.float32), "b": np.ones((3,), np.float32)}
    got = {"a": np.ones((2, 2), np.float32) + 1e-3, "b": np.ones((), np.float32)}    # b: shape mismatch
    result = BuildResult(config="fused", compare=compare_outputs(got, ref))
    assert result.max_abs_error == pytest.approx(1e-3, rel=1e-3)
    only_bad = BuildResult(config="fused", compare=compare_outputs({"b": got["b"]}, {"b": ref["b"]}))
    assert only_bad.max_abs_error is None
    assert only_bad.to_dict()["max_abs_error"] is None


def test_atol_alone_keeps_each_dtypes_rtol() -> None:
    table = tolerances(1e-3, None)
    assert table is not None
    assert table["float16"].rtol == DEFAULT_TOLERANCES["float16"].rtol == 1e-2
    assert table["float32"].atol == table["float16"].atol == 1e-3
    assert table["float32"].rtol == DEFAULT_TOLERANCES["float32"].rtol
    assert tolerances(None, 1e-1)["bfloat16"].atol == DEFAULT_TOLERANCES["bfloat16"].atol
    assert tolerances(None, None) is None
    assert "int64" not in table    # integers stay exact


def _parse(add, argv: list[str], prefix: str = "") -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add(p.add_argument, prefix)
    return p.parse_args(argv)


def test_cli_and_pytest_share_every_build_option() -> None:
    cli = option_names(add_build_options)
    under_pytest = option_names(lambda add, prefix: add_build_options(add, prefix, debug=False), PYTEST_PREFIX)
    # every CLI build option exists under pytest with the fuseguard- prefix (debug is pytest's own)
    assert {f"--{PYTEST_PREFIX}{n[2:]}" for n in cli if n != "--debug"} <= under_pytest
    # the README's pytest spellings
    assert {"--gpu-arch", "--no-fusion", "--disable-pattern", "--no-schedule", "--fuseguard-plugin",
            "--fuseguard-timeout", "--mcpu"} <= under_pytest
    assert "--timeout" not in under_pytest and "--plugin" not in under_pytest


def test_pytest_help_lists_the_shared_options() -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    cli = subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "verify", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    for name in sorted(option_names(add_build_options) - {"--debug"}):
        assert f"--{PYTEST_PREFIX}{name[2:]}" in proc.stdout, name
        assert name in cli.stdout, name
    for name in option_names(add_model_options) | option_names(add_compare_options):
        assert name in cli.stdout, name


def test_values_are_checked_at_parse_time(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(add_build_options, ["--timeout", "-1"])
    with pytest.raises(SystemExit):
        _parse(add_compare_options, ["--atol", "nan"])
    args = _parse(add_build_options, ["--gpu-arch", "sm_90", "--disable-pattern", "softmax"], PYTEST_PREFIX)
    assert getattr(args, dest("gpu-arch", PYTEST_PREFIX)) == "sm_90"


def test_explicit_seed_zero_overrides_a_suite_seed() -> None:
    from fuseguard.verify.check.model import SuiteSpec, verify_model

    spec = SuiteSpec("softmax_layernorm", (("batch", 1), ("seq", 4)), seed=7)
    assert verify_model(spec).seed == 7
    assert verify_model(spec, seed=0).seed == 0


def test_shape_valued_outputs_run(tmp_path: Path) -> None:
    from fuseguard.compiler.pipeline import compile_model

    graph = helper.make_graph([helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Relu", ["x"], ["y"])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("s", TensorProto.INT64, [2]),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    compiled = compile_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    shape, y = compiled.run({"x": np.ones((2, 3), np.float32)})
    assert shape.dtype == np.int64 and shape.tolist() == [2, 3]
    assert y.shape == (2, 3)


def test_bisect_task_error_is_untestable(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from fuseguard.verify.debug import bisect
    from fuseguard.verify import cli
    from fuseguard.verify.worker import Worker, WorkerTaskError

    def boom(self, *args, **kwargs):
        raise WorkerTaskError("RuntimeError", "boom", "Traceback ...", "bisecting conv_bn_relu")

    monkeypatch.setattr(Worker, "call", boom)
    assert cli.main(["bisect", "conv_bn_relu"]) == bisect.EXIT_UNTESTABLE == 125
    err = capsys.readouterr().err
    assert "cannot test" in err and "boom" in err and "Traceback" not in err


def test_debug_shows_the_worker_traceback_of_a_failed_build(tmp_path: Path) -> None:
    path = tmp_path / "fault_build.onnx"
    onnx.save(_two_output_model(), path)
    base = [sys.executable, "-m", "fuseguard.verify.cli", "verify", str(path), "--plugin", str(FAULTS)]
    quiet = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=600)
    loud = subprocess.run(base + ["--debug"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert quiet.returncode == loud.returncode == 1
    assert "Traceback" not in quiet.stderr
    assert "Traceback" in loud.stderr and "injected fault" in loud.stderr
