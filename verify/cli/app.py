"""The `fuseguard` parser (every sub-command's options) and `main`, which dispatches to the handlers and turns
any error into one line and its exit code (cli/__init__.py lists the codes)."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence

from fuseguard.compiler.errors import FuseguardError
from .common import EXIT_INTERNAL, EXIT_USAGE, Parser, add_build_options_only, add_model_and_build_options
from .perf import cmd_baseline, cmd_bench, cmd_gate, cmd_profile, cmd_tune
from .tools import cmd_cache, cmd_conformance, cmd_device_bundle, cmd_env, cmd_patterns, cmd_reduce
from .verify import cmd_compile, cmd_verify

def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fuseguard", description="Operator-fusion compiler on TVM Relax, and its verifier.")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)

    v = sub.add_parser("verify", help="compile fused and unfused, run both and ONNX Runtime, compare")
    v.add_argument("models", nargs="*", metavar="MODEL", help="ONNX files or built-in suite model names "
                   "(none: the whole built-in suite)")
    add_model_and_build_options(v)
    from ..options import add_compare_options

    add_compare_options(v.add_argument)
    v.add_argument("--output-tol", action="append", default=[], metavar="NAME=ATOL[,RTOL]",
                   help="tolerance for one output, e.g. logits=1e-3,1e-3 (repeatable)")
    v.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    v.add_argument("--html", default=None, metavar="FILE", help="write a self-contained HTML report (verdicts, "
                   "error statistics and plots per output, fusion groups and their reasons, memory traffic)")
    v.add_argument("--report", action="store_true", help="print each build's fusion report")
    v.add_argument("--profile", action="store_true", help="also time every kernel of both builds (as `fuseguard "
                   "profile`, through the build cache) and put each fused group's time beside its unfused parts "
                   "in --json and --html")
    v.add_argument("--quick", action="store_true", help="built-in suite without the slow real models")
    v.add_argument("--artifact", action="append", default=[], metavar="DIR",
                   help="re-verify a build written by `fuseguard compile --out DIR` without compiling "
                        "(repeatable; the models and build options are then ignored)")

    cp = sub.add_parser("compile", help="write the deployable fused build per architecture, verified, with a "
                                        "manifest (versions, decisions, verdict)")
    cp.add_argument("models", nargs="+", metavar="MODEL", help="ONNX files or suite model names")
    add_model_and_build_options(cp)
    cp.add_argument("--out", required=True, metavar="DIR", help="DIR/<arch class>/ gets model.so, model.onnx, "
                    "manifest.json (one model: DIR itself; several: DIR/<model>/...)")
    cp.add_argument("--seed", type=int, default=0, help="seed of the verification inputs (default 0)")

    from ..options import non_negative_float, percentage, positive_int
    from ..perf.timing import SAMPLE_BUDGET_S, THREAD_POOLS

    b = sub.add_parser("bench", help="time TVM fused / unfused against ONNX Runtime (a benchmark, not a test)")
    b.add_argument("models", nargs="*", metavar="MODEL", help="ONNX files or suite model names (none: the suite)")
    add_model_and_build_options(b)
    b.add_argument("--threads", type=int, default=None, help="threads for TVM and ORT alike (default: all cores)")
    b.add_argument("--repeats", type=positive_int, default=7, help="timed runs per contender and process after "
                                                                  "warm-up, at least (default 7)")
    b.add_argument("--sample-ms", type=non_negative_float, default=SAMPLE_BUDGET_S * 1e3, metavar="MS",
                   help="more rounds until each contender was sampled this long in a process (default "
                        f"{SAMPLE_BUDGET_S * 1e3:g}; 0: exactly --repeats; not with --thread-pools deployed)")
    b.add_argument("--processes", type=positive_int, default=3, metavar="N",
                   help="fresh timing processes, each loading the exported builds (default 3; ratios get a "
                        "95%% interval over them)")
    b.add_argument("--halfwidth", type=percentage, default=2.0, metavar="PCT",
                   help="add fresh processes (up to --max-processes) while a ratio's 95%% interval is wider than "
                        "+-PCT%% (default 2; 0 turns it off: exactly --processes)")
    b.add_argument("--max-processes", type=positive_int, default=None, metavar="N",
                   help="fresh processes per model at most while sampling for --halfwidth (default 30)")
    b.add_argument("--thread-pools", choices=THREAD_POOLS, default=None,
                   help="parked (default): spin-waiting off in both runtimes, so neither steals the other's "
                        "cores; brief: each pool spins ~0.2 ms after a parallel region, then parks, with a "
                        "1 ms pause between contenders (one run's kernels find their workers awake); "
                        "deployed: each runtime's default spinning, every contender timed after the "
                        "process has gone idle, as a deployed model runs")
    b.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    b.add_argument("--html", default=None, metavar="FILE", help="write a self-contained HTML page (times, "
                   "ratios against ONNX Runtime with intervals, chart)")
    b.add_argument("--quick", action="store_true", help="built-in suite without the slow real models")
    b.add_argument("--buckets", action="append", default=[], metavar="[NAME=]A,B,...",
                   help="with --dynamic: also time static builds for these sizes, each size padded to the "
                        "smallest bucket that holds it (NAME may be left out with one --dynamic dim)")

    bl = sub.add_parser("baseline", help="per-architecture latency baselines: update, check, import, export")
    bl.add_argument("action", choices=["update", "check", "show", "history", "import", "export"],
                    help="update: measure and record; check: gate against the baseline; show: list entries; "
                         "history: each entry per commit of the baseline file (--plot FILE.png|.html); "
                         "import/export: pytest-benchmark JSON (--pytest-benchmark FILE)")
    bl.add_argument("models", nargs="*", metavar="MODEL", help="ONNX files or suite model names (default: latency set)")
    add_model_and_build_options(bl)
    bl.add_argument("--baseline-dir", default=None, metavar="DIR", help="default: the repo's baselines/")
    bl.add_argument("--pytest-benchmark", default=None, metavar="FILE", help="for import/export")
    bl.add_argument("--plot", default=None, metavar="FILE", help="history: write the trend as PNG or HTML")
    bl.add_argument("--processes", type=positive_int, default=None, metavar="N",
                    help="update/check: fresh processes to measure in, each normalised by its own ONNX Runtime "
                         "run, pooled (default 3; more when the gate is unsure)")
    bl.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)

    pr = sub.add_parser("profile", help="time every kernel of the fused and unfused build: each fused group "
                                        "against its unfused parts (a benchmark)")
    pr.add_argument("models", nargs="+", metavar="MODEL", help="ONNX files or suite model names")
    add_model_and_build_options(pr)
    pr.add_argument("--threads", type=int, default=None, help="threads for TVM (default: all cores)")
    pr.add_argument("--repeats", type=int, default=20, help="timed runs after warm-up (default 20)")
    pr.add_argument("--rows", type=int, default=40, help="kernels shown, slowest first (default 40)")
    pr.add_argument("--json", default=None, metavar="FILE", help="write the profiles as JSON")
    pr.add_argument("--html", default=None, metavar="FILE", help="write a self-contained HTML page (per model: "
                    "totals, a chart of the slowest groups fused vs unfused, every group's time, bytes, GFLOP/s)")

    rd = sub.add_parser("reduce", help="shrink a model whose build fails or crashes to the fewest ONNX nodes that "
                                       "fail the same way, and write it (a reproducer to hand over)")
    rd.add_argument("models", nargs=1, metavar="MODEL", help="an ONNX file or suite model name")
    add_model_and_build_options(rd)
    rd.add_argument("--fused-only", action="store_true",
                    help="build only the fused side of each candidate (default: fused, then unfused)")
    rd.add_argument("--out", default="reduced", metavar="DIR",
                    help="where reduced.onnx and reduce.json go (default ./reduced)")

    tu = sub.add_parser("tune", help="measure each pattern group fused vs its unfused parts and record the "
                                     "verdict in the architecture's decision database")
    tu.add_argument("models", nargs="+", metavar="MODEL", help="ONNX files or suite model names")
    add_model_and_build_options(tu)
    tu.add_argument("--threads", type=int, default=None, help="threads for TVM (default: all cores)")
    tu.add_argument("--repeats", type=int, default=20, help="timed runs after warm-up (default 20)")
    tu.add_argument("--processes", type=positive_int, default=None, metavar="N",
                    help="fresh processes to profile each model in; a group's times are the medians over them "
                         "(default 3)")
    tu.add_argument("--decision-db", default=None, metavar="FILE",
                    help="database file (default: baselines/decisions/<arch>.json)")
    tu.add_argument("--no-confirm", action="store_true",
                    help="record a split-back on the per-group profile alone (default: only where the whole model "
                         "also ran faster with that group split, timed interleaved)")

    co = sub.add_parser("conformance", help="the ONNX backend node tests, fused and unfused, against their "
                                            "expected outputs and ONNX Runtime")
    co.add_argument("--ops", default=None, metavar="GLOB[,GLOB]", help="only operators matching, e.g. 'Reduce*'")
    co.add_argument("--sample", action="store_true", help="one case per operator (the default pytest run's set)")
    co.add_argument("--case", action="append", default=[], metavar="NAME", help="one case by name (repeatable)")
    co.add_argument("--json", default=None, metavar="FILE", help="write every case's outcome as JSON")
    add_build_options_only(co)

    ga = sub.add_parser("gate", help="A/B latency gate: this tree's compiler against a base revision's, "
                                     "both timed in the same fresh processes (no stored baseline needed)")
    ga.add_argument("models", nargs="*", metavar="MODEL", help="ONNX files or suite model names "
                    "(default: the latency set)")
    add_model_and_build_options(ga)
    ga.add_argument("--base", default=None, metavar="REV", help="the revision to gate against (default: the "
                    "merge-base with main, or on main the previous commit)")
    ga.add_argument("--threads", type=int, default=None, help="threads for TVM and ORT alike (default: all cores)")
    ga.add_argument("--repeats", type=int, default=7, help="interleaved rounds per fresh process (default 7)")
    ga.add_argument("--processes", type=int, default=4, metavar="N",
                    help="fresh timing processes to start with (default 4, half of them loading the candidate "
                         "first; up to 8 while unclear)")
    from ..options import slowdown_factor

    ga.add_argument("--factor", type=slowdown_factor, default=1.10, help="slowdown that fails (default 1.10)")
    ga.add_argument("--json", default=None, metavar="FILE", help="write the verdicts as JSON")
    ga.add_argument("--html", default=None, metavar="FILE", help="write a self-contained HTML page (verdicts, "
                    "ratio chart, compile time, planned memory)")

    ca = sub.add_parser("cache", help="the build cache: info (entries, size, where) or clear")
    ca.add_argument("action", choices=["info", "clear"])
    ca.add_argument("--cache-dir", default=None, metavar="DIR", help="default: FUSEGUARD_CACHE_DIR or ~/.cache/fuseguard")

    db = sub.add_parser("device-bundle", help="prebuilt CUDA libraries + TVM's runtime for the device check "
                                             "(scripts/gpu-check.sh runs it on a GPU machine with no TVM)")
    db.add_argument("--gpu-arch", default="sm_90", metavar="sm_XX", help="the device's architecture (default sm_90)")
    db.add_argument("--out", required=True, metavar="DIR", help="the bundle's folder (carry it to the device)")
    db.add_argument("--mode", choices=("smoke", "full"), default="full",
                    help="smoke: the <5-minute subset only (default: full, which also holds the smoke subset)")

    sub.add_parser("patterns", help="list the fusion patterns")
    sub.add_parser("env", help="the environment variables fuseguard reads, with the values this shell sets "
                               "and the host it detects")
    from ..debug.bisect import add_bisect_parser

    add_bisect_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    from ..debug.bisect import run_bisect

    handler = {"verify": cmd_verify, "bench": cmd_bench, "baseline": cmd_baseline, "patterns": cmd_patterns, "env": cmd_env, "profile": cmd_profile,
               "reduce": cmd_reduce,
               "tune": cmd_tune, "conformance": cmd_conformance, "gate": cmd_gate, "cache": cmd_cache, "compile": cmd_compile,
               "device-bundle": cmd_device_bundle,
               "bisect": run_bisect}[args.command]
    from ..options import apply_cache_options, getter

    apply_cache_options(getter(args))
    try:
        return handler(args)
    except FuseguardError as err:
        if getattr(args, "debug", False):
            traceback.print_exc()
        from .common import about, model_label

        print(f"fuseguard: error: {about(model_label(args), err)}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("fuseguard: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the last line of defence: one line, the traceback only with --debug
        if getattr(args, "debug", False):
            traceback.print_exc()
        where = f" writing {err.filename}" if isinstance(err, OSError) and err.filename else ""
        print(f"fuseguard: error: {args.command}{where} failed: {type(err).__name__}: {err}"
              + ("" if getattr(args, "debug", False) else " (--debug shows the traceback)"), file=sys.stderr)
        return EXIT_INTERNAL

