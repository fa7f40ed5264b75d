"""Where fuseguard keeps what it caches (builds, SASS logs, base revisions of the A/B gate), and whether
caching is on: one place every cache reads, so none of them needs the build cache's module."""

from __future__ import annotations

from pathlib import Path

from . import settings

ENV_DIR = "FUSEGUARD_CACHE_DIR"
ENV_OFF = "FUSEGUARD_NO_CACHE"


def enabled() -> bool:
    return not settings.flag(ENV_OFF)


def home() -> Path:
    """fuseguard's cache directory: `FUSEGUARD_CACHE_DIR`, else `$XDG_CACHE_HOME/fuseguard`, else
    `~/.cache/fuseguard` (builds in `builds/`, SASS logs in `sass/`, base revisions of the A/B gate in `revs/`)."""
    return settings.path(ENV_DIR) or (settings.path("XDG_CACHE_HOME") or Path.home() / ".cache") / "fuseguard"
