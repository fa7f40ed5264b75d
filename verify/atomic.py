"""Crash-safe, inter-process-safe file updates: nothing a killed or concurrent writer does can lose data.

Baselines are shared state: pytest-xdist workers, parallel CI jobs and a human with an editor all touch
the same JSON file. A plain ``open(path, "w")`` truncates first, so a SIGKILL (OOM killer, CI timeout)
mid-write leaves an empty or half-written file, and two read-modify-write cycles racing each other drop
one side's entry. Here every write goes to a temporary file in the same directory, is fsynced, and is
renamed over the target (``os.replace`` is atomic on POSIX and Windows); every read-modify-write holds an
inter-process lock. A file that does not parse or validate is reported and never overwritten: it may be
someone's only copy of months of measurements.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from fuseguard.compiler.errors import BaselineError

LOCK_TIMEOUT_S = 60.0
"""How long a writer waits for another one; a record() holds the lock for milliseconds."""

PathLike = str | os.PathLike[str]


def _fsync_dir(directory: Path) -> None:
    """Persist the rename itself: without this a power cut can resurrect the old directory entry."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # Windows cannot open directories; its rename is already durable enough.
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _new_file_mode(target: Path) -> int:
    """Keep the target's permissions; a fresh file gets the umask default, not mkstemp's 0600."""
    try:
        return target.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def atomic_write_text(path: PathLike, text: str, *, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text`` so that readers see either the old or the new file, never a mix.

    A process killed at any point leaves the previous file intact (at worst a stray ``.<name>.*.tmp``
    next to it, which is safe to delete).
    """
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    directory.mkdir(parents=True, exist_ok=True)
    mode = _new_file_mode(target)
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding=encoding, newline="\n") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_dir(directory)


def atomic_write_json(path: PathLike, obj: Any) -> None:
    """Atomically write ``obj`` as indented, key-sorted JSON (stable diffs in code review)."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")


@contextlib.contextmanager
def locked(path: PathLike, *, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold an inter-process lock on ``path`` (via ``path + ".lock"``) for the duration of the block.

    The OS releases the lock when its holder dies, so a killed writer cannot wedge later ones.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = f"{target}.lock"
    lock = FileLock(lock_path, timeout=timeout)
    try:
        lock.acquire()
    except Timeout:
        raise BaselineError(
            f"{target}: could not lock {lock_path} within {timeout:g}s; another process is still "
            f"updating this file (wait for it, or raise the timeout)"
        ) from None
    try:
        yield
    finally:
        lock.release()


def read_json_document(path: PathLike) -> dict[str, Any] | None:
    """Parse a JSON object file; None when it does not exist, BaselineError when it is not a JSON object."""
    target = Path(path)
    try:
        raw = target.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BaselineError(f"{target}: cannot read ({exc.strerror or exc})") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BaselineError(f"{target}: not UTF-8 text (byte {exc.start}); the file was left untouched") from None
    except json.JSONDecodeError as exc:
        raise BaselineError(
            f"{target}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
            f"the file was left untouched"
        ) from None
    if not isinstance(doc, dict):
        raise BaselineError(
            f"{target}: top level must be a JSON object, got {type(doc).__name__}; the file was left untouched"
        )
    return doc


def update_json(
    path: PathLike,
    mutate: Callable[[dict[str, Any]], None],
    validate: Callable[[dict[str, Any]], None] | None = None,
    *,
    timeout: float = LOCK_TIMEOUT_S,
) -> dict[str, Any]:
    """Locked read-modify-write of a JSON object file; returns the document as written.

    A missing file reads as ``{}``. An existing file that fails to parse or to ``validate`` raises
    BaselineError and is never overwritten; the mutated document is validated again before writing, so
    a buggy ``mutate`` cannot write a file that later reads fail on. ``validate`` raises BaselineError
    (ValueError/TypeError are wrapped) with a message naming the file and the problem.
    """
    target = Path(path)

    def check(doc: dict[str, Any], when: str) -> None:
        if validate is None:
            return
        try:
            validate(doc)
        except BaselineError as exc:
            raise BaselineError(f"{exc}{when}") from None
        except (ValueError, TypeError, KeyError) as exc:
            raise BaselineError(f"{target}: {exc}{when}") from None

    with locked(target, timeout=timeout):
        existing = read_json_document(target)
        if existing is not None:
            check(existing, "; the file was left untouched")
        doc: dict[str, Any] = {} if existing is None else existing
        mutate(doc)
        check(doc, " (after the update; nothing was written)")
        atomic_write_json(target, doc)
    return doc
