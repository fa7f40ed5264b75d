"""The fusion cost model: every candidate group gets a decision and a reason, fused or not."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from .decisions import Measured, decision_key
from .hardware import Hardware
from .legality import convexity_violation
from .patterns import CostEstimate, Match, PatternRule, intermediate_traffic_cost


#: Rules whose fused kernel is a matmul or conv with an epilogue: the CPU schedules tile one output, so a
#: group whose intermediate is also read outside (a second output) cannot be scheduled as one.
SINGLE_OUTPUT_RULES = frozenset({"conv2d_bias_act", "matmul_bias_gelu", "gated_mlp"})


@dataclass
class Decision:
    pattern: str
    variant: str
    fused: bool
    reason: str
    ops: list[str]
    anchor: str                   # name of the group's output var (ties the decision to the report)
    var_names: list[str]
    bytes_saved: int = 0
    launches_saved: int = 0
    predicted_us: float = 0.0
    onnx_nodes: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)   # names of the vars the group reads (links it to its call)
    key: str = ""                 # the group's structural key in the measured-decision database
    #: what decided: "estimate", "measured", "check", "legality", "user" or "veto" (the scheduler or the
    #: GPU resource check refused the fused kernel after it was built)
    source: str = "estimate"

    def to_dict(self) -> dict:
        return asdict(self)


def _fmt_bytes(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"


def decide(rule: PatternRule, match: Match, hw: Hardware, *, disabled: bool, disabled_why: str = "",
           disabled_source: str = "user", measured: Mapping[str, Measured] | None = None, target: str = "") -> Decision:
    """Refuse when disabled, illegal or infeasible; otherwise a measurement of this group's structure on this
    target decides where one exists (`fuseguard tune`), else the predicted benefit."""
    out = match.output_var()
    key = decision_key(rule.name, match.variant, match.ops, match.input_vars(), match.constants(), out, target)
    base = dict(pattern=rule.name, variant=match.variant, ops=match.ops, key=key,
                anchor=out.name if out is not None else "", var_names=match.var_names, inputs=match.input_names)
    estimate: CostEstimate = (rule.cost or intermediate_traffic_cost)(match, hw)
    numbers = dict(bytes_saved=estimate.bytes_saved, launches_saved=estimate.launches_saved,
                   predicted_us=estimate.predicted_us)
    if disabled:
        return Decision(fused=False, reason=disabled_why or f"pattern '{rule.name}' disabled", source=disabled_source,
                        **base, **numbers)
    illegal = convexity_violation(match.bindings, match.var_usages)
    if illegal:
        return Decision(fused=False, reason=illegal, source="legality", **base, **numbers)
    escaping = match.escaping()
    if escaping and rule.name in SINGLE_OUTPUT_RULES:
        return Decision(fused=False, source="legality", reason=(
            f"'{escaping[0].name}' is also used outside the group: a {rule.name} kernel with a second output has "
            f"no matmul/conv schedule (measured: AlexNet's classifier ran 12x slower that way)"), **base, **numbers)
    if rule.check is not None:
        why_not = rule.check(match, hw)
        if why_not:
            return Decision(fused=False, reason=why_not, source="check", **base, **numbers)
    found = (measured or {}).get(key)
    if found is not None:
        return Decision(fused=found.fuse, reason=found.reason, source="measured", **base, **numbers)
    if not estimate.beneficial:
        return Decision(fused=False, reason=f"no predicted benefit on {hw.name} (saves {_fmt_bytes(estimate.bytes_saved)})",
                        **base, **numbers)
    reason = (f"saves {_fmt_bytes(estimate.bytes_saved)} of memory traffic and {estimate.launches_saved} "
              f"kernel(s), ~{estimate.predicted_us:.1f} us on {hw.name}")
    return Decision(fused=True, reason=reason, **base, **numbers)
