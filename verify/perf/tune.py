"""`fuseguard tune MODEL...`: measure every pattern group fused and as its unfused parts, record the verdict.

The analytic cost model (compiler/fusion/cost.py) decides first; where this database holds a measurement of the
same group structure on the same architecture, the measurement wins (compiler/fusion/decisions.py). A group is
split back only when its fused kernel is slower than its unfused parts by more than `TUNE_MARGIN` and
`TUNE_MIN_US`: inside them one process's timing noise decides, and fusing keeps the memory-traffic saving.
Each model is profiled in `PROCESSES` fresh processes and each group's times are the medians over them: a
verdict written into the database outlives the process it was measured in. A split-back must then also make
the whole model faster (`confirm_splits`): a group can read slower than its parts for a reason the decision
does not change (its output storage is cold in the fused build's memory plan), and splitting it would only
lose the fusion.
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
#: Such groups are replayed now (verify/perf/profile.py: 0.6-0.7 us both sides); the floor stays as a noise margin.
TUNE_MIN_US = 2.0
#: Fresh processes `fuseguard tune` profiles each model in (`--processes`). Why not one: a whole process can
#: run in a slow mode (docs/measurement.md: 1 in 5-10 processes ran 1.2-2x slower), and a kernel's placement
#: in memory differs per process; the median of three takes neither one process's mode nor its luck.
PROCESSES = 3
#: Confirmation of a split-back: the model built with that group split against the estimate-only build,
#: interleaved in one process for this many rounds; the split is recorded only when the bootstrap 95%
#: interval of split / fused lies below 1. Why: MobileNet-V2's two depthwise 3x3 + bias + ReLU6 groups read
#: 229 vs 188 and 258 vs 182 us against their parts (their output storage is cold in the fused build's memory
#: plan, docs/measurement.md), and the build with both split ran 0.988x, 1.003x and 1.024x of the fused one.
CONFIRM_ROUNDS = 30


@dataclass
class TuneResult:
    model: str
    path: str
    decisions: list[dict[str, Any]] = field(default_factory=list)    # key, pattern, fused_us, parts_us, fuse
    processes: int = 1

    @property
    def split(self) -> list[dict[str, Any]]:
        return [d for d in self.decisions if not d["fuse"]]

    def render(self) -> str:
        lines = [f"{self.model}: {len(self.decisions)} group shape(s) measured in {self.processes} fresh "
                 f"process(es), {len(self.split)} split back -> {self.path}"]
        for d in self.decisions:
            verdict = "fuse" if d["fuse"] else "SPLIT"
            if d.get("whole_model") is not None:
                verdict += f" (model split back: {d['whole_model']:.3f}x)"
            lines.append(f"  {d['pattern']:18s} fused {d['fused_us']:8.1f} us  parts {d['parts_us']:8.1f} us  "
                         f"({d['instances']}x)  {verdict}")
        return "\n".join(lines)


def measured_verdicts(groups: Sequence[Any], model: str, when: str) -> dict[str, Any]:
    """Per decision key (summed over the groups that share it): fuse unless slower beyond the margin."""
    from fuseguard.compiler.fusion.decisions import Measured

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


def merge_groups(profiles: Sequence[Any]) -> list[Any]:
    """Each group's fused and parts times as the medians over several profiles of the same builds."""
    import numpy as np

    from fuseguard.compiler.errors import FuseguardError

    first = profiles[0].groups
    shape = [(g.kernel, tuple(g.nodes)) for g in first]
    for other in profiles[1:]:
        if [(g.kernel, tuple(g.nodes)) for g in other.groups] != shape:
            raise FuseguardError(f"{profiles[0].model}: the profiles to merge are of different builds "
                                 f"(a build changed between processes?)")
    return [replace(g, fused_us=float(np.median([p.groups[i].fused_us for p in profiles])),
                    parts_us=float(np.median([p.groups[i].parts_us for p in profiles])))
            for i, g in enumerate(first)]


def _db_path(options: Any, db: str | None) -> Path:
    from fuseguard.compiler.fusion import decisions
    from fuseguard.compiler.hw.target import resolve

    path = decisions.db_path(resolve(options.gpu_arch, options.mcpu).class_id,
                             db if db is not None else options.decision_db)
    if path is None:
        from fuseguard.compiler.errors import UsageError

        raise UsageError("fuseguard tune: the decision database is switched off (FUSEGUARD_DECISION_DB='')")
    return Path(path)


def profile_for_tuning(source: Any, *, shapes: Mapping[str, Sequence[int]] | None = None, options: Any = None,
                       threads: int | None = None, repeats: int = 20, db: str | None = None) -> Any:
    """One process's profile of `source` built on the estimate alone (no earlier measurement decides)."""
    from fuseguard.compiler.pipeline import CompileOptions

    from .profile import profile_model

    options = options or CompileOptions()
    _db_path(options, db)                                   # refuse a switched-off database before timing
    return profile_model(source, shapes=shapes, options=replace(options, decision_db=""), threads=threads,
                         repeats=repeats)


def confirm_splits(source: Any, keys: Sequence[str], *, shapes: Mapping[str, Sequence[int]] | None = None,
                   options: Any = None, threads: int | None = None,
                   rounds: int = CONFIRM_ROUNDS) -> dict[str, tuple[float, tuple[float, float]]]:
    """Per decision key: the whole model with that group split back over the estimate-only build (time ratio
    and its bootstrap 95% interval), the builds timed interleaved in this process."""
    import json
    import tempfile

    import numpy as np

    from fuseguard.compiler.fusion import decisions
    from fuseguard.compiler.pipeline import CompileOptions, compile_model

    from .bench import ratio_interval
    from ..check.model import load_with_inputs
    from .timing import measure_interleaved

    if not keys:
        return {}
    options = options or CompileOptions()
    loaded, inputs = load_with_inputs(source, shapes)
    fns = {"": compile_model(loaded, options=replace(options, decision_db="")).time_fn(inputs)}
    header = {"schema": decisions.SCHEMA, "versions": decisions.versions()}
    with tempfile.TemporaryDirectory(prefix="fuseguard-confirm-") as tmp:
        for key in keys:
            path = Path(tmp) / f"{key}.json"
            split = decisions.Measured(fuse=False, fused_us=0.0, parts_us=0.0, model=loaded.name, measured_at="")
            path.write_text(json.dumps({**header, "entries": {key: decisions.entry(split)}}))
            fns[key] = compile_model(loaded, options=replace(options, decision_db=str(path))).time_fn(inputs)
    samples = measure_interleaved(fns, warmup=3, repeats=rounds, threads=threads)
    base = samples[""].usable_ms
    out = {}
    for key in keys:
        mine = samples[key].usable_ms
        ratio = float(np.median(mine) / np.median(base))
        out[key] = ratio_interval([ratio], (mine, base))
    return out


def record_tuning(profiles: Sequence[Any], *, options: Any = None, db: str | None = None, source: Any = None,
                  shapes: Mapping[str, Sequence[int]] | None = None, threads: int | None = None,
                  confirm: bool = True) -> TuneResult:
    """Write each group shape's verdict, from the medians over `profiles`, into the decision database; with
    `source` (and `confirm`), a split-back stands only where the whole model ran faster split (`confirm_splits`)."""
    from fuseguard.compiler.fusion import decisions
    from fuseguard.compiler.pipeline import CompileOptions

    from ..atomic import update_json

    options = options or CompileOptions()
    path = _db_path(options, db)
    model = profiles[0].model
    when = _dt.date.today().isoformat()
    verdicts = measured_verdicts(merge_groups(profiles), model, when)
    if source is not None and confirm:
        splits = [key for key, (m, _, _) in verdicts.items() if not m.fuse]
        for key, (ratio, (_, hi)) in confirm_splits(source, splits, shapes=shapes, options=options,
                                                    threads=threads).items():
            m, pattern, n = verdicts[key]
            # split only on a clear whole-model gain (an unreadable interval, NaN, keeps the group fused)
            verdicts[key] = (replace(m, fuse=not hi < 1.0, whole_model=ratio), pattern, n)
    header = {"schema": decisions.SCHEMA, "versions": decisions.versions()}

    def mutate(doc: dict[str, Any]) -> None:
        if {k: doc.get(k) for k in header} != header:        # another version's measurements: start over
            doc.clear()
        doc.update(header)
        entries = doc.setdefault("entries", {})
        for key, (measured, pattern, _) in verdicts.items():
            entries[key] = {**decisions.entry(measured), "pattern": pattern}

    path.parent.mkdir(parents=True, exist_ok=True)
    update_json(path, mutate)
    result = TuneResult(model=model, path=str(path), processes=len(profiles))
    for key, (m, pattern, n) in sorted(verdicts.items(), key=lambda kv: kv[1][1]):
        result.decisions.append({"key": key, "pattern": pattern, "fused_us": m.fused_us, "parts_us": m.parts_us,
                                 "fuse": m.fuse, "instances": n, "whole_model": m.whole_model})
    return result


def tune_model(source: Any, *, shapes: Mapping[str, Sequence[int]] | None = None, options: Any = None,
               threads: int | None = None, repeats: int = 20, db: str | None = None) -> TuneResult:
    """Profile in this process with estimates only, then record the verdicts (one process: `fuseguard tune`
    takes several, `profile_for_tuning` in each and `record_tuning` over them)."""
    profile = profile_for_tuning(source, shapes=shapes, options=options, threads=threads, repeats=repeats, db=db)
    return record_tuning([profile], options=options, db=db, source=source, shapes=shapes, threads=threads)
