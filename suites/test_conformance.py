"""ONNX semantics: the backend node-test suite through fuseguard (verify/conformance.py).

The default run keeps one case per operator; `pytest suites/test_conformance.py --conformance-full` runs
all 1884 (nightly). Fusion must never break a case the unfused build gets right, no case may crash the
harness, and a case wrong where ONNX Runtime is right must be a known TVM-lowering defect listed below
(each one a bug to fix, not a tolerance).
"""

from __future__ import annotations

import pytest

from fuseguard.verify.conformance import case_names, run_in_worker

#: Wrong where ONNX Runtime is right, with the reason (measured with `fuseguard conformance`).
KNOWN_WRONG = {
    "test_batchnorm_epsilon_training_mode": "BatchNormalization ignores training_mode",
    "test_batchnorm_example_training_mode": "BatchNormalization ignores training_mode",
    "test_bitshift_left_int32_negative_shift": "BitShift edge cases (TVM lowering)",
    "test_bitshift_left_int32_shift_ge_width": "BitShift edge cases (TVM lowering)",
    "test_convtranspose_output_shape": "ConvTranspose ignores output_shape",
    "test_expand_dim_changed": "Expand with a run-time shape input keeps the target's 1s (TVM's converter)",
    "test_mod_float_edge_cases_fmod_0_float16": "float Mod edge cases (TVM lowering)",
    "test_mod_float_edge_cases_fmod_0_float32": "float Mod edge cases (TVM lowering)",
    "test_mod_float_edge_cases_fmod_0_float64": "float Mod edge cases (TVM lowering)",
    "test_spacetodepth_crd_mode_example": "SpaceToDepth CRD mode",
    "test_training_dropout_zero_ratio_mask": "training-mode Dropout's mask is float32, not bool",
}


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


@pytest.mark.conformance_full
def test_all_cases(fuseguard_worker, compile_options) -> None:
    report = run_in_worker(case_names(), options=compile_options, worker=fuseguard_worker)
    print(report.summary())
    _check(report)
