"""A compiler change that costs exactly one more Gemm+Relu layer on `benchmarks/ab_power.py`'s stack model,
loaded with --plugin: the output `y` becomes `y + 0 * sum(relu(y @ W), axis=1)`, the same values (for finite
values) and one more 64x512xCOLUMNS matmul, +10% on the 10-layer stack. Why a plugin and not an 11-layer
model: the stored-baseline gate divides by ONNX Runtime run on the SAME model, so a heavier model is heavier
for ORT too and cancels; only a slower build of an unchanged model is a regression the gate must catch."""

import numpy as np
from tvm import relax

from fuseguard.compiler.pipeline import register_pass


#: Columns of the extra matmul. Measured on the 10-layer stack, SPR class, 2 threads, interleaved: 64 -> +0.6%,
#: 128 -> +2.7%, 320 -> +8.5%, 448 -> +10.1% (a full 512-column matmul with an elementwise epilogue cost +35%).
#: `benchmarks/baseline_power.py` measures and prints the true slowdown in each run.
COLUMNS = int(__import__("os").environ.get("EXTRA_LAYER_COLUMNS", "448"))


def extra_layer(mod):
    main = mod["main"]
    out = main.body.body
    sinfo = out.ty
    rows, width = (int(d) for d in sinfo.shape.values)
    w = relax.const((np.random.default_rng(7).standard_normal((width, COLUMNS)) / width ** 0.5).astype("float32"))
    narrow = relax.TensorType((rows, COLUMNS), "float32")
    column = relax.TensorType((rows, 1), "float32")
    mm, act = (relax.DataflowVar(f"extra_{n}", narrow) for n in ("mm", "relu"))
    total, zero = (relax.DataflowVar(f"extra_{n}", column) for n in ("sum", "zero"))
    result = relax.Var("extra_out", sinfo)
    block = relax.DataflowBlock([
        relax.VarBinding(mm, relax.op.matmul(out, w)),
        relax.VarBinding(act, relax.op.nn.relu(mm)),
        relax.VarBinding(total, relax.op.sum(act, axis=[1], keepdims=True)),
        relax.VarBinding(zero, relax.op.multiply(total, relax.const(0.0, "float32"))),
        relax.VarBinding(result, relax.op.add(out, zero)),
    ])
    body = relax.SeqExpr(list(main.body.blocks) + [block], result)
    new = relax.Function(main.params, body, main.ret_ty, main.is_pure, main.attrs)
    mod = mod.shallow_copy() if hasattr(mod, "shallow_copy") else mod
    mod["main"] = new
    return relax.transform.Normalize()(mod)


register_pass("before_fusion", extra_layer, name="extra_layer")
