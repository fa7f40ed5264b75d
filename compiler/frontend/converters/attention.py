"""ONNX's own Attention operator (opset 23, 24's cache inputs, 25's sliding window) as Relax ops.

TVM's frontend maps "Attention" to Microsoft's contrib op (a `num_heads` attribute, packed QKV weights) and
fails on the standard one with a KeyError, so every model exported at opset 23+ with
`scaled_dot_product_attention` as one node could not be imported. Semantics follow ONNX's reference
implementation (onnx/reference/ops/op_attention.py) step for step: 3D inputs split into heads; the KV
cache concatenated; the scale applied as sqrt(scale) to Q and to K^T (so the result is emitted in the form
the `attention` fusion pattern's "qk_scaled" variant matches, compiler/fusion/patterns.py); softcap before the
bias; a boolean mask as 0 / -inf, a short mask padded with -inf; bottom-right causal and sliding-window
frontiers offset by the cache length (or per batch by `nonpad_kv_seqlen`); grouped-query heads repeated;
a row with no attendable key gives 0, decided on the bias (applied to the output, after the P.V
product, so the attention group stays intact: a NaN row of P only reaches its own output row).
"""

from __future__ import annotations

import numpy as np
import onnx
from tvm import relax

from ...ir.helpers import static_dims


def is_onnx_attention(attrs: dict) -> bool:
    """The standard op (default domain), not com.microsoft's, which has `num_heads`."""
    return "num_heads" not in attrs


def _const(value: np.ndarray | float, dtype: str) -> relax.Expr:
    """A constant of `dtype`; numpy has no bfloat16, so such constants are made in float32 and cast."""
    if dtype == "bfloat16":
        return relax.op.astype(relax.const(np.asarray(value, dtype="float32")), dtype)
    return relax.const(np.asarray(value).astype(dtype), dtype)


def _split_heads(x: relax.Expr, heads: int, dims: list[int]) -> relax.Expr:
    """[B, S, H*D] -> [B, H, S, D]."""
    b, s, hidden = dims
    return relax.op.permute_dims(relax.op.reshape(x, (b, s, heads, hidden // heads)), [0, 2, 1, 3])


def convert(inputs: list, attrs: dict) -> relax.Expr:
    """The converted node as a tuple of its outputs (Y, present_key, present_value, qk_matmul_output).
    Raises ValueError for what it cannot convert (the importer names the node in its one-line error)."""
    q, k, v = inputs[0], inputs[1], inputs[2]
    mask, past_k, past_v = (inputs[i] if len(inputs) > i else None for i in (3, 4, 5))
    nonpad = inputs[6] if len(inputs) > 6 else None
    q_dims, k_dims, v_dims = static_dims(q), static_dims(k), static_dims(v)
    if q_dims is None or k_dims is None or v_dims is None:
        raise ValueError("Q, K and V need static shapes (symbolic dims are not supported for this op yet)")
    if len(q_dims) != len(k_dims) or len(q_dims) not in (3, 4):
        raise ValueError(f"Q and K must both be 3D or 4D, got ranks {len(q_dims)} and {len(k_dims)}")
    dtype = str(q.ty.dtype)
    three_d = len(q_dims) == 3
    if three_d:
        qh, kvh = int(attrs.get("q_num_heads", 0)), int(attrs.get("kv_num_heads", 0))
        if not qh or not kvh:
            raise ValueError("3D inputs need the q_num_heads and kv_num_heads attributes")
        q, k, v = _split_heads(q, qh, q_dims), _split_heads(k, kvh, k_dims), _split_heads(v, kvh, v_dims)
        q_dims = [q_dims[0], qh, q_dims[1], q_dims[2] // qh]
        k_dims = [k_dims[0], kvh, k_dims[1], k_dims[2] // kvh]
        v_dims = [v_dims[0], kvh, v_dims[1], v_dims[2] // kvh]
    batch, q_heads, q_len, head = q_dims
    kv_heads = k_dims[1]
    scale = attrs.get("scale")
    scale = 1.0 / np.sqrt(head) if scale is None else float(scale)
    root = _const(np.sqrt(scale), dtype)

    past_len = 0
    if past_k is not None and past_v is not None:
        pk = static_dims(past_k)
        if pk is None:
            raise ValueError("past_key needs a static shape")
        past_len = pk[2]
        k, v = relax.op.concat([past_k, k], axis=2), relax.op.concat([past_v, v], axis=2)
    present_k, present_v = k, v
    kv_len = k_dims[2] + past_len

    # The additive bias [.., q_len, kv_len]: numpy while every part is a constant, Relax once one is not.
    bias: np.ndarray | relax.Expr | None = None
    if mask is not None:
        m_dims = static_dims(mask)
        if m_dims is None:
            raise ValueError("attn_mask needs a static shape")
        is_bool = str(mask.ty.dtype) == "bool"
        if is_bool:
            mask = relax.op.where(mask, _const(0.0, dtype), _const(-np.inf, dtype))
        elif str(mask.ty.dtype) != dtype:
            mask = relax.op.astype(mask, dtype)
        if m_dims[-1] < kv_len:
            pad = np.full([*m_dims[:-1], kv_len - m_dims[-1]], -np.inf, dtype="float32")
            mask = relax.op.concat([mask, _const(pad, dtype)], axis=-1)
        bias = mask
    i_idx = np.arange(q_len).reshape(q_len, 1)
    j_idx = np.arange(kv_len).reshape(1, kv_len)
    offset: np.ndarray | relax.Expr = np.asarray(past_len)
    if nonpad is not None and past_k is None:
        # per batch: offset[b] = nonpad_kv_seqlen[b] - q_len, as [B, 1, 1, 1] against [q_len, kv_len] indices
        offset = relax.op.subtract(relax.op.reshape(relax.op.astype(nonpad, "int64"), (batch, 1, 1, 1)),
                                   relax.const(q_len, "int64"))

    def frontier(allowed_of) -> np.ndarray | relax.Expr:
        """0 where `allowed_of(i + offset - j)` holds, -inf elsewhere (numpy float32 while the offset is
        a constant: 0 and -inf are exact in every float type)."""
        if isinstance(offset, np.ndarray):
            return np.where(allowed_of(i_idx + int(offset) - j_idx), 0.0, -np.inf).astype("float32")
        diff = relax.op.subtract(relax.op.add(relax.const(i_idx.astype("int64"), "int64"), offset),
                                 relax.const(j_idx.astype("int64"), "int64"))
        return relax.op.where(allowed_of(diff), _const(0.0, dtype), _const(-np.inf, dtype))

    def ge(x, bound: int):
        return x >= bound if isinstance(x, np.ndarray) else relax.op.greater_equal(x, relax.const(bound, "int64"))

    def le(x, bound: int):
        return x <= bound if isinstance(x, np.ndarray) else relax.op.less_equal(x, relax.const(bound, "int64"))

    def add(a, b):
        if a is None:
            return b
        if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
            return a + b
        as_expr = [_const(x, dtype) if isinstance(x, np.ndarray) else x for x in (a, b)]
        return relax.op.add(*as_expr)

    if int(attrs.get("is_causal", 0)):
        bias = add(bias, frontier(lambda diff: ge(diff, 0)))             # j <= i + offset
    left, right = int(attrs.get("left_window_size", -1)), int(attrs.get("right_window_size", -1))
    if left >= 0 or right >= 0:
        win = None
        if left >= 0:
            win = add(win, frontier(lambda diff: le(diff, left)))
        if right >= 0:
            win = add(win, frontier(lambda diff: ge(diff, -right)))
        bias = add(bias, win)
    if nonpad is not None:
        seqlen = relax.op.reshape(relax.op.astype(nonpad, "int64"), (batch, 1, 1, 1))
        keep = relax.op.less(relax.const(np.arange(kv_len).reshape(1, 1, 1, kv_len).astype("int64"), "int64"), seqlen)
        bias = add(bias, relax.op.where(keep, _const(0.0, dtype), _const(-np.inf, dtype)))

    if q_heads != kv_heads and kv_heads and q_heads % kv_heads == 0:
        k = relax.op.repeat(k, q_heads // kv_heads, axis=1)
        v = relax.op.repeat(v, q_heads // kv_heads, axis=1)
    scores = relax.op.matmul(relax.op.multiply(q, root),
                             relax.op.multiply(relax.op.permute_dims(k, [0, 1, 3, 2]), root))
    softcap = float(attrs.get("softcap", 0.0) or 0.0)
    if softcap > 0:
        scores = relax.op.multiply(relax.op.tanh(relax.op.divide(scores, _const(softcap, dtype))),
                                   _const(softcap, dtype))
    qk_out = scores
    biased = add(scores, bias) if bias is not None else scores
    mode = int(attrs.get("qk_matmul_output_mode", 0))
    if mode == 2:
        qk_out = biased
    precision = attrs.get("softmax_precision")
    soft_dtype = onnx.helper.tensor_dtype_to_np_dtype(int(precision)).name if precision is not None else dtype
    logits = relax.op.astype(biased, soft_dtype) if soft_dtype != dtype else biased
    probs = relax.op.nn.softmax(logits, axis=-1)
    if soft_dtype != dtype:
        probs = relax.op.astype(probs, dtype)

    masked_rows: relax.Expr | None = None                   # [.., q_len, 1]: no attendable key
    if isinstance(bias, np.ndarray):
        rows = np.isneginf(bias.max(axis=-1, keepdims=True))
        if rows.any():
            masked_rows = relax.const(rows)
    elif bias is not None:
        # max -inf: no attendable key (relax.max starts from -inf: compiler/passes/legalize_fixes.py; a row all
        # finfo.min, as HF writes masks, is attendable)
        masked_rows = relax.op.equal(relax.op.max(bias, axis=-1, keepdims=True), _const(-np.inf, dtype))
    y = relax.op.matmul(probs, v)
    if masked_rows is not None:
        y = relax.op.where(masked_rows, _const(0.0, dtype), y)
    if mode == 3:
        qk_out = probs if masked_rows is None else relax.op.where(masked_rows, _const(0.0, dtype), probs)
    if three_d:
        y = relax.op.reshape(relax.op.permute_dims(y, [0, 2, 1, 3]), (batch, q_len, q_heads * v_dims[3]))
    outputs = [y, present_k, present_v, qk_out]
    wanted = attrs.get("tvm_custom", {}).get("num_outputs", 1)
    return relax.Tuple(outputs[:max(1, wanted)])
