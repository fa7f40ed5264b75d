"""verify.atomic: a killed writer, a failed write or a corrupt file never costs the previous contents."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from filelock import FileLock

from fuseguard.compiler.errors import BaselineError
from fuseguard.verify.atomic import atomic_write_json, atomic_write_text, locked, update_json

ROOT = Path(__file__).resolve().parents[1]


def _temps(directory: Path, name: str) -> list[Path]:
    return sorted(directory.glob(f".{name}.*.tmp"))


def test_atomic_write_replaces_content_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "doc.json"
    atomic_write_json(target, {"b": 1, "a": [1.5, None]})
    atomic_write_json(target, {"b": 2})
    assert json.loads(target.read_text()) == {"b": 2}
    assert target.read_text().endswith("\n")
    assert _temps(tmp_path, "doc.json") == []


def test_atomic_write_keeps_the_files_permissions(tmp_path: Path) -> None:
    target = tmp_path / "doc.txt"
    target.write_text("old")
    target.chmod(0o640)
    atomic_write_text(target, "new")
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert target.read_text() == "new"


def test_atomic_write_creates_missing_directories(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "doc.txt"
    atomic_write_text(target, "x")
    assert target.read_text() == "x"


def test_a_write_that_fails_before_the_rename_leaves_the_old_file(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "doc.txt"
    target.write_text("precious")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space"):
        atomic_write_text(target, "replacement")
    assert target.read_text() == "precious"
    assert _temps(tmp_path, "doc.txt") == []


def test_nan_is_refused_rather_than_written_as_invalid_json(tmp_path: Path) -> None:
    target = tmp_path / "doc.json"
    target.write_text('{"ok": 1}\n')
    with pytest.raises(ValueError):
        atomic_write_json(target, {"median_ms": float("nan")})
    assert target.read_text() == '{"ok": 1}\n'


_WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    from fuseguard.verify.atomic import atomic_write_text
    from test_atomic import version_text
    i = 1
    while True:
        atomic_write_text(sys.argv[1], version_text(i))
        i += 1
""")


def version_text(i: int) -> str:
    """Version i of the file the SIGKILL test writes: 8 MB, its version number first."""
    return f'{{"version": {i}, "payload": "' + "x" * (8 << 20) + '"}\n'


def test_sigkill_mid_write_leaves_the_previous_file_intact(tmp_path: Path) -> None:
    """A real writer process is SIGKILLed while a temporary exists: the target is still a complete version."""
    target = tmp_path / "doc.json"
    target.write_text(version_text(0))
    env = dict(os.environ, PYTHONPATH=f"{Path(__file__).parent}{os.pathsep}{ROOT}")
    mid_write_kills = 0
    for _attempt in range(5):
        child = subprocess.Popen([sys.executable, "-c", _WRITER, str(target), str(ROOT)], env=env)
        try:
            deadline = time.monotonic() + 10
            while not _temps(tmp_path, "doc.json") and time.monotonic() < deadline:
                time.sleep(0.0002)
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
        assert child.returncode == -signal.SIGKILL
        leftovers = _temps(tmp_path, "doc.json")
        raw = target.read_text()
        version = json.loads(raw)["version"]  # parses: never a torn file
        assert raw == version_text(version)  # byte-for-byte a complete version
        if leftovers:  # the kill landed before os.replace: the interrupted write was version + 1
            mid_write_kills += 1
            partial = leftovers[0].read_bytes()[:40]
            if partial:
                assert partial.startswith(f'{{"version": {version + 1},'.encode())
            for leftover in leftovers:
                leftover.unlink()
        if mid_write_kills >= 2:
            break
    assert mid_write_kills >= 1, "never managed to kill the writer mid-write"


def test_update_json_starts_from_an_empty_document(tmp_path: Path) -> None:
    target = tmp_path / "new.json"
    out = update_json(target, lambda doc: doc.update(a=1))
    assert out == {"a": 1}
    assert json.loads(target.read_text()) == {"a": 1}


@pytest.mark.parametrize("content, problem", [
    (b'{"schema_version": 1, "entries": {', "not valid JSON"),
    (b"[1, 2]", "top level must be a JSON object"),
    (b"\xff\xfe\x00garbage", "not UTF-8"),
])
def test_update_json_never_overwrites_a_corrupt_file(tmp_path: Path, content: bytes, problem: str) -> None:
    target = tmp_path / "sm_80.json"
    target.write_bytes(content)
    calls = []
    with pytest.raises(BaselineError, match=problem) as info:
        update_json(target, calls.append)
    assert str(target) in str(info.value)
    assert "left untouched" in str(info.value)
    assert target.read_bytes() == content
    assert calls == []


def test_update_json_never_overwrites_a_file_that_fails_validation(tmp_path: Path) -> None:
    target = tmp_path / "doc.json"
    content = b'{"version": "seven"}\n'
    target.write_bytes(content)

    def validate(doc: dict) -> None:
        if not isinstance(doc.get("version"), int):
            raise ValueError(f"version must be an integer, got {doc.get('version')!r}")

    with pytest.raises(BaselineError, match=r"doc\.json: version must be an integer, got 'seven'; the file was left"):
        update_json(target, lambda doc: doc.update(version=8), validate)
    assert target.read_bytes() == content


def test_update_json_does_not_write_a_mutation_that_fails_validation(tmp_path: Path) -> None:
    target = tmp_path / "doc.json"
    target.write_text('{"n": 1}\n')

    def validate(doc: dict) -> None:
        if doc["n"] < 0:
            raise BaselineError(f"{target}: n must be >= 0, got {doc['n']}")

    with pytest.raises(BaselineError, match="n must be >= 0, got -1 .after the update; nothing was written"):
        update_json(target, lambda doc: doc.update(n=-1), validate)
    assert target.read_text() == '{"n": 1}\n'


def test_locked_times_out_with_a_clear_error_while_another_holder_has_it(tmp_path: Path) -> None:
    target = tmp_path / "sm_80.json"
    holder = FileLock(f"{target}.lock")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with holder:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(10)
        with pytest.raises(BaselineError, match=r"sm_80\.json: could not lock .*sm_80\.json\.lock within 0\.2s"):
            with locked(target, timeout=0.2):
                pass
    finally:
        release.set()
        thread.join()
    with locked(target, timeout=1):  # free again once the holder let go
        pass
