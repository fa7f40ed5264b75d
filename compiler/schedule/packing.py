"""Compile-time panel packing of constant weights (exact permutation, so numerics are unchanged).

A weight read as ``W[.., j, ..]`` with ``j`` the vectorised output axis becomes
``Wp[j // nr, .., j % nr]``: each ``nr``-wide panel is contiguous along the reduction axes, so the
micro-kernel's vector loads stream through memory. The PrimFunc side is a ``transform_layout`` on the
parameter; the Relax side replaces the constant fed to ``call_tir`` by its numpy-packed copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import s_tir, tirx
from tvm.s_tir.schedule import SBlockRV


def panel_index_map(ndim: int, j_dim: int, nr: int):  # noqa: ANN201 - returns an index-map lambda
    def index_map(*idx: tirx.Var) -> list[tirx.Expr]:
        rest = [idx[d] for d in range(ndim) if d != j_dim]
        return [idx[j_dim] // nr, *rest, idx[j_dim] % nr]

    return index_map


def pack_param_layout(sch: s_tir.Schedule, block: SBlockRV, buffer_var, j_dim: int, nr: int) -> None:  # noqa: ANN001
    """Rewrite the layout of parameter ``buffer_var`` (read by ``block``) into panels."""
    blk = sch.get(block)
    read_idx = next(i for i, r in enumerate(blk.reads) if r.source.same_as(buffer_var))
    ndim = len(blk.reads[read_idx].region)
    sch.transform_layout(block, ("read", read_idx), panel_index_map(ndim, j_dim, nr))


def pack_array(arr: np.ndarray, j_dim: int, nr: int) -> np.ndarray:
    """Numpy twin of :func:`panel_index_map`: ``[.., J, ..] -> [J / nr, .., nr]``."""
    shape = arr.shape
    if shape[j_dim] % nr:
        raise ValueError(f"axis {j_dim} of {shape} is not a multiple of {nr}")
    split = arr.reshape(*shape[:j_dim], shape[j_dim] // nr, nr, *shape[j_dim + 1 :])
    # axes now: [..j_dim-1], jo (j_dim), ji (j_dim+1), [rest...]
    ndim = split.ndim
    order = [j_dim] + [d for d in range(ndim) if d not in (j_dim, j_dim + 1)] + [j_dim + 1]
    return np.ascontiguousarray(split.transpose(order))


def pack_vnni(arr: np.ndarray, j_dim: int, lanes: int, k_step: int = 4) -> np.ndarray:
    """Numpy twin of `cpu_matmul_int8.vnni_index_map`: a 2-D int8 ``[K, N]`` (or ``[N, K]``, ``j_dim`` 0) ->
    ``[N / lanes, K / k_step, lanes, k_step]``."""
    kn = arr if j_dim == 1 else arr.T
    k, n = kn.shape
    if n % lanes or k % k_step:
        raise ValueError(f"{arr.shape} does not split into {lanes}-column, {k_step}-row steps")
    return np.ascontiguousarray(kn.reshape(k // k_step, k_step, n // lanes, lanes).transpose(2, 0, 3, 1))


@dataclass(frozen=True)
class PackPlan:
    """How a schedule re-laid out a constant parameter; `apply` does the same to its numpy value."""

    param: int                  # the parameter's position
    j_dim: int                  # the output-column axis of the weight
    nr: int | None = None       # panels of `nr` columns (`pack_array`); None: the columns only padded
    k_step: int | None = None   # VNNI steps of `k_step` rows (`pack_vnni`, int8 weights)
    pad_to: int | None = None   # the column axis zero-padded to this many first (`pad_columns`)

    def apply(self, arr: np.ndarray) -> np.ndarray:
        if self.pad_to is not None:
            arr = pad_columns(arr, self.j_dim, self.pad_to)
        if self.nr is None:
            return arr
        return pack_vnni(arr, self.j_dim, self.nr, self.k_step) if self.k_step else pack_array(arr, self.j_dim, self.nr)


def pad_columns(arr: np.ndarray, j_dim: int, extent: int) -> np.ndarray:
    """``arr`` with axis ``j_dim`` zero-padded at its end to ``extent`` (a weight widened to whole column
    tiles, `cpu_matmul.widen_param`: the padded columns multiply into outputs that are never stored)."""
    if arr.shape[j_dim] > extent:
        raise ValueError(f"axis {j_dim} of {arr.shape} is longer than {extent}")
    widths = [(0, 0)] * arr.ndim
    widths[j_dim] = (0, extent - arr.shape[j_dim])
    return np.ascontiguousarray(np.pad(arr, widths))
