"""Latency gate: each model against baselines/<arch>.json, normalised by a same-run reference.

A model fails only when it is slower by more than the factor (default 10%) AND the difference is
statistically significant (verify/perf/gate.py); inconclusive runs take more samples first. No baseline is
reported as a skip ("no baseline"), or a failure with --strict-baselines. Record with --update-baselines.
"""

from __future__ import annotations

import pytest

from fuseguard.suites.latency_set import LATENCY_SET, latency_spec


#: ResNet-50's A/B (90 s on a 2-core Zen4, ~150 s on CI's runner: two 25-layer builds and four fresh timing
#: processes) is timed with `--models-full` (nightly); SqueezeNet keeps the convnets in the default run.
LATENCY_FULL_RUN_ONLY = ("resnet50",)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.models_full] if n in LATENCY_FULL_RUN_ONLY else [])
                                  for n in LATENCY_SET])
def test_latency_against_baseline(name: str, latency_gate) -> None:
    result = latency_gate(latency_spec(name))
    assert not result.regressed, result.line()


#: Fusion must pay on every machine: fused against unfused in the same run (no stored baseline), on a
#: convnet, a transformer block and the real exports where fusion once lost (AlexNet's classifier).
#: AlexNet (102 s cold on a 2-core Zen3: 240 MB of weights built twice) and LLaMA (31 s; GPT-2 keeps the
#: real-export transformers) are timed with `--models-full` (nightly).
PAYS_SET = ("alexnet", "squeezenet", "bert_encoder", "mlp_gelu", "gpt2_tiny", "llama_tiny")
PAYS_FULL_RUN_ONLY = ("alexnet", "llama_tiny")


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.models_full] if n in PAYS_FULL_RUN_ONLY else [])
                                  for n in PAYS_SET])
def test_fusion_pays(name: str, fusion_pays) -> None:
    from fuseguard.verify.check.model import resolve_model_arg

    spec = latency_spec(name) if name in LATENCY_SET else resolve_model_arg(name)
    result = fusion_pays(spec)
    assert result.passed, result.line()
