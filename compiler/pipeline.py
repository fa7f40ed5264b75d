"""The whole compiler pipeline, in order, in one place.

    import (ONNX -> Relax, provenance tags `n<node>_<Op>`)          importer.py
    0b integer_matmuls             int8 QDQ, CPUs with VNNI: MatMul(DQ(Q(x)), DQ(int8 W)) as a u8 x s8 -> int32
                                    GEMM between a quantize and a dequantize, W kept int8 (compiler/passes/int8_gemm.py;
                                    kernel: compiler/schedule/cpu_matmul_int8.py)                  [int8_kernels]
    1  FoldConstantMoves, FoldConstant   reshapes/transposes of weights in numpy, then materialise weights built
                                    by ConstantOfShape/Expand/...
       NormalizeFlattenedGemm       reshape(Gemm(reshape(x))) -> MatMul (+bias) (GPT-2's Conv1D, ORT folds)
       ExpandSmallPowers            x^2, x^3 -> multiplies (powf does not vectorise)
       MaskedFillAsAdd              softmax(where(c, x, lowest)) -> softmax(x + mask): an attention pattern's mask
       FoldReshapedAdd              reshape(reshape(x) + c) -> x + c' (Swin's shifted-window mask)
       UnflattenScores              [B*H, S, S] scores split to [B, H, S, S] before their matmul, not after (BLOOM)
       Conv1dAsConv2d               conv1d as a height-1 conv2d (audio front ends: no conv1d kernel)
       Conv3dAsConv2d               conv3d as one conv2d per temporal tap over the frames, summed (video)
       DropPaddingTaps              kernel rows/columns that only ever read zero padding cut off (ASPP)
       KeepConv1dChains4D           elementwise ops between two such convs stay 4-D (the layout passes through)
    1b fold_fake_quant              int8 QDQ: each Quantize->Dequantize pair as exact fp32 arithmetic on the
                                    integer grid, so the layout and fusion see through it (compiler/passes/qdq.py)  [qdq]
                                    (the unfused build turns it back into its Q and DQ ops after step 4c)
    2  FoldBatchNorm                conv(+bias) -> BatchNorm folded into the conv weights     [bn_folding]
    3  DecomposeOpsForInference     the remaining BatchNorms to elementwise ops (before fusion, or
                                    conv and batch-norm never fuse)
    4  CanonicalizeBindings, DeadCodeElimination, FoldConstant                                 [dce]
    4b to_precision, CSE, FoldConstant   fp16/bf16: GEMM/conv operands in the reduced type, fp32
                                    accumulation, epilogues and statistics (compiler/passes/precision.py)  [precision]
    4c to_blocked                  CPU: convs in NCHW{lanes}c, the layout propagated, weights packed
                                    (compiler/passes/layout.py); the unfused build takes the same decision  [layout]
       pad_channels                 first: convs whose channels are not whole blocks padded with zero
                                    filters, the padding carried to the next conv (compiler/passes/padding.py)
                                                                                          [channel_padding]
       user passes "before_fusion"
    5  pattern fusion                                                                          [fusion]
       5a rule.prepare             rewrites a rule needs first (decomposed LayerNorm -> one op)
       5b FuseOpsByPattern         the table in patterns.py; each match decided by cost.decide with
                                   a reason, and stamped with that decision
       5c replacements             hand-written kernels for groups that have one (attention)
       user passes "after_fusion"
    6  DispatchSortScan, LegalizeOps, AnnotateTIROpPattern, FoldConstant   Relax ops -> TIR PrimFuncs
                                    (scans, sorts and sampling by TVM's dispatchers first; CUDA: grouped convs
                                    as batched GEMMs, compiler/cuda/legalize.py)
    7  FuseOps, FuseTIR             generic fusion of the rest, one PrimFunc per group          [fusion]
       user passes "after_tir_fusion"
    8  schedules                    CPU: compiler.schedule.cpu; CUDA: dlight GPU rules         [schedule]
                                    a pattern group no rule can schedule is vetoed (with that reason)
                                    and steps 1-8 run again without it
    9  lower + memory planning      StaticPlanBlockMemory, ... VMShapeLower
       9b concat_in_place          CPU: a concat of contiguous slices written in place by the kernels of
                                    its inputs, the copy dropped (compiler/passes/concat_in_place.py)  [concat_in_place]
   10  codegen                      tvm.compile for {"kind": "llvm", "mcpu": host} or {"kind": "cuda", "arch": sm_XX}
   10b SASS check (CUDA)            every kernel through nvcc/ptxas for sm_XX (compiler/cuda/sass.py): a fused
                                    group that spills, cannot launch, or loses more to occupancy than it
                                    saves (compiler/cuda/cost.py) is vetoed and steps 1-10 run again

The unfused build is the same pipeline with steps 5 and 7 off: the fallback users can always ship.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import onnx
import tvm
import tvm_ffi
from tvm import relax

from . import progress, settings
from .dynamic import DynamicDim, check_names, upper_bounds
from .errors import CompileError, FuseguardError, ShapeError, UsageError
from .hw import hostcpu
from .hw.hardware import Hardware, for_target
from .hw.target import TargetSpec, resolve
from .frontend.converters import subbyte
from .frontend.importer import ImportResult, import_folded, import_model, provenance_of
from .frontend.loader import LoadedModel, error_line, load
from .passes.normalize import (Conv1dAsConv2d, Conv3dAsConv2d, DropPaddingTaps, ExpandSmallPowers, FoldBatchNorm,
                               FoldConstantMoves, FoldReshapedAdd, KeepConv1dChains4D, MaskedFillAsAdd,
                               NormalizeFlattenedGemm, UnflattenScores)
from .passes.qdq import QdqSummary, as_qdq_ops, fold_fake_quant, legalize_map as qdq_legalize_map
from .passes.int8_gemm import integer_matmuls
from .passes.precision import check as precision_check, dtype_census, to_precision
from .passes.layout import LayoutSummary, legalize_map as layout_legalize_map, to_blocked
from .passes.legalize_fixes import FoldEmptyReductions, legalize_map as fixes_legalize_map
from .passes.concat_in_place import ConcatInPlace
from .fusion import cost, decisions, patterns, report
from .fusion.recognize import apply_replacements
from .ir import analysis
from .schedule.cpu_matmul_int8 import supported as int8_supported

STAGES = ("before_fusion", "after_fusion", "after_tir_fusion")
#: Pipeline stages whose failure on a directly imported model is retried through the ONNX Runtime fold
#: step: they run before anything of fuseguard's, so a failure there is about the imported graph's form.
#: How often lowering is retried after FuseOpsByPattern reports a cycle between two matches.
MAX_CYCLE_RETRIES = 8
_CYCLE = re.compile(r"cyclic dependency detected between the groups (\S+) and (\S+) are in")
EARLY_STAGES = frozenset({"fold_constant", "normalize", "bn_folding", "decompose", "dce", "legalize"})

PassLike = Callable[[tvm.IRModule], tvm.IRModule]
_USER_PASSES: dict[str, list[tuple[str, PassLike]]] = {s: [] for s in STAGES}


def register_pass(stage: str, fn: PassLike, name: str | None = None) -> PassLike:
    """Run `fn(mod) -> mod` at a named stage of every build (the public extension point for passes)."""
    if stage not in STAGES:
        raise UsageError(f"unknown pipeline stage {stage!r}; stages are: {', '.join(STAGES)}")
    _USER_PASSES[stage].append((name or getattr(fn, "__name__", "user_pass"), fn))
    return fn


def unregister_pass(stage: str, name: str) -> None:
    _USER_PASSES[stage] = [(n, f) for n, f in _USER_PASSES[stage] if n != name]


@dataclass(frozen=True)
class CompileOptions:
    """Every optimisation behind a switch. `CompileOptions(fusion=False)` is the unfused fallback."""

    gpu_arch: str | None = None
    mcpu: str | None = None
    fusion: bool = True
    disabled_patterns: frozenset[str] = frozenset()
    bn_folding: bool = True
    dce: bool = True
    schedule: bool = True
    num_threads: int | None = None
    extra_passes: tuple[tuple[str, PassLike], ...] = ()      # (stage, fn) for this build only
    #: measured-decision database (compiler/fusion/decisions.py): None = the architecture's default file,
    #: "" = estimates only
    decision_db: str | None = None
    #: CUDA builds: compile every kernel to SASS with nvcc and check its resources (compiler/cuda/sass.py):
    #: "auto" when a toolkit is found, "require" (no toolkit is an error) or "off"
    sass: str = "auto"
    #: dims kept symbolic (compiler/dynamic.py): one build serves every size of them
    dynamic: tuple[DynamicDim, ...] = ()
    #: "fp32", or "fp16"/"bf16": GEMM and conv operands in that type, accumulated in fp32 (compiler/passes/precision.py)
    precision: str = "fp32"
    #: CPU: convs in the channel-blocked layout NCHW{vector lanes}c (compiler/passes/layout.py)
    layout: bool = True
    #: with the layout step: convs whose channels are not whole blocks padded with zero filters first, so
    #: they block too (compiler/passes/padding.py)
    channel_padding: bool = True
    #: int8 QDQ models: Quantize->Dequantize pairs as fp32 elementwise ops on the integer grid (compiler/passes/qdq.py)
    qdq: bool = True
    #: int8 QDQ models on CPUs with VNNI: MatMuls on int8 weights as integer GEMMs (compiler/passes/int8_gemm.py)
    int8_kernels: bool = True
    #: CPU: a concatenation along an axis of contiguous slices written in place by its inputs' kernels, after
    #: memory planning (compiler/passes/concat_in_place.py)
    concat_in_place: bool = True

    def __post_init__(self) -> None:
        precision_check(self.precision)

    def unfused(self) -> "CompileOptions":
        """The fallback build; passes marked `fused_only` (they model a change to fusion, such as a fault placed
        in one fused kernel) are left out of it."""
        return replace(self, fusion=False, extra_passes=tuple((s, f) for s, f in self.extra_passes
                                                              if not getattr(f, "fused_only", False)))

    def to_dict(self, passes: Callable[[PassLike], Any] | None = None) -> dict[str, Any]:
        """Plain values, for the build cache's key, another tree's CompileOptions (the A/B gate) and the
        artifact manifest: frozensets sorted; user passes left out, or each as `passes(fn)`."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "extra_passes":
                if passes is None:
                    continue
                value = [(stage, passes(fn)) for stage, fn in value]
            elif isinstance(value, frozenset):
                value = sorted(value)
            elif f.name == "dynamic":
                value = [str(d) for d in value]
            out[f.name] = value
        return out

    @property
    def config_label(self) -> str:
        if not self.fusion:
            return "unfused"
        if self.disabled_patterns:
            return "fused-no:" + ",".join(sorted(self.disabled_patterns))
        return "fused"


@dataclass
class CompiledModel:
    name: str
    target: TargetSpec
    options: CompileOptions
    executable: Any
    report: report.FusionReport
    input_names: list[str]
    input_shapes: dict[str, tuple[int, ...]]
    output_names: list[str]
    compile_s: float
    lowered: tvm.IRModule | None = None      # the module handed to codegen (for inspection)
    cache_hit: bool = False                  # served from the build cache (compiler/cache.py)
    library_path: str | None = None          # the exported library, when one exists on disk
    load_s: float = 0.0                      # time to load a cached build
    #: symbolic builds: {dim name: [(input, axis), ...]} of each `--dynamic` dim (bounds in options.dynamic)
    dynamic_axes: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    #: output index -> ONNX type, for 4- and 2-bit outputs (returned in a byte container: compiler/frontend/converters/subbyte.py)
    narrow_outputs: dict[int, int] = field(default_factory=dict)
    _vm: Any = field(default=None, repr=False)

    def check_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        """A symbolic build's kernels trust its bounds (storage is planned for them): a size beyond one is a
        one-line ShapeError here, never an out-of-bounds write."""
        bounds = upper_bounds(self.options.dynamic)
        for dim, where in self.dynamic_axes.items():
            for inp, axis in where:
                size = np.shape(inputs[inp])[axis] if inp in inputs else None
                if size is not None and dim in bounds and size > bounds[dim]:
                    raise ShapeError(f"{self.name}: input '{inp}' has {dim}={size} at axis {axis}, beyond the "
                                     f"build's bound --dynamic {dim}<={bounds[dim]}")

    def device(self) -> tvm.runtime.Device:
        return tvm.cuda(0) if self.target.is_gpu else tvm.cpu(0)

    def vm(self) -> relax.VirtualMachine:
        if self._vm is None:
            if self.target.is_gpu:       # the kernels are compiled when the library loads (compiler/cuda/jit.py)
                from .cuda.jit import install

                install()
            self._vm = relax.VirtualMachine(self.executable, self.device())
        return self._vm

    def run(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        self.check_inputs(inputs)
        dev = self.device()
        args = [tvm.runtime.tensor(subbyte.container_input(np.asarray(inputs[n], order="C")), dev)
                for n in self.input_names]
        out = [to_numpy(t) for t in flatten_outputs(self.vm()["main"](*args))]
        for i, onnx_type in self.narrow_outputs.items():
            out[i] = subbyte.from_container(out[i], onnx_type)
        return out

    def time_fn(self, inputs: Mapping[str, np.ndarray]) -> Callable[[], None]:
        """A closure that runs the model once on pre-uploaded inputs (for timing)."""
        self.check_inputs(inputs)
        dev = self.device()
        args = [tvm.runtime.tensor(subbyte.container_input(np.asarray(inputs[n], order="C")), dev)
                for n in self.input_names]
        vm = self.vm()
        func = vm["main"]

        def once() -> None:
            func(*args)
            if self.target.is_gpu:
                dev.sync()

        return once

    def cuda_source(self) -> str:
        return generated_source(self.executable, "cuda")


def to_numpy(value: Any) -> np.ndarray:
    """One VM output as an array: a tensor, a shape value (ONNX `Shape` output, int64) or a scalar."""
    if isinstance(value, tvm.runtime.Tensor):
        return np.asarray(value.numpy())
    if isinstance(value, tvm_ffi.Shape):
        return np.asarray(list(value), dtype=np.int64)
    if isinstance(value, (bool, int, float, np.generic)):
        return np.asarray(value)
    raise TypeError(f"unexpected VM output of type {type(value).__name__}")


def flatten_outputs(value: Any) -> list[Any]:
    """The VM's (possibly nested) result as a flat list of outputs; a shape value is one output."""
    if isinstance(value, (tvm.runtime.Tensor, tvm_ffi.Shape)):
        return [value]
    if isinstance(value, (list, tuple)) or hasattr(value, "__len__") and not isinstance(value, (str, bytes)):
        out: list[Any] = []
        for item in value:
            out.extend(flatten_outputs(item))
        return out
    return [value]


def generated_source(executable: Any, kind: str = "cuda") -> str:
    """Device source code emitted for the executable (CUDA C for cuda targets)."""
    lib = getattr(executable, "mod", executable)
    texts = []
    stack = [lib]
    seen = set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        try:
            if m.kind == kind or (kind == "cuda" and m.kind in ("cuda", "ptx")):
                texts.append(m.inspect_source())
        except Exception:  # noqa: BLE001 - a module without source (a DSO import) has none to show
            pass
        try:
            stack.extend(m.imports)
        except Exception:  # noqa: BLE001 - a module kind without imports
            pass
    return "\n".join(texts)


# ----------------------------------------------------------------------------- fusion with decisions

def _fusion_patterns(options: CompileOptions, hw: Hardware, log: list[cost.Decision],
                     vetoed: dict[tuple[str, tuple[str, ...]], str], spec: TargetSpec) -> list[relax.transform.FusionPattern]:
    """FusionPatterns whose check asks the cost model, and that stamp each composite function with the id
    of the decision that made it (`fuseguard.decision`), so the report can name why every group exists."""
    out = []
    seen: dict[tuple[str, str], int] = {}
    by_root: dict[relax.Expr, int] = {}
    measured = decisions.load(decisions.db_path(spec.class_id, options.decision_db))
    for rule in patterns.rules():
        disabled = rule.name in options.disabled_patterns
        for variant, pat, ann in rule.variants():
            def check(ctx: relax.transform.PatternCheckContext, rule=rule, variant=variant, disabled=disabled) -> bool:
                usages = {k: list(v) for k, v in ctx.var_usages.items()}
                match = patterns.Match(pattern=rule.name, variant=variant, annotated=dict(ctx.annotated_expr),
                                       bindings=dict(ctx.matched_bindings), var_usages=usages)
                veto = vetoed.get((rule.name, tuple(match.input_names)))
                decision = cost.decide(rule, match, hw, disabled=disabled or veto is not None,
                                       disabled_why=veto or f"pattern '{rule.name}' disabled by the user (--disable-pattern)",
                                       disabled_source="veto" if veto is not None and not disabled else "user",
                                       measured=measured, target=spec.class_id)
                key = (rule.name, decision.anchor)
                if key not in seen:
                    seen[key] = len(log)
                    log.append(decision)
                elif decision.fused:
                    earlier = log[seen[key]]
                    if not earlier.fused and earlier.variant != decision.variant:
                        # keep why the more specific variant was refused (e.g. not convex): explainable
                        decision.reason += f"; variant {earlier.variant} refused: {earlier.reason}"
                    log[seen[key]] = decision
                if "root" in ctx.annotated_expr:
                    by_root[ctx.annotated_expr["root"]] = seen[key]
                return decision.fused

            def attrs(annotated: dict, by_root=by_root) -> dict[str, str]:
                index = by_root.get(annotated.get("root")) if "root" in annotated else None
                return {"fuseguard.decision": str(index)} if index is not None else {}

            out.append(relax.transform.FusionPattern(f"fuseguard.{rule.name}", pat, ann, check, attrs))
    return out


def _run_user_passes(stage: str, mod: tvm.IRModule, options: CompileOptions) -> tvm.IRModule:
    for name, fn in list(_USER_PASSES[stage]) + [(getattr(f, "__name__", "pass"), f) for s, f in options.extra_passes if s == stage]:
        try:
            mod = fn(mod)
        except Exception as err:
            raise CompileError(f"user pass '{name}' at stage '{stage}' failed: {type(err).__name__}: {err}") from err
        if not isinstance(mod, tvm.IRModule):
            raise CompileError(f"user pass '{name}' at stage '{stage}' returned {type(mod).__name__}, not an IRModule")
    return mod


def _schedule_gpu(mod: tvm.IRModule, target: tvm.target.Target) -> tuple[tvm.IRModule, dict[str, str], dict[str, str]]:
    """dlight's GPU rules (the list TVM's own CUDA pipeline uses), first that applies wins, as
    `dl.ApplyDefaultSchedule` does, but recording which rule took each PrimFunc: a matmul or conv left to
    `Fallback` runs as plain thread-bound loops, and the report says so."""
    from tvm import tirx
    from tvm.s_tir import dlight as dl

    rules = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    left_alone: dict[str, str] = {}
    scheduled: dict[str, str] = {}
    updated = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        if func.attrs is not None and "tirx.is_scheduled" in func.attrs and int(func.attrs["tirx.is_scheduled"]) == 1:
            left_alone[gv.name_hint] = "already scheduled"
            continue
        for rule in rules:
            space = rule.apply(func, target, False)
            if space is None:
                continue
            sch = space if not isinstance(space, (list, tuple)) else space[0]
            updated[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
            scheduled[gv.name_hint] = f"dlight.gpu.{type(rule).__name__}"
            break
        else:
            left_alone[gv.name_hint] = "no dlight GPU rule applies"
    for gv, func in updated.items():
        mod[gv] = func
    return mod, left_alone, scheduled


def _schedule(mod: tvm.IRModule, spec: TargetSpec, target: tvm.target.Target,
              options: CompileOptions) -> tuple[tvm.IRModule, dict[str, str], dict[str, str]]:
    """Schedule every PrimFunc; return the module, {function: why no schedule applied} and
    {function: the rule that scheduled it}."""
    if spec.is_gpu:
        return _schedule_gpu(mod, target)
    if not options.schedule:
        return mod, {}, {}
    from .schedule.cpu import schedule_cpu_module_with_report

    mod, sched = schedule_cpu_module_with_report(mod, target, enabled=True, num_threads=options.num_threads)
    return mod, dict(sched.left_alone), dict(sched.scheduled)


def lower(mod: tvm.IRModule, spec: TargetSpec, options: CompileOptions, *, name: str = "model",
          provenance: Callable[[list[str]], list[str]] | None = None,
          vetoed: Mapping[tuple[str, tuple[str, ...]], str] | None = None) -> tuple[tvm.IRModule, report.FusionReport]:
    """Steps 1-9: a Relax module in, a module ready for codegen and its fusion report out.

    A pattern group whose fused kernel no schedule rule can handle would run as naive loops, far slower
    than its unfused parts (measured: 100x for a merged attention on CPU). Such groups are vetoed with
    that reason and the module is lowered once more: the scheduler has the last word on a fusion.
    """
    vetoed = dict(vetoed or {})
    for _ in range(MAX_CYCLE_RETRIES):
        try:
            lowered, rep, unscheduled = _lower(mod, spec, options, name=name, provenance=provenance, vetoed=vetoed)
            break
        except CompileError as err:
            # Two matches each convex on their own can still depend on each other (A reads B's output
            # and B reads A's): FuseOpsByPattern stops with "cyclic dependency detected between the
            # groups X and Y". Refuse the match holding Y and fuse again.
            found = _CYCLE.search(str(err))
            if err.stage != "pattern_fusion" or found is None or err.__cause__ is None:
                raise
            decision = getattr(err, "decisions", None)
            culprit = next((d for d in (decision or []) if d.fused and found.group(2) in d.var_names), None)
            if culprit is None:
                raise
            vetoed[(culprit.pattern, tuple(culprit.inputs))] = (
                f"fused together with the group of '{found.group(1)}' it would form a dependency cycle "
                f"(each group needs the other's output)")
    else:
        raise CompileError(f"{name}: pattern fusion kept forming dependency cycles", stage="pattern_fusion")
    if not unscheduled:
        return lowered, rep
    vetoed = {**vetoed, **{(d.pattern, tuple(d.inputs)): f"the fused kernel has no {spec.label} schedule ({why}); "
                                                         f"unfused parts are scheduled and faster"
                           for d, why in unscheduled}}
    lowered, rep2, _ = _lower(mod, spec, options, name=name, provenance=provenance, vetoed=vetoed)
    rep2.compile_s += rep.compile_s
    return lowered, rep2


def _lower(mod: tvm.IRModule, spec: TargetSpec, options: CompileOptions, *, name: str,
           provenance: Callable[[list[str]], list[str]] | None,
           vetoed: dict[tuple[str, tuple[str, ...]], str]):
    target = spec.tvm_target()
    hw = for_target("cuda" if spec.is_gpu else "cpu", spec.arch)
    provenance = provenance or (lambda names: [])
    rep = report.FusionReport(model=name, target=spec.label, fusion=options.fusion,
                              disabled_patterns=sorted(options.disabled_patterns))
    t0 = time.perf_counter()

    def stage(label: str, passes: Sequence[tvm.transform.Pass], m: tvm.IRModule) -> tvm.IRModule:
        progress.stage(label)
        start = time.perf_counter()
        try:
            with target:
                m = tvm.transform.Sequential(list(passes))(m)
        except Exception as err:  # a TVM pass failing: name the stage, keep the cause for --debug
            raise CompileError(f"{name}: stage '{label}' failed for {spec.label}: {type(err).__name__}: "
                               f"{error_line(err)}", stage=label) from err
        rep.stage_s[label] = rep.stage_s.get(label, 0.0) + time.perf_counter() - start
        return m

    T = relax.transform
    bounds = upper_bounds(options.dynamic)
    if bounds:      # StaticPlanBlockMemory plans storage for the bound instead of allocating per call
        mod["main"] = mod["main"].with_attr("tir_var_upper_bound", {k: tvm.tirx.IntImm("int64", v)
                                                                    for k, v in bounds.items()})
    rep.dynamic = [str(d) for d in options.dynamic]
    int8_matmuls = int8_quantizes = 0
    lanes = int8_supported(target) if options.qdq and options.int8_kernels and not spec.is_gpu else 0
    if lanes:
        found: list[int] = []

        def _int8(m: tvm.IRModule, _ctx: object) -> tvm.IRModule:
            out, matmuls, quantizes = integer_matmuls(m, lanes)
            found[:] = [matmuls, quantizes]
            return out

        mod = stage("int8_kernels", [tvm.transform.module_pass(_int8, opt_level=0, name="IntegerMatmuls")], mod)
        int8_matmuls, int8_quantizes = found
    mod = stage("fold_constant", [FoldConstantMoves, FoldEmptyReductions, T.FoldConstant()], mod)
    mod = stage("normalize", [NormalizeFlattenedGemm, ExpandSmallPowers, FoldReshapedAdd, UnflattenScores,
                              MaskedFillAsAdd, Conv1dAsConv2d, Conv3dAsConv2d, DropPaddingTaps, KeepConv1dChains4D],
                mod)
    if options.qdq:
        qdq_summary: list[QdqSummary] = []

        def _fold_qdq(m: tvm.IRModule, _ctx: object) -> tvm.IRModule:
            out, summary = fold_fake_quant(m)
            qdq_summary.append(replace(summary, int8_matmuls=int8_matmuls,
                                       quantize_left=summary.quantize_left - int8_quantizes,
                                       dequantize_left=summary.dequantize_left - int8_matmuls))
            return out

        mod = stage("qdq", [tvm.transform.module_pass(_fold_qdq, opt_level=0, name="FoldFakeQuant")], mod)
        rep.qdq = qdq_summary[-1].line()
    if options.bn_folding:
        mod = stage("bn_folding", [FoldBatchNorm, T.FoldConstant()], mod)
    mod = stage("decompose", [T.DecomposeOpsForInference()], mod)
    if options.dce:
        mod = stage("dce", [T.CanonicalizeBindings(), T.DeadCodeElimination(["main"]), T.FoldConstant()], mod)
    if options.precision != "fp32":
        low = tvm.transform.module_pass(lambda m, _ctx: to_precision(m, options.precision), opt_level=0,
                                        name="ToPrecision")
        mod = stage("precision", [low, T.EliminateCommonSubexpr(), T.FoldConstant()], mod)
    rep.precision = options.precision
    if options.layout and not spec.is_gpu:
        lanes = hostcpu.host_from_target(target).fp32_lanes
        chosen: list = []

        def _blocked(m: tvm.IRModule, _ctx: object) -> tvm.IRModule:
            out, summary = to_blocked(m, lanes, options.channel_padding)
            chosen.append(summary)
            return out

        mod = stage("layout", [tvm.transform.module_pass(_blocked, opt_level=0, name="ToBlocked")], mod)
        rep.layout = chosen[-1].line()
    else:
        rep.layout = LayoutSummary().line()
    if options.qdq and not options.fusion:   # the unfused build runs each pair as its Q and DQ kernels
        mod = stage("qdq_ops", [tvm.transform.module_pass(lambda m, _ctx: as_qdq_ops(m), opt_level=0,
                                                          name="AsQdqOps")], mod)
    rep.dtypes = dtype_census(mod) if options.precision != "fp32" else {}
    mod = _run_user_passes("before_fusion", mod, options)

    decisions: list[cost.Decision] = []
    links: dict[str, cost.Decision] = {}
    replaced_calls: list[tuple[str, cost.Decision]] = []
    not_replaced: list[tuple[cost.Decision, str]] = []
    if options.fusion:
        for rule in patterns.rules():
            if rule.prepare is not None and rule.name not in options.disabled_patterns:
                start = time.perf_counter()
                mod, _ = rule.prepare(mod)
                # the rewritten decomposition is dead now: drop it before the next rule's prepare or the
                # matcher sees it (an RMSNorm inside a dead LayerNorm decomposition, a phantom consumer)
                mod = T.DeadCodeElimination(["main"])(mod)
                rep.stage_s[f"prepare_{rule.name}"] = time.perf_counter() - start
        fusion_patterns = _fusion_patterns(options, hw, decisions, vetoed, spec)
        try:
            with cost.decide_at({d.name: d.decide_size for d in options.dynamic}):
                mod = stage("pattern_fusion", [T.FuseOpsByPattern(fusion_patterns, bind_constants=False,
                                                                  annotate_codegen=False)], mod)
        except CompileError as err:
            err.decisions = decisions        # type: ignore[attr-defined]  # for the cycle retry in lower()
            raise
        if options.dynamic:     # say at which size an estimate was made for a symbolic dim
            at = ", ".join(f"{d.name}={d.decide_size} ({'its bound' if d.upper else 'representative'})"
                           for d in options.dynamic)
            for d in decisions:
                if d.source == "estimate":
                    d.reason += f"; symbolic dims estimated at {at}"
        links = report.link_decisions(mod, decisions)
        start = time.perf_counter()
        wanted = {gv: patterns.PATTERNS[d.pattern].replacement for gv, d in links.items()
                  if d.pattern in patterns.PATTERNS and patterns.PATTERNS[d.pattern].replacement is not None}
        with target, cost.decide_at({d.name: d.decide_size for d in options.dynamic}):
            mod, replaced, refused = apply_replacements(mod, wanted, spec)    # kernels tiled at the same sizes
        # A group fused only for its hand-written kernel (attention) that the kernel refused would be merged by
        # FuseTIR into one loop nest holding S x S: torchvision Swin-V2's cosine attention (a per-head scale)
        # ran 45 ms against 0.96 ms for its parts. Vetoed like an unschedulable group: lowered again unfused.
        not_replaced = [(links[c], f"the hand-written {links[c].pattern} kernel does not take this group's form, and "
                         f"one merged loop nest would hold the whole score matrix")
                        for c in dict.fromkeys(refused) if c in links]
        links.update({kernel: links[composite] for kernel, composite in replaced})
        replaced_calls = [(kernel, links[composite]) for kernel, composite in replaced]
        rep.stage_s["replacements"] = time.perf_counter() - start
    mod = _run_user_passes("after_fusion", mod, options)

    if spec.is_gpu:   # grouped convs as batched GEMMs dlight's Matmul rule schedules (compiler/cuda/legalize.py)
        from .cuda.legalize import legalize_map

        legalize = T.LegalizeOps(customize_legalize_map={**fixes_legalize_map(), **legalize_map(), **qdq_legalize_map()})
    else:       # the blocked convs of step 4c to their own computes (compiler/passes/layout.py)
        legalize = T.LegalizeOps(customize_legalize_map={**fixes_legalize_map(), **layout_legalize_map(),
                                                          **qdq_legalize_map()})
    # cumsum/cumprod, sort/argsort/topk and sampling have no LegalizeOps rule: TVM's backends dispatch them to
    # their TE/TIR kernels first (a RoBERTa export's position ids, CumSum, reached codegen as R.cumsum)
    dispatch = [relax.backend.DispatchSampling(), relax.backend.DispatchSortScan()]
    mod = stage("legalize", [*dispatch, legalize, T.AnnotateTIROpPattern(), T.FoldConstant()], mod)
    rep.ops_before_fusion = analysis.count_kernels(mod)
    if options.fusion:
        legalized = mod
        mod = stage("fuse_ops", [T.FuseOps()], mod)
        start = time.perf_counter()
        try:
            sites = analysis.call_site_provenance(legalized)
        except Exception:  # provenance is a report nicety; never fail a build over it
            sites = None
        rep.stage_s["provenance"] = time.perf_counter() - start
        rep.groups = report.fused_groups(mod, provenance, decisions, links, sites, replaced_calls)
        mod = stage("fuse_tir", [T.FuseTIR()], mod)
    for d in decisions:
        if not d.onnx_nodes:
            d.onnx_nodes = provenance(d.var_names)
    rep.decisions = decisions
    mod = _run_user_passes("after_tir_fusion", mod, options)

    start = time.perf_counter()
    progress.stage("schedule")
    with target:
        mod, left_alone, scheduled = _schedule(mod, spec, target, options)
    rep.stage_s["schedule"] = time.perf_counter() - start
    rep.schedules = {**scheduled, **{k: f"left alone: {why}" for k, why in left_alone.items()}}
    report.attach_kernels(mod, rep.groups)
    rep.call_sites = report.kernel_call_sites(mod, rep.groups, provenance)
    unscheduled = [(links[g.function], left_alone[g.kernel]) for g in rep.groups
                   if g.pattern != "generic" and g.kernel in left_alone and g.function in links
                   and left_alone[g.kernel] != "already scheduled"] + not_replaced

    plan = [T.RewriteDataflowReshape(), T.ToNonDataflow(), T.RemovePurityChecking(), T.CallTIRRewrite(),
            T.StaticPlanBlockMemory()]
    finalize = [T.RewriteCUDAGraph()] if spec.is_gpu else []
    finalize += [T.LowerAllocTensor(), T.KillAfterLastUse(), T.LowerRuntimeBuiltin(), T.ComputePrimValue(),
                 T.VMShapeLower(), T.AttachGlobalSymbol()]
    rep.kernels = analysis.count_kernels(mod)
    rep.traffic_bytes, rep.min_traffic_bytes = analysis.memory_traffic(mod)
    mod = stage("memory_plan", plan, mod)
    if options.concat_in_place and not spec.is_gpu:
        dropped: list[tuple[str, frozenset]] = []
        mod = stage("concat_in_place", [ConcatInPlace(dropped)], mod)
        if dropped:
            kept = report.without_calls(rep.call_sites, dropped)
            rep.traffic_bytes -= sum(s["bytes"] for s in rep.call_sites) - sum(s["bytes"] for s in kept)
            rep.kernels, rep.call_sites = rep.kernels - len(dropped), kept
            rep.memory = f"memory: {len(dropped)} concatenation(s) written in place by the kernels of their inputs"
    mod = stage("memory_plan", finalize, mod)
    rep.planned_bytes = analysis.planned_bytes(mod)
    rep.compile_s = time.perf_counter() - t0
    return mod, rep, unscheduled


def build(mod: tvm.IRModule, spec: TargetSpec) -> Any:
    """Step 10: codegen. CUDA builds need no GPU: TVM emits CUDA source and compiles it with NVRTC/nvcc lazily."""
    return tvm.compile(mod, target=spec.tvm_target(), relax_pipeline=None)


def _lower_and_build(mod: tvm.IRModule, spec: TargetSpec, options: CompileOptions, *, name: str,
                     provenance: Callable[[list[str]], list[str]] | None,
                     vetoed: Mapping[tuple[str, tuple[str, ...]], str] | None = None):
    lowered, rep = lower(mod, spec, options, name=name, provenance=provenance, vetoed=vetoed)
    progress.stage("codegen")
    try:
        exe = build(lowered, spec)
    except Exception as err:
        raise CompileError(f"{name}: code generation for {spec.label} failed: {type(err).__name__}: "
                           f"{str(err).strip().splitlines()[-1] if str(err).strip() else ''}",
                           stage="codegen") from err
    return lowered, rep, exe


def _sass_of(exe: Any, lowered: tvm.IRModule, rep: report.FusionReport, spec: TargetSpec, name: str) -> Any:
    from .cuda import sass

    groups = {g.kernel: g.pattern for g in rep.groups}
    progress.stage("sass")
    start = time.perf_counter()
    try:
        result = sass.check(generated_source(exe, "cuda"), lowered, spec.arch, for_target("cuda", spec.arch), groups,
                            schedules=rep.schedules)
    except CompileError as err:
        raise CompileError(f"{name}: {err}", stage="sass") from err
    rep.stage_s["sass"] = rep.stage_s.get("sass", 0.0) + time.perf_counter() - start
    return result


def _check_gpu_kernels(mod: tvm.IRModule, spec: TargetSpec, options: CompileOptions, lowered: tvm.IRModule,
                       rep: report.FusionReport, exe: Any, *, name: str,
                       provenance: Callable[[list[str]], list[str]] | None):
    """Step 10b (CUDA): every kernel compiled to SASS for the architecture (compiler/cuda/sass.py). A fused
    group whose kernel spills, cannot launch, or whose occupancy the GPU cost model predicts makes it
    slower than its parts (compiler/cuda/cost.py) is vetoed and the build is redone without it; a kernel
    with a problem that no veto can remove fails the build, naming it."""
    from .cuda import cost as gpu_cost, sass

    if sass.find_toolkit() is None:
        if options.sass == "require":
            sass.require_toolkit()
        return lowered, rep, exe
    hw = for_target("cuda", spec.arch)

    def _occ(k: Any) -> float:
        return gpu_cost.effective_occupancy(hw, k.occupancy, k.threads, k.grid)

    result = _sass_of(exe, lowered, rep, spec, name)
    # a group's decision by (pattern, anchor): structural keys are shared by identical groups
    decision_of = {(d.pattern, d.anchor): d for d in rep.decisions if d.fused}
    vetoes: dict[tuple[str, tuple[str, ...]], str] = {}
    by_function: dict[str, list[sass.KernelResources]] = {}
    for k in result.kernels:
        by_function.setdefault(k.function, []).append(k)
    suspects = []
    for g in rep.pattern_groups:
        d = decision_of.get((g.pattern, g.output_var))
        kernels = by_function.get(g.kernel, [])
        if d is None or not kernels:
            continue
        bad = [p for k in kernels for p in k.problems]
        if bad:
            vetoes[(d.pattern, tuple(d.inputs))] = (f"the fused kernel {bad[0]} on {spec.arch} (ptxas); built "
                                                    f"without this fusion")
        elif min(_occ(k) for k in kernels) < gpu_cost.saturation(hw):
            suspects.append((g, d, kernels))
    if suspects:
        # below saturation occupancy costs bandwidth: weigh it against the parts, built and checked unfused
        try:
            parts_build = compile_relax(mod, replace(options.unfused(), sass="auto"), name=name, provenance=provenance)
        except CompileError as err:
            # the parts do not build for this architecture: nothing to weigh against, the fused build stands
            suspects, parts_build = [], None
            progress.stage(f"sass: parts not weighed ({error_line(err)})")
        parts_sass = sass.SassReport.from_dict((parts_build.report.sass if parts_build else None)
                                               or {"arch": spec.arch, "toolkit": "", "flags": []})
        occ = {}
        for k in parts_sass.kernels:
            occ[k.function] = min(occ.get(k.function, 1.0), _occ(k))
        for g, d, kernels in suspects:
            parts = [(s["bytes"], occ.get(s["kernel"], 1.0), s["flops"])
                     for s in gpu_cost.parts_of(g.onnx_nodes, parts_build.report.call_sites)]
            site = next((s for s in rep.call_sites if s["kernel"] == g.kernel), None)
            if not parts or site is None:
                continue
            verdict = gpu_cost.compare(hw, g.kernel, site["bytes"], min(_occ(k) for k in kernels), parts)
            if verdict.slower:
                vetoes[(d.pattern, tuple(d.inputs))] = verdict.reason(hw)
    if vetoes:
        lowered, rep, exe = _lower_and_build(mod, spec, options, name=name, provenance=provenance, vetoed=vetoes)
        result = _sass_of(exe, lowered, rep, spec, name)
    rep.sass = result.to_dict()
    broken = result.problems()
    if broken:
        k = broken[0]
        what = f"group '{k.group}' " if k.group else ""
        raise CompileError(f"{name}: {what}kernel {k.kernel} cannot run on {spec.arch}: {k.problems[0]}"
                           f"{f' (and {len(broken) - 1} more kernel(s))' if len(broken) > 1 else ''}", stage="sass")
    return lowered, rep, exe


def compile_relax(mod: tvm.IRModule, options: CompileOptions = CompileOptions(), *, name: str = "model",
                  input_names: Sequence[str] | None = None, input_shapes: Mapping[str, tuple[int, ...]] | None = None,
                  output_names: Sequence[str] | None = None,
                  provenance: Callable[[list[str]], list[str]] | None = None) -> CompiledModel:
    """Compile a Relax IRModule (entry `main`) through the pipeline."""
    spec = resolve(options.gpu_arch, options.mcpu)
    if options.num_threads is None and not spec.is_gpu:
        options = replace(options, num_threads=settings.integer("TVM_NUM_THREADS") or spec.num_cores)
    unknown = set(options.disabled_patterns) - set(patterns.pattern_names())
    if unknown:
        raise UsageError(f"--disable-pattern: unknown pattern(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(patterns.pattern_names())}")
    start = time.perf_counter()
    lowered, rep, exe = _lower_and_build(mod, spec, options, name=name, provenance=provenance)
    if spec.is_gpu and options.sass != "off":
        lowered, rep, exe = _check_gpu_kernels(mod, spec, options, lowered, rep, exe, name=name,
                                               provenance=provenance)
    compile_s = time.perf_counter() - start
    rep.compile_s = compile_s
    params = [p.name for p in mod["main"].params]
    names = list(input_names) if input_names is not None else params
    return CompiledModel(name=name, target=spec, options=options, executable=exe, report=rep, input_names=names,
                         input_shapes=dict(input_shapes or {}), output_names=list(output_names or []),
                         compile_s=compile_s, lowered=lowered)


def _import_once(loaded: LoadedModel, dynamic: Sequence[DynamicDim],
                 how: Callable[[LoadedModel, Sequence[DynamicDim]], ImportResult]) -> ImportResult:
    """Import `loaded` once for every build made from it (verify builds fused and unfused from one
    LoadedModel: the second build reuses the first one's import). Each build gets its own copy of the
    module, since later steps update functions in place; the functions themselves are immutable."""
    key = (how.__name__, tuple(dynamic))
    if key not in loaded.imports:
        loaded.imports[key] = how(loaded, dynamic)
    shared = loaded.imports[key]
    return replace(shared, mod=shared.mod.clone())


def compile_model(source: str | os.PathLike | bytes | onnx.ModelProto | LoadedModel | tvm.IRModule,
                  shapes: Mapping[str, Sequence[int]] | None = None,
                  options: CompileOptions = CompileOptions(), *, name: str | None = None) -> CompiledModel:
    """ONNX (path, bytes, ModelProto) or a Relax IRModule in; a runnable CompiledModel out."""
    if isinstance(source, tvm.IRModule):
        return compile_relax(source, options, name=name or "module")
    loaded = source if isinstance(source, LoadedModel) else load(source, shapes, name=name,
                                                                 dynamic=options.dynamic)
    start = time.perf_counter()
    progress.stage("import")
    imported: ImportResult = _import_once(loaded, options.dynamic, import_model)
    import_s = time.perf_counter() - start

    def build_from(result: ImportResult) -> CompiledModel:
        return compile_relax(result.mod, options, name=loaded.name, input_names=list(loaded.input_shapes),
                             input_shapes=loaded.input_shapes, output_names=loaded.output_names,
                             provenance=lambda names: provenance_of(names, result))

    try:
        compiled = build_from(imported)
    except CompileError as err:
        # Exporters' shape subgraphs (Shape -> Range -> ...) can import as tensors of unknown shape that
        # the first passes cannot handle (a YOLOv8 head, torchvision's shufflenet): fold them with ONNX
        # Runtime and build once more, saying so in the report.
        if imported.prepared or err.stage not in EARLY_STAGES:
            raise
        start = time.perf_counter()
        try:
            imported = _import_once(loaded, options.dynamic, import_folded)
        except FuseguardError:
            raise err from None
        import_s += time.perf_counter() - start
        try:
            compiled = build_from(imported)
        except CompileError as second:
            raise CompileError(f"{second} (also after folding shape computations with ONNX Runtime; first "
                               f"try: stage '{err.stage}')", stage=second.stage) from second
    if options.dynamic:
        compiled.dynamic_axes = check_names(loaded.model, options.dynamic, loaded.name)
    compiled.narrow_outputs = subbyte.output_types(loaded.model)
    if imported.prepared:
        compiled.report.imported_via = "onnxruntime-fold"
    compiled.report.stage_s["import"] = import_s
    compiled.compile_s += import_s
    return compiled
