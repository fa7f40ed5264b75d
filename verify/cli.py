"""The `fuseguard` command line.

Exit codes: 0 all passed, 1 an output mismatched (or a build crashed), 2 unusable input or usage.
Errors are one line on stderr; `--debug` adds the traceback.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fuseguard.compiler import settings
from fuseguard.compiler.errors import FuseguardError, UsageError

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2
#: fuseguard itself failed (a bug, or the disk): said in one line naming the command, never a traceback.
EXIT_INTERNAL = 3


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line (its default), and never prints a traceback."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"fuseguard: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _add_build_options(p: argparse.ArgumentParser) -> None:
    from .options import add_build_options, add_model_options

    add_model_options(p.add_argument)
    add_build_options(p.add_argument)


def _add_build_options_no_model(p: argparse.ArgumentParser) -> None:
    from .options import add_build_options

    add_build_options(p.add_argument, timeout=300.0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fuseguard", description="Operator-fusion compiler on TVM Relax, and its verifier.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    v = sub.add_parser("verify", help="compile fused and unfused, run both and ONNX Runtime, compare")
    v.add_argument("models", nargs="*", metavar="MODEL", help="ONNX files or built-in suite model names "
                   "(none: the whole built-in suite)")
    _add_build_options(v)
    from .options import add_compare_options

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
    _add_build_options(cp)
    cp.add_argument("--out", required=True, metavar="DIR", help="DIR/<arch class>/ gets model.so, model.onnx, "
                    "manifest.json (one model: DIR itself; several: DIR/<model>/...)")
    cp.add_argument("--seed", type=int, default=0, help="seed of the verification inputs (default 0)")

    from .options import non_negative_float, percentage, positive_int
    from .perf.timing import SAMPLE_BUDGET_S, THREAD_POOLS

    b = sub.add_parser("bench", help="time TVM fused / unfused against ONNX Runtime (a benchmark, not a test)")
    b.add_argument("models", nargs="*", metavar="MODEL", help="ONNX files or suite model names (none: the suite)")
    _add_build_options(b)
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
    _add_build_options(bl)
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
    _add_build_options(pr)
    pr.add_argument("--threads", type=int, default=None, help="threads for TVM (default: all cores)")
    pr.add_argument("--repeats", type=int, default=20, help="timed runs after warm-up (default 20)")
    pr.add_argument("--rows", type=int, default=40, help="kernels shown, slowest first (default 40)")
    pr.add_argument("--json", default=None, metavar="FILE", help="write the profiles as JSON")
    pr.add_argument("--html", default=None, metavar="FILE", help="write a self-contained HTML page (per model: "
                    "totals, a chart of the slowest groups fused vs unfused, every group's time, bytes, GFLOP/s)")

    rd = sub.add_parser("reduce", help="shrink a model whose build fails or crashes to the fewest ONNX nodes that "
                                       "fail the same way, and write it (a reproducer to hand over)")
    rd.add_argument("models", nargs=1, metavar="MODEL", help="an ONNX file or suite model name")
    _add_build_options(rd)
    rd.add_argument("--fused-only", action="store_true",
                    help="build only the fused side of each candidate (default: fused, then unfused)")
    rd.add_argument("--out", default="reduced", metavar="DIR",
                    help="where reduced.onnx and reduce.json go (default ./reduced)")

    tu = sub.add_parser("tune", help="measure each pattern group fused vs its unfused parts and record the "
                                     "verdict in the architecture's decision database")
    tu.add_argument("models", nargs="+", metavar="MODEL", help="ONNX files or suite model names")
    _add_build_options(tu)
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
    _add_build_options_no_model(co)

    ga = sub.add_parser("gate", help="A/B latency gate: this tree's compiler against a base revision's, "
                                     "both timed in the same fresh processes (no stored baseline needed)")
    ga.add_argument("models", nargs="*", metavar="MODEL", help="ONNX files or suite model names "
                    "(default: the latency set)")
    _add_build_options(ga)
    ga.add_argument("--base", default=None, metavar="REV", help="the revision to gate against (default: the "
                    "merge-base with main, or on main the previous commit)")
    ga.add_argument("--threads", type=int, default=None, help="threads for TVM and ORT alike (default: all cores)")
    ga.add_argument("--repeats", type=int, default=7, help="interleaved rounds per fresh process (default 7)")
    ga.add_argument("--processes", type=int, default=4, metavar="N",
                    help="fresh timing processes to start with (default 4, half of them loading the candidate "
                         "first; up to 8 while unclear)")
    from .options import slowdown_factor

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
    from .debug.bisect import add_bisect_parser

    add_bisect_parser(sub)
    return parser


def _options(args: argparse.Namespace):
    from .options import compile_options, getter

    return compile_options(getter(args))


def _compile(args: argparse.Namespace) -> int:
    from fuseguard.compiler.frontend.loader import parse_shape_spec
    from fuseguard.compiler.plugins import env_for, load_plugins

    from .check.model import SuiteSpec
    from .worker import Worker

    load_plugins(args.plugin)
    options = _options(args)
    shapes = dict(parse_shape_spec(s) for s in args.shape)
    sources = _sources(args)
    args.worst = EXIT_OK
    with Worker(sys_path=[str(Path.cwd())], env=env_for(args.plugin), forward_output=args.debug) as worker:
        for source in sources:
            label = source.label if isinstance(source, SuiteSpec) else str(source)
            out = Path(args.out) if len(sources) == 1 else Path(args.out) / Path(label).stem
            done = _call_one(args, worker, "fuseguard.verify.check.artifact:write_artifact", label, f"compiling {label} for release",
                             source=source, out_dir=str(out), options=options, seed=args.seed,
                             shapes=shapes if not isinstance(source, SuiteSpec) else None)
            if done is _FAILED:
                continue
            err = done["max_abs_error"]
            print(f"{label}: wrote {done['directory']} ({'verified' if done['passed'] else 'VERIFICATION FAILED'}"
                  f" against ONNX Runtime, max err {err:.2e})" if err is not None else
                  f"{label}: wrote {done['directory']}")
            if not done["passed"]:
                args.worst = max(args.worst, EXIT_MISMATCH)
    return args.worst


def _verify_artifacts(args: argparse.Namespace) -> int:
    from .check.artifact import ArtifactVerdict
    from .worker import Worker

    args.worst = EXIT_OK
    with Worker(sys_path=[str(Path.cwd())], forward_output=args.debug) as worker:
        for directory in args.artifact:
            d = _call_one(args, worker, "fuseguard.verify.check.artifact:verify_artifact", directory, f"re-verifying {directory}",
                          directory=directory)
            if d is _FAILED:
                continue
            verdict = ArtifactVerdict(**d)
            print(verdict.line())
            if not verdict:
                print(f"fuseguard: mismatch: {verdict.summary}", file=sys.stderr)
                args.worst = max(args.worst, EXIT_MISMATCH)
    return args.worst


def _verify(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.artifact:
        return _verify_artifacts(args)

    from fuseguard.compiler.frontend.loader import parse_shape_spec

    from .check.compare import Tolerance
    from .check.model import SuiteSpec, verify_in_worker
    from .worker import Worker, WorkerFailure, WorkerTaskError

    console = Console(stderr=False, width=None if sys.stdout.isatty() else 160)
    options = _options(args)
    from fuseguard.compiler.plugins import env_for, load_plugins

    load_plugins(args.plugin)
    unknown = set()
    if args.disable_pattern:
        from fuseguard.compiler.patterns import pattern_names  # imports TVM: only when needed

        unknown = set(args.disable_pattern) - set(pattern_names())
    if unknown:
        raise UsageError(f"--disable-pattern: unknown pattern(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(pattern_names())}")
    shapes = dict(parse_shape_spec(s) for s in args.shape)
    from .options import tolerances as tolerances_from

    tolerances = tolerances_from(args.atol, args.rtol)
    if shapes and not args.models:
        raise UsageError("--shape needs a MODEL.onnx (the built-in suite pins its own shapes)")
    sources = _sources(args)
    per_output = {}
    for item in args.output_tol:
        out_name, _, values = item.rpartition("=")
        try:
            parts = [float(v) for v in values.split(",")]
            if not out_name or not 1 <= len(parts) <= 2:
                raise ValueError
        except ValueError:
            raise UsageError(f"--output-tol {item!r}: expected NAME=ATOL[,RTOL]") from None
        per_output[out_name] = Tolerance(atol=parts[0], rtol=parts[1] if len(parts) > 1 else parts[0])
    per_output = per_output or None
    if args.inputs and len(sources) != 1:
        raise UsageError("--inputs FILE.npz applies to exactly one model")
    if args.profile and (options.gpu_arch or options.dynamic):
        raise UsageError("verify --profile times the host CPU's static builds: leave out --gpu-arch and --dynamic")

    from .progress import Progress

    progress = Progress(len(sources))
    worker = Worker(sys_path=[str(Path.cwd())], env={**env_for(args.plugin), **progress.env},
                    forward_output=args.debug)
    rows, results, worst = [], [], EXIT_OK
    try:
        progress.__enter__()
        for index, source in enumerate(sources, 1):
            label = source.label if isinstance(source, SuiteSpec) else str(source)
            progress.start(index, label)
            kwargs = dict(shapes=shapes if not isinstance(source, SuiteSpec) else None, options=options,
                          seed=args.seed, inputs_file=args.inputs, tolerances=tolerances, per_output=per_output,
                          default_dim=args.default_dim)
            try:
                if options.dynamic:     # one symbolic build pair, many drawn sizes (verify/check/dynamic.py)
                    from .check.dynamic import verify_dynamic_in_worker

                    verdict = verify_dynamic_in_worker(source, timeout=args.timeout, worker=worker,
                                                       draws=args.draws, **kwargs)
                else:
                    verdict = verify_in_worker(source, timeout=args.timeout, worker=worker, **kwargs)
                progress.done(label, verdict.status)
                rows.append(_report_verdict(verdict, label, source, results, console, args))
                if not verdict.passed:
                    worst = max(worst, EXIT_MISMATCH)
            except FuseguardError as err:
                if args.debug and getattr(err, "remote_traceback", None):
                    print(err.remote_traceback, file=sys.stderr)
                message, code = str(err), err.exit_code
            except (WorkerFailure, WorkerTaskError) as err:
                message = f"{label}: " + (str(err) if args.debug else str(err).split("\n--- last lines", 1)[0])
                code = EXIT_MISMATCH
            except Exception as err:  # noqa: BLE001 - a harness bug on one model must not end the run
                if args.debug:
                    traceback.print_exc()
                message = f"{label}: internal error: {type(err).__name__}: {err} (--debug shows the traceback)"
                code = EXIT_MISMATCH
            else:
                continue
            # The error line below is this model's one line (docs/bad-inputs.md): no progress line too.
            print(f"fuseguard: error: {message}", file=sys.stderr)
            worst = max(worst, code)
            results.append({"model": label, "source": str(getattr(source, "name", source)), "status": "ERROR",
                            "error": message})
            rows.append((label, "-", "-", "-", "-", "[red]ERROR[/]", "-"))
    finally:
        progress.__exit__(None, None, None)
        worker.close()

    _print_table(console, rows, options)
    if args.profile:
        _profile_verified(args, sources, results, options)
    if args.json:
        from .atomic import atomic_write_json

        atomic_write_json(args.json, {"target": options.gpu_arch or "cpu", "config": options.config_label,
                                      "models": results})
    if args.html:
        from .atomic import atomic_write_text
        from .html import render_verify

        atomic_write_text(args.html, render_verify(results, title="fuseguard verify",
                                                   target=f"{options.gpu_arch or 'cpu'} ({options.config_label})"))
        print(f"wrote {args.html}", file=sys.stderr)
    return worst


def _profile_verified(args: argparse.Namespace, sources: Sequence[Any], results: list[dict], options: Any) -> None:
    """`verify --profile`: each model that ran gets its per-kernel profile (`result["profile"]`), timed in a
    worker of its own with the profile's thread settings; a model that fails to profile says so in one line
    and keeps its verdict (profiling is information, not a check)."""
    from fuseguard.compiler.plugins import env_for
    from fuseguard.compiler.hw.target import host_cores

    from .check.model import SuiteSpec
    from .perf.timing import timing_env
    from .worker import Worker

    threads = host_cores()
    env = {**env_for(args.plugin), **timing_env(threads, against_ort=False)}
    verdict_code = getattr(args, "worst", EXIT_OK)
    with Worker(sys_path=[str(Path.cwd())], env=env, forward_output=args.debug) as worker:
        for source, result in zip(sources, results):
            if result.get("status") not in ("PASS", "FAIL"):
                continue
            print(f"fuseguard: profiling {result['model']}", file=sys.stderr, flush=True)
            profile = _call_one(args, worker, "fuseguard.verify.perf.profile:profile_model", result["model"],
                                f"profiling {result['model']}", source=source,
                                shapes=None if isinstance(source, SuiteSpec) else result.get("input_shapes"),
                                options=options, threads=threads, seed=result.get("seed") or 0)
            if profile is not _FAILED:
                result["profile"] = profile.to_dict()
                slower = profile.slower_groups()
                print(f"fuseguard: {result['model']}: kernels fused {profile.fused_total_us:.0f} us, unfused "
                      f"{profile.unfused_total_us:.0f} us; {len(slower)} fused group(s) slower than their parts",
                      file=sys.stderr)
    args.worst = verdict_code     # a profile that failed does not change the verdict's exit code


def _report_verdict(verdict, label: str, source: Any, results: list, console, args: argparse.Namespace):
    """Print one model's warnings, errors, mismatches and report; record its JSON; return its table row."""
    results.append({**verdict.to_dict(), "source": str(getattr(source, "name", source))})
    for w in verdict.warnings:
        print(f"fuseguard: warning: {w}", file=sys.stderr)
    for build in (verdict.fused, verdict.unfused):
        if build.error:
            if args.debug and build.traceback:
                print(build.traceback, file=sys.stderr, end="")
            print(f"fuseguard: error: {label} ({build.config}): {build.error}", file=sys.stderr)
    checks = getattr(verdict, "checks", None)
    if checks is not None and not verdict.skipped_run:  # --dynamic: what one build pair covered, the smallest failure
        ranges = ", ".join(f"{k} in [{lo}, {hi}]" for k, (lo, hi) in verdict.ranges.items())
        print(f"fuseguard: {label}: {verdict.sizes_checked} sizes ({ranges}) checked against {verdict.builds} "
              f"build(s) in {verdict.check_s:.1f} s", file=sys.stderr)
        if verdict.failing is not None:
            sizes = ", ".join(f"{k}={v}" for k, v in verdict.failing.sizes.items())
            print(f"fuseguard: mismatch: {label}: smallest failing size {sizes}"
                  f"{': ' + verdict.failing.error if verdict.failing.error else ''}; reproduce with "
                  f"`fuseguard verify {label} {verdict.reproduce}`", file=sys.stderr)
    if not verdict.passed:
        for build in (verdict.fused, verdict.unfused):
            if build.compare is not None and not build.compare:
                print(f"fuseguard: mismatch: {label} ({build.config} vs ONNX Runtime): "
                      f"{build.compare.summary()}", file=sys.stderr)
    if args.report and verdict.fused.report:
        from fuseguard.compiler.cuda.sass import SassReport

        rep = verdict.fused.report
        console.print(rep.render())
        if rep.sass:      # CUDA builds: every kernel's registers, spills, shared memory and occupancy
            console.print(SassReport.from_dict(rep.sass).render())
    return _row(verdict)


def _fmt_err(build) -> str:
    if build.error:
        return "[red]build error[/]"
    if not build.ran:
        return "-"
    err = build.max_abs_error
    text = f"{err:.2e}" if err is not None else "-"
    return text if build.passed else f"[red]{text}[/]"


def _row(verdict) -> tuple[str, ...]:
    status = verdict.status
    colour = {"PASS": "green", "COMPILED": "yellow", "FAIL": "red", "ERROR": "red"}[status]
    shown = status if not verdict.skipped_run else f"COMPILED ({verdict.skipped_run})"
    # A build that failed has no groups and no compile time: "-", never a 0 that reads like a result.
    groups = "-" if verdict.fused.error else f"{verdict.fused.groups} ({verdict.fused.pattern_groups} pattern)"

    def secs(build) -> str:
        return "-" if build.error else "cached" if build.cached else f"{build.compile_s:.1f}"

    model = verdict.model
    if any(b.report is not None and b.report.imported_via != "onnx" for b in (verdict.fused, verdict.unfused)):
        model += " (ORT-folded)"     # imported through ONNX Runtime's shape folding: say so
    return (model, str(verdict.nodes), groups, _fmt_err(verdict.fused), _fmt_err(verdict.unfused),
            f"[{colour}]{shown}[/]", f"{secs(verdict.fused)} / {secs(verdict.unfused)}")


def _print_table(console, rows: list[tuple[str, ...]], options) -> None:
    from rich.table import Table

    table = Table(title=f"fuseguard verify ({options.gpu_arch or 'cpu'}, {options.config_label} vs unfused "
                        f"vs ONNX Runtime)")
    for col, justify in (("model", "left"), ("nodes", "right"), ("fused groups", "right"),
                         ("max err fused vs ORT", "right"), ("max err unfused vs ORT", "right"),
                         ("verdict", "left"), ("compile s (fused / unfused)", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _sources(args: argparse.Namespace) -> list[Any]:
    from fuseguard.suites.models import suite_models, zoo_models

    from .check.model import dim_overrides, resolve_model_arg

    dims, seed = dim_overrides(args.dim), getattr(args, "seed", None)
    names = args.models or [m.name for m in suite_models(include_slow=not args.quick)] + \
        [m.name for m in zoo_models() if not (args.quick and m.slow)]
    return [resolve_model_arg(item, dims=dims, seed=seed) for item in names]


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fuseguard.compiler.frontend.loader import parse_shape_spec
    from fuseguard.compiler.plugins import env_for, load_plugins
    from fuseguard.compiler.hw.target import host_cores

    from .perf.bench import render
    from .check.model import SuiteSpec
    from .worker import Worker, WorkerFailure, WorkerTaskError

    load_plugins(args.plugin)
    options = _options(args)
    if options.gpu_arch:
        raise UsageError("fuseguard bench times the host CPU; GPU timing runs under pytest --gpu-arch on a GPU runner")
    threads = args.threads or host_cores()
    shapes = dict(parse_shape_spec(s) for s in args.shape)
    if options.dynamic:
        if args.thread_pools not in (None, "parked"):
            raise UsageError("bench --dynamic times with the thread pools parked; leave out --thread-pools")
        if args.html:
            raise UsageError("bench --dynamic prints and writes --json only; leave out --html")
        return _bench_cliff(args, options, threads, shapes)
    if args.buckets:
        raise UsageError("--buckets pads sizes of a symbolic build: give --dynamic NAME too")
    from .perf.timing import DEFAULT_POOLS, timing_env

    args.thread_pools = args.thread_pools or DEFAULT_POOLS
    deployed = args.thread_pools == "deployed"
    env = {**env_for(args.plugin), **timing_env(threads, against_ort=not deployed, pools=args.thread_pools)}
    console = Console(width=None if sys.stdout.isatty() else 160)
    results, worst = [], EXIT_OK
    import tempfile

    from .perf.bench import MAX_PROCESSES, aggregate, needs_more, set_aside_note, unresolved_note
    from .progress import Progress

    target = args.halfwidth / 100 if args.halfwidth else None
    most = max(args.max_processes or MAX_PROCESSES, args.processes)
    sample_s = args.sample_ms / 1e3

    import time

    sources = _sources(args)
    labels = [source.label if isinstance(source, SuiteSpec) else str(source) for source in sources]

    def failed(label: str, err: Exception) -> None:
        nonlocal worst
        if isinstance(err, FuseguardError):
            print(f"fuseguard: error: {err}", file=sys.stderr)
            worst = max(worst, err.exit_code)
        else:
            print(f"fuseguard: error: {label}: {str(err).splitlines()[0]}", file=sys.stderr)
            worst = max(worst, EXIT_MISMATCH)

    with Progress(len(sources)) as progress, \
            Worker(sys_path=[str(Path.cwd())], env={**env, **progress.env}, forward_output=args.debug) as worker, \
            tempfile.TemporaryDirectory(prefix="fuseguard-bench-") as tmp:
        metas: dict[int, dict] = {}
        for i, source in enumerate(sources):      # every build first: the timing below never waits on a compile
            progress.start(i + 1, labels[i])
            try:
                metas[i] = worker.call("fuseguard.verify.perf.bench:prepare_bench",
                                       what=f"compiling {labels[i]} for bench", timeout=args.timeout, source=source,
                                       directory=str(Path(tmp) / str(i)),
                                       shapes=shapes if not isinstance(source, SuiteSpec) else None, options=options)
            except (FuseguardError, WorkerFailure, WorkerTaskError) as err:
                failed(labels[i], err)
        # Fresh processes round-robin over the models (one process of each, then the next round), so that a phase
        # of the host lasting seconds lands on one process of several models, where each model's between-process
        # interval sees it, not on all of one model's processes: back to back, SqueezeNet's three runs of this
        # command disagreed by 4% beyond their intervals (docs/measurement.md). Rounds go on for the models whose
        # interval is still wider than --halfwidth.
        runs: dict[int, list] = {i: [] for i in metas}
        done: dict[int, object] = {}
        seconds = dict.fromkeys(metas, 0.0)
        while len(done) < len(metas):
            for i in [i for i in metas if i not in done]:
                progress.start(i + 1, labels[i])
                have = len(runs[i])
                progress.stage(f"timing, fresh process {have + 1}" + (f" of {args.processes}" if have < args.processes
                                                                         else " (interval wider than asked)"))
                t0 = time.perf_counter()
                try:
                    with Worker(sys_path=[str(Path.cwd())], env=env, forward_output=args.debug) as timer:
                        runs[i].append(timer.call("fuseguard.verify.perf.bench:time_prepared",
                                                  what=f"timing {labels[i]} ({have + 1})", timeout=args.timeout,
                                                  directory=str(Path(tmp) / str(i)), threads=threads,
                                                  repeats=args.repeats, thread_pools=args.thread_pools,
                                                  min_sampled_s=sample_s))
                except (FuseguardError, WorkerFailure, WorkerTaskError) as err:
                    failed(labels[i], err)
                    done[i] = None
                    continue
                seconds[i] += time.perf_counter() - t0
                if len(runs[i]) < args.processes:
                    continue
                result = aggregate(metas[i], runs[i], threads, args.thread_pools)
                result.halfwidth_target = target
                if not needs_more(result, target, most):
                    done[i] = result
                    progress.done(labels[i], f"fused {result.tvm_fused_ms:.2f} ms, unfused {result.tvm_unfused_ms:.2f} "
                                             f"ms, ORT {result.ort_ms:.2f} ms ({result.fused_vs_ort:.2f}x ORT)",
                                  f"{result.processes} processes" + (f" ({result.set_aside} more set aside)"
                                                                      if result.set_aside else "")
                                  + f", {seconds[i]:.0f} s of timing")
        results = [done[i] for i in sorted(done) if done[i] is not None]
    sampled = (f"{args.processes}-{most} fresh processes (more while a ratio's interval is wider than "
               f"+-{args.halfwidth:g}%)" if target is not None and most > args.processes
               else f"{args.processes} fresh process(es)")
    console.print(render(results, f"fuseguard bench ({threads} threads, {sampled} x "
                                  f">= {args.repeats} interleaved rounds"
                                  + (f" and >= {sample_s * 1e3:g} ms a contender" if sample_s and not deployed else "")
                                  + " after warm-up, thread pools "
                                  f"{args.thread_pools}; "
                                  f"cpu {settings.get('FUSEGUARD_MCPU') or options.mcpu or 'detected'})"))
    for note in (set_aside_note(results), unresolved_note(results)):
        if note:
            print(note, file=sys.stderr)
    if args.json:
        from .atomic import atomic_write_json

        atomic_write_json(args.json, {r.model: r.to_dict() for r in results})
    if args.html:
        from .atomic import atomic_write_text
        from .html import render_bench

        atomic_write_text(args.html, render_bench([r.to_dict() for r in results], note=f"{threads} threads, "
                          f"cpu {settings.get('FUSEGUARD_MCPU') or options.mcpu or 'detected'}"))
        print(f"wrote {args.html}")
    return worst


def _bench_cliff(args: argparse.Namespace, options: Any, threads: int, shapes: dict) -> int:
    """`bench --dynamic NAME --dim NAME=A,B,...`: the symbolic build against a static build per size."""
    from rich.console import Console

    from fuseguard.compiler.plugins import env_for

    from .check.model import SuiteSpec
    from .progress import Progress
    from .perf.timing import timing_env
    from .worker import Worker

    dynamic = {d.name for d in options.dynamic}
    sizes = dict(_dim_sizes(item, dynamic, "--dim") for item in args.dim)
    if not sizes:
        raise UsageError("bench --dynamic needs the sizes to time, e.g. --dim seq=16,64,128,384")
    buckets = dict(_dim_sizes(item, dynamic, "--buckets", name_optional=True) for item in args.buckets)
    args.dim = []
    sources = _sources(args)
    console = Console(width=None if sys.stdout.isatty() else 160)
    results = []
    args.worst = EXIT_OK
    env = {**env_for(args.plugin), **timing_env(threads)}
    with Progress(len(sources)) as progress, \
            Worker(sys_path=[str(Path.cwd())], env={**env, **progress.env}, forward_output=args.debug) as worker:
        for i, source in enumerate(sources):
            label = source.label if isinstance(source, SuiteSpec) else str(source)
            progress.start(i + 1, label)
            result = _call_one(args, worker, "fuseguard.verify.perf.cliff:bench_cliff", label, f"timing {label} dynamic vs static",
                               source=source, options=options, sizes=sizes, threads=threads, repeats=args.repeats,
                               buckets=buckets, shapes=shapes if not isinstance(source, SuiteSpec) else None)
            if result is _FAILED:
                continue
            results.append(result)
            progress.done(label, f"worst dynamic/static {result.worst:.2f}x")
            console.print(result.render())
    if args.json:
        from .atomic import atomic_write_json

        atomic_write_json(args.json, {r.model: r.to_dict() for r in results})
    return args.worst


def _dim_sizes(item: str, dynamic: set[str], flag: str, *, name_optional: bool = False) -> tuple[str, list[int]]:
    """`NAME=A,B,...` for a --dynamic dim (NAME may be left out with one dynamic dim when `name_optional`)."""
    dim, eq, values = item.rpartition("=")
    if not eq and name_optional and len(dynamic) == 1:
        dim = next(iter(dynamic))
    parts = values.split(",")
    if dim not in dynamic or not all(p.isdigit() and int(p) >= 1 for p in parts):
        name = "[NAME=]" if name_optional else "NAME="
        raise UsageError(f"{flag} {item!r}: with --dynamic, give {name}A,B,... for a dynamic dim "
                         f"({', '.join(sorted(dynamic))}), sizes >= 1")
    return dim, [int(p) for p in parts]


def _baseline(args: argparse.Namespace) -> int:
    from fuseguard.compiler.plugins import env_for, load_plugins

    from .perf.baselines import from_pytest_benchmark, load_baselines, record, to_pytest_benchmark
    from .perf.latency import BASELINE_DIR, PROCESSES, baseline_path, gate_model
    from .worker import Worker, WorkerFailure

    load_plugins(args.plugin)
    options = _options(args)
    path = baseline_path(options, Path(args.baseline_dir) if args.baseline_dir else BASELINE_DIR)
    if args.action == "show":
        doc = load_baselines(path)
        for key in sorted(doc.entries):
            e = doc.entries[key]
            norm = f", {e.normalised:.3f}x reference" if e.normalised is not None else ""
            print(f"{key}: median {e.median_ms:.3f} ms, IQR {e.iqr_ms:.3f} ms, n={e.n}{norm}")
        print(f"{len(doc)} entries in {path}")
        return EXIT_OK
    if args.action == "history":
        from rich.console import Console

        from .perf.history import baseline_history, plot, render_table

        names = [Path(m).stem if m.endswith(".onnx") else m for m in args.models]
        points = baseline_history(path, names)
        if not points:
            raise UsageError(f"baseline history: no entry for {', '.join(names) or 'any model'} in {path}'s history")
        Console().print(render_table(points))
        if args.plot:
            print(f"wrote {plot(points, args.plot)}")
        return EXIT_OK
    if args.action in ("import", "export"):
        if not args.pytest_benchmark:
            raise UsageError(f"baseline {args.action} needs --pytest-benchmark FILE")
        if args.action == "export":
            to_pytest_benchmark(load_baselines(path).entries, args.pytest_benchmark)
            print(f"wrote {args.pytest_benchmark} from {path}")
        else:
            entries = from_pytest_benchmark(args.pytest_benchmark)
            for key, entry in entries.items():
                record(path, key, entry)
            print(f"recorded {len(entries)} entries from {args.pytest_benchmark} into {path}")
        return EXIT_OK
    from .perf.gate import Gate, load_gate_config

    gate = Gate.from_config(load_gate_config(None, path.parent))
    if not args.models:
        from fuseguard.suites.latency_set import LATENCY_SET, latency_spec

        sources = [latency_spec(name) for name in LATENCY_SET]
    else:
        sources = _sources(args)
    worst = EXIT_OK
    from .perf.timing import timing_env

    env = {**env_for(args.plugin), **timing_env()}
    with Worker(sys_path=[str(Path.cwd())], env=env, forward_output=args.debug) as worker:
        for source in sources:
            try:
                result, run, key = gate_model(worker, source, options=options, path=path,
                                              update=args.action == "update", timeout=args.timeout, gate=gate,
                                              processes=args.processes or PROCESSES)
            except WorkerFailure as err:
                print(f"fuseguard: error: {str(err).splitlines()[0]}", file=sys.stderr)
                worst = max(worst, EXIT_MISMATCH)
                continue
            if args.action == "update":
                print(f"recorded {key} in {path}: median {run.candidate.median_ms:.3f} ms "
                      f"({run.reference_kind} {run.reference.median_ms:.3f} ms), {run.candidate.n} samples "
                      f"from {run.processes} fresh process(es)")
            else:
                print(result.line())
                if result.regressed:
                    worst = max(worst, EXIT_MISMATCH)
    return worst


_FAILED = object()


def _call_one(args: argparse.Namespace, worker: Any, task: str, label: str, what: str, **kwargs: Any) -> Any:
    """`worker.call(task)` for one model; a failure is reported in one line, lands in `args.worst`, and
    returns `_FAILED`."""
    from .worker import WorkerFailure, WorkerTaskError

    try:
        return worker.call(task, what=what, timeout=args.timeout, **kwargs)
    except FuseguardError as err:
        print(f"fuseguard: error: {err}", file=sys.stderr)
        args.worst = max(getattr(args, "worst", EXIT_OK), err.exit_code)
    except (WorkerFailure, WorkerTaskError) as err:
        print(f"fuseguard: error: {label}: {str(err).splitlines()[0]}", file=sys.stderr)
        args.worst = max(getattr(args, "worst", EXIT_OK), EXIT_MISMATCH)
    return _FAILED


def _each_model(args: argparse.Namespace, worker: Any, task: str, verb: str,
                **kwargs: Any) -> Iterator[tuple[Any, Any]]:
    """Run `task` in `worker` for every MODEL argument; yield (source, result) for the ones that ran and
    report the others in one line each (the exit code lands in `args.worst`)."""
    from .check.model import SuiteSpec

    for source in _sources(args):
        label = source.label if isinstance(source, SuiteSpec) else str(source)
        result = _call_one(args, worker, task, label, f"{verb} {label}", source=source,
                           shapes=_shapes_for(args, source), **kwargs)
        if result is not _FAILED:
            yield source, result


def _reduce(args: argparse.Namespace) -> int:
    from fuseguard.compiler.plugins import env_for, load_plugins

    from .debug.reduce import reduce_model
    from .worker import Worker

    load_plugins(args.plugin)
    options = _options(args)
    (source,) = _sources(args)
    from fuseguard.compiler.frontend.loader import parse_shape_spec

    shapes = dict(parse_shape_spec(s) for s in args.shape)
    with Worker(sys_path=[str(Path.cwd())], env=env_for(args.plugin), forward_output=args.debug) as worker:
        result = reduce_model(source, worker, options=options, shapes=shapes or None, fused_only=args.fused_only,
                              out_dir=args.out, timeout=args.timeout,
                              progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(result.line())
    if result.signature is None:
        return EXIT_OK
    return EXIT_OK if result.confirmed else EXIT_MISMATCH


def _profile(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fuseguard.compiler.plugins import env_for, load_plugins
    from fuseguard.compiler.hw.target import host_cores

    from .perf.timing import timing_env
    from .worker import Worker

    load_plugins(args.plugin)
    options = _options(args)
    if options.gpu_arch:
        raise UsageError("fuseguard profile times the host CPU")
    threads = args.threads or host_cores()
    console = Console(width=None if sys.stdout.isatty() else 200)
    results, args.worst = [], EXIT_OK
    env = {**env_for(args.plugin), **timing_env(threads, against_ort=False)}
    with Worker(sys_path=[str(Path.cwd())], env=env, forward_output=args.debug) as worker:
        for _, result in _each_model(args, worker, "fuseguard.verify.perf.profile:profile_model", "profiling", options=options,
                                     threads=threads, repeats=args.repeats):
            results.append(result)
            console.print(result.render(max_rows=args.rows))
            slower = result.slower_groups()
            if slower:
                sure = {id(g) for g in result.sure_losses()}
                console.print(f"{result.model}: {len(slower)} fused kernel(s) slower than their unfused parts "
                              f"by > 5% ({len([g for g in slower if id(g) in sure])} beyond the noise of their "
                              f"rounds): " + ", ".join(g.kernel for g in slower[:6]))
    if args.json:
        from .atomic import atomic_write_json

        atomic_write_json(args.json, {r.model: r.to_dict() for r in results})
    if args.html:
        from .atomic import atomic_write_text
        from .html import render_profile

        atomic_write_text(args.html, render_profile({r.model: r.to_dict() for r in results}))
        print(f"wrote {args.html}", file=sys.stderr)
    return args.worst


def _tune(args: argparse.Namespace) -> int:
    from fuseguard.compiler.plugins import env_for, load_plugins
    from fuseguard.compiler.hw.target import host_cores

    from .perf.timing import timing_env
    from .worker import Worker

    load_plugins(args.plugin)
    options = _options(args)
    if options.gpu_arch:
        raise UsageError("fuseguard tune measures on the host CPU")
    threads = args.threads or host_cores()
    args.worst = EXIT_OK
    env = {**env_for(args.plugin), **timing_env(threads, against_ort=False)}
    from .perf.tune import PROCESSES

    processes = args.processes or PROCESSES
    with Worker(sys_path=[str(Path.cwd())], env=env, forward_output=args.debug) as worker:
        for source, first in _each_model(args, worker, "fuseguard.verify.perf.tune:profile_for_tuning", "tuning (process 1)",
                                         options=options, threads=threads, repeats=args.repeats, db=args.decision_db):
            profiles = [first]
            label = getattr(source, "label", str(source))
            for n in range(2, processes + 1):
                worker.close()          # a fresh process: the builds come from the cache, loaded, not compiled
                got = _call_one(args, worker, "fuseguard.verify.perf.tune:profile_for_tuning", label,
                                f"tuning {label} (process {n})", source=source, shapes=_shapes_for(args, source),
                                options=options, threads=threads, repeats=args.repeats, db=args.decision_db)
                if got is _FAILED:
                    break
                profiles.append(got)
            else:
                result = _call_one(args, worker, "fuseguard.verify.perf.tune:record_tuning", label, f"recording {label}",
                                   profiles=profiles, options=options, db=args.decision_db, source=source,
                                   shapes=_shapes_for(args, source), threads=threads, confirm=not args.no_confirm)
                if result is not _FAILED:
                    print(result.render())
    return args.worst


def _shapes_for(args: argparse.Namespace, source: Any) -> dict[str, Any] | None:
    """The --shape pins for a file (suite models carry their own), as `_each_model` passes them."""
    from fuseguard.compiler.frontend.loader import parse_shape_spec

    from .check.model import SuiteSpec

    return None if isinstance(source, SuiteSpec) else dict(parse_shape_spec(s) for s in getattr(args, "shape", []))


def _conformance(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fuseguard.compiler.plugins import env_for, load_plugins

    from .check.conformance import case_names, run_in_worker
    from .worker import Worker

    load_plugins(args.plugin)
    options = _options(args)
    names = args.case or case_names(args.ops, sample=args.sample)
    if not names:
        raise UsageError(f"--ops {args.ops!r} matches no operator of the ONNX node tests")
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(f"fuseguard conformance: {len(names)} case(s), fused and unfused, against the expected outputs "
                  f"and ONNX Runtime")
    with Worker(sys_path=[str(Path.cwd())], env=env_for(args.plugin), forward_output=args.debug) as worker:
        report = run_in_worker(names, options=options, timeout=args.timeout, worker=worker,
                               progress=lambda n: print(f"  {n}/{len(names)} cases", file=sys.stderr, flush=True))
    console.print(report.render())
    console.print(report.summary())
    if args.json:
        from .atomic import atomic_write_json

        atomic_write_json(args.json, report.to_dict())
    return EXIT_OK if report else EXIT_MISMATCH


def _gate(args: argparse.Namespace) -> int:
    import tempfile

    from rich.console import Console

    from fuseguard.compiler.frontend.loader import parse_shape_spec
    from fuseguard.compiler.plugins import env_for, load_plugins
    from fuseguard.compiler.hw.target import host_cores
    from fuseguard.suites.latency_set import LATENCY_SET, latency_spec

    from .perf import ab
    from .perf.gate import GatePolicy
    from .perf.timing import timing_env

    load_plugins(args.plugin)
    options = _options(args)
    if options.gpu_arch:
        raise UsageError("fuseguard gate times the host CPU; a GPU A/B gate runs on a GPU runner")
    if args.processes < 2:
        raise UsageError("--processes must be >= 2: per-process speed modes are part of what is measured")
    rev = args.base or ab.default_base()
    if rev is None:
        raise UsageError("no base revision: pass --base REV (this is not a git checkout with history)")
    commit = ab.resolve_commit(rev)
    base_tree = ab.materialize(commit)
    threads = args.threads or host_cores()
    env = {**env_for(args.plugin), **timing_env(threads)}
    sources = _sources(args) if args.models else [latency_spec(n) for n in LATENCY_SET]
    shapes = dict(parse_shape_spec(s) for s in args.shape)
    console = Console(width=None if sys.stdout.isatty() else 160, stderr=True)
    policy = GatePolicy(factor=args.factor)
    results = []
    console.print(f"fuseguard gate: {ab.PROJECT_ROOT} (working tree) against {rev} = {commit[:12]}, "
                  f"{len(sources)} model(s), {threads} threads")
    with tempfile.TemporaryDirectory(prefix="fuseguard-gate-") as tmp:
        for i, source in enumerate(sources):
            result = ab.ab_model(source, base_tree, ab.PROJECT_ROOT, base_commit=commit, workdir=Path(tmp) / str(i),
                                 options=options.to_dict(), threads=threads, processes=args.processes,
                                 repeats=args.repeats, policy=policy, timeout=args.timeout, env=env, shapes=shapes,
                                 progress=lambda m, i=i: console.print(f"[{i + 1}/{len(sources)}] {m}",
                                                                       highlight=False))
            results.append(result)
            print(result.line(), flush=True)
    if args.json:
        from .atomic import atomic_write_json

        atomic_write_json(args.json, {"base": commit, "results": [r.to_dict() for r in results]})
    if args.html:
        from .atomic import atomic_write_text
        from .html import render_gate

        atomic_write_text(args.html, render_gate([r.to_dict() for r in results], base=commit))
        print(f"wrote {args.html}")
    failed = [r for r in results if ab.verdict_is_failure(r)]
    changed = [r for r in results if r.outputs_match is False]
    print(f"fuseguard gate: {len(results) - len(failed)}/{len(results)} passed against {commit[:12]}"
          + (f"; outputs changed in {', '.join(r.model for r in changed)}" if changed else ""))
    return EXIT_MISMATCH if failed else EXIT_OK


def _cache(args: argparse.Namespace) -> int:
    from fuseguard.compiler.cache import BuildCache

    cache = BuildCache()
    if args.action == "clear":
        print(f"removed {cache.clear()} build(s) from {cache.dir}")
        return EXIT_OK
    info = cache.info()
    print(f"{info['directory']}: {info['entries']} build(s), {info['bytes'] / 2**20:.1f} MiB "
          f"(cap {info['max_bytes'] / 2**20:.0f} MiB, least recently used go first)")
    return EXIT_OK


def _device_bundle(args: argparse.Namespace) -> int:
    from fuseguard.compiler.hw.target import resolve

    from .device.bundle import make_bundle

    resolve(args.gpu_arch)       # a bad --gpu-arch is a usage error before anything builds
    manifest = make_bundle(args.out, target=args.gpu_arch, mode=args.mode)
    print(f"{args.out}: {len(manifest['entries'])} models fused and unfused for {args.gpu_arch}, "
          f"{manifest['bytes'] / 2**20:.1f} MiB; on the device: bash scripts/gpu-check.sh {args.out} smoke|full")
    return EXIT_OK


def _patterns(args: argparse.Namespace) -> int:
    from fuseguard.compiler.patterns import PATTERNS

    for name, rule in PATTERNS.items():
        print(f"{name:20s} {rule.description}")
    return EXIT_OK


def _env(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from fuseguard.compiler.hw.hostcpu import detect_host

    table = Table(title="environment variables fuseguard reads (compiler/settings.py)")
    for col in ("variable", "value", "changes code", "what"):
        table.add_column(col, overflow="fold")
    for name, value, what, code in settings.rows():
        table.add_row(name, value or "-", "yes" if code else "", what)
    console = Console()
    console.print(table)
    h = detect_host()
    kib = lambda n: f"{n // 1024} KiB" if n else "?"  # noqa: E731
    console.print(f"host: {h.model_name or h.vendor or '?'} -> mcpu {h.mcpu}, {h.cores} usable core(s), "
                  f"{h.vector_bits}-bit vectors ({h.vector_registers} registers), L1D {kib(h.l1d_bytes)}, "
                  f"L2 {kib(h.l2_bytes)}, L3 {kib(h.l3_bytes)}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    from .debug.bisect import run_bisect

    handler = {"verify": _verify, "bench": _bench, "baseline": _baseline, "patterns": _patterns, "env": _env, "profile": _profile,
               "reduce": _reduce,
               "tune": _tune, "conformance": _conformance, "gate": _gate, "cache": _cache, "compile": _compile,
               "device-bundle": _device_bundle,
               "bisect": run_bisect}[args.command]
    from .options import apply_cache_options, getter

    apply_cache_options(getter(args))
    try:
        return handler(args)
    except FuseguardError as err:
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"fuseguard: error: {err}", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
