"""Build, model and tolerance options, defined once and shared by the CLI, `fuseguard bisect` and pytest.

pytest-benchmark's pattern: each group is an `add_*_options(addoption, prefix)` function over a plain
`addoption` callable, so `argparse.ArgumentParser.add_argument` and pytest's `group.addoption` take the
same definitions. Under pytest every option is also spelled with the `fuseguard-` prefix; the names
that cannot collide with other plugins (`--gpu-arch`, `--no-fusion`, ...) keep their short form too, as
the README documents. Values are checked at parse time (`type=` functions raising `ArgumentTypeError`).

`compile_options(get)` and `tolerances(atol, rtol)` turn parsed values into the objects the pipeline
and the comparator take: one place builds them, whatever the entry point.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from typing import Any

AddOption = Callable[..., Any]

#: pytest spelling prefix; `--plugin`/`--timeout`/`--debug` exist only prefixed there (pytest-timeout
#: owns `--timeout`, and `--debug` is pytest's own).
PYTEST_PREFIX = "fuseguard-"
_PREFIX_ONLY = {"plugin", "timeout", "debug", "no-cache", "cache-dir"}

#: Per-model limit for compile + run in the worker. DenseNet-121 builds in ~30 s per side here; 900 s
#: leaves room for a 2-core machine under load. Bisection runs 2-6 builds, so it gets twice as much.
DEFAULT_TIMEOUT_S = 900.0
BISECT_TIMEOUT_S = 1800.0


def _number(text: str, ok: Callable[[float], bool], want: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    return _number(text, lambda v: v > 0, "a number > 0")


def slowdown_factor(text: str) -> float:
    """A gate's factor: a slowdown ratio, so > 1."""
    return _number(text, lambda v: v > 1, "a slowdown ratio > 1")


def _tolerance_value(text: str) -> float:
    return _number(text, lambda v: v == v and v >= 0, "a number >= 0")


def _names(name: str, prefix: str) -> list[str]:
    if not prefix:
        return [f"--{name}"]
    if name in _PREFIX_ONLY:
        return [f"--{prefix}{name}"]
    return [f"--{name}", f"--{prefix}{name}"]


def dest(name: str, prefix: str = "") -> str:
    """The attribute an option lands in (`gpu-arch` -> `gpu_arch`, under pytest `fuseguard_gpu_arch`)."""
    return (prefix + name).replace("-", "_")


def _add(addoption: AddOption, prefix: str, name: str, **kwargs: Any) -> None:
    addoption(*_names(name, prefix), dest=dest(name, prefix), **kwargs)


def add_build_options(addoption: AddOption, prefix: str = "", *, timeout: float = DEFAULT_TIMEOUT_S,
                      debug: bool = True) -> None:
    """How a model is compiled: target, fusion switches, plugins, and the worker's limit."""
    _add(addoption, prefix, "gpu-arch", default=None, metavar="ARCH",
         help="compile for CUDA sm_80/sm_86/sm_89/sm_90; the device run is skipped without a CUDA device")
    _add(addoption, prefix, "mcpu", default=None, metavar="CPU", help="LLVM CPU for the host target (default: detected)")
    _add(addoption, prefix, "no-fusion", action="store_true", default=False,
         help="turn every fusion off (the unfused fallback)")
    _add(addoption, prefix, "disable-pattern", action="append", default=[], metavar="NAME",
         help="turn one fusion pattern off (repeatable); see `fuseguard patterns`")
    _add(addoption, prefix, "no-schedule", action="store_true", default=False,
         help="build without CPU schedules (TVM's naive loops)")
    _add(addoption, prefix, "no-layout", action="store_true", default=False,
         help="keep convs in NCHW: no channel-blocked layout step (compiler/passes/layout.py)")
    _add(addoption, prefix, "no-channel-padding", action="store_true", default=False,
         help="block only convs whose channels are whole blocks: no zero-filter padding (compiler/passes/padding.py)")
    _add(addoption, prefix, "no-concat-in-place", action="store_true", default=False,
         help="keep every concatenation a copy: no inputs written in place (compiler/passes/concat_in_place.py)")
    _add(addoption, prefix, "no-qdq-fold", action="store_true", default=False,
         help="int8 QDQ models: keep each Quantize->Dequantize pair as two kernels instead of exact fp32 "
              "arithmetic fused into its producer (compiler/passes/qdq.py)")
    _add(addoption, prefix, "no-int8-kernels", action="store_true", default=False,
         help="int8 QDQ models: compute MatMuls on int8 weights in fp32 on the dequantised grid instead of "
              "integer GEMMs on VNNI (compiler/passes/int8_gemm.py)")
    _add(addoption, prefix, "precision", choices=("fp32", "fp16", "bf16"), default="fp32",
         help="compute GEMM/conv operands in fp16 or bf16, accumulated in fp32 (fused and unfused alike); "
              "each build is then also compared with an fp64 run (default fp32)")
    _add(addoption, prefix, "plugin", action="append", default=[], metavar="MODULE",
         help="import a Python module that registers fusion patterns or passes (repeatable)")
    _add(addoption, prefix, "timeout", type=_positive_float, default=timeout, metavar="S",
         help=f"limit for the work on one model in its worker process (default {timeout:g} s)")
    _add(addoption, prefix, "no-cache", action="store_true", default=False,
         help="compile everything anew: neither read nor write the build cache (FUSEGUARD_NO_CACHE=1)")
    _add(addoption, prefix, "cache-dir", default=None, metavar="DIR",
         help="build cache and materialised base revisions (default: FUSEGUARD_CACHE_DIR, else "
              "~/.cache/fuseguard)")
    if debug:
        _add(addoption, prefix, "debug", action="store_true", default=False,
             help="show tracebacks (from the worker too)")


def add_model_options(addoption: AddOption, prefix: str = "") -> None:
    """Which shapes a model is built at."""
    _add(addoption, prefix, "shape", action="append", default=[], metavar="NAME=DIMS",
         help="pin an input shape, e.g. input=1x3x224x224 (repeatable)")
    _add(addoption, prefix, "dim", action="append", default=[], metavar="NAME=N",
         help="free dimension of a built-in suite model, e.g. seq=128 or batch=2 (repeatable)")
    _add(addoption, prefix, "default-dim", type=int, default=None, metavar="N",
         help="value for every dynamic dimension not pinned by --shape or --inputs "
              "(default: 1 for batch, 224 for image height/width, 16 otherwise)")
    add_dynamic_options(addoption, prefix)


def add_dynamic_options(addoption: AddOption, prefix: str = "") -> None:
    """Symbolic dims (compiler/dynamic.py) and how many sizes to draw for them."""
    _add(addoption, prefix, "dynamic", type=_dynamic_dims, action="append", default=[], metavar="NAME[<=N]",
         help="keep the input dimensions named NAME symbolic: one build serves every size (e.g. seq<=512; "
              "a bound plans memory for it; comma-separated or repeated)")
    _add(addoption, prefix, "draws", type=_draws, default=None, metavar="N",
         help="with --dynamic: check N hypothesis-drawn sizes against one fused and one unfused build "
              "(default 50); a failing size is shrunk to the smallest that fails")


def _dynamic_dims(text: str) -> tuple:
    from fuseguard.compiler.dynamic import parse_dynamic
    from fuseguard.compiler.errors import UsageError

    try:
        return parse_dynamic(text)
    except UsageError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix(f"--dynamic {text!r}: ")) from None


def positive_int(text: str) -> int:
    """A count: an integer >= 1."""
    return int(_number(text, lambda v: v >= 1 and v == int(v), "an integer >= 1"))


_draws = positive_int


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (0 usually turns something off)."""
    return _number(text, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")


def percentage(text: str) -> float:
    """A share in percent: a number in [0, 100)."""
    return _number(text, lambda v: 0 <= v < 100, "a percentage in [0, 100)")


def add_compare_options(addoption: AddOption, prefix: str = "") -> None:
    """Which inputs, and how close is close enough."""
    _add(addoption, prefix, "inputs", default=None, metavar="FILE.npz",
         help="input arrays keyed by input name (missing inputs are drawn at random)")
    _add(addoption, prefix, "seed", type=int, default=None,
         help="seed for random inputs (default: the suite model's own seed, 0 for files)")
    _add(addoption, prefix, "atol", type=_tolerance_value, default=None,
         help="absolute tolerance for float outputs (each float dtype keeps its default rtol)")
    _add(addoption, prefix, "rtol", type=_tolerance_value, default=None,
         help="relative tolerance for float outputs (each float dtype keeps its default atol)")


def getter(namespace: argparse.Namespace | None = None, *, config: Any = None,
           prefix: str = "") -> Callable[[str], Any]:
    """`get("gpu-arch")` over an argparse namespace or a pytest config, whichever entry point parsed."""
    if config is not None:
        return lambda name: config.getoption(dest(name, prefix))
    return lambda name: getattr(namespace, dest(name, prefix), None)


def compile_options(get: Callable[[str], Any]) -> Any:
    """The one place that turns parsed options into `CompileOptions`."""
    from fuseguard.compiler.dynamic import parse_dynamic
    from fuseguard.compiler.pipeline import CompileOptions

    return CompileOptions(gpu_arch=get("gpu-arch"), mcpu=get("mcpu"), fusion=not get("no-fusion"),
                          disabled_patterns=frozenset(get("disable-pattern") or ()),
                          schedule=not get("no-schedule"), layout=not get("no-layout"),
                          channel_padding=not get("no-channel-padding"), qdq=not get("no-qdq-fold"),
                          int8_kernels=not get("no-int8-kernels"), concat_in_place=not get("no-concat-in-place"),
                          precision=get("precision") or "fp32",
                          dynamic=parse_dynamic([str(d) for group in (get("dynamic") or ()) for d in group]))


def apply_cache_options(get: Callable[[str], Any]) -> None:
    """`--no-cache` / `--cache-dir` as the environment the workers inherit (compiler/cache.py reads it)."""
    import os

    from fuseguard.compiler.cache import ENV_DIR, ENV_OFF

    if get("no-cache"):
        os.environ[ENV_OFF] = "1"
    if get("cache-dir"):
        os.environ[ENV_DIR] = os.path.abspath(get("cache-dir"))


def tolerances(atol: float | None, rtol: float | None) -> Mapping[str, Any] | None:
    """`--atol`/`--rtol` as a per-dtype table: a bound the user gave replaces that bound for every float
    dtype; the other bound stays each dtype's default (so `--atol 1e-3` keeps float16's rtol 1e-2)."""
    if atol is None and rtol is None:
        return None
    from .check.compare import DEFAULT_TOLERANCES, Tolerance

    return {name: Tolerance(atol if atol is not None else tol.atol, rtol if rtol is not None else tol.rtol)
            for name, tol in DEFAULT_TOLERANCES.items() if name.startswith(("float", "bfloat"))}


def option_names(add: Callable[[AddOption, str], None], prefix: str = "") -> set[str]:
    """Every spelling an `add_*_options` function defines (for the CLI/pytest parity test)."""
    names: set[str] = set()
    add(lambda *flags, **_: names.update(flags), prefix)
    return names
