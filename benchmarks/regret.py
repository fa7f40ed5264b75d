"""Is the cost model right? Per fused pattern group: predicted saving vs measured saving, and regret.

    python benchmarks/regret.py bert_encoder resnet50 llama_tiny ... [--repeats 20] [--db FILE|'']

For every pattern group of each model's fused build, `verify.perf.profile` times the fused kernel and the
unfused kernels of the same ONNX nodes. Printed per model: Spearman rank correlation of predicted vs
measured saving (with `--runs N`, of each group's median saving over N profiles, and each run's own rho);
the ceiling of that correlation, the square root of the measurement's reliability (one run: odd rounds against
even rounds over the groups read from the model run, `verify.perf.profile.split_half_reliability`; several: the runs
against each other, replayed groups included), so a rho near the ceiling is as good as the profile can tell; fused
groups slower than their parts (by > 5%), and regret: the time lost against the
better choice per group (a fused group measured slower than its parts costs the difference), summed, in
us and as a share of the model's fused time; then the groups slower beyond noise ("sure": the saving's
95% interval over the paired rounds lies below 0, `ProfileResult.sure_losses`; with `--runs`, of the first run)
and the regret they carry.
A sum of shortfalls grows with noise alone: a group whose true saving is 0 reads a shortfall half the
time. Regret covers the groups the model chose to fuse; a match it refused is not timed fused. `--db ''` (the default) decides with the estimate alone; pass a decision
database (written by `fuseguard tune`) to see the effect of measured decisions. `--confirm` also builds the
model with each losing group split back and times it against the fused build, interleaved
(`verify.perf.tune.confirm_splits`): "confirmed regret" counts a loss only where the split whole model ran faster
with its 95% interval below 1. Groups whose in-model times the two builds' memory plans set (one side's inputs or
output out of the caches, the other's not: `verify.perf.profile.plan_bound`) are read from replays.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

from fuseguard.compiler.hw.target import host_cores  # noqa: E402
from fuseguard.verify.perf.timing import timing_env  # noqa: E402

# As `fuseguard profile` runs: all cores, TVM's pool spinning. Left to TVM's default, this 2-vCPU Zen3 VM got
# ONE thread (TVM counts it as one physical core), so every figure here was single-threaded while `bench`
# used two. Set before the first kernel runs: the pool reads it when it starts.
os.environ.update(timing_env(host_cores(), against_ort=False))

from fuseguard.compiler.pipeline import CompileOptions  # noqa: E402
from fuseguard.verify.check.model import resolve_model_arg  # noqa: E402
from fuseguard.verify.perf.profile import profile_model, split_half_reliability  # noqa: E402


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--db", default="", help="decision database ('' = estimate only)")
    p.add_argument("--confirm", action="store_true", help="time each losing group split back in the whole model")
    p.add_argument("--groups", action="store_true", help="print every group: predicted and measured saving, "
                   "and whether it was read from the model run or from replays")
    p.add_argument("--runs", type=int, default=1, help="profile each model this many times and rank the median "
                   "saving of each group; the ceiling then comes from the runs' agreement, replayed groups included")
    args = p.parse_args(argv)
    print(f"{'model':28s} {'groups':>6s} {'rho':>6s} {'per run':>11s} {'ceiling':>7s} {'slower':>6s} "
          f"{'regret us':>10s} {'regret %':>9s} {'sure':>5s} {'beyond noise':>12s} {'fused ms':>9s} "
          f"{'unfused ms':>10s}")
    for name in args.models:
        results = [profile_model(resolve_model_arg(name), options=CompileOptions(decision_db=args.db),
                                 repeats=args.repeats) for _ in range(max(1, args.runs))]
        runs = [[g for g in r.groups if g.pattern not in ("generic", "single op") and g.parts] for r in results]
        result, groups = results[0], runs[0]
        if any(len(run) != len(groups) for run in runs):
            raise SystemExit(f"{name}: the runs built different groups")
        predicted = [g.predicted_us for g in groups]
        by_run = [[g.saving_us for g in run] for run in runs]
        measured = [float(np.median(column)) for column in zip(*by_run)]
        rho = _rho(predicted, measured)
        per_run = [_rho(predicted, savings) for savings in by_run]
        reliability = split_half_reliability(groups) if len(runs) == 1 else _between_runs(by_run)
        ceiling = math.sqrt(max(0.0, reliability)) if reliability is not None else float("nan")
        regret = sum(max(0.0, -m) for m in measured)
        slower = len([g for g, m in zip(groups, measured) if m < -0.05 * g.parts_us])
        total = float(np.median([r.fused_total_us for r in results]))
        sure = [g for g in result.sure_losses() if g in groups]
        beyond = sum(-g.saving_us for g in sure)
        spread = f"{min(per_run):.2f}-{max(per_run):.2f}" if len(per_run) > 1 else ""
        print(f"{name:28s} {len(groups):6d} {rho:6.2f} {spread:>11s} {ceiling:7.2f} {slower:6d} {regret:10.1f} "
              f"{100 * regret / total:8.2f}% {len(sure):5d} {100 * beyond / total:11.2f}% {total / 1e3:9.2f} "
              f"{result.unfused_total_us / 1e3:10.2f}")
        if args.confirm:
            from fuseguard.verify.perf.tune import confirm_splits

            losing = sorted({g.key for g in groups if g.saving_us < 0 and g.key})
            confirmed = confirm_splits(resolve_model_arg(name), losing,
                                       options=CompileOptions(decision_db=args.db))
            lost = sum((1 - ratio) * total for ratio, (_, hi) in confirmed.values() if hi < 1.0)
            # Not used for rho: a whole-model difference of 1-2% between two builds of one process is as often the
            # builds' different memory plans as the group (EfficientNet-B0's 10 us SE-block groups read +-2%).
            print(f"    confirmed regret {lost:.1f} us ({100 * lost / total:.2f}%): " + ", ".join(
                f"split {ratio:.3f}x [{lo:.3f}, {hi:.3f}]" for ratio, (lo, hi) in confirmed.values()))
        for g in sorted(groups, key=lambda g: g.saving_us)[:None if args.groups else 3]:
            detail = (f"{g.fused_us:.1f} vs {g.parts_us:.1f}, {g.timing}; {g.kernel[:40]}" if args.groups
                      else g.kernel[:50])
            if args.groups or g.saving_us < 0:
                print(f"    {g.pattern:18s} predicted {g.predicted_us:7.1f} us, measured {g.saving_us:7.1f} us "
                      f"({detail})")
    return 0


def _rho(predicted: list[float], measured: list[float]) -> float:
    return float(stats.spearmanr(predicted, measured).statistic) if len(predicted) >= 3 else float("nan")


def _between_runs(by_run: list[list[float]]) -> float | None:
    """Reliability of the median over the runs: the mean rank correlation between two runs' savings, stepped up
    to all runs (Spearman-Brown)."""
    pairs = [_rho(a, b) for i, a in enumerate(by_run) for b in by_run[i + 1:]]
    r = float(np.mean(pairs)) if pairs else float("nan")
    n = len(by_run)
    return n * r / (1 + (n - 1) * r) if math.isfinite(r) and r > -1 / (n - 1) else None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
