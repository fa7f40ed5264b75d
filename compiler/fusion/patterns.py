"""The fusion pattern table: every named pattern, its structural check and its cost function.

One table in one file, so that a reader sees what can be fused and why. Each rule yields one or more
`tvm.relax.dpl` patterns (optional parts such as a bias become separate, more specific variants listed
first); FuseOpsByPattern applies them in table order, and every match is put to the cost model
(`compiler.fusion.cost.decide`), which fuses it or says why not.

Users add rules with `register_pattern` (see README "Extending fuseguard").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import tvm
import tvm_ffi
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

from ..hw.hardware import Hardware
from .attention import attention_check, attention_replacement, attention_variants
from .cost import decomposition_cost, intermediate_traffic_cost, merged_nodes
from .rules import Match, PatternRule, commutative, scaled

# --------------------------------------------------------------------------- conv2d + activation

_ACTIVATIONS: dict[str, Callable[[DFPattern], DFPattern]] = {
    # Most specific first: HardSwish and HardSigmoid contain a Clip (and an add that a residual variant
    # of plain Clip would otherwise swallow).
    # HardSwish: x * clip(x + 3, 0, 6) / 6
    "hardswish": lambda x: commutative("relax.multiply", x, is_op("relax.divide")(
        is_op("relax.clip")(commutative("relax.add", x, is_const()), wildcard(), wildcard()), is_const())),
    # HardSigmoid: clip(alpha * x + beta, 0, 1)
    "hardsigmoid": lambda x: is_op("relax.clip")(
        commutative("relax.add", commutative("relax.multiply", x, is_const()), is_const()), wildcard(), wildcard()),
    "relu": lambda x: is_op("relax.nn.relu")(x),
    "silu": lambda x: is_op("relax.nn.silu")(x) | commutative("relax.multiply", x, is_op("relax.sigmoid")(x)),
    "leakyrelu": lambda x: is_op("relax.nn.leakyrelu")(x),
    "sigmoid": lambda x: is_op("relax.sigmoid")(x),
    # ReLU6 and other Clip(0, 6)-style bounds (the importer keeps Clip as relax.clip)
    "clip": lambda x: is_op("relax.clip")(x, wildcard(), wildcard()),
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
                    y = commutative("relax.add", y, residual)
                y = act(y)
                ann["root"] = y
                label = "conv2d" + ("_bias" if with_bias else "") + ("_add" if with_residual else "") + f"_{act_name}"
                variants.append((label, y, ann))
    return variants


def _channels(shape: list, layout: str) -> int:
    """Channels of a conv output in ``layout``: NCHW/NHWC's C, or blocks x lanes in NCHW{b}c (its lanes alone
    had read as 8 channels on AVX2 and vetoed every blocked conv's epilogue)."""
    dims = list(shape)      # spatial dims may be symbolic; channels are not
    return int(dims[1]) * int(dims[4]) if len(dims) == 5 else int(dims[layout.index("C")])


def _conv_check(match: Match, hw: Hardware) -> str | None:
    conv = match.annotated["conv"]
    out_channels = _channels(conv.ty.shape.values, str(conv.attrs.out_layout))
    if not hw.is_gpu and out_channels < 16:
        return (f"Conv with {out_channels} output channels (< 16): the fused epilogue adds register "
                f"pressure with too few channels to vectorise over")
    return None


# --------------------------------------------------------------------------- matmul + bias + GELU

def _gelu_forms(x: DFPattern) -> dict[str, DFPattern]:
    """GELU as exporters emit it: the op, the erf decomposition, and the tanh approximation."""
    # erf form: 0.5 * x * (1 + erf(x / sqrt(2)))  (Div -> Erf -> Add -> Mul -> Mul), also x * 0.7071
    scaled = is_op("relax.divide")(x, is_const()) | commutative("relax.multiply", x, is_const())
    erf1 = commutative("relax.add", is_op("relax.erf")(scaled), is_const())
    erf_form = commutative("relax.multiply", commutative("relax.multiply", x, erf1), is_const()) | \
        commutative("relax.multiply", x, commutative("relax.multiply", erf1, is_const()))
    # tanh form: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))
    cube = is_op("relax.power")(x, is_const()) | commutative("relax.multiply", x, commutative("relax.multiply", x, x))
    inner = commutative("relax.add", x, commutative("relax.multiply", cube, is_const()))
    tanh1 = commutative("relax.add", is_op("relax.tanh")(commutative("relax.multiply", inner, is_const())), is_const())
    tanh_form = commutative("relax.multiply", commutative("relax.multiply", x, tanh1), is_const()) | \
        commutative("relax.multiply", x, commutative("relax.multiply", tanh1, is_const())) | \
        commutative("relax.multiply", commutative("relax.multiply", x, is_const()), tanh1)
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
                x = commutative("relax.add", mm, bias)
                ann["bias"] = bias
            root = _gelu_forms(x)[form]
            ann["root"] = root
            variants.append((f"matmul{'_bias' if with_bias else ''}_{form}", root, ann))
    return variants


# --------------------------------------------------------------------------- SiLU-gated MLP

def _gated_mlp_variants() -> list[tuple[str, DFPattern, dict[str, DFPattern]]]:
    """LLaMA's MLP gate: SiLU(x @ Wg (+ b)) * up, with `up` (x @ Wu) read as an input of the epilogue.

    The gate projection, its SiLU (op or x * sigmoid(x), as TorchScript exports it) and the gating
    multiply become one matmul kernel with an elementwise epilogue; the up projection stays its own matmul
    (two matmuls in one PrimFunc is a shape no CPU matmul schedule takes)."""
    variants = []
    for with_bias in (True, False):
        weight = is_const()
        mm = is_op("relax.matmul")(wildcard(), weight)
        g: DFPattern = mm
        ann = {"matmul": mm, "weight": weight}
        if with_bias:
            bias = is_const()
            g = commutative("relax.add", mm, bias)
            ann["bias"] = bias
        silu = is_op("relax.nn.silu")(g) | commutative("relax.multiply", g, is_op("relax.sigmoid")(g))
        up = wildcard()
        root = commutative("relax.multiply", silu, up)
        ann["root"], ann["up"] = root, up
        variants.append((f"matmul{'_bias' if with_bias else ''}_silu_gate", root, ann))
    return variants


def _gated_mlp_check(match: Match, hw: Hardware) -> str | None:
    up, root = match.annotated["up"], match.annotated["root"]
    try:
        a, b = list(up.ty.shape.values), list(root.ty.shape.values)
    except (TypeError, AttributeError):
        return "unknown shapes: the epilogue's broadcast cannot be checked"
    # structural: a symbolic dim is the same var on both sides when they do not broadcast
    if len(a) != len(b) or not all(tvm_ffi.structural_equal(x, y) for x, y in zip(a, b)):
        return "the up projection broadcasts against the gate: not an elementwise epilogue"
    return None


# --------------------------------------------------------------------------- LayerNorm

def _layernorm_variants() -> list[tuple[str, DFPattern, dict[str, DFPattern]]]:
    variants = []
    for label, with_bias, with_residual in (("bias_residual_layernorm", True, True),
                                            ("residual_layernorm", False, True),
                                            ("layernorm", False, False)):
        x: DFPattern = wildcard()
        ann: dict[str, DFPattern] = {}
        if with_bias:
            bias = is_const()
            x = commutative("relax.add", x, bias)
            ann["bias"] = bias
        if with_residual:
            x = commutative("relax.add", x, wildcard())
        root = is_op("relax.nn.layer_norm")(x, is_const(), is_const())
        ann["root"] = ann["layer_norm"] = root
        variants.append((label, root, ann))
    return variants


def _layernorm_check(match: Match, hw: Hardware) -> str | None:
    if match.variant == "layernorm" and merged_nodes(match.output_var()) < 2:
        return "a lone LayerNormalization op is already one kernel: nothing to fuse"
    return None


def _prepare_layernorm(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[list[str]]]:
    from .recognize import recognize_layernorm

    return recognize_layernorm(mod)


# --------------------------------------------------------------------------- RMSNorm

def _rmsnorm_variants() -> list[tuple[str, DFPattern, dict[str, DFPattern]]]:
    variants = []
    for label, with_residual in (("residual_rmsnorm", True), ("rmsnorm", False)):
        x: DFPattern = wildcard()
        if with_residual:
            x = commutative("relax.add", x, wildcard())
        root = is_op("relax.nn.rms_norm")(x, is_const())
        variants.append((label, root, {"root": root, "rms_norm": root}))
    return variants


def _rmsnorm_check(match: Match, hw: Hardware) -> str | None:
    if match.variant == "rmsnorm" and merged_nodes(match.output_var()) < 2:
        return "a lone RMSNorm op is already one kernel: nothing to fuse"
    return None


def _prepare_rmsnorm(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[list[str]]]:
    from .recognize import recognize_rmsnorm

    return recognize_rmsnorm(mod)


# --------------------------------------------------------------------------- Softmax


def _softmax_variants() -> list[tuple[str, DFPattern, dict[str, DFPattern]]]:
    variants = []
    for label in ("scale_mask_softmax", "mask_softmax", "scale_softmax"):
        x: DFPattern = wildcard()
        if label.startswith("scale"):
            x = scaled(x)
        if "mask" in label:
            x = commutative("relax.add", x, wildcard())
        root = is_op("relax.nn.softmax")(x)
        variants.append((label, root, {"root": root, "softmax": root}))
    return variants


# --------------------------------------------------------------------------- attention


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
    name="attention",
    description="MatMul(Q, K^T) -> scale -> (+mask) -> Softmax -> MatMul(V) as one kernel",
    variants=attention_variants,
    check=attention_check,
    cost=intermediate_traffic_cost,
    tags=("attention",),
))

register_pattern(PatternRule(
    name="conv2d_bias_act",
    description="Conv2d (+bias, +folded BatchNorm) (+residual add) + ReLU/ReLU6/SiLU/LeakyReLU/Sigmoid/"
                "HardSwish/HardSigmoid in one kernel",
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

register_pattern(PatternRule(
    name="gated_mlp",
    description="MatMul (+bias) + SiLU + gating multiply (LLaMA's SiLU-gated MLP) with the epilogue in the "
                "output tile",
    variants=_gated_mlp_variants,
    check=_gated_mlp_check,
    cost=intermediate_traffic_cost,
    tags=("gated_mlp",),
))

register_pattern(PatternRule(
    name="layernorm",
    description="(bias +) residual add + LayerNorm in one kernel; decomposed LayerNorm recognised as one op",
    variants=_layernorm_variants,
    check=_layernorm_check,
    cost=decomposition_cost,
    prepare=_prepare_layernorm,
    tags=("layernorm",),
))

register_pattern(PatternRule(
    name="rmsnorm",
    description="(residual add +) RMSNorm in one kernel; the exported decomposition (Pow, ReduceMean, Add, "
                "Sqrt, Div, Mul, Mul) recognised as one op",
    variants=_rmsnorm_variants,
    check=_rmsnorm_check,
    cost=decomposition_cost,
    prepare=_prepare_rmsnorm,
    tags=("rmsnorm",),
))

register_pattern(PatternRule(
    name="softmax",
    description="(scale *) (+ mask) Softmax as one row-reduction kernel (max, exp, sum, divide)",
    variants=_softmax_variants,
    cost=intermediate_traffic_cost,
    tags=("softmax",),
))


# --------------------------------------------------------------------------- replacement kernels


PATTERNS["attention"].replacement = attention_replacement
