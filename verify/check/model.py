"""Verify one model: fused build, unfused build and ONNX Runtime on the same inputs.

`verify_model` does the work in-process; `verify_in_worker` runs it in a reusable worker subprocess
so a native crash or hang in TVM fails that one model, not the run.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from fuseguard.compiler.errors import FuseguardError, InputError, ModelError, UsageError
from fuseguard.compiler.frontend.loader import LoadedModel, error_line, load
from fuseguard.compiler import progress
from fuseguard.compiler.cache import compile_cached
from fuseguard.compiler.plugins import load_env_plugins
from fuseguard.compiler.pipeline import CompileOptions, CompiledModel
from fuseguard.compiler.hw.target import cuda_device_present, resolve

from .compare import Tolerance, compare_outputs, rescue_boundary_flips, uninformative_outputs
from .precision import (check_against_fp64, fp64_reference, is_qdq, loose_tolerances, qdq_tolerances,
                        quantisation_error)
from .inputs import load_npz, make_inputs
from .reference import reference_providers, run_onnxruntime
from .results import BuildResult, ModelVerdict

NO_CUDA_DEVICE = "no CUDA device"


@dataclass(frozen=True)
class SuiteSpec:
    """A built-in suite model, built inside the worker (no large protobufs through the pipe)."""

    name: str
    dims: tuple[tuple[str, int], ...] = ()
    seed: int = 0

    def build(self) -> onnx.ModelProto:
        from fuseguard.suites.models import get_model

        return get_model(self.name).make(dict(self.dims), seed=self.seed)

    @property
    def label(self) -> str:
        return self.name + ("[" + ",".join(f"{k}={v}" for k, v in self.dims) + "]" if self.dims else "")


def dim_overrides(items: Sequence[str]) -> dict[str, int]:
    """`--dim NAME=N` values as a dict (N >= 1)."""
    dims: dict[str, int] = {}
    for item in items:
        name, _, value = item.partition("=")
        if not name or not value.isdigit() or int(value) < 1:
            raise UsageError(f"--dim {item!r}: expected NAME=N with N >= 1")
        dims[name] = int(value)
    return dims


def resolve_model_arg(item: str, *, dims: Mapping[str, int] | None = None,
                      seed: int | None = None) -> "str | SuiteSpec":
    """A MODEL argument: an existing file (or anything named *.onnx) stays a path; otherwise it must be a
    built-in suite model, returned as a SuiteSpec at its default dims overlaid with `dims` (unknown dim
    names are ignored, so one `--dim seq=128` can apply to a mixed list of models)."""
    from pathlib import Path

    if Path(item).exists() or item.endswith(".onnx"):
        return item
    from fuseguard.suites.models import get_model, suite_models

    try:
        model = get_model(item)
    except KeyError:
        raise UsageError(f"{item}: no such file, and not a built-in suite model "
                         f"({', '.join(s.name for s in suite_models())})") from None
    merged = {**model.default_dims, **{k: v for k, v in (dims or {}).items() if k in model.default_dims}}
    return SuiteSpec(model.name, tuple(sorted(merged.items())), seed=seed or 0)


def build_and_run(loaded: LoadedModel, options: CompileOptions, config: str, inputs: Mapping[str, np.ndarray],
                   reference: Mapping[str, np.ndarray] | None, tolerances: Any,
                   per_output: Mapping[str, Tolerance] | None,
                   keep: dict[str, np.ndarray] | None = None) -> tuple[BuildResult, CompiledModel | None]:
    result = BuildResult(config=config)
    try:
        with progress.scope(f"compile {config}"):
            compiled = compile_cached(loaded, options)
    except FuseguardError as err:
        if err.exit_code == 2:
            raise
        import traceback

        result.error = str(err)
        result.traceback = traceback.format_exc()
        return result, None
    rep = compiled.report
    result.compile_s, result.kernels = compiled.compile_s, rep.kernels
    result.cached = compiled.cache_hit
    result.groups, result.pattern_groups = len(rep.groups), len(rep.pattern_groups)
    result.report = rep
    if reference is not None:
        progress.stage(f"run {config} and compare")
        start = time.perf_counter()
        outputs = compiled.run(inputs)
        result.run_s = time.perf_counter() - start
        result.ran = True
        named = dict(zip(loaded.output_names, outputs))
        if keep is not None:
            keep.update(named)
        result.compare = compare_outputs(named, dict(reference), tolerances=tolerances, per_output=per_output)
    return result, compiled


def load_with_inputs(source: Any, shapes: Mapping[str, Sequence[int]] | None = None, *, name: str | None = None,
                     seed: int = 0) -> tuple[LoadedModel, dict[str, np.ndarray]]:
    """A model argument (file, bytes, ModelProto or suite model, built here) loaded, with seeded inputs; the
    user's plugins are loaded first. What `profile`, `bench` and `tune`'s confirmation each start from."""
    load_env_plugins()
    if isinstance(source, SuiteSpec):
        name = name or source.label
        source = source.build()
    loaded = load(source, shapes, name=name)
    return loaded, make_inputs(loaded.model, loaded.input_shapes, seed=seed)


def verify_model(source: str | bytes | onnx.ModelProto | SuiteSpec, *, shapes: Mapping[str, Sequence[int]] | None = None,
                 options: CompileOptions = CompileOptions(), seed: int | None = None, inputs_file: str | None = None,
                 tolerances: Any = None, per_output: Mapping[str, Tolerance] | None = None,
                 name: str | None = None, default_dim: int | None = None) -> ModelVerdict:
    """Build fused and unfused, run both and ONNX Runtime on the same seeded inputs, compare.

    `seed=None` takes a suite model's own seed (0 for files); any int, 0 included, overrides it."""
    load_env_plugins()
    progress.stage("load")
    if isinstance(source, SuiteSpec):
        name = name or source.label
        seed = source.seed if seed is None else seed
        source = source.build()
    seed = 0 if seed is None else seed
    user = load_npz(inputs_file) if inputs_file else None
    loaded = load(source, shapes, name=name, default_dim=default_dim,
                  shape_hints={k: a.shape for k, a in user.items()} if user else None)
    spec = resolve(options.gpu_arch, options.mcpu)
    try:
        inputs = make_inputs(loaded.model, loaded.input_shapes, seed=seed, user=user)
    except InputError as err:
        if inputs_file and inputs_file not in str(err):
            raise InputError(f"{inputs_file}: {err}") from None
        raise
    skipped = NO_CUDA_DEVICE if spec.is_gpu and not cuda_device_present() else None
    try:
        progress.stage("ONNX Runtime reference")
        providers = reference_providers(spec.is_gpu)
        reference = None if skipped else run_onnxruntime(loaded.model, inputs, providers=providers)
    except Exception as err:  # ORT's own errors: a model it cannot run at these shapes is unusable input
        label = str(loaded.path) if loaded.path else loaded.name
        raise ModelError(f"{label}: ONNX Runtime cannot run it: {error_line(err)}{loaded.shape_hint()}") from err
    reduced = options.precision != "fp32"
    if reduced and tolerances is None and per_output is None and reference is not None:
        # vs fp32 ORT: a loose, scale-aware sanity bound only
        per_output = loose_tolerances(options.precision, reference)
    if tolerances is None and per_output is None:
        if is_qdq(loaded.model):        # int8 QDQ: QDQ_STEPS quantisation steps on each dequantized output
            per_output = qdq_tolerances(loaded.model) or None
    fused_out: dict[str, np.ndarray] = {}
    unfused_out: dict[str, np.ndarray] = {}
    fused, _ = build_and_run(loaded, options, options.config_label, inputs, reference, tolerances, per_output,
                              keep=fused_out)
    unfused, _ = build_and_run(loaded, options.unfused(), "unfused", inputs, reference, tolerances, per_output,
                                keep=unfused_out)
    notes = list(loaded.warnings)
    if reference is not None and not reduced:     # reduced precision compares against loose, scale-aware bounds
        weak = uninformative_outputs(reference, tolerances, per_output, {"fused": fused_out, "unfused": unfused_out})
        notes += [f"{loaded.name}: {why}" for why in weak.values()]
    if reduced and fused_out and unfused_out and reference is not None:
        progress.stage("fp64 reference")
        try:
            gold, engine = fp64_reference(loaded.model, inputs, loaded.output_names, reference,
                                          run_onnxruntime)
        except Exception as err:     # no fp64 run at all: say so; the loose fp32 comparison still stands
            notes.append(f"no fp64 reference ({error_line(err)}): fused vs unfused error not compared")
        else:
            fused.fp64 = check_against_fp64(options.precision, fused_out, unfused_out, gold, engine)
            notes.append(fused.fp64.summary())
    quant = int8 = None
    if not reduced and fused_out and unfused_out and reference is not None and is_qdq(loaded.model):
        progress.stage("ONNX Runtime int8 kernels")
        try:
            int8 = run_onnxruntime(loaded.model, inputs, optimize=True, providers=providers)
        except Exception as err:     # information only: say why it is missing, the verdict stands
            int8 = None
            notes.append(f"no ONNX Runtime int8-kernel run ({error_line(err)})")
        if int8 is not None and per_output and tolerances is None:
            _rescue_flips((fused, unfused), int8, reference, per_output, notes)
    if int8 is not None:
        progress.stage("fp32 model (activation quantisation removed)")
        try:
            quant = quantisation_error(loaded.model, inputs, {
                "fused": fused_out, "unfused": unfused_out, "ORT reference": reference, "ORT int8 kernels": int8},
                lambda m, feeds: run_onnxruntime(m, feeds, providers=providers))
        except Exception as err:     # information only: say why it is missing, the verdict stands
            notes.append(f"no fp32-model comparison ({error_line(err)})")
        if quant is not None:
            notes.append(quant.summary())
    if spec.is_gpu and not skipped:
        notes.append(f"reference: ONNX Runtime {providers[0].removesuffix('ExecutionProvider')} provider")
    return ModelVerdict(model=loaded.name, target=spec.label, nodes=loaded.num_nodes,
                        input_shapes=loaded.input_shapes, seed=seed, fused=fused, unfused=unfused,
                        skipped_run=skipped, warnings=notes, precision=options.precision, quantisation=quant)


def _rescue_flips(builds: Sequence[BuildResult], int8: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
                  per_output: Mapping[str, Tolerance], notes: list[str]) -> None:
    """int8 QDQ models: a build's tolerance failures that are sparse rounding-boundary flips, no larger than
    ONNX Runtime's own int8 kernels' error, pass with a note (verify/compare.rescue_boundary_flips)."""
    yardstick = {name: float(np.max(np.abs(np.asarray(int8[name], np.float64) - np.asarray(reference[name], np.float64))))
                 for name in per_output if name in int8 and name in reference and np.shape(int8[name]) == np.shape(reference[name])
                 and np.asarray(reference[name]).size}
    for build in builds:
        if build.compare is None or build.compare:
            continue
        build.compare = rescue_boundary_flips(build.compare, yardstick)
        notes.extend(f"{build.config}: {r.name}: {r.note}" for r in build.compare.values() if r.note)


def verify_in_worker(source: str | bytes | SuiteSpec, *, timeout: float | None = None, worker: Any = None,
                     **kwargs: Any) -> ModelVerdict:
    """`verify_model` in a worker subprocess: crashes and hangs become WorkerFailure for this model only."""
    from ..worker import get_worker

    worker = worker or get_worker()
    label = source.label if isinstance(source, SuiteSpec) else (kwargs.get("name") or str(source)[:80])
    options: CompileOptions = kwargs.get("options", CompileOptions())
    target = options.gpu_arch or "cpu"
    return worker.call("fuseguard.verify.check.model:verify_model", what=f"verifying {label} for {target}",
                       timeout=timeout, source=source, **kwargs)
