"""Compare one run's outputs with a reference run, element by element, and explain the verdict.

Results are values (Polygraphy's comparator style): `OutputCompareResult` and `CompareResult` are
truthy exactly when the comparison passed, and carry the statistics needed to judge a failure
without rerunning: error percentiles, where the worst element is, and the smallest tolerance that
would have passed.

The rule (numpy `isclose` / `torch.testing.assert_close`, chosen over Polygraphy's "fails only if
it exceeds both" because one bound is easier to reason about and to tighten): a finite element
passes when ``|actual - reference| <= atol + rtol * |reference|``, evaluated in float64.
Non-finite values follow fixed rules that no tolerance can relax:

* NaN or Inf in the actual where the reference is finite never passes (not even with atol=inf):
  a fused kernel that overflows is a bug, however loose the tolerance.
* Inf in the reference passes only against an Inf of the same sign at the same position.
* NaN in the reference fails by default (``nan_equal=False``, as torch's ``equal_nan``): a NaN
  reference usually means the random inputs are out of the model's domain, so the comparison
  proves nothing and should be looked at. With ``nan_equal=True`` a NaN passes only against a NaN.

Integer and bool outputs compare exactly (native equality, no float rounding); shapes must match
exactly (no broadcasting); empty tensors pass on matching shape and dtype alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from rich.markup import escape
from rich.table import Table

from fuseguard.compiler.errors import UsageError

#: Added to ``|reference|`` where it is 0 when computing relative error (Polygraphy's choice).
REL_EPSILON: float = float(np.finfo(np.float64).eps)


@dataclass(frozen=True)
class Tolerance:
    """An element passes when ``|actual - reference| <= atol + rtol * |reference|``.

    ``atol`` may be ``inf`` (accept any finite error); ``rtol`` must be finite because
    ``inf * 0`` is undefined where the reference is 0.
    """

    atol: float
    rtol: float

    def __post_init__(self) -> None:
        for field, value in (("atol", self.atol), ("rtol", self.rtol)):
            if not isinstance(value, (int, float, np.floating, np.integer)) or math.isnan(value) or value < 0:
                raise UsageError(f"tolerance {field} must be a number >= 0, got {value!r}")
        if math.isinf(self.rtol):
            raise UsageError("tolerance rtol must be finite (inf * 0 is undefined where the reference is 0)")
        object.__setattr__(self, "atol", float(self.atol))
        object.__setattr__(self, "rtol", float(self.rtol))

    @property
    def exact(self) -> bool:
        return self.atol == 0.0 and self.rtol == 0.0

    def __str__(self) -> str:
        return f"atol={self.atol:.3g} rtol={self.rtol:.3g}"


EXACT = Tolerance(0.0, 0.0)

#: Per-dtype defaults, keyed by numpy dtype name.
#:
#: ==========  =======  =======  ====================================================================
#: dtype       atol     rtol     why
#: ==========  =======  =======  ====================================================================
#: float64     1e-7     1e-7     torch's defaults; fp64 paths rarely reorder reductions.
#: float32     1e-4     1e-4     looser than torch (1e-5 / 1.3e-6): fused vs ORT on deep CNNs
#:                               (ResNet-50, random He-init weights) sums thousands of terms per
#:                               output in a different order, and the error grows with depth; 1e-4
#:                               passes correct kernels there and still catches wrong indexing or
#:                               a dropped bias, which err at the 1e-2..1e0 scale.
#: float16     1e-3     1e-2     fp16 eps is 9.8e-4; a few ulps of reordering per layer.
#: bfloat16    1e-2     5e-2     bf16 eps is 7.8e-3 (torch uses rtol 1.6e-2 for single ops).
#: ints, bool  0        0        exact: indices, argmax, masks and shapes have no "close enough".
#: ==========  =======  =======  ====================================================================
DEFAULT_TOLERANCES: Mapping[str, Tolerance] = {
    "float64": Tolerance(1e-7, 1e-7),
    "float32": Tolerance(1e-4, 1e-4),
    "float16": Tolerance(1e-3, 1e-2),
    "bfloat16": Tolerance(1e-2, 5e-2),
    **{name: EXACT for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")},
}

Tolerances = Tolerance | Mapping[str, Tolerance] | None
"""One `Tolerance` for every floating output, a dtype-name -> `Tolerance` table that overrides
entries of `DEFAULT_TOLERANCES`, or None for the defaults."""


def _is_exact_dtype(dtype: np.dtype) -> bool:
    return dtype.kind in "biu"


def resolve_tolerance(name: str, dtype: np.dtype, tolerances: Tolerances = None,
                      per_output: Mapping[str, Tolerance] | None = None) -> Tolerance:
    """Pick the tolerance for one output: per-output override, then global, then dtype default.

    A single global `Tolerance` applies to floating outputs only, so loosening floats never
    makes an index output "approximately right"; name the output in ``per_output`` to do that.
    """
    if per_output and name in per_output:
        return per_output[name]
    if isinstance(tolerances, Tolerance):
        return EXACT if _is_exact_dtype(dtype) else tolerances
    table = {**DEFAULT_TOLERANCES, **(tolerances or {})}
    if dtype.name in table:
        return table[dtype.name]
    if _is_exact_dtype(dtype):
        return EXACT
    raise UsageError(f"no default tolerance for output {name!r} of dtype {dtype.name}; "
                     f"pass tolerances={{'{dtype.name}': Tolerance(atol, rtol)}}")


@dataclass(frozen=True, kw_only=True)
class OutputCompareResult:
    """The verdict and error statistics for one output; truthy when it passed.

    Error statistics cover the positions where both sides are finite and are None when there are
    none (empty tensor, shape mismatch, missing output). ``min_atol`` is the smallest atol that
    passes with this result's rtol, ``min_rtol`` the smallest rtol that passes with its atol (both
    exact in float64: one float below fails); None when no finite value would pass (a NaN/Inf rule
    is broken, or a reference 0 would need an infinite rtol).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    passed: bool
    tolerance: Tolerance
    reason: str = ""
    note: str = ""
    size: int = 0
    mismatches: int = 0
    mismatch_fraction: float = 0.0
    nonfinite_mismatches: int = 0
    nan_actual: int = 0
    inf_actual: int = 0
    nan_reference: int = 0
    inf_reference: int = 0
    max_abs_error: float | None = None
    mean_abs_error: float | None = None
    median_abs_error: float | None = None
    p99_abs_error: float | None = None
    max_abs_index: tuple[int, ...] | None = None
    max_rel_error: float | None = None
    mean_rel_error: float | None = None
    median_rel_error: float | None = None
    p99_rel_error: float | None = None
    first_mismatch_index: tuple[int, ...] | None = None
    min_atol: float | None = None
    min_rtol: float | None = None
    abs_error_histogram: tuple[tuple[float, ...], tuple[int, ...]] | None = None

    def __bool__(self) -> bool:
        return self.passed

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types only (lists, floats, ints, str, None), for reports and baselines."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Tolerance):
                value = {"atol": value.atol, "rtol": value.rtol}
            elif field.name == "abs_error_histogram" and value is not None:
                value = {"edges": list(value[0]), "counts": list(value[1])}
            out[field.name] = _jsonable(value)
        return out


class CompareResult(Mapping[str, OutputCompareResult]):
    """Output name -> `OutputCompareResult`, in reference order; truthy when every output passed."""

    __slots__ = ("_outputs",)

    def __init__(self, outputs: Mapping[str, OutputCompareResult]) -> None:
        if not outputs:
            raise UsageError("nothing to compare: both runs produced no outputs")
        self._outputs = dict(outputs)

    def __getitem__(self, name: str) -> OutputCompareResult:
        return self._outputs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._outputs)

    def __len__(self) -> int:
        return len(self._outputs)

    def __bool__(self) -> bool:
        return all(self._outputs.values())

    def __repr__(self) -> str:
        return f"CompareResult({self.summary()!r})"

    @property
    def passed(self) -> bool:
        return bool(self)

    @property
    def failed(self) -> list[str]:
        return [name for name, result in self._outputs.items() if not result]

    @property
    def worst(self) -> OutputCompareResult:
        """The output to look at first: failing before passing, NaN/Inf failures first, then the
        largest max abs error."""
        return max(self._outputs.values(),
                   key=lambda r: (not r.passed, r.nonfinite_mismatches > 0,
                                  -math.inf if r.max_abs_error is None else r.max_abs_error))

    def summary(self) -> str:
        worst = self.worst
        where = f" at {worst.max_abs_index}" if worst.max_abs_index is not None else ""
        err = f"max abs err {_fmt(worst.max_abs_error)}{where}"
        if self:
            return f"PASS: {len(self)}/{len(self)} outputs within tolerance (worst {worst.name!r}: {err})"
        return (f"FAIL: {len(self.failed)}/{len(self)} outputs failed "
                f"(worst {worst.name!r}: {worst.reason})")

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "summary": self.summary(),
                "outputs": {name: result.to_dict() for name, result in self._outputs.items()}}

    def __rich__(self) -> Table:
        return render_table(self)


def _jsonable(value: Any) -> Any:
    """Strict JSON: tuples become lists, and a non-finite float its name ("inf"), never a bare Infinity."""
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def render_table(result: CompareResult) -> Table:
    """Per-output stats with "Minimum Required Tolerance" (Polygraphy), for a terminal report."""
    table = Table(title=escape(result.summary()), title_justify="left", caption_justify="left")
    for header in ("output", "dtype", "shape", "status", "tolerance", "max abs (index)", "mean abs",
                   "p99 abs", "max rel", "mismatches", "min atol @rtol", "min rtol @atol"):
        table.add_column(header, justify="left" if header in ("output", "status") else "right")
    for name, r in result.items():
        where = f" {r.max_abs_index}" if r.max_abs_index is not None else ""
        status = "[green]pass[/green]" if r else "[red]FAIL[/red]"
        table.add_row(
            escape(name), r.dtype, str(r.shape), status, str(r.tolerance), f"{_fmt(r.max_abs_error)}{where}",
            _fmt(r.mean_abs_error), _fmt(r.p99_abs_error), _fmt(r.max_rel_error),
            f"{r.mismatches} ({r.mismatch_fraction:.2%})",
            f"{_fmt(r.min_atol)} @{r.tolerance.rtol:.3g}", f"{_fmt(r.min_rtol)} @{r.tolerance.atol:.3g}",
        )
    failures = [f"{escape(name)}: {escape(r.reason)}" for name, r in result.items() if not r]
    notes = [f"{escape(name)}: {escape(r.note)}" for name, r in result.items() if r.note]
    table.caption = "\n".join(failures + notes) or None
    return table


def _to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "numpy") and callable(value.numpy):  # tvm.runtime.Tensor, torch.Tensor
        return np.asarray(value.numpy())
    return np.asarray(value)


def _named(values: Mapping[str, Any] | Sequence[Any], names: Sequence[str] | None,
           side: str) -> dict[str, np.ndarray]:
    """Name a sequence by position: after the other side's names if it has them, else output_<i>."""
    if isinstance(values, Mapping):
        return {str(k): _to_numpy(v) for k, v in values.items()}
    values = list(values)
    if names is not None:
        if len(names) != len(values):
            raise UsageError(f"{side} has {len(values)} outputs but the other side names {len(names)}: "
                             f"{', '.join(names)}")
        return {name: _to_numpy(v) for name, v in zip(names, values)}
    return {f"output_{i}": _to_numpy(v) for i, v in enumerate(values)}


def _pair_names(actual: Mapping[str, Any] | Sequence[Any],
                reference: Mapping[str, Any] | Sequence[Any],
                ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    ref_names = list(reference) if isinstance(reference, Mapping) else None
    act_names = list(actual) if isinstance(actual, Mapping) else None
    return _named(actual, ref_names, "actual"), _named(reference, act_names, "reference")


def _smallest_passing(passes: Callable[[float], bool], start: float) -> float | None:
    """Smallest float64 x >= 0 with passes(x), for a monotone predicate, searching from start.

    Searches on the bit pattern (non-negative float64s order like their int64 bits), so the
    answer is exact: the next float down fails.
    """
    hi = max(start, 0.0)
    while not passes(hi):  # the analytic start can be an ulp low after rounding
        hi = hi * 2 if hi > 0 else 5e-324
        if math.isinf(hi):
            return None
    if passes(0.0):
        return 0.0
    lo, hi_bits = 0, int(np.float64(hi).view(np.int64))
    while hi_bits - lo > 1:
        mid = (lo + hi_bits) // 2
        if passes(float(np.int64(mid).view(np.float64))):
            hi_bits = mid
        else:
            lo = mid
    return float(np.int64(hi_bits).view(np.float64))


def _nonfinite_reason(a: np.ndarray, r: np.ndarray, finite_r: np.ndarray, ok: np.ndarray,
                      nan_equal: bool) -> list[str]:
    reasons = []
    bad_actual = finite_r & ~np.isfinite(a)
    if bad_actual.any():
        first = tuple(int(i) for i in np.argwhere(bad_actual)[0])
        counts = [f"{n} {kind}" for kind, n in (("NaN", int(np.isnan(a[bad_actual]).sum())),
                                                 ("Inf", int(np.isinf(a[bad_actual]).sum()))) if n]
        reasons.append(f"{' and '.join(counts)} in actual where reference is finite (first at {first})")
    inf_r = np.isinf(r)
    if (inf_r & ~ok).any():
        reasons.append(f"{int((inf_r & ~ok).sum())} Inf in reference not matched by same-sign Inf in actual")
    nan_r = np.isnan(r)
    if (nan_r & ~ok).any():
        if nan_equal:
            reasons.append(f"{int((nan_r & ~ok).sum())} NaN in reference where actual is not NaN")
        else:
            reasons.append(f"{int(nan_r.sum())} NaN in reference (inputs out of the model's domain?"
                           " set nan_equal=True to accept NaN at the same positions)")
    return reasons


def _error_stats(d: np.ndarray, r_abs: np.ndarray, both: np.ndarray) -> dict[str, Any]:
    """Abs/rel error summaries over the elements finite on both sides (d, r_abs flattened)."""
    with np.errstate(invalid="ignore", over="ignore"):  # inf differences give inf/nan stats, not warnings
        rel = d / np.where(r_abs == 0, REL_EPSILON, r_abs)
        imax = int(np.argmax(d))
        dmax = float(d[imax])
        histogram = None
        if math.isfinite(dmax):
            counts, edges = np.histogram(d, bins=10, range=(0.0, dmax if dmax > 0 else 1.0))
            histogram = (tuple(float(e) for e in edges), tuple(int(c) for c in counts))
        return dict(
            max_abs_error=dmax, mean_abs_error=float(d.mean()), median_abs_error=float(np.median(d)),
            p99_abs_error=float(np.percentile(d, 99)),
            max_abs_index=tuple(int(i) for i in np.unravel_index(np.flatnonzero(both)[imax], both.shape)),
            max_rel_error=float(rel.max()), mean_rel_error=float(rel.mean()),
            median_rel_error=float(np.median(rel)), p99_rel_error=float(np.percentile(rel, 99)),
            abs_error_histogram=histogram,
        )


def _min_tolerances(d: np.ndarray, r_abs: np.ndarray, tolerance: Tolerance) -> dict[str, float | None]:
    """Smallest atol passing with the given rtol and smallest rtol passing with the given atol.

    Each starts from the analytic bound, then is made exact under the float64 rule itself.
    """
    if d.size == 0:
        return {"min_atol": 0.0, "min_rtol": 0.0}
    with np.errstate(invalid="ignore", over="ignore"):
        rtol_term = tolerance.rtol * r_abs
        min_atol = _smallest_passing(lambda x: bool(np.all(d <= x + rtol_term)), float(np.max(d - rtol_term)))
        need = d > tolerance.atol
        if np.any(need & (r_abs == 0)):  # an error at a zero reference: no rtol covers it
            return {"min_atol": min_atol, "min_rtol": None}
        start = float(np.max((d[need] - tolerance.atol) / r_abs[need])) if need.any() else 0.0
        min_rtol = _smallest_passing(lambda x: bool(np.all(d <= tolerance.atol + x * r_abs)), start)
    return {"min_atol": min_atol, "min_rtol": min_rtol}


def compare_output(name: str, actual: np.ndarray, reference: np.ndarray, tolerance: Tolerance,
                   nan_equal: bool = False, check_dtype: bool = True) -> OutputCompareResult:
    """Compare one output pair under one tolerance (see the module docstring for the rules)."""
    actual, reference = _to_numpy(actual), _to_numpy(reference)
    base = dict(name=name, dtype=reference.dtype.name, shape=tuple(int(d) for d in reference.shape),
                tolerance=tolerance, size=int(reference.size))
    if actual.shape != reference.shape:
        return OutputCompareResult(**base, passed=False,
                                   reason=f"shape mismatch: actual {tuple(actual.shape)} vs "
                                          f"reference {tuple(reference.shape)}")
    reasons = []
    if check_dtype and actual.dtype != reference.dtype:
        reasons.append(f"dtype mismatch: actual {actual.dtype.name} vs reference {reference.dtype.name}")
    if reference.size == 0:
        return OutputCompareResult(**base, passed=not reasons, reason="; ".join(reasons))

    exact_ints = tolerance.exact and _is_exact_dtype(actual.dtype) and _is_exact_dtype(reference.dtype)
    wide = np.complex128 if np.iscomplexobj(actual) or np.iscomplexobj(reference) else np.float64
    a, r = actual.astype(wide), reference.astype(wide)
    finite_a, finite_r = np.isfinite(a), np.isfinite(r)
    both = finite_a & finite_r
    with np.errstate(over="ignore"):  # |1e308 - -1e308| is inf: a failure, not a crash
        d = np.abs(a[both] - r[both])
    r_abs = np.abs(r[both])

    ok = np.zeros(reference.shape, dtype=bool)
    if exact_ints:  # native compare: int64 values above 2**53 differ even when their float64s tie
        ok[...] = actual == reference
    else:
        ok[both] = d <= tolerance.atol + tolerance.rtol * r_abs
        inf_r = np.isinf(r)
        ok[inf_r] = a[inf_r] == r[inf_r]
        nan_r = np.isnan(r)
        ok[nan_r] = nan_equal & np.isnan(a[nan_r])
    nonfinite_mismatches = int((~both & ~ok).sum())
    mismatches = int((~ok).sum())
    if nonfinite_mismatches:
        reasons.extend(_nonfinite_reason(a, r, finite_r, ok, nan_equal))

    stats = _error_stats(d, r_abs, both) if d.size else {}
    if nonfinite_mismatches == 0:
        stats.update(_min_tolerances(d, r_abs, tolerance))
        if exact_ints and mismatches and not np.any(d > 0):  # only int64s above 2**53 differ
            stats.update(min_atol=None, min_rtol=None)

    finite_bad = int((both & ~ok).sum())
    if finite_bad:
        would = " or ".join(f"{label}>={_fmt(stats.get(key))}" for label, key in
                            (("atol", "min_atol"), ("rtol", "min_rtol")) if stats.get(key) is not None)
        reasons.append(
            f"{finite_bad} of {reference.size} elements ({finite_bad / reference.size:.2%}) out of tolerance "
            f"{tolerance}; max abs err {_fmt(stats.get('max_abs_error'))} at {stats.get('max_abs_index')}"
            + (f"; would pass with {would}" if would else ""))
    bad = np.argwhere(~ok)
    return OutputCompareResult(
        **base, passed=not reasons, reason="; ".join(reasons),
        mismatches=mismatches, mismatch_fraction=mismatches / reference.size,
        nonfinite_mismatches=nonfinite_mismatches,
        nan_actual=int(np.isnan(a).sum()), inf_actual=int(np.isinf(a).sum()),
        nan_reference=int(np.isnan(r).sum()), inf_reference=int(np.isinf(r).sum()),
        first_mismatch_index=tuple(int(i) for i in bad[0]) if len(bad) else None,
        **stats,
    )


def uninformative_outputs(reference: Mapping[str, Any], tolerances: Tolerances = None,
                          per_output: Mapping[str, Tolerance] | None = None,
                          runs: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, str]:
    """Reference outputs whose comparison cannot catch a wrong result, name -> why: one value everywhere (a
    zero-initialised layer of a random-weight model: torchvision's ViT head, HF MobileViT's last stage), or
    floats that never exceed their absolute tolerance (an all-zero result would pass too; EfficientNetV2-S
    with random weights peaks at 3e-6 against float32's atol 1e-4). ``runs`` (label -> outputs) adds each
    run's largest error relative to the output's peak, which is what still tells there."""
    found: dict[str, str] = {}
    for name, value in reference.items():
        r = _to_numpy(value)
        if r.size == 0 or r.dtype.kind not in "biuf":
            continue
        finite = r[np.isfinite(r)] if r.dtype.kind == "f" else r
        if finite.size == 0:
            continue
        if r.size > 1 and finite.size == r.size and finite.min() == finite.max():
            found[name] = (f"output {name!r} is {finite.flat[0]:g} at all {r.size} values in the reference run: equal "
                           f"results cannot show a wrong one (a zero-initialised layer in a random-weight model?); "
                           f"`fuseguard bisect` compares every intermediate then")
            continue
        if r.dtype.kind != "f":
            continue
        tol = resolve_tolerance(name, r.dtype, tolerances, per_output)
        peak = float(np.abs(finite).max())
        if peak > tol.atol:
            continue
        rel = ""
        if runs:
            parts = [f"{label} {float(np.abs(_to_numpy(out[name]).astype(np.float64) - r).max()) / peak:.1e}"
                     for label, out in runs.items() if name in out and peak > 0]
            rel = f"; largest error relative to that peak: {', '.join(parts)}" if parts else ""
        found[name] = (f"output {name!r} peaks at {peak:.3g}, under its atol {tol.atol:g}: an all-zero result would "
                       f"pass too (--output-tol {name}=ATOL sets a tighter one; `fuseguard bisect` compares every "
                       f"intermediate){rel}")
    return found


def compare_outputs(actual: Mapping[str, Any] | Sequence[Any], reference: Mapping[str, Any] | Sequence[Any],
                    tolerances: Tolerances = None, per_output: Mapping[str, Tolerance] | None = None,
                    nan_equal: bool = False, check_dtype: bool = True) -> CompareResult:
    """Compare every output of a run with the reference run; outputs are matched by name.

    A sequence on one side takes the other side's names in order (both sequences: output_<i>).
    An output present on only one side fails. ``per_output`` keys that name no output raise
    `UsageError`, since a misspelt override would otherwise silently not apply.
    """
    act, ref = _pair_names(actual, reference)
    if per_output:
        unknown = sorted(set(per_output) - set(ref) - set(act))
        if unknown:
            raise UsageError(f"per-output tolerance for unknown output(s) {', '.join(map(repr, unknown))}; "
                             f"outputs are: {', '.join(ref) or '(none)'}")
    results: dict[str, OutputCompareResult] = {}
    for name in [*ref, *(n for n in act if n not in ref)]:
        present = ref[name] if name in ref else act[name]
        tol = resolve_tolerance(name, present.dtype, tolerances, per_output)
        if name not in act or name not in ref:
            results[name] = OutputCompareResult(
                name=name, dtype=present.dtype.name, shape=tuple(int(d) for d in present.shape),
                size=int(present.size), tolerance=tol, passed=False,
                reason="missing from actual outputs" if name not in act else "not in reference outputs")
            continue
        results[name] = compare_output(name, act[name], ref[name], tol, nan_equal=nan_equal,
                                       check_dtype=check_dtype)
    return CompareResult(results)


def rmse_of(x: np.ndarray, y: np.ndarray) -> float:
    diff = x.astype(np.float64) - y.astype(np.float64)
    return float(np.sqrt(np.mean(diff * diff))) if diff.size else 0.0


def compare_with_fp64_tiebreak(actual: Mapping[str, Any] | Sequence[Any],
                               reference: Mapping[str, Any] | Sequence[Any],
                               fp64_reference: Mapping[str, Any] | Sequence[Any], mult: float = 2.0,
                               tolerances: Tolerances = None,
                               per_output: Mapping[str, Tolerance] | None = None,
                               nan_equal: bool = False) -> CompareResult:
    """`compare_outputs`, then rescue tolerance-only failures that are no worse than the reference.

    PyTorch dynamo's `same()` rule: against an fp64 run of the same model, an output passes when
    ``RMSE(actual, fp64) <= mult * RMSE(reference, fp64) + atol / 10`` — a fused result may be as
    wrong as the unfused one, not more. Shape, dtype, NaN/Inf and integer failures are never rescued.
    """
    result = compare_outputs(actual, reference, tolerances, per_output, nan_equal=nan_equal)
    act, ref = _pair_names(actual, reference)
    gold = _named(fp64_reference, list(result), "fp64_reference")
    rescued: dict[str, OutputCompareResult] = {}
    for name, r in result.items():
        eligible = (not r and r.nonfinite_mismatches == 0 and r.max_abs_error is not None
                    and name in act and name in ref and act[name].dtype == ref[name].dtype
                    and not _is_exact_dtype(ref[name].dtype))
        if not eligible:
            rescued[name] = r
            continue
        if name not in gold or gold[name].shape != ref[name].shape:
            raise UsageError(f"fp64 reference for output {name!r} is missing or has shape "
                             f"{None if name not in gold else tuple(gold[name].shape)}, "
                             f"expected {tuple(ref[name].shape)}")
        res_err, ref_err = rmse_of(act[name], gold[name]), rmse_of(ref[name], gold[name])
        bound = mult * ref_err + r.tolerance.atol / 10
        verdict = f"rmse(actual, fp64)={res_err:.3g} vs {mult:g} * rmse(reference, fp64)={ref_err:.3g} + atol/10"
        if res_err <= bound:
            rescued[name] = dataclasses.replace(r, passed=True, reason="", note=f"passed by fp64 tie-break: {verdict}")
        else:
            rescued[name] = dataclasses.replace(r, reason=f"{r.reason}; fp64 tie-break failed: {verdict}")
    return CompareResult(rescued)


#: Boundary-flip rule (int8 QDQ models): at most this fraction of an output's elements may lie beyond its
#: tolerance. A value that sits on a rounding boundary of an inner QuantizeLinear lands one step apart in two
#: correct engines, and the next MatMul spreads that step over a row of outputs (|w| * s_w * s_x each): sparse.
#: Measured (ORT's quantize_static, 20 input draws each, int8 kernels on): gpt2_tiny and bert_encoder reach 3
#: steps on at most 0.06% of elements; a wrong zero-point correction put 74% of elements beyond.
FLIP_FRACTION = 0.01
#: ... and the largest error may be this many tolerances when ONNX Runtime's own int8 kernels (the engine
#: users would ship otherwise) are closer to the reference than that; else as far as they are.
FLIP_TOLERANCES = 2.0


def rescue_boundary_flips(result: CompareResult, yardstick: Mapping[str, float]) -> CompareResult:
    """Tolerance-only failures of a QDQ model's dequantized outputs pass when they are sparse
    (FLIP_FRACTION) and no larger than max(FLIP_TOLERANCES tolerances, `yardstick[name]`: ONNX Runtime's own
    int8 kernels' largest error against the same reference), with a note saying so. Shape, dtype and NaN/Inf
    failures are never rescued; nor is a dense error, however small."""
    rescued: dict[str, OutputCompareResult] = {}
    for name, r in result.items():
        if r or r.nonfinite_mismatches or r.max_abs_error is None or not r.size or name not in yardstick \
                or any(w in r.reason for w in ("shape mismatch", "dtype mismatch", "missing from")):
            rescued[name] = r
            continue
        bound = max(FLIP_TOLERANCES * r.tolerance.atol, yardstick[name])
        verdict = (f"{r.mismatches} of {r.size} elements beyond the tolerance ({r.mismatch_fraction:.3%}), largest "
                   f"{r.max_abs_error:.3g} vs a bound of {bound:.3g} (ONNX Runtime's int8 kernels: {yardstick[name]:.3g})")
        if r.mismatch_fraction <= FLIP_FRACTION and r.max_abs_error <= bound:
            rescued[name] = dataclasses.replace(r, passed=True, reason="", note=f"passed as rounding-boundary flips: {verdict}")
        else:
            rescued[name] = dataclasses.replace(r, reason=f"{r.reason}; not rounding-boundary flips: {verdict}")
    return CompareResult(rescued)
