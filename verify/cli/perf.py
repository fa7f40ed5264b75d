"""The speed commands: `fuseguard bench`, `baseline`, `gate`, `profile` and `tune`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fuseguard.compiler import settings
from fuseguard.compiler.errors import FuseguardError, UsageError
from .common import (about, EXIT_MISMATCH, EXIT_OK, FAILED_CALL, call_one, dim_sizes, each_model, model_sources, options_of,
                     shapes_for)


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fuseguard.compiler.frontend.loader import parse_shape_spec
    from fuseguard.compiler.plugins import env_for, load_plugins
    from fuseguard.compiler.hw.target import host_cores

    from ..perf.bench import render
    from ..check.model import SuiteSpec
    from ..worker import Worker, WorkerFailure, WorkerTaskError

    load_plugins(args.plugin)
    options = options_of(args)
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
    from ..perf.timing import DEFAULT_POOLS, timing_env

    args.thread_pools = args.thread_pools or DEFAULT_POOLS
    deployed = args.thread_pools == "deployed"
    env = {**env_for(args.plugin), **timing_env(threads, against_ort=not deployed, pools=args.thread_pools)}
    console = Console(width=None if sys.stdout.isatty() else 160)
    results, worst = [], EXIT_OK
    import tempfile

    from ..perf.bench import MAX_PROCESSES, aggregate, needs_more, set_aside_note, unresolved_note
    from ..progress import Progress

    target = args.halfwidth / 100 if args.halfwidth else None
    most = max(args.max_processes or MAX_PROCESSES, args.processes)
    sample_s = args.sample_ms / 1e3

    import time

    sources = model_sources(args)
    labels = [source.label if isinstance(source, SuiteSpec) else str(source) for source in sources]

    def failed(label: str, err: Exception) -> None:
        nonlocal worst
        if isinstance(err, FuseguardError):
            print(f"fuseguard: error: {about(label, err)}", file=sys.stderr)
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
        from ..atomic import atomic_write_json

        atomic_write_json(args.json, {r.model: r.to_dict() for r in results})
    if args.html:
        from ..atomic import atomic_write_text
        from ..html import render_bench

        atomic_write_text(args.html, render_bench([r.to_dict() for r in results], note=f"{threads} threads, "
                          f"cpu {settings.get('FUSEGUARD_MCPU') or options.mcpu or 'detected'}"))
        print(f"wrote {args.html}")
    return worst


def _bench_cliff(args: argparse.Namespace, options: Any, threads: int, shapes: dict) -> int:
    """`bench --dynamic NAME --dim NAME=A,B,...`: the symbolic build against a static build per size."""
    from rich.console import Console

    from fuseguard.compiler.plugins import env_for

    from ..check.model import SuiteSpec
    from ..progress import Progress
    from ..perf.timing import timing_env
    from ..worker import Worker

    dynamic = {d.name for d in options.dynamic}
    sizes = dict(dim_sizes(item, dynamic, "--dim") for item in args.dim)
    if not sizes:
        raise UsageError("bench --dynamic needs the sizes to time, e.g. --dim seq=16,64,128,384")
    buckets = dict(dim_sizes(item, dynamic, "--buckets", name_optional=True) for item in args.buckets)
    args.dim = []
    sources = model_sources(args)
    console = Console(width=None if sys.stdout.isatty() else 160)
    results = []
    args.worst = EXIT_OK
    env = {**env_for(args.plugin), **timing_env(threads)}
    with Progress(len(sources)) as progress, \
            Worker(sys_path=[str(Path.cwd())], env={**env, **progress.env}, forward_output=args.debug) as worker:
        for i, source in enumerate(sources):
            label = source.label if isinstance(source, SuiteSpec) else str(source)
            progress.start(i + 1, label)
            result = call_one(args, worker, "fuseguard.verify.perf.cliff:bench_cliff", label, f"timing {label} dynamic vs static",
                               source=source, options=options, sizes=sizes, threads=threads, repeats=args.repeats,
                               buckets=buckets, shapes=shapes if not isinstance(source, SuiteSpec) else None)
            if result is FAILED_CALL:
                continue
            results.append(result)
            progress.done(label, f"worst dynamic/static {result.worst:.2f}x")
            console.print(result.render())
    if args.json:
        from ..atomic import atomic_write_json

        atomic_write_json(args.json, {r.model: r.to_dict() for r in results})
    return args.worst


def cmd_baseline(args: argparse.Namespace) -> int:
    from fuseguard.compiler.plugins import env_for, load_plugins

    from ..perf.baselines import from_pytest_benchmark, load_baselines, record, to_pytest_benchmark
    from ..perf.latency import BASELINE_DIR, PROCESSES, baseline_path, gate_model
    from ..worker import Worker, WorkerFailure

    load_plugins(args.plugin)
    options = options_of(args)
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

        from ..perf.history import baseline_history, plot, render_table

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
    from ..perf.gate import Gate, load_gate_config

    gate = Gate.from_config(load_gate_config(None, path.parent))
    if not args.models:
        from fuseguard.suites.latency_set import LATENCY_SET, latency_spec

        sources = [latency_spec(name) for name in LATENCY_SET]
    else:
        sources = model_sources(args)
    worst = EXIT_OK
    from ..perf.timing import timing_env

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


def cmd_profile(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fuseguard.compiler.plugins import env_for, load_plugins
    from fuseguard.compiler.hw.target import host_cores

    from ..perf.timing import timing_env
    from ..worker import Worker

    load_plugins(args.plugin)
    options = options_of(args)
    if options.gpu_arch:
        raise UsageError("fuseguard profile times the host CPU")
    threads = args.threads or host_cores()
    console = Console(width=None if sys.stdout.isatty() else 200)
    results, args.worst = [], EXIT_OK
    env = {**env_for(args.plugin), **timing_env(threads, against_ort=False)}
    with Worker(sys_path=[str(Path.cwd())], env=env, forward_output=args.debug) as worker:
        for _, result in each_model(args, worker, "fuseguard.verify.perf.profile:profile_model", "profiling", options=options,
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
        from ..atomic import atomic_write_json

        atomic_write_json(args.json, {r.model: r.to_dict() for r in results})
    if args.html:
        from ..atomic import atomic_write_text
        from ..html import render_profile

        atomic_write_text(args.html, render_profile({r.model: r.to_dict() for r in results}))
        print(f"wrote {args.html}", file=sys.stderr)
    return args.worst


def cmd_tune(args: argparse.Namespace) -> int:
    from fuseguard.compiler.plugins import env_for, load_plugins
    from fuseguard.compiler.hw.target import host_cores

    from ..perf.timing import timing_env
    from ..worker import Worker

    load_plugins(args.plugin)
    options = options_of(args)
    if options.gpu_arch:
        raise UsageError("fuseguard tune measures on the host CPU")
    threads = args.threads or host_cores()
    args.worst = EXIT_OK
    env = {**env_for(args.plugin), **timing_env(threads, against_ort=False)}
    from ..perf.tune import PROCESSES

    processes = args.processes or PROCESSES
    with Worker(sys_path=[str(Path.cwd())], env=env, forward_output=args.debug) as worker:
        for source, first in each_model(args, worker, "fuseguard.verify.perf.tune:profile_for_tuning", "tuning (process 1)",
                                         options=options, threads=threads, repeats=args.repeats, db=args.decision_db):
            profiles = [first]
            label = getattr(source, "label", str(source))
            for n in range(2, processes + 1):
                worker.close()          # a fresh process: the builds come from the cache, loaded, not compiled
                got = call_one(args, worker, "fuseguard.verify.perf.tune:profile_for_tuning", label,
                                f"tuning {label} (process {n})", source=source, shapes=shapes_for(args, source),
                                options=options, threads=threads, repeats=args.repeats, db=args.decision_db)
                if got is FAILED_CALL:
                    break
                profiles.append(got)
            else:
                result = call_one(args, worker, "fuseguard.verify.perf.tune:record_tuning", label, f"recording {label}",
                                   profiles=profiles, options=options, db=args.decision_db, source=source,
                                   shapes=shapes_for(args, source), threads=threads, confirm=not args.no_confirm)
                if result is not FAILED_CALL:
                    print(result.render())
    return args.worst


def cmd_gate(args: argparse.Namespace) -> int:
    import tempfile

    from rich.console import Console

    from fuseguard.compiler.frontend.loader import parse_shape_spec
    from fuseguard.compiler.plugins import env_for, load_plugins
    from fuseguard.compiler.hw.target import host_cores
    from fuseguard.suites.latency_set import LATENCY_SET, latency_spec

    from ..perf import ab
    from ..perf.gate import GatePolicy
    from ..perf.timing import timing_env

    load_plugins(args.plugin)
    options = options_of(args)
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
    sources = model_sources(args) if args.models else [latency_spec(n) for n in LATENCY_SET]
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
        from ..atomic import atomic_write_json

        atomic_write_json(args.json, {"base": commit, "results": [r.to_dict() for r in results]})
    if args.html:
        from ..atomic import atomic_write_text
        from ..html import render_gate

        atomic_write_text(args.html, render_gate([r.to_dict() for r in results], base=commit))
        print(f"wrote {args.html}")
    failed = [r for r in results if ab.verdict_is_failure(r)]
    changed = [r for r in results if r.outputs_match is False]
    print(f"fuseguard gate: {len(results) - len(failed)}/{len(results)} passed against {commit[:12]}"
          + (f"; outputs changed in {', '.join(r.model for r in changed)}" if changed else ""))
    return EXIT_MISMATCH if failed else EXIT_OK
