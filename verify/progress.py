"""What a long command is doing, shown while it works: `[3/18] resnet50: compile fused: schedule (12 s)`.

The work announces its stages with `compiler.progress.stage` (in the worker subprocess too: they arrive
through the file named by `FUSEGUARD_PROGRESS`, which `Progress.env` hands to the worker). On a terminal a
rich status line follows the latest stage with the elapsed time; elsewhere (CI logs) nothing is redrawn:
one line per finished model, and a heartbeat line when one model has been silent for a while, so a log
never goes quiet for minutes without saying what it is waiting on.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from fuseguard.compiler.progress import ENV

#: A non-terminal log says "still working" after this long on one stage (seconds).
HEARTBEAT_S = 30.0
_POLL_S = 0.25


class Progress:
    """`with Progress(n, console) as p: p.start(i, label); ...; p.done(label, "PASS")`."""

    def __init__(self, total: int, console: Any = None, *, live: bool | None = None,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        from rich.console import Console

        self.total = total
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.live = self.console.is_terminal if live is None else live
        self.heartbeat_s = heartbeat_s
        fd, name = tempfile.mkstemp(prefix="fuseguard-progress-", suffix=".log")
        os.close(fd)
        self.path = Path(name)
        self.env = {ENV: str(self.path)}
        self._index = 0
        self._label = ""
        self._stage = "starting"
        self._model_t0 = self._stage_t0 = time.monotonic()
        self._said = time.monotonic()
        self._pos = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._status: Any = None
        self._thread: threading.Thread | None = None

    # -- the command's side

    def start(self, index: int, label: str) -> None:
        with self._lock:
            self._index, self._label = index, label
            self._stage, self._model_t0 = "starting", time.monotonic()
            self._stage_t0 = self._said = self._model_t0
        self._refresh()

    def stage(self, text: str) -> None:
        """A stage of the parent's own (timing, comparing) rather than the worker's."""
        with self._lock:
            self._stage, self._stage_t0 = text, time.monotonic()
        self._refresh()

    def done(self, label: str, status: str, detail: str = "") -> None:
        seconds = time.monotonic() - self._model_t0
        self.console.print(f"[{self._index}/{self.total}] {label}: {status} ({seconds:.1f} s)"
                           + (f" {detail}" if detail else ""), highlight=False, markup=False)
        with self._lock:
            self._said = time.monotonic()

    # -- plumbing

    def _prefix(self) -> str:
        return f"[{self._index}/{self.total}] {self._label}"

    def _refresh(self) -> None:
        if self._status is not None:
            now = time.monotonic()
            self._status.update(f"{self._prefix()}: {self._stage} ({now - self._stage_t0:.0f} s; "
                                f"model {now - self._model_t0:.0f} s)")

    def _poll(self) -> None:
        while not self._stop.wait(_POLL_S):
            self._read()
            self._refresh()
            if not self.live and self._label:
                now = time.monotonic()
                if now - self._said >= self.heartbeat_s:
                    self.console.print(f"{self._prefix()}: still working, {self._stage} "
                                       f"({now - self._stage_t0:.0f} s)", highlight=False, markup=False)
                    self._said = now

    def _read(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                f.seek(self._pos)
                chunk = f.read()
                self._pos = f.tell()
        except OSError:
            return
        lines = [ln for ln in chunk.splitlines() if "\t" in ln]
        if lines:
            with self._lock:
                self._stage = lines[-1].split("\t", 1)[1]
                self._stage_t0 = time.monotonic()

    def last_stage(self) -> str:
        self._read()
        return self._stage

    def __enter__(self) -> Progress:
        if self.live:
            self._status = self.console.status(f"{self._prefix() or 'fuseguard'}: starting")
            self._status.__enter__()
        self._thread = threading.Thread(target=self._poll, name="fuseguard-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._status is not None:
            self._status.__exit__(exc_type, exc, tb)
            self._status = None
        try:
            self.path.unlink()
        except OSError:
            pass

