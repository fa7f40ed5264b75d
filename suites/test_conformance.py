"""ONNX semantics: the backend node-test suite through fuseguard (verify/check/conformance.py).

The default run keeps one case per operator; `pytest suites/test_conformance.py --conformance-full` runs
all 1884 (nightly). Fusion must never break a case the unfused build gets right, no case may crash the
harness, and a case wrong where ONNX Runtime is right must be a known TVM-lowering defect listed below
(each one a bug to fix, not a tolerance).
"""

from __future__ import annotations

import pytest

from fuseguard.verify.check.conformance import case_names, run_in_worker

#: Wrong where ONNX Runtime is right, with the reason (measured with `fuseguard conformance`). Empty since
#: compiler/frontend/converters/semantics.py: the eleven once listed here are in FIXED below.
KNOWN_WRONG: dict[str, str] = {}

#: Cases once wrong, refused or failing, each standing for a fix (run by default, all fused and unfused:
#: they must come out right, frozen or not): the eleven once wrong where ORT was right, 8-bit floats
#: (compiler/frontend/converters/narrow_floats.py), zero-size inputs, inputs frozen whole (a window's size, ConstantOfShape's shape).
FIXED = (
    "test_batchnorm_epsilon_training_mode", "test_batchnorm_example_training_mode",
    "test_bitshift_left_int32_negative_shift", "test_bitshift_left_int32_shift_ge_width",
    "test_convtranspose_output_shape", "test_expand_dim_changed", "test_mod_float_edge_cases_fmod_0_float16",
    "test_mod_float_edge_cases_fmod_0_float32", "test_mod_float_edge_cases_fmod_0_float64",
    "test_spacetodepth_crd_mode_example", "test_training_dropout_zero_ratio_mask",
    "test_cast_FLOAT_to_FLOAT8E4M3FN", "test_cast_no_saturate_FLOAT16_to_FLOAT8E5M2",
    "test_cast_FLOAT8E4M3FNUZ_to_FLOAT", "test_castlike_FLOAT_to_FLOAT8E5M2FNUZ_expanded",
    "test_cast_e8m0_FLOAT_to_FLOAT8E8M0", "test_dequantizelinear_e4m3fn_float16", "test_quantizelinear_e5m2",
    "test_reduce_sum_empty_set", "test_tril_zero", "test_hannwindow_symmetric", "test_constantofshape_int_zeros",
    "test_pow_types_float32_int64", "test_onehot_with_axis", "test_reduce_max_bool_inputs",
)


def _check(report) -> None:
    crashed = [r.name for r in report.results if r.fused.reason.startswith("crash")]
    assert not crashed, f"the harness crashed on: {crashed}"
    fusion_only = [r.name for r in report.results if r.fusion_only_failure]
    assert not fusion_only, f"fusion broke cases the unfused build gets right: {fusion_only}"
    unexpected = {r.name: r.fused.reason for r in report.results
                  if r.wrong_where_ort_right and r.name not in KNOWN_WRONG}
    assert not unexpected, f"wrong where ONNX Runtime is right: {unexpected}"


def test_one_case_per_operator(fuseguard_worker, compile_options) -> None:
    names = case_names(sample=True)
    assert len(names) > 150
    report = run_in_worker(names, options=compile_options, worker=fuseguard_worker)
    print(report.summary())
    _check(report)


def test_cases_once_wrong_are_right(fuseguard_worker, compile_options) -> None:
    report = run_in_worker(list(FIXED), options=compile_options, worker=fuseguard_worker)
    _check(report)
    not_right = {r.name: (r.fused.status, r.unfused.status, r.fused.reason[:120]) for r in report.results
                 if r.fused.status != "right" or r.unfused.status != "right"}
    assert not not_right, not_right


@pytest.mark.conformance_full
def test_all_cases(fuseguard_worker, compile_options) -> None:
    report = run_in_worker(case_names(), options=compile_options, worker=fuseguard_worker)
    print(report.summary())
    _check(report)
