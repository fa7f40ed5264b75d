"""A deliberately wrong fusion, loaded with --plugin: inside fused Conv groups, ReLU becomes Sigmoid.

Only the fused build has composite functions at the after_fusion stage, so the unfused build stays right
and the verifier must report the fused side as mismatching.
"""

from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from fuseguard.compiler.pipeline import register_pass


def relu_to_sigmoid_in_fused_convs(mod):
    x = wildcard()
    pattern = is_op("relax.nn.relu")(x)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and func.attrs is not None and "Composite" in func.attrs \
                and "conv2d" in str(func.attrs["Composite"]):
            mod[gv] = rewrite_call(pattern, lambda expr, m: relax.op.sigmoid(m[x]), func)
    return mod


register_pass("after_fusion", relu_to_sigmoid_in_fused_convs, name="wrong_relu")
