"""Content-addressed cache of compiled builds: the exported library plus its fusion report.

Why: every command compiled everything anew (DenseNet-121 ~25 s per build, twice per verify), and pytest
compiled the same builds again for verify, latency and fusion-pays. The key is a hash of everything that
changes the generated code, so a hit is the same build, and any change misses:

* the model bytes and pinned input shapes;
* every `CompileOptions` field (user passes by name and source), the resolved target and, on a CPU, the
  host's features and cache sizes (what the schedules read);
* the environment switches schedules read (`FUSEGUARD_CPU_SCHEDULE_*`, `FUSEGUARD_MCPU`, `TVM_NUM_THREADS`)
  and the measured-decision database's content;
* the toolchain as loaded (`compiler/toolchain.py`: TVM's and tvm-ffi's sources and native libraries by
  path, size, mtime and inode, LLVM's version: a TVM source tree on `PYTHONPATH` keeps its version string
  through every edit), a hash of every source file of `compiler/`, the loaded plugins (by source)
  and the registered patterns and passes (by source): the stale-cache bugs of others came from keys that
  named a callable by import path (Inductor) or left the model out (engine caches).

Entries live in `FUSEGUARD_CACHE_DIR/builds` (default `~/.cache/fuseguard/builds`), one directory per key
written whole and renamed into place under a per-key file lock (safe under pytest-xdist). The library's
sha256 is checked on every load: a corrupt or truncated entry is reported once, removed and rebuilt, never
loaded. Least-recently-used entries go past `FUSEGUARD_CACHE_MAX_MB` (default 4096). `FUSEGUARD_NO_CACHE=1`
bypasses it.
"""

from __future__ import annotations

import atexit
import hashlib
import inspect
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from . import settings
from .paths import ENV_DIR, ENV_OFF, enabled, home  # noqa: F401  (re-exported: compiler.cache.home, ...)

ENV_MAX_MB = "FUSEGUARD_CACHE_MAX_MB"
DEFAULT_MAX_MB = 4096
#: Bump when the entry layout changes.
FORMAT = 1
_LIB = "lib.so"
_META = "meta.json"
_warned: set[str] = set()


def root() -> Path:
    return home() / "builds"


# ----------------------------------------------------------------------------- the key

def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@lru_cache(maxsize=1)
def compiler_source_hash() -> str:
    """Every .py file of the compiler package, by relative path and content."""
    pkg = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(pkg.rglob("*.py")):
        h.update(str(path.relative_to(pkg)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _callable_id(fn: Any) -> str:
    """A callable by its source (a changed body misses), its qualified name when source is unavailable; an
    object that names itself (`cache_id()`: a pass with parameters, such as an injected fault) by that."""
    own = getattr(fn, "cache_id", None)
    if callable(own):
        return str(own())
    target = getattr(fn, "__wrapped__", fn)
    try:
        return _sha(inspect.getsource(target).encode())[:16]
    except (OSError, TypeError):
        return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


def _registry_id() -> dict[str, Any]:
    """Registered patterns and passes, and loaded plugins, each by source."""
    from .fusion import patterns
    from . import pipeline, plugins

    pats = {}
    for rule in patterns.rules():
        parts = [rule.name, rule.description]
        for attr in ("variants", "check", "cost", "prepare"):
            value = getattr(rule, attr, None)
            if callable(value):
                parts.append(_callable_id(value))
        pats[rule.name] = _sha("|".join(parts).encode())[:16]
    passes = {stage: [(name, _callable_id(fn)) for name, fn in entries]
              for stage, entries in pipeline._USER_PASSES.items() if entries}
    loaded = {}
    for name in sorted(plugins._loaded):
        path = Path(name) if name.endswith(".py") else None
        if path is None:
            module = sys.modules.get(name)
            file = getattr(module, "__file__", None)
            path = Path(file) if file else None
        loaded[name] = _sha(path.read_bytes())[:16] if path is not None and path.is_file() else "?"
    return {"patterns": pats, "passes": passes, "plugins": loaded}


def _decision_db_id(spec: Any, options: Any) -> str:
    from .fusion import decisions

    path = decisions.db_path(spec.class_id, options.decision_db)
    if path is None or not path.is_file():
        return "none"
    return _sha(path.read_bytes())[:16]


def build_key(model_bytes: bytes, shapes: Mapping[str, Sequence[int]], options: Any, spec: Any,
              name: str = "") -> str:
    """The hash of everything that changes the build (module docstring). The model's name is part of it:
    the pipeline hands it to passes and plugins, which may act on it (the harness's fault injection does)."""
    from . import toolchain

    host: dict[str, Any] = {}
    if not spec.is_gpu:
        from .hw.hostcpu import detect_host

        h = detect_host()
        host = {"features": sorted(h.features), "l1d": h.l1d_bytes, "l2": h.l2_bytes, "l3": h.l3_bytes,
                "cores": h.cores}
    env = dict(sorted(settings.code_environment().items()))
    doc = {
        "format": FORMAT,
        "model": _sha(model_bytes),
        "name": name,
        "shapes": {k: [int(d) for d in v] for k, v in sorted(shapes.items())},
        "options": options.to_dict(passes=_callable_id),
        "target": [spec.kind, spec.arch, spec.num_cores],
        "host": host,
        "env": env,
        "decisions": _decision_db_id(spec, options),
        "toolchain": toolchain.digest(),
        "compiler": compiler_source_hash(),
        "registry": _registry_id(),
    }
    return _sha(json.dumps(doc, sort_keys=True, default=str).encode())


# ----------------------------------------------------------------------------- the store

@dataclass(frozen=True)
class Entry:
    key: str
    path: Path
    meta: dict[str, Any]

    @property
    def library(self) -> Path:
        return self.path / _LIB


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


class BuildCache:
    """One cache directory (see the module docstring)."""

    def __init__(self, directory: Path | None = None, max_bytes: int | None = None) -> None:
        self.dir = directory or root()
        mb = settings.number(ENV_MAX_MB)
        self.max_bytes = max_bytes if max_bytes is not None else int(mb * 2**20) if mb else DEFAULT_MAX_MB * 2**20

    def _lock(self, key: str):
        from filelock import FileLock

        self.dir.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.dir / f".{key}.lock"), timeout=600)

    def get(self, key: str) -> Entry | None:
        path = self.dir / key
        meta_file = path / _META
        if not meta_file.is_file():
            return None
        try:
            meta = json.loads(meta_file.read_text())
            ok = meta.get("format") == FORMAT and _sha((path / _LIB).read_bytes()) == meta.get("library_sha256")
        except (OSError, ValueError):
            ok = False
        if not ok:
            _warn_once(key, f"fuseguard: build cache entry {path} is corrupt or truncated (checksum mismatch): "
                            f"removed, rebuilding")
            with self._lock(key):
                shutil.rmtree(path, ignore_errors=True)
            return None
        try:
            os.utime(meta_file)       # least-recently-used order
        except OSError:
            pass
        return Entry(key, path, meta)

    def put(self, key: str, library_writer, meta: Mapping[str, Any]) -> Entry:
        """`library_writer(path)` writes the exported library; the entry appears whole or not at all."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with self._lock(key):
            final = self.dir / key
            if (final / _META).is_file():
                existing = self.get(key)
                if existing is not None:
                    return existing
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:12]}-", dir=self.dir))
            try:
                library_writer(str(tmp / _LIB))
                doc = {**meta, "format": FORMAT, "key": key, "created": time.time(),
                       "library_sha256": _sha((tmp / _LIB).read_bytes())}
                (tmp / _META).write_text(json.dumps(doc, default=str))
                if final.exists():
                    shutil.rmtree(final, ignore_errors=True)
                tmp.rename(final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        self.evict()
        return Entry(key, final, doc)

    def entries(self) -> list[tuple[Path, int, float]]:
        """(entry dir, bytes, last use) for every complete entry."""
        out = []
        if not self.dir.is_dir():
            return out
        for path in self.dir.iterdir():
            meta = path / _META
            if path.is_dir() and not path.name.startswith(".") and meta.is_file():
                size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
                out.append((path, size, meta.stat().st_mtime))
        return out

    def evict(self) -> list[Path]:
        """Remove least-recently-used entries until the cache fits its cap."""
        items = sorted(self.entries(), key=lambda e: e[2])
        total = sum(size for _, size, _ in items)
        removed = []
        for path, size, _ in items:
            if total <= self.max_bytes:
                break
            with self._lock(path.name):
                shutil.rmtree(path, ignore_errors=True)
            total -= size
            removed.append(path)
        return removed

    def info(self) -> dict[str, Any]:
        items = self.entries()
        return {"directory": str(self.dir), "entries": len(items), "bytes": sum(s for _, s, _ in items),
                "max_bytes": self.max_bytes}

    def clear(self) -> int:
        items = self.entries()
        for path, _, _ in items:
            with self._lock(path.name):
                shutil.rmtree(path, ignore_errors=True)
        for stale in self.dir.glob(".tmp-*") if self.dir.is_dir() else []:
            shutil.rmtree(stale, ignore_errors=True)
        return len(items)


# ----------------------------------------------------------------------------- compile through it

def compile_cached(loaded: Any, options: Any, *, cache: BuildCache | None = None) -> Any:
    """`pipeline.compile_model(loaded, options=options)`, served from the cache when the same build exists.

    A hit returns a CompiledModel whose executable is the loaded library, with `lowered=None` and
    `cache_hit=True` (profiling and bisection, which need the lowered module, compile for real)."""
    from . import pipeline, progress
    from .fusion.report import FusionReport
    from .hw.target import cuda_device_present, resolve

    spec = resolve(options.gpu_arch, options.mcpu)
    if spec.is_gpu and not cuda_device_present():
        # A CUDA library cannot be loaded back without the CUDA runtime: without a device it is compiled
        # (which checks code generation) but not cached.
        return pipeline.compile_model(loaded, options=options)
    if not enabled():
        compiled = pipeline.compile_model(loaded, options=options)
        out = Path(tempfile.mkdtemp(prefix="fuseguard-build-")) / _LIB
        _TEMP_BUILDS.append(out.parent)
        _load_exported(compiled, lambda path: compiled.executable.export_library(path), out)
        return compiled
    cache = cache or BuildCache()
    key = build_key(loaded.model.SerializeToString(), loaded.input_shapes, options, spec, name=loaded.name)
    entry = cache.get(key)
    if entry is not None:
        import tvm

        progress.stage("cached build")
        start = time.perf_counter()
        meta = entry.meta
        compiled = pipeline.CompiledModel(
            name=loaded.name, target=spec, options=options,
            executable=tvm.runtime.load_module(str(entry.library)),
            report=FusionReport.from_dict(meta["report"]), input_names=list(meta["input_names"]),
            input_shapes={k: tuple(v) for k, v in meta["input_shapes"].items()},
            output_names=list(meta["output_names"]), compile_s=float(meta["compile_s"]),
            dynamic_axes={k: [tuple(p) for p in v] for k, v in meta.get("dynamic_axes", {}).items()},
            narrow_outputs={int(k): int(v) for k, v in meta.get("narrow_outputs", {}).items()})
        compiled.cache_hit = True
        compiled.library_path = str(entry.library)
        compiled.load_s = time.perf_counter() - start
        return compiled
    compiled = pipeline.compile_model(loaded, options=options)
    meta = {"model": loaded.name, "report": compiled.report.to_dict(), "input_names": compiled.input_names,
            "input_shapes": {k: list(v) for k, v in compiled.input_shapes.items()},
            "dynamic_axes": {k: [list(p) for p in v] for k, v in compiled.dynamic_axes.items()},
            "output_names": compiled.output_names, "compile_s": compiled.compile_s, "target": spec.label,
            "narrow_outputs": {str(k): v for k, v in compiled.narrow_outputs.items()}}
    exported: dict[str, float] = {}

    def write(path: str) -> None:
        start = time.perf_counter()
        compiled.executable.export_library(path)
        exported["s"] = time.perf_counter() - start
        meta["compile_s"] = compiled.compile_s + exported["s"]

    try:
        entry = cache.put(key, write, meta)
    except OSError as err:  # a full or read-only disk: the build itself is fine
        _warn_once("put", f"fuseguard: build cache at {cache.dir} not written ({err}); continuing uncached")
        return compiled
    _load_exported(compiled, None, entry.library, exported.get("s", 0.0))
    return compiled


#: uncached builds' exported libraries, removed when the process exits
_TEMP_BUILDS: list[Path] = []


@atexit.register
def _remove_temp_builds() -> None:
    for path in _TEMP_BUILDS:
        shutil.rmtree(path, ignore_errors=True)


def _load_exported(compiled: Any, writer: Any, library: Path, export_s: float = 0.0) -> None:
    """Run a fresh CPU build from its exported library, and count the export in its compile time.

    The in-memory executable generates machine code only when its VM is created (LLVM's JIT: 2.8 s of
    bert_tiny_dyn's first run, which `verify --dynamic` counted as checking time), and exporting it for the
    cache generated the same code a second time. Exported once and loaded, the code is generated once,
    inside `compile_s`."""
    import tvm

    start = time.perf_counter()
    if writer is not None:
        writer(str(library))
    compiled.executable = tvm.runtime.load_module(str(library))
    compiled._vm = None
    compiled.library_path = str(library)
    spent = export_s + time.perf_counter() - start
    compiled.compile_s += spent
    compiled.report.compile_s += spent
    compiled.report.stage_s["export"] = spent
