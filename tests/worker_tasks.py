"""Tasks for tests/test_worker.py, run inside real worker subprocesses.

tests/ is not a package: the tests pass `sys_path=[<tests dir>]` to Worker and name
these as "worker_tasks:<function>".
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fuseguard.compiler.errors import ModelError


class CustomError(Exception):
    """A non-builtin, non-fuseguard exception: must come back as WorkerTaskError."""


def add(a: Any, b: Any) -> Any:
    return a + b


def getpid() -> int:
    return os.getpid()


def getenv(name: str) -> str | None:
    return os.environ.get(name)


def native_segfault() -> None:
    ctypes.string_at(0)  # a real NULL dereference in C


def abort() -> None:
    os.abort()


def exit_code(code: int) -> None:
    os._exit(code)


def hang(seconds: float) -> None:
    time.sleep(seconds)


def spawn_and_hang(pid_file: str) -> None:
    """Leave a grandchild behind (in the worker's process group), then hang."""
    child = subprocess.Popen(["sleep", "100"])
    Path(pid_file).write_text(str(child.pid))
    time.sleep(100)


def raise_value_error() -> None:
    raise ValueError("bad value 42")


def raise_custom_error() -> None:
    raise CustomError("custom trouble")


def raise_model_error() -> None:
    raise ModelError("model.onnx: graph is truncated")


def print_both(text: str) -> str:
    print(f"stdout: {text}")
    print(f"stderr: {text}", file=sys.stderr)
    return text


def allocate(nbytes: int) -> int:
    return len(bytearray(nbytes))


def sleep_then_getpid(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def torch_after_importing_tvm() -> str:
    """'hidden' where tvm started without torch and torch still imports afterwards (the worker's finder), else
    'absent' (not installed) or 'imported' (tvm_ffi imported it)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "absent"
    import tvm  # noqa: F401

    if "torch" in sys.modules:
        return "imported"
    import torch  # noqa: F401 - a plugin's import after tvm's start goes through

    return "hidden"
