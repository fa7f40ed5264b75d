"""Baseline history: a model's recorded latency per commit, read from the baseline file's git history.

Each commit that changed `baselines/<class>.json` is one point per entry: its median and, what is
comparable across re-recordings on different days, its latency normalised by the same-run ONNX Runtime
reference (the machine's drift divides out). `fuseguard baseline history [MODEL...] [--plot FILE]` prints
the table and, optionally, writes the trend as PNG or as a self-contained HTML page.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fuseguard.compiler.errors import UsageError


@dataclass(frozen=True)
class HistoryPoint:
    commit: str                  # the commit that wrote this version of the file
    date: str                    # its commit date (ISO 8601)
    subject: str
    key: str                     # the baseline entry's key (model|shapes|config)
    median_ms: float
    normalised: float | None     # median / the ONNX Runtime reference median, same run
    recorded_at: str | None      # the compiler commit the entry was measured with (its metadata)


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UsageError(f"baseline history: git {' '.join(args[:2])} failed in {repo}: "
                         f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return proc.stdout


def baseline_history(path: str | Path, models: Sequence[str] = ()) -> list[HistoryPoint]:
    """Every committed version of the baseline file `path`, oldest first, as points for the entries whose
    model (the key's first field) is in `models` (all when empty)."""
    target = Path(path).resolve()
    repo = Path(_git(target.parent, "rev-parse", "--show-toplevel").strip())
    rel = target.relative_to(repo).as_posix()
    log = _git(repo, "log", "--reverse", "--format=%H%x09%cI%x09%s", "--", rel).strip()
    if not log:
        raise UsageError(f"baseline history: {rel} has no committed versions in {repo}")
    wanted = set(models)
    points: list[HistoryPoint] = []
    for line in log.splitlines():
        commit, date, subject = line.split("\t", 2)
        try:
            doc = json.loads(_git(repo, "show", f"{commit}:{rel}"))
        except (UsageError, ValueError):
            continue                     # deleted or unreadable at that commit: no point
        for key, entry in sorted(doc.get("entries", {}).items()):
            if wanted and key.split("|", 1)[0] not in wanted:
                continue
            points.append(HistoryPoint(commit=commit, date=date, subject=subject, key=key,
                                       median_ms=float(entry["median_ms"]), normalised=entry.get("normalised"),
                                       recorded_at=(entry.get("metadata") or {}).get("git_commit")))
    return points


def label(key: str) -> str:
    """`model [shapes] (config)` of a baseline key `model|shapes|config`, shapes cut to 32 characters."""
    parts = key.split("|")
    if len(parts) < 3:
        return key
    shapes = parts[1] if len(parts[1]) <= 32 else parts[1][:31] + "~"
    return f"{parts[0]} [{shapes}] ({parts[-1]})"


def render_table(points: Sequence[HistoryPoint]) -> "object":
    from rich.table import Table

    table = Table(title="baseline history (normalised: latency / same-run ONNX Runtime)")
    for col in ("entry", "commit", "date", "median ms", "normalised", "change"):
        table.add_column(col, overflow="fold")
    previous: dict[str, HistoryPoint] = {}
    for p in points:
        before = previous.get(p.key)
        if before is not None and before.median_ms == p.median_ms and before.normalised == p.normalised:
            continue                     # the file changed, this entry did not
        change = ""
        if before is not None and before.normalised and p.normalised:
            change = f"{p.normalised / before.normalised:.2f}x"
        table.add_row(label(p.key), p.commit[:10], p.date[:10], f"{p.median_ms:.3f}",
                      "-" if p.normalised is None else f"{p.normalised:.3f}", change)
        previous[p.key] = p
    return table


def plot(points: Sequence[HistoryPoint], out: str | Path) -> Path:
    """The normalised trend per entry, one line each, against commit order: PNG, or HTML embedding it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    commits = list(dict.fromkeys(p.commit for p in points))
    fig, ax = plt.subplots(figsize=(max(6, len(commits) * 0.8), 4))
    for key in dict.fromkeys(p.key for p in points):
        mine = [(commits.index(p.commit), p.normalised) for p in points if p.key == key and p.normalised]
        if mine:
            ax.plot([x for x, _ in mine], [y for _, y in mine], marker="o", label=label(key))
    ax.set_xticks(range(len(commits)), [c[:7] for c in commits], rotation=45)
    ax.set_ylabel("latency / ONNX Runtime (same run)")
    ax.set_title("baseline history")
    ax.legend(fontsize="small")
    if out.suffix.lower() == ".html":
        from ..html import png_data_uri

        out.write_text(f"<!doctype html><meta charset=utf-8><title>baseline history</title>"
                       f"<h1>baseline history</h1><img src=\"{png_data_uri(fig)}\" alt=\"normalised latency per commit\">")
    else:
        fig.savefig(out, format="png", dpi=90, bbox_inches="tight")
        plt.close(fig)
    return out
