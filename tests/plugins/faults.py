"""Fault injection for the harness tests, loaded with --plugin: models named `fault_<kind>` misbehave.

Each kind is a way a build can go wrong that the verifier must report as that model's row, never as a
traceback that ends the run: `fault_build` (the fused build fails to compile), `fault_shape` (an output
of the wrong shape), `fault_dtype` (an output of the wrong dtype), `fault_missing` (an output missing),
`fault_nan` (NaN in an output), `fault_crash` (a Python exception while the model runs). Models with
other names are left alone.
"""

from __future__ import annotations

import numpy as np

from fuseguard.compiler import pipeline
from fuseguard.compiler.errors import CompileError

_compile_relax = pipeline.compile_relax
_run = pipeline.CompiledModel.run


def _compile(mod, options=pipeline.CompileOptions(), *, name="model", **kwargs):
    if name == "fault_build" and options.fusion:
        raise CompileError(f"{name}: code generation for cpu failed: InternalError: injected fault")
    return _compile_relax(mod, options, name=name, **kwargs)


def _faulty_run(self, inputs):
    outputs = _run(self, inputs)
    kind = self.name.removeprefix("fault_") if self.name.startswith("fault_") else None
    if kind == "shape":
        outputs[0] = outputs[0].reshape(-1)[:1].reshape(())
    elif kind == "dtype":
        outputs[0] = outputs[0].astype(np.float64)
    elif kind == "missing":
        outputs = outputs[:-1]
    elif kind == "nan":
        outputs[0] = np.full_like(outputs[0], np.nan)
    elif kind == "crash":
        raise RuntimeError("injected fault while running")
    return outputs


pipeline.compile_relax = _compile
pipeline.CompiledModel.run = _faulty_run
