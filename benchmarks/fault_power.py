"""Verification power per kind of fused kernel: faults placed in one fused kernel of the fused build only.

For every real export of the zoo (or --models), every kind of fused kernel the build makes (each pattern,
the tiled attention kernel, TVM's generic FuseOps groups) gets faults of both families
(`verify/debug/faults.py`): structure kept (scale, shift, float16 rounding) and an operation added or
dropped (negatives clipped, the outermost operation dropped), at one call site (the middle one of that
kind). Each fault runs `fuseguard bisect` with its reproducer check; the table counts per kind: caught (the
fused build fails against ONNX Runtime, as `fuseguard verify` says), localised (bisect named the faulty
kernel), proven (and its reproducer fails on its own), wrong blame; faults whose effect stayed under the
tolerance are listed apart with their size. A clean run per model counts false alarms.

    python benchmarks/fault_power.py [--models llama_tiny,vit_tiny] [--faults scale:0.1,drop] [--json out.json]

`--sample` is the CI sample (tests/test_fault_power.py runs a few of the same faults).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1].parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

DEFAULT_FAULTS = "scale:0.1,scale:0.01,shift:0.1,round,clip,drop"


def _parse_faults(text: str) -> list[tuple[str, float]]:
    out = []
    for part in text.split(","):
        kind, _, size = part.partition(":")
        out.append((kind.strip(), float(size) if size else 0.1))
    return out


def pick_sites(sites: list, per_kind: int = 1) -> list:
    """`per_kind` call sites of each kind, spread over its calls: with one, the lower middle call
    (index len // 2 - 1: the last of the first half, past the first layer's unique names and shapes)."""
    by_kind: dict[str, list] = defaultdict(list)
    for s in sites:
        by_kind[s.kind].append(s)
    chosen = []
    for group in by_kind.values():
        step = max(1, len(group) // (per_kind + 1))
        if per_kind == 1:
            chosen.append(group[max(0, step - 1)])
        else:
            chosen.extend(group[min(len(group) - 1, step * (i + 1))] for i in range(min(per_kind, len(group))))
    return chosen


def main(argv: list[str] | None = None) -> int:
    from fuseguard.compiler.frontend.loader import load
    from fuseguard.compiler.pipeline import CompileOptions
    from fuseguard.suites.zoo import load_zoo_model, zoo_entries, zoo_entry
    from fuseguard.verify.debug.bisect import bisect_model
    from fuseguard.verify.debug.faults import FaultOutcome, fused_sites, prepared, run_fault

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="zoo models (default: every fast static one)")
    parser.add_argument("--faults", default=DEFAULT_FAULTS, help=f"kind[:size],... (default {DEFAULT_FAULTS})")
    parser.add_argument("--per-kind", type=int, default=1, help="call sites per kind of kernel")
    parser.add_argument("--json", default=None, help="write every outcome here (JSON lines, as they come)")
    args = parser.parse_args(argv)
    names = args.models.split(",") if args.models else [e.name for e in zoo_entries()
                                                          if not e.slow and not e.dynamic]
    faults = _parse_faults(args.faults)
    console = Console()
    outcomes: list[FaultOutcome] = []
    false_alarms: dict[str, str] = {}
    sink = open(args.json, "a") if args.json else None
    for name in names:
        entry = zoo_entry(name)
        loaded = prepared(load(load_zoo_model(name, seed=0), {k: v[0] for k, v in entry.inputs.items()}, name=name))
        options = CompileOptions()
        with tempfile.TemporaryDirectory() as tmp:
            clean = bisect_model(loaded, options=options, out_dir=tmp, confirm=False)
        if clean.status != "no-drift":
            false_alarms[name] = clean.summary()
        sites = pick_sites(fused_sites(loaded, options), args.per_kind)
        console.print(f"[bold]{name}[/]: clean {clean.status}; sites {[(s.kind, s.kernel, s.call) for s in sites]}")
        for site in sites:
            for kind, size in faults:
                with tempfile.TemporaryDirectory() as tmp:
                    try:
                        out = run_fault(loaded, options, site, kind, size, tmp)
                    except Exception as err:  # noqa: BLE001 - a fault the harness could not run is a row, not the end
                        out = FaultOutcome(name, site, kind, size, applied=False,
                                           detail=f"{type(err).__name__}: {err}")
                outcomes.append(out)
                mark = ("n/a" if not out.applied else "below tol" if out.below_tolerance else
                        "PROVEN" if out.proven else "localised" if out.localised else
                        "caught" if out.caught else "MISSED")
                console.print(f"  {site.kind:18s} {kind}:{size:<6g} {mark:10s} effect {out.effect:.3g} "
                              f"{out.seconds:5.1f}s {out.blamed or ''} {out.detail[:160] if mark in ('n/a', 'caught', 'MISSED') else ''}")
                if sink:
                    row = asdict(out)
                    sink.write(json.dumps(row, default=str) + "\n")
                    sink.flush()
    table = Table(title="fault-injection power per kind of fused kernel")
    for col in ("kind", "faults", "caught", "localised", "proven", "wrong blame", "below tolerance", "n/a"):
        table.add_column(col, justify="right" if col != "kind" else "left")
    per: dict[str, list[FaultOutcome]] = defaultdict(list)
    for o in outcomes:
        per[o.site.kind].append(o)
    for kind, rows in sorted(per.items()):
        live = [o for o in rows if o.applied and not o.below_tolerance]
        table.add_row(kind, str(len(live)), f"{sum(o.caught for o in live)}/{len(live)}",
                      f"{sum(o.localised for o in live)}/{len(live)}", f"{sum(o.proven for o in live)}/{len(live)}",
                      str(sum(bool(o.blamed) for o in live)),
                      ", ".join(f"{o.fault}:{o.size:g} ({o.effect:.2g})" for o in rows if o.applied and o.below_tolerance) or "0",
                      str(sum(not o.applied for o in rows)))
    console.print(table)
    console.print(f"false alarms (clean builds): {len(false_alarms)}/{len(names)} {false_alarms or ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
