"""A deliberately wrong reduced-precision kernel, loaded with --plugin: fused GEMM groups accumulate in the
reduced type (a matmul's `out_dtype` fp16 instead of fp32, the classic half-precision compute-type bug).

Only the fused build has composite functions at the after_fusion stage, so the unfused build keeps fp32
accumulation. In an fp32 build the plugin changes nothing. Every output element stays within the loose
per-element bound of the fp32 result; the comparison against fp64 (the fused build more wrong than the
unfused build in the same precision) is what catches it.
"""

from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from fuseguard.compiler.pipeline import register_pass

_a, _b = wildcard(), wildcard()
_pattern = is_op("relax.matmul")(_a, _b)


def _low_accumulate(expr: relax.Call, m: dict) -> relax.Expr:
    low = str(m[_a].ty.dtype)
    if low not in ("float16", "bfloat16") or str(expr.attrs.out_dtype) == low:   # done (rewrite_call iterates)
        return expr
    return relax.op.astype(relax.op.matmul(m[_a], m[_b], out_dtype=low), "float32")


def accumulate_fused_gemms_in_low_precision(mod):
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and func.attrs is not None and "Composite" in func.attrs:
            mod[gv] = rewrite_call(_pattern, _low_accumulate, func)
    return mod


register_pass("after_fusion", accumulate_fused_gemms_in_low_precision, name="lowp_accumulate")
