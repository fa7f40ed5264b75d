"""Measured fusion decisions: a per-architecture database the cost model reads before it estimates.

`fuseguard tune MODEL...` (verify/perf/tune.py) times every pattern group fused and as its unfused parts
(verify/perf/profile.py) and records, per group *shape*, whether fusing paid. Every later build on the same
architecture looks the group up here first: a measurement wins over the analytic estimate, and the report
says which of the two decided.

The key is the group's structure, not its model: pattern, variant, the op sequence, the shapes and dtypes
of its inputs, constants and output, and the target; so a measurement made on one model decides the same
group in another. Entries made by another fuseguard or TVM version are ignored (schedules change).

File: `baselines/decisions/<arch>.json` (arch as the latency baselines name it), or the file named by
`CompileOptions.decision_db` / `FUSEGUARD_DECISION_DB` ("" turns measured decisions off).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tvm
from tvm import relax

from .. import settings
from ..paths import PROJECT_ROOT

ENV = "FUSEGUARD_DECISION_DB"
DEFAULT_DIR = PROJECT_ROOT / "baselines" / "decisions"
SCHEMA = 1


def versions() -> dict[str, str]:
    """What a measurement depends on besides the group: the compiler's and TVM's versions."""
    try:
        from importlib.metadata import version

        fuseguard = version("fuseguard")
    except Exception:  # noqa: BLE001 - running from a source tree without metadata
        fuseguard = "source"
    return {"fuseguard": fuseguard, "tvm": str(tvm.__version__)}


def _signature(expr: relax.Expr) -> str:
    ty = getattr(expr, "ty", None)
    if isinstance(ty, relax.TensorType) and ty.shape is not None:
        try:
            dims = "x".join(str(int(d)) for d in ty.shape.values)
        except (TypeError, AttributeError):
            dims = "?"
        return f"{ty.dtype}[{dims}]"
    return type(ty).__name__ if ty is not None else "?"


def decision_key(pattern: str, variant: str, ops: list[str], inputs: list[relax.Expr],
                 constants: list[relax.Expr], output: relax.Expr | None, target: str) -> str:
    """A stable hash of the group's structure on one target (see the module docstring)."""
    text = json.dumps({"pattern": pattern, "variant": variant, "ops": ops,
                       "inputs": sorted(_signature(e) for e in inputs),
                       "constants": sorted(_signature(e) for e in constants),
                       "output": _signature(output) if output is not None else "", "target": target},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Measured:
    fuse: bool
    fused_us: float
    parts_us: float
    model: str
    measured_at: str
    #: the whole model split at this group over fused, when `tune` timed it (None: not timed)
    whole_model: float | None = None

    @property
    def reason(self) -> str:
        verdict = "fused" if self.fuse else "split back"
        if self.fuse and self.whole_model is not None:
            verdict = f"kept fused (split back, the whole model ran {self.whole_model:.3f}x)"
        return (f"measured ({self.measured_at}, on {self.model}): fused {self.fused_us:.1f} us vs unfused parts "
                f"{self.parts_us:.1f} us: {verdict}")


def db_path(class_id: str, override: str | None = None) -> Path | None:
    """Where this architecture's decisions live; None when measured decisions are switched off."""
    chosen = override if override is not None else settings.get(ENV)
    if chosen is not None:
        return Path(chosen) if chosen else None
    return DEFAULT_DIR / f"{class_id}.json"


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int) -> dict[str, Measured]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or doc.get("versions") != versions():
        return {}
    out = {}
    for key, e in (doc.get("entries") or {}).items():
        try:
            whole = e.get("whole_model")
            out[key] = Measured(fuse=bool(e["fuse"]), fused_us=float(e["fused_us"]), parts_us=float(e["parts_us"]),
                                model=str(e.get("model", "?")), measured_at=str(e.get("measured_at", "?")),
                                whole_model=float(whole) if whole is not None else None)
        except (KeyError, TypeError, ValueError):
            continue
    return out


def load(path: Path | None) -> dict[str, Measured]:
    """The entries of `path` that this fuseguard and TVM can use ({} when absent, corrupt or stale)."""
    if path is None or not path.is_file():
        return {}
    return _load(str(path), path.stat().st_mtime_ns)


def entry(measured: Measured) -> dict[str, Any]:
    out = {"fuse": measured.fuse, "fused_us": round(measured.fused_us, 3), "parts_us": round(measured.parts_us, 3),
           "model": measured.model, "measured_at": measured.measured_at}
    if measured.whole_model is not None:
        out["whole_model"] = round(measured.whole_model, 4)
    return out
