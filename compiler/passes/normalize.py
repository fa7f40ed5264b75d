"""fuseguard's own graph passes of pipeline steps 1 and 2: exporter forms normalised, constant moves and
BatchNorm folded (the stock TVM passes are used directly in pipeline.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax

from ..ir.helpers import (
    const_values,
    is_constant,
    numpy_of,
    same_dims,
    shape_dims,
    static_dims,
    tensor_dtype,
)
from ..ir.rewrite import each_relax_function, rebind, recognize


@relax.expr_functor.mutator
class _BatchNormFolder(relax.PyExprMutator):
    """Rewrites `conv2d(x, W) [+ b] -> batch_norm -> [0]` into `conv2d(x, W*s) + ((b - mean)*s + beta)`.

    A binding-level mutator rather than a pattern rewrite so the new bindings keep the provenance names
    of the nodes they replace (the conv keeps the Conv's, the bias add takes the BatchNorm's).
    """

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.values: dict[relax.Var, relax.Expr] = {}

    def _lookup(self, expr: relax.Expr) -> relax.Expr | None:
        return self.values.get(expr) if isinstance(expr, relax.Var) else None

    def _match(self, item: relax.Expr):
        if not (isinstance(item, relax.TupleGetItem) and item.index == 0):
            return None
        bn = self._lookup(item.tuple_value) if isinstance(item.tuple_value, relax.Var) else item.tuple_value
        if not (isinstance(bn, relax.Call) and isinstance(bn.op, tvm.ir.Op) and bn.op.name == "relax.nn.batch_norm"):
            return None
        if int(bn.attrs.axis) != 1 or not all(is_constant(a) for a in bn.args[1:5]):
            return None
        pre_var = bn.args[0]
        pre = self._lookup(pre_var)
        bias = None
        conv_var = pre_var
        if isinstance(pre, relax.Call) and pre.op.name == "relax.add" and is_constant(pre.args[1]):
            bias, conv_var = pre.args[1], pre.args[0]
            pre = self._lookup(conv_var)
        if not (isinstance(pre, relax.Call) and isinstance(pre.op, tvm.ir.Op) and pre.op.name == "relax.nn.conv2d"):
            return None
        if pre.attrs.kernel_layout != "OIHW" or pre.attrs.data_layout != "NCHW" or not is_constant(pre.args[1]):
            return None
        return bn, pre, conv_var, bias

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.values[binding.var] = binding.value
        found = self._match(binding.value)
        if found is None:
            super().visit_var_binding_(binding)
            return
        bn, conv, conv_var, bias = found
        w = numpy_of(conv.args[1])
        gamma, beta, mean, var = (numpy_of(a) for a in bn.args[1:5])
        scale = gamma / np.sqrt(var + float(bn.attrs.epsilon))
        b = numpy_of(bias).reshape(-1) if bias is not None else np.zeros_like(mean)
        if b.shape != mean.shape or w.shape[0] != mean.shape[0]:
            super().visit_var_binding_(binding)
            return
        new_w = (w * scale.reshape(-1, *([1] * (w.ndim - 1)))).astype(w.dtype)
        new_b = ((b - mean) * scale + beta).astype(w.dtype).reshape(1, -1, *([1] * (w.ndim - 2)))
        data = self.visit_expr(conv.args[0])
        new_conv = self.builder_.emit(relax.Call(conv.op, [data, relax.const(new_w)], conv.attrs),
                                      conv_var.name)
        folded = self.builder_.emit(relax.op.add(new_conv, relax.const(new_b)), binding.var.name)
        self.set_var_remap(binding.var, folded)


def _index_value(expr: object, env: dict) -> object:
    """An index map's output index over numpy index grids (Var, IntImm, +, -, *, floordiv, floormod)."""
    if isinstance(expr, tvm.tirx.Var):
        return env[expr]
    if isinstance(expr, tvm.tirx.IntImm):
        return int(expr.value)
    ops = {tvm.tirx.Add: np.add, tvm.tirx.Sub: np.subtract, tvm.tirx.Mul: np.multiply,
           tvm.tirx.FloorDiv: np.floor_divide, tvm.tirx.FloorMod: np.mod}
    for kind, fn in ops.items():
        if isinstance(expr, kind):
            return fn(_index_value(expr.a, env), _index_value(expr.b, env))
    raise ValueError(f"index expression {expr!r}")


def _moved(call: relax.Call) -> np.ndarray | None:
    """The value of a reshape / permute_dims / layout_transform of a constant, computed in numpy; None for
    any other call or form."""
    src = numpy_of(call.args[0])
    dims = static_dims(call)
    if dims is None:
        return None
    name = call.op.name
    if name == "relax.reshape":
        return src.reshape(dims)
    if name == "relax.permute_dims":
        axes = call.attrs.axes
        return np.ascontiguousarray(np.transpose(src, None if axes is None else [int(a) for a in axes]))
    if name == "relax.layout_transform":
        index_map = call.attrs.index_map
        if len(index_map.initial_indices) != src.ndim:
            return None
        try:
            env = dict(zip(index_map.initial_indices, np.indices(src.shape, sparse=True)))
            dst = [np.broadcast_to(_index_value(e, env), src.shape) for e in index_map.final_indices]
        except ValueError:
            return None
        pad = call.attrs.pad_value
        out = np.full(dims, float(pad.value) if pad is not None else 0.0, dtype=src.dtype)
        out[tuple(dst)] = src
        return out
    return None


@relax.expr_functor.mutator
class _ConstantMoveFolder(relax.PyExprMutator):
    """A call-level mutator, not rewrite_call: that one also canonicalised bindings and left a DataflowVar as
    a dataflow block's output (ill-formed: codegen failed on a conv -> BatchNorm graph)."""

    _MOVES = ("relax.reshape", "relax.permute_dims", "relax.layout_transform")

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 - visitor API
        call = super().visit_call_(call)
        if isinstance(call.op, tvm.ir.Op) and call.op.name in self._MOVES and is_constant(call.args[0]):
            value = _moved(call)
            if value is not None:
                return relax.const(value)
        return call


@tvm.transform.module_pass(opt_level=0, name="FoldConstantMoves")
def FoldConstantMoves(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:  # noqa: N802
    """Reshapes, transposes and layout transforms of constants folded in numpy before FoldConstant, which
    builds and runs a TIR kernel for each: SqueezeNet's 26 bias reshapes took 0.97 s of a 2.4 s compile, and
    the layout step's packed weights 2.3 s more (Zen5)."""
    folder = _ConstantMoveFolder(mod)
    return each_relax_function(mod, folder.visit_expr)


@tvm.transform.module_pass(opt_level=0, name="FoldBatchNorm")
def FoldBatchNorm(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:  # noqa: N802 - TVM pass style
    """Fold inference BatchNorm into the preceding Conv2d (with or without bias); DCE removes the originals."""
    folder = _BatchNormFolder(mod)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and not (func.attrs and "Primitive" in func.attrs):
            folder.builder_.update_func(gv, folder.visit_expr(func))
    return folder.builder_.get()


# ------------------------------------------------------------------------ normalising exporter forms


@tvm.transform.module_pass(opt_level=0, name="NormalizeFlattenedGemm")
def NormalizeFlattenedGemm(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:  # noqa: N802
    """reshape(matmul(reshape(x, [M, K]), W) (+ b), x.shape[:-1] + [N]) -> matmul(x, W) (+ b).

    GPT-2's Conv1D (`addmm` on `x.view(-1, nx)`) and ONNX Runtime's MatMulAddFusion both flatten a 3-D
    activation around a Gemm; the reshape between the bias and the activation hides MatMul + bias + GELU
    from the pattern table. The rewrite is exact: a row-major flatten and unflatten of the same rows.
    The new bindings keep the ONNX nodes they stand for in their names (a `rewrite_call` here named the
    matmul `lv3`: the profile then lost GPT-2's MLP matmul from the unfused parts, a phantom 4x slowdown).
    """
    from tvm.relax.dpl import is_const, is_op, wildcard

    x, weight, bias = wildcard(), is_const(), is_const()
    flat = is_op("relax.reshape")(x, wildcard())
    mm = is_op("relax.matmul")(flat, weight)
    biased = is_op("relax.add")(mm, bias) | is_op("relax.add")(bias, mm)
    pattern = is_op("relax.reshape")(biased, wildcard()) | is_op("relax.reshape")(mm, wildcard())

    def rewrite(m: dict) -> relax.Expr | None:
        expr = m[pattern]
        src, res = shape_dims(m[x]), shape_dims(expr)     # symbolic batch/seq too (dynamic builds)
        w = static_dims(m[weight])
        if src is None or res is None or w is None or len(w) != 2 or len(src) < 3 or len(res) != len(src):
            return None
        if not (same_dims(res[:-1], src[:-1]) and same_dims(src[-1:], [w[0]]) and same_dims(res[-1:], [w[1]])):
            return None
        out = relax.op.matmul(m[x], m[weight])
        if bias in m:
            b = static_dims(m[bias])
            if b is None or (b and b[:-1] and any(d != 1 for d in b[:-1])):
                return None
            out = relax.op.add(out, m[bias])
        return out

    return recognize(mod, pattern, rewrite, "Gemm")[0]


@tvm.transform.module_pass(opt_level=0, name="ExpandSmallPowers")
def ExpandSmallPowers(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:  # noqa: N802
    """power(x, 2) -> x * x and power(x, 3) -> x * (x * x), for float tensors.

    LLVM lowers `powf` inside a vectorised loop to one scalar libm call per lane: GPT-2's tanh GELU
    (`0.044715 * x^3`) fused into the MLP matmul's epilogue made that kernel 76 us slower than its
    unfused parts (benchmarks/regret.py, Zen4). Two multiplies are vector instructions and exact to
    within an ulp of powf; the patterns accept both spellings. (x^0.5, 0.25, 0.75, 1.5 become square roots
    inside their own kernel: `legalize_fixes`, no intermediate tensors for an unfused build to plan.)
    """
    from tvm.relax.dpl import is_const, is_op, wildcard

    x, c = wildcard(), is_const()
    pattern = is_op("relax.power")(x, c)

    def rewrite(m: dict) -> relax.Expr | None:
        ty = m[x].ty
        if not isinstance(ty, relax.TensorType) or not str(ty.dtype).startswith("float"):
            return None
        exponent = np.asarray(numpy_of(m[c]))
        if exponent.size != 1 or float(exponent.reshape(())) not in (2.0, 3.0):
            return None
        square = relax.op.multiply(m[x], m[x])
        return square if float(exponent.reshape(())) == 2.0 else relax.op.multiply(m[x], square)

    return recognize(mod, pattern, rewrite, "Pow")[0]


#: A fill at or below this is a mask value: x + fill == fill exactly for |x| < ulp(fill) / 2 (3.8e22 at -1e30;
#: 1e31 at float32's lowest, HF's and torch's masked_fill value; any finite x at -inf).
MASK_FILL_AT_MOST = -1e30


@tvm.transform.module_pass(opt_level=0, name="MaskedFillAsAdd")
def MaskedFillAsAdd(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:  # noqa: N802
    """softmax(where(c, x, fill) [+ m]) -> softmax(x + where(c, 0, fill) [+ m]) for a float32 fill <=
    MASK_FILL_AT_MOST, either branch (`masked_fill` exports where(c, fill, x)).

    GPT-Neo's causal mask (and hand-written `masked_fill` attention) selects instead of adding, which the
    attention pattern (an additive mask) cannot match. The sum equals the select bit for bit for every
    score below 1e22 in magnitude; a constant condition becomes a constant mask. A select between constants
    (BLOOM's where(c, 0, lowest)) is such a mask already.
    """
    from tvm.relax.dpl import is_const, is_op, wildcard

    cond, score, fill = wildcard(), wildcard(), is_const()
    cond2, score2, fill2 = wildcard(), wildcard(), is_const()
    keep = is_op("relax.where")(cond, score, fill)          # the score where cond holds
    drop = is_op("relax.where")(cond2, fill2, score2)       # masked_fill: the fill where cond holds
    picked = keep | drop
    other = wildcard()
    added = is_op("relax.add")(picked, other) | is_op("relax.add")(other, picked)
    root = is_op("relax.nn.softmax")(picked | added)

    def rewrite(m: dict) -> relax.Expr | None:
        c, x, f, fill_where_true = (m[cond], m[score], m[fill], False) if keep in m else \
            (m[cond2], m[score2], m[fill2], True)
        values = numpy_of(f)
        if is_constant(x) or tensor_dtype(x) != "float32" or values.size != 1 \
                or not values.reshape(()) <= MASK_FILL_AT_MOST:
            return None
        lowest, zero = np.float32(values.reshape(())), np.float32(0)
        where_true, where_false = (lowest, zero) if fill_where_true else (zero, lowest)
        if (cv := const_values(c)) is not None:
            mask: relax.Expr = relax.const(np.where(cv, where_true, where_false).astype("float32"))
        else:
            mask = relax.op.where(c, relax.const(where_true), relax.const(where_false))
        inner = relax.op.add(x, mask)
        if other in m:
            inner = relax.op.add(inner, m[other])
        sm = m[root]
        return relax.Call(sm.op, [inner], sm.attrs, sm.ty_args)

    return recognize(mod, root, rewrite, "Softmax")[0]


@tvm.transform.module_pass(opt_level=0, name="UnflattenScores")
def UnflattenScores(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:  # noqa: N802
    """reshape(f(matmul(q, kt)), [B, H, Sq, Sk]) over [B*H, ...] operands -> f(matmul(q', kt')) in 4-D, f up to
    two elementwise ops with a constant or a [B*H | 1, ...] operand (reshaped alike).

    BLOOM scores heads flattened into the batch (`baddbmm(alibi, q, k^T)`) and splits them before adding the
    mask: the 4-D attention pattern then sees a reshape where the scores' matmul should be. Splitting the
    leading dim first is the same arithmetic in the same order. The probabilities' matmul with V, flattened
    the same way, is split alike; the reshape pairs left around the softmax then cancel."""
    from tvm.relax.dpl import is_op, wildcard

    q, kt = wildcard(), wildcard()
    scores = is_op("relax.matmul")(q, kt)
    operands = (wildcard(), wildcard())

    def elementwise(x, operand):  # noqa: ANN001, ANN202 - DFPatterns
        return (is_op("relax.add")(x, operand) | is_op("relax.add")(operand, x) | is_op("relax.multiply")(x, operand)
                | is_op("relax.multiply")(operand, x) | is_op("relax.divide")(x, operand)
                | is_op("relax.subtract")(x, operand))

    one = elementwise(scores, operands[0])
    two = elementwise(one, operands[1])
    root = is_op("relax.reshape")(scores | one | two, wildcard())

    def split(expr: relax.Expr, batch: int, heads: int) -> relax.Expr | None:
        dims = static_dims(expr)
        if dims is not None and len(dims) == 3 and dims[0] == batch * heads:
            return relax.op.reshape(expr, [batch, heads, *dims[1:]])
        if is_constant(expr) and numpy_of(expr).size == 1:
            return expr
        return expr if dims is not None and (len(dims) < 3 or dims[0] == 1) else None  # the same in 3-D and 4-D

    def rewrite(m: dict) -> relax.Expr | None:
        out, flat = static_dims(m[root]), static_dims(m[scores])
        if out is None or flat is None or len(out) != 4 or len(flat) != 3 or out[0] * out[1] != flat[0] \
                or out[2:] != flat[1:]:
            return None
        batch, heads = out[0], out[1]
        q4, kt4 = split(m[q], batch, heads), split(m[kt], batch, heads)
        if q4 is None or q4 is m[q] or kt4 is None or kt4 is m[kt]:      # both [B*H, ...], split
            return None
        x: relax.Expr = relax.op.matmul(q4, kt4, m[scores].attrs.out_dtype)
        for node, operand in ((one, operands[0]), (two, operands[1])):
            if node not in m:
                break
            other = split(m[operand], batch, heads)
            if other is None:
                return None
            call = m[node]      # add and multiply commute exactly; divide and subtract have the scores first
            x = relax.Call(call.op, [x, other], call.attrs, call.ty_args)
        return x

    # Only where a split was made, so every other model keeps its reshapes as they were before this pass. TVM's
    # RemoveRedundantReshape segfaulted on MobileBERT's dynamic export while the importer match-cast its
    # trigram embedding; with the reshape it uses now (importer._settle) it runs there without a crash.
    out, rewritten = recognize(mod, root, rewrite, "Reshape")
    return relax.transform.RemoveRedundantReshape()(out) if rewritten else out


#: FoldReshapedAdd materialises the constant at the tensor's full size before shrinking it: at most this many
#: elements (Swin-T's shifted-window mask, 64 x 3 x 49 x 49 = 461k, is the largest met).
RESHAPED_ADD_MAX_ELEMENTS = 1 << 24


@tvm.transform.module_pass(opt_level=0, name="FoldReshapedAdd")
def FoldReshapedAdd(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:  # noqa: N802
    """reshape(reshape(x, s) + c, shape(x)) -> x + c' for a constant c, c' = c broadcast to s, reshaped back and
    shrunk to size 1 along every axis it is constant on.

    Swin's shifted windows add their mask as `view(B, nW, heads, N, N) + mask; view(-1, heads, N, N)`: the
    reshapes around the add hide it from the attention pattern (5 of Swin-T's 12 blocks). The add is the same
    element for element."""
    from tvm.relax.dpl import is_const, is_op, wildcard

    x, c = wildcard(), is_const()
    inner = is_op("relax.reshape")(x, wildcard())
    added = is_op("relax.add")(inner, c) | is_op("relax.add")(c, inner)
    root = is_op("relax.reshape")(added, wildcard())

    def rewrite(m: dict) -> relax.Expr | None:
        x_dims, out_dims, mid_dims = static_dims(m[x]), static_dims(m[root]), static_dims(m[inner])
        if x_dims is None or x_dims != out_dims or mid_dims is None or static_dims(m[added]) != mid_dims \
                or int(np.prod(x_dims)) > RESHAPED_ADD_MAX_ELEMENTS:
            return None
        full = np.broadcast_to(numpy_of(m[c]), mid_dims).reshape(x_dims)
        for axis in range(full.ndim):
            first = full.take([0], axis=axis)
            if np.array_equal(full, np.broadcast_to(first, full.shape)):
                full = first
        return relax.op.add(m[x], relax.const(np.ascontiguousarray(full)))

    return recognize(mod, root, rewrite, "Add")[0]


def _out_dtype(attrs) -> str | None:  # noqa: ANN001 - a conv's attrs
    """A conv's explicit output dtype, or None for "the input's"."""
    return str(attrs.out_dtype) if str(attrs.out_dtype) not in ("", "void", "None") else None


def _rewrite_convs(mod: tvm.IRModule, op: str, layouts: tuple[str, ...],
                   rewrite: Callable[[relax.Call, relax.Expr, relax.Expr], relax.Expr | None]) -> tvm.IRModule:
    """Every `op(x, w)` whose (data, kernel[, output]) layouts are `layouts` through `rewrite(call, x, w)`; a
    None keeps the call."""
    from tvm.relax.dpl import is_op, wildcard

    x, weight = wildcard(), wildcard()
    pattern = is_op(op)(x, weight)

    def checked(m: dict) -> relax.Expr | None:
        a = m[pattern].attrs
        if (a.data_layout, a.kernel_layout, a.out_layout)[:len(layouts)] != layouts:
            return None
        return rewrite(m[pattern], m[x], m[weight])

    return recognize(mod, pattern, checked, "Conv")[0]


@tvm.transform.module_pass(opt_level=0, name="Conv1dAsConv2d")
def Conv1dAsConv2d(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:  # noqa: N802
    """conv1d(x, w) -> squeeze(conv2d(x[:, :, None], w[:, :, None]), 2): a height-1 conv2d, exact.

    No CPU rule schedules conv1d: the audio front ends of real exports (Wav2Vec2's seven feature convs,
    Whisper's two) ran at ~2 GFLOP/s, Wav2Vec2 30x ONNX Runtime (Sapphire Rapids). As conv2d they take the
    conv kernels, the conv patterns and the layout step.
    """
    def rewrite(call: relax.Call, x: relax.Expr, weight: relax.Expr) -> relax.Expr | None:
        attrs = call.attrs
        if static_dims(weight) is None or len(shape_dims(x) or []) != 3:
            return None
        (stride,), (dilation,) = attrs.strides, attrs.dilation
        left, right = attrs.padding
        conv = relax.op.nn.conv2d(relax.op.expand_dims(x, [2]), relax.op.expand_dims(weight, [2]),
                                  strides=(1, int(stride)), padding=(0, int(left), 0, int(right)),
                                  dilation=(1, int(dilation)), groups=int(attrs.groups), out_dtype=_out_dtype(attrs))
        return relax.op.squeeze(conv, [2])

    return _rewrite_convs(mod, "relax.nn.conv1d", ("NCW", "OIW", "NCW"), rewrite)


@tvm.transform.module_pass(opt_level=0, name="Conv3dAsConv2d")
def Conv3dAsConv2d(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:  # noqa: N802
    """conv3d -> one conv2d per temporal tap, over the frames as a batch, summed: exact up to summation order.

    ``y[:, :, t] = sum_k conv2d(x[:, :, t * st + k * dt], w[:, :, k])``: the (padded) input viewed as
    [N, D, C, H, W], each tap a strided slice of its frames reshaped to [N * D_out, C, H, W]. No CPU rule
    schedules conv3d: torchvision's R3D-18 (1x3x8x112x112) ran one process of `fuseguard bench` for over
    five minutes, TVM's generic loops at a few GFLOP/s (Sapphire Rapids). As conv2d the taps take the conv
    kernels, the conv patterns (a tap's sum is a residual add) and the layout step. Static shapes, constant
    weights and the NCDHW layout only; anything else keeps conv3d.
    """
    def rewrite(call: relax.Call, x: relax.Expr, weight: relax.Expr) -> relax.Expr | None:
        attrs = call.attrs
        dims, wdims, out = static_dims(x), static_dims(weight), static_dims(call)
        if dims is None or len(dims) != 5 or wdims is None or out is None or not is_constant(weight):
            return None
        n, c, d, h, w_ = dims
        kd = wdims[2]
        st, sh, sw = (int(v) for v in attrs.strides)
        dd, dh, dw = (int(v) for v in attrs.dilation)
        front, top, left, back, bottom, right = (int(v) for v in attrs.padding)
        d_out = (d + front + back - dd * (kd - 1) - 1) // st + 1
        if d_out < 1:
            return None
        data = x
        if front or back:
            data = relax.op.nn.pad(data, [0, 0, 0, 0, front, back, 0, 0, 0, 0])
        frames = relax.op.permute_dims(data, [0, 2, 1, 3, 4])                    # [N, D, C, H, W]
        w_np = numpy_of(weight)
        total = None
        for k in range(kd):
            taps = relax.op.strided_slice(frames, axes=[1], begin=[k * dd], end=[k * dd + (d_out - 1) * st + 1],
                                          strides=[st])
            conv = relax.op.nn.conv2d(relax.op.reshape(taps, (n * d_out, c, h, w_)),
                                      relax.const(np.ascontiguousarray(w_np[:, :, k]), str(w_np.dtype)),
                                      strides=(sh, sw), padding=(top, left, bottom, right), dilation=(dh, dw),
                                      groups=int(attrs.groups), out_dtype=_out_dtype(attrs))
            total = conv if total is None else relax.op.add(total, conv)
        return relax.op.permute_dims(relax.op.reshape(total, (n, d_out, out[1], out[3], out[4])), [0, 2, 1, 3, 4])

    return _rewrite_convs(mod, "relax.nn.conv3d", ("NCDHW", "OIDHW", "NCDHW"), rewrite)


def _live_taps(size: int, out: int, stride: int, dilation: int, pad: int, kernel: int) -> tuple[int, int] | None:
    """The first and last kernel taps along one axis that read the input for some output, or None if none."""
    live = [k for k in range(kernel)
            if any(0 <= o * stride + k * dilation - pad < size for o in range(out))]
    return (live[0], live[-1]) if live else None


@tvm.transform.module_pass(opt_level=0, name="DropPaddingTaps")
def DropPaddingTaps(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:  # noqa: N802
    """A conv's kernel rows/columns that read only zero padding, for every output, are cut off: exact (a
    product with a padded zero is 0; finite weights only, as 0 * inf is not).

    DeepLabV3's ASPP dilates its 3x3 convs by 24 and 36 on a 14x14 feature map: every off-centre tap lands in
    the padding, so each is a 1x1 conv computed nine times over (torchvision deeplabv3_mobilenet_v3_large,
    960 -> 256 channels: 7.1 and 8.3 ms of a 30.7 ms model, ORT 12.5 ms for all of it; Sapphire Rapids).
    """
    def rewrite(call: relax.Call, x: relax.Expr, weight: relax.Expr) -> relax.Expr | None:
        attrs = call.attrs
        if not is_constant(weight):
            return None
        dims, wdims, out = static_dims(x), static_dims(weight), static_dims(call)
        if dims is None or wdims is None or out is None or len(dims) != 4:
            return None
        (sh, sw), (dh, dw) = (int(v) for v in attrs.strides), (int(v) for v in attrs.dilation)
        top, left, bottom, right = (int(v) for v in attrs.padding)
        rows = _live_taps(dims[2], out[2], sh, dh, top, wdims[2])
        cols = _live_taps(dims[3], out[3], sw, dw, left, wdims[3])
        if rows is None or cols is None or (rows == (0, wdims[2] - 1) and cols == (0, wdims[3] - 1)):
            return None
        w_np = numpy_of(weight)
        if not np.isfinite(w_np).all():
            return None
        # the new padding keeps every output where it was: a negative leading one would need the input cropped
        # (skipped); a trailing one only drops rows no output reads, so it is 0 if the output size stays
        new_top, new_left = top - rows[0] * dh, left - cols[0] * dw
        kh, kw = rows[1] - rows[0] + 1, cols[1] - cols[0] + 1
        new_bottom = max(0, (out[2] - 1) * sh + dh * (kh - 1) + 1 - dims[2] - new_top)
        new_right = max(0, (out[3] - 1) * sw + dw * (kw - 1) + 1 - dims[3] - new_left)
        if min(new_top, new_left) < 0 or \
                (dims[2] + new_top + new_bottom - dh * (kh - 1) - 1) // sh + 1 != out[2] or \
                (dims[3] + new_left + new_right - dw * (kw - 1) - 1) // sw + 1 != out[3]:
            return None
        cut = np.ascontiguousarray(w_np[:, :, rows[0]:rows[1] + 1, cols[0]:cols[1] + 1])
        return relax.op.nn.conv2d(x, relax.const(cut, str(w_np.dtype)), strides=(sh, sw),
                                  padding=(new_top, new_left, new_bottom, new_right),
                                  dilation=(dh if kh > 1 else 1, dw if kw > 1 else 1), groups=int(attrs.groups),
                                  data_layout="NCHW", kernel_layout="OIHW", out_layout=str(attrs.out_layout),
                                  out_dtype=_out_dtype(attrs))

    return _rewrite_convs(mod, "relax.nn.conv2d", ("NCHW", "OIHW"), rewrite)


#: Elementwise ops a height-1 conv's output may pass through and stay 4-D (GELU as exporters write it:
#: divide, erf, add, multiply; ReLU; SiLU; ...).
_UNARY_EW = frozenset({"relax.erf", "relax.tanh", "relax.sigmoid", "relax.exp", "relax.sqrt", "relax.negative",
                       "relax.abs", "relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.silu",
                       "relax.clip"})
_BINARY_EW = frozenset({"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.power",
                        "relax.maximum", "relax.minimum"})


def _scalar_constant(expr: relax.Expr) -> bool:
    """A constant operand that broadcasts the same in 3-D and 4-D: one element, or a PrimValue (no tensor
    type: clip's bounds)."""
    if not isinstance(expr, tvm.ir.Constant):
        return False
    dims = static_dims(expr)
    return dims is None or all(d == 1 for d in dims)


@relax.expr_functor.mutator
class _KeepHeightOne(relax.PyExprMutator):
    """`expand_dims(f(squeeze(y, 2)), 2)` -> `f(y)` for elementwise `f` with scalar constants (below)."""

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.four_d: dict[relax.Var, relax.Var] = {}     # 3-D var -> the 4-D var it is squeeze(., 2) of

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        op = value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else ""
        args = list(value.args) if op else []
        if op == "relax.squeeze" and [int(a) for a in (value.attrs.axis or [])] == [2] \
                and (static_dims(args[0]) or [0, 0, 0])[2:3] == [1]:
            super().visit_var_binding_(binding)
            self.four_d[binding.var] = self.visit_expr(args[0])
            return
        if op == "relax.expand_dims" and [int(a) for a in value.attrs.axis] == [2] and args[0] in self.four_d \
                and isinstance(binding.var, relax.DataflowVar):
            self.set_var_remap(binding.var, self.four_d[args[0]])
            return
        lifted = [self.four_d.get(a) for a in args]
        if (op in _UNARY_EW or op in _BINARY_EW) and any(w is not None for w in lifted) \
                and all(w is not None or _scalar_constant(a) for a, w in zip(args, lifted)):
            wide = self.builder_.emit(relax.Call(value.op, [w if w is not None else a for a, w in zip(args, lifted)],
                                                 value.attrs, value.ty_args), binding.var.name)
            narrow = relax.op.squeeze(wide, [2])
            rebind(self, binding.var, narrow)
            self.four_d[binding.var] = wide
            return
        super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="KeepConv1dChains4D")
def KeepConv1dChains4D(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:  # noqa: N802
    """Between two height-1 convs (Conv1dAsConv2d), the elementwise ops stay on the 4-D tensor: the squeeze
    after one conv and the expand_dims before the next cancel. With them in place the layout step could not
    carry NCHW{b}c through a squeeze, and put a transform on each side of every conv of Wav2Vec2's feature
    extractor (15 transforms, 1.8 ms of its 10.7; Zen3). The squeezed copies left unused go at DCE."""
    mutator = _KeepHeightOne(mod)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and not (func.attrs and "Primitive" in func.attrs):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get()


# ------------------------------------------------------------------------ recognising decomposed ops


# ------------------------------------------------------------------------ replacement kernels


