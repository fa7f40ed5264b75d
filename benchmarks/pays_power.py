"""Power and false-alarm rate of the fusion-pays gate (`verify/perf/pays.py`: fused slower than unfused beyond
5% fails), on real TVM builds.

Why a script: "would the pays gate catch a fused build 10% slower than its unfused one here, and does it
ever fail one that is not?" takes many fresh timing processes and depends on the host's noise.

Workload: benchmarks/ab_power.py's 10-layer Gemm+Relu stack. Each trial times two exported builds through
the pays gate's own loop (`pays.time_prepared_pays`: fresh processes, one fused/unfused ratio each, a 95%
t-interval, more processes while it straddles 1.05x). A/A trial: the "fused" and "unfused" libraries are
two copies of the same build (true ratio 1.00x). Slowed trial: the "fused" library is the build with
`benchmarks/plugins/extra_layer.py` (one more matmul, true ratio ~1.10x, measured and printed). Trials of
both kinds are shuffled so slow phases of the machine are spread over them.

    python benchmarks/pays_power.py                  # 30 A/A + 30 slowed trials, ~10 minutes
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab_power import run_trials, stack, summarise  # noqa: E402
from baseline_power import PLUGIN, true_slowdown  # noqa: E402

from fuseguard.compiler.plugins import env_for  # noqa: E402
from fuseguard.compiler.hw.target import host_cores  # noqa: E402
from fuseguard.verify.perf.pays import PAYS_FACTOR, time_prepared_pays  # noqa: E402
from fuseguard.verify.perf.timing import timing_env  # noqa: E402
from fuseguard.verify.worker import Worker  # noqa: E402


def export(model: Path, out: Path, env: dict[str, str]) -> None:
    """bench.prepare_bench into `out` (fused and unfused of `model`, with whatever plugin `env` loads)."""
    with Worker(env=env, forward_output=False) as w:
        w.call("fuseguard.verify.perf.bench:prepare_bench", what="compiling", timeout=900, source=str(model),
               directory=str(out))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--aa", type=int, default=30, help="A/A trials (default 30)")
    p.add_argument("--slow", type=int, default=30, help="slowed trials (default 30)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    threads = host_cores()
    env = timing_env(threads)
    pays_env = timing_env(threads, against_ort=False)   # as the pays gate times (TVM alone: its pool spins)
    with tempfile.TemporaryDirectory(prefix="pays-power-") as tmp:
        root = Path(tmp)
        model = root / "stack.onnx"
        model.write_bytes(stack(10).SerializeToString())
        export(model, root / "plain", env)
        export(model, root / "slowed", {**env, **env_for([str(PLUGIN)])})
        dirs = {"A/A": root / "aa", "+10%": root / "p10"}
        for kind, fused in (("A/A", root / "plain" / "fused.so"), ("+10%", root / "slowed" / "fused.so")):
            shutil.copytree(root / "plain", dirs[kind])
            shutil.copyfile(root / "plain" / "fused.so", dirs[kind] / "unfused.so")   # the same build both ways
            shutil.copyfile(fused, dirs[kind] / "fused.so")
            meta = json.loads((dirs[kind] / "meta.json").read_text())
            meta["unfused"] = meta["fused"]
            (dirs[kind] / "meta.json").write_text(json.dumps(meta))
        truth = true_slowdown(model, env)
        print(f"true slowdown of the slowed build, interleaved in one process: {truth:.3f}x", flush=True)
        kinds = ["A/A"] * args.aa + ["+10%"] * args.slow

        def one(kind: str) -> tuple[str, float, int, str]:
            result = time_prepared_pays(str(dirs[kind]), "stack", threads=threads, env=pays_env)
            return result.verdict, result.ratio, result.processes, result.line()

        verdicts, ratios, procs, elapsed = run_trials(kinds, one)
    print(f"\nfusion-pays gate power, {threads} threads, limit {PAYS_FACTOR}x, true slowdown {truth:.3f}x, "
          f"{len(kinds)} trials in {elapsed / 60:.1f} min ({elapsed / len(kinds):.1f} s per trial)")
    summary = summarise(verdicts, ratios, procs)
    for kind, c in summary.items():
        counts = ", ".join(f"{verdicts[kind][k]} {k}" for k in sorted(verdicts[kind]))
        print(f"{kind:5s}: {c['trials']} trials: {counts}; median ratio {c['median_ratio']:.3f}, "
              f"{c['mean_processes']:.1f} processes on average")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "true_slowdown": truth,
                                               "seconds_per_trial": elapsed / len(kinds)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
