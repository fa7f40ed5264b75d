"""Where fuseguard keeps what it caches (builds, SASS logs, base revisions of the A/B gate), and whether
caching is on: one place every cache reads, so none of them needs the build cache's module."""

from __future__ import annotations

import os
from pathlib import Path

ENV_DIR = "FUSEGUARD_CACHE_DIR"
ENV_OFF = "FUSEGUARD_NO_CACHE"


def enabled() -> bool:
    return os.environ.get(ENV_OFF, "").strip().lower() not in ("1", "true", "yes", "on")


def home() -> Path:
    """fuseguard's cache directory: `FUSEGUARD_CACHE_DIR`, else `$XDG_CACHE_HOME/fuseguard`, else
    `~/.cache/fuseguard` (builds in `builds/`, SASS logs in `sass/`, base revisions of the A/B gate in `revs/`)."""
    env = os.environ.get(ENV_DIR)
    return Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fuseguard"
