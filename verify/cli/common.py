"""What every `fuseguard` sub-command shares: exit codes, the parser that fails in one line, the build
options, the models a command names, and running one task per model in a worker."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from collections.abc import Iterator
from typing import Any

from fuseguard.compiler.errors import FuseguardError, UsageError


EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2
#: fuseguard itself failed (a bug, or the disk): said in one line naming the command, never a traceback.
EXIT_INTERNAL = 3


class Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line (its default), and never prints a traceback."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"fuseguard: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def add_model_and_build_options(p: argparse.ArgumentParser) -> None:
    from ..options import add_build_options, add_model_options

    add_model_options(p.add_argument)
    add_build_options(p.add_argument)


def add_build_options_only(p: argparse.ArgumentParser) -> None:
    from ..options import add_build_options

    add_build_options(p.add_argument, timeout=300.0)


def options_of(args: argparse.Namespace):
    from ..options import compile_options, getter

    return compile_options(getter(args))


def model_sources(args: argparse.Namespace) -> list[Any]:
    from fuseguard.suites.models import suite_models, zoo_models

    from ..check.model import dim_overrides, resolve_model_arg

    dims, seed = dim_overrides(args.dim), getattr(args, "seed", None)
    names = args.models or [m.name for m in suite_models(include_slow=not args.quick)] + \
        [m.name for m in zoo_models() if not (args.quick and m.slow)]
    return [resolve_model_arg(item, dims=dims, seed=seed) for item in names]


def dim_sizes(item: str, dynamic: set[str], flag: str, *, name_optional: bool = False) -> tuple[str, list[int]]:
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


FAILED_CALL = object()


def about(label: str, err: BaseException | str) -> str:
    """`err`'s message naming the model it is about: prefixed with `label` (the model's path or suite name)
    unless the message already names it (a message from deep inside, such as an input of element type STRING,
    knew the input but not the file)."""
    text = str(err)
    stem = Path(label).stem if label else ""
    if not label or label in text or (stem and stem in text):
        return text
    return f"{label}: {text}"


def model_label(args: argparse.Namespace) -> str:
    """The one model a single-model command (profile, bisect, reduce, compile, cliff) is about, else ""."""
    for attr in ("model", "models"):
        value = getattr(args, attr, None)
        if isinstance(value, str):
            return value
        if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], str):
            return value[0]
    return ""


def call_one(args: argparse.Namespace, worker: Any, task: str, label: str, what: str, **kwargs: Any) -> Any:
    """`worker.call(task)` for one model; a failure is reported in one line, lands in `args.worst`, and
    returns `FAILED_CALL`."""
    from ..worker import WorkerFailure, WorkerTaskError

    try:
        return worker.call(task, what=what, timeout=args.timeout, **kwargs)
    except FuseguardError as err:
        print(f"fuseguard: error: {about(label, err)}", file=sys.stderr)
        args.worst = max(getattr(args, "worst", EXIT_OK), err.exit_code)
    except (WorkerFailure, WorkerTaskError) as err:
        print(f"fuseguard: error: {label}: {str(err).splitlines()[0]}", file=sys.stderr)
        args.worst = max(getattr(args, "worst", EXIT_OK), EXIT_MISMATCH)
    return FAILED_CALL


def each_model(args: argparse.Namespace, worker: Any, task: str, verb: str,
                **kwargs: Any) -> Iterator[tuple[Any, Any]]:
    """Run `task` in `worker` for every MODEL argument; yield (source, result) for the ones that ran and
    report the others in one line each (the exit code lands in `args.worst`)."""
    from ..check.model import SuiteSpec

    for source in model_sources(args):
        label = source.label if isinstance(source, SuiteSpec) else str(source)
        result = call_one(args, worker, task, label, f"{verb} {label}", source=source,
                           shapes=shapes_for(args, source), **kwargs)
        if result is not FAILED_CALL:
            yield source, result


def shapes_for(args: argparse.Namespace, source: Any) -> dict[str, Any] | None:
    """The --shape pins for a file (suite models carry their own), as `each_model` passes them."""
    from fuseguard.compiler.frontend.loader import parse_shape_spec

    from ..check.model import SuiteSpec

    return None if isinstance(source, SuiteSpec) else dict(parse_shape_spec(s) for s in getattr(args, "shape", []))
