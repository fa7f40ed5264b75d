"""The README's zoo table from a `fuseguard verify --json` result.

    fuseguard verify $(python -c "from suites.models import zoo_models; print(*[m.name for m in zoo_models()])") \
        --json zoo.json
    python benchmarks/zoo_table.py zoo.json
"""

from __future__ import annotations

import json
import sys
from collections import Counter


def _err(build: dict) -> str:
    value = build.get("max_abs_error")
    return "error" if build.get("error") else ("-" if value is None else f"{value:.1e}")


def table(doc: dict) -> str:
    from fuseguard.suites.zoo import zoo_entry

    lines = ["| model | source | nodes | fused groups (pattern) | patterns fused | max err fused / unfused vs ORT "
             "| imported | verdict |", "|---|---|---|---|---|---|---|---|"]
    for m in doc["models"]:
        fused = m.get("fused") or {}
        rep = fused.get("report") or {}
        counts = Counter(g["pattern"] for g in rep.get("groups", []) if g["pattern"] != "generic")
        try:
            entry = zoo_entry(m["model"].removesuffix("_peaked"))
            source = f"{entry.source.split(' (')[0]}, {entry.exporter}" + \
                (", peaked softmax" if m["model"].endswith("_peaked") else "")
        except KeyError:
            source = "-"
        via = "ORT fold step" if rep.get("imported_via", "onnx") != "onnx" else "directly"
        lines.append(f"| {m['model']} | {source} | {m.get('nodes', '-')} | {fused.get('groups', '-')} "
                     f"({fused.get('pattern_groups', '-')}) | "
                     + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-")
                     + f" | {_err(fused)} / {_err(m.get('unfused') or {})} | {via} | {m.get('status')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.load(open(sys.argv[1]))))
