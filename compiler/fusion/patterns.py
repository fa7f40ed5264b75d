"""The fusion pattern table: every named pattern, its structural check and its cost function.

One table in one file, so that a reader sees what can be fused and why. Each rule yields one or more
`tvm.relax.dpl` patterns (optional parts such as a bias become separate, more specific variants listed
first); FuseOpsByPattern applies them in table order, and every match is put to the cost model
(`compiler.fusion.cost.decide`), which fuses it or says why not.

Users add rules with `register_pattern` (see README "Extending fuseguard").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

from ..ir import tags
# The analytic estimate lives in compiler/fusion/cost.py; re-exported here for rules written against this module.
from .cost import (CostEstimate, decide_at, decomposition_cost, dims_for_cost, intermediate_traffic_cost,
                   merged_nodes, tensor_bytes)
from ..hw.hardware import Hardware, for_target


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
    def input_names(self) -> list[str]:
        """Vars the group reads but does not bind: the arguments of its call once fused."""
        bound = set(self.bindings)
        names: list[str] = []

        def visit(expr: relax.Expr) -> None:
            if isinstance(expr, relax.Var) and expr not in bound and expr.name not in names:
                names.append(expr.name)

        for value in self.bindings.values():
            relax.analysis.post_order_visit(value, visit)
        return sorted(names)

    @property
    def ops(self) -> list[str]:
        """Operator names in graph order (by provenance tag; untagged bindings keep their place)."""
        def order(item: tuple[relax.Var, relax.Expr]) -> int:
            found = tags.indices(item[0].name)
            return found[0] if found else 1 << 30

        names = []
        for _, value in sorted(self.bindings.items(), key=order):
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
                names.append(value.op.name.removeprefix("relax.").removeprefix("nn."))
        return names

    def input_vars(self) -> list[relax.Var]:
        """Vars the group reads but does not bind, in first-use order."""
        bound, found = set(self.bindings), []

        def visit(expr: relax.Expr) -> None:
            if isinstance(expr, relax.Var) and expr not in bound and expr not in found:
                found.append(expr)

        for value in self.bindings.values():
            relax.analysis.post_order_visit(value, visit)
        return found

    def constants(self) -> list[relax.Expr]:
        """Tensor constants the group reads (weights, biases, scales)."""
        found: list[relax.Expr] = []

        def visit(expr: relax.Expr) -> None:
            if not isinstance(expr, (relax.Var, relax.Call)) and isinstance(getattr(expr, "ty", None), relax.TensorType) \
                    and hasattr(getattr(expr, "value", None), "numpy"):
                found.append(expr)

        for value in self.bindings.values():
            relax.analysis.post_order_visit(value, visit)
        return found

    def escaping(self) -> list[relax.Var]:
        """Bound vars other than the group's output that are also read outside the group (the fused call
        must then return them too, as a tuple)."""
        inside = set(self.bindings)
        out = self.output_var()
        return [v for v in self.bindings if v is not out
                and any(u not in inside for u in self.var_usages.get(v, []))]

    def output_var(self) -> relax.Var | None:
        """The group's result: the one bound var not consumed inside the group."""
        inside = set(self.bindings)
        for var in self.bindings:
            users = self.var_usages.get(var, [])
            if not any(u in inside for u in users):
                return var
        return None


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
    #: Optional rewrite run before matching while the rule is enabled (e.g. recognising a decomposed
    #: LayerNorm as one op): IRModule -> (IRModule, names of the bindings each rewrite consumed).
    prepare: Callable[[tvm.IRModule], tuple[tvm.IRModule, list[list[str]]]] | None = None
    #: Optional replacement kernel: (composite Relax function, TargetSpec) -> new function or None.
    #: Applied right after fusion; None keeps TVM's generated kernel for the group.
    replacement: Callable[..., object] | None = None


# --------------------------------------------------------------------------- helpers

def _commutative(op: str, a: DFPattern, b: DFPattern) -> DFPattern:
    return is_op(op)(a, b) | is_op(op)(b, a)


# --------------------------------------------------------------------------- conv2d + activation

_ACTIVATIONS: dict[str, Callable[[DFPattern], DFPattern]] = {
    # Most specific first: HardSwish and HardSigmoid contain a Clip (and an add that a residual variant
    # of plain Clip would otherwise swallow).
    # HardSwish: x * clip(x + 3, 0, 6) / 6
    "hardswish": lambda x: _commutative("relax.multiply", x, is_op("relax.divide")(
        is_op("relax.clip")(_commutative("relax.add", x, is_const()), wildcard(), wildcard()), is_const())),
    # HardSigmoid: clip(alpha * x + beta, 0, 1)
    "hardsigmoid": lambda x: is_op("relax.clip")(
        _commutative("relax.add", _commutative("relax.multiply", x, is_const()), is_const()), wildcard(), wildcard()),
    "relu": lambda x: is_op("relax.nn.relu")(x),
    "silu": lambda x: is_op("relax.nn.silu")(x) | _commutative("relax.multiply", x, is_op("relax.sigmoid")(x)),
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
                    y = _commutative("relax.add", y, residual)
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
            g = _commutative("relax.add", mm, bias)
            ann["bias"] = bias
        silu = is_op("relax.nn.silu")(g) | _commutative("relax.multiply", g, is_op("relax.sigmoid")(g))
        up = wildcard()
        root = _commutative("relax.multiply", silu, up)
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
            x = _commutative("relax.add", x, bias)
            ann["bias"] = bias
        if with_residual:
            x = _commutative("relax.add", x, wildcard())
        root = is_op("relax.nn.layer_norm")(x, is_const(), is_const())
        ann["root"] = ann["layer_norm"] = root
        variants.append((label, root, ann))
    return variants


def _layernorm_check(match: Match, hw: Hardware) -> str | None:
    if match.variant == "layernorm" and merged_nodes(match.output_var()) < 2:
        return "a lone LayerNormalization op is already one kernel: nothing to fuse"
    return None


def _prepare_layernorm(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[list[str]]]:
    from ..passes.normalize import recognize_layernorm

    return recognize_layernorm(mod)


# --------------------------------------------------------------------------- RMSNorm

def _rmsnorm_variants() -> list[tuple[str, DFPattern, dict[str, DFPattern]]]:
    variants = []
    for label, with_residual in (("residual_rmsnorm", True), ("rmsnorm", False)):
        x: DFPattern = wildcard()
        if with_residual:
            x = _commutative("relax.add", x, wildcard())
        root = is_op("relax.nn.rms_norm")(x, is_const())
        variants.append((label, root, {"root": root, "rms_norm": root}))
    return variants


def _rmsnorm_check(match: Match, hw: Hardware) -> str | None:
    if match.variant == "rmsnorm" and merged_nodes(match.output_var()) < 2:
        return "a lone RMSNorm op is already one kernel: nothing to fuse"
    return None


def _prepare_rmsnorm(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[list[str]]]:
    from ..passes.normalize import recognize_rmsnorm

    return recognize_rmsnorm(mod)


# --------------------------------------------------------------------------- Softmax

def _scaled(x: DFPattern) -> DFPattern:
    return _commutative("relax.multiply", x, is_const()) | is_op("relax.divide")(x, is_const())


def _softmax_variants() -> list[tuple[str, DFPattern, dict[str, DFPattern]]]:
    variants = []
    for label in ("scale_mask_softmax", "mask_softmax", "scale_softmax"):
        x: DFPattern = wildcard()
        if label.startswith("scale"):
            x = _scaled(x)
        if "mask" in label:
            x = _commutative("relax.add", x, wildcard())
        root = is_op("relax.nn.softmax")(x)
        variants.append((label, root, {"root": root, "softmax": root}))
    return variants


# --------------------------------------------------------------------------- attention

def _attention_variants() -> list[tuple[str, DFPattern, dict[str, DFPattern]]]:
    """Attention as exporters emit it: the scale after Q.K^T (HF eager, hand-written; a per-head constant in
    Swin V2's cosine attention), on Q and on K^T separately (torch's scaled_dot_product_attention
    decomposition: both by sqrt(1/sqrt(d))), or already folded into the Q projection; no additive mask, one
    (HF's computed causal/padding mask) or two (T5's position bias, then the padding mask; GPT-Neo's causal
    mask once `MaskedFillAsAdd` has made it an add), summed into one for the kernel."""
    variants = []
    for scaling in ("scores", "qk", "none"):
        for masks in (2, 1, 0):
            q, kt, v = wildcard(), wildcard(), wildcard()
            ann: dict[str, DFPattern] = {"q": q, "kt": kt, "v": v}
            if scaling == "qk":
                scores = is_op("relax.matmul")(_scaled(q), _scaled(kt))
                x: DFPattern = scores
            else:
                scores = is_op("relax.matmul")(q, kt)
                x = _scaled(scores) if scaling == "scores" else scores
            ann["scores"] = scores
            for n in range(masks):
                mask = wildcard()
                x = _commutative("relax.add", x, mask)
                ann[_MASKS[n]] = mask
            probs = is_op("relax.nn.softmax")(x)
            root = is_op("relax.matmul")(probs, v)
            ann["softmax"], ann["root"] = probs, root
            label = "attention" + ("", "_masked", "_masked2")[masks] + {"scores": "", "qk": "_qk_scaled",
                                                                         "none": "_unscaled"}[scaling]
            variants.append((label, root, ann))
    return variants


#: the annotations of an attention match's additive masks, innermost first
_MASKS = ("mask", "mask2")


def _attention_check(match: Match, hw: Hardware) -> str | None:
    """Fuse only into the tiled online-softmax kernel: merged by FuseTIR instead, the five ops become one
    PrimFunc that still materialises S x S and that no schedule rule handles well (measured 100x slower
    than unfused on CPU)."""
    scores = match.annotated["scores"]
    try:
        symbolic = not all(isinstance(d, tvm.tirx.IntImm) for d in scores.ty.shape.values)
    except (TypeError, AttributeError):
        return "scores of unknown shape"
    if symbolic and hw.is_gpu:
        return "scores of symbolic shape (the CUDA tiled kernel is specialised per shape)"
    shape = dims_for_cost(scores)     # symbolic dims at the cost model's sizes: for the tile choice
    if shape is None:
        return "scores of symbolic shape with no size to choose tiles at"
    if len(shape) == 3:          # [batch * heads, seq_q, seq_k]: torch's MultiheadAttention
        shape = [1, *shape]
    if len(shape) != 4:
        return f"scores of rank {len(shape)} (need [batch, heads, seq_q, seq_k] or [batch*heads, seq_q, seq_k])"
    softmax = match.annotated["softmax"]
    axis = int(softmax.attrs.axis)
    if axis not in (-1, len(scores.ty.shape.values) - 1):
        return f"softmax over axis {axis}, not the key axis"
    for name in ("q", "kt", "v"):
        if len(match.annotated[name].ty.shape.values) != len(scores.ty.shape.values):
            return f"{name} of rank {len(match.annotated[name].ty.shape.values)}: broadcast batch matmul"
    from ..passes.normalize import same_dims

    for mask in (match.annotated[name] for name in _MASKS if name in match.annotated):
        if not isinstance(mask.ty, relax.TensorType) or mask.ty.shape is None or \
                len(mask.ty.shape.values) > len(scores.ty.shape.values):
            return "mask of unknown or higher rank than the scores"
        for m_dim, s_dim in zip(reversed(list(mask.ty.shape.values)), reversed(list(scores.ty.shape.values))):
            if not (same_dims([m_dim], [1]) or same_dims([m_dim], [s_dim])):
                return (f"mask dim {m_dim} does not provably broadcast to the scores' {s_dim} (a symbolic "
                        f"dim the kernel cannot check)")
    escaping = match.escaping()
    if escaping:
        return (f"'{escaping[0].name}' is also used outside the group: the tiled kernel returns only the "
                f"attention output")
    q = match.annotated["q"]
    if not isinstance(q.ty.shape.values[-1], tvm.tirx.IntImm):
        return "symbolic head size"
    head_dim = int(q.ty.shape.values[-1])
    dtype = str(q.ty.dtype)
    if dtype not in ("float32", "float16"):
        return f"{dtype} attention: the tiled kernel is written for float32 and float16"
    v = match.annotated["v"]
    v_dims = dims_for_cost(v)
    if v_dims is None:
        return "V of unknown shape"
    if len(v_dims) < 2 or v_dims[-2] != shape[3]:
        return f"V of shape {v_dims}: the tiled kernel needs one value row per key ({shape[3]})"
    if v_dims[-1] != head_dim and hw.is_gpu:
        return (f"V of shape {v_dims}: the CUDA tiled kernel needs V's head size equal to Q's ({head_dim}) "
                f"(the CPU kernel takes another, LeViT's)")
    try:
        from ..kernels.attention import choose_tiles, cuda_tile_budget
    except ImportError:
        return "no tiled attention kernel available for this target"
    budget = cuda_tile_budget(hw) if hw.is_gpu else hw.l2_bytes
    tiles = choose_tiles(shape[2], shape[3], head_dim, str(q.ty.dtype), "cuda" if hw.is_gpu else "llvm", budget,
                         v_dims[-1])
    if tiles is None:
        return (f"no attention tile for head_dim {head_dim} fits {budget // 1024} KiB of "
                f"{'shared memory per block' if hw.is_gpu else 'L2'} on {hw.name}: falling back to unfused")
    return None


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
    variants=_attention_variants,
    check=_attention_check,
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

def _attention_replacement(bb: relax.BlockBuilder, func: relax.Function, args: list[relax.Expr], spec) -> relax.Expr | None:
    """Swap the composite attention group for the tiled online-softmax kernel (compiler/kernels).

    The scale is the product of every constant multiplier (divisors inverted) on the way from Q and K^T
    to the softmax, wherever the exporter put it; rank-3 groups ([batch*heads, seq, d]) run as one batch.
    """
    from ..kernels.attention import attention_call, cuda_tile_budget
    from ..passes.normalize import const_values, same_dims

    param_arg = dict(zip(func.params, args))
    values: dict[relax.Var, relax.Expr] = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            values[binding.var] = binding.value

    def value_of(expr: relax.Expr) -> relax.Expr:
        return values.get(expr, expr) if isinstance(expr, relax.Var) else expr

    def const_array(expr: relax.Expr) -> np.ndarray | None:
        return const_values(param_arg.get(expr, expr) if isinstance(expr, relax.Var) else expr)

    def const_scalar(expr: relax.Expr) -> float | None:
        arr = const_array(expr)
        return float(arr.reshape(())) if arr is not None and arr.size == 1 else None

    def broadcast_factor(value: relax.Call) -> tuple[np.ndarray, int] | None:
        """`scores * c` or `scores / c` with c a constant tensor that is 1 along the key axis (per head or per
        query row: Swin V2's learnt logit scale) or along the query axis (per key): the factor and the
        operand it moves to (0: Q, 1: K^T), as (c q).k = c (q.k), up to rounding."""
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                and value.op.name in ("relax.multiply", "relax.divide")):
            return None
        arr = const_array(value.args[1])
        if arr is None and value.op.name == "relax.multiply":
            arr = const_array(value.args[0])
        if arr is None or arr.ndim < 2 or 1 not in arr.shape[-2:]:
            return None
        return (arr if value.op.name == "relax.multiply" else 1.0 / arr), 0 if arr.shape[-1] == 1 else 1

    scale = 1.0

    def unscale(value: relax.Expr) -> relax.Expr | None:
        """For `x * c`, `c * x` or `x / c` with a scalar constant c: fold c into `scale`, return x."""
        nonlocal scale
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                and value.op.name in ("relax.multiply", "relax.divide")):
            return None
        a, b = value.args
        cb = const_scalar(b)
        ca = const_scalar(a) if value.op.name == "relax.multiply" else None
        if cb is not None:
            scale *= cb if value.op.name == "relax.multiply" else 1.0 / cb
            return a
        if ca is not None:
            scale *= ca
            return b
        return None

    def strip_scale(expr: relax.Expr) -> relax.Expr | None:
        """Follow scalings by constants down to the group's parameter; None if it is not one."""
        while (inner := unscale(value_of(expr))) is not None:
            expr = inner
        return param_arg.get(expr) if isinstance(expr, relax.Var) and expr in param_arg else None

    calls = [v for v in values.values() if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op)]
    softmax = next((c for c in calls if c.op.name == "relax.nn.softmax"), None)
    matmuls = [c for c in calls if c.op.name == "relax.matmul"]
    if softmax is None or len(matmuls) != 2:
        return None
    second = next(m for m in matmuls if value_of(m.args[0]) is softmax or
                  (isinstance(m.args[0], relax.Var) and values.get(m.args[0]) is softmax))
    first = next(m for m in matmuls if m is not second)
    v = param_arg.get(second.args[1]) if isinstance(second.args[1], relax.Var) else None
    # from the softmax input back to the first matmul: additive masks, then (inside them) the scale
    masks: list[relax.Expr] = []
    factors: list[tuple[np.ndarray, int]] = []
    expr = softmax.args[0]
    while True:
        value = value_of(expr)
        if value is first:
            break
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)):
            return None
        if value.op.name == "relax.add":
            a, b = value.args
            inner_a = isinstance(a, relax.Var) and a in values
            inner_b = isinstance(b, relax.Var) and b in values
            if inner_a == inner_b or len(masks) == len(_MASKS) or scale != 1.0 or factors:
                return None     # a mask inside a scale would be scaled too: not this kernel's formula
            mask_expr = b if inner_a else a
            masks.append(param_arg.get(mask_expr, mask_expr) if isinstance(mask_expr, relax.Var) else mask_expr)
            expr = a if inner_a else b
        elif (inner := unscale(value)) is not None:
            expr = inner
        elif (factor := broadcast_factor(value)) is not None:
            factors.append(factor)
            expr = value.args[0] if const_array(value.args[0]) is None else value.args[1]
        else:
            return None
    q, kt = strip_scale(first.args[0]), strip_scale(first.args[1])
    if q is None or kt is None or v is None:
        return None
    operands = [q, kt]
    for arr, which in factors:      # per head/row onto Q, per key onto K^T, which they must not enlarge
        dims = list(operands[which].ty.shape.values)
        if arr.ndim > len(dims) or not all(a == 1 or same_dims([a], [d]) for a, d in zip(arr.shape[::-1], dims[::-1])):
            return None
        operands[which] = bb.emit(relax.op.multiply(operands[which], relax.const(arr.astype(str(q.ty.dtype)))))
    q, kt = operands
    rank = len(q.ty.shape.values)
    if rank == 3:
        q, kt, v = (bb.emit(relax.op.expand_dims(t, [0])) for t in (q, kt, v))
    mask = None
    for m in masks:     # T5's position bias and padding mask: one mask for the kernel
        mask = m if mask is None else bb.emit(relax.op.add(mask, m))
    if mask is not None:
        mrank = len(mask.ty.shape.values)
        if mrank < 4:
            mask = bb.emit(relax.op.reshape(mask, [1] * (4 - mrank) + list(mask.ty.shape.values)))
    k = bb.emit(relax.op.permute_dims(kt, [0, 1, 3, 2]))
    # the tile the cost model's check chose (compiler/kernels/attention.cuda_tile_budget), at the cost
    # model's sizes for symbolic sequences
    budget = cuda_tile_budget(for_target("cuda", spec.arch)) if spec.is_gpu else None
    seq_dims = (q.ty.shape.values[-2], k.ty.shape.values[-2])
    tile_sizes = None
    if not all(isinstance(d, tvm.tirx.IntImm) for d in seq_dims):
        from ..kernels.attention import SYMBOLIC_SEQ_TILE_AT

        q_at, k_at = dims_for_cost(q), dims_for_cost(k)
        if q_at is not None and k_at is not None:
            tile_sizes = (min(q_at[-2], SYMBOLIC_SEQ_TILE_AT), min(k_at[-2], SYMBOLIC_SEQ_TILE_AT))
    call = attention_call(bb, q, k, v, mask, scale, spec.tvm_target(), max_shared_bytes=budget,
                          name="fused_attention", tile_sizes=tile_sizes)
    if rank == 3:
        out = bb.emit(call)
        return relax.op.squeeze(out, [0])
    return call


PATTERNS["attention"].replacement = _attention_replacement
