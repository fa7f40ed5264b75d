"""Vectorisable float32 approximations of exp, erf and tanh for fused epilogues (switch: fast_math).

Why: LLVM lowers ``erf``/``tanh``/``exp`` inside vectorised loops to one scalar libm call per lane, so a
GELU epilogue costs ~15% of an MLP block. These forms use only +, *, /, min/max, floor and a bit
reinterpret, which LLVM keeps in SIMD registers. Coefficients: Cephes ``expf`` (range reduction to
[-ln2/2, ln2/2], degree-5 polynomial) and Eigen's rational ``erf``/``tanh`` (clamped). Max errors are
measured against numpy in tests/test_schedule_cpu.py (MAX_ABS_ERR below is what they assert).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

# `relax.round` legalises to `tirx.nearbyint` (ties to even, as ONNX Round and QuantizeLinear ask), which
# TVM 0.27 does not mark vectorisable, unlike floor, ceil and round: every loop holding one was scalarised
# (one libm call a lane), and one holding it around a Let (the approximations below) failed to compile,
# "Let cannot bind the same var to two different values" (the vectoriser visits the statement twice). LLVM
# vectorises the intrinsic (`vroundps`/`vrndscaleps`), so mark it.
if tvm.ir.Op.get("tirx.nearbyint").get_attr("TVectorizable") is None:
    tvm.ir.register_op_attr("tirx.nearbyint", "TVectorizable", True)
# The same holds for `tirx.isnan` (LLVM: one `fcmp uno`, vectorisable), which `_keep_nan` puts in every
# approximation below: unmarked, TVM scalarised each loop holding an erf/tanh/exp/sigmoid, and LLVM's loop
# vectoriser re-vectorised it at its preferred 256 bits (ymm on AVX-512 hosts), in-tile epilogues included.
if tvm.ir.Op.get("tirx.isnan").get_attr("TVectorizable") is None:
    tvm.ir.register_op_attr("tirx.isnan", "TVectorizable", True)

# Bounds asserted by the tests (absolute error for erf/tanh, relative for exp) over the tested ranges.
MAX_ABS_ERR = {"erf": 5e-7, "tanh": 5e-7}  # measured 3.3e-7 / 2.6e-7 (numpy fp32 itself: 3e-8 / 6e-8)
MAX_REL_ERR = {"exp": 2e-7}  # measured 8.3e-8 (numpy fp32 expf: 1.9e-7)
MAX_ABS_ERR["sigmoid"] = 2e-7  # measured 8.8e-8 over [-100, 100] (numpy fp32: the same)

_ERF_ALPHA = (
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
)
_ERF_BETA = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03, -1.42647390514189e-02)
_TANH_ALPHA = (
    -2.76076847742355e-16,
    2.00018790482477e-13,
    -8.60467152213735e-11,
    5.12229709037114e-08,
    1.48572235717979e-05,
    6.37261928875436e-04,
    4.89352455891786e-03,
)
_TANH_BETA = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)
_EXP_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _f(v: float) -> tirx.FloatImm:
    return tirx.const(v, "float32")


def _horner(x: tirx.Expr, coeffs: tuple[float, ...]) -> tirx.Expr:
    acc: tirx.Expr = _f(coeffs[0])
    for c in coeffs[1:]:
        acc = acc * x + _f(c)
    return acc


def _let(value: tirx.Expr, name: str, body_fn) -> tirx.Expr:  # noqa: ANN001 - callable building the body
    var = tirx.Var(name, "float32")
    return tirx.Let(var, value, body_fn(var))


def _keep_nan(x: tirx.Var, y: tirx.Expr) -> tirx.Expr:
    """min/max clamps drop NaN (LLVM minnum); a blend puts it back so NaN still propagates."""
    return tirx.Select(tirx.isnan(x), x, y)


def fast_erf(x: tirx.Expr) -> tirx.Expr:
    """Eigen's rational erf on x clamped to [-4, 4] (erf(+-4) rounds to +-1 in float32)."""

    def body(xv: tirx.Var) -> tirx.Expr:
        def clamped(xc: tirx.Var) -> tirx.Expr:
            return _let(xc * xc, "x2", lambda x2: (xc * _horner(x2, _ERF_ALPHA)) / _horner(x2, _ERF_BETA))

        return _keep_nan(xv, _let(tirx.max(tirx.min(xv, _f(4.0)), _f(-4.0)), "xc", clamped))

    return _let(x, "x", body)


def fast_tanh(x: tirx.Expr) -> tirx.Expr:
    """Eigen's rational tanh on x clamped to +-7.9053 (tanh rounds to +-1 beyond)."""
    lim = 7.90531110763549805

    def body(xv: tirx.Var) -> tirx.Expr:
        def clamped(xc: tirx.Var) -> tirx.Expr:
            return _let(xc * xc, "x2", lambda x2: (xc * _horner(x2, _TANH_ALPHA)) / _horner(x2, _TANH_BETA))

        return _keep_nan(xv, _let(tirx.max(tirx.min(xv, _f(lim)), _f(-lim)), "xc", clamped))

    return _let(x, "x", body)


def fast_exp(x: tirx.Expr) -> tirx.Expr:
    """Cephes expf: n = round(x / ln2), r = x - n ln2 (two-part ln2), exp = p(r) * 2^n.

    Outside the normal range the result is exactly 0 or +inf, as libm's (no denormal outputs). A lane below
    the range computes exp(0) before the select drops it: clamped to the bound instead it computed
    2^-126 x 0.999997, a denormal, and a causal mask's -3.4e38 lanes made a [1, 4, 64, 64] softmax 3.4x
    slower (11.9 -> 40.5 us, SPR class: the denormal assist on every masked lane; LLaMA's attention scores).
    """
    lo, hi = -87.3365478515625, 88.3762626647949

    def body(xv: tirx.Var) -> tirx.Expr:
        def clamped(xc: tirx.Var) -> tirx.Expr:
            def with_n(n: tirx.Var) -> tirx.Expr:
                def with_r(r: tirx.Var) -> tirx.Expr:
                    poly = _horner(r, _EXP_P) * r * r + r + _f(1.0)
                    bits = (tirx.Cast("int32", n) + tirx.const(127, "int32")) << tirx.const(23, "int32")
                    return poly * tirx.reinterpret("float32", bits)

                return _let(xc - n * _f(0.693359375) - n * _f(-2.12194440e-4), "r", with_r)

            return _let(tirx.floor(xc * _f(1.44269504088896341) + _f(0.5)), "n", with_n)

        val = _let(tirx.Select(xv < _f(lo), _f(0.0), tirx.min(xv, _f(hi))), "xc", clamped)
        val = tirx.Select(xv < _f(lo), _f(0.0), tirx.Select(xv > _f(hi), _f(float("inf")), val))
        return _keep_nan(xv, val)

    return _let(x, "x", body)


def fast_sigmoid(x: tirx.Expr) -> tirx.Expr:
    """1 / (1 + exp(-x)) on the fast exp: SiLU/Swish epilogues (EfficientNet, MobileNetV3, LLaMA's
    gate) lowered `sigmoid` to a scalar libm expf per lane, ~4x the cost of the depthwise conv it
    followed. exp(-x) overflows to +inf for x < -88.4, giving exactly 0, as libm's does."""
    return _let(x, "xs", lambda xv: _keep_nan(xv, _f(1.0) / (_f(1.0) + fast_exp(_f(0.0) - xv))))


_REWRITES = {"tirx.erf": fast_erf, "tirx.tanh": fast_tanh, "tirx.exp": fast_exp, "tirx.sigmoid": fast_sigmoid}


def rewrite_fast_math(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Replace float32 ``erf``/``tanh``/``exp``/``sigmoid`` calls in ``func`` by the approximations above."""
    ops = {tvm.ir.Op.get(name): fn for name, fn in _REWRITES.items()}

    def _map(call: tvm.ir.Call) -> tvm.ir.Expr:
        for op, fn in ops.items():
            if call.op.same_as(op) and str(call.ty) == "float32":
                return fn(call.args[0])
        return call

    return tvm_ffi.structural_map(func, (tvm.ir.Call, _map), order="post")


def has_fast_math(node: object) -> bool:
    """Does ``node`` (a block body, an expression) evaluate one of the approximations above? They are the
    only Let chains in a rewritten kernel, and each costs ~20 vector operations an element."""
    found: list[object] = []
    tvm_ffi.structural_walk(node, (tirx.Let, found.append), order="post")
    return bool(found)
