"""Where fuseguard keeps what it caches (builds, SASS logs, base revisions of the A/B gate), and whether
caching is on: one place every cache reads, so none of them needs the build cache's module."""

from __future__ import annotations

from pathlib import Path

from . import settings

#: The folder that holds compiler/, verify/, suites/ and baselines/: a checkout's root (or site-packages/fuseguard
#: once installed). The one place a module finds the decision database, the stored baselines or the tree a
#: worker puts on `sys.path`: computed from this file's own place, so a module moved to another folder cannot
#: silently point them elsewhere (tests/test_structure.py checks no other module computes one).
PROJECT_ROOT = Path(__file__).resolve().parent.parent

ENV_DIR = "FUSEGUARD_CACHE_DIR"
ENV_OFF = "FUSEGUARD_NO_CACHE"


def enabled() -> bool:
    return not settings.flag(ENV_OFF)


def home() -> Path:
    """fuseguard's cache directory: `FUSEGUARD_CACHE_DIR`, else `$XDG_CACHE_HOME/fuseguard`, else
    `~/.cache/fuseguard` (builds in `builds/`, SASS logs in `sass/`, base revisions of the A/B gate in `revs/`)."""
    return settings.path(ENV_DIR) or (settings.path("XDG_CACHE_HOME") or Path.home() / ".cache") / "fuseguard"
