"""Verify many shapes against one build: `fuseguard verify MODEL --dynamic seq --draws 50`.

A symbolic build (compiler/dynamic.py) serves every size of its dynamic dims, so the fused and the unfused
build are compiled once each and hypothesis draws the sizes: biased to tile edges (1, 2^k, 2^k +- 1, the
bound), where a kernel's remainder path is. Each drawn size runs both builds and ONNX Runtime on the same
seeded inputs; a failing size is shrunk to the smallest that fails and reported with the seed that
reproduces it. The verdict records how many builds and how many distinct sizes it took.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx

from fuseguard.compiler import progress
from fuseguard.compiler.dynamic import DynamicDim, as_spec, check_names, relabel
from fuseguard.compiler.errors import ModelError, UsageError
from fuseguard.compiler.frontend.loader import LoadedModel, error_line, load
from fuseguard.compiler.pipeline import CompileOptions

from .compare import CompareResult, Tolerance, compare_outputs
from .model import NO_CUDA_DEVICE, SuiteSpec, build_and_run
from .results import BuildResult, ModelVerdict
from .inputs import make_inputs

#: Draws when --draws is not given: the issue's bar for the transformer suites.
DEFAULT_DRAWS = 50
#: Sizes a dynamic dim is drawn from when it has no bound and no suite range: 1..256 covers the
#: sequence lengths the suites and the cliff benchmark use, with 2^k +- 1 edges up to 257.
DEFAULT_DRAW_UPPER = 256


def edge_sizes(lo: int, hi: int) -> list[int]:
    """lo, hi and every 2^k - 1, 2^k, 2^k + 1 between them: where tiles and vector lanes end."""
    out = {lo, hi}
    k = 0
    while (1 << k) - 1 <= hi:
        out.update(v for v in ((1 << k) - 1, 1 << k, (1 << k) + 1) if lo <= v <= hi)
        k += 1
    return sorted(out)


def size_strategy(lo: int, hi: int) -> Any:
    """Sizes in [lo, hi], half of the draws from `edge_sizes`; shrinks towards lo."""
    from hypothesis import strategies as st

    if not 1 <= lo <= hi:
        raise UsageError(f"size range [{lo}, {hi}] is empty or below 1")
    return st.one_of(st.sampled_from(edge_sizes(lo, hi)), st.integers(lo, hi))


def sizes_strategy(ranges: Mapping[str, tuple[int, int]]) -> Any:
    """{dim name: size} for every dynamic dim."""
    from hypothesis import strategies as st

    return st.fixed_dictionaries({name: size_strategy(lo, hi) for name, (lo, hi) in ranges.items()})


@dataclass
class ShapeCheck:
    """One drawn size against both builds."""

    sizes: dict[str, int]
    fused: CompareResult | None = None
    unfused: CompareResult | None = None
    error: str | None = None          # a run that raised (shape function, kernel, ONNX Runtime)

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.fused) and bool(self.unfused)

    def worst(self, which: str) -> float | None:
        result = getattr(self, which)
        if result is None:
            return None
        errors = [r.max_abs_error for r in result.values() if r.max_abs_error is not None]
        return max(errors) if errors else None

    def to_dict(self) -> dict[str, Any]:
        return {"sizes": dict(self.sizes), "passed": self.passed, "error": self.error,
                "fused_max_abs_error": self.worst("fused"), "unfused_max_abs_error": self.worst("unfused")}


@dataclass
class DynamicVerdict(ModelVerdict):
    """A ModelVerdict over many sizes of one symbolic build pair: FAIL when any drawn size fails."""

    dynamic: str = ""
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    draws: int = 0
    checks: list[ShapeCheck] = field(default_factory=list)
    failing: ShapeCheck | None = None      # the smallest failing size, after shrinking
    check_s: float = 0.0

    @property
    def builds(self) -> int:
        return sum(1 for b in (self.fused, self.unfused) if not b.cached and not b.error)

    @property
    def sizes_checked(self) -> int:
        return len({tuple(sorted(c.sizes.items())) for c in self.checks})

    @property
    def status(self) -> str:
        base = super().status
        if base == "PASS" and self.failing is not None:
            return "FAIL"
        return base

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.update({"dynamic": self.dynamic, "ranges": {k: list(v) for k, v in self.ranges.items()},
                  "draws": self.draws, "builds": self.builds, "sizes_checked": self.sizes_checked,
                  "checks": [c.to_dict() for c in self.checks], "check_s": self.check_s,
                  "failing": self.failing.to_dict() if self.failing else None,
                  "reproduce": self.reproduce})
        return d

    @property
    def reproduce(self) -> str:
        return f"--dynamic {self.dynamic} --draws {self.draws} --seed {self.seed}"


class _SizeFailed(Exception):
    def __init__(self, check: ShapeCheck) -> None:
        super().__init__(str(check.sizes))
        self.check = check


def _ranges(dims: Sequence[DynamicDim], suite_ranges: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    out = {}
    for d in dims:
        lo, hi = suite_ranges.get(d.name, (1, d.upper or DEFAULT_DRAW_UPPER))
        if d.upper is not None:
            hi = min(hi, d.upper) if d.name in suite_ranges else d.upper
        out[d.name] = (lo, max(lo, hi))
    return out


def _load(source: Any, shapes: Any, options: CompileOptions, name: str | None,
          default_dim: int | None) -> tuple[LoadedModel, dict[str, tuple[int, int]], int | None]:
    suite_ranges: dict[str, tuple[int, int]] = {}
    seed = None
    if isinstance(source, SuiteSpec):
        from fuseguard.suites.models import get_model

        entry = get_model(source.name)
        names = [d.name for d in options.dynamic]
        unknown = [n for n in names if n not in entry.default_dims and n not in entry.dynamic_dims]
        if unknown:
            raise UsageError(f"{source.name}: --dynamic {unknown[0]}: the model's dims are "
                             f"{', '.join([*entry.default_dims, *entry.dynamic_dims]) or '(none)'}")
        name, seed = name or source.label, source.seed
        suite_ranges = {n: entry.dim_ranges[n] for n in names}
        source = relabel(source.build(), entry.dynamic_axes(names))
    loaded = load(source, shapes, name=name, default_dim=default_dim, dynamic=options.dynamic)
    return loaded, _ranges(options.dynamic, suite_ranges), seed


def verify_dynamic(source: str | bytes | onnx.ModelProto | SuiteSpec, *, options: CompileOptions,
                   draws: int | None = None, shapes: Mapping[str, Sequence[int]] | None = None,
                   seed: int | None = None, tolerances: Any = None,
                   per_output: Mapping[str, Tolerance] | None = None, name: str | None = None,
                   default_dim: int | None = None, inputs_file: str | None = None) -> DynamicVerdict:
    """Compile fused and unfused once each with `options.dynamic` symbolic; check `draws` drawn sizes."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hseed

    if not options.dynamic:
        raise UsageError("verify_dynamic needs --dynamic NAME")
    if inputs_file:
        raise UsageError("--inputs FILE.npz pins one shape; with --dynamic the inputs are drawn per size")
    from fuseguard.compiler.plugins import load_env_plugins
    from fuseguard.compiler.hw.target import cuda_device_present, resolve

    load_env_plugins()
    progress.stage("load")
    loaded, ranges, suite_seed = _load(source, shapes, options, name, default_dim)
    seed = (suite_seed or 0) if seed is None else seed
    draws = DEFAULT_DRAWS if draws is None else draws
    spec = resolve(options.gpu_arch, options.mcpu)
    skipped = NO_CUDA_DEVICE if spec.is_gpu and not cuda_device_present() else None
    fused, fused_model = build_and_run(loaded, options, options.config_label, {}, None, tolerances, per_output)
    unfused, unfused_model = build_and_run(loaded, options.unfused(), "unfused", {}, None, tolerances, per_output)
    verdict = DynamicVerdict(model=loaded.name, target=spec.label, nodes=loaded.num_nodes,
                             input_shapes=loaded.input_shapes, seed=seed, fused=fused, unfused=unfused,
                             skipped_run=skipped, warnings=list(loaded.warnings), dynamic=as_spec(options.dynamic),
                             ranges=ranges, draws=draws)
    if skipped or fused_model is None or unfused_model is None:
        return verdict
    axes = check_names(loaded.model, options.dynamic, loaded.name)
    session = _session(loaded)

    done: dict[tuple[tuple[str, int], ...], ShapeCheck] = {}

    def check_one(sizes: dict[str, int]) -> ShapeCheck:
        # Inputs are seeded per size, so a size drawn again (hypothesis repeats the edges: 100 draws of
        # bert_encoder were 73 distinct sizes) would compute exactly the same: reuse its result.
        key = tuple(sorted(sizes.items()))
        if key not in done:
            done[key] = _check_size(sizes)
        return done[key]

    def _check_size(sizes: dict[str, int]) -> ShapeCheck:
        result = ShapeCheck(sizes=dict(sizes))
        pinned = {k: list(v) for k, v in loaded.input_shapes.items()}
        for dim, where in axes.items():
            for inp, axis in where:
                pinned[inp][axis] = sizes[dim]
        try:
            inputs = make_inputs(loaded.model, {k: tuple(v) for k, v in pinned.items()}, seed=seed)
            names = [o.name for o in session.get_outputs()]
            reference = dict(zip(names, session.run(names, {i.name: inputs[i.name] for i in session.get_inputs()})))
        except Exception as err:  # noqa: BLE001 - ORT refusing a size is the model's limit, not a mismatch
            raise ModelError(f"{loaded.name}: ONNX Runtime cannot run it at {sizes}: {error_line(err)}") from err
        for which, compiled in (("fused", fused_model), ("unfused", unfused_model)):
            try:
                outputs = compiled.run(inputs)
            except Exception as err:  # noqa: BLE001 - a size the build cannot run fails that size
                result.error = f"{which} build at {sizes}: {error_line(err)}"
                return result
            setattr(result, which, compare_outputs(dict(zip(loaded.output_names, outputs)), reference,
                                                   tolerances=tolerances, per_output=per_output))
        return result

    checks: list[ShapeCheck] = []

    @settings(max_examples=draws, database=None, deadline=None, derandomize=False, verbosity=Verbosity.quiet,
              phases=(Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck),
              report_multiple_bugs=False)
    @hseed(seed)
    @given(sizes_strategy(ranges))
    def search(sizes: dict[str, int]) -> None:
        progress.stage(f"check {', '.join(f'{k}={v}' for k, v in sizes.items())} ({len(checks) + 1})")
        fresh = tuple(sorted(sizes.items())) not in done
        result = check_one(sizes)
        if fresh:
            checks.append(result)
        if not result.passed:
            raise _SizeFailed(result)

    start = time.perf_counter()
    try:
        search()
    except _SizeFailed as failed:
        verdict.failing = _smallest(failed.check, ranges, check_one, checks)
    verdict.check_s = time.perf_counter() - start
    verdict.checks = checks
    shown = verdict.failing or (checks[-1] if checks else None)
    if shown is not None:       # the table's error columns show the failing size (else the last one)
        fused.compare, unfused.compare = shown.fused, shown.unfused
        fused.ran = unfused.ran = True
    return verdict


def _smallest(failing: ShapeCheck, ranges: Mapping[str, tuple[int, int]], check: Any,
              log: list[ShapeCheck]) -> ShapeCheck:
    """Hypothesis shrinks a drawn integer well, but an edge drawn from a list only towards the list's head:
    finish per dim, trying the edges below the failing size (smallest first), then bisecting between the
    largest size known to pass and the smallest known to fail. The smallest failing size when failures
    are monotone in that interval, and always a failing size no larger than hypothesis found."""
    seen = {tuple(sorted(c.sizes.items())): c for c in log}

    def at(sizes: dict[str, int]) -> ShapeCheck:
        key = tuple(sorted(sizes.items()))
        if key not in seen:
            seen[key] = check(sizes)
            log.append(seen[key])
        return seen[key]

    best = failing
    for dim, (lo, _) in ranges.items():
        passing = lo - 1
        for size in edge_sizes(lo, best.sizes[dim] - 1) if best.sizes[dim] > lo else []:
            result = at({**best.sizes, dim: size})
            if not result.passed:
                best = result
                break
            passing = size
        fail = best.sizes[dim]
        while fail - passing > 1:
            mid = (passing + fail) // 2
            result = at({**best.sizes, dim: mid})
            if result.passed:
                passing = mid
            else:
                best, fail = result, mid
    return best


def _session(loaded: LoadedModel) -> Any:
    """One ONNX Runtime session for every size (graph optimisations off, as the static reference)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(loaded.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001
        raise ModelError(f"{loaded.name}: ONNX Runtime cannot load it with symbolic dims: {error_line(err)}") from err


def verify_dynamic_in_worker(source: Any, *, timeout: float | None = None, worker: Any = None,
                             **kwargs: Any) -> DynamicVerdict:
    """`verify_dynamic` in a worker subprocess (a crash fails this model only)."""
    from ..worker import get_worker

    worker = worker or get_worker()
    label = source.label if isinstance(source, SuiteSpec) else (kwargs.get("name") or str(source)[:80])
    return worker.call("fuseguard.verify.check.dynamic:verify_dynamic", what=f"verifying {label} at drawn sizes",
                       timeout=timeout, source=source, **kwargs)


__all__ = ["DynamicVerdict", "ShapeCheck", "edge_sizes", "size_strategy", "sizes_strategy", "verify_dynamic",
           "verify_dynamic_in_worker", "BuildResult"]
