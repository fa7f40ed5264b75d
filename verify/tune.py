"""`fuseguard tune MODEL...`: measure every pattern group fused and as its unfused parts, record the verdict.

The analytic cost model (compiler/cost.py) decides first; where this database holds a measurement of the
same group structure on the same architecture, the measurement wins (compiler/decisions.py). A group is
split back only when its fused kernel is slower than its unfused parts by more than `TUNE_MARGIN` and
`TUNE_MIN_US`: inside them one process's timing noise decides, and fusing keeps the memory-traffic saving.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

#: Relative slowdown of a fused kernel against its parts that splits it back. 5%: per-kernel medians of
#: 20 runs in one process moved by 2-4% between runs on this 2-core machine (fuseguard profile, repeated).
TUNE_MARGIN = 0.05
#: ... and by more than this many microseconds a call. The profile's per-call hook costs ~2 us, measured and
#: subtracted: kernels shorter than that read 0.0-0.2 us (vit_tiny's unfused add + LayerNorm parts, against
#: 1-2 us fused), so a relative margin alone split back groups on the hook's own noise (3 of vit_tiny's 5).
TUNE_MIN_US = 2.0


@dataclass
class TuneResult:
    model: str
    path: str
    decisions: list[dict[str, Any]] = field(default_factory=list)    # key, pattern, fused_us, parts_us, fuse

    @property
    def split(self) -> list[dict[str, Any]]:
        return [d for d in self.decisions if not d["fuse"]]

    def render(self) -> str:
        lines = [f"{self.model}: {len(self.decisions)} group shape(s) measured, {len(self.split)} split back "
                 f"-> {self.path}"]
        for d in self.decisions:
            lines.append(f"  {d['pattern']:18s} fused {d['fused_us']:8.1f} us  parts {d['parts_us']:8.1f} us  "
                         f"({d['instances']}x)  {'fuse' if d['fuse'] else 'SPLIT'}")
        return "\n".join(lines)


def measured_verdicts(groups: Sequence[Any], model: str, when: str) -> dict[str, Any]:
    """Per decision key (summed over the groups that share it): fuse unless slower beyond the margin."""
    from fuseguard.compiler.decisions import Measured

    sums: dict[str, list[float]] = {}
    names: dict[str, str] = {}
    for g in groups:
        if not g.key or not g.parts or g.pattern in ("generic", "single op"):
            continue
        acc = sums.setdefault(g.key, [0.0, 0.0, 0])
        acc[0] += g.fused_us
        acc[1] += g.parts_us
        acc[2] += 1
        names[g.key] = g.pattern
    out = {}
    for key, (fused, parts, n) in sums.items():
        slower = fused > parts * (1 + TUNE_MARGIN) and (fused - parts) / n > TUNE_MIN_US
        out[key] = (Measured(fuse=not slower, fused_us=fused / n, parts_us=parts / n,
                             model=model, measured_at=when), names[key], int(n))
    return out


def tune_model(source: Any, *, shapes: Mapping[str, Sequence[int]] | None = None, options: Any = None,
               threads: int | None = None, repeats: int = 20, db: str | None = None) -> TuneResult:
    """Profile with estimates only, then write each group shape's measured verdict into the database."""
    from fuseguard.compiler import decisions
    from fuseguard.compiler.pipeline import CompileOptions
    from fuseguard.compiler.target import resolve

    from .atomic import update_json
    from .profile import profile_model

    options = options or CompileOptions()
    path = decisions.db_path(resolve(options.gpu_arch, options.mcpu).class_id,
                             db if db is not None else options.decision_db)
    if path is None:
        from fuseguard.compiler.errors import UsageError

        raise UsageError("fuseguard tune: the decision database is switched off (FUSEGUARD_DECISION_DB='')")
    profile = profile_model(source, shapes=shapes, options=replace(options, decision_db=""), threads=threads,
                            repeats=repeats)
    when = _dt.date.today().isoformat()
    verdicts = measured_verdicts(profile.groups, profile.model, when)
    header = {"schema": decisions.SCHEMA, "versions": decisions.versions()}

    def mutate(doc: dict[str, Any]) -> None:
        if {k: doc.get(k) for k in header} != header:        # another version's measurements: start over
            doc.clear()
        doc.update(header)
        entries = doc.setdefault("entries", {})
        for key, (measured, pattern, _) in verdicts.items():
            entries[key] = {**decisions.entry(measured), "pattern": pattern}

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    update_json(path, mutate)
    result = TuneResult(model=profile.model, path=str(path))
    for key, (m, pattern, n) in sorted(verdicts.items(), key=lambda kv: kv[1][1]):
        result.decisions.append({"key": key, "pattern": pattern, "fused_us": m.fused_us, "parts_us": m.parts_us,
                                 "fuse": m.fuse, "instances": n})
    return result
