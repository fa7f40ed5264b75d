"""The other commands: `fuseguard reduce`, `conformance`, `cache`, `device-bundle`, `patterns` and `env`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fuseguard.compiler import settings
from fuseguard.compiler.errors import UsageError
from .common import EXIT_MISMATCH, EXIT_OK, model_sources, options_of


def cmd_reduce(args: argparse.Namespace) -> int:
    from fuseguard.compiler.plugins import env_for, load_plugins

    from ..debug.reduce import reduce_model
    from ..worker import Worker

    load_plugins(args.plugin)
    options = options_of(args)
    (source,) = model_sources(args)
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


def cmd_conformance(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fuseguard.compiler.plugins import env_for, load_plugins

    from ..check.conformance import case_names, run_in_worker
    from ..worker import Worker

    load_plugins(args.plugin)
    options = options_of(args)
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
        from ..atomic import atomic_write_json

        atomic_write_json(args.json, report.to_dict())
    return EXIT_OK if report else EXIT_MISMATCH


def cmd_cache(args: argparse.Namespace) -> int:
    from fuseguard.compiler.cache import BuildCache

    cache = BuildCache()
    if args.action == "clear":
        print(f"removed {cache.clear()} build(s) from {cache.dir}")
        return EXIT_OK
    info = cache.info()
    print(f"{info['directory']}: {info['entries']} build(s), {info['bytes'] / 2**20:.1f} MiB "
          f"(cap {info['max_bytes'] / 2**20:.0f} MiB, least recently used go first)")
    from fuseguard.compiler import toolchain

    print("the key sees this toolchain:")
    for line in toolchain.describe():
        print(f"  {line}")
    return EXIT_OK


def cmd_device_bundle(args: argparse.Namespace) -> int:
    from fuseguard.compiler.hw.target import resolve

    from ..device.bundle import make_bundle

    resolve(args.gpu_arch)       # a bad --gpu-arch is a usage error before anything builds
    manifest = make_bundle(args.out, target=args.gpu_arch, mode=args.mode)
    print(f"{args.out}: {len(manifest['entries'])} models fused and unfused for {args.gpu_arch}, "
          f"{manifest['bytes'] / 2**20:.1f} MiB; on the device: bash scripts/gpu-check.sh {args.out} smoke|full")
    return EXIT_OK


def cmd_patterns(args: argparse.Namespace) -> int:
    from fuseguard.compiler.patterns import PATTERNS

    for name, rule in PATTERNS.items():
        print(f"{name:20s} {rule.description}")
    return EXIT_OK


def cmd_env(args: argparse.Namespace) -> int:
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
