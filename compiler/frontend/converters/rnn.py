"""ONNX's recurrent layers, LSTM, GRU and RNN, which TVM's Relax frontend has no converter for (speech and
OCR exports carry them: CRNN's bidirectional LSTM, DeepSpeech's GRUs).

The sequence is static, so the recurrence is unrolled: the input projection of every time step is one matmul
(`X @ W^T + Wb`, [T, N, G*H]), then per step one small matmul with the recurrent weights and the gate
arithmetic, which FuseOps fuses into the matmul's epilogue. As the ONNX spec and ONNX Runtime compute it:
directions forward, reverse and bidirectional, `layout` 1 (batch first), optional B, initial_h/initial_c,
peepholes P (LSTM), `clip` on every activation's input, `input_forget` (LSTM), `linear_before_reset` (GRU),
the `activations` list with their alpha/beta (consumed, as ORT does, only by the functions that take them),
and `sequence_lens` (steps past a sequence's length leave its state and write 0 to Y; a reverse pass starts
at each sequence's own last step).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tvm import relax

from ...ir.helpers import static_dims

R = relax.op

#: gate count and default activations per op
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_DEFAULT_ACTIVATIONS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}
#: activation -> (uses alpha, uses beta, default alpha, default beta)
_PARAMS = {"Affine": (True, True, 1.0, 0.0), "LeakyRelu": (True, False, 0.01, 0.0),
           "ThresholdedRelu": (True, False, 1.0, 0.0), "ScaledTanh": (True, True, 1.0, 1.0),
           "HardSigmoid": (True, True, 0.2, 0.5), "Elu": (True, False, 1.0, 0.0)}


def _scalar(v: float) -> relax.Expr:
    return relax.const(np.float32(v), "float32")


def _activation(name: str, alpha: float, beta: float) -> Callable[[relax.Expr], relax.Expr]:
    one, zero = _scalar(1.0), _scalar(0.0)
    table: dict[str, Callable[[relax.Expr], relax.Expr]] = {
        "sigmoid": R.sigmoid,
        "tanh": R.tanh,
        "relu": R.nn.relu,
        "affine": lambda x: R.add(R.multiply(x, _scalar(alpha)), _scalar(beta)),
        "leakyrelu": lambda x: R.where(R.less(x, zero), R.multiply(x, _scalar(alpha)), x),
        "thresholdedrelu": lambda x: R.where(R.greater(x, _scalar(alpha)), x, zero),
        "scaledtanh": lambda x: R.multiply(R.tanh(R.multiply(x, _scalar(beta))), _scalar(alpha)),
        "hardsigmoid": lambda x: R.clip(R.add(R.multiply(x, _scalar(alpha)), _scalar(beta)), 0.0, 1.0),
        "elu": lambda x: R.where(R.less(x, zero), R.multiply(R.subtract(R.exp(x), one), _scalar(alpha)), x),
        "softsign": lambda x: R.divide(x, R.add(R.abs(x), one)),
        "softplus": lambda x: R.log(R.add(R.exp(x), one)),
    }
    fn = table.get(name.lower())
    if fn is None:
        raise ValueError(f"activation {name!r} is not one ONNX's recurrent ops define")
    return fn


def _activations(kind: str, attrs: dict, directions: int) -> list[list[Callable[[relax.Expr], relax.Expr]]]:
    """Per direction, the op's activation functions with their parameters."""
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in attrs.get("activations", [])]
    per = len(_DEFAULT_ACTIVATIONS[kind])
    if not names:
        names = _DEFAULT_ACTIVATIONS[kind] * directions
    if len(names) != per * directions:
        raise ValueError(f"{kind}: {len(names)} activations for {directions} direction(s), expected {per * directions}")
    alphas, betas = list(attrs.get("activation_alpha", [])), list(attrs.get("activation_beta", []))
    out = []
    for name in names:
        uses_a, uses_b, da, db = _PARAMS.get(name, (False, False, 0.0, 0.0))
        a = float(alphas.pop(0)) if uses_a and alphas else da
        b = float(betas.pop(0)) if uses_b and betas else db
        out.append(_activation(name, a, b))
    return [out[d * per:(d + 1) * per] for d in range(directions)]


def _opt(inputs: list, i: int) -> relax.Expr | None:
    return inputs[i] if len(inputs) > i and inputs[i] is not None else None


def _split(x: relax.Expr, parts: int) -> list[relax.Expr]:
    """`x` [..., parts * H] into `parts` tensors along the last axis."""
    tup = R.split(x, parts, axis=-1)
    return [relax.TupleGetItem(tup, k) for k in range(parts)]


def convert(kind: str) -> Callable[[relax.BlockBuilder, list, dict], relax.Expr]:
    def run(bb: relax.BlockBuilder, inputs: list, attrs: dict) -> relax.Expr:
        return _recurrent(bb, kind, inputs, attrs)
    return run


def _recurrent(bb: relax.BlockBuilder, kind: str, inputs: list, attrs: dict) -> relax.Expr:
    x, w, r = inputs[:3]
    bias, seq_lens = _opt(inputs, 3), _opt(inputs, 4)
    h0, c0 = _opt(inputs, 5), _opt(inputs, 6)
    peep = _opt(inputs, 7) if kind == "LSTM" else None
    layout = int(attrs.get("layout", 0))
    if layout:
        x = bb.normalize(R.permute_dims(x, [1, 0, 2]))
        h0 = bb.normalize(R.permute_dims(h0, [1, 0, 2])) if h0 is not None else None
        c0 = bb.normalize(R.permute_dims(c0, [1, 0, 2])) if c0 is not None else None
    xdims, wdims = static_dims(x), static_dims(w)
    if xdims is None or wdims is None or len(xdims) != 3:
        raise ValueError(f"{kind} needs an input of static shape [seq, batch, input]")
    steps, batch, _ = xdims
    directions = wdims[0]
    gates = _GATES[kind]
    hidden = int(attrs.get("hidden_size", wdims[1] // gates))
    direction = attrs.get("direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else str(direction)
    if (direction == "bidirectional") != (directions == 2):
        raise ValueError(f"{kind}: direction {direction} with {directions} weight set(s)")
    clip = float(attrs["clip"]) if "clip" in attrs else None
    acts = _activations(kind, attrs, directions)
    input_forget = bool(int(attrs.get("input_forget", 0)))
    linear_before_reset = bool(int(attrs.get("linear_before_reset", 0)))

    def clipped(v: relax.Expr) -> relax.Expr:
        return R.clip(v, -clip, clip) if clip is not None else v

    zeros = relax.const(np.zeros((batch, hidden), np.float32), "float32")
    valid_at: Callable[[int], relax.Expr] | None = None
    within: relax.Expr | None = None
    if seq_lens is not None:
        lens = bb.normalize(R.reshape(R.astype(seq_lens, "int64"), [batch, 1]))
        valid_at = lambda t: R.greater(lens, relax.const(t, "int64"))  # noqa: E731
        # a reverse pass runs each sequence backwards from its own last step: time index t of sequence b
        # reads step len_b - 1 - t (t < len_b); the permutation is its own inverse, so Y goes back through it
        t_idx = relax.const(np.arange(steps, dtype=np.int64).reshape(steps, 1), "int64")
        lens_row = bb.normalize(R.reshape(lens, [1, batch]))
        within = bb.normalize(R.where(R.less(t_idx, lens_row),
                                      R.subtract(R.subtract(lens_row, relax.const(1, "int64")), t_idx),
                                      R.broadcast_to(t_idx, [steps, batch])))                    # [T, N]

    def per_sequence_reverse(v: relax.Expr, width: int) -> relax.Expr:
        idx = R.broadcast_to(R.expand_dims(within, [2]), [steps, batch, width])
        return bb.normalize(R.gather_elements(v, idx, axis=0))

    ys, last_h, last_c = [], [], []
    for d in range(directions):
        wd = bb.normalize(R.permute_dims(R.take(w, relax.const(d, "int64"), axis=0), [1, 0]))    # [I, G*H]
        rd = bb.normalize(R.permute_dims(R.take(r, relax.const(d, "int64"), axis=0), [1, 0]))    # [H, G*H]
        proj = R.matmul(x, wd)                                                                    # [T, N, G*H]
        wb = rb = None
        if bias is not None:
            bd = bb.normalize(R.take(bias, relax.const(d, "int64"), axis=0))
            wb = R.strided_slice(bd, [0], [0], [gates * hidden])
            rb = bb.normalize(R.strided_slice(bd, [0], [gates * hidden], [2 * gates * hidden]))
            proj = R.add(proj, wb)
        proj = bb.normalize(proj)
        h = bb.normalize(R.take(h0, relax.const(d, "int64"), axis=0)) if h0 is not None else zeros
        c = bb.normalize(R.take(c0, relax.const(d, "int64"), axis=0)) if c0 is not None else zeros
        p_i = p_o = p_f = None
        if peep is not None:
            p_i, p_o, p_f = (bb.normalize(t) for t in _split(R.take(peep, relax.const(d, "int64"), axis=0), 3))
        f_act = acts[d][0]
        backwards = direction == "reverse" or (direction == "bidirectional" and d == 1)
        if backwards and within is not None:
            proj, order = per_sequence_reverse(proj, gates * hidden), range(steps)
        else:
            order = range(steps - 1, -1, -1) if backwards else range(steps)
        outs: dict[int, relax.Expr] = {}
        for t in order:
            xt = R.take(proj, relax.const(t, "int64"), axis=0)                                    # [N, G*H]
            if kind == "LSTM":
                g_act, h_act = acts[d][1], acts[d][2]
                pre = R.add(xt, R.matmul(h, rd))
                if rb is not None:
                    pre = R.add(pre, rb)
                gi, go, gf, gc = _split(bb.normalize(pre), 4)
                i = f_act(clipped(R.add(gi, R.multiply(p_i, c)) if p_i is not None else gi))
                f = R.subtract(_scalar(1.0), i) if input_forget else \
                    f_act(clipped(R.add(gf, R.multiply(p_f, c)) if p_f is not None else gf))
                new_c = bb.normalize(R.add(R.multiply(f, c), R.multiply(i, g_act(clipped(gc)))))
                o = f_act(clipped(R.add(go, R.multiply(p_o, new_c)) if p_o is not None else go))
                new_h = R.multiply(o, h_act(new_c))
            elif kind == "GRU":
                g_act = acts[d][1]
                xz, xr, xh = _split(xt, 3)
                rz, rr, rh = _split(bb.normalize(R.matmul(h, rd)), 3)
                if rb is not None:
                    bz, br, bh = _split(rb, 3)
                    rz, rr = R.add(rz, bz), R.add(rr, br)
                z = f_act(clipped(R.add(xz, rz)))
                rg = f_act(clipped(R.add(xr, rr)))
                if linear_before_reset:
                    rec = R.multiply(rg, R.add(rh, bh) if rb is not None else rh)
                else:
                    rh_w = bb.normalize(R.strided_slice(rd, [1], [2 * hidden], [3 * hidden]))
                    rec = R.matmul(R.multiply(rg, h), rh_w)
                    if rb is not None:
                        rec = R.add(rec, bh)
                cand = g_act(clipped(R.add(xh, rec)))
                new_h = R.add(R.multiply(R.subtract(_scalar(1.0), z), cand), R.multiply(z, h))
                new_c = c
            else:
                pre = R.add(xt, R.matmul(h, rd))
                new_h = f_act(clipped(R.add(pre, rb) if rb is not None else pre))
                new_c = c
            new_h = bb.normalize(new_h)
            if valid_at is not None:
                valid = bb.normalize(valid_at(t))
                outs[t] = bb.normalize(R.where(valid, new_h, zeros))
                h = bb.normalize(R.where(valid, new_h, h))
                c = bb.normalize(R.where(valid, new_c, c)) if kind == "LSTM" else c
            else:
                outs[t], h, c = new_h, new_h, bb.normalize(new_c)
        y_d = bb.normalize(R.stack([outs[t] for t in range(steps)], axis=0))                      # [T, N, H]
        ys.append(per_sequence_reverse(y_d, hidden) if backwards and within is not None else y_d)
        last_h.append(h)
        last_c.append(c)
    y = R.stack(ys, axis=1)                                                                        # [T, D, N, H]
    y_h, y_c = R.stack(last_h, axis=0), R.stack(last_c, axis=0)                                   # [D, N, H]
    if layout:
        y, y_h, y_c = R.permute_dims(y, [2, 0, 1, 3]), R.permute_dims(y_h, [1, 0, 2]), R.permute_dims(y_c, [1, 0, 2])
    outputs = [y, y_h, y_c] if kind == "LSTM" else [y, y_h]
    count = attrs.get("tvm_custom", {}).get("num_outputs", len(outputs))
    return relax.Tuple(outputs[:max(count, 1)])


CONVERTERS: dict[str, Callable[[relax.BlockBuilder, list, dict], relax.Expr]] = {
    kind: convert(kind) for kind in ("LSTM", "GRU", "RNN")}
