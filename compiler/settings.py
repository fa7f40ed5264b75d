"""Every environment variable fuseguard reads, in one table, and the only module that reads them.

A switch read in five modules drifts (two spellings of "off", a default that differs per command), and a
switch that changes generated code but is missing from the build cache's key serves a stale build. So
each variable is declared once here, with what it does and whether it changes code (`code=True`: part of
the cache key, `compiler/cache.py`), and read through a typed accessor. `fuseguard env` prints the table
with the values this process sees. Writing a variable for a child process (`os.environ[...] = ...`,
`env=` of a subprocess) is not reading it and stays where it happens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Setting:
    name: str
    help: str
    code: bool = False            # changes the generated code: part of the build-cache key


_TABLE: tuple[Setting, ...] = (
    Setting("FUSEGUARD_MCPU", "LLVM CPU to compile for instead of the detected host (cross-compiling "
            "for another x86 class)", code=True),
    Setting("TVM_NUM_THREADS", "threads of TVM's pool; also the `num-cores` the CPU schedules parallelise "
            "for (default: the usable cores)", code=True),
    Setting("FUSEGUARD_CPU_SCHEDULE_OFF", "CPU schedule switches to turn off, comma-separated "
            "(compiler/schedule/cpu.py: CpuScheduleOptions)", code=True),
    Setting("FUSEGUARD_CPU_SCHEDULE_ON", "CPU schedule switches to turn on, comma-separated", code=True),
    Setting("FUSEGUARD_DECISION_DB", "measured fusion decisions file; empty turns measured decisions off "
            "(default: baselines/decisions/<class>.json)", code=True),
    Setting("FUSEGUARD_CACHE_DIR", "cache directory (default: $XDG_CACHE_HOME/fuseguard or "
            "~/.cache/fuseguard)"),
    Setting("XDG_CACHE_HOME", "the user's cache root, when FUSEGUARD_CACHE_DIR is not set"),
    Setting("FUSEGUARD_NO_CACHE", "1/true/yes/on: no build cache (every build compiles)"),
    Setting("FUSEGUARD_CACHE_MAX_MB", "build cache size before least-recently-used entries go"),
    Setting("FUSEGUARD_PLUGINS", "plugin modules or files to load, comma-separated (as --plugin)"),
    Setting("FUSEGUARD_PROGRESS", "file a worker appends its stage lines to (set by the parent)"),
    Setting("FUSEGUARD_WORKER_NO_TORCH", "1 (timing commands set it for their workers): `import tvm` in the "
            "worker leaves out torch, which tvm_ffi imports whenever it is installed (2.1 s of a fresh process's "
            "3.4 s start)"),
    Setting("FUSEGUARD_CUDA_ARCH", "sm_XX of the CUDA device, instead of asking the driver"),
    Setting("FUSEGUARD_NVCC", "nvcc to use for the offline SASS check"),
    Setting("FUSEGUARD_CUDA_HOME", "CUDA toolkit root for the SASS check (then CUDA_PATH, CUDA_HOME)"),
    Setting("CUDA_PATH", "CUDA toolkit root (NVIDIA's Windows-style name)"),
    Setting("CUDA_HOME", "CUDA toolkit root"),
    Setting("FUSEGUARD_BASELINE_REV", "base revision the pytest latency gate compares against "
            "(as --baseline-rev)"),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in _TABLE}

_TRUE = ("1", "true", "yes", "on")


def get(name: str) -> str | None:
    """The raw value, None when unset. Only declared names: a typo must fail, not read nothing."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not a fuseguard setting (declare it in compiler/settings.py)")
    return os.environ.get(name)


def text(name: str, default: str = "") -> str:
    value = get(name)
    return default if value is None else value


def flag(name: str) -> bool:
    return text(name).strip().lower() in _TRUE


def items(name: str) -> list[str]:
    """A comma-separated list, blanks dropped."""
    return [s.strip() for s in text(name).split(",") if s.strip()]


def _parsed(name: str, convert, what: str):
    """The value through `convert`, None when unset or blank; a bad value names the variable."""
    value = text(name).strip()
    if not value:
        return None
    try:
        return convert(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected {what}") from None


def integer(name: str, default: int = 0) -> int:
    value = _parsed(name, int, "an integer")
    return default if value is None else value


def number(name: str) -> float | None:
    return _parsed(name, float, "a number")


def path(name: str) -> Path | None:
    value = get(name)
    return Path(value) if value else None


def code_environment() -> dict[str, str]:
    """The set variables that change generated code, for the build cache's key."""
    return {s.name: os.environ[s.name] for s in _TABLE if s.code and s.name in os.environ}


def rows() -> list[tuple[str, str, str, bool]]:
    """(name, value or "", help, changes code) for `fuseguard env`."""
    return [(s.name, os.environ.get(s.name, ""), s.help, s.code) for s in _TABLE]
