"""The built-in suite: every model verified fused vs unfused vs ONNX Runtime, shapes drawn by hypothesis.

Run `pytest suites/` on CPU; `pytest suites/ --gpu-arch=sm_80` compiles every model for sm_80 and runs it
where a CUDA device is present. Each example prints its dims and seed, so a failure reproduces with
`fuseguard verify` or `SuiteSpec(name, dims, seed)`.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuseguard.suites.models import SuiteModel, suite_models
from fuseguard.suites.strategies import dims_for
from fuseguard.verify.check.model import SuiteSpec
from fuseguard.verify.pytest_plugin import model_marks, skip_without_cuda_run

#: Examples per model beyond the default shape: unscheduled TVM code is slow, so the heavy models
#: verify their default shape only, and the small ones a few drawn shapes each.
EXAMPLES = {"mlp_gelu": 2, "conv_bn_relu": 3, "softmax_layernorm": 3, "bert_encoder": 1, "attention": 2}


def _params() -> list:
    return [pytest.param(m, id=m.name, marks=model_marks(m)) for m in suite_models()]


def _check(verdict) -> None:
    skip_without_cuda_run(verdict)
    for build in (verdict.fused, verdict.unfused):
        assert build.error is None, f"{verdict.model} ({build.config}): {build.error}"
        assert build.compare is not None and build.compare, (
            f"{verdict.model} [seed {verdict.seed}, shapes {verdict.input_shapes}] {build.config} vs ORT: "
            f"{build.compare.summary() if build.compare is not None else 'not run'}")


@pytest.mark.parametrize("model", _params())
def test_default_shape(model: SuiteModel, verify_model) -> None:
    """Every suite model, at its default shape, matches ONNX Runtime fused and unfused."""
    verdict = verify_model(SuiteSpec(model.name, tuple(sorted(model.default_dims.items())), seed=0))
    _check(verdict)
    if verdict.fused.report.fusion:
        assert verdict.fused.kernels <= verdict.unfused.kernels


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_drawn_shapes(name: str, verify_model, request: pytest.FixtureRequest) -> None:
    """Shapes drawn over the model's free dims (batch, sequence, spatial size) all verify."""
    from fuseguard.suites.models import get_model

    model = get_model(name)
    examples = request.config.getoption("--fuseguard-examples") or EXAMPLES[name]

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(dims=dims_for(model), seed=st.integers(0, 2**16))
    def check(dims: dict, seed: int) -> None:
        print(f"{name}: dims={dims} seed={seed}")
        _check(verify_model(SuiteSpec(name, tuple(sorted(dims.items())), seed=seed)))

    check()
