"""Power and false-alarm rate of the A/B gate (`fuseguard gate`), on real TVM builds of both arms.

Why a script: "would the A/B gate catch a 10% regression on this machine, and how often does it cry wolf?"
takes many minutes of real timing and depends on the host's noise.

Workload: a stack of N identical Gemm+Relu layers (64 x 512, width 512), compiled by fuseguard. The slowed
arm is the same stack with 11 layers instead of 10 (+10% work, same inputs and outputs), or 15 (+50%); the
unchanged arm is a second, separate compile of the 10-layer stack (an A/A trial). Each trial times its two
builds and ONNX Runtime exactly as `fuseguard gate` does (`verify.perf.ab.time_arms` in fresh processes, half
of them loading the candidate first, more processes while unclear) and takes `verify.perf.ab.decide`'s verdict.
Trials of all kinds are shuffled so slow phases of the machine are spread over them.

    python benchmarks/ab_power.py                 # 40 A/A + 40 at +10% + 10 at +50%, ~15 minutes
    python benchmarks/ab_power.py --aa 300 --slow 100    # the issue's sample sizes (about an hour)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fuseguard.compiler.frontend.loader import load  # noqa: E402
from fuseguard.compiler.pipeline import CompileOptions, compile_model  # noqa: E402
from fuseguard.compiler.hw.target import host_cores  # noqa: E402
from fuseguard.verify.perf.ab import decide  # noqa: E402
from fuseguard.verify.perf.gate import GatePolicy, Verdict  # noqa: E402
from fuseguard.verify.perf.timing import timing_env  # noqa: E402
from fuseguard.verify.worker import Worker  # noqa: E402

ROWS, WIDTH = 64, 512


def stack(layers: int):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) * (1 / WIDTH ** 0.5)).astype(np.float32), "w")
    b = numpy_helper.from_array(np.zeros(WIDTH, np.float32), "b")
    nodes, x = [], "x"
    for i in range(layers):
        nodes += [helper.make_node("Gemm", [x, "w", "b"], [f"g{i}"]), helper.make_node("Relu", [f"g{i}"], [f"r{i}"])]
        x = f"r{i}"
    graph = helper.make_graph(nodes, f"stack{layers}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, WIDTH])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [ROWS, WIDTH])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def prepare(directory: Path, base_layers: int, cand_layers: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    meta = {}
    for label, layers in (("base", base_layers), ("candidate", cand_layers)):
        model = stack(layers)
        compiled = compile_model(load(model, None, name=f"stack{layers}"), options=CompileOptions())
        compiled.executable.export_library(str(directory / f"{label}.so"))
        meta[label] = {"input_names": compiled.input_names}
        if label == "base":
            (directory / "model.onnx").write_bytes(model.SerializeToString())
    np.savez(directory / "inputs.npz", x=np.random.default_rng(1).standard_normal((ROWS, WIDTH)).astype(np.float32))
    (directory / "meta.json").write_text(json.dumps(meta))


def trial(directory: Path, threads: int, processes: int, repeats: int, policy: GatePolicy) -> tuple[Verdict, float, int]:
    env = timing_env(threads)
    count = [0]

    def one() -> dict[str, list[float]]:
        count[0] += 1
        with Worker(env=env, forward_output=False) as w:
            return w.call("fuseguard.verify.perf.ab:time_arms", what="timing", timeout=600, directory=str(directory),
                          threads=threads, repeats=repeats, flip=count[0] % 2 == 0)

    runs = [one() for _ in range(processes)]
    extra = [8 - processes]

    def more():
        if extra[0] <= 0:
            return None
        extra[0] -= 1
        return one()

    result = decide("stack", runs, policy, more)
    return result.verdict, float(result.ratio or float("nan")), len(runs)


def run_trials(kinds: list[str], one) -> tuple[dict[str, Counter], dict[str, list[float]], dict[str, list[int]], float]:
    """Run `one(kind) -> (verdict, ratio, processes, line)` for the kinds shuffled (slow phases of the machine
    spread over all kinds); per kind the verdict counts, ratios and process counts, and the seconds taken."""
    order = list(kinds)
    random.Random(0).shuffle(order)
    verdicts: dict[str, Counter] = {k: Counter() for k in dict.fromkeys(kinds)}
    ratios: dict[str, list[float]] = {k: [] for k in verdicts}
    procs: dict[str, list[int]] = {k: [] for k in verdicts}
    start = time.perf_counter()
    for i, kind in enumerate(order, 1):
        verdict, ratio, n, line = one(kind)
        verdicts[kind][verdict] += 1
        ratios[kind].append(ratio)
        procs[kind].append(n)
        print(f"[{i}/{len(order)}] {kind}: {line}", flush=True)
    return verdicts, ratios, procs, time.perf_counter() - start


def summarise(verdicts: dict[str, Counter], ratios: dict[str, list[float]],
              procs: dict[str, list[int]]) -> dict[str, dict]:
    """Per kind of trial: the count of each verdict, the median ratio and the mean processes a trial took."""
    return {kind: {"trials": sum(c.values()), **c, "median_ratio": float(np.median(ratios[kind])),
                   "mean_processes": float(np.mean(procs[kind]))}
            for kind, c in verdicts.items() if sum(c.values())}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--aa", type=int, default=40, help="A/A trials (default 40)")
    p.add_argument("--slow", type=int, default=40, help="+10%% trials (default 40)")
    p.add_argument("--big", type=int, default=10, help="+50%% trials (default 10)")
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    threads = host_cores()
    policy = GatePolicy(factor=1.10)
    with tempfile.TemporaryDirectory(prefix="ab-power-") as tmp:
        dirs = {"A/A": Path(tmp) / "aa", "+10%": Path(tmp) / "p10", "+50%": Path(tmp) / "p50"}
        prepare(dirs["A/A"], 10, 10)
        prepare(dirs["+10%"], 10, 11)
        prepare(dirs["+50%"], 10, 15)
        kinds = ["A/A"] * args.aa + ["+10%"] * args.slow + ["+50%"] * args.big

        def one(kind: str) -> tuple[str, float, int, str]:
            verdict, ratio, n = trial(dirs[kind], threads, args.processes, args.repeats, policy)
            return verdict.value, ratio, n, f"{verdict.value} {ratio:.3f}x ({n} processes)"

        verdicts, ratios, procs, elapsed = run_trials(kinds, one)
    print(f"\nA/B gate power, {threads} threads, factor 1.10, {len(kinds)} trials in {elapsed / 60:.1f} min "
          f"({elapsed / len(kinds):.1f} s per trial)")
    print(f"{'arm':6s} {'trials':>6s} {'slower':>7s} {'same':>5s} {'faster':>6s} {'inconcl.':>8s} "
          f"{'median ratio':>12s} {'processes':>9s}")
    summary = summarise(verdicts, ratios, procs)
    for kind, c in summary.items():
        print(f"{kind:6s} {c['trials']:6d} {c.get('slower', 0):7d} {c.get('same', 0):5d} {c.get('faster', 0):6d} "
              f"{c.get('inconclusive', 0):8d} {c['median_ratio']:12.3f} {c['mean_processes']:9.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
