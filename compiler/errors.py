"""Errors a user can act on. Each names the model, node, input or file and what is wrong.

`exit_code` is what the CLI exits with: 2 for unusable input or usage. The worker pool
re-raises these by class name in the parent, so keep constructors to a single message string.
"""

from __future__ import annotations


class FuseguardError(Exception):
    """Base class: a clear, one-line problem a user can fix (no traceback needed)."""

    exit_code: int = 2


class ModelError(FuseguardError):
    """The model file or graph is unusable: truncated, not ONNX, invalid, unsafe external data, ..."""


class UnsupportedOperatorError(ModelError):
    """The model uses an operator the TVM ONNX frontend cannot import."""


class ShapeError(FuseguardError):
    """A --shape or input does not fit the model (unknown name, wrong rank, zero-size, too large)."""


class InputError(FuseguardError):
    """User-supplied inputs (--inputs FILE.npz) are missing, extra or of the wrong shape/dtype."""


class UsageError(FuseguardError):
    """A command-line option or API argument is wrong."""


class CompileError(FuseguardError):
    """TVM failed to compile a model that imported fine (a compiler bug, not bad input).

    `stage` names the pipeline step that failed (a pass list in compiler/pipeline.py, or "codegen").
    """

    exit_code = 1

    def __init__(self, message: str, *, stage: str | None = None) -> None:
        super().__init__(message)
        self.stage = stage


class BaselineError(FuseguardError):
    """A baseline file is corrupt or does not validate; it is never overwritten."""
