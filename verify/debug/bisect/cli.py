"""`fuseguard bisect`: its parser and its run (each model bisected in a worker process)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fuseguard.compiler.errors import UsageError

from .results import EXIT_UNTESTABLE


def add_bisect_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`fuseguard bisect MODEL`: the sub-command, on the CLI's sub-parsers."""
    p = subparsers.add_parser(
        "bisect", help="find the fused group (or lowered operator) where the output drifts",
        description="Compile fused and unfused with every kernel output captured (fusion intact), run both and "
                    "ONNX Runtime, and name the first fused group or operator whose output drifts while its "
                    "inputs agree. Writes a reproducer (sub-model + inputs). Exit codes for `git bisect run`: "
                    "0 no drift, 1 drift, 125 cannot be built at this commit, 2 usage error.")
    p.add_argument("model", metavar="MODEL", help="an ONNX file or a built-in suite model name")
    from ...options import BISECT_TIMEOUT_S, add_build_options, add_compare_options, add_model_options

    add_build_options(p.add_argument, timeout=BISECT_TIMEOUT_S)
    add_model_options(p.add_argument)
    add_compare_options(p.add_argument)
    p.add_argument("--out", default="fuseguard-bisect", metavar="DIR",
                   help="where the reproducer goes (default ./fuseguard-bisect)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")
    p.add_argument("--html", default=None, metavar="FILE", help="write a self-contained HTML page (the verdict, "
                   "both builds against ONNX Runtime, the drifting group, its ONNX nodes and the reproducer)")
    p.add_argument("--no-confirm", action="store_true", help="do not re-verify the reproducer (saves two builds)")
    p.add_argument("--onnx-order", action="store_true",
                   help="for import/lowering drift, bisect ONNX node order instead of using captured kernels")
    return p


def run_bisect(args: argparse.Namespace) -> int:
    """Run `fuseguard bisect`; returns the exit code (0 no drift, 1 drift, 125 untestable)."""
    from rich.console import Console

    from fuseguard.compiler.frontend.loader import parse_shape_spec
    from fuseguard.compiler.plugins import load_plugins

    from ...check.model import SuiteSpec, dim_overrides, resolve_model_arg
    from ...options import compile_options, getter
    from ...options import tolerances as tolerances_from

    load_plugins(args.plugin)
    options = compile_options(getter(args))
    tolerances = tolerances_from(args.atol, args.rtol)
    shapes = dict(parse_shape_spec(s) for s in args.shape)
    source: Any = resolve_model_arg(args.model, dims=dim_overrides(args.dim), seed=args.seed)
    if isinstance(source, SuiteSpec) and shapes:
        raise UsageError("--shape needs a MODEL.onnx (a built-in suite model pins its own shapes)")
    # In a worker: a native crash or hang in TVM at this commit is "cannot test" (125), not a dead bisect.
    from fuseguard.compiler.plugins import env_for

    from ...worker import Worker, WorkerFailure, WorkerTaskError

    label = source.label if isinstance(source, SuiteSpec) else str(source)
    with Worker(sys_path=[str(Path.cwd())], env=env_for(args.plugin), forward_output=args.debug) as worker:
        try:
            result = worker.call("fuseguard.verify.debug.bisect.search:bisect_model", what=f"bisecting {label}", timeout=args.timeout,
                                 source=source, shapes=shapes or None, options=options, inputs=args.inputs,
                                 seed=args.seed, tolerances=tolerances, out_dir=args.out,
                                 confirm=not args.no_confirm, default_dim=args.default_dim,
                                 strategy="onnx-order" if args.onnx_order else "capture")
        except (WorkerFailure, WorkerTaskError) as err:
            # A crash, a hang or an exception in the bisection at this commit: "cannot test" (125) for
            # `git bisect run`, never 1 (= "bad").
            if args.debug and getattr(err, "remote_traceback", None):
                print(err.remote_traceback, file=sys.stderr)
            print(f"fuseguard: cannot test: {label}: {str(err).splitlines()[0]}", file=sys.stderr)
            return EXIT_UNTESTABLE
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(result.render())
    if args.json:
        from ...atomic import atomic_write_json

        atomic_write_json(args.json, result.to_dict())
    if args.html:
        from ...atomic import atomic_write_text
        from ...html import render_bisect

        atomic_write_text(args.html, render_bisect(result.to_dict()))
        print(f"wrote {args.html}", file=sys.stderr)
    if result.status == "untestable":
        print(f"fuseguard: cannot test: {result.error}", file=sys.stderr)
    return result.exit_code
