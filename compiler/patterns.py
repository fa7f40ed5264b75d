"""The fusion pattern table: every named pattern, its structural check and its cost function.

One table in one file, so that a reader sees what can be fused and why. Each rule yields one or more
`tvm.relax.dpl` patterns (optional parts such as a bias become separate, more specific variants listed
first); FuseOpsByPattern applies them in table order, and every match is put to the cost model
(`compiler.cost.decide`), which fuses it or says why not.

Users add rules with `register_pattern` (see README "Extending fuseguard").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

from .hardware import Hardware


@dataclass
class Match:
    """What a check or cost function sees of one candidate group."""

    pattern: str
    variant: str
    annotated: Mapping[str, relax.Expr]
    bindings: Mapping[relax.Var, relax.Expr]       # the bindings that would move into the group
    var_usages: Mapping[relax.Var, list[relax.Var]]

    @property
    def vars(self) -> list[relax.Var]:
        return list(self.bindings.keys())

    @property
    def var_names(self) -> list[str]:
        return [v.name for v in self.bindings]

    @property
    def ops(self) -> list[str]:
        names = []
        for value in self.bindings.values():
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
                names.append(value.op.name.removeprefix("relax.").removeprefix("nn."))
        return names

    def output_var(self) -> relax.Var | None:
        """The group's result: the one bound var not consumed inside the group."""
        inside = set(self.bindings)
        for var in self.bindings:
            users = self.var_usages.get(var, [])
            if not any(u in inside for u in users):
                return var
        return None


@dataclass
class CostEstimate:
    """Predicted benefit of fusing one group on one target."""

    bytes_saved: int          # global-memory traffic avoided (intermediates not written and re-read)
    launches_saved: int       # kernels (GPU launches / CPU parallel regions) avoided
    predicted_us: float       # bytes_saved / bandwidth + launches_saved * launch overhead

    @property
    def beneficial(self) -> bool:
        return self.predicted_us > 0


CheckFn = Callable[[Match, Hardware], "str | None"]     # a reason not to fuse, or None
CostFn = Callable[[Match, Hardware], CostEstimate]


@dataclass
class PatternRule:
    """A named fusion rule. `variants` maps a variant name to (pattern, annotations)."""

    name: str
    description: str
    variants: Callable[[], list[tuple[str, DFPattern, dict[str, DFPattern]]]]
    check: CheckFn | None = None
    cost: CostFn | None = None
    tags: tuple[str, ...] = field(default_factory=tuple)
    #: Optional replacement: given the matched group's Relax function, return a new one (e.g. a
    #: hand-written kernel). Applied after fusion; None keeps TVM's generated kernel.
    replacement: Callable[..., object] | None = None


# --------------------------------------------------------------------------- helpers

def tensor_bytes(expr: relax.Expr) -> int:
    sinfo = expr.ty
    if not isinstance(sinfo, relax.TensorType) or sinfo.shape is None:
        return 0
    try:
        dims = [int(d) for d in sinfo.shape.values]
    except (TypeError, AttributeError):
        return 0
    bits = tvm.runtime.DataType(sinfo.dtype).bits if sinfo.dtype else 32
    return math.prod(dims) * max(1, bits // 8)


def intermediate_traffic_cost(match: Match, hw: Hardware) -> CostEstimate:
    """Default cost: each intermediate tensor is written once and read once per consumer when unfused."""
    out = match.output_var()
    saved = 0
    for var in match.vars:
        if var is out:
            continue
        nbytes = tensor_bytes(var)
        readers = max(1, len([u for u in match.var_usages.get(var, [])]))
        saved += nbytes * (1 + readers)
    launches = max(0, len(match.ops) - 1)
    us = saved / (hw.mem_bandwidth_gbs * 1e3) + launches * hw.launch_overhead_us
    return CostEstimate(bytes_saved=saved, launches_saved=launches, predicted_us=us)


def _commutative(op: str, a: DFPattern, b: DFPattern) -> DFPattern:
    return is_op(op)(a, b) | is_op(op)(b, a)


# --------------------------------------------------------------------------- conv2d + activation

_ACTIVATIONS: dict[str, Callable[[DFPattern], DFPattern]] = {
    "relu": lambda x: is_op("relax.nn.relu")(x),
    "silu": lambda x: is_op("relax.nn.silu")(x) | _commutative("relax.multiply", x, is_op("relax.sigmoid")(x)),
    "leakyrelu": lambda x: is_op("relax.nn.leakyrelu")(x),
    "sigmoid": lambda x: is_op("relax.sigmoid")(x),
}


def _conv_variants() -> list[tuple[str, DFPattern, dict[str, DFPattern]]]:
    variants = []
    for act_name, act in _ACTIVATIONS.items():
        for with_residual in (True, False):
            for with_bias in (True, False):
                data, weight = wildcard(), is_const()
                conv = is_op("relax.nn.conv2d")(data, weight)
                y: DFPattern = conv
                ann = {"conv": conv, "weight": weight}
                if with_bias:
                    bias = is_const()
                    y = is_op("relax.add")(y, bias)
                    ann["bias"] = bias
                if with_residual:
                    residual = wildcard()
                    y = _commutative("relax.add", y, residual)
                y = act(y)
                ann["root"] = y
                label = "conv2d" + ("_bias" if with_bias else "") + ("_add" if with_residual else "") + f"_{act_name}"
                variants.append((label, y, ann))
    return variants


def _conv_check(match: Match, hw: Hardware) -> str | None:
    conv = match.annotated["conv"]
    out_channels = int(conv.ty.shape.values[1]) if conv.attrs.out_layout == "NCHW" else \
        int(conv.ty.shape.values[-1])
    if not hw.is_gpu and out_channels < 16:
        return (f"Conv with {out_channels} output channels (< 16): the fused epilogue adds register "
                f"pressure with too few channels to vectorise over")
    return None


# --------------------------------------------------------------------------- matmul + bias + GELU

def _gelu_forms(x: DFPattern) -> dict[str, DFPattern]:
    """GELU as exporters emit it: the op, the erf decomposition, and the tanh approximation."""
    # erf form: 0.5 * x * (1 + erf(x / sqrt(2)))  (Div -> Erf -> Add -> Mul -> Mul), also x * 0.7071
    scaled = is_op("relax.divide")(x, is_const()) | _commutative("relax.multiply", x, is_const())
    erf1 = _commutative("relax.add", is_op("relax.erf")(scaled), is_const())
    erf_form = _commutative("relax.multiply", _commutative("relax.multiply", x, erf1), is_const()) | \
        _commutative("relax.multiply", x, _commutative("relax.multiply", erf1, is_const()))
    # tanh form: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))
    cube = is_op("relax.power")(x, is_const()) | _commutative("relax.multiply", x, _commutative("relax.multiply", x, x))
    inner = _commutative("relax.add", x, _commutative("relax.multiply", cube, is_const()))
    tanh1 = _commutative("relax.add", is_op("relax.tanh")(_commutative("relax.multiply", inner, is_const())), is_const())
    tanh_form = _commutative("relax.multiply", _commutative("relax.multiply", x, tanh1), is_const()) | \
        _commutative("relax.multiply", x, _commutative("relax.multiply", tanh1, is_const())) | \
        _commutative("relax.multiply", _commutative("relax.multiply", x, is_const()), tanh1)
    return {
        "gelu": is_op("relax.nn.gelu")(x) | is_op("relax.nn.gelu_tanh")(x),
        "gelu_erf": erf_form,
        "gelu_tanh": tanh_form,
    }


def _matmul_gelu_variants() -> list[tuple[str, DFPattern, dict[str, DFPattern]]]:
    variants = []
    for form in ("gelu", "gelu_erf", "gelu_tanh"):
        for with_bias in (True, False):
            weight = is_const()
            mm = is_op("relax.matmul")(wildcard(), weight)
            x: DFPattern = mm
            ann = {"matmul": mm, "weight": weight}
            if with_bias:
                bias = is_const()
                x = _commutative("relax.add", mm, bias)
                ann["bias"] = bias
            root = _gelu_forms(x)[form]
            ann["root"] = root
            variants.append((f"matmul{'_bias' if with_bias else ''}_{form}", root, ann))
    return variants


# --------------------------------------------------------------------------- the table

PATTERNS: dict[str, PatternRule] = {}


def register_pattern(rule: PatternRule, *, before: str | None = None) -> PatternRule:
    """Add a rule to the table (the public extension point). `before` puts it ahead of another rule."""
    if rule.name in PATTERNS:
        raise ValueError(f"fusion pattern {rule.name!r} is already registered")
    if before is None:
        PATTERNS[rule.name] = rule
    else:
        if before not in PATTERNS:
            raise ValueError(f"cannot insert {rule.name!r} before unknown pattern {before!r}")
        items = list(PATTERNS.items())
        idx = [k for k, _ in items].index(before)
        items.insert(idx, (rule.name, rule))
        PATTERNS.clear()
        PATTERNS.update(items)
    return rule


def unregister_pattern(name: str) -> None:
    PATTERNS.pop(name, None)


def pattern_names() -> list[str]:
    return list(PATTERNS)


def rules(enabled: Iterable[str] | None = None) -> list[PatternRule]:
    names = list(PATTERNS) if enabled is None else [n for n in PATTERNS if n in set(enabled)]
    return [PATTERNS[n] for n in names]


register_pattern(PatternRule(
    name="conv2d_bias_act",
    description="Conv2d (+bias, +folded BatchNorm) (+residual add) + ReLU/SiLU/LeakyReLU/Sigmoid in one kernel",
    variants=_conv_variants,
    check=_conv_check,
    cost=intermediate_traffic_cost,
    tags=("conv_bn_relu",),
))

register_pattern(PatternRule(
    name="matmul_bias_gelu",
    description="MatMul/Gemm + bias + GELU (op, erf or tanh form) with the epilogue in the output tile",
    variants=_matmul_gelu_variants,
    cost=intermediate_traffic_cost,
    tags=("matmul_bias_gelu",),
))
