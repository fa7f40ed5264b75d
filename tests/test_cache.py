"""The build cache: a hit is the same build, every input of the key misses, nothing corrupt is loaded."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuseguard.compiler import cache as build_cache
from fuseguard.compiler.frontend.loader import load
from fuseguard.compiler.pipeline import CompileOptions, register_pass, unregister_pass
from fuseguard.compiler.hw.target import resolve


def _model(scale: float = 1.0):
    w = numpy_helper.from_array((np.arange(64, dtype=np.float32).reshape(8, 8) * scale / 64), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])]
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 8])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _key(model=None, options: CompileOptions = CompileOptions(), shapes=None) -> str:
    m = model or _model()
    return build_cache.build_key(m.SerializeToString(), shapes or {"x": (4, 8)}, options, resolve())


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(build_cache.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(build_cache.ENV_OFF, raising=False)
    return tmp_path / "builds"


def test_hit_is_the_same_build(cache_dir: Path) -> None:
    loaded = load(_model(), None, name="m")
    cold = build_cache.compile_cached(loaded, CompileOptions())
    warm = build_cache.compile_cached(loaded, CompileOptions())
    assert not cold.cache_hit and warm.cache_hit and warm.lowered is None
    x = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    np.testing.assert_array_equal(cold.run(x)[0], warm.run(x)[0])
    assert warm.report.to_dict()["groups"] == cold.report.to_dict()["groups"]
    assert warm.report.kernels == cold.report.kernels and warm.input_names == cold.input_names


def test_every_input_of_the_key_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    base = _key()
    assert _key() == base                                                  # deterministic
    assert _key(model=_model(scale=2.0)) != base                           # the model's bytes
    assert _key(shapes={"x": (4, 9)}) != base                              # pinned shapes
    assert build_cache.build_key(_model().SerializeToString(), {"x": (4, 8)}, CompileOptions(), resolve(),
                                 name="other") != base                     # the name (plugins may act on it)
    assert _key(options=CompileOptions(fusion=False)) != base              # each option
    assert _key(options=CompileOptions(disabled_patterns=frozenset({"layernorm"}))) != base
    assert _key(options=CompileOptions(schedule=False)) != base
    monkeypatch.setenv("FUSEGUARD_CPU_SCHEDULE_OFF", "conv_pointwise")   # a schedule switch
    assert _key() != base
    monkeypatch.delenv("FUSEGUARD_CPU_SCHEDULE_OFF")
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    assert _key() != base
    monkeypatch.delenv("TVM_NUM_THREADS")

    def my_pass(mod):
        return mod

    register_pass("before_fusion", my_pass, name="cache_test_pass")       # a registered pass
    try:
        with_pass = _key()
        assert with_pass != base
    finally:
        unregister_pass("before_fusion", "cache_test_pass")
    assert _key() == base

    def my_pass(mod):  # noqa: F811 - same name, different body: must miss (keyed by source, not name)
        return mod if mod is not None else None

    register_pass("before_fusion", my_pass, name="cache_test_pass")
    try:
        assert _key() not in (base, with_pass)
    finally:
        unregister_pass("before_fusion", "cache_test_pass")


def test_a_changed_decision_database_misses(tmp_path: Path) -> None:
    db = tmp_path / "decisions.json"
    db.write_text('{"entries": {}}')
    first = _key(options=CompileOptions(decision_db=str(db)))
    db.write_text('{"entries": {"k": {"fuse": false}}}')
    assert _key(options=CompileOptions(decision_db=str(db))) != first


def test_a_changed_compiler_source_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    base = _key()
    build_cache.compiler_source_hash.cache_clear()
    monkeypatch.setattr(build_cache, "compiler_source_hash", lambda: "a different compiler")
    assert _key() != base


def test_corrupt_entry_is_reported_removed_and_rebuilt(cache_dir: Path) -> None:
    loaded = load(_model(), None, name="m")
    build_cache.compile_cached(loaded, CompileOptions())
    (entry,) = [p for p in cache_dir.iterdir() if not p.name.startswith(".")]
    lib = entry / "lib.so"
    # Truncated, as a new file in its place: this process runs the build from that library, and rewriting a
    # loaded library in place would pull the code from under it (as it would in any process)
    cut = entry / "lib.so.cut"
    cut.write_bytes(lib.read_bytes()[: lib.stat().st_size // 2])
    cut.replace(lib)
    build_cache._warned.clear()
    with pytest.warns(UserWarning, match="corrupt or truncated"):
        again = build_cache.compile_cached(loaded, CompileOptions())
    assert not again.cache_hit                                            # rebuilt, not loaded
    assert build_cache.compile_cached(loaded, CompileOptions()).cache_hit  # and stored whole again


def _writer(args: tuple[str, str, int]) -> str:
    directory, key, n = args
    os.environ[build_cache.ENV_DIR] = directory
    c = build_cache.BuildCache(Path(directory) / "builds")

    def write(path: str) -> None:
        Path(path).write_bytes(bytes([n]) * 100_000)

    return c.put(key, write, {"writer": n}).meta["library_sha256"]


def test_concurrent_writers_leave_one_whole_entry(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        shas = pool.map(_writer, [(str(tmp_path), "k" * 64, n) for n in range(8)])
    c = build_cache.BuildCache(tmp_path / "builds")
    entry = c.get("k" * 64)
    assert entry is not None and entry.meta["library_sha256"] in shas
    assert len(c.entries()) == 1 and not list((tmp_path / "builds").glob(".tmp-*"))


def test_least_recently_used_are_evicted(tmp_path: Path) -> None:
    import time

    c = build_cache.BuildCache(tmp_path, max_bytes=250_000)
    for i in range(3):
        c.put(f"{i:064d}", lambda p: Path(p).write_bytes(b"x" * 100_000), {})
        time.sleep(0.02)
        if i == 1:
            assert c.get(f"{0:064d}") is not None      # touch entry 0: entry 1 is now the oldest
            time.sleep(0.02)
    names = {p.name for p, _, _ in c.entries()}
    assert f"{0:064d}" in names and f"{2:064d}" in names and f"{1:064d}" not in names
    assert c.clear() == 2 and c.info()["entries"] == 0


def test_no_cache_switch(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build_cache.ENV_OFF, "1")
    loaded = load(_model(), None, name="m")
    assert not build_cache.compile_cached(loaded, CompileOptions()).cache_hit
    assert not build_cache.compile_cached(loaded, CompileOptions()).cache_hit
    assert not cache_dir.exists() or not any(cache_dir.iterdir())


def test_profile_reuses_cached_builds(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fuseguard profile` builds through the cache: a second profile of the same model compiles nothing."""
    from fuseguard.compiler import pipeline
    from fuseguard.verify.check.model import SuiteSpec
    from fuseguard.verify.perf.profile import profile_model

    spec = SuiteSpec("conv_bn_relu", (("batch", 1),), seed=0)
    profile_model(spec, repeats=2, threads=1)
    calls: list[str] = []
    real = pipeline.compile_model
    monkeypatch.setattr(pipeline, "compile_model", lambda *a, **k: calls.append("build") or real(*a, **k))
    again = profile_model(spec, repeats=2, threads=1)
    assert calls == [] and again.fused and again.unfused


_BUILD_ONCE = """
import sys
sys.path.insert(0, {tests!r})
import tvm
from test_cache import _model
from fuseguard.compiler import cache
from fuseguard.compiler.frontend.loader import load
from fuseguard.compiler.pipeline import CompileOptions
assert tvm.__file__.startswith({tree!r}), tvm.__file__     # the copy on PYTHONPATH is the TVM loaded
print("hit" if cache.compile_cached(load(_model(), None, name="m"), CompileOptions()).cache_hit else "miss")
"""


def test_a_tvm_tree_first_on_pythonpath_changed_by_one_line_gets_a_fresh_build(cache_dir: Path,
                                                                              tmp_path: Path) -> None:
    """TVM's developers run a source tree first on PYTHONPATH whose version string never changes with their
    edits: a copy of the installed tvm, one line of its fusion code changed, must miss the cache."""
    import subprocess
    import sys

    import tvm

    installed = Path(tvm.__file__).resolve().parent
    tree = tmp_path / "tvm-tree"
    # hard links: the 300 MB of libraries are the same files (same inode), the edited file is replaced below
    import shutil

    shutil.copytree(installed, tree / "tvm", copy_function=os.link,
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
           "PYTHONDONTWRITEBYTECODE": "1"}
    script = _BUILD_ONCE.format(tests=str(Path(__file__).parent), tree=str(tree))

    def build() -> str:
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.split()[-1]

    assert build() == "miss"
    assert build() == "hit"                      # the unchanged tree is a stable key
    fusion = tree / "tvm" / "relax" / "transform" / "transform.py"
    text = fusion.read_text()
    assert "def FuseOps(fuse_opt_level=-1)" in text
    fusion.unlink()                              # a new file: the installed one stays untouched
    fusion.write_text(text.replace("def FuseOps(fuse_opt_level=-1)", "def FuseOps(fuse_opt_level=2)", 1))
    assert build() == "miss"                     # one line of fusion code changed: a fresh build
    assert build() == "hit"
