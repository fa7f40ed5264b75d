"""The latency gate under pytest, as a user runs it: record, compare, a real slowdown fails, nothing lost."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_pytest(*args: str) -> subprocess.CompletedProcess[str]:
    import os

    env = {k: v for k, v in os.environ.items() if k != "FUSEGUARD_BASELINE_REV"}   # stored baselines here
    return subprocess.run([sys.executable, "-m", "pytest", "suites/test_latency.py", "-k", "conv_bn_relu",
                           "-p", "no:cacheprovider", "-rs", "-q", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)


def only_file(directory: Path) -> Path:
    (path,) = [p for p in directory.glob("*.json") if p.name != "gate.json"]
    return path


def test_no_baseline_is_reported_not_passed_or_failed(tmp_path: Path) -> None:
    proc = run_pytest("--baseline-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout
    assert "1 skipped" in proc.stdout and "no baseline for conv_bn_relu" in proc.stdout
    # The blind gate is said once, with both ways out.
    assert proc.stdout.count("no latency baselines for this machine class") == 1, proc.stdout
    assert "--baseline-rev REV" in proc.stdout
    strict = run_pytest("--baseline-dir", str(tmp_path), "--strict-baselines")
    assert strict.returncode == 1 and "no baseline" in strict.stdout


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One recording (a pytest run of ~10 s) shared by the tests below, each on its own copy."""
    folder = tmp_path_factory.mktemp("recorded")
    record = run_pytest("--baseline-dir", str(folder), "--update-baselines")
    assert record.returncode == 0, record.stdout
    return only_file(folder)


def copy_of(recorded: Path, tmp_path: Path) -> Path:
    shutil.copy(recorded, tmp_path / recorded.name)
    return tmp_path / recorded.name


def test_record_then_a_real_slowdown_fails(recorded: Path, tmp_path: Path) -> None:
    path = copy_of(recorded, tmp_path)
    doc = json.loads(path.read_text())
    (key,) = doc["entries"]
    assert key.startswith("conv_bn_relu|x=1x64x56x56|fused")
    entry = doc["entries"][key]
    assert entry["n"] >= 5 and entry["metadata"]["reference_kind"] == "onnxruntime-cpu"
    # Recorded from several sets of fresh processes (an outlying set left out), and the file says how many.
    assert entry["metadata"]["processes"] in (6, 9) and entry["n"] >= 6 * 5

    same = run_pytest("--baseline-dir", str(tmp_path))
    assert same.returncode == 0, same.stdout

    # The key names the model; the metadata knows its bytes: another model under the same key is said.
    sha = entry["metadata"]["model_sha256"]
    assert len(sha) == 64
    entry["metadata"]["model_sha256"] = "0" * 64
    path.write_text(json.dumps(doc))
    changed = run_pytest("--baseline-dir", str(tmp_path))
    assert changed.returncode == 0 and "model changed since the baseline" in changed.stdout, changed.stdout
    entry["metadata"]["model_sha256"] = sha
    # ... and its build options: a baseline of another build (say --precision bf16) is not this one's.
    options = entry["metadata"]["options_sha256"]
    entry["metadata"]["options_sha256"] = "1" * 64
    path.write_text(json.dumps(doc))
    changed = run_pytest("--baseline-dir", str(tmp_path))
    assert changed.returncode == 0 and "build options changed since the baseline" in changed.stdout, changed.stdout
    entry["metadata"]["options_sha256"] = options

    # Make the baseline twice as fast as what this build really does: the gate must call it a regression.
    for field in ("samples_ms",):
        entry[field] = [v / 2 for v in entry[field]]
    entry["median_ms"] /= 2
    entry["iqr_ms"] /= 2
    entry["normalised"] = entry["median_ms"] / entry["reference_median_ms"]
    path.write_text(json.dumps(doc))
    for _ in range(3):  # a neighbour busy on this shared host makes the gate say "inconclusive": measure again
        slow = run_pytest("--baseline-dir", str(tmp_path), "-s")
        if "host busy" not in slow.stdout:
            break
    assert slow.returncode == 1, slow.stdout
    assert "latency regression: conv_bn_relu: slower" in slow.stdout


def test_corrupt_baseline_fails_loudly_and_is_not_overwritten(recorded: Path, tmp_path: Path) -> None:
    path = copy_of(recorded, tmp_path)
    path.write_text('{"schema_version": 1, "arch": "' + path.stem + '", "entries": {"broken": 3}}')
    before = path.read_bytes()
    proc = run_pytest("--baseline-dir", str(tmp_path), "--update-baselines")
    assert proc.returncode != 0
    assert path.name in proc.stdout and "broken" in proc.stdout
    assert path.read_bytes() == before


def test_busy_host_makes_a_slowdown_inconclusive_not_a_failure(recorded: Path, tmp_path: Path) -> None:
    """Two busy-looping neighbours: the gate must not blame the model for the machine's load."""
    path = copy_of(recorded, tmp_path)
    doc = json.loads(path.read_text())
    (entry,) = doc["entries"].values()
    entry["samples_ms"] = [v / 2 for v in entry["samples_ms"]]
    entry["median_ms"] /= 2
    entry["iqr_ms"] /= 2
    entry["normalised"] = entry["median_ms"] / entry["reference_median_ms"]
    path.write_text(json.dumps(doc))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        proc = run_pytest("--baseline-dir", str(tmp_path), "-s")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert proc.returncode == 0, proc.stdout
    assert "inconclusive" in proc.stdout and "host busy" in proc.stdout


def _run(candidate_ms: list[float], reference_ms: list[float]):
    from fuseguard.verify.perf.latency import LatencyRun
    from fuseguard.verify.perf.timing import Samples

    def samples(ms: list[float]) -> Samples:
        return Samples(tuple(v * 1e6 for v in ms), preempted=(0,) * len(ms))

    return LatencyRun(model="m", shapes={}, device="cpu", threads=2, reference_kind="onnxruntime-cpu",
                      candidate=samples(candidate_ms), reference=samples(reference_ms), foreign_load=0.01)


def test_pooled_processes_cancel_a_speed_mode_that_hits_the_whole_process() -> None:
    """A process running 1.5x slow (ORT with it, as measured modes do) must not widen or shift the pooled
    candidate/reference ratio, and the pooled run says how many processes it holds."""
    import numpy as np

    from fuseguard.verify.perf.latency import pool_runs

    rng = np.random.default_rng(0)
    runs = []
    for mode in (1.0, 1.5, 1.0):
        cand = list(mode * 2.0 * (1 + 0.01 * rng.standard_normal(15)))
        ref = list(mode * 4.0 * (1 + 0.01 * rng.standard_normal(15)))
        runs.append(_run(cand, ref))
    pooled = pool_runs(runs)
    assert pooled.processes == 3 and pooled.candidate.n == 45 and pooled.reference.n == 45
    ratio = pooled.candidate.ms / pooled.reference.median_ms
    assert abs(float(np.median(ratio)) - 0.5) < 0.01
    assert float(ratio.max() / ratio.min()) < 1.1        # pooled raw, the slow process would read 1.5x
    raw = np.concatenate([r.candidate.ms for r in runs])
    assert float(raw.max() / raw.min()) > 1.4
    # More samples scaled to the first set's reference median keep the same normalisation.
    extra = pool_runs([_run([3.0] * 5, [6.0] * 5)], reference_ms=pooled.reference.median_ms)
    assert abs(float(np.median(extra.candidate.ms)) / pooled.reference.median_ms - 0.5) < 1e-9


def test_a_process_preempted_samples_are_set_aside_before_pooling() -> None:
    from fuseguard.verify.perf.latency import pool_runs
    from fuseguard.verify.perf.timing import Samples

    run = _run([1.0] * 6, [2.0] * 6)
    preempted = Samples(tuple([1e6] * 6 + [9e6] * 2), preempted=(0,) * 6 + (3, 3))
    from dataclasses import replace

    pooled = pool_runs([replace(run, candidate=preempted)])
    assert pooled.candidate.n == 6 and max(pooled.candidate.ms) < 1.01


def test_a_recording_leaves_out_a_set_taken_in_a_slow_phase() -> None:
    """Two of five recordings once read 0.97-1.02x ORT where everything around them read 0.77x: a set of
    processes far from the other sets' median is left out, and said; sets that agree are all kept."""
    from dataclasses import replace

    from fuseguard.verify.perf.latency import pool_runs, record_sets

    def one_set(norm: float) -> object:
        return replace(pool_runs([_run([norm * 4.0] * 10, [4.0] * 10) for _ in range(3)]))

    run, note = record_sets([one_set(0.78), one_set(0.97), one_set(0.77)])
    assert run.processes == 6 and "0.970x" in note and "left out" in note
    assert abs(run.candidate.median_ms / run.reference.median_ms - 0.775) < 0.01
    run, note = record_sets([one_set(0.78), one_set(0.80), one_set(0.77)])
    assert run.processes == 9 and note == ""


def test_cli_records_from_fresh_processes_and_checks(tmp_path: Path) -> None:
    """`fuseguard baseline update` then `check`, as a user runs them: the recording says how many fresh
    processes it pooled, the file records it, and the unchanged build passes its own baseline."""
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "baseline", *args, "conv_bn_relu",
                               "--baseline-dir", str(tmp_path), "--processes", "2"], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)

    # The check gates with a loose factor from the baseline directory's gate.json (the documented per-model
    # override): this test is about the CLI's plumbing, not the gate's power. At the default 1.10 one CI run
    # (2-core runner, class not recorded) read the unchanged build 1.15x of the baseline recorded 20 s
    # earlier, confirmed in 2 more processes: a host phase no same-run reference cancels. The stored gate's
    # false-alarm rate is measured in benchmarks/baseline_power.py, not asserted from one trial here.
    (tmp_path / "gate.json").write_text(json.dumps({"conv_bn_relu": {"factor": 1.6}}))
    update = cli("update")
    assert update.returncode == 0, update.stderr
    assert "recorded conv_bn_relu|" in update.stdout and "fresh process(es)" in update.stdout
    entry = next(iter(json.loads(only_file(tmp_path).read_text())["entries"].values()))
    assert entry["metadata"]["processes"] in (4, 6) and len(entry["metadata"]["options_sha256"]) == 64
    check = cli("check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "conv_bn_relu: " in check.stdout and "2 fresh process(es)" in check.stdout, check.stdout
