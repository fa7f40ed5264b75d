"""The fusion cost model: the analytic estimate (bytes and launches a group saves, at the sizes a symbolic
build decides with) and the decision every candidate group gets, with its reason, fused or not. A
measured decision (compiler/fusion/decisions.py) wins over the estimate where one exists."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field

import tvm
from tvm import relax

from ..hw.hardware import Hardware
from ..ir.tags import indices as tag_indices
from ..ir.tags import label as tag_label
from .decisions import Measured, decision_key
from .legality import convexity_violation
from .rules import CostEstimate, Match, PatternRule

# ----------------------------------------------------------------------------- the estimate

#: Sizes the cost model decides with in a symbolic build ({dim name: size}, compiler/dynamic.py): each
#: dynamic dim's bound, else a representative size. Set by `decide_at` for one fusion pass.
_DECIDE_SIZES: dict[str, int] = {}


@contextlib.contextmanager
def decide_at(sizes: Mapping[str, int]) -> Iterator[None]:
    """Within this block, symbolic dims count as `sizes` for cost estimates (never for legality)."""
    global _DECIDE_SIZES
    saved, _DECIDE_SIZES = _DECIDE_SIZES, dict(sizes)
    try:
        yield
    finally:
        _DECIDE_SIZES = saved


def dims_for_cost(expr: relax.Expr) -> list[int] | None:
    """A tensor's dims, with symbolic ones evaluated at the `decide_at` sizes; None when unknown."""
    sinfo = getattr(expr, "ty", None)
    if not isinstance(sinfo, relax.TensorType) or sinfo.shape is None:
        return None
    out = []
    for d in sinfo.shape.values:
        if isinstance(d, tvm.tirx.IntImm):
            out.append(int(d))
            continue
        from tvm.sym import Analyzer
        from tvm.tirx import analysis

        ana = Analyzer()
        for var in analysis.undefined_vars(d, []):
            if var.name not in _DECIDE_SIZES:
                return None
            ana.bind(var, tvm.tirx.IntImm("int64", _DECIDE_SIZES[var.name]))  # Relax shapes are int64
        value = ana.simplify(d)
        if not isinstance(value, tvm.tirx.IntImm):
            return None
        out.append(int(value))
    return out


def tensor_bytes(expr: relax.Expr) -> int:
    sinfo = expr.ty
    dims = dims_for_cost(expr)
    if dims is None:
        return 0
    bits = tvm.runtime.DataType(sinfo.dtype).bits if sinfo.dtype else 32
    return math.prod(dims) * max(1, bits // 8)


def bandwidth_gbs(nbytes: int, hw: Hardware) -> float:
    """The rate an unfused kernel moves a tensor of ``nbytes`` at: from L2 where it fills at most half of all
    cores' L2, from L3 where it fills at most half of L3, else DRAM (CPU rows; a GPU row has DRAM only)."""
    if hw.l2_bandwidth_gbs and 2 * nbytes <= hw.l2_bytes * max(1, hw.cores):
        return hw.l2_bandwidth_gbs
    if hw.l3_bandwidth_gbs and 2 * nbytes <= hw.l3_bytes:
        return hw.l3_bandwidth_gbs
    return hw.mem_bandwidth_gbs


def traffic_us(nbytes: int, times: int, hw: Hardware) -> float:
    """Microseconds to move a tensor of ``nbytes`` ``times`` times (each write or read of it)."""
    return nbytes * times / (bandwidth_gbs(nbytes, hw) * 1e3)


def intermediate_traffic_cost(match: Match, hw: Hardware) -> CostEstimate:
    """Default cost: each intermediate tensor is written once and read once per consumer when unfused, at the
    rate of the kernel that reads it (:func:`serial_read_gbs` where that kernel runs on one core)."""
    out = match.output_var()
    saved, us = 0, 0.0
    for var in match.vars:
        if var is out:
            continue
        nbytes = tensor_bytes(var)
        readers = max(1, len([u for u in match.var_usages.get(var, [])]))
        saved += nbytes * (1 + readers)
        gbs = serial_read_gbs(match, var, nbytes, hw) or bandwidth_gbs(nbytes, hw)
        us += nbytes * (1 + readers) / (gbs * 1e3)
    launches = max(0, len(match.ops) - 1)
    return CostEstimate(bytes_saved=saved, launches_saved=launches, predicted_us=us + launches * hw.launch_overhead_us)


def _kernel_size(var: relax.Var, value: relax.Expr) -> tuple[int, int] | None:
    """(iterations, bytes of buffers) of the kernel computing ``var`` alone, as the CPU scheduler counts them:
    a conv's or matmul's iterations are its multiply-adds, another op's its largest tensor's elements. None
    when a shape is unknown or the binding is not an operator call."""
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
        return None
    out_dims = dims_for_cost(var)
    tensors = [a for a in value.args if isinstance(getattr(a, "ty", None), relax.TensorType)]
    arg_dims = [dims_for_cost(a) for a in tensors]
    if out_dims is None or any(d is None for d in arg_dims):
        return None
    work = max([math.prod(out_dims)] + [math.prod(d) for d in arg_dims])   # type: ignore[arg-type]
    name = value.op.name
    if name in ("relax.nn.conv2d", "relax.nn.conv1d") and len(arg_dims) > 1:
        work = math.prod(out_dims) * math.prod(arg_dims[1][1:])            # type: ignore[index]
    elif name == "relax.matmul" and arg_dims and arg_dims[0]:
        work = math.prod(out_dims) * arg_dims[0][-1]                       # type: ignore[index]
    return work, tensor_bytes(var) + sum(tensor_bytes(a) for a in tensors)


def _serial(size: tuple[int, int] | None) -> bool | None:
    """The CPU scheduler's rule (`schedule.cpu.PARALLEL_MIN_WORK` iterations, `PARALLEL_MIN_BYTES` of
    buffers) on a :func:`_kernel_size`."""
    from ..schedule.cpu import PARALLEL_MIN_BYTES, PARALLEL_MIN_WORK

    return None if size is None else size[0] < PARALLEL_MIN_WORK and size[1] < PARALLEL_MIN_BYTES


def runs_serial(var: relax.Var, value: relax.Expr) -> bool | None:
    """Would the unfused kernel computing ``var`` run on one core? None when a shape is unknown."""
    return _serial(_kernel_size(var, value))


#: Ops that keep a tensor's size but reduce along its rows: their kernels are bound by arithmetic and row
#: passes, not by moving the tensor once (see :func:`serial_read_gbs`).
ROW_REDUCING_OPS = frozenset({"layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm", "softmax",
                              "log_softmax"})


def moves_its_tensor(var: relax.Var, value: relax.Expr) -> bool:
    """Is the kernel computing ``var`` bound by moving its tensors once (elementwise, broadcasting, a copy)?
    Its output has as many elements as its largest input, and it is no row reduction or contraction."""
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
        return False
    op = value.op.name.rsplit(".", 1)[-1]
    if op in ROW_REDUCING_OPS or op in ("conv1d", "conv2d", "conv3d", "matmul"):
        return False
    out = dims_for_cost(var)
    ins = [dims_for_cost(a) for a in value.args if isinstance(getattr(a, "ty", None), relax.TensorType)]
    if out is None or not ins or any(d is None for d in ins):
        return False
    return math.prod(out) == max(math.prod(d) for d in ins)   # type: ignore[arg-type]


def fused_runs_serial(match: Match) -> bool | None:
    """Would the group's fused kernel run on one core (its ops' iterations summed, the buffers it reads and
    writes)? None when a shape is unknown."""
    sizes = [_kernel_size(var, value) for var, value in match.bindings.items()]
    if any(size is None for size in sizes):
        return None
    out = match.output_var()
    reads = sum(tensor_bytes(v) for v in [*match.input_vars(), *match.constants()])   # weights included
    nbytes = reads + (tensor_bytes(out) if out is not None else 0)
    return _serial((sum(size[0] for size in sizes), nbytes))   # type: ignore[index]


def serial_read_gbs(match: Match, var: relax.Var, nbytes: int, hw: Hardware) -> float | None:
    """The rate a group's intermediate moves at when every kernel of the group reading it runs on one core
    (:func:`runs_serial`) on a multi-core CPU and the fused kernel does not; None otherwise
    (:func:`bandwidth_gbs` applies). One core's L3 rate where the tensor fills more than half its L2; the
    cross-core rate where the kernel writing it ran in parallel (half of it sits in the other cores' L2); else
    one core's L2 rate.

    Why: at all cores' L2 rate, ResNet-18's conv + ReLU groups were predicted to save 2.4-12.5 us where their
    unfused ReLUs (serial, under 2 MiB of buffers) took 5-53 us, and its conv + add + ReLU groups, whose add ran
    in parallel at 56x56, ranked below them: rho 0.47-0.73 (SPR class, `benchmarks/regret.py`). Only for
    readers bound by moving the tensor (:func:`moves_its_tensor`): Whisper-tiny's serial LayerNorms (768 KB
    rows) charged so had its add + LayerNorm groups predicted 51-71 us against 7-39 measured, in the wrong
    order (rho 0.93 -> 0.81). Where the fused kernel is serial too, it reads the group's inputs at those
    rates as well, and the estimate keeps the caches' rates."""
    if hw.is_gpu or not hw.cross_core_gbs or hw.cores < 2:
        return None
    readers = [u for u in match.var_usages.get(var, []) if u in match.bindings]
    if not readers or not all(runs_serial(u, match.bindings[u]) and moves_its_tensor(u, match.bindings[u])
                              for u in readers):
        return None
    if fused_runs_serial(match) is not False:
        return None
    cores = max(1, hw.cores)
    if 2 * nbytes > hw.l2_bytes:
        return hw.l3_bandwidth_gbs / cores
    if runs_serial(var, match.bindings[var]) is False:
        return hw.cross_core_gbs
    return hw.l2_bandwidth_gbs / cores


#: Unfused, the passes over a tensor the size of the input that an exported decomposition's intermediates
#: make (each written once, read once per reader), by the label the recogniser tags it with
#: (compiler/passes/normalize.py). LayerNorm's nine nodes: the centred input (written, read by Pow and Div), its square,
#: the normalised and the scaled tensors; RMSNorm's five to seven: the square and the normalised tensor. The
#: rest (the means, eps added, the square root) hold one value a row: a kernel each, no traffic. Counted as
#: two full-size passes a node, LLaMA-tiny's RMSNorm groups were predicted at 7.3-9.0 us against 4-5 us
#: measured, above its gated-MLP groups (7.4 predicted, 7-8 measured; SPR class).
FULL_SIZE_PASSES = {"LayerNormalization": 9, "RMSNorm": 4}
#: Of a decomposition's nodes, those writing a full-size tensor (the rest write a value a row and cost the
#: VM's call, `Hardware.small_kernel_us`, not a full kernel's launch). Each charged a full launch, the row
#: nodes had LLaMA-tiny's RMSNorm groups predicted at 5.9-7.6 us against 3.4-4.4 measured, level with its
#: gated-MLP (7.4 predicted, 7.7-9.8 measured) and attention groups (7.7, 11.0-11.2): rho 0.46 (SPR class).
FULL_SIZE_NODES = {"LayerNormalization": 5, "RMSNorm": 2}


def decomposition_cost(match: Match, hw: Hardware) -> CostEstimate:
    """A rule that recognises a decomposed op (LayerNorm, RMSNorm written out as 5-9 ONNX nodes): each merged
    node was its own kernel, and its full-size intermediates made `FULL_SIZE_PASSES` over a tensor the size of
    the output (an unknown decomposition: two a node, every node full-size)."""
    base = intermediate_traffic_cost(match, hw)
    out = match.output_var()
    merged = merged_nodes(out)
    if merged < 2:
        return base
    label = tag_label(out.name) if out is not None else ""
    passes = FULL_SIZE_PASSES.get(label, 2 * (merged - 1))
    full = min(merged - 1, FULL_SIZE_NODES.get(label, merged - 1))
    launches_us = full * hw.launch_overhead_us + (merged - 1 - full) * hw.small_kernel_us
    nbytes = tensor_bytes(out)
    return CostEstimate(base.bytes_saved + passes * nbytes, base.launches_saved + merged - 1,
                        base.predicted_us + traffic_us(nbytes, passes, hw) + launches_us)


def merged_nodes(var: relax.Var | None) -> int:
    """How many ONNX nodes a binding stands for (a recognised `n1x2x3_Op` tag counts each)."""
    return max(1, len(tag_indices(var.name))) if var is not None else 1


# ----------------------------------------------------------------------------- the decision

#: Rules whose fused kernel is a matmul or conv with an epilogue: the CPU schedules tile one output, so a
#: group whose intermediate is also read outside (a second output) cannot be scheduled as one.
SINGLE_OUTPUT_RULES = frozenset({"conv2d_bias_act", "matmul_bias_gelu", "gated_mlp"})


@dataclass
class Decision:
    pattern: str
    variant: str
    fused: bool
    reason: str
    ops: list[str]
    anchor: str                   # name of the group's output var (ties the decision to the report)
    var_names: list[str]
    bytes_saved: int = 0
    launches_saved: int = 0
    predicted_us: float = 0.0
    onnx_nodes: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)   # names of the vars the group reads (links it to its call)
    key: str = ""                 # the group's structural key in the measured-decision database
    #: what decided: "estimate", "measured", "check", "legality", "user" or "veto" (the scheduler or the
    #: GPU resource check refused the fused kernel after it was built)
    source: str = "estimate"

    def to_dict(self) -> dict:
        return asdict(self)


def _fmt_bytes(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"


def decide(rule: PatternRule, match: Match, hw: Hardware, *, disabled: bool, disabled_why: str = "",
           disabled_source: str = "user", measured: Mapping[str, Measured] | None = None, target: str = "") -> Decision:
    """Refuse when disabled, illegal or infeasible; otherwise a measurement of this group's structure on this
    target decides where one exists (`fuseguard tune`), else the predicted benefit."""
    out = match.output_var()
    key = decision_key(rule.name, match.variant, match.ops, match.input_vars(), match.constants(), out, target)
    base = dict(pattern=rule.name, variant=match.variant, ops=match.ops, key=key,
                anchor=out.name if out is not None else "", var_names=match.var_names, inputs=match.input_names)
    estimate: CostEstimate = (rule.cost or intermediate_traffic_cost)(match, hw)
    numbers = dict(bytes_saved=estimate.bytes_saved, launches_saved=estimate.launches_saved,
                   predicted_us=estimate.predicted_us)
    if disabled:
        return Decision(fused=False, reason=disabled_why or f"pattern '{rule.name}' disabled", source=disabled_source,
                        **base, **numbers)
    illegal = convexity_violation(match.bindings, match.var_usages)
    if illegal:
        return Decision(fused=False, reason=illegal, source="legality", **base, **numbers)
    escaping = match.escaping()
    if escaping and rule.name in SINGLE_OUTPUT_RULES:
        return Decision(fused=False, source="legality", reason=(
            f"'{escaping[0].name}' is also used outside the group: a {rule.name} kernel with a second output has "
            f"no matmul/conv schedule (measured: AlexNet's classifier ran 12x slower that way)"), **base, **numbers)
    if rule.check is not None:
        why_not = rule.check(match, hw)
        if why_not:
            return Decision(fused=False, reason=why_not, source="check", **base, **numbers)
    found = (measured or {}).get(key)
    if found is not None:
        return Decision(fused=found.fuse, reason=found.reason, source="measured", **base, **numbers)
    if not estimate.beneficial:
        return Decision(fused=False, reason=f"no predicted benefit on {hw.name} (saves {_fmt_bytes(estimate.bytes_saved)})",
                        **base, **numbers)
    reason = (f"saves {_fmt_bytes(estimate.bytes_saved)} of memory traffic and {estimate.launches_saved} "
              f"kernel(s), ~{estimate.predicted_us:.1f} us on {hw.name}")
    return Decision(fused=True, reason=reason, **base, **numbers)
