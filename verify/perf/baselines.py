"""Per-architecture latency baselines: one JSON file per GPU arch or CPU class, raw samples kept.

Why one file per architecture: an sm_80 number says nothing about sm_90, and CI machines of one class
can share a file without merge conflicts across classes. Why raw samples: a regression gate that only
stores a median (pytest-benchmark's ``--benchmark-compare-fail``) can apply a threshold but no
statistical test; keeping up to MAX_SAMPLES samples lets verify.perf.gate run Mann-Whitney/KS against them.
Why a reference median: the same-run ONNX Runtime (or calibration kernel) latency turns absolute
milliseconds into a ratio that survives a slower CI host or a noisy neighbour.

The schema is documented, with an example, in baselines/README.md. Writes go through
verify.atomic.update_json (lock + validate + atomic replace), so concurrent recorders lose nothing and
a corrupt file is reported, never overwritten.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import platform
import re
import statistics
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from fuseguard.compiler.errors import BaselineError, UsageError
from fuseguard.verify.atomic import PathLike, atomic_write_json, read_json_document, update_json
from fuseguard.verify.perf.timing import Samples

SCHEMA_VERSION = 1
MAX_SAMPLES = 50
"""Samples kept per entry: enough for MWU/KS to resolve a 1-IQR shift (Pinpoint: ~35), small enough to review."""

_ARCH_RE = re.compile(r"^(sm_\d{2,3}[a-z]?|cpu-[a-z0-9][a-z0-9_.+]*(-[a-z0-9_.+]+)*-\d+c)$")
_MCPU_RE = re.compile(r"^[a-z0-9][a-z0-9_.+-]*$")
_HEX_RE = re.compile(r"^[0-9a-f]{7,40}$")
_PYTEST_BENCHMARK_FORMAT = "5.2.3"
"""pytest-benchmark release whose JSON layout to_pytest_benchmark() writes when that package is absent."""

_TOP_FIELDS = {"schema_version", "arch", "entries"}
_ENTRY_FIELDS = {"median_ms", "iqr_ms", "n", "samples_ms", "reference_median_ms", "reference_samples_ms",
                 "normalised", "metadata"}
_ENTRY_REQUIRED = _ENTRY_FIELDS - {"reference_samples_ms"}
_META_FIELDS = {"device", "driver", "cuda", "tvm_version", "fuseguard_version", "git_commit", "date", "threads",
                "reference_kind"}
#: Metadata fields later schema revisions added: optional, so older files stay valid.
_META_OPTIONAL = {"model_sha256", "options_sha256", "processes"}


# ----------------------------------------------------------------------------------------------- naming

def cpu_class_id(mcpu: str, cores: int) -> str:
    """Baseline file stem for a CPU run, e.g. ``cpu-znver1-2c``: LLVM's -mcpu name plus usable cores."""
    name = mcpu.strip().lower()
    if not _MCPU_RE.match(name):
        raise UsageError(f"cpu_class_id: mcpu must be an LLVM CPU name like 'znver4' or 'skylake-avx512', "
                         f"got {mcpu!r}")
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise UsageError(f"cpu_class_id: cores must be a positive integer, got {cores!r}")
    return f"cpu-{name}-{cores}c"


def host_cpu_class() -> str:
    """This machine's CPU class: LLVM's host CPU name (via TVM) and the cores this process may use."""
    from fuseguard.compiler.hw.hostcpu import llvm_host_name, usable_cores  # lazily: TVM takes most of a second to load

    return cpu_class_id(llvm_host_name(), usable_cores())


def fusion_label(enabled: bool = True, disabled: Iterable[str] = ()) -> str:
    """The fusion-config part of a key: ``fused``, ``unfused`` or ``fused-no:a+b`` (patterns sorted)."""
    if not enabled:
        return "unfused"
    names = sorted(set(disabled))
    for name in names:
        if not name or any(c in name for c in "|+, "):
            raise UsageError(f"fusion pattern name must be non-empty without '|', '+', ',' or spaces, got {name!r}")
    return "fused" if not names else "fused-no:" + "+".join(names)


def make_key(model: str, shapes: Mapping[str, Sequence[int]], fusion: str) -> str:
    """Entry key ``model|in1=1x3x224x224,in2=scalar|fusion``; inputs sorted so dict order does not matter."""
    if not model or "|" in model:
        raise UsageError(f"model name must be non-empty and contain no '|', got {model!r}")
    if not fusion or "|" in fusion:
        raise UsageError(f"fusion config must be non-empty and contain no '|', got {fusion!r}")
    parts = []
    for name in sorted(shapes):
        if not name or any(c in name for c in "|,="):
            raise UsageError(f"input name must be non-empty without '|', ',' or '=', got {name!r} (model {model})")
        dims = list(shapes[name])
        if any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0 for d in dims):
            raise UsageError(f"input {name!r} of {model}: shape must be concrete non-negative ints, got {dims}")
        parts.append(f"{name}=" + ("x".join(str(int(d)) for d in dims) if dims else "scalar"))
    return f"{model}|{','.join(parts) or '-'}|{fusion}"


def model_of(key: str) -> str:
    """The model-name part of a key (what per-model gate overrides match)."""
    return key.split("|", 1)[0]


# ----------------------------------------------------------------------------------------------- entries

def git_commit() -> str | None:
    """This checkout's HEAD commit, or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out if _HEX_RE.match(out) else None


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class Metadata:
    """Where and how an entry was measured: enough to tell a real regression from a changed environment."""

    device: str
    tvm_version: str
    fuseguard_version: str
    date: str
    driver: str | None = None
    cuda: str | None = None
    git_commit: str | None = None
    threads: int | None = None
    reference_kind: str | None = None
    #: the measured model's bytes (ONNX, as compiled): a different model under the same key is caught
    model_sha256: str | None = None
    #: the build options (`verify.perf.latency.options_digest`): a build with other options is caught too
    options_sha256: str | None = None
    #: fresh processes the samples were pooled from, each normalised by its own reference (verify.perf.latency)
    processes: int | None = None

    @classmethod
    def collect(cls, device: str, *, threads: int | None, reference_kind: str | None,
                driver: str | None = None, cuda: str | None = None, model_sha256: str | None = None,
                options_sha256: str | None = None, processes: int | None = None) -> Metadata:
        """Metadata for a measurement made now, in this checkout, with the installed TVM and fuseguard."""
        return cls(device=device, driver=driver, cuda=cuda, tvm_version=_dist_version("apache-tvm"),
                   fuseguard_version=_dist_version("fuseguard"), git_commit=git_commit(),
                   date=datetime.now(timezone.utc).isoformat(timespec="seconds"), threads=threads,
                   reference_kind=reference_kind, model_sha256=model_sha256, options_sha256=options_sha256,
                   processes=processes)

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in sorted(_META_FIELDS)}
        out.update({name: getattr(self, name) for name in sorted(_META_OPTIONAL) if getattr(self, name) is not None})
        return out


def _keep(samples: Sequence[float], cap: int = MAX_SAMPLES) -> tuple[float, ...]:
    """At most ``cap`` real samples, chosen evenly across the sorted run so the distribution's shape survives."""
    values = [float(v) for v in samples]
    if len(values) <= cap:
        return tuple(values)
    ordered = sorted(values)
    picks = np.unique(np.round(np.linspace(0, len(ordered) - 1, cap)).astype(int))
    return tuple(ordered[i] for i in picks)


@dataclass(frozen=True)
class Entry:
    """One model x shapes x fusion-config measurement on one architecture."""

    median_ms: float
    iqr_ms: float
    n: int
    samples_ms: tuple[float, ...]
    reference_median_ms: float | None
    normalised: float | None
    metadata: Metadata
    reference_samples_ms: tuple[float, ...] | None = None

    @classmethod
    def from_samples(cls, samples_ms: Samples | Sequence[float], metadata: Metadata, *,
                     reference_ms: Samples | Sequence[float] | float | None = None) -> Entry:
        """Summarise a run; ``reference_ms`` is the same-run reference (its samples, or just its median).

        Given timing.Samples, their ``usable_ms`` are kept: the unpreempted samples when there are enough,
        so a baseline recorded on a busy host is not inflated by other processes' time slices.
        """
        if isinstance(samples_ms, Samples):
            samples_ms = samples_ms.usable_ms.tolist()
        if isinstance(reference_ms, Samples):
            reference_ms = reference_ms.usable_ms.tolist()
        values = np.asarray(samples_ms, dtype=float)
        if values.size == 0 or not np.all(np.isfinite(values)) or np.any(values <= 0):
            raise UsageError(f"baseline samples must be a non-empty list of positive times, got {list(samples_ms)[:5]}")
        median = float(np.median(values))
        q1, q3 = np.percentile(values, [25, 75])
        ref_samples: tuple[float, ...] | None = None
        ref_median: float | None = None
        if reference_ms is not None:
            if isinstance(reference_ms, (int, float)):
                ref_median = float(reference_ms)
            else:
                ref_samples = _keep(reference_ms)
                ref_median = float(np.median(np.asarray(reference_ms, dtype=float)))
            if not (math.isfinite(ref_median) and ref_median > 0):
                raise UsageError(f"reference median must be a positive time, got {ref_median}")
        if (ref_median is None) != (metadata.reference_kind is None):
            raise UsageError("metadata.reference_kind must be set exactly when a reference was measured")
        return cls(median_ms=median, iqr_ms=float(q3 - q1), n=int(values.size), samples_ms=_keep(values.tolist()),
                   reference_median_ms=ref_median, normalised=None if ref_median is None else median / ref_median,
                   metadata=metadata, reference_samples_ms=ref_samples)

    def normalised_samples(self) -> np.ndarray | None:
        """Samples divided by the same-run reference median, or None without a reference."""
        if self.reference_median_ms is None:
            return None
        return np.asarray(self.samples_ms) / self.reference_median_ms

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "median_ms": self.median_ms, "iqr_ms": self.iqr_ms, "n": self.n, "samples_ms": list(self.samples_ms),
            "reference_median_ms": self.reference_median_ms, "normalised": self.normalised,
            "metadata": self.metadata.to_dict(),
        }
        if self.reference_samples_ms is not None:
            out["reference_samples_ms"] = list(self.reference_samples_ms)
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Entry:
        """Build from an already validated entry object."""
        ref = raw.get("reference_samples_ms")
        return cls(median_ms=float(raw["median_ms"]), iqr_ms=float(raw["iqr_ms"]), n=int(raw["n"]),
                   samples_ms=tuple(float(v) for v in raw["samples_ms"]),
                   reference_median_ms=None if raw["reference_median_ms"] is None
                   else float(raw["reference_median_ms"]),
                   normalised=None if raw["normalised"] is None else float(raw["normalised"]),
                   metadata=Metadata(**{k: raw["metadata"].get(k) for k in _META_FIELDS | _META_OPTIONAL}),
                   reference_samples_ms=None if ref is None else tuple(float(v) for v in ref))


# ----------------------------------------------------------------------------------------------- validation

def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_entry(key: Any, entry: Any, problems: list[str], where: str) -> None:
    at = f"{where}: entry {key!r}"
    if not isinstance(key, str) or key.count("|") != 2 or not all(key.split("|")[i] for i in (0, 2)):
        problems.append(f"{at}: key must look like 'model|input=1x3x224x224|fused' (three '|'-separated parts)")
    if not isinstance(entry, dict):
        problems.append(f"{at}: must be an object, got {_show(entry)}")
        return
    for name in sorted(_ENTRY_REQUIRED - entry.keys()):
        problems.append(f"{at}: missing field '{name}'")
    for name in sorted(entry.keys() - _ENTRY_FIELDS):
        problems.append(f"{at}: unknown field '{name}' (schema_version {SCHEMA_VERSION} has {sorted(_ENTRY_FIELDS)})")

    def positive(name: str) -> bool:
        if name in entry and not (_is_number(entry[name]) and entry[name] > 0):
            problems.append(f"{at}: {name} must be a positive number, got {_show(entry[name])}")
            return False
        return name in entry

    def samples(name: str) -> list[float] | None:
        value = entry.get(name)
        if not isinstance(value, list) or not 1 <= len(value) <= MAX_SAMPLES:
            problems.append(f"{at}: {name} must be a list of 1..{MAX_SAMPLES} positive numbers, got {_show(value)}")
            return None
        bad = [v for v in value if not (_is_number(v) and v > 0)]
        if bad:
            problems.append(f"{at}: {name} must hold positive numbers only, got {_show(bad[0])}")
            return None
        return value

    has_median = positive("median_ms")
    if "iqr_ms" in entry and not (_is_number(entry["iqr_ms"]) and entry["iqr_ms"] >= 0):
        problems.append(f"{at}: iqr_ms must be a non-negative number, got {_show(entry['iqr_ms'])}")
    n = entry.get("n")
    n_ok = isinstance(n, int) and not isinstance(n, bool) and n >= 1
    if "n" in entry and not n_ok:
        problems.append(f"{at}: n must be a positive integer (the sample count), got {_show(n)}")
    kept = samples("samples_ms") if "samples_ms" in entry else None
    if kept is not None:
        if n_ok and len(kept) > n:
            problems.append(f"{at}: samples_ms holds {len(kept)} samples but n is {n}")
        if has_median and not min(kept) <= entry["median_ms"] <= max(kept):
            problems.append(f"{at}: median_ms {_show(entry['median_ms'])} lies outside its samples "
                            f"[{_show(min(kept))}, {_show(max(kept))}]")

    ref = entry.get("reference_median_ms")
    has_ref = ref is not None and positive("reference_median_ms")
    norm = entry.get("normalised")
    if ref is None and norm is not None:
        problems.append(f"{at}: normalised must be null when reference_median_ms is null, got {_show(norm)}")
    if ref is not None and "normalised" in entry:
        if not (_is_number(norm) and norm > 0):
            problems.append(f"{at}: normalised must be a positive number, got {_show(norm)}")
        elif has_ref and has_median and not math.isclose(norm, entry["median_ms"] / ref, rel_tol=1e-6):
            problems.append(f"{at}: normalised must equal median_ms / reference_median_ms "
                            f"({entry['median_ms'] / ref:.6g}), got {_show(norm)}")
    if entry.get("reference_samples_ms") is not None:
        if ref is None:
            problems.append(f"{at}: reference_samples_ms given but reference_median_ms is null")
        samples("reference_samples_ms")

    meta = entry.get("metadata")
    if "metadata" not in entry:
        return
    if not isinstance(meta, dict):
        problems.append(f"{at}: metadata must be an object, got {_show(meta)}")
        return
    for name in sorted(_META_FIELDS - meta.keys()):
        problems.append(f"{at}: metadata is missing '{name}'")
    for name in sorted(meta.keys() - _META_FIELDS - _META_OPTIONAL):
        problems.append(f"{at}: metadata has unknown field '{name}'")
    for name in ("model_sha256", "options_sha256"):
        value = meta.get(name)
        if value is not None and not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value)):
            problems.append(f"{at}: metadata.{name} must be a hex digest or null, got {_show(meta[name])}")
    for name in ("device", "tvm_version", "fuseguard_version", "date"):
        if name in meta and not (isinstance(meta[name], str) and meta[name].strip()):
            problems.append(f"{at}: metadata.{name} must be a non-empty string, got {_show(meta[name])}")
    for name in ("driver", "cuda", "reference_kind"):
        if meta.get(name) is not None and not (isinstance(meta[name], str) and meta[name].strip()):
            problems.append(f"{at}: metadata.{name} must be a non-empty string or null, got {_show(meta[name])}")
    if isinstance(meta.get("date"), str):
        try:
            datetime.fromisoformat(meta["date"])
        except ValueError:
            problems.append(f"{at}: metadata.date must be an ISO 8601 date-time, got {_show(meta['date'])}")
    commit = meta.get("git_commit")
    if commit is not None and not (isinstance(commit, str) and _HEX_RE.match(commit)):
        problems.append(f"{at}: metadata.git_commit must be 7-40 lowercase hex digits or null, got {_show(commit)}")
    for name in ("threads", "processes"):
        value = meta.get(name)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            problems.append(f"{at}: metadata.{name} must be a positive integer or null, got {_show(value)}")
    kind_given = "reference_kind" in meta and "reference_median_ms" in entry
    if kind_given and (meta["reference_kind"] is None) != (ref is None):
        problems.append(f"{at}: metadata.reference_kind must be set exactly when reference_median_ms is, "
                        f"got {_show(meta['reference_kind'])} with reference_median_ms {_show(ref)}")


def validate_document(doc: Any, path: PathLike) -> None:
    """Raise BaselineError naming the file, the entry and the field for the first problem (and a count of the rest)."""
    where = str(path)
    problems: list[str] = []
    if not isinstance(doc, dict):
        raise BaselineError(f"{where}: top level must be an object, got {_show(doc)}")
    version = doc.get("schema_version")
    if not (isinstance(version, int) and not isinstance(version, bool)):
        problems.append(f"{where}: schema_version must be the integer {SCHEMA_VERSION}, got {_show(version)}")
    elif version > SCHEMA_VERSION:
        problems.append(f"{where}: schema_version {version} was written by a newer fuseguard; "
                        f"this one reads {SCHEMA_VERSION} (upgrade fuseguard)")
    elif version != SCHEMA_VERSION:
        problems.append(f"{where}: schema_version must be {SCHEMA_VERSION}, got {version}")
    arch = doc.get("arch")
    if not (isinstance(arch, str) and _ARCH_RE.match(arch)):
        problems.append(f"{where}: arch must be a GPU arch like 'sm_80' or a CPU class like 'cpu-znver1-2c', "
                        f"got {_show(arch)}")
    elif Path(where).suffix == ".json" and Path(where).stem != arch:
        problems.append(f"{where}: arch is {arch!r} but the file is named for {Path(where).stem!r}")
    for name in sorted(doc.keys() - _TOP_FIELDS):
        problems.append(f"{where}: unknown top-level field {name!r}")
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        problems.append(f"{where}: entries must be an object mapping keys to entries, got {_show(entries)}")
    else:
        for key, entry in entries.items():
            _check_entry(key, entry, problems, where)
    if problems:
        more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
        raise BaselineError(problems[0] + more)


# ----------------------------------------------------------------------------------------------- files

@dataclass
class BaselineFile:
    """A parsed, validated baseline file; ``lookup`` returning None means "no baseline", not pass or fail."""

    path: Path
    arch: str
    entries: dict[str, Entry] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def lookup(self, key: str) -> Entry | None:
        return self.entries.get(key)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries


def load_baselines(path: PathLike) -> BaselineFile:
    """Read ``baselines/<arch>.json``; a missing file is an empty baseline set, a corrupt one a BaselineError."""
    target = Path(path)
    doc = read_json_document(target)
    if doc is None:
        return BaselineFile(path=target, arch=target.stem)
    validate_document(doc, target)
    return BaselineFile(path=target, arch=doc["arch"], schema_version=doc["schema_version"],
                        entries={k: Entry.from_dict(v) for k, v in doc["entries"].items()})


def record(path: PathLike, key: str, entry: Entry) -> None:
    """Add or replace one entry under the file lock; concurrent recorders (xdist workers) lose nothing."""
    target = Path(path)
    payload = entry.to_dict()

    def mutate(doc: dict[str, Any]) -> None:
        if not doc:
            doc.update(schema_version=SCHEMA_VERSION, arch=target.stem, entries={})
        doc["entries"][key] = payload

    update_json(target, mutate, lambda doc: validate_document(doc, target))


# ----------------------------------------------------------------------------------------------- pytest-benchmark

def _foreign_metadata(doc: Mapping[str, Any], extra: Mapping[str, Any]) -> Metadata:
    machine = doc.get("machine_info") if isinstance(doc.get("machine_info"), dict) else {}
    cpu = machine.get("cpu") if isinstance(machine.get("cpu"), dict) else {}
    commit = doc.get("commit_info") if isinstance(doc.get("commit_info"), dict) else {}
    commit_id = commit.get("id")
    stored = extra.get("fuseguard_metadata") if isinstance(extra.get("fuseguard_metadata"), dict) else {}
    fallback = {
        "device": str(cpu.get("brand_raw") or machine.get("node") or "unknown"),
        "driver": None, "cuda": None, "tvm_version": "unknown", "fuseguard_version": "unknown",
        "git_commit": commit_id if isinstance(commit_id, str) and _HEX_RE.match(commit_id) else None,
        "date": str(doc.get("datetime") or datetime.now(timezone.utc).isoformat(timespec="seconds")),
        "threads": None, "reference_kind": None,
    }
    return Metadata(**{name: stored.get(name, fallback[name]) for name in _META_FIELDS})


def from_pytest_benchmark(path: PathLike) -> dict[str, Entry]:
    """Entries from a ``--benchmark-json`` file (seconds -> ms).

    Keys come from ``extra_info["fuseguard_key"]`` when present (files written by to_pytest_benchmark),
    else ``<fullname>|-|default``. Raw per-round data is required: the gate tests against samples.
    """
    source = Path(path)
    doc = read_json_document(source)
    if doc is None:
        raise BaselineError(f"{source}: no such pytest-benchmark file")
    benches = doc.get("benchmarks")
    if not isinstance(benches, list):
        raise BaselineError(f"{source}: not a pytest-benchmark JSON file (no 'benchmarks' list)")
    out: dict[str, Entry] = {}
    for i, bench in enumerate(benches):
        label = bench.get("fullname") or bench.get("name") if isinstance(bench, dict) else None
        if not isinstance(label, str) or not isinstance(bench.get("stats"), dict):
            raise BaselineError(f"{source}: benchmarks[{i}] has no name/fullname or no stats object")
        stats, extra = bench["stats"], bench.get("extra_info") or {}
        data = stats.get("data")
        if not isinstance(data, list) or not data or not all(_is_number(v) and v > 0 for v in data):
            raise BaselineError(f"{source}: benchmark {label!r} has no raw timing data (stats.data); "
                                f"write it with --benchmark-json (which includes data) or --benchmark-save-data")
        key = extra.get("fuseguard_key") or make_key(label.replace("|", "/"), {}, "default")
        if key in out:
            raise BaselineError(f"{source}: two benchmarks map to the key {key!r}")
        samples = [v * 1e3 for v in data]
        ref = extra.get("reference_median_ms")
        ref_samples = extra.get("reference_samples_ms")
        raw = {
            "median_ms": stats.get("median", statistics.median(data)) * 1e3,
            "iqr_ms": stats.get("iqr", 0.0) * 1e3, "n": int(stats.get("rounds", len(data))),
            "samples_ms": list(_keep(samples)), "reference_median_ms": ref,
            "normalised": None if ref is None else stats.get("median", statistics.median(data)) * 1e3 / ref,
            "metadata": _foreign_metadata(doc, extra).to_dict(),
        }
        if ref_samples is not None:
            raw["reference_samples_ms"] = list(_keep(ref_samples))
        _check_single(source, key, raw)
        out[key] = Entry.from_dict(raw)
    return out


def _check_single(source: Path, key: str, raw: dict[str, Any]) -> None:
    problems: list[str] = []
    _check_entry(key, raw, problems, str(source))
    if problems:
        raise BaselineError(problems[0])


def to_pytest_benchmark(entries: Mapping[str, Entry], path: PathLike) -> None:
    """Write entries as a pytest-benchmark JSON file (seconds), readable by ``pytest-benchmark compare``."""
    benches = []
    first = next(iter(entries.values()), None)
    for key, entry in entries.items():
        data = [v / 1e3 for v in entry.samples_ms]
        arr = np.asarray(data)
        q1, q3 = (float(v) for v in np.percentile(arr, [25, 75]))
        iqr = entry.iqr_ms / 1e3
        mean = float(arr.mean())
        stddev = float(arr.std(ddof=1)) if arr.size > 1 else 0.0
        lo_fence, hi_fence = q1 - 1.5 * (q3 - q1), q3 + 1.5 * (q3 - q1)
        inside = arr[(arr >= lo_fence) & (arr <= hi_fence)]
        iqr_out = int(arr.size - inside.size)
        sd_out = int(np.sum((arr < mean - stddev) | (arr > mean + stddev)))
        extra: dict[str, Any] = {"fuseguard_key": key, "fuseguard_metadata": entry.metadata.to_dict()}
        if entry.reference_median_ms is not None:
            extra["reference_median_ms"] = entry.reference_median_ms
        if entry.reference_samples_ms is not None:
            extra["reference_samples_ms"] = list(entry.reference_samples_ms)
        benches.append({
            "group": None, "name": key, "fullname": f"fuseguard::{key}", "params": None, "param": None,
            "extra_info": extra, "options": {"disable_gc": False, "timer": "perf_counter", "min_rounds": entry.n,
                                             "max_time": None, "min_time": None, "warmup": True},
            "stats": {"min": float(arr.min()), "max": float(arr.max()), "mean": mean, "stddev": stddev,
                      "rounds": entry.n, "median": entry.median_ms / 1e3, "iqr": iqr, "q1": q1, "q3": q3,
                      "iqr_outliers": iqr_out, "stddev_outliers": sd_out, "outliers": f"{sd_out};{iqr_out}",
                      "ld15iqr": float(inside.min()) if inside.size else float(arr.min()),
                      "hd15iqr": float(inside.max()) if inside.size else float(arr.max()),
                      "ops": 1.0 / mean, "total": float(arr.sum()), "iterations": 1, "data": data},
        })
    version = _dist_version("pytest-benchmark")
    doc = {
        "machine_info": {"node": platform.node(), "processor": platform.processor(), "machine": platform.machine(),
                         "python_implementation": platform.python_implementation(),
                         "python_version": platform.python_version(), "python_compiler": platform.python_compiler(),
                         "release": platform.release(), "system": platform.system(),
                         "cpu": {"brand_raw": first.metadata.device if first else "unknown"}},
        "commit_info": {"id": first.metadata.git_commit if first else None, "time": None, "author_time": None,
                        "dirty": None, "project": "fuseguard", "branch": None},
        "benchmarks": benches,
        "datetime": datetime.now(timezone.utc).isoformat(),
        "version": _PYTEST_BENCHMARK_FORMAT if version == "unknown" else version,
    }
    atomic_write_json(path, doc)
