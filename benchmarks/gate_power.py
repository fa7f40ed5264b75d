"""Detection power and false-alarm rate of verify.perf.gate, measured with real timings on this machine.

Why a script and not a test: it answers "would the gate have caught a 10% regression here, and how
often does it cry wolf?", which takes minutes of real measurement and depends on the host's noise.

Workload: an ONNX Runtime session of a small MLP (3 x Gemm+Relu, built with onnx.helper) run K times
per call; a variant "+x%" runs it round(K * (1 + x)) times, so it does exactly x% more work (its true
slowdown is measured too and printed). The reference is a second, independent ORT session of the same
model measured interleaved with the candidate in every run, as fuseguard does with ONNX Runtime. A
baseline of the original is recorded once (through verify.perf.baselines.record), then the gate runs many
times per level, in shuffled order so slow phases of the machine are spread over all levels.

    python benchmarks/gate_power.py            # full run, a few minutes
    python benchmarks/gate_power.py --quick    # >= 20 runs per level, 40 unchanged, about a minute
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import multiprocessing.synchronize
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from rich.console import Console
from rich.table import Table
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fuseguard.verify.perf.baselines import Entry, Metadata, load_baselines, make_key, record  # noqa: E402
from fuseguard.verify.perf.gate import Gate, GatePolicy, GateResult, Measurement, Verdict  # noqa: E402
from fuseguard.verify.perf.timing import measure_interleaved  # noqa: E402

LEVELS = (0.05, 0.10, 0.20, 0.50)
K = 20  # session runs per call of the original: 21, 22, 24, 30 give exactly +5/10/20/50% work
BATCH, WIDTH, LAYERS = 32, 128, 3
THREADS = 1


def mlp_model(seed: int = 0) -> onnx.ModelProto:
    """A small Gemm+Relu MLP, the kind of subgraph fuseguard fuses."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(LAYERS):
        inits += [numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) * 0.05).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(np.zeros(WIDTH, np.float32), f"b{i}")]
        nodes += [helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [f"g{i}"]),
                  helper.make_node("Relu", [f"g{i}"], [f"r{i}"])]
        x = f"r{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, WIDTH])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [BATCH, WIDTH])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    from fuseguard.verify.perf.timing import ort_timing_options

    return ort.InferenceSession(model.SerializeToString(), ort_timing_options(THREADS),
                                providers=["CPUExecutionProvider"])


def _neighbour(seed: int, stop: multiprocessing.synchronize.Event) -> None:
    """A noisy co-tenant: bursts of busy spinning and idle gaps of random length (10-300 ms)."""
    rng = np.random.default_rng(seed)
    while not stop.is_set():
        until = time.perf_counter() + rng.uniform(0.01, 0.3)
        while time.perf_counter() < until:
            pass
        time.sleep(rng.uniform(0.01, 0.3))


@contextlib.contextmanager
def neighbours(count: int, seed: int) -> Iterator[None]:
    """Run ``count`` bursty CPU hogs for the duration of the block (the 2-core CI host on a bad day)."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_neighbour, args=(seed + i, stop), daemon=True) for i in range(count)]
    for proc in procs:
        proc.start()
    try:
        yield
    finally:
        stop.set()
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


@dataclass
class LevelStats:
    results: list[GateResult] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    stats_seconds: list[float] = field(default_factory=list)


def preempted_share(results: list[GateResult]) -> float:
    """Share of all samples taken (candidate and reference) that the OS preempted and the gate set aside."""
    aside = sum(r.set_aside for r in results)
    return aside / max(1, aside + sum(2 * r.n_candidate for r in results))


def rate_ci(k: int, n: int) -> tuple[float, float]:
    """Clopper-Pearson 95% interval: 0 of 40 false alarms still allows a 9% rate, and the table should say so."""
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return ci.low, ci.high


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 runs per level and 40 unchanged runs (~1 minute)")
    parser.add_argument("--runs", type=int, help="gate runs per slowdown level (default 60, quick 20)")
    parser.add_argument("--null-runs", type=int, help="gate runs with no change (default 500, quick 40)")
    parser.add_argument("--baselines", type=int, help="baselines recorded, spread over the run (default 5, quick 2)")
    parser.add_argument("--repeats", type=int, default=15, help="samples per gate run before adaptive sampling")
    parser.add_argument("--baseline-repeats", type=int, default=50, help="samples in the recorded baseline")
    parser.add_argument("--neighbours", type=int, default=0, metavar="N",
                        help="also run N bursty CPU hogs throughout (a noisy co-tenant); 0 = as the machine is")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runtime", choices=["ort", "tvm"], default="ort",
                        help="what the candidate runs: ORT (default) or the fuseguard-compiled TVM build of the "
                             "same MLP, gated against ORT as the reference as `pytest` does")
    args = parser.parse_args(argv)
    if args.runtime == "tvm":  # before TVM's runtime starts its thread pool
        from fuseguard.verify.perf.timing import timing_env

        os.environ.update(timing_env(THREADS))
    with neighbours(args.neighbours, args.seed):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    runs = args.runs or (20 if args.quick else 60)
    null_runs = args.null_runs or (40 if args.quick else 500)
    n_baselines = args.baselines or (2 if args.quick else 5)
    console = Console() if sys.stdout.isatty() else Console(width=190)
    started = time.perf_counter()

    model = mlp_model()
    cand_sess, ref_sess = session(model), session(model)
    feed = {"x": np.random.default_rng(1).standard_normal((BATCH, WIDTH)).astype(np.float32)}

    def workload(sess: ort.InferenceSession, k: int):
        def call() -> None:
            for _ in range(k):
                sess.run(None, feed)
        return call

    reference = workload(ref_sess, K)
    if args.runtime == "tvm":
        from fuseguard.compiler.pipeline import compile_model

        once = compile_model(model).time_fn(feed)

        def tvm_workload(k: int):
            def call() -> None:
                for _ in range(k):
                    once()
            return call

        variants = {0.0: tvm_workload(K)} | {lvl: tvm_workload(round(K * (1 + lvl))) for lvl in LEVELS}
    else:
        variants = {0.0: workload(cand_sess, K)} | {lvl: workload(cand_sess, round(K * (1 + lvl))) for lvl in LEVELS}

    def run(level: float, n: int, warmup: int = 1) -> Measurement:
        got = measure_interleaved({"candidate": variants[level], "reference": reference}, warmup=warmup,
                                  repeats=n, min_time_s=0.0, threads=THREADS)
        return Measurement.of(got["candidate"], got["reference"], "onnxruntime")

    # Ground truth: each variant against the original, interleaved, many samples.
    console.print(f"[bold]gate power[/]: {args.runtime.upper()} MLP {LAYERS}x{WIDTH} batch {BATCH}, {THREADS} thread, "
                  f"{K} runs per call, {os.cpu_count()} CPUs, {args.neighbours} noisy neighbours; "
                  f"measuring true slowdowns ...")
    truth: dict[float, float] = {0.0: 1.0}
    for lvl in LEVELS:  # median over 5 interleaved blocks: one block can land in a burst of load
        blocks = []
        for _ in range(5):
            got = measure_interleaved({"orig": variants[0.0], "var": variants[lvl]}, warmup=2, repeats=40,
                                      min_time_s=0.0)
            blocks.append(np.median(got["var"].usable_ms) / np.median(got["orig"].usable_ms))
        truth[lvl] = float(np.median(blocks))

    key = make_key(f"mlp{LAYERS}x{WIDTH}", {"x": [BATCH, WIDTH]}, "fused")
    meta = Metadata.collect(f"{os.cpu_count()}-CPU host", threads=THREADS, reference_kind="onnxruntime")
    gate = Gate(GatePolicy())
    schedule = [(lvl, i) for lvl in LEVELS for i in range(runs)] + [(0.0, i) for i in range(null_runs)]
    np.random.default_rng(args.seed).shuffle(schedule)
    chunks = np.array_split(np.arange(len(schedule)), n_baselines)
    per_level: dict[float, LevelStats] = {lvl: LevelStats() for lvl in (0.0, *LEVELS)}
    normalised_baselines: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, console.status("gating") as status:
        path = Path(tmp) / "cpu-bench-2c.json"
        for chunk in chunks:
            # A fresh baseline per chunk: detection at the boundary depends on how lucky the one baseline
            # was, so the rates below average over several, as over several teams' baseline files.
            base_run = measure_interleaved({"candidate": variants[0.0], "reference": reference}, warmup=5,
                                           repeats=args.baseline_repeats, min_time_s=0.0, threads=THREADS)
            record(path, key, Entry.from_samples(base_run["candidate"], meta, reference_ms=base_run["reference"]))
            baselines = load_baselines(path)
            entry = baselines.lookup(key)
            assert entry is not None and entry.normalised is not None
            normalised_baselines.append(entry.normalised)
            for done in chunk:
                lvl = schedule[done][0]
                status.update(f"gate run {done + 1}/{len(schedule)}")
                measuring = 0.0

                def more(n: int, lvl: float = lvl) -> Measurement:
                    nonlocal measuring
                    t = time.perf_counter()
                    got = run(lvl, n)
                    measuring += time.perf_counter() - t
                    return got

                t0 = time.perf_counter()
                result = gate.check(key, more(args.repeats), baselines, more=more)
                total = time.perf_counter() - t0
                bucket = per_level[lvl]
                bucket.results.append(result)
                bucket.seconds.append(total)
                bucket.stats_seconds.append(total - measuring)
    console.print(f"{n_baselines} baselines of {args.baseline_repeats} samples, normalised medians "
                  + ", ".join(f"{v:.4f}" for v in normalised_baselines))

    table = Table(title=f"verify.perf.gate on real timings (factor {gate.default.factor:g}, alpha {gate.default.alpha:g}, "
                        f"{args.repeats} samples then adaptive up to {gate.default.max_samples})")
    for col in ("change", "true slowdown", "runs", "slower/same/faster/inconcl.", "flagged slower (95% CI)",
                "median ratio", "mean n", "preempted", "gate s/model", "stats s/model"):
        table.add_column(col, justify="right")
    for lvl, bucket in per_level.items():
        counts = Counter(r.verdict for r in bucket.results)
        n = len(bucket.results)
        k = counts[Verdict.SLOWER]
        lo, hi = rate_ci(k, n)
        table.add_row("none" if lvl == 0 else f"+{lvl:.0%}", f"{truth[lvl]:.3f}x", str(n),
                      "/".join(str(counts[v]) for v in (Verdict.SLOWER, Verdict.SAME, Verdict.FASTER,
                                                         Verdict.INCONCLUSIVE)),
                      f"{k / n:.1%} ({lo:.1%}-{hi:.1%})",
                      f"{np.median([r.ratio for r in bucket.results]):.3f}",
                      f"{np.mean([r.n_candidate for r in bucket.results]):.0f}",
                      f"{preempted_share(bucket.results):.0%}",
                      f"{np.median(bucket.seconds):.2f}", f"{np.median(bucket.stats_seconds):.3f}")
    console.print(table)
    null = per_level[0.0].results
    ten = per_level[0.10].results
    alarms = sum(r.verdict is not Verdict.SAME for r in null)
    console.print(f"10% slowdown detected in {sum(r.regressed for r in ten) / len(ten):.1%} of runs (target >= 95%); "
                  f"unchanged model flagged slower in {sum(r.regressed for r in null) / len(null):.1%} "
                  f"(target <= 1%), any verdict but same in {alarms / len(null):.1%}")
    for lvl, bucket in per_level.items():
        console.print(f"  e.g. {'unchanged' if lvl == 0 else f'+{lvl:.0%}'}: {bucket.results[0]}", highlight=False)
    console.print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
