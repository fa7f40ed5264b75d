"""verify.perf.baselines: schema errors name file, entry and field; concurrent recorders lose nothing; interop."""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fuseguard.compiler.errors import BaselineError, UsageError
from fuseguard.verify.perf.baselines import (MAX_SAMPLES, SCHEMA_VERSION, Entry, Metadata, cpu_class_id,
                                             from_pytest_benchmark, fusion_label, host_cpu_class, load_baselines,
                                             make_key, model_of, record, to_pytest_benchmark, validate_document)
from fuseguard.verify.perf.timing import Samples

KEY = "resnet50|data=1x3x224x224|fused"
META = Metadata(device="NVIDIA A100-SXM4-80GB", driver="550.54.15", cuda="12.4", tvm_version="0.27.0.post1",
                fuseguard_version="0.1.0", git_commit="58410283ad7bdf758f2a39f91cd60a6c37ab4ab1",
                date="2026-11-29T19:18:25+00:00", threads=1, reference_kind="onnxruntime")


def entry(median: float = 2.0, n: int = 20, seed: int = 0) -> Entry:
    rng = np.random.default_rng(seed)
    return Entry.from_samples(median * rng.lognormal(0, 0.02, n), META, reference_ms=3.0 * rng.lognormal(0, 0.02, n))


def document(**entries: Any) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "arch": "sm_80",
            "entries": entries or {KEY: entry().to_dict()}}


# ------------------------------------------------------------------------------------------- naming


def test_cpu_class_id_names_mcpu_and_core_count() -> None:
    assert cpu_class_id("znver1", 2) == "cpu-znver1-2c"
    assert cpu_class_id("Skylake-AVX512", 16) == "cpu-skylake-avx512-16c"
    with pytest.raises(UsageError, match="cores must be a positive integer"):
        cpu_class_id("znver1", 0)
    with pytest.raises(UsageError, match="mcpu must be an LLVM CPU name"):
        cpu_class_id("zen 4/x", 2)


def test_cpu_class_ids_are_valid_arches() -> None:
    doc = document()
    doc["arch"] = cpu_class_id("skylake-avx512", 2)
    validate_document(doc, "baselines/cpu-skylake-avx512-2c.json")
    doc["arch"] = host_cpu_class()  # this machine, via TVM's LLVM host CPU name
    assert doc["arch"].startswith("cpu-") and doc["arch"].endswith("c")
    validate_document(doc, f"baselines/{doc['arch']}.json")


def test_keys_are_stable_and_readable() -> None:
    key = make_key("bert", {"mask": [1, 128], "ids": (1, 128), "scale": []}, fusion_label(disabled=["b", "a"]))
    assert key == "bert|ids=1x128,mask=1x128,scale=scalar|fused-no:a+b"
    assert make_key("resnet50", {"data": [1, 3, 224, 224]}, fusion_label()) == KEY
    assert make_key("m", {}, fusion_label(enabled=False)) == "m|-|unfused"
    assert model_of(key) == "bert"
    with pytest.raises(UsageError, match="concrete non-negative ints"):
        make_key("m", {"x": [1, -1]}, "fused")
    with pytest.raises(UsageError, match="no '\\|'"):
        make_key("a|b", {}, "fused")


# ------------------------------------------------------------------------------------------- entries


def test_entry_summarises_and_caps_samples_keeping_the_extremes() -> None:
    samples = list(np.linspace(1.0, 2.0, 201))
    e = Entry.from_samples(samples, META, reference_ms=4.0)
    assert e.n == 201 and len(e.samples_ms) == MAX_SAMPLES
    assert e.median_ms == pytest.approx(1.5) and e.iqr_ms == pytest.approx(0.5)
    assert min(e.samples_ms) == 1.0 and max(e.samples_ms) == 2.0
    assert e.normalised == pytest.approx(1.5 / 4.0)
    assert np.allclose(e.normalised_samples(), np.asarray(e.samples_ms) / 4.0)


def test_entry_from_samples_uses_the_unpreempted_samples() -> None:
    run = Samples(tuple(v * 1e6 for v in [1.0, 1.01, 9.0, 1.02, 0.99, 8.0, 1.0]), preempted=(0, 0, 3, 0, 0, 1, 0))
    e = Entry.from_samples(run, META, reference_ms=2.0)
    assert e.n == 5 and max(e.samples_ms) == pytest.approx(1.02)


def test_entry_without_reference_needs_no_reference_kind() -> None:
    meta = Metadata(**{**META.to_dict(), "reference_kind": None})
    e = Entry.from_samples([1.0, 2.0], meta)
    assert e.reference_median_ms is None and e.normalised is None and e.normalised_samples() is None
    with pytest.raises(UsageError, match="reference_kind"):
        Entry.from_samples([1.0, 2.0], META)


def test_metadata_collect_fills_versions_date_and_commit() -> None:
    meta = Metadata.collect("cpu", threads=2, reference_kind="calibration")
    assert meta.tvm_version.startswith("0.27") and meta.fuseguard_version != ""
    assert meta.git_commit is None or len(meta.git_commit) == 40
    validate_document(document(**{KEY: Entry.from_samples([1.0], meta, reference_ms=1.0).to_dict()}),
                      "baselines/sm_80.json")


# ------------------------------------------------------------------------------------------- validation

def _set(path: str, value: Any) -> Any:
    def change(doc: dict[str, Any]) -> None:
        node = doc["entries"][KEY]
        *parents, leaf = path.split(".")
        for name in parents:
            node = node[name]
        if value is DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    return change


DELETE = object()
AT = f"baselines/sm_80.json: entry '{KEY}': "


@pytest.mark.parametrize("change, message", [
    (_set("median_ms", -3), AT + "median_ms must be a positive number, got -3"),
    (_set("median_ms", "2.0"), AT + 'median_ms must be a positive number, got "2.0"'),
    (_set("median_ms", True), AT + "median_ms must be a positive number, got true"),
    (_set("iqr_ms", -0.5), AT + "iqr_ms must be a non-negative number, got -0.5"),
    (_set("n", 0), AT + "n must be a positive integer (the sample count), got 0"),
    (_set("n", 2.5), AT + "n must be a positive integer (the sample count), got 2.5"),
    (_set("n", 3), AT + "samples_ms holds 20 samples but n is 3"),
    (_set("samples_ms", []), AT + "samples_ms must be a list of 1..50 positive numbers, got []"),
    (_set("samples_ms", [1.0] * 51), AT + "samples_ms must be a list of 1..50 positive numbers"),
    (_set("samples_ms", [2.0, -1.0]), AT + "samples_ms must hold positive numbers only, got -1.0"),
    (_set("median_ms", 9.0), AT + "median_ms 9.0 lies outside its samples"),
    (_set("reference_median_ms", 0), AT + "reference_median_ms must be a positive number, got 0"),
    (_set("normalised", 0.5), AT + "normalised must equal median_ms / reference_median_ms"),
    (_set("reference_samples_ms", "fast"),
     AT + 'reference_samples_ms must be a list of 1..50 positive numbers, got "fast"'),
    (_set("median_m", 2.0), AT + "unknown field 'median_m'"),
    (_set("iqr_ms", DELETE), AT + "missing field 'iqr_ms'"),
    (_set("metadata", "A100"), AT + 'metadata must be an object, got "A100"'),
    (_set("metadata.device", ""), AT + 'metadata.device must be a non-empty string, got ""'),
    (_set("metadata.cuda", 12.4), AT + "metadata.cuda must be a non-empty string or null, got 12.4"),
    (_set("metadata.date", "yesterday"), AT + 'metadata.date must be an ISO 8601 date-time, got "yesterday"'),
    (_set("metadata.threads", 0), AT + "metadata.threads must be a positive integer or null, got 0"),
    (_set("metadata.processes", 1.5), AT + "metadata.processes must be a positive integer or null, got 1.5"),
    (_set("metadata.options_sha256", "abc"), AT + 'metadata.options_sha256 must be a hex digest or null, got "abc"'),
    (_set("metadata.git_commit", "HEAD"),
     AT + 'metadata.git_commit must be 7-40 lowercase hex digits or null, got "HEAD"'),
    (_set("metadata.reference_kind", None),
     AT + "metadata.reference_kind must be set exactly when reference_median_ms is"),
    (_set("metadata.tvm_version", DELETE), AT + "metadata is missing 'tvm_version'"),
    (_set("metadata.gpu", "x"), AT + "metadata has unknown field 'gpu'"),
])
def test_each_wrong_entry_field_is_named_with_file_and_entry(change: Any, message: str) -> None:
    doc = document()
    change(doc)
    with pytest.raises(BaselineError) as info:
        validate_document(doc, "baselines/sm_80.json")
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(schema_version=2), "schema_version 2 was written by a newer fuseguard"),
    (lambda d: d.update(schema_version="1"), 'schema_version must be the integer 1, got "1"'),
    (lambda d: d.update(arch="sm_86"), "arch is 'sm_86' but the file is named for 'sm_80'"),
    (lambda d: d.update(arch="a100"), 'arch must be a GPU arch like \'sm_80\' or a CPU class'),
    (lambda d: d.update(entries=[]), "entries must be an object mapping keys to entries, got []"),
    (lambda d: d.update(extra=1), "unknown top-level field 'extra'"),
    (lambda d: d["entries"].update({"resnet50": d["entries"][KEY]}), "entry 'resnet50': key must look like"),
])
def test_top_level_problems_are_named(change: Any, message: str) -> None:
    doc = document()
    change(doc)
    with pytest.raises(BaselineError, match=r"^baselines/sm_80\.json: ") as info:
        validate_document(doc, "baselines/sm_80.json")
    assert message in str(info.value)


def test_several_problems_are_counted() -> None:
    doc = document()
    doc["entries"][KEY]["median_ms"] = -1
    doc["entries"][KEY]["n"] = 0
    with pytest.raises(BaselineError, match=r"median_ms must be a positive number, got -1 \(and 1 more problem\)$"):
        validate_document(doc, "baselines/sm_80.json")


# ------------------------------------------------------------------------------------------- files


def test_record_load_lookup_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sm_80.json"
    assert len(load_baselines(path)) == 0 and load_baselines(path).arch == "sm_80"
    first, second = entry(2.0, seed=1), entry(3.0, seed=2)
    record(path, KEY, first)
    record(path, "bert|ids=1x128|unfused", second)
    loaded = load_baselines(path)
    assert loaded.lookup(KEY) == first
    assert loaded.lookup("bert|ids=1x128|unfused") == second
    assert loaded.lookup("bert|ids=1x128|fused") is None  # "no baseline", a state of its own
    record(path, KEY, second)
    assert load_baselines(path).lookup(KEY) == second
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION


@pytest.mark.parametrize("content", [
    b'{"schema_version": 1, "arch": "sm_80", "entries": {"a|b|c": {"median_ms": 1',
    b"",
    json.dumps(document(**{KEY: {**entry().to_dict(), "median_ms": -3}})).encode(),
])
def test_a_corrupt_or_invalid_file_is_never_overwritten(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "sm_80.json"
    path.write_bytes(content)
    with pytest.raises(BaselineError, match=r"sm_80\.json: .*left untouched"):
        record(path, KEY, entry())
    assert path.read_bytes() == content
    with pytest.raises(BaselineError, match=r"sm_80\.json: "):
        load_baselines(path)


def _record_many(path: str, worker: int, count: int) -> None:
    for i in range(count):
        record(path, f"model{worker}_{i}|x=1x{i + 1}|fused", entry(1.0 + worker + i / 100, seed=worker * 100 + i))


def test_concurrent_recorders_in_separate_processes_lose_no_entry(tmp_path: Path) -> None:
    path = tmp_path / "cpu-znver4-2c.json"
    workers, per_worker = 4, 12
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_record_many, args=(str(path), w, per_worker)) for w in range(workers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [0] * workers
    loaded = load_baselines(path)
    assert len(loaded) == workers * per_worker
    assert loaded.lookup("model3_11|x=1x12|fused") == entry(1.0 + 3 + 11 / 100, seed=311)


# ------------------------------------------------------------------------------------------- pytest-benchmark


_BENCH_TEST = textwrap.dedent("""
    def work():
        return sum(i * i for i in range(2000))

    def test_tiny(benchmark):
        benchmark.pedantic(work, rounds=30, iterations=2, warmup_rounds=1)

    def test_other(benchmark):
        benchmark.extra_info["fuseguard_key"] = "other|x=1x4|fused"
        benchmark.pedantic(work, rounds=60, iterations=1)
""")


@pytest.fixture(scope="module")
def benchmark_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real pytest-benchmark 5 --benchmark-json file, produced by running a tiny benchmark."""
    folder = tmp_path_factory.mktemp("bench")
    (folder / "test_bench_tiny.py").write_text(_BENCH_TEST)
    out = folder / "out.json"
    # An xdist worker's PYTEST_XDIST_WORKER would make pytest-benchmark disable itself in the child.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "--rootdir", str(folder), str(folder / "test_bench_tiny.py"), f"--benchmark-json={out}"],
                          cwd=folder, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_reads_a_real_pytest_benchmark_file(benchmark_json: Path) -> None:
    raw = {b["name"]: b for b in json.loads(benchmark_json.read_text())["benchmarks"]}
    entries = from_pytest_benchmark(benchmark_json)
    tiny = entries[f"{raw['test_tiny']['fullname']}|-|default"]
    stats = raw["test_tiny"]["stats"]
    assert tiny.n == stats["rounds"] == 30
    assert tiny.median_ms == pytest.approx(stats["median"] * 1e3)
    assert tiny.iqr_ms == pytest.approx(stats["iqr"] * 1e3)
    assert list(tiny.samples_ms) == pytest.approx([v * 1e3 for v in stats["data"]])
    assert tiny.reference_median_ms is None and tiny.metadata.reference_kind is None
    other = entries["other|x=1x4|fused"]
    assert other.n == 60 and len(other.samples_ms) == MAX_SAMPLES  # capped, extremes kept
    assert max(other.samples_ms) == pytest.approx(max(raw["test_other"]["stats"]["data"]) * 1e3)


def _same(a: Entry, b: Entry) -> bool:
    """Equal up to the float rounding of ms -> s -> ms."""
    def num(x: Any) -> Any:
        return None if x is None else pytest.approx(x, rel=1e-12)
    return (a.metadata == b.metadata and a.n == b.n and list(a.samples_ms) == num(list(b.samples_ms))
            and a.median_ms == num(b.median_ms) and a.iqr_ms == num(b.iqr_ms)
            and a.reference_median_ms == num(b.reference_median_ms) and a.normalised == num(b.normalised)
            and (a.reference_samples_ms is None) == (b.reference_samples_ms is None))


def test_pytest_benchmark_round_trip_keeps_everything(benchmark_json: Path, tmp_path: Path) -> None:
    ours = {KEY: entry(2.0), "bert|ids=1x128|unfused": entry(5.0, n=80, seed=3)}
    theirs = from_pytest_benchmark(benchmark_json)
    out = tmp_path / "exported.json"
    to_pytest_benchmark({**ours, **theirs}, out)
    back = from_pytest_benchmark(out)
    assert back.keys() == {**ours, **theirs}.keys()
    assert all(_same(back[k], v) for k, v in {**ours, **theirs}.items())
    exported = json.loads(out.read_text())
    assert exported["benchmarks"][0]["stats"]["median"] == pytest.approx(2.0 * np.median(
        np.random.default_rng(0).lognormal(0, 0.02, 20)) / 1e3)


def test_pytest_benchmark_itself_reads_the_exported_file(tmp_path: Path) -> None:
    beside = Path(sys.executable).parent / "pytest-benchmark"     # this interpreter's, not another on PATH
    exe = str(beside) if beside.exists() else shutil.which("pytest-benchmark")
    if exe is None:
        pytest.skip("pytest-benchmark's CLI is not on PATH")
    out = tmp_path / "0001_exported.json"
    to_pytest_benchmark({KEY: entry(2.0)}, out)
    proc = subprocess.run([exe, "compare", str(out), "--columns=min,median,iqr,rounds"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "resnet50|data=1x3x224x224|fused" in proc.stdout


def test_pytest_benchmark_file_without_raw_data_is_refused(benchmark_json: Path, tmp_path: Path) -> None:
    doc = json.loads(benchmark_json.read_text())
    stripped = copy.deepcopy(doc)
    for bench in stripped["benchmarks"]:
        del bench["stats"]["data"]
    path = tmp_path / "nodata.json"
    path.write_text(json.dumps(stripped))
    with pytest.raises(BaselineError, match=r"nodata\.json: benchmark .*test_tiny.* has no raw timing data"):
        from_pytest_benchmark(path)
    path.write_text('{"machine_info": {}}')
    with pytest.raises(BaselineError, match="not a pytest-benchmark JSON file"):
        from_pytest_benchmark(path)
