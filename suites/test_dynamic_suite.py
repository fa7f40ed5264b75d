"""Symbolic shapes: each transformer-style suite model compiled once fused and once unfused with its
sequence (and batch) dims symbolic, then checked at many hypothesis-drawn sizes against ONNX Runtime.

    pytest suites/test_dynamic_suite.py                      # the models below, 50 sizes each
    pytest suites/test_dynamic_suite.py --draws 200 --dynamic "seq<=64"

A failure names the smallest failing size and the `fuseguard verify ... --dynamic` line that reproduces it.
"""

from __future__ import annotations

import pytest

from fuseguard.verify.check.model import SuiteSpec
from fuseguard.verify.pytest_plugin import skip_without_cuda_run

#: model -> its dims to keep symbolic. Draws per model: the issue's bar (>= 50 sizes in CI).
DYNAMIC = {
    "bert_encoder": "batch,seq",
    "attention_masked": "seq",
    "mlp_gelu": "batch,seq",
    "softmax_layernorm": "seq",
    # real torch.onnx.export output with dynamic_axes (suites/zoo/*_dyn.onnx)
    "bert_tiny_dyn": "batch,seq",
    "gpt2_tiny_dyn": "batch,seq",
    "llama_tiny_dyn": "batch,seq",
}
DRAWS = 50


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_many_sizes_one_build(name: str, verify_dynamic) -> None:
    verdict = verify_dynamic(SuiteSpec(name), DYNAMIC[name], draws=DRAWS)
    skip_without_cuda_run(verdict)
    for build in (verdict.fused, verdict.unfused):
        assert build.error is None, f"{verdict.model} ({build.config}): {build.error}"
    assert verdict.failing is None, (
        f"{verdict.model}: fails at {verdict.failing.sizes}: {verdict.failing.error or ''} "
        f"fused {verdict.failing.fused.summary() if verdict.failing.fused is not None else '-'}; "
        f"unfused {verdict.failing.unfused.summary() if verdict.failing.unfused is not None else '-'}; "
        f"reproduce: fuseguard verify {name} {verdict.reproduce}")
    # one symbolic build pair served every size (cached builds count 0), and the draws were distinct enough
    # to reach the tile edges: at least half the draws distinct sizes
    assert verdict.builds <= 2
    assert verdict.sizes_checked >= min(DRAWS, verdict.draws) // 2, verdict.sizes_checked
    assert verdict.fused.report.dynamic, "the fused build is not symbolic"
