"""verify.check.compare: tolerance rule, NaN/Inf rules, minimum passing tolerances, reports."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from rich.console import Console

from fuseguard.compiler.errors import UsageError
from fuseguard.verify.check.compare import (DEFAULT_TOLERANCES, EXACT, REL_EPSILON, CompareResult,
                                            OutputCompareResult, Tolerance, compare_outputs,
                                            compare_with_fp64_tiebreak, render_table, resolve_tolerance)

F32 = DEFAULT_TOLERANCES["float32"]


def _one(actual: np.ndarray, reference: np.ndarray, tol: Tolerance = F32, **kw: object) -> OutputCompareResult:
    return compare_outputs({"y": actual}, {"y": reference}, per_output={"y": tol}, **kw)["y"]


def _ref() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)


# --- the tolerance rule ---------------------------------------------------------------------------

def test_within_tolerance_passes_and_is_truthy() -> None:
    ref = _ref()
    result = compare_outputs({"y": ref + np.float32(5e-5)}, {"y": ref})
    assert result and result["y"] and result.passed and result.failed == []
    assert result["y"].reason == "" and result["y"].mismatches == 0
    assert result["y"].tolerance == F32


def test_bound_is_atol_plus_rtol_times_reference() -> None:
    ref = np.array([0.0, 100.0])
    # error 1.5 at |ref|=100 passes only through the rtol term; the same error at ref=0 needs atol
    assert _one(np.array([0.0, 101.5]), ref, Tolerance(1.0, 0.01))
    failed = _one(np.array([1.5, 100.0]), ref, Tolerance(1.0, 0.01))
    assert not failed and failed.mismatches == 1 and failed.max_abs_index == (0,)
    assert "1 of 2 elements" in failed.reason and "out of tolerance" in failed.reason


def test_failure_reports_stats_and_location() -> None:
    ref = _ref()
    actual = ref.copy()
    actual[3, 7] += 0.5
    actual[5, 1] -= 0.01
    r = _one(actual, ref)
    assert not r and not bool(r)
    assert r.mismatches == 2 and r.mismatch_fraction == pytest.approx(2 / ref.size)
    assert r.max_abs_index == (3, 7) and r.first_mismatch_index == (3, 7)
    assert r.max_abs_error == pytest.approx(0.5, rel=1e-6)
    assert r.median_abs_error == 0.0 and r.p99_abs_error is not None
    assert r.max_rel_error == pytest.approx(0.5 / abs(float(ref[3, 7])), rel=1e-5)
    assert "(3, 7)" in r.reason and "would pass with atol>=" in r.reason
    edges, counts = r.abs_error_histogram
    assert len(edges) == 11 and len(counts) == 10 and sum(counts) == ref.size
    assert edges[0] == 0.0 and edges[-1] == pytest.approx(0.5, rel=1e-6)


def test_relative_error_uses_epsilon_where_reference_is_zero() -> None:
    r = _one(np.array([1e-3]), np.array([0.0]))
    assert r.max_rel_error == pytest.approx(1e-3 / REL_EPSILON)
    assert r.min_rtol is None  # no rtol can cover an error at a zero reference ...
    assert r.min_atol == pytest.approx(1e-3)  # ... but atol can


# --- minimum tolerances ---------------------------------------------------------------------------

def test_min_atol_and_min_rtol_are_tight() -> None:
    ref = _ref()
    actual = ref + np.random.default_rng(1).standard_normal(ref.shape).astype(np.float32) * np.float32(1e-3)
    r = _one(actual, ref)
    assert not r and r.min_atol is not None and r.min_rtol is not None
    assert _one(actual, ref, Tolerance(r.min_atol, F32.rtol))
    assert not _one(actual, ref, Tolerance(float(np.nextafter(r.min_atol, 0)), F32.rtol))
    assert _one(actual, ref, Tolerance(F32.atol, r.min_rtol))
    assert not _one(actual, ref, Tolerance(F32.atol, float(np.nextafter(r.min_rtol, 0))))


def test_min_tolerances_are_zero_for_identical_outputs() -> None:
    ref = _ref()
    r = _one(ref.copy(), ref)
    assert r and r.min_atol == 0.0 and r.min_rtol == 0.0 and r.max_abs_error == 0.0


_finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(ref=hnp.arrays(np.float32, st.integers(1, 24), elements=_finite),
       noise=hnp.arrays(np.float32, 24, elements=st.floats(-1, 1, width=32)),
       rtol=st.sampled_from([0.0, 1e-6, 1e-3, 0.1]), atol=st.sampled_from([0.0, 1e-7, 1e-2]))
def test_min_tolerances_are_exact_property(ref: np.ndarray, noise: np.ndarray, rtol: float, atol: float) -> None:
    actual = ref + noise[: ref.size]
    r = _one(actual, ref, Tolerance(atol, rtol))
    assert r.min_atol is not None
    assert _one(actual, ref, Tolerance(r.min_atol, rtol))
    if r.min_atol > 0:
        assert not _one(actual, ref, Tolerance(float(np.nextafter(r.min_atol, 0)), rtol))
    assert bool(r) == (r.min_atol <= atol)
    if r.min_rtol is not None:
        assert _one(actual, ref, Tolerance(atol, r.min_rtol))
        if r.min_rtol > 0:
            assert not _one(actual, ref, Tolerance(atol, float(np.nextafter(r.min_rtol, 0))))


# --- NaN and Inf ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_actual_where_reference_finite_never_passes(bad: float) -> None:
    ref = _ref()
    actual = ref.copy()
    actual[2, 3] = bad
    r = _one(actual, ref, Tolerance(math.inf, 0.5))
    assert not r
    assert r.nonfinite_mismatches == 1 and r.mismatches == 1 and r.first_mismatch_index == (2, 3)
    assert "where reference is finite (first at (2, 3))" in r.reason
    assert r.min_atol is None and r.min_rtol is None
    assert (r.nan_actual, r.inf_actual) == ((1, 0) if np.isnan(bad) else (0, 1))


def test_inf_must_match_sign_and_position() -> None:
    ref = np.array([1.0, np.inf, -np.inf], dtype=np.float32)
    assert _one(ref.copy(), ref)
    r = _one(np.array([1.0, -np.inf, -np.inf], dtype=np.float32), ref)
    assert not r and r.inf_reference == 2 and "Inf in reference not matched" in r.reason
    assert not _one(np.array([1.0, 3e38, -np.inf], dtype=np.float32), ref, Tolerance(math.inf, 0.0))


def test_reference_nan_fails_unless_nan_equal() -> None:
    ref = np.array([1.0, np.nan], dtype=np.float32)
    r = _one(ref.copy(), ref)
    assert not r and r.nan_reference == 1 and "nan_equal=True" in r.reason
    assert _one(ref.copy(), ref, nan_equal=True)
    # nan_equal accepts a NaN only against a NaN
    assert not _one(np.array([1.0, 0.0], dtype=np.float32), ref, Tolerance(math.inf, 0.0), nan_equal=True)


# --- shapes, dtypes, integers, empties ------------------------------------------------------------

def test_shape_mismatch_fails_without_broadcasting() -> None:
    r = _one(np.zeros((1, 3), np.float32), np.zeros(3, np.float32), Tolerance(math.inf, 0.0))
    assert not r and r.reason == "shape mismatch: actual (1, 3) vs reference (3,)"
    assert r.max_abs_error is None and r.min_atol is None


def test_dtype_mismatch_fails_unless_unchecked() -> None:
    ref = _ref()
    r = compare_outputs({"y": ref.astype(np.float64)}, {"y": ref})["y"]
    assert not r and "dtype mismatch: actual float64 vs reference float32" in r.reason
    assert r.max_abs_error == 0.0  # stats are still computed to help the reader
    assert compare_outputs({"y": ref.astype(np.float64)}, {"y": ref}, check_dtype=False)


def test_integers_compare_exactly_even_above_2_pow_53() -> None:
    big = np.array([2**53, 7], dtype=np.int64)
    assert not compare_outputs({"i": big + np.array([1, 0])}, {"i": big})
    assert compare_outputs({"i": big.copy()}, {"i": big})
    # a global float tolerance does not make an index "approximately right" ...
    off_by_one = {"i": np.array([3, 4])}
    assert not compare_outputs(off_by_one, {"i": np.array([3, 5])}, tolerances=Tolerance(10.0, 0.0))
    # ... but naming the output does
    assert compare_outputs(off_by_one, {"i": np.array([3, 5])}, per_output={"i": Tolerance(1.0, 0.0)})
    assert not compare_outputs({"b": np.array([True, False])}, {"b": np.array([True, True])})


def test_empty_tensors_compare_by_shape() -> None:
    assert compare_outputs({"e": np.zeros((0, 3), np.float32)}, {"e": np.ones((0, 3), np.float32)})
    r = compare_outputs({"e": np.zeros((3, 0), np.float32)}, {"e": np.zeros((0, 3), np.float32)})["e"]
    assert not r and "shape mismatch" in r.reason


def test_missing_and_extra_outputs_fail() -> None:
    x = np.ones(2, np.float32)
    result = compare_outputs({"a": x, "extra": x}, {"a": x, "b": x})
    assert not result and result.failed == ["b", "extra"]
    assert result["b"].reason == "missing from actual outputs"
    assert result["extra"].reason == "not in reference outputs"


# --- tolerance selection --------------------------------------------------------------------------

def test_per_output_override_and_dtype_table() -> None:
    ref = {"loose": _ref(), "strict": _ref()}
    actual = {k: v + np.float32(1e-3) for k, v in ref.items()}
    result = compare_outputs(actual, ref, per_output={"loose": Tolerance(2e-3, 0.0)})
    assert result["loose"] and not result["strict"] and result.failed == ["strict"]
    assert compare_outputs(actual, ref, tolerances={"float32": Tolerance(2e-3, 0.0)})
    assert compare_outputs(actual, ref, tolerances=Tolerance(2e-3, 0.0))
    with pytest.raises(UsageError, match="'lose'"):
        compare_outputs(actual, ref, per_output={"lose": Tolerance(1.0, 0.0)})


def test_default_table_covers_float_and_integer_dtypes() -> None:
    assert resolve_tolerance("x", np.dtype(ml_dtypes.bfloat16)) == DEFAULT_TOLERANCES["bfloat16"]
    assert resolve_tolerance("x", np.dtype(np.float16)) == DEFAULT_TOLERANCES["float16"]
    assert resolve_tolerance("x", np.dtype(np.uint8)) == EXACT
    assert F32.atol >= 1e-4 and F32.rtol >= 1e-4  # deep fp32 models reorder long accumulations
    with pytest.raises(UsageError, match="complex64"):
        resolve_tolerance("x", np.dtype(np.complex64))


def test_bfloat16_outputs_use_their_own_tolerance() -> None:
    ref = np.array([1.0, 2.0, 4.0], dtype=ml_dtypes.bfloat16)
    one_ulp = np.array([1.0078125, 2.0, 4.0], dtype=ml_dtypes.bfloat16)
    assert compare_outputs({"y": one_ulp}, {"y": ref})
    assert not compare_outputs({"y": one_ulp.astype(np.float32)}, {"y": ref.astype(np.float32)})


@pytest.mark.parametrize("atol, rtol", [(-1.0, 0.0), (0.0, math.inf), (math.nan, 0.0)])
def test_invalid_tolerance_is_rejected(atol: float, rtol: float) -> None:
    with pytest.raises(UsageError):
        Tolerance(atol, rtol)


# --- results as values ----------------------------------------------------------------------------

def test_sequences_are_named_by_position() -> None:
    x, y = _ref(), _ref() + 1
    assert list(compare_outputs([x, y], [x, y])) == ["output_0", "output_1"]
    mixed = compare_outputs([x, y], {"first": x, "second": y})
    assert list(mixed) == ["first", "second"] and mixed
    with pytest.raises(UsageError, match="1 outputs"):
        compare_outputs([x], {"first": x, "second": y})
    with pytest.raises(UsageError, match="nothing to compare"):
        compare_outputs({}, {})


def test_worst_summary_and_json() -> None:
    ref = {"a": _ref(), "b": _ref(), "n": _ref()}
    actual = {"a": ref["a"] + np.float32(1.0), "b": ref["b"] + np.float32(5.0), "n": ref["n"].copy()}
    actual["n"][0, 0] = np.nan
    result = compare_outputs(actual, ref)
    assert isinstance(result, CompareResult) and not result
    assert result.worst.name == "n"  # a NaN failure outranks any finite error
    assert result.summary().startswith("FAIL: 3/3 outputs failed (worst 'n':")
    passing = compare_outputs({"a": ref["a"], "b": ref["b"] + np.float32(1e-5)}, {"a": ref["a"], "b": ref["b"]})
    assert passing.worst.name == "b" and passing.summary().startswith("PASS: 2/2")

    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert data["passed"] is False and data["outputs"]["n"]["min_atol"] is None
    assert data["outputs"]["a"]["tolerance"] == {"atol": F32.atol, "rtol": F32.rtol}
    assert len(data["outputs"]["a"]["abs_error_histogram"]["counts"]) == 10

    def plain(value: object) -> bool:
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        if isinstance(value, list):
            return all(plain(v) for v in value)
        return value is None or type(value) in (bool, int, float, str)

    assert plain(result.to_dict())


def test_overflowing_difference_stays_json_serialisable() -> None:
    r = _one(np.array([1e308]), np.array([-1e308]))
    assert r.max_abs_error == math.inf and not r
    json.dumps(r.to_dict(), allow_nan=False)


def test_rich_table_shows_minimum_tolerances() -> None:
    ref = _ref()
    result = compare_outputs({"y[0]": ref + np.float32(1e-3)}, {"y[0]": ref})
    console = Console(record=True, width=250)
    console.print(render_table(result))
    console.print(result)  # __rich__
    text = console.export_text()
    assert "min atol @rtol" in text and "y[0]" in text and "FAIL" in text
    assert f"{result['y[0]'].min_atol:.3g}" in text


# --- fp64 tie-break -------------------------------------------------------------------------------

def test_fp64_tiebreak_accepts_no_worse_than_reference() -> None:
    rng = np.random.default_rng(3)
    gold = rng.standard_normal(1000)
    reference = (gold + rng.standard_normal(1000) * 1e-3).astype(np.float32)
    as_wrong = (gold + rng.standard_normal(1000) * 1.2e-3).astype(np.float32)
    far_worse = (gold + rng.standard_normal(1000) * 1e-2).astype(np.float32)
    assert not compare_outputs({"y": as_wrong}, {"y": reference})
    rescued = compare_with_fp64_tiebreak({"y": as_wrong}, {"y": reference}, {"y": gold})
    assert rescued and rescued["y"].note.startswith("passed by fp64 tie-break")
    still = compare_with_fp64_tiebreak({"y": far_worse}, {"y": reference}, {"y": gold})
    assert not still and "fp64 tie-break failed" in still["y"].reason


def test_fp64_tiebreak_never_rescues_nan_or_integers() -> None:
    gold = np.linspace(-1, 1, 16)
    reference = gold.astype(np.float32)
    actual = reference.copy()
    actual[4] = np.nan
    assert not compare_with_fp64_tiebreak({"y": actual}, {"y": reference}, {"y": gold}, mult=1e9)
    ints = np.arange(16)
    assert not compare_with_fp64_tiebreak({"i": ints + 1}, {"i": ints}, {"i": ints + 0.5}, mult=1e9)


# --- outputs a comparison cannot fail on ------------------------------------------------------------

def test_constant_and_below_tolerance_outputs_are_named_with_the_relative_error_that_still_tells() -> None:
    from fuseguard.verify.check.compare import uninformative_outputs

    rng = np.random.default_rng(0)
    tiny = (rng.standard_normal((4, 8)) * 1e-6).astype(np.float32)
    reference = {"zeros": np.zeros((1, 1000), np.float32), "tiny": tiny, "fine": _ref(),
                 "scalar": np.zeros((), np.float32), "argmax": np.full((4,), 3, np.int64)}
    weak = uninformative_outputs(reference, runs={"fused": {"tiny": tiny * 1.5}})
    assert set(weak) == {"zeros", "tiny", "argmax", "scalar"}    # one value, or never over atol 1e-4
    assert "peaks at 0," in weak["scalar"]                          # a single value is not "one value everywhere"
    assert "is 0 at all 1000 values" in weak["zeros"] and "bisect" in weak["zeros"]
    assert "under its atol 0.0001" in weak["tiny"] and "fused 5.0e-01" in weak["tiny"]
    # a tighter tolerance for that output makes its comparison count again
    assert "tiny" not in uninformative_outputs(reference, per_output={"tiny": Tolerance(1e-9, 1e-3)})


def test_verify_warns_when_a_model_output_is_zero_whatever_the_input(tmp_path) -> None:
    """A random-weight export whose last layer is zero-initialised (torchvision's ViT head) passes any build:
    verify says so in its warnings (the verdict stands)."""
    from onnx import TensorProto, helper, numpy_helper

    from fuseguard.verify.check.model import verify_model

    w = numpy_helper.from_array(np.zeros((16, 10), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "zero_head",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 10])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    verdict = verify_model(model, name="zero_head")
    assert verdict.passed
    assert any("zero_head: output 'y' is 0 at all 20 values" in w for w in verdict.warnings)
    w2 = numpy_helper.from_array(np.random.default_rng(1).standard_normal((16, 10)).astype(np.float32), "w")
    model.graph.initializer[0].CopyFrom(w2)
    assert not any("output 'y'" in w for w in verify_model(model, name="informative").warnings)
