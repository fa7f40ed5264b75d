"""Latency gate: each model against baselines/<arch>.json, normalised by a same-run reference.

A model fails only when it is slower by more than the factor (default 10%) AND the difference is
statistically significant (verify/gate.py); inconclusive runs take more samples first. No baseline is
reported as a skip ("no baseline"), or a failure with --strict-baselines. Record with --update-baselines.
"""

from __future__ import annotations

import pytest

from suites.models import get_model
from verify.core import SuiteSpec

#: Small and medium models: cheap to time, and each exercises a different fused kernel family.
LATENCY_MODELS = ["mlp_gelu", "conv_bn_relu", "bert_encoder", "attention_masked", "softmax_layernorm",
                  "squeezenet", "resnet50"]


@pytest.mark.parametrize("name", LATENCY_MODELS)
def test_latency_against_baseline(name: str, latency_gate) -> None:
    model = get_model(name)
    result = latency_gate(SuiteSpec(name, tuple(sorted(model.default_dims.items()))))
    assert not result.regressed, result.line()
