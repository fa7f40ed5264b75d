"""fuseguard's pytest plugin: options, markers and fixtures in one place.

    pytest                               the suites on this CPU
    pytest --gpu-arch=sm_80              compile every suite model for sm_80; run it where a GPU is present
    pytest --no-fusion                   the "fused" side built with every fusion off
    pytest --disable-pattern NAME        one pattern off (repeatable)
    pytest --fuseguard-plugin MODULE     import a module that registers patterns or passes
    pytest --baseline-rev origin/main    latency gated A/B against that revision's compiler (any machine)

Each model is compiled and run in a reusable worker subprocess (one per xdist worker), so a native
crash or hang in TVM fails that one test with "crashed (SIGSEGV) while ..." and the session goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fuseguard.compiler.paths import PROJECT_ROOT


def _settings() -> Any:
    from fuseguard.compiler import settings   # imported when pytest asks, not when it loads the plugin

    return settings


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fuseguard")
    from .options import PYTEST_PREFIX, add_build_options

    # The same definitions as the CLI's (verify/options.py); --plugin and --timeout are spelled
    # --fuseguard-plugin and --fuseguard-timeout here.
    add_build_options(group.addoption, PYTEST_PREFIX, debug=False)
    from .options import add_dynamic_options

    # --dynamic/--draws reach the symbolic-shape suite (suites/test_dynamic_suite.py) only: every other
    # test builds static shapes, as before
    add_dynamic_options(group.addoption, PYTEST_PREFIX)
    group.addoption("--update-baselines", action="store_true", default=False,
                    help="record this run's latencies into baselines/<arch>.json (locked, atomic)")
    group.addoption("--strict-baselines", action="store_true", default=False,
                    help="a model with no baseline fails instead of being reported as 'no baseline'")
    group.addoption("--baseline-dir", default=None, metavar="DIR",
                    help="where the per-architecture baseline files live (default: the repo's baselines/)")
    group.addoption("--baseline-candidate", default=None, metavar="DIR",
                    help="also write this run's entries to DIR/<arch>.json (a candidate baseline, e.g. for CI "
                         "artifacts)")
    group.addoption("--baseline-rev", default=_settings().get("FUSEGUARD_BASELINE_REV"), metavar="REV",
                    help="gate latency A/B against this revision's compiler, same run, instead of the stored "
                         "baselines (works on any machine class; env FUSEGUARD_BASELINE_REV)")
    group.addoption("--gate-config", default=None, metavar="FILE.json",
                    help='per-model gate overrides, e.g. {"resnet50": {"factor": 1.2}} '
                         "(default: gate.json in the baseline directory, when present)")
    group.addoption("--conformance-full", action="store_true", default=False,
                    help="run all 1884 ONNX node conformance cases (default: one case per operator)")
    group.addoption("--sass-full", action="store_true", default=False,
                    help="compile every suite and real model to SASS for sm_80 and sm_90 (default: the built-in "
                         "models on both and three real models on one each)")
    group.addoption("--models-full", action="store_true", default=False,
                    help="also verify and time the largest real models (DenseNet-121, Inception v2, AlexNet, "
                         "ViT-B/16, EfficientNet-B0; default: a representative sample of each family)")
    group.addoption("--fuseguard-examples", type=int, default=None, metavar="N",
                    help="hypothesis examples per suite model (default: each suite's own setting)")


def pytest_configure(config: pytest.Config) -> None:
    from .options import PYTEST_PREFIX, apply_cache_options, getter

    apply_cache_options(getter(config=config, prefix=PYTEST_PREFIX))
    config.addinivalue_line("markers", "gpu: needs a CUDA device to run (compiles anywhere)")
    config.addinivalue_line("markers", "slow: a large real model")
    for marker, (option, what) in OPT_IN.items():
        config.addinivalue_line("markers", f"{marker}: {what}; deselected unless {option} (nightly)")
    from fuseguard.compiler.plugins import load_plugins

    load_plugins(config.getoption("--fuseguard-plugin") or [])


#: Opt-in heavy suites: marker -> (the option that selects them, what they are).
OPT_IN = {
    "conformance_full": ("--conformance-full", "all 1884 ONNX node cases"),
    "sass_full": ("--sass-full", "every suite model compiled to SASS for sm_80 and sm_90"),
    "models_full": ("--models-full", "the largest real models, verified and timed"),
}


def model_marks(model: Any) -> list:
    """A suite model's pytest marks: `slow` for a large real model, `models_full` for one the default run leaves
    to `--models-full` (suites/models.py: FULL_RUN_ONLY)."""
    from fuseguard.suites.models import full_run_only

    return ([pytest.mark.slow] if model.slow else []) + ([pytest.mark.models_full] if full_run_only(model.name) else [])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Opt-in suites are deselected, not skipped, unless asked for (`--conformance-full`, `--sass-full`,
    `--models-full`)."""
    off = {m for m, (option, _) in OPT_IN.items() if not config.getoption(option)}
    drop = [item for item in items if any(item.get_closest_marker(m) for m in off)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        keep = set(map(id, drop))
        items[:] = [item for item in items if id(item) not in keep]


def pytest_report_header(config: pytest.Config) -> list[str]:
    from fuseguard.compiler.hw.target import cuda_device_present, resolve

    spec = resolve(config.getoption("--gpu-arch"))
    device = "CUDA device present" if cuda_device_present() else "no CUDA device"
    return [f"fuseguard: target {spec.label}, {device}, fusion "
            f"{'off' if config.getoption('--no-fusion') else 'on'}"
            + (f", disabled patterns: {', '.join(config.getoption('--disable-pattern'))}"
               if config.getoption("--disable-pattern") else "")]


@pytest.fixture(scope="session")
def gpu_arch(request: pytest.FixtureRequest) -> str | None:
    return request.config.getoption("--gpu-arch")


@pytest.fixture(scope="session")
def compile_options(request: pytest.FixtureRequest):
    """The CompileOptions the command line asks for (the 'fused' side of every comparison), static shapes
    (`--dynamic` goes to the `verify_dynamic` fixture)."""
    from dataclasses import replace

    from .options import PYTEST_PREFIX, compile_options, getter

    return replace(compile_options(getter(config=request.config, prefix=PYTEST_PREFIX)), dynamic=())


@pytest.fixture(scope="session")
def fuseguard_worker(request: pytest.FixtureRequest) -> Iterator[Any]:
    """One reusable worker subprocess per pytest (or xdist worker) process."""
    from .worker import Worker

    from fuseguard.compiler.plugins import env_for

    from .perf.timing import timing_env

    env = {**env_for(request.config.getoption("--fuseguard-plugin") or []), **timing_env()}
    worker = Worker(sys_path=[str(PROJECT_ROOT)], env=env)
    yield worker
    worker.close()


@pytest.fixture
def verify_model(request: pytest.FixtureRequest, fuseguard_worker: Any, compile_options: Any):
    """verify_model(source, **kwargs) -> ModelVerdict, in the worker; a crash or hang fails this test only."""
    from .check.model import verify_in_worker
    from .worker import WorkerFailure

    timeout = request.config.getoption("--fuseguard-timeout")

    def run(source: Any, **kwargs: Any):
        kwargs.setdefault("options", compile_options)
        try:
            return verify_in_worker(source, timeout=timeout, worker=fuseguard_worker, **kwargs)
        except WorkerFailure as err:
            pytest.fail(str(err), pytrace=False)

    return run


@pytest.fixture
def verify_dynamic(request: pytest.FixtureRequest, fuseguard_worker: Any, compile_options: Any):
    """verify_dynamic(source, dims, draws=None) -> DynamicVerdict, in the worker: `dims` ("seq" or
    "batch,seq<=64") unless the command line gave --dynamic, `draws` unless it gave --draws."""
    from dataclasses import replace

    from fuseguard.compiler.dynamic import parse_dynamic

    from .check.dynamic import verify_dynamic_in_worker
    from .options import PYTEST_PREFIX, compile_options as parsed, getter
    from .worker import WorkerFailure

    get = getter(config=request.config, prefix=PYTEST_PREFIX)
    timeout = request.config.getoption("--fuseguard-timeout")

    def run(source: Any, dims: str, draws: int | None = None, **kwargs: Any):
        asked = parsed(get).dynamic
        options = replace(compile_options, dynamic=asked or parse_dynamic(dims))
        try:
            return verify_dynamic_in_worker(source, timeout=timeout, worker=fuseguard_worker, options=options,
                                            draws=get("draws") or draws, **kwargs)
        except WorkerFailure as err:
            pytest.fail(str(err), pytrace=False)

    return run


@pytest.fixture(scope="session")
def latency_gate(request: pytest.FixtureRequest, fuseguard_worker: Any, compile_options: Any, gpu_arch: str | None):
    """gate(source) -> GateResult: time a model against its baseline; fails the test on a real slowdown."""
    import warnings

    from fuseguard.compiler.hw.target import cuda_device_present

    from .perf.gate import Gate, Verdict
    from .perf.latency import BASELINE_DIR, baseline_path, gate_model
    from .worker import WorkerFailure

    cfg = request.config
    directory = Path(cfg.getoption("--baseline-dir") or BASELINE_DIR)
    path = baseline_path(compile_options, directory)
    from .perf.gate import load_gate_config

    gate = Gate.from_config(load_gate_config(cfg.getoption("--gate-config"), directory))
    candidate = cfg.getoption("--baseline-candidate")
    rev = cfg.getoption("--baseline-rev")
    ab_run = _ab_gate(rev, compile_options, gate, cfg) if rev else None
    told: list[bool] = []

    def run(source: Any):
        if gpu_arch and not cuda_device_present():
            pytest.skip(f"no CUDA device: latency of {getattr(source, 'name', source)} on {gpu_arch} needs a GPU")
        if ab_run is not None:
            result = ab_run(source)
            print(result.line())
            if result.error:
                pytest.fail(f"A/B gate: {result.line()}", pytrace=False)
            if result.regressed:
                pytest.fail(f"latency regression against {rev}: {result.line()}", pytrace=False)
            if result.resource_regressions():
                pytest.fail(f"compile-time or memory regression against {rev}: {result.line()}", pytrace=False)
            return result
        if not path.exists() and not cfg.getoption("--update-baselines") and not told:
            told.append(True)
            warnings.warn(f"no latency baselines for this machine class ({path.name} is missing in {directory}): "
                          f"the stored-baseline gate is blind here. Gate against a revision instead with "
                          f"pytest --baseline-rev REV (e.g. origin/main), or record with --update-baselines",
                          stacklevel=2)
        try:
            result, measured, key = gate_model(fuseguard_worker, source, options=compile_options, path=path,
                                               update=cfg.getoption("--update-baselines"),
                                               candidate_dir=Path(candidate) if candidate else None, gate=gate,
                                               timeout=cfg.getoption("--fuseguard-timeout"))
        except WorkerFailure as err:
            pytest.fail(str(err), pytrace=False)
        load = f", other processes used {measured.foreign_load:.0%} of the CPUs" \
            if measured.foreign_load is not None else ""
        line = f"{result.line()} [{path.name}: {key}{load}]"
        print(line)
        if result.verdict is Verdict.NO_BASELINE and not cfg.getoption("--update-baselines"):
            if cfg.getoption("--strict-baselines"):
                pytest.fail(f"no baseline: {line} (record one with pytest --update-baselines)", pytrace=False)
            if "changed since the baseline" in result.note:       # another model or build under this key
                pytest.skip(f"{key} in {path}: {result.note}")
            pytest.skip(f"no baseline for {key} in {path} (record one with pytest --update-baselines)")
        if result.regressed and not cfg.getoption("--update-baselines"):
            pytest.fail(f"latency regression: {line}", pytrace=False)
        if result.verdict is Verdict.FASTER:
            warnings.warn(f"faster than baseline: {line}; consider pytest --update-baselines", stacklevel=2)
        return result

    return run


def _ab_gate(rev: str, compile_options: Any, gate: Any, cfg: pytest.Config):
    """source -> ABResult against `rev`'s compiler (verify/perf/ab.py); the base tree is materialised once."""
    import tempfile

    from fuseguard.compiler.plugins import env_for
    from fuseguard.compiler.hw.target import host_cores

    from .perf import ab
    from .perf.timing import timing_env

    commit = ab.resolve_commit(rev)
    base_tree = ab.materialize(commit)
    threads = host_cores()
    env = {**env_for(cfg.getoption("--fuseguard-plugin") or []), **timing_env(threads)}
    workdir = Path(tempfile.mkdtemp(prefix="fuseguard-ab-"))
    count = [0]

    def run(source: Any):
        count[0] += 1
        key = getattr(source, "label", str(source))
        return ab.ab_model(source, base_tree, ab.PROJECT_ROOT, base_commit=commit, workdir=workdir / str(count[0]),
                           options=compile_options.to_dict(), threads=threads,
                           policy=gate.policy_for(key), timeout=cfg.getoption("--fuseguard-timeout"), env=env)

    return run


@pytest.fixture(scope="session")
def fusion_pays(request: pytest.FixtureRequest, fuseguard_worker: Any, compile_options: Any, gpu_arch: str | None):
    """check(source) -> PaysResult: fused vs unfused of the same model, same run, fresh processes; fails the
    test when fusion makes the model slower beyond 5% (verify/perf/pays.py). Needs no stored baseline."""
    from fuseguard.compiler.plugins import env_for
    from fuseguard.compiler.hw.target import cuda_device_present, host_cores

    from .perf.pays import check_fusion_pays
    from .perf.timing import timing_env
    from .worker import WorkerFailure

    cfg = request.config
    threads = host_cores()
    env = {**env_for(cfg.getoption("--fuseguard-plugin") or []), **timing_env(threads, against_ort=False)}

    def run(source: Any):
        if gpu_arch and not cuda_device_present():
            pytest.skip(f"no CUDA device: fused vs unfused latency on {gpu_arch} needs a GPU")
        if not compile_options.fusion:
            pytest.skip("--no-fusion: there is no fused build to compare")
        try:
            result = check_fusion_pays(fuseguard_worker, source, options=compile_options, threads=threads, env=env,
                                       timeout=cfg.getoption("--fuseguard-timeout"))
        except WorkerFailure as err:
            pytest.fail(str(err), pytrace=False)
        print(result.line())
        if not result:
            pytest.fail(f"fusion makes it slower: {result.line()}", pytrace=False)
        return result

    return run


def skip_without_cuda_run(verdict: Any) -> None:
    """Compiled for a GPU on a machine without one: the compile was checked, the run is skipped."""
    from .check.model import NO_CUDA_DEVICE

    if verdict.skipped_run == NO_CUDA_DEVICE:
        pytest.skip(f"{NO_CUDA_DEVICE}: {verdict.model} compiled for {verdict.target}, device run skipped")
