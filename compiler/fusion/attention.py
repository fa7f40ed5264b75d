"""The attention rule: the forms exporters write scaled-dot-product attention in, the check that fuses a
group only into the tiled online-softmax kernel, and the replacement that swaps the group for that kernel
(compiler/kernels/attention.py; ONNX's own Attention op is converted in frontend/converters/attention.py)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_op, wildcard

from ..hw.hardware import Hardware, for_target
from .cost import dims_for_cost
from .rules import Match, commutative, scaled


def attention_variants() -> list[tuple[str, DFPattern, dict[str, DFPattern]]]:
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
                scores = is_op("relax.matmul")(scaled(q), scaled(kt))
                x: DFPattern = scores
            else:
                scores = is_op("relax.matmul")(q, kt)
                x = scaled(scores) if scaling == "scores" else scores
            ann["scores"] = scores
            for n in range(masks):
                mask = wildcard()
                x = commutative("relax.add", x, mask)
                ann[MASKS[n]] = mask
            probs = is_op("relax.nn.softmax")(x)
            root = is_op("relax.matmul")(probs, v)
            ann["softmax"], ann["root"] = probs, root
            label = "attention" + ("", "_masked", "_masked2")[masks] + {"scores": "", "qk": "_qk_scaled",
                                                                         "none": "_unscaled"}[scaling]
            variants.append((label, root, ann))
    return variants


#: the annotations of an attention match's additive masks, innermost first
MASKS = ("mask", "mask2")


def attention_check(match: Match, hw: Hardware) -> str | None:
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
    from ..ir.helpers import same_dims

    for mask in (match.annotated[name] for name in MASKS if name in match.annotated):
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


def attention_replacement(bb: relax.BlockBuilder, func: relax.Function, args: list[relax.Expr], spec) -> relax.Expr | None:
    """Swap the composite attention group for the tiled online-softmax kernel (compiler/kernels).

    The scale is the product of every constant multiplier (divisors inverted) on the way from Q and K^T
    to the softmax, wherever the exporter put it; rank-3 groups ([batch*heads, seq, d]) run as one batch.
    """
    from ..ir.helpers import const_values, same_dims
    from ..kernels.attention import attention_call, cuda_tile_budget

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
            if inner_a == inner_b or len(masks) == len(MASKS) or scale != 1.0 or factors:
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
