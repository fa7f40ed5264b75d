"""int8 QDQ models: a MatMul between a Quantize->Dequantize pair and a dequantized int8 weight as an
integer GEMM, on CPUs with VNNI.

`compiler/passes/qdq.py` computes every QDQ pair in fp32 on the integer grid, exact but no faster than the fp32
model, while ONNX Runtime runs these MatMuls on u8s8 integer kernels (2.3x fuseguard's fp32 route on
the QDQ BERT encoder, Sapphire Rapids). Here

    MatMul(DQ(Q(x, s_q, z_q), s_x, z_x), DQ(W, s_w, 0))
      = dequantize(matmul(quantize(x, s_q, z_q + o, uint8), W, int32), s_x * s_w, (z_x + o) * colsum(W))

with W kept int8 (folded to fp32 by the next step otherwise) and o = 128 when the activation is int8:
vpdpbusd multiplies *unsigned* by signed bytes, and x + 128 as uint8 is x as int8 shifted, its shift
taken out with the zero point (the column sums of W are constants). Exact: the integer products and sums
are exact in int32, and the one rounding left is the dequantize's multiply. The kernel is
compiler/schedule/cpu_matmul_int8.py; the quantize of x fuses into x's producer and the dequantize (and
what follows: bias, GELU, the next pair) into the GEMM's epilogue.

Runs before constant folding (step 1), for fused and unfused builds alike (the unfused build runs the
quantize, the GEMM and the dequantize as three kernels). Only where the target has VNNI, W is 2-D and
symmetric (zero point 0, as ORT's quantiser writes weights), its scale per tensor or per output column,
K, N split into the kernel's steps and the output's shape static; any other MatMul keeps the fp32 route.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..ir.helpers import numpy_of
from ..ir.rewrite import recognize
from .qdq import scalar_value

_SHIFT = {"int8": 128, "uint8": 0}


def _pattern():
    from tvm.relax.dpl import is_const, is_op, wildcard

    x, s_q, z_q, s_x, z_x = wildcard(), is_const(), is_const(), is_const(), is_const()
    quant = is_op("relax.quantize")(x, s_q, z_q)
    act_dq = is_op("relax.dequantize")(quant, s_x, z_x)
    shape = wildcard()
    act = act_dq | is_op("relax.reshape")(act_dq, shape)
    w, s_w, z_w = is_const(), is_const(), is_const()
    w_dq = is_op("relax.dequantize")(w, s_w, z_w)
    w_t = is_op("relax.permute_dims")(w_dq)
    out = is_op("relax.matmul")(act, w_dq | w_t)
    return out, dict(x=x, s_q=s_q, z_q=z_q, s_x=s_x, z_x=z_x, quant=quant, act_dq=act_dq, shape=shape, w=w,
                     s_w=s_w, z_w=z_w, w_dq=w_dq, w_t=w_t)


def integer_matmuls(mod: tvm.IRModule, lanes: int) -> tuple[tvm.IRModule, int, int]:
    """Rewrite every qualifying MatMul (module docstring); `lanes` is the kernel's vector width in int32
    lanes (N must be a multiple). Returns the module, how many MatMuls it rewrote and how many quantize
    ops feed them (MatMuls reading the same activation share one)."""
    out, p = _pattern()

    def rewrite(m: dict) -> relax.Expr | None:
        quant, act_dq, w_dq, mm = m[p["quant"]], m[p["act_dq"]], m[p["w_dq"]], m[out]
        x_ty = m[p["x"]].ty
        q_dtype = str(quant.attrs.out_dtype)
        if q_dtype not in _SHIFT or str(act_dq.attrs.out_dtype) != "float32" or str(w_dq.attrs.out_dtype) != "float32" \
                or not isinstance(x_ty, relax.TensorType) or str(x_ty.dtype) != "float32" \
                or str(mm.attrs.out_dtype) not in ("", "None", "void", "float32"):
            return None
        params = [scalar_value(m[p[k]]) for k in ("s_q", "z_q", "s_x", "z_x")]
        if any(v is None for v in params):
            return None
        s_q, z_q, s_x, z_x = params
        w = np.asarray(numpy_of(m[p["w"]]))
        z_w = np.asarray(numpy_of(m[p["z_w"]]))
        s_w = np.asarray(numpy_of(m[p["s_w"]]), np.float64)
        if w.dtype != np.int8 or w.ndim != 2 or np.any(z_w != 0):
            return None
        axis = int(w_dq.attrs.axis) % 2
        if s_w.size != 1 and (s_w.ndim != 1 or s_w.size != w.shape[axis]):
            return None
        transposed = p["w_t"] in m
        if transposed:
            axes = m[p["w_t"]].attrs.axes
            if axes is not None and [int(a) for a in axes] != [1, 0]:
                return None
        w_kn = w.T if transposed else w          # [K, N]
        n_axis = 0 if transposed else 1          # which axis of the stored W is N
        if s_w.size != 1 and axis != n_axis:     # a scale per K row does not factor out of the sum
            return None
        k, n = w_kn.shape
        if k % 4 or n % lanes:
            return None
        shift = _SHIFT[q_dtype]
        scale = np.broadcast_to(s_x * s_w.reshape(-1), (n,)).astype(np.float32)
        corr = ((z_x + shift) * w_kn.astype(np.int64).sum(axis=0)).astype(np.int32)
        act = relax.op.quantize(m[p["x"]], relax.const(np.float32(s_q)), relax.const(np.uint8(int(z_q) + shift)),
                                axis=-1, out_dtype="uint8")
        if p["shape"] in m:
            act = relax.op.reshape(act, m[p["shape"]])
        acc = relax.op.matmul(act, relax.const(np.ascontiguousarray(w_kn), "int8"), out_dtype="int32")
        dims = mm.ty.shape.values if isinstance(mm.ty, relax.TensorType) and mm.ty.shape is not None else None
        if dims is None or not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
            return None     # symbolic rows: the kernel's tensorized tile does not lower with them (TVM 0.27's
                            # match-buffer check fails on the padded offset); the fp32 route takes them
        rank = len(dims)
        return relax.op.dequantize(acc, relax.const(scale, "float32"), relax.const(corr, "int32"), axis=rank - 1,
                                   out_dtype="float32")

    mod, rewritten = recognize(mod, out, rewrite, "MatMulInteger")
    if not rewritten:
        return mod, 0, 0
    mod = relax.transform.DeadCodeElimination(["main"])(relax.transform.EliminateCommonSubexpr()(mod))
    return mod, len(rewritten), _count_feeding_quantizes(mod)


def _count_feeding_quantizes(mod: tvm.IRModule) -> int:
    """uint8 quantize ops read by an int32 matmul (directly or through a reshape)."""
    producers: dict[relax.Var, relax.Call] = {}
    feeding: set[relax.Var] = set()

    def visit(binding: relax.VarBinding) -> None:
        value = binding.value
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
            producers[binding.var] = value
            if value.op.name == "relax.matmul" and str(value.attrs.out_dtype) == "int32":
                a = value.args[0]
                if a in producers and producers[a].op.name == "relax.reshape":
                    a = producers[a].args[0]
                if a in producers and producers[a].op.name == "relax.quantize":
                    feeding.add(a)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            for block in func.body.blocks:
                for b in block.bindings:
                    if isinstance(b, relax.VarBinding):
                        visit(b)
    return len(feeding)
