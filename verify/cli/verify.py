"""`fuseguard verify` and `fuseguard compile`: verdicts on models (or shipped artifacts), and verified builds
written with their manifest."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fuseguard.compiler.errors import FuseguardError, UsageError
from .common import about, EXIT_MISMATCH, EXIT_OK, FAILED_CALL, call_one, model_sources, options_of


def cmd_compile(args: argparse.Namespace) -> int:
    from fuseguard.compiler.frontend.loader import parse_shape_spec
    from fuseguard.compiler.plugins import env_for, load_plugins

    from ..check.model import SuiteSpec
    from ..worker import Worker

    load_plugins(args.plugin)
    options = options_of(args)
    shapes = dict(parse_shape_spec(s) for s in args.shape)
    sources = model_sources(args)
    args.worst = EXIT_OK
    with Worker(sys_path=[str(Path.cwd())], env=env_for(args.plugin), forward_output=args.debug) as worker:
        for source in sources:
            label = source.label if isinstance(source, SuiteSpec) else str(source)
            out = Path(args.out) if len(sources) == 1 else Path(args.out) / Path(label).stem
            done = call_one(args, worker, "fuseguard.verify.check.artifact:write_artifact", label, f"compiling {label} for release",
                             source=source, out_dir=str(out), options=options, seed=args.seed,
                             shapes=shapes if not isinstance(source, SuiteSpec) else None)
            if done is FAILED_CALL:
                continue
            err = done["max_abs_error"]
            print(f"{label}: wrote {done['directory']} ({'verified' if done['passed'] else 'VERIFICATION FAILED'}"
                  f" against ONNX Runtime, max err {err:.2e})" if err is not None else
                  f"{label}: wrote {done['directory']}")
            if not done["passed"]:
                args.worst = max(args.worst, EXIT_MISMATCH)
    return args.worst


def cmd_verify_artifacts(args: argparse.Namespace) -> int:
    from ..check.artifact import ArtifactVerdict
    from ..worker import Worker

    args.worst = EXIT_OK
    with Worker(sys_path=[str(Path.cwd())], forward_output=args.debug) as worker:
        for directory in args.artifact:
            d = call_one(args, worker, "fuseguard.verify.check.artifact:verify_artifact", directory, f"re-verifying {directory}",
                          directory=directory)
            if d is FAILED_CALL:
                continue
            verdict = ArtifactVerdict(**d)
            print(verdict.line())
            if not verdict:
                print(f"fuseguard: mismatch: {verdict.summary}", file=sys.stderr)
                args.worst = max(args.worst, EXIT_MISMATCH)
    return args.worst


def cmd_verify(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.artifact:
        return cmd_verify_artifacts(args)

    from fuseguard.compiler.frontend.loader import parse_shape_spec

    from ..check.compare import Tolerance
    from ..check.model import SuiteSpec, verify_in_worker
    from ..worker import Worker, WorkerFailure, WorkerTaskError

    console = Console(stderr=False, width=None if sys.stdout.isatty() else 160)
    options = options_of(args)
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
    from ..options import tolerances as tolerances_from

    tolerances = tolerances_from(args.atol, args.rtol)
    if shapes and not args.models:
        raise UsageError("--shape needs a MODEL.onnx (the built-in suite pins its own shapes)")
    sources = model_sources(args)
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

    from ..progress import Progress

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
                    from ..check.dynamic import verify_dynamic_in_worker

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
                message, code = about(label, err), err.exit_code
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
        from ..atomic import atomic_write_json

        atomic_write_json(args.json, {"target": options.gpu_arch or "cpu", "config": options.config_label,
                                      "models": results})
    if args.html:
        from ..atomic import atomic_write_text
        from ..html import render_verify

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

    from ..check.model import SuiteSpec
    from ..perf.timing import timing_env
    from ..worker import Worker

    threads = host_cores()
    env = {**env_for(args.plugin), **timing_env(threads, against_ort=False)}
    verdict_code = getattr(args, "worst", EXIT_OK)
    with Worker(sys_path=[str(Path.cwd())], env=env, forward_output=args.debug) as worker:
        for source, result in zip(sources, results):
            if result.get("status") not in ("PASS", "FAIL"):
                continue
            print(f"fuseguard: profiling {result['model']}", file=sys.stderr, flush=True)
            profile = call_one(args, worker, "fuseguard.verify.perf.profile:profile_model", result["model"],
                                f"profiling {result['model']}", source=source,
                                shapes=None if isinstance(source, SuiteSpec) else result.get("input_shapes"),
                                options=options, threads=threads, seed=result.get("seed") or 0)
            if profile is not FAILED_CALL:
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
