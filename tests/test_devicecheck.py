"""The device check's CPU-side logic: a bundle made here runs through verify/device/check.py with tvm-ffi and
TVM's runtime library alone (no `import tvm`), on the CPU; on a GPU only the device type and the kernels'
compilation at load differ (compiler/cuda/jit.py, tested in test_sass.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fuseguard.verify.device.bundle import BundleItem, make_bundle


@pytest.fixture(scope="module")
def cpu_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bundle")
    make_bundle(out, target="cpu", items=(BundleItem("conv_bn_relu", True), BundleItem("attention", False, seq=64)),
                runtime=False)
    import tvm

    runtime = out / "runtime"
    runtime.mkdir()
    (runtime / "libtvm_runtime.so").symlink_to(Path(tvm.__file__).parent / "lib" / "libtvm_runtime.so")
    return out


def _run(bundle: Path, *args: str) -> subprocess.CompletedProcess:
    # `-c` with a guard: the runner must never import TVM's Python package
    code = ("import sys, runpy; sys.argv = ['devicecheck', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('fuseguard.verify.devicecheck', run_name='__main__')\n"
            "finally:\n    assert 'tvm' not in sys.modules, 'the device check imported tvm'\n")
    return subprocess.run([sys.executable, "-c", code, str(bundle), *args], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=600)


def test_bundle_runs_without_tvm(cpu_bundle: Path, tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    proc = _run(cpu_bundle, "--mode", "full", "--json", str(summary), "--repeats", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(summary.read_text())
    assert got["passed"] and got["device"] == "cpu"
    assert {r["model"] for r in got["results"]} == {"conv_bn_relu", "attention_seq64"}
    for row in got["results"]:
        assert row["fused"]["passed"] and row["unfused"]["passed"] and row["fused"]["ms"] > 0


def test_smoke_mode_runs_the_smoke_subset(cpu_bundle: Path, tmp_path: Path) -> None:
    summary = tmp_path / "smoke.json"
    assert _run(cpu_bundle, "--json", str(summary), "--repeats", "2").returncode == 0
    assert [r["model"] for r in json.loads(summary.read_text())["results"]] == ["conv_bn_relu"]


def test_a_wrong_expected_output_fails_that_model(cpu_bundle: Path, tmp_path: Path) -> None:
    import shutil

    import numpy as np

    broken = tmp_path / "broken"
    shutil.copytree(cpu_bundle, broken, symlinks=True)
    path = broken / "data" / "conv_bn_relu.npz"
    with np.load(path) as z:
        arrays = dict(z)
    arrays["expected_0"] = arrays["expected_0"] + 1.0
    np.savez(path, **arrays)
    proc = _run(broken, "--json", str(tmp_path / "s.json"), "--repeats", "2")
    assert proc.returncode == 1 and "conv_bn_relu: FAIL" in proc.stdout
