"""The models the latency gate times, and the sizes it times them at (data, used by pytest and the CLI)."""

from __future__ import annotations

from fuseguard.suites.models import get_model
from fuseguard.verify.check.model import SuiteSpec

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
