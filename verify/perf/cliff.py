"""The performance cliff of a symbolic build: `fuseguard bench MODEL --dynamic seq --dim seq=16,64,128,384`.

Fused kernels are tiled for the shapes they were compiled at; a symbolic build runs one set of kernels at
every size (remainder paths, unknown trip counts, storage allocated per call). Per size this times the
dynamic build, a static build compiled for exactly that size, and ONNX Runtime (all optimisations, same
threads), interleaved in one process, and prints dynamic/static and static/ORT.

`--buckets seq=64,128,256,512` adds the usual alternative: a few static builds, each serving the sizes up to
its bucket, the input padded to it. A size is timed on the static build of the smallest bucket that holds it,
at the bucket's size: the cost of padding, against the dynamic build. (Whether padded positions change the
answer is the model's business: transformers mask them. Only the time is measured here.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fuseguard.compiler import progress
from fuseguard.compiler.cache import compile_cached
from fuseguard.compiler.dynamic import check_names, relabel
from fuseguard.compiler.errors import UsageError
from fuseguard.compiler.frontend.loader import load
from fuseguard.compiler.pipeline import CompileOptions
from fuseguard.compiler.plugins import load_env_plugins

from ..check.inputs import make_inputs
from .timing import measure_interleaved, ort_timing_options


@dataclass
class CliffRow:
    sizes: dict[str, int]
    dynamic_ms: float
    static_ms: float
    ort_ms: float
    static_compile_s: float
    bucket: dict[str, int] | None = None    # the sizes it was padded to (None: no --buckets, or none holds it)
    bucket_ms: float | None = None

    @property
    def bucket_vs_dynamic(self) -> float | None:
        return None if self.bucket_ms is None else self.bucket_ms / self.dynamic_ms

    @property
    def dynamic_vs_static(self) -> float:
        return self.dynamic_ms / self.static_ms

    @property
    def static_vs_ort(self) -> float:
        return self.static_ms / self.ort_ms


@dataclass
class CliffResult:
    model: str
    dynamic: str
    threads: int
    cpu: str
    dynamic_compile_s: float
    rows: list[CliffRow] = field(default_factory=list)
    buckets: dict[str, list[int]] = field(default_factory=dict)
    bucket_compile_s: float = 0.0       # the distinct bucket builds' compile time together

    @property
    def worst(self) -> float:
        return max((r.dynamic_vs_static for r in self.rows), default=float("nan"))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for row, out in zip(self.rows, d["rows"]):
            out.update(dynamic_vs_static=row.dynamic_vs_static, static_vs_ort=row.static_vs_ort,
                       dynamic_vs_ort=row.dynamic_ms / row.ort_ms, bucket_vs_dynamic=row.bucket_vs_dynamic)
        return d

    def render(self) -> Any:
        from rich.table import Table

        buckets = "; ".join(f"buckets {k}={','.join(map(str, v))}" for k, v in self.buckets.items())
        table = Table(title=f"dynamic vs static: {self.model}, --dynamic {self.dynamic} ({self.cpu}, {self.threads} "
                            f"threads; one symbolic build, {self.dynamic_compile_s:.1f} s"
                            + (f"; {buckets}: {self.bucket_compile_s:.1f} s of builds" if buckets else "") + ")")
        cols = ["sizes", "dynamic ms", "static ms", "ORT ms", "dynamic / static", "static / ORT", "static build s"]
        if self.buckets:
            cols += ["bucket", "bucketed ms", "bucketed / dynamic"]
        for col in cols:
            table.add_column(col, justify="left" if col == "sizes" else "right")
        for r in self.rows:
            cells = [", ".join(f"{k}={v}" for k, v in r.sizes.items()), f"{r.dynamic_ms:.3f}",
                     f"{r.static_ms:.3f}", f"{r.ort_ms:.3f}", f"{r.dynamic_vs_static:.2f}x",
                     f"{r.static_vs_ort:.2f}x", f"{r.static_compile_s:.1f}"]
            if self.buckets:
                cells += ([", ".join(f"{k}={v}" for k, v in r.bucket.items()), f"{r.bucket_ms:.3f}",
                           f"{r.bucket_vs_dynamic:.2f}x"]
                          if r.bucket_ms is not None else ["none holds it", "-", "-"])
            table.add_row(*cells)
        return table


def bucket_for(size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `size` (None: it is larger than every bucket)."""
    return min((b for b in buckets if b >= size), default=None)


def bench_cliff(source: Any, *, options: CompileOptions, sizes: Mapping[str, Sequence[int]], threads: int,
                repeats: int = 15, seed: int = 0, shapes: Mapping[str, Sequence[int]] | None = None,
                buckets: Mapping[str, Sequence[int]] | None = None) -> CliffResult:
    """One symbolic fused build against a static fused build per size (the sizes zipped: the i-th of each
    dim together, a dim given once applies to every row), ONNX Runtime, and with `buckets` the static
    build of the bucket each size pads to."""
    import onnxruntime as ort

    from fuseguard.compiler.hw.target import resolve

    from ..check.model import SuiteSpec

    load_env_plugins()
    names = [d.name for d in options.dynamic]
    if set(sizes) - set(names):
        raise UsageError(f"--dim {', '.join(sorted(set(sizes) - set(names)))}: not a --dynamic dim ({', '.join(names)})")
    rows = max((len(v) for v in sizes.values()), default=0)
    if not rows or any(len(v) not in (1, rows) for v in sizes.values()):
        raise UsageError("--dim NAME=A,B,...: give the sizes to time (each dim one size or the same number)")
    buckets = {k: sorted(set(v)) for k, v in (buckets or {}).items()}
    if set(buckets) - set(names):
        raise UsageError(f"--buckets {', '.join(sorted(set(buckets) - set(names)))}: not a --dynamic dim "
                         f"({', '.join(names)})")
    suite = None
    if isinstance(source, SuiteSpec):
        from fuseguard.suites.models import get_model

        suite, name = get_model(source.name), source.label
        model = relabel(source.build(), suite.dynamic_axes(names))
    else:
        model, name = source, None
    loaded = load(model, shapes, name=name, dynamic=options.dynamic)
    axes = check_names(loaded.model, options.dynamic, loaded.name)
    with progress.scope("compile dynamic"):
        dynamic = compile_cached(loaded, options)
    session = ort.InferenceSession(loaded.model.SerializeToString(), ort_timing_options(threads),
                                   providers=["CPUExecutionProvider"])
    result = CliffResult(model=loaded.name, dynamic=",".join(str(d) for d in options.dynamic), threads=threads,
                         cpu=resolve(options.gpu_arch, options.mcpu).label, dynamic_compile_s=dynamic.compile_s)
    result.buckets = {k: list(v) for k, v in buckets.items()}
    static_options = replace(options, dynamic=())
    built: dict[tuple[tuple[str, int], ...], Any] = {}
    bucket_builds: set[tuple[tuple[str, int], ...]] = set()

    def size_of(dim: str) -> int:
        inp, axis = axes[dim][0]
        return loaded.input_shapes[inp][axis]

    def pinned_at(at: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        pinned = {k: list(v) for k, v in loaded.input_shapes.items()}
        for dim, where in axes.items():
            for inp, axis in where:
                pinned[inp][axis] = at.get(dim, pinned[inp][axis])
        return {k: tuple(v) for k, v in pinned.items()}

    def static_build(at: dict[str, int]) -> Any:
        key = tuple(sorted(at.items()))
        if key in built:
            return built[key]
        if suite is not None and not all(n in suite.dynamic_dims for n in names):
            static_source = SuiteSpec(source.name, tuple(sorted({**dict(source.dims), **at}.items())),
                                      seed=source.seed).build()
            static_loaded = load(static_source, name=f"{loaded.name}@{at}")
        elif suite is not None:     # an export that names its dims: pin them
            static_loaded = load(source.build(), pinned_at(at), name=f"{loaded.name}@{at}")
        else:
            static_loaded = load(source, pinned_at(at), name=f"{loaded.name}@{at}")
        with progress.scope(f"compile static {at}"):
            built[key] = compile_cached(static_loaded, static_options)
        return built[key]

    for i in range(rows):
        at = {k: (v[i] if len(v) > 1 else v[0]) for k, v in sizes.items()}
        inputs = make_inputs(loaded.model, pinned_at(at), seed=seed)
        static = static_build(at)
        contenders = {"dynamic": dynamic.time_fn(inputs), "static": static.time_fn(inputs)}
        padded = {k: bucket_for(at.get(k, size_of(k)), v) for k, v in buckets.items()}
        if buckets and all(b is not None for b in padded.values()):
            bucket_at = {**at, **padded}
            key = tuple(sorted(bucket_at.items()))
            bucketed = static_build(bucket_at)
            if key not in bucket_builds:
                bucket_builds.add(key)
                result.bucket_compile_s += bucketed.compile_s
            contenders["bucket"] = bucketed.time_fn(make_inputs(loaded.model, pinned_at(bucket_at), seed=seed))
        feed = {i.name: inputs[i.name] for i in session.get_inputs()}
        contenders["ort"] = lambda: session.run(None, feed)
        progress.stage(f"timing {at}")
        samples = measure_interleaved(contenders, repeats=repeats, threads=threads)
        result.rows.append(CliffRow(sizes=at, dynamic_ms=samples["dynamic"].median_ms,
                                    static_ms=samples["static"].median_ms, ort_ms=samples["ort"].median_ms,
                                    static_compile_s=static.compile_s,
                                    bucket=padded if "bucket" in contenders else None,
                                    bucket_ms=samples["bucket"].median_ms if "bucket" in samples else None))
    return result
