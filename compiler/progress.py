"""Announce what a long step is doing, from wherever it runs (a worker subprocess included).

`stage("compile fused: schedule")` appends one line to the file named by `FUSEGUARD_PROGRESS` when that is
set (the parent process tails it: verify/progress.py) and is a no-op otherwise: one `open` per stage, a few
dozen per model, so it costs nothing next to a compile. A file rather than the worker's pipe because the
pipe carries exactly one reply per call, and a file survives a crashing child (its last stage says where).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from collections.abc import Iterator

from . import settings

ENV = "FUSEGUARD_PROGRESS"
_prefix: list[str] = []


def stage(text: str) -> None:
    path = settings.get(ENV)
    if not path:
        return
    label = ": ".join([*_prefix, text])
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{time.time():.3f}\t{label}\n")
    except OSError:
        pass  # progress is a courtesy: never fail the work over it


@contextmanager
def scope(text: str) -> Iterator[None]:
    """Prefix every stage announced inside with `text` ("compile fused: schedule")."""
    _prefix.append(text)
    stage("start")
    try:
        yield
    finally:
        _prefix.pop()
