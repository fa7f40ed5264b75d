"""The reduced-precision error table: per model and precision, fused and unfused RMSE against fp64.

    fuseguard verify MODEL... --precision fp16 --json fp16.json
    fuseguard verify MODEL... --precision bf16 --json bf16.json
    python benchmarks/precision_table.py fp16.json bf16.json

Columns: the worst output's RMSE against the fp64 run for the fused and the unfused build, their ratio
(the fp64 rule allows 3x), that output's RMS (the scale the errors are relative to), the fp64 engine and
the verdict. Markdown on stdout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(path: Path) -> list[list[str]]:
    data = json.loads(path.read_text())
    out = []
    for m in data["models"]:
        fp64 = (m.get("fused") or {}).get("fp64")
        precision = m.get("precision", "?")
        if not fp64 or not fp64.get("outputs"):
            why = next((w for w in m.get("warnings", []) if "fp64" in w), m.get("status", ""))
            out.append([m["model"], precision, "-", "-", "-", "-", "-", f"{m.get('status')} ({why[:60]})"])
            continue
        worst = max(fp64["outputs"], key=lambda o: o["fused_rmse"] / o["bound"] if o["bound"] else 0.0)
        ratio = worst["fused_rmse"] / worst["unfused_rmse"] if worst["unfused_rmse"] else float("inf")
        rms = (worst["bound"] - fp64["mult"] * worst["unfused_rmse"]) / {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}.get(
            precision, 1.0)
        engine = fp64["engine"].replace(" float64", "").replace(" (opset as given)", "")
        out.append([m["model"], precision, f"{worst['fused_rmse']:.3g}", f"{worst['unfused_rmse']:.3g}",
                    f"{ratio:.2f}x", f"{rms:.3g}", engine, m.get("status", "")])
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    header = ["model", "precision", "fused rmse vs fp64", "unfused rmse vs fp64", "fused / unfused",
              "output rms", "fp64 by", "verdict"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for path in argv:
        for r in rows(Path(path)):
            print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
