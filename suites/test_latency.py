"""Latency gate: each model against baselines/<arch>.json, normalised by a same-run reference.

A model fails only when it is slower by more than the factor (default 10%) AND the difference is
statistically significant (verify/gate.py); inconclusive runs take more samples first. No baseline is
reported as a skip ("no baseline"), or a failure with --strict-baselines. Record with --update-baselines.
"""

from __future__ import annotations

import pytest

from suites.models import get_model
from verify.core import SuiteSpec

#: Models and the sizes they are gated at: each exercises a different fused kernel family, and each runs
#: for at least ~1 ms. Below that (a 30 us Softmax+LayerNorm, a 0.1 ms attention at seq 64) per-call
#: overhead and timer jitter dominate and the gate measured false alarms; such models are verified for
#: correctness in test_verify_suite.py but not timed here.
LATENCY_SET: dict[str, dict[str, int]] = {
    "mlp_gelu": {"seq": 64},
    "conv_bn_relu": {"size": 56},
    "bert_encoder": {"seq": 64},
    "attention_masked": {"seq": 256},
    "squeezenet": {},
    "resnet50": {},
}


def latency_spec(name: str) -> SuiteSpec:
    model = get_model(name)
    return SuiteSpec(name, tuple(sorted({**model.default_dims, **LATENCY_SET[name]}.items())))


@pytest.mark.parametrize("name", list(LATENCY_SET))
def test_latency_against_baseline(name: str, latency_gate) -> None:
    result = latency_gate(latency_spec(name))
    assert not result.regressed, result.line()
