"""Power and false-alarm rate of the STORED-baseline gate (`fuseguard baseline update|check`), with the
baseline re-recorded every round, on real TVM builds.

Why a script: the round-to-round failure issues 13 and 16 describe (a baseline recorded in one process
carries that process's speed mode: in one series two baselines came out slow and every later check read
0.72-0.82x) shows only across many recordings of real builds on a real machine.

Workload: the Gemm+Relu stack of benchmarks/ab_power.py, 10 layers (A) and 11 layers (B: exactly +10% work,
same inputs and outputs), each saved as `stack.onnx` so both land under one baseline key. Each round
records A's baseline with `verify.latency.gate_model(update=True)` (what `fuseguard baseline update` runs),
then checks A (A/A: a false alarm if "slower") and B (+10%: a miss unless "slower") in shuffled order, each
check a fresh `gate_model` call as `fuseguard baseline check` makes it. B is a different model, so its
check would be refused as "model changed since the baseline": the benchmark blanks the recorded model and
options hashes (as in a baseline written before they were recorded) so that only the timing is tested.

    python benchmarks/baseline_power.py                     # 5 rounds x (5 A/A + 5 at +10%), ~15 minutes
    python benchmarks/baseline_power.py --processes 1       # the one-process recording of earlier releases
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab_power import stack  # noqa: E402

from fuseguard.compiler.pipeline import CompileOptions  # noqa: E402
from fuseguard.compiler.target import host_cores  # noqa: E402
from fuseguard.verify.baselines import load_baselines, record  # noqa: E402
from fuseguard.verify.gate import Gate, GatePolicy  # noqa: E402
from fuseguard.verify.latency import gate_model  # noqa: E402
from fuseguard.verify.timing import timing_env  # noqa: E402
from fuseguard.verify.worker import Worker  # noqa: E402


def blank_hashes(path: Path, key: str) -> None:
    entry = load_baselines(path).lookup(key)
    assert entry is not None, key
    record(path, key, replace(entry, metadata=replace(entry.metadata, model_sha256=None, options_sha256=None)))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--checks", type=int, default=5, help="checks of each kind per round (default 5)")
    p.add_argument("--processes", type=int, default=3, help="fresh processes per recording and check (default 3)")
    p.add_argument("--factor", type=float, default=1.10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    threads = host_cores()
    gate = Gate(GatePolicy(factor=args.factor))
    options = CompileOptions()
    rows = []
    verdicts: dict[str, Counter] = {"A/A": Counter(), "+10%": Counter()}
    ratios: dict[str, list[float]] = {"A/A": [], "+10%": []}
    seconds: list[float] = []
    with tempfile.TemporaryDirectory(prefix="baseline-power-") as tmp, \
            Worker(env=timing_env(threads), forward_output=False) as worker:
        models = {}
        for label, layers in (("A/A", 10), ("+10%", 11)):
            folder = Path(tmp) / f"l{layers}"
            folder.mkdir()
            (folder / "stack.onnx").write_bytes(stack(layers).SerializeToString())
            models[label] = folder / "stack.onnx"
        start = time.perf_counter()
        for rnd in range(1, args.rounds + 1):
            path = Path(tmp) / f"round{rnd}" / "cpu-bench-2c.json"
            path.parent.mkdir()
            t0 = time.perf_counter()
            _, run, key = gate_model(worker, models["A/A"], options=options, path=path, update=True, gate=gate,
                                     processes=args.processes)
            record_s = time.perf_counter() - t0
            blank_hashes(path, key)
            normalised = run.candidate.median_ms / run.reference.median_ms
            kinds = ["A/A"] * args.checks + ["+10%"] * args.checks
            random.Random(rnd).shuffle(kinds)
            got: dict[str, Counter] = {"A/A": Counter(), "+10%": Counter()}
            for kind in kinds:
                t0 = time.perf_counter()
                result, _, _ = gate_model(worker, models[kind], options=options, path=path, gate=gate,
                                          processes=args.processes)
                seconds.append(time.perf_counter() - t0)
                got[kind][result.verdict.value] += 1
                verdicts[kind][result.verdict.value] += 1
                ratios[kind].append(float(result.ratio or float("nan")))
                print(f"round {rnd} {kind}: {result.line()}", flush=True)
            rows.append({"round": rnd, "baseline_normalised": normalised, "record_s": record_s,
                         "aa": dict(got["A/A"]), "slow": dict(got["+10%"])})
            print(f"round {rnd}: baseline {normalised:.4f}x ORT (recorded in {record_s:.0f} s); "
                  f"A/A slower {got['A/A']['slower']}/{args.checks}, +10% slower {got['+10%']['slower']}/{args.checks}",
                  flush=True)
        elapsed = time.perf_counter() - start
    print(f"\nstored-baseline gate, {threads} threads, factor {args.factor}, {args.processes} process(es) per "
          f"measurement, {args.rounds} rounds re-recorded, {elapsed / 60:.1f} min "
          f"({np.median(seconds):.1f} s median per check)")
    print(f"{'round':>5s} {'baseline/ORT':>12s} {'A/A slower':>10s} {'+10% slower':>11s}")
    for r in rows:
        print(f"{r['round']:5d} {r['baseline_normalised']:12.4f} {r['aa'].get('slower', 0):10d} "
              f"{r['slow'].get('slower', 0):11d}")
    summary = {}
    for kind, c in verdicts.items():
        n = sum(c.values())
        print(f"{kind:5s}: {n} checks: " + ", ".join(f"{v} {k}" for k, v in sorted(c.items()))
              + f"; median ratio {np.nanmedian(ratios[kind]):.3f}")
        summary[kind] = {"checks": n, **c, "median_ratio": float(np.nanmedian(ratios[kind]))}
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rows, "summary": summary, "processes": args.processes,
                                               "seconds_per_check": float(np.median(seconds))}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
