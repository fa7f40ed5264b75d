"""Structural analysis of TIR blocks shared by the CPU schedule rules.

Rules recognise kernels by what their blocks compute (iterator kinds, access patterns, the reduction
body), never by function or block names, because fusion renames freely.
"""

from __future__ import annotations

from collections.abc import Iterable

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.schedule import SBlockRV

REDUCE = tirx.IterVar.CommReduce
# In 0.27 a buffer load is an ``ir.TensorLoad`` and intrinsic calls are ``ir.Call`` (tirx.BufferLoad is a factory).
BufferLoad = tvm.ir.TensorLoad
Call = tvm.ir.Call
SPATIAL = tirx.IterVar.DataPar


def int_or_none(expr: object) -> int | None:
    """Static integer value of an extent, or None when it is symbolic."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    return None


def vars_in(expr: object) -> set[tirx.Var]:
    found: set[tirx.Var] = set()
    tvm_ffi.structural_walk(expr, (tirx.Var, found.add), order="post")
    return found


def iter_kinds(block: s_tir.SBlock) -> str:
    return "".join("R" if iv.iter_type == REDUCE else ("S" if iv.iter_type == SPATIAL else "O") for iv in block.iter_vars)


def is_spatial(block: s_tir.SBlock) -> bool:
    return all(iv.iter_type == SPATIAL for iv in block.iter_vars)


def is_reduction(block: s_tir.SBlock) -> bool:
    return any(iv.iter_type == REDUCE for iv in block.iter_vars)


def widened_load(expr: object) -> object:
    """The load under a widening cast (`--precision fp16/bf16` operands read as Cast(float32, load)), else
    `expr` itself: GEMM and conv rules match reduced operands as they match fp32 ones."""
    if isinstance(expr, tirx.Cast) and isinstance(expr.value, BufferLoad) \
            and str(expr.value.source.dtype) in ("float16", "bfloat16"):
        return expr.value
    return expr


def loads_in(expr: object) -> list[BufferLoad]:
    found: list[BufferLoad] = []
    tvm_ffi.structural_walk(expr, (BufferLoad, found.append), order="post")
    return found


def calls_in(expr: object) -> list[Call]:
    found: list[Call] = []
    tvm_ffi.structural_walk(expr, (Call, found.append), order="post")
    return found


def simple_index_vars(indices: Iterable[tirx.Expr]) -> list[tirx.Var] | None:
    """The index vars when every index is a bare variable (plain strided access), else None."""
    out: list[tirx.Var] = []
    for idx in indices:
        if not isinstance(idx, tirx.Var):
            return None
        out.append(idx)
    return out


def root_blocks(sch: s_tir.Schedule) -> list[SBlockRV]:
    """Top-level blocks (children of the root block) in program order."""
    root = sch.get_sblock("root") if _has_root(sch) else None
    if root is None:
        return []
    return list(sch.get_child_blocks(root))


def _has_root(sch: s_tir.Schedule) -> bool:
    try:
        sch.get_sblock("root")
        return True
    except Exception:  # noqa: BLE001 - no root block
        return False


def loops_match_iters(sch: s_tir.Schedule, block_rv: SBlockRV) -> bool:
    """True when the block's iter vars are bound one-to-one, in order, to its enclosing loops.

    This is the shape legalisation produces; the rules rely on it to map iterators to loops.
    """
    realize = realize_of(sch, block_rv)
    if realize is None:
        return False
    loops = sch.get_loops(block_rv)
    if len(loops) != len(realize.iter_values):
        return False
    for loop_rv, value in zip(loops, realize.iter_values):
        loop = sch.get(loop_rv)
        if not (isinstance(value, tirx.Var) and value.same_as(loop.loop_var)):
            return False
        if int_or_none(loop.min) != 0:
            return False
    return True


def realize_of(sch: s_tir.Schedule, block_rv: SBlockRV) -> s_tir.SBlockRealize | None:
    block = sch.get(block_rv)
    found: list[s_tir.SBlockRealize] = []

    def _visit(node: s_tir.SBlockRealize) -> None:
        if node.block.same_as(block):
            found.append(node)

    tvm_ffi.structural_walk(sch.mod["main"], (s_tir.SBlockRealize, _visit), order="post")
    return found[0] if found else None


def try_inline_all(sch: s_tir.Schedule, keep: Iterable[SBlockRV] = ()) -> list[SBlockRV]:
    """Inline every spatial block that can be inlined, except those in ``keep``; return the rest.

    Producers are inlined into consumers (compute_inline) first, then trailing elementwise blocks into
    their producer (reverse_compute_inline); repeated until nothing changes.
    """
    keep_names = {sch.get(b).name_hint for b in keep}
    changed = True
    while changed:
        changed = False
        for blk in root_blocks(sch):
            block = sch.get(blk)
            if block.name_hint in keep_names or not is_spatial(block):
                continue
            try:
                sch.compute_inline(blk)
                changed = True
                break
            except Exception:  # noqa: BLE001 - ScheduleError or an FFI error: not inlinable
                pass
    return root_blocks(sch)


def executed_block_instances(func: tirx.PrimFunc) -> int | None:
    """How many block instances a PrimFunc executes (loop extents multiplied down to each block); None when
    an extent is symbolic. Equal to the iteration domain for a schedule that computes each value once;
    larger when a schedule recomputes a producer inside a consumer loop."""
    total = 0

    def visit(stmt: object, mult: int) -> bool:
        nonlocal total
        if isinstance(stmt, tirx.For):
            ext = int_or_none(stmt.extent)
            return ext is not None and visit(stmt.body, mult * ext)
        if isinstance(stmt, s_tir.SBlockRealize):
            if stmt.block.iter_vars:
                total += mult
            return visit(stmt.block.body, mult)
        if isinstance(stmt, tirx.SeqStmt):
            return all(visit(s, mult) for s in stmt.seq)
        if isinstance(stmt, tirx.IfThenElse):
            return visit(stmt.then_case, mult) and (stmt.else_case is None or visit(stmt.else_case, mult))
        body = getattr(stmt, "body", None)
        return visit(body, mult) if body is not None else True

    return total if visit(func.body, 1) else None


def inline_around(sch: s_tir.Schedule, block: SBlockRV) -> tuple[SBlockRV, SBlockRV | None] | None:
    """Inline producers and the elementwise chain after `block`, keeping it: (block, its one epilogue or
    None); None when more than one other block survives (no single-output tile can carry them)."""
    name = sch.get(block).name_hint
    blocks = try_inline_all(sch, keep=[block])
    kept = sch.get_sblock(name)
    others = [b for b in blocks if sch.get(b).name_hint != name]
    if len(others) > 1:
        return None
    return kept, (others[0] if others else None)
