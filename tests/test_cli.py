"""The fuseguard CLI, run as a user runs it: a real subprocess, exit codes, one-line errors, JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = Path(__file__).resolve().parent / "plugins" / "wrong_relu.py"


def fuseguard(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_verify_suite_model_passes_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = fuseguard("verify", "conv_bn_relu", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "PASS" in proc.stdout
    data = json.loads(out.read_text())
    (model,) = data["models"]
    assert model["status"] == "PASS"
    assert model["fused"]["compare"]["outputs"]["y"]["passed"] is True
    assert model["fused"]["report"]["groups"][0]["pattern"] == "conv2d_bias_act"


def test_wrong_fusion_exits_1_and_names_the_fused_side() -> None:
    proc = fuseguard("verify", "conv_bn_relu", "--plugin", str(PLUGIN))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "mismatch: conv_bn_relu" in proc.stderr and "fused" in proc.stderr
    assert "unfused vs ONNX Runtime" not in proc.stderr      # the unfused build stays right
    assert "Traceback" not in proc.stderr


def test_a_plugin_written_against_the_old_import_names_still_works_and_is_warned(tmp_path: Path) -> None:
    """`from compiler.pipeline import register_pass` (the README's old spelling) reaches the one real
    registry through the alias, so the wrong fusion it registers is caught; a FutureWarning says what to
    write instead."""
    old = tmp_path / "old_names.py"
    old.write_text(PLUGIN.read_text().replace("from fuseguard.compiler.pipeline import", "from compiler.pipeline import"))
    assert "from compiler.pipeline import register_pass" in old.read_text()
    proc = subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "verify", "conv_bn_relu", "--plugin", str(old)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "mismatch: conv_bn_relu" in proc.stderr
    assert "`compiler` is fuseguard's old import name: import `fuseguard.compiler` instead" in proc.stderr


def test_old_names_alias_the_installed_modules_and_never_shadow_another_tree(tmp_path: Path) -> None:
    """In a checkout the old name is the same module object (one registry); a different tree's
    `compiler` folder first on sys.path (a base revision in the A/B gate) loads as itself."""
    other = tmp_path / "base" / "compiler"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("WHERE = 'base tree'\n")
    code = ("import sys, warnings; warnings.simplefilter('ignore'); import fuseguard.compiler as fc; "
            "import compiler; print(compiler is fc, getattr(compiler, 'WHERE', 'own'))")
    same = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert same.stdout.split() == ["True", "own"], same.stderr
    base = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(other.parent)!r}); " + code],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert base.stdout.split() == ["False", "base", "tree"], base.stderr
    module = tmp_path / "single"
    module.mkdir()
    (module / "compiler.py").write_text("WHERE = 'someone else'\n")      # another project's module
    other_module = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(module)!r}); " + code],
                                  cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert other_module.stdout.split() == ["False", "someone", "else"], other_module.stderr


def test_no_fusion_makes_the_wrong_fusion_disappear() -> None:
    proc = fuseguard("verify", "conv_bn_relu", "--plugin", str(PLUGIN), "--no-fusion")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("args, needle", [
    (["verify", "no_such_model"], "not a built-in suite model"),
    (["verify", "conv_bn_relu", "--disable-pattern", "nope"], "unknown pattern"),
    (["verify", "conv_bn_relu", "--gpu-arch", "ampere"], "sm_XX"),
    (["verify", "--bogus-flag"], "unrecognized arguments"),
    (["verify", "conv_bn_relu", "--plugin", "no_such_module_xyz"], "cannot import"),
    (["verify", "conv_bn_relu", "--profile", "--gpu-arch", "sm_80"], "leave out --gpu-arch"),
    (["bench", "conv_bn_relu", "--dynamic", "batch", "--dim", "batch=1,2", "--html", "x.html"], "leave out --html"),
])
def test_usage_errors_exit_2_with_one_line(args: list[str], needle: str) -> None:
    proc = fuseguard(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fuseguard: error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_gpu_arch_compiles_without_a_device() -> None:
    proc = fuseguard("verify", "mlp_gelu", "--gpu-arch", "sm_80")
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout


def test_patterns_lists_the_table() -> None:
    proc = fuseguard("patterns")
    assert proc.returncode == 0
    for name in ("conv2d_bias_act", "matmul_bias_gelu", "attention", "layernorm", "softmax"):
        assert name in proc.stdout


def test_env_lists_every_setting_with_the_value_this_process_sees() -> None:
    import os

    from fuseguard.compiler.settings import SETTINGS

    proc = subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "env"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "FUSEGUARD_CPU_SCHEDULE_OFF": "fast_math",
                                            "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    for name in SETTINGS:
        assert name in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if "FUSEGUARD_CPU_SCHEDULE_OFF" in line)
    assert "fast_math" in row and "yes" in row
    assert "usable core" in proc.stdout


def test_pytest_plugin_option_loads_a_wrong_fusion_and_the_suite_catches_it() -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "suites/test_verify_suite.py", "-q", "-p", "no:cacheprovider",
                           "-k", "test_default_shape and conv_bn_relu", "--fuseguard-plugin", str(PLUGIN)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout
    assert "conv_bn_relu" in proc.stdout and "fused vs ORT" in proc.stdout


CRASH = Path(__file__).resolve().parent / "plugins" / "native_crash.py"


def test_native_crash_fails_that_model_and_the_run_goes_on() -> None:
    proc = fuseguard("verify", "conv_bn_relu", "mlp_gelu", "--plugin", str(CRASH))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "crashed (SIGSEGV) while verifying conv_bn_relu" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert any("mlp_gelu" in line and "PASS" in line for line in proc.stdout.splitlines())


def test_hang_times_out_and_the_run_goes_on() -> None:
    import os

    env = {**os.environ, "FUSEGUARD_TEST_HANG": "1"}
    proc = subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "verify", "conv_bn_relu", "mlp_gelu", "--plugin",
                           str(CRASH), "--timeout", "20"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "timed out after 20 s while verifying conv_bn_relu" in proc.stderr
    assert any("mlp_gelu" in line and "PASS" in line for line in proc.stdout.splitlines())


def test_bench_json_has_the_documented_keys(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = fuseguard("bench", "conv_bn_relu", "--repeats", "3", "--halfwidth", "0", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    (entry,) = json.loads(out.read_text()).values()
    for key in ("tvm_fused_ms", "tvm_unfused_ms", "ort_ms", "ort_noopt_ms", "compile_s"):
        assert entry[key] > 0, key
    assert "fused / ORT" in proc.stdout


def test_bench_samples_fresh_processes_and_reports_intervals(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = fuseguard("bench", "conv_bn_relu", "--repeats", "3", "--processes", "2", "--halfwidth", "0", "--json",
                     str(out))
    assert proc.returncode == 0, proc.stderr
    (entry,) = json.loads(out.read_text()).values()
    assert entry["processes"] == 2
    assert all(len(v) == 2 for v in entry["per_process_ms"].values())
    lo, hi = entry["fused_vs_ort_ci"]
    assert lo <= entry["fused_vs_ort"] <= hi
    assert "95% CI" in proc.stdout
    # the time budget: a ~1 ms model takes far more than --repeats rounds a process (200 ms of each contender)
    assert entry["samples"] > 2 * 4 * 3 and ">= 200 ms a contender" in " ".join(proc.stdout.split())


def test_bench_adds_processes_while_an_interval_is_wider_than_asked(tmp_path: Path) -> None:
    """+-0.01% is out of any machine's reach: bench samples up to --max-processes, then says the intervals stayed
    wide and by how much; --halfwidth 0 keeps exactly --processes (the tests above)."""
    out = tmp_path / "bench.json"
    proc = fuseguard("bench", "conv_bn_relu", "--repeats", "3", "--processes", "2", "--halfwidth", "0.01",
                     "--max-processes", "4", "--sample-ms", "0", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    (entry,) = json.loads(out.read_text()).values()
    assert entry["processes"] == 4 and entry["halfwidth_target"] == 0.0001
    assert entry["samples"] <= 4 * 4 * 3          # --sample-ms 0: --repeats rounds (preempted ones retried, <= 4x)
    assert "a contender" not in proc.stdout
    assert "intervals wider than +-0.01% at the process budget (conv_bn_relu" in " ".join(proc.stderr.split())
    assert "2-4 fresh processes" in " ".join(proc.stdout.split())


def test_bench_process_budget_decision() -> None:
    from fuseguard.verify.perf.bench import BenchResult, halfwidth, needs_more

    assert halfwidth(1.0, (0.98, 1.03)) == pytest.approx(0.03) and halfwidth(1.0, None) == float("inf")
    r = BenchResult(model="m", threads=2, tvm_fused_ms=1.0, tvm_unfused_ms=1.2, ort_ms=1.0, ort_noopt_ms=1.5,
                    compile_s=1.0, unfused_compile_s=1.0, fused_iqr_ms=0.0, samples=9, kernels_fused=1,
                    kernels_unfused=2, processes=3, fused_vs_ort_ci=(0.99, 1.01), fusion_gain_ci=(1.1, 1.3),
                    fused_vs_ort_est=1.0, fusion_gain_est=1.2, halfwidth_target=0.02)
    assert r.halfwidth == pytest.approx(0.1 / 1.2) and not r.resolved
    assert needs_more(r, 0.02, 10) and not needs_more(r, 0.1, 10) and not needs_more(r, None, 10)
    assert not needs_more(r, 0.02, 3)                  # the budget spent
    r.processes = 1
    assert not needs_more(r, 0.02, 10)                 # one process: a bootstrap over rounds, never extended
    r.processes, r.set_aside = 3, 7
    assert not needs_more(r, 0.02, 10)                 # processes set aside count against the budget


def test_bench_sets_aside_a_process_the_host_slowed_by_its_reference_not_its_ratio() -> None:
    """bert_encoder, SPR class: two of 30 processes ran ORT 1.8x and TVM 2.3-2.6x their medians (fused/ORT 1.38x
    against ~1.0x elsewhere) and doubled the interval's width. The reference runtime decides which to leave out:
    a process whose ratio alone is off stays in."""
    from fuseguard.verify.perf.bench import aggregate, set_aside_note, slow_host_processes

    def run(fused: float, ort: float) -> dict[str, list[float]]:
        return {"tvm_fused": [fused] * 3, "tvm_unfused": [1.1 * fused] * 3, "ort": [ort] * 3,
                "ort_noopt": [2 * ort] * 3}

    normal = [run(3.0 + 0.05 * i, 3.1 + 0.03 * (i % 3)) for i in range(8)]
    host_slowed = [run(8.3, 6.0), run(7.1, 5.5)]
    ratio_off = [run(4.2, 3.1)]
    runs = normal[:3] + host_slowed + normal[3:] + ratio_off
    assert slow_host_processes(runs) == [3, 4] and slow_host_processes(runs[:2]) == []
    meta = {"model": "m", "fused": {"compile_s": 1.0, "kernels": 1}, "unfused": {"compile_s": 1.0, "kernels": 2}}
    result = aggregate(meta, runs, threads=2)
    assert (result.processes, result.set_aside) == (9, 2)
    kept = normal + ratio_off                       # the ratio-off process is in: the geometric mean is theirs
    expect = float(np.exp(np.mean([np.log(r["tvm_fused"][0] / r["ort"][0]) for r in kept])))
    assert result.fused_vs_ort == pytest.approx(expect)
    assert "m 2 of 11" in set_aside_note([result]) and set_aside_note([aggregate(meta, normal, 2)]) == ""


def test_bench_times_round_robin_over_the_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every build first, then one fresh timing process of each model per round (a host phase of seconds lands on
    one process of several models, where each interval sees it); only the models still wider than --halfwidth
    get more rounds. A stand-in worker records the calls. The timing processes run the pools parked, and
    ``brief`` when asked."""
    import fuseguard.verify.worker as worker_mod
    from fuseguard.verify import cli
    from fuseguard.verify.perf.timing import BRIEF_TVM_SPIN_COUNT

    calls: list[tuple[str, str]] = []
    pools: set[tuple[str | None, str | None]] = set()
    spread = {"conv_bn_relu": 0.5, "mlp_gelu": 0.0}      # mlp_gelu's processes agree: resolved after 2

    class FakeWorker:
        def __init__(self, *a, env=None, **k) -> None:
            self.spin = (env or {}).get("TVM_THREAD_POOL_SPIN_COUNT")

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None

        def call(self, fn: str, *, what: str, directory: str, **kwargs):
            model = what.split(" ")[1]
            calls.append((fn.rsplit(":", 1)[1], model))
            pools.add((self.spin, kwargs.get("thread_pools")))
            if fn.endswith("prepare_bench"):
                return {"model": model, "fused": {"compile_s": 0.1, "kernels": 1},
                        "unfused": {"compile_s": 0.1, "kernels": 2}}
            k = sum(1 for c in calls if c == ("time_prepared", model))
            f = 1.0 + spread[model.split("[")[0]] * (k % 2)
            return {"tvm_fused": [f] * 3, "tvm_unfused": [1.2] * 3, "ort": [1.0] * 3, "ort_noopt": [1.5] * 3}

    monkeypatch.setattr(worker_mod, "Worker", FakeWorker)
    assert cli.main(["bench", "conv_bn_relu", "mlp_gelu", "--processes", "2", "--max-processes", "4"]) == 0
    timing = [m.split("[")[0] for fn, m in calls if fn == "time_prepared"]
    assert [fn for fn, _ in calls[:2]] == ["prepare_bench", "prepare_bench"]
    assert timing == ["conv_bn_relu", "mlp_gelu", "conv_bn_relu", "mlp_gelu", "conv_bn_relu", "conv_bn_relu"]
    assert pools == {("0", None), ("0", "parked")}
    pools.clear()
    assert cli.main(["bench", "mlp_gelu", "--processes", "2", "--thread-pools", "brief"]) == 0
    assert pools == {(str(BRIEF_TVM_SPIN_COUNT), None), (str(BRIEF_TVM_SPIN_COUNT), "brief")}


def test_bench_can_time_the_thread_pools_as_deployed(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = fuseguard("bench", "conv_bn_relu", "--repeats", "3", "--processes", "1", "--thread-pools", "deployed",
                     "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    (entry,) = json.loads(out.read_text()).values()
    assert entry["thread_pools"] == "deployed" and entry["ort_ms"] > 0
    assert "thread pools deployed" in " ".join(proc.stdout.split())
    refused = fuseguard("bench", "conv_bn_relu", "--dynamic", "batch", "--dim", "batch=1,2",
                        "--thread-pools", "deployed")
    assert refused.returncode != 0 and "--thread-pools" in refused.stderr and "Traceback" not in refused.stderr


def test_ratio_interval_from_processes_and_from_one_process() -> None:
    from fuseguard.verify.perf.bench import ratio_interval

    est, (lo, hi) = ratio_interval([1.0, 1.1, 0.9, 1.05])
    assert lo < est < hi and 0.9 < est < 1.1
    est1, (lo1, hi1) = ratio_interval([2.0], ([2.0, 2.1, 1.9, 2.0], [1.0, 1.0, 1.0, 1.0]))
    assert lo1 <= est1 <= hi1 and est1 == 2.0


def test_a_zero_size_input_pinned_by_shape_verifies(tmp_path: Path) -> None:
    """`--shape x=0x4`: an empty batch through a reduction and an elementwise op, fused and unfused, against ORT
    (the ONNX node suite's empty-set reductions and CastLike's dtype-only input are such inputs)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("ReduceSum", ["r", "axes"], ["y"], keepdims=1),
         helper.make_node("Exp", ["r"], ["z"])], "empty",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [0])])
    path = tmp_path / "empty.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    proc = fuseguard("verify", str(path), "--shape", "x=0x4", "--json", str(tmp_path / "out.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
