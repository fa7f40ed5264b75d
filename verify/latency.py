"""Latency gating of one model against its per-architecture baseline.

The worker side (`measure_model`) compiles once, keeps the build, and times it interleaved with a
same-run reference: ONNX Runtime on the CPU with the same thread count, or on a GPU a fixed calibration
kernel on the same device. The parent side (`gate_model`) normalises by that reference, asks the gate
(verify/gate.py) for a verdict, samples more through the worker when the gate is unsure, and records the
run into `baselines/<arch>.json` when asked to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuseguard.compiler import settings
from fuseguard.compiler.pipeline import CompileOptions

from .timing import ForeignLoad, Samples, measure_interleaved, ort_timing_options

BASELINE_DIR = Path(__file__).resolve().parent.parent / "baselines"

#: Above this share of the machine used by other processes during a run, "slower" becomes "inconclusive".
BUSY_HOST = 0.10

# ------------------------------------------------------------------------------------------ worker side

_CACHE: dict[Any, Any] = {}


@dataclass
class LatencyRun:
    model: str
    shapes: dict[str, tuple[int, ...]]
    device: str
    threads: int
    reference_kind: str
    candidate: Samples
    reference: Samples
    foreign_load: float | None = None   # share of the machine others used while we measured
    model_sha256: str | None = None     # of the ONNX model as compiled (the baseline records it)


def _calibration_kernel(spec):
    """A fixed 1024x1024 matmul on the target device: a same-run yardstick where ORT cannot run."""
    import numpy as np
    import tvm
    from tvm import relax
    from tvm.script import relax as R

    @tvm.script.ir_module
    class Calibration:
        @R.function
        def main(a: R.Tensor((1024, 1024), "float32"), b: R.Tensor((1024, 1024), "float32")):
            return R.matmul(a, b)

    from fuseguard.compiler.pipeline import compile_relax

    build = compile_relax(Calibration, CompileOptions(gpu_arch=spec.arch if spec.is_gpu else None), name="calibration")
    rng = np.random.default_rng(0)
    data = {"a": rng.standard_normal((1024, 1024)).astype("float32"),
            "b": rng.standard_normal((1024, 1024)).astype("float32")}
    return build.time_fn(data)


def measure_model(source: Any, *, options: CompileOptions = CompileOptions(), shapes: Mapping[str, Sequence[int]] | None = None,
                  threads: int | None = None, repeats: int = 15, warmup: int = 3, seed: int = 0) -> LatencyRun:
    """Time the compiled model and its reference, interleaved (runs in a worker; builds are cached)."""
    import onnxruntime as ort

    from fuseguard.compiler.cache import compile_cached
    from fuseguard.compiler.onnx_loader import load
    from fuseguard.compiler.plugins import load_env_plugins
    from fuseguard.compiler.target import resolve

    from .core import SuiteSpec
    from .inputs import make_inputs

    load_env_plugins()
    key = (repr(source), repr(options), repr(shapes), threads, seed)
    if key not in _CACHE:
        label = source.name if isinstance(source, SuiteSpec) else None
        model = source.build() if isinstance(source, SuiteSpec) else source
        loaded = load(model, shapes, name=label)
        inputs = make_inputs(loaded.model, loaded.input_shapes, seed=seed)
        built = compile_cached(loaded, options)
        spec = resolve(options.gpu_arch, options.mcpu)
        threads = threads or settings.integer("TVM_NUM_THREADS") or spec.num_cores or 1
        if spec.is_gpu:
            reference, kind = _calibration_kernel(spec), "calibration-matmul-1024"
            device = _gpu_name()
        else:
            session = ort.InferenceSession(loaded.model.SerializeToString(), ort_timing_options(threads),
                                           providers=["CPUExecutionProvider"])
            feed = {i.name: inputs[i.name] for i in session.get_inputs()}
            reference, kind = (lambda: session.run(None, feed)), "onnxruntime-cpu"
            device = f"{spec.arch} x{threads}"
        _CACHE[key] = (loaded, built.time_fn(inputs), reference, kind, device, threads, spec)
    loaded, candidate, reference, kind, device, threads, spec = _CACHE[key]
    sync = (lambda: __import__("tvm").cuda(0).sync()) if spec.is_gpu else None
    with ForeignLoad() as load_meter:
        samples = measure_interleaved({"candidate": candidate, "reference": reference}, warmup=warmup,
                                      repeats=repeats, threads=threads, sync=sync)
    import hashlib

    return LatencyRun(model=loaded.name, shapes=dict(loaded.input_shapes), device=device, threads=threads,
                      reference_kind=kind, candidate=samples["candidate"], reference=samples["reference"],
                      foreign_load=load_meter.fraction,
                      model_sha256=hashlib.sha256(loaded.model.SerializeToString()).hexdigest())


def _gpu_name() -> str:
    import tvm

    try:
        return str(tvm.cuda(0).device_name)
    except Exception:  # noqa: BLE001 - a name for the baseline's metadata only
        return "cuda"


# ------------------------------------------------------------------------------------------ parent side

def baseline_path(options: CompileOptions, directory: Path = BASELINE_DIR) -> Path:
    """`baselines/sm_80.json` for a GPU arch, `baselines/cpu-<mcpu>-<N>c.json` for this CPU class."""
    from fuseguard.compiler.target import resolve

    from .baselines import cpu_class_id

    spec = resolve(options.gpu_arch, options.mcpu)
    name = spec.arch if spec.is_gpu else cpu_class_id(spec.arch, spec.num_cores or 1)
    return Path(directory) / f"{name}.json"


def entry_key(run: LatencyRun, options: CompileOptions) -> str:
    from .baselines import fusion_label, make_key

    return make_key(run.model, run.shapes, fusion_label(options.fusion, sorted(options.disabled_patterns)))


def gate_model(worker: Any, source: Any, *, options: CompileOptions, path: Path, update: bool = False,
               candidate_dir: Path | None = None, gate: Any = None, timeout: float | None = None,
               repeats: int = 15, what: str | None = None) -> tuple[Any, LatencyRun, str]:
    """Measure in `worker`, gate against `path`, record when updating. Returns (GateResult, run, key)."""
    from .baselines import Entry, Metadata, load_baselines, record
    from .gate import Gate, Measurement

    gate = gate or Gate()
    what = what or f"timing {getattr(source, 'label', source)}"

    def measure(n: int) -> LatencyRun:
        return worker.call("fuseguard.verify.latency:measure_model", what=what, timeout=timeout, source=source,
                           options=options, repeats=n, warmup=1)

    baselines = load_baselines(path)           # a corrupt file fails here, loudly, and is left untouched
    run = worker.call("fuseguard.verify.latency:measure_model", what=what, timeout=timeout, source=source, options=options,
                      repeats=repeats)
    key = entry_key(run, options)
    measurement = Measurement.of(run.candidate, run.reference, run.reference_kind)

    loads: list[float] = [run.foreign_load] if run.foreign_load is not None else []

    def more_tracked(n: int) -> Measurement:
        extra = measure(max(n, 3))
        if extra.foreign_load is not None:
            loads.append(extra.foreign_load)
        return Measurement.of(extra.candidate, extra.reference, extra.reference_kind)

    entry = baselines.lookup(key)
    stored = entry.metadata.model_sha256 if entry is not None else None
    if stored and run.model_sha256 and stored != run.model_sha256 and not update:
        # Same name, shapes and fusion, different model: gating it against the other model's latency
        # would be silently wrong either way.
        from .gate import GateResult, Verdict

        result = GateResult(run.model, Verdict.NO_BASELINE, None, None, None, len(measurement.samples_ms), 0,
                            gate.policy_for(key).factor, gate.policy_for(key).confidence, normalised=False,
                            note=f"model changed since the baseline (sha256 {stored[:12]} recorded, "
                                 f"{run.model_sha256[:12]} now): re-record it with --update-baselines")
        return result, run, key
    result = gate.check(key, measurement, baselines, more=more_tracked, name=run.model)
    if result.regressed:
        # Confirm in a fresh process. Timings within one process share its memory placement and thread
        # layout, so its samples agree with each other more than runs of different processes do: an
        # unchanged ResNet-50 measured 1.12x "slower" (p=3e-32) in one worker and 1.01x in the next. A real
        # regression reproduces in every process.
        from dataclasses import replace

        from .gate import Verdict

        worker.close()
        again = measure(repeats)
        if again.foreign_load is not None:
            loads.append(again.foreign_load)
        second = gate.check(key, Measurement.of(again.candidate, again.reference, again.reference_kind), baselines,
                            more=more_tracked, name=run.model)
        if second.regressed:
            result = replace(second, note="; ".join(x for x in ("confirmed in a fresh process", second.note) if x))
        else:
            result = replace(result, verdict=Verdict.INCONCLUSIVE,
                             note=f"did not reproduce in a fresh process ({second.verdict.value} "
                                  f"{second.ratio:.2f}x)" if second.ratio is not None else
                                  "did not reproduce in a fresh process")
    busiest = max(loads, default=0.0)
    if result.regressed and busiest > BUSY_HOST:
        from dataclasses import replace

        from .gate import Verdict

        result = replace(result, verdict=Verdict.INCONCLUSIVE,
                         note=f"host busy: other processes used {busiest:.0%} of the CPUs while measuring; "
                              f"{result.note}".rstrip("; "))
    if update or candidate_dir is not None:
        meta = Metadata.collect(run.device, threads=run.threads, reference_kind=run.reference_kind,
                                model_sha256=run.model_sha256)
        entry = Entry.from_samples(run.candidate, meta, reference_ms=run.reference)
        if update:
            record(path, key, entry)
        if candidate_dir is not None:
            record(Path(candidate_dir) / path.name, key, entry)
    return result, run, key
