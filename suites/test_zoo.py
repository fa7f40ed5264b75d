"""The real-export zoo (suites/zoo): torch.onnx.export output of torchvision and transformers models.

Every model, both exporters where committed, verifies fused and unfused against ONNX Runtime; no fused
build fails. The large ones (vit_b_16, efficientnet_b0) run with `--models-full` (nightly).
"""

from __future__ import annotations

import pytest

from fuseguard.suites.models import zoo_models
from fuseguard.verify.check.model import SuiteSpec
from fuseguard.verify.pytest_plugin import model_marks, skip_without_cuda_run


def _params() -> list:
    return [pytest.param(m, id=m.name, marks=model_marks(m)) for m in zoo_models()]


def test_zoo_is_committed() -> None:
    names = {m.name for m in zoo_models()}
    assert {"resnet18", "mobilenet_v2", "shufflenet_v2_x1_0", "vit_tiny", "bert_tiny", "gpt2_tiny",
            "llama_tiny", "resnet18_dynamo", "bert_tiny_dynamo", "roberta_tiny"} <= names


@pytest.mark.parametrize("model", _params())
def test_zoo_model_verifies(model, verify_model) -> None:
    verdict = verify_model(SuiteSpec(model.name))
    skip_without_cuda_run(verdict)
    for build in (verdict.fused, verdict.unfused):
        assert build.error is None, f"{model.name} ({build.config}): {build.error}"
        assert build.compare is not None and build.compare, f"{model.name} {build.config}: {build.compare.summary()}"


#: The exports' attention forms: BERT / GPT-2 / LLaMA (transformers, eager) scale after Q.K^T and add a
#: computed mask (GPT-2 and LLaMA causal through Where, LLaMA after rotary and repeated KV heads); the ViT
#: (torch's scaled_dot_product_attention decomposed) scales Q and K^T separately, on rank-3 tensors in the
#: TorchScript export. Each must match the attention pattern.
ATTENTION_MODELS = ("bert_tiny", "bert_tiny_dynamo", "gpt2_tiny", "llama_tiny", "roberta_tiny", "vit_tiny",
                    "vit_tiny_dynamo")


@pytest.mark.parametrize("name", ATTENTION_MODELS)
def test_attention_pattern_matches_real_exports(name: str, verify_model) -> None:
    verdict = verify_model(SuiteSpec(name))
    assert verdict.status == "PASS", verdict.fused.error
    decisions = [d for d in verdict.fused.report.decisions if d.pattern == "attention"]
    assert len(decisions) == 2, f"{name}: {len(decisions)} attention matches (2 layers)"
    groups = [g for g in verdict.fused.report.groups if g.pattern == "attention"]
    assert all(d.fused for d in decisions) == (len(groups) == 2), (decisions, groups)


#: Patterns each transformer export must fuse (2 layers each): GPT-2's MLP is a flattened Gemm (Conv1D)
#: with the tanh GELU, BERT's comes through ONNX Runtime's fold step, LLaMA has RMSNorm (2 per layer +
#: the final norm) and the SiLU-gated MLP.
EXPECTED_PATTERNS = {
    "bert_tiny": {"attention": 2, "matmul_bias_gelu": 2, "layernorm": 5},
    "bert_tiny_dynamo": {"attention": 2, "matmul_bias_gelu": 2, "layernorm": 5},
    "gpt2_tiny": {"attention": 2, "matmul_bias_gelu": 2, "layernorm": 5},
    "llama_tiny": {"attention": 2, "rmsnorm": 5, "gated_mlp": 2},
    "roberta_tiny": {"attention": 2, "matmul_bias_gelu": 2, "layernorm": 5},   # position ids by CumSum
    "wav2vec2_tiny": {"attention": 2, "matmul_bias_gelu": 2, "layernorm": 5},  # after a conv1d front end
    "whisper_tiny_enc": {"attention": 2, "matmul_bias_gelu": 2, "layernorm": 5},
}


@pytest.mark.parametrize("name", sorted(EXPECTED_PATTERNS))
def test_transformer_patterns_fuse(name: str, verify_model) -> None:
    verdict = verify_model(SuiteSpec(name))
    assert verdict.status == "PASS", verdict.fused.error
    counts: dict[str, int] = {}
    for group in verdict.fused.report.groups:
        counts[group.pattern] = counts.get(group.pattern, 0) + 1
    for pattern, expected in EXPECTED_PATTERNS[name].items():
        assert counts.get(pattern, 0) == expected, (name, counts)
