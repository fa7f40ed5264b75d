"""The performance cliff of a symbolic build: `fuseguard bench MODEL --dynamic seq --dim seq=16,64,128,384`.

Fused kernels are tiled for the shapes they were compiled at; a symbolic build runs one set of kernels at
every size (remainder paths, unknown trip counts, storage allocated per call). Per size this times the
dynamic build, a static build compiled for exactly that size, and ONNX Runtime (all optimisations, same
threads), interleaved in one process, and prints dynamic/static and static/ORT.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from compiler import progress
from compiler.cache import compile_cached
from compiler.dynamic import check_names, relabel
from compiler.errors import UsageError
from compiler.onnx_loader import load
from compiler.pipeline import CompileOptions
from compiler.plugins import load_env_plugins

from .inputs import make_inputs
from .timing import measure_interleaved, ort_timing_options


@dataclass
class CliffRow:
    sizes: dict[str, int]
    dynamic_ms: float
    static_ms: float
    ort_ms: float
    static_compile_s: float

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

    @property
    def worst(self) -> float:
        return max((r.dynamic_vs_static for r in self.rows), default=float("nan"))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for row, out in zip(self.rows, d["rows"]):
            out.update(dynamic_vs_static=row.dynamic_vs_static, static_vs_ort=row.static_vs_ort,
                       dynamic_vs_ort=row.dynamic_ms / row.ort_ms)
        return d

    def render(self) -> Any:
        from rich.table import Table

        table = Table(title=f"dynamic vs static: {self.model}, --dynamic {self.dynamic} ({self.cpu}, {self.threads} "
                            f"threads; one symbolic build, {self.dynamic_compile_s:.1f} s)")
        for col in ("sizes", "dynamic ms", "static ms", "ORT ms", "dynamic / static", "static / ORT",
                    "static build s"):
            table.add_column(col, justify="left" if col == "sizes" else "right")
        for r in self.rows:
            table.add_row(", ".join(f"{k}={v}" for k, v in r.sizes.items()), f"{r.dynamic_ms:.3f}",
                          f"{r.static_ms:.3f}", f"{r.ort_ms:.3f}", f"{r.dynamic_vs_static:.2f}x",
                          f"{r.static_vs_ort:.2f}x", f"{r.static_compile_s:.1f}")
        return table


def bench_cliff(source: Any, *, options: CompileOptions, sizes: Mapping[str, Sequence[int]], threads: int,
                repeats: int = 15, seed: int = 0, shapes: Mapping[str, Sequence[int]] | None = None) -> CliffResult:
    """One symbolic fused build against a static fused build per size (the sizes zipped: the i-th of each
    dim together, a dim given once applies to every row) and ONNX Runtime."""
    import onnxruntime as ort

    from compiler.target import resolve

    from .core import SuiteSpec

    load_env_plugins()
    names = [d.name for d in options.dynamic]
    if set(sizes) - set(names):
        raise UsageError(f"--dim {', '.join(sorted(set(sizes) - set(names)))}: not a --dynamic dim ({', '.join(names)})")
    rows = max((len(v) for v in sizes.values()), default=0)
    if not rows or any(len(v) not in (1, rows) for v in sizes.values()):
        raise UsageError("--dim NAME=A,B,...: give the sizes to time (each dim one size or the same number)")
    suite = None
    if isinstance(source, SuiteSpec):
        from suites.models import get_model

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
    static_options = replace(options, dynamic=())
    for i in range(rows):
        at = {k: (v[i] if len(v) > 1 else v[0]) for k, v in sizes.items()}
        pinned = {k: list(v) for k, v in loaded.input_shapes.items()}
        for dim, where in axes.items():
            for inp, axis in where:
                pinned[inp][axis] = at.get(dim, pinned[inp][axis])
        inputs = make_inputs(loaded.model, {k: tuple(v) for k, v in pinned.items()}, seed=seed)
        if suite is not None and not all(n in suite.dynamic_dims for n in names):
            static_source = SuiteSpec(source.name, tuple(sorted({**dict(source.dims), **at}.items())),
                                      seed=source.seed).build()
            static_loaded = load(static_source, name=f"{loaded.name}@{at}")
        elif suite is not None:     # an export that names its dims: pin them
            static_loaded = load(source.build(), {k: tuple(v) for k, v in pinned.items()}, name=f"{loaded.name}@{at}")
        else:
            static_loaded = load(source, {k: tuple(v) for k, v in pinned.items()}, name=f"{loaded.name}@{at}")
        with progress.scope(f"compile static {at}"):
            static = compile_cached(static_loaded, static_options)
        feed = {i.name: inputs[i.name] for i in session.get_inputs()}
        progress.stage(f"timing {at}")
        samples = measure_interleaved({"dynamic": dynamic.time_fn(inputs), "static": static.time_fn(inputs),
                                       "ort": lambda: session.run(None, feed)}, repeats=repeats, threads=threads)
        result.rows.append(CliffRow(sizes=at, dynamic_ms=samples["dynamic"].median_ms,
                                    static_ms=samples["static"].median_ms, ort_ms=samples["ort"].median_ms,
                                    static_compile_s=static.compile_s))
    return result
