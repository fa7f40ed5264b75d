"""Pipeline step 9b: a concatenation whose inputs are written in place, where the copy would have been.

Why: SqueezeNet's fire modules end in a channel concat of two convs' outputs; the eight concat kernels copied
3-5 MB and took 271 us of its 3.4 ms (SPR class, `fuseguard profile squeezenet`), 8% of the model, with
nothing computed. Along an axis with only unit dims before it (channels at batch 1, NCHW or NCHW{b}c), each
input is one contiguous slice of the output: after memory planning (StaticPlanBlockMemory), the inputs and
the output are placed in one storage, each input at its slice's byte offset, and the concat call is dropped.
The kernels that write the inputs then write the concat's output. Both builds take it (it is memory
planning, not fusion); `CompileOptions(concat_in_place=False)` turns it off.

The storage is one the plan already has, big enough and free over the tensors' lifetime once they leave
their own (the output's, an input's, or any other); where the plan has none the copy stays, so the plan
never grows (with a fresh storage a concat, SqueezeNet planned 11.6 MiB against 6.1). Taken only where it is
plainly safe: every input a planned tensor that exactly one kernel writes (not a parameter, a constant, a
view or a tensor another concat moved), the output a planned tensor only the concat writes, static shapes,
one dtype, and every slice offset a multiple of the runtime's 64-byte allocation alignment (kernels assume
it). fuseguard's pipeline makes no in-place kernel calls, which could write an input after the concat read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import tvm
from tvm import relax

#: The byte alignment TVM's kernels assume of a tensor's data (the runtime's `kAllocAlignment`).
ALIGNMENT = 64
_FOREVER = 1 << 60

_ALLOC_TENSOR = tvm.ir.Op.get("relax.memory.alloc_tensor")
_ALLOC_STORAGE = tvm.ir.Op.get("relax.memory.alloc_storage")


def _static_shape(var: relax.Var) -> tuple[list[int], str] | None:
    ty = var.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    shape = ty.shape
    if not isinstance(shape, relax.ShapeExpr) or not all(isinstance(d, tvm.tirx.IntImm) for d in shape.values):
        return None
    return [int(d) for d in shape.values], str(ty.dtype)


def _kernel_call(mod: tvm.IRModule, value: object) -> bool:
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar) \
        and isinstance(mod[value.op], tvm.tirx.PrimFunc)


def _is_concat(mod: tvm.IRModule, call: relax.Call) -> bool:
    return _kernel_call(mod, call) and call.op.name_hint.startswith("concatenate") and len(call.args) >= 3


def concat_axis(shapes: list[list[int]], out: list[int]) -> int | None:
    """The axis the inputs concatenate along when each is one contiguous slice of ``out``, else None."""
    rank = len(out)
    if len(shapes) < 2 or any(len(s) != rank for s in shapes):
        return None
    diff = [k for k in range(rank) if any(s[k] != out[k] for s in shapes)]
    if len(diff) != 1:
        return None
    axis = diff[0]
    if sum(s[axis] for s in shapes) != out[axis] or any(d != 1 for d in out[:axis]):
        return None
    return axis


@dataclass
class _Plan:
    """The block's planned tensors: where each lives, and from which binding to which it is live."""

    bindings: list[relax.Binding]
    alloc_at: dict[relax.Var, int] = field(default_factory=dict)          # tensor -> its alloc_tensor binding
    storage_of: dict[relax.Var, relax.Var] = field(default_factory=dict)  # tensor -> its storage
    offset_of: dict[relax.Var, int] = field(default_factory=dict)
    storage_at: dict[relax.Var, int] = field(default_factory=dict)        # storage -> its alloc_storage binding
    size: dict[relax.Var, int] = field(default_factory=dict)              # storage -> bytes
    writers: dict[relax.Var, list[int]] = field(default_factory=dict)     # tensor -> kernel calls writing it
    roots: dict[relax.Var, set] = field(default_factory=dict)             # var -> the tensors it may alias
    last_use: dict[relax.Var, int] = field(default_factory=dict)          # tensor -> last binding reading it
    used: set = field(default_factory=set)                                # every var some binding reads

    def of(self, var: relax.Var) -> set:
        return self.roots.get(var, {var})

    def live(self, tensor: relax.Var) -> tuple[int, int]:
        return self.alloc_at[tensor], self.last_use.get(tensor, self.alloc_at[tensor])


def _plan(mod: tvm.IRModule, block: relax.BindingBlock, tail: list[relax.Expr]) -> _Plan:
    plan = _Plan(list(block.bindings))
    for i, b in enumerate(plan.bindings):
        value = b.value     # a VarBinding's or a MatchCast's
        if isinstance(value, relax.Call) and value.op.same_as(_ALLOC_TENSOR):
            plan.alloc_at[b.var] = i
            plan.storage_of[b.var] = value.args[0]
            continue
        if isinstance(value, relax.Call) and value.op.same_as(_ALLOC_STORAGE):
            plan.storage_at[b.var] = i
            dims = value.args[0].values if isinstance(value.args[0], relax.ShapeExpr) else []
            plan.size[b.var] = int(dims[0]) if len(dims) == 1 and isinstance(dims[0], tvm.tirx.IntImm) else -1
            continue
        used = list(relax.analysis.free_vars(value))
        plan.used.update(used)
        roots = set().union(*(plan.of(v) for v in used)) if used else set()
        for t in roots:
            plan.last_use[t] = i
        if _kernel_call(mod, value) and isinstance(value.args[-1], relax.Var):
            for t in plan.of(value.args[-1]):
                plan.writers.setdefault(t, []).append(i)
        elif roots:
            plan.roots[b.var] = roots     # an alias, a view or a tuple of them: its uses are the tensors' uses
    for expr in tail:                     # the function's result, later blocks: live to the end
        for v in relax.analysis.free_vars(expr):
            plan.used.add(v)
            for t in plan.of(v):
                plan.last_use[t] = _FOREVER
    return plan


def _host_storage(plan: _Plan, moved: list[relax.Var], need: int, start: int, end: int) -> relax.Var | None:
    """A storage of at least ``need`` bytes, defined before ``start``, that no tensor but ``moved`` occupies
    within [start, end]: the output's own first, then an input's, then any; None when the plan has none."""
    order = list(dict.fromkeys([*(plan.storage_of[t] for t in reversed(moved)), *plan.storage_at]))
    for s in order:
        if s not in plan.storage_at or plan.storage_at[s] >= start or plan.size.get(s, -1) < need:
            continue
        tenants = [t for t, st in plan.storage_of.items() if st.same_as(s) and t not in moved]
        if all(hi < start or lo > end for lo, hi in (plan.live(t) for t in tenants)):
            return s
    return None


def _rewrite_block(mod: tvm.IRModule, block: relax.BindingBlock,
                   tail: list[relax.Expr]) -> tuple[relax.BindingBlock, list[tuple[str, frozenset]]]:
    plan = _plan(mod, block, tail)
    bindings = plan.bindings
    moved_all: set = set()
    drop: set[int] = set()
    for i, b in enumerate(bindings):
        call = b.value if isinstance(b, relax.VarBinding) else None
        if not isinstance(call, relax.Call) or not _is_concat(mod, call) or b.var in plan.used:
            continue
        if not all(isinstance(a, relax.Var) and len(plan.of(a)) == 1 for a in call.args):
            continue
        ins = [next(iter(plan.of(a))) for a in call.args[:-1]]
        out = next(iter(plan.of(call.args[-1])))
        tensors = [*ins, out]
        if len(set(tensors)) != len(tensors) or any(t not in plan.alloc_at or t in moved_all for t in tensors):
            continue
        # each input written by one kernel before the concat, the output by the concat alone
        if any(len(plan.writers.get(t, [])) != 1 or plan.writers[t][0] > i for t in ins) \
                or plan.writers.get(out) != [i]:
            continue
        shapes = [_static_shape(t) for t in tensors]
        if any(s is None for s in shapes) or len({s[1] for s in shapes}) != 1:
            continue
        if concat_axis([s[0] for s in shapes[:-1]], shapes[-1][0]) is None:
            continue
        itemsize = tvm.DataType(shapes[-1][1]).bits // 8
        sizes = [math.prod(s[0]) * itemsize for s in shapes]
        offsets = [sum(sizes[:k]) for k in range(len(ins))]
        if any(o % ALIGNMENT for o in offsets):
            continue
        start = min(plan.alloc_at[t] for t in tensors)
        end = max(plan.live(t)[1] for t in tensors)
        host = _host_storage(plan, tensors, sizes[-1], start, end)
        if host is None:        # a fresh or a grown storage would plan more memory than the copy did
            continue
        for t, offset in zip(tensors, (*offsets, 0)):
            plan.storage_of[t], plan.offset_of[t] = host, offset
        moved_all.update(tensors)
        drop.add(i)
    if not drop:
        return block, []
    out_bindings: list[relax.Binding] = []
    for i, b in enumerate(bindings):
        if i in drop:
            continue
        if b.var in moved_all:
            a = b.value
            offset = plan.offset_of[b.var]
            new = relax.Call(a.op, [plan.storage_of[b.var], relax.prim_value(tvm.tirx.IntImm("int64", offset)),
                                    *a.args[2:]], a.attrs, a.ty_args)
            if offset:
                # The VM gives a tensor at an offset a DLTensor byte_offset, which every kernel's argument
                # check refuses; ensure_zero_offset moves the data pointer instead (no copy on a CPU when the
                # offset is a multiple of the allocation alignment, checked above).
                raw = relax.Var(f"{b.var.name}_at_offset", b.var.ty)
                out_bindings += [relax.VarBinding(raw, new),
                                 relax.VarBinding(b.var, relax.op.memory.ensure_zero_offset(raw))]
            else:
                out_bindings.append(relax.VarBinding(b.var, new))
        else:
            out_bindings.append(b)
    dropped = []
    for i in sorted(drop):
        out = next(iter(plan.of(bindings[i].value.args[-1])))
        names = {v.name for v, roots in plan.roots.items() if roots == {out}} | {out.name}
        dropped.append((bindings[i].value.op.name_hint, frozenset(names)))
    return relax.BindingBlock(out_bindings), dropped


def concat_in_place(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[tuple[str, frozenset]]]:
    """`mod` with every qualifying concatenation written in place by its inputs' kernels, and each dropped
    call's kernel with the names bound to its output (a call site's `var` is one), in execution order."""
    dropped: list[tuple[str, frozenset]] = []
    updates = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        blocks, mine = [], []
        body = func.body
        for k, block in enumerate(body.blocks):
            if isinstance(block, relax.DataflowBlock):
                blocks.append(block)
                continue
            later = [b.value for blk in body.blocks[k + 1:] for b in blk.bindings] + [body.body]
            new, names = _rewrite_block(mod, block, later)
            blocks.append(new)
            mine += names
        if mine:
            updates[gv] = relax.Function(func.params, relax.SeqExpr(blocks, body.body), func.ret_ty,
                                         func.is_pure, func.attrs, func.span)
            dropped += mine
    for gv, func in updates.items():
        mod[gv] = func
    return mod, dropped


def ConcatInPlace(dropped: list[tuple[str, frozenset]]) -> tvm.transform.Pass:  # noqa: N802 - a TVM pass
    """`concat_in_place` as a module pass for the pipeline's stages; `dropped` receives what it dropped."""

    @tvm.transform.module_pass(opt_level=0, name="ConcatInPlace")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod, names = concat_in_place(mod)
        dropped.extend(names)
        return mod

    return _pass
