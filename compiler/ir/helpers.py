"""Relax expression queries every step shares: a constant's value, a tensor's dims (static or symbolic) and
dtype."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tvm
from tvm import relax


def numpy_of(const: relax.Expr) -> np.ndarray:
    return const.value.numpy()


def is_constant(expr: relax.Expr) -> bool:
    return hasattr(expr, "value") and isinstance(expr, relax.Expr) and not isinstance(expr, relax.Var) \
        and hasattr(expr.value, "numpy")


def shape_dims(expr: relax.Expr) -> list | None:
    """An expression's tensor dims as PrimExprs (static or symbolic), or None (not a tensor, unknown rank)."""
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    try:
        return list(ty.shape.values)
    except (TypeError, AttributeError):
        return None


def same_dims(a: Sequence, b: Sequence) -> bool:
    """Equal dim lists: ints by value, symbolic dims structurally (the same var or expression)."""
    import tvm_ffi

    def norm(d: object) -> object:
        return int(d) if isinstance(d, (int, tvm.tirx.IntImm)) else d

    if len(a) != len(b):
        return False
    for x, y in zip(map(norm, a), map(norm, b)):
        if isinstance(x, int) or isinstance(y, int):
            if x != y:
                return False
        elif not tvm_ffi.structural_equal(x, y):
            return False
    return True


def const_values(x: object) -> np.ndarray | None:
    """The value of a relax constant (an initializer, or an input the conformance runner froze), else None."""
    data = getattr(x, "value", None) if x is not None and not isinstance(x, relax.Var) else None
    return data.numpy() if data is not None and hasattr(data, "numpy") else None


def tensor_dtype(x: object) -> str | None:
    """A tensor expression's dtype, else None (an omitted optional input, a shape, a tuple)."""
    ty = getattr(x, "ty", None) if isinstance(x, relax.Expr) else None
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


def static_dims(expr: relax.Expr) -> list[int] | None:
    """An expression's static tensor shape, or None (not a tensor, unknown rank or a symbolic dim)."""
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    try:
        return [int(d) for d in ty.shape.values]
    except (TypeError, AttributeError):
        return None


