"""The bisection itself: probe both builds kernel by kernel, align them, walk in execution order to the
first group that drifts (or bisect the ONNX graph when the unfused build is already wrong)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fuseguard.compiler.errors import FuseguardError, UsageError

from ...check.compare import (CompareResult, OutputCompareResult, Tolerance, Tolerances, compare_outputs,
                              uninformative_outputs)
from .graph import OnnxGraph, close, compare_one, expose, extract, max_abs, stem, tolerance_for
from .results import BLAME_FUSION, BLAME_LOWERING, BisectResult, Culprit, Reproducer

if TYPE_CHECKING:
    from fuseguard.compiler.capture import Alignment, CaptureManifest, CapturedKernel
    from fuseguard.compiler.frontend.loader import LoadedModel
    from fuseguard.compiler.pipeline import CompileOptions, CompiledModel


def _anchors(build: "_Build") -> dict[str, str]:
    """Fused capture key -> the pattern group's output var before fusion (the cost model's anchor).

    Only for functions called once: FuseOps/FuseTIR merge structurally identical groups into one
    function, and the report then repeats that function's first anchor for every call.
    """
    from fuseguard.compiler.capture import node_index

    calls: dict[str, list[str]] = {}
    for k in build.manifest.kernels:
        if k.tuple_index in (None, 0):
            calls.setdefault(k.function, []).append(k.key)
    seen: dict[str, int] = {}
    out: dict[str, str] = {}
    for g in build.compiled.report.groups:
        i = seen.get(g.function, 0)
        seen[g.function] = i + 1
        keys = calls.get(g.function, [])
        if g.pattern != "generic" and len(keys) == 1 and i == 0 and node_index(g.output_var) is not None:
            out[keys[i]] = g.output_var
    return out


@dataclass
class _Build:
    compiled: "CompiledModel"
    manifest: "CaptureManifest"
    outputs: list[np.ndarray]
    captures: dict[str, np.ndarray]


class _Bisector:
    def __init__(self, loaded: "LoadedModel", options: "CompileOptions", inputs: dict[str, np.ndarray],
                 tolerances: Tolerances, out_dir: Path, confirm: bool, strategy: str) -> None:
        self.loaded, self.options, self.inputs = loaded, options, inputs
        self.tolerances, self.out_dir, self.confirm, self.strategy = tolerances, out_dir, confirm, strategy
        self.graph = OnnxGraph(loaded.model)
        self.result = BisectResult(model=loaded.name, target="", status="drift")
        self.fp64: Any = None    # a reduced build's outputs vs fp64 (verify.check.precision.Fp64Check)
        self.per_output: dict[str, Tolerance] | None = None     # per-tensor tolerances (reduced precision)
        #: capture keys of fused suspects searched past (refuted, or without a cut-out): their consumers are
        #: judged as if they agreed, and their captured values are not fed to later cut-outs
        self.refuted: set[str] = set()
        #: each tried suspect's reproducer (by id), so the one shown is always the reported culprit's
        self.reproducers: dict[int, Reproducer | None] = {}
        self.start = time.perf_counter()

    # -- steps

    def _timed(self, label: str, start: float) -> None:
        self.result.timings[label] = self.result.timings.get(label, 0.0) + time.perf_counter() - start

    def build(self, options: "CompileOptions", label: str) -> _Build:
        from fuseguard.compiler.capture import CapturePass
        from fuseguard.compiler.pipeline import compile_model

        capture = CapturePass()
        opts = dataclasses.replace(options, extra_passes=tuple(options.extra_passes) + (("after_tir_fusion", capture),))
        start = time.perf_counter()
        compiled = compile_model(self.loaded, options=opts)
        self.result.builds += 1
        self._timed(f"build {label}", start)
        start = time.perf_counter()
        flat = compiled.run(self.inputs)
        self._timed(f"run {label}", start)
        outputs, captures = capture.manifest.split(flat)
        return _Build(compiled, capture.manifest, outputs, captures)

    def onnx_tensors(self, manifest: "CaptureManifest") -> dict[str, str]:
        """Capture key -> the ONNX tensor it holds (model inputs, tagged node outputs, model outputs)."""
        from fuseguard.compiler.capture import node_index

        out: dict[str, str] = dict(zip(manifest.params, self.loaded.input_shapes))
        folded = self.options.bn_folding
        for k in manifest.kernels:
            index = node_index(k.key) if "#" not in k.key else None
            tensor = self.graph.node_tensor(index, folded) if index is not None else None
            if tensor is not None:
                out[k.key] = tensor
        for key, name in zip(manifest.outputs, self.loaded.output_names):
            if key:
                out[key] = name
        return out

    def node_names(self, keys: Sequence[str]) -> tuple[list[str], list[str]]:
        from fuseguard.compiler.capture import node_indices

        idx = sorted({i for k in keys for i in node_indices(k) if i < len(self.graph.nodes)})
        return [self.graph.nodes[i].name for i in idx], [self.graph.nodes[i].op_type for i in idx]

    def run(self) -> BisectResult:
        from fuseguard.compiler.capture import align
        from fuseguard.compiler.hw.target import cuda_device_present, resolve

        from ...check.reference import run_onnxruntime

        res = self.result
        spec = resolve(self.options.gpu_arch, self.options.mcpu)
        res.target = spec.label
        if spec.is_gpu and not cuda_device_present():
            return self._untestable("no CUDA device to run the build on")
        try:
            fused = self.build(self.options, "fused")
            unfused = self.build(self.options.unfused(), "unfused")
        except FuseguardError as err:
            if isinstance(err, UsageError):
                raise
            return self._untestable(str(err))
        except Exception as err:  # a TVM failure while building or running: this commit cannot be tested
            return self._untestable(f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}")

        u2onnx = self.onnx_tensors(unfused.manifest)
        start = time.perf_counter()
        wanted = [t for k, t in u2onnx.items() if k not in unfused.manifest.params]
        reference = run_onnxruntime(expose(self.loaded.model, wanted), self.inputs)
        self._timed("onnxruntime", start)
        names = self.loaded.output_names
        gold: dict[str, np.ndarray] | None = None
        if self.options.precision != "fp32":
            gold = self._reduced_precision(fused, unfused, wanted, reference)
        res.fused_vs_reference = compare_outputs(dict(zip(names, fused.outputs)), {n: reference[n] for n in names},
                                                 tolerances=self.tolerances, per_output=self._per(names))
        res.unfused_vs_reference = compare_outputs(dict(zip(names, unfused.outputs)),
                                                   {n: reference[n] for n in names}, tolerances=self.tolerances,
                                                   per_output=self._per(names))
        start = time.perf_counter()
        alignment = align(fused.manifest, unfused.manifest, anchors=_anchors(fused))
        self._timed("align", start)
        res.unmapped = list(alignment.unmapped)
        fused_ok = res.fused_vs_reference and (self.fp64 is None or bool(self.fp64))
        # fp32 only: reduced builds compare against loose, scale-aware bounds (and fp64)
        weak = {} if gold is not None else uninformative_outputs({n: reference[n] for n in names}, self.tolerances,
                                                                 self._per(names))
        if fused_ok and res.unfused_vs_reference:
            if not weak:
                res.status = "no-drift"
                return self._finish()
            # The outputs agree but could not have shown a wrong result (one value everywhere: a random-weight export
            # with a zero-initialised last layer): the intermediates are the verification left.
            res.notes.append(f"output(s) {', '.join(map(repr, weak))} cannot show a wrong result (one value "
                             f"everywhere, or under the atol): every intermediate compared instead")
            hidden = [c for c in (self._lowering_culprit(unfused, u2onnx, reference),
                                  next(self._fusion_candidates(fused, unfused, alignment, u2onnx), None))
                      if c is not None]
            if not hidden:
                res.status = "no-drift"
                return self._finish()
            return self._localised(hidden, fused, unfused, alignment, u2onnx, reference)

        culprits: list[Culprit] = []
        if not res.unfused_vs_reference:
            lowering = None if self.strategy == "onnx-order" else self._lowering_culprit(unfused, u2onnx, reference)
            if lowering is None and self.strategy != "onnx-order":
                res.notes.append("no unfused intermediate that maps to an ONNX tensor drifts; bisecting the ONNX "
                                 "graph in node order")
            if lowering is None:
                lowering = self._onnx_order_culprit(reference)
            if lowering is not None:
                culprits.append(lowering)
        if not fused_ok or (res.unfused_vs_reference and not culprits):
            fusion = (self._fusion_culprit_fp64(fused, unfused, alignment, u2onnx, gold) if gold is not None
                      else self._proven_fusion_culprit(fused, unfused, alignment, u2onnx, reference))
            if fusion is not None:
                culprits.append(fusion)
            elif not res.unfused_vs_reference:
                pass  # the fused build inherits the lowering drift; nothing fusion-specific diverged
            else:
                res.notes.append(f"no fused kernel that maps onto the unfused build diverges "
                                 f"({len(alignment.unmapped)} fused kernels could not be mapped)")
        return self._localised(culprits, fused, unfused, alignment, u2onnx, reference)

    def _localised(self, culprits: list[Culprit], fused: _Build, unfused: _Build, alignment: "Alignment",
                   u2onnx: Mapping[str, str], reference: Mapping[str, np.ndarray]) -> BisectResult:
        """The verdict with its culprits (the first one gets a reproducer); drift left unlocalised without any."""
        res = self.result
        if culprits:
            res.culprit, res.other = culprits[0], culprits[1:]
            res.reproducer = self.reproducers.get(id(res.culprit))   # written while the suspects were tried
            if id(res.culprit) not in self.reproducers:
                start = time.perf_counter()
                try:
                    res.reproducer = self._reproducer(res.culprit, fused, unfused, alignment, u2onnx, reference)
                except Exception as err:  # the verdict stands without a reproducer
                    res.notes.append(f"no reproducer: {type(err).__name__}: {err}")
                self._timed("reproducer", start)
        return self._finish()

    # -- reduced precision (fp16/bf16 builds)

    def _reduced_precision(self, fused: _Build, unfused: _Build, wanted: Sequence[str],
                           reference: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """Set up the comparison a reduced build is judged by (verify's, per intermediate): every tensor vs ONNX
        Runtime fp32 with the precision's loose budget, and the fused build vs fp64 beside the unfused build
        (dynamo's rule). Returns the fp64 value of every exposed tensor, or None when no fp64 run agrees."""
        from ...check.reference import run_onnxruntime
        from ...check.precision import check_against_fp64, fp64_reference, loose_tolerances

        precision = self.options.precision
        if self.tolerances is None:      # the user's own tolerances stand
            self.per_output = loose_tolerances(precision, reference)
        exposed = expose(self.loaded.model, list(wanted))
        start = time.perf_counter()
        try:
            gold, engine = fp64_reference(exposed, self.inputs, [o.name for o in exposed.graph.output],
                                          reference, run_onnxruntime)
        except Exception as err:  # noqa: BLE001 - the loose comparison still stands
            self.result.notes.append(f"no fp64 reference ({type(err).__name__}: {str(err)[:200]}): judged by the "
                                     f"{precision} budget against ONNX Runtime fp32 only")
            return None
        finally:
            self._timed("fp64 reference", start)
        names = self.loaded.output_names
        self.fp64 = check_against_fp64(precision, dict(zip(names, fused.outputs)), dict(zip(names, unfused.outputs)),
                                       {n: gold[n] for n in names if n in gold}, engine)
        self.result.notes.append(self.fp64.summary())
        return gold

    def _fusion_culprit_fp64(self, fused: _Build, unfused: _Build, alignment: "Alignment",
                             u2onnx: Mapping[str, str], gold: Mapping[str, np.ndarray]) -> Culprit | None:
        """The first fused kernel more wrong against fp64 than its unfused counterpart allows (the output
        rule, per intermediate) while its inputs are not: in reduced precision fused and unfused differ
        everywhere by rounding, so "differs from the unfused build" names nothing. A kernel with no ONNX
        tensor (the casts the precision pass adds) is judged against its unfused twin within the budget."""
        from ...check.compare import rmse_of
        from ...check.precision import BUDGET, HALF_MULT, UNIT_ROUNDOFF, rms_of

        precision = self.options.precision
        by_key = fused.manifest.by_key()
        verdict: dict[str, bool] = {p: True for p in fused.manifest.params}

        def onnx_inputs(v: str, depth: int = 0) -> list[str]:
            """The ONNX tensors behind a fused kernel's input (through kernels that stand for none)."""
            u = alignment.mapping.get(v, v)
            if u in u2onnx:
                return [u2onnx[u]]
            producer = by_key.get(v)
            if producer is None or depth > 4:
                return [v]
            return [t for w in producer.input_vars for t in onnx_inputs(w, depth + 1)]

        for k in fused.manifest.kernels:
            target = alignment.mapping.get(k.key)
            if target is None or target not in unfused.captures:
                continue
            actual, ref = fused.captures[k.key], unfused.captures[target]
            tensor = u2onnx.get(target)
            g = gold.get(tensor) if tensor is not None else None
            if g is None or actual.shape != g.shape or ref.shape != g.shape or not np.issubdtype(g.dtype, np.floating):
                b = BUDGET[precision]
                verdict[k.key] = close(actual, ref, Tolerance(rtol=b, atol=max(b * rms_of(ref), 1e-30))) \
                    if np.issubdtype(np.asarray(ref).dtype, np.floating) else bool(np.array_equal(actual, ref))
                continue
            self.result.compared += 1
            f_err, u_err = rmse_of(actual, g), rmse_of(ref, g)
            bound = HALF_MULT * u_err + UNIT_ROUNDOFF[precision] * rms_of(g)
            verdict[k.key] = bool(np.isfinite(f_err) and f_err <= bound)
            if verdict[k.key]:
                continue
            states = [verdict.get(v) for v in k.input_vars]
            inputs_agree = None if None in states else all(states)
            if inputs_agree is False:
                continue            # inherited from an earlier kernel's drift (that one would have been named)
            ratio = f_err / u_err if u_err > 0 else float("inf")
            return self._fusion_record(
                k, target, fused, unfused, alignment, tensor, actual, ref,
                [t for v in k.input_vars for t in onnx_inputs(v)], inputs_agree, {},
                fp64=(f"{precision} vs fp64: fused rmse {f_err:.3g}, unfused {u_err:.3g} ({ratio:.2f}x; allowed "
                      f"{HALF_MULT:g}x + {UNIT_ROUNDOFF[precision]:.2g} x rms {rms_of(g):.3g})"))
        return None

    def _per(self, names: Sequence[str]) -> dict[str, Tolerance] | None:
        """The per-tensor tolerances of the tensors being compared (compare_outputs refuses others)."""
        return {n: self.per_output[n] for n in names if n in self.per_output} if self.per_output else None

    def _finish(self) -> BisectResult:
        self.result.seconds = time.perf_counter() - self.start
        return self.result

    def _untestable(self, why: str) -> BisectResult:
        self.result.status = "untestable"
        self.result.error = why
        return self._finish()

    # -- blame: import/lowering (unfused vs ORT)

    def _lowering_culprit(self, unfused: _Build, u2onnx: Mapping[str, str],
                          reference: Mapping[str, np.ndarray]) -> Culprit | None:
        from fuseguard.compiler.capture import upstream

        agree: set[str] = set(unfused.manifest.params)
        keys = unfused.manifest.by_key()
        for k in unfused.manifest.kernels:
            tensor = u2onnx.get(k.key)
            if tensor is None or tensor not in reference or reference[tensor].shape != unfused.captures[k.key].shape:
                continue
            self.result.compared += 1
            actual, ref = unfused.captures[k.key], reference[tensor]
            if close(actual, ref, tolerance_for(tensor, ref, self.tolerances, self.per_output)):
                agree.add(k.key)
                continue
            closure = upstream(k, keys, agree, set(unfused.manifest.params), 10_000)
            members, leaves = closure if closure else ([k.key], set())
            input_errors: dict[str, float | None] = {}
            for leaf in sorted(leaves):
                t = u2onnx.get(leaf, leaf)
                value = unfused.captures.get(leaf, self.inputs.get(t))
                input_errors[t] = max_abs(value, reference[t]) if value is not None and t in reference else 0.0
            nodes, ops = self.node_names(members)
            return Culprit(
                blame=BLAME_LOWERING, kernel=k.key, function=k.function, pattern="",
                ops=[stem(keys[m].function) for m in members if m in keys], onnx_nodes=nodes, onnx_op_types=ops,
                onnx_inputs=[u2onnx.get(leaf, leaf) for leaf in sorted(leaves, key=lambda x: keys[x].index if x in keys else -1)],
                onnx_outputs=[tensor], error=compare_one(tensor, actual, ref, self.tolerances, self.per_output),
                inputs_agree=bool(closure), input_errors=input_errors)
        return None

    def _onnx_order_culprit(self, reference: Mapping[str, np.ndarray]) -> Culprit | None:
        """Bisect node order: the first prefix whose live tensors drift (unfused build vs ORT) ends at the culprit."""
        from fuseguard.compiler.frontend.loader import load
        from fuseguard.compiler.cache import compile_cached

        from ...check.reference import run_onnxruntime

        g = self.graph
        memo: dict[int, tuple[bool, CompareResult | None]] = {}

        def drifts(k: int) -> bool:
            if k in memo:
                return memo[k][0]
            outputs = g.frontier(k)
            sub = extract(g.model, g.inputs, outputs)
            feed = {i.name: self.inputs[i.name] for i in sub.graph.input if i.name in self.inputs}
            start = time.perf_counter()
            try:
                sub_loaded = load(sub, {n: tuple(v.shape) for n, v in feed.items()}, name=f"prefix{k}")
                compiled = compile_cached(sub_loaded, self.options.unfused())
                self.result.builds += 1
                got = compiled.run(feed)
            except FuseguardError as err:
                self.result.notes.append(f"prefix up to node {k} does not build ({err}); counted as drifting")
                memo[k] = (True, None)
                return True
            finally:
                self._timed("onnx-order bisection", start)
            ref = run_onnxruntime(sub, feed)
            cmp = compare_outputs(dict(zip(sub_loaded.output_names, got)), {n: ref[n] for n in sub_loaded.output_names},
                                  tolerances=self.tolerances, per_output=self._per(sub_loaded.output_names))
            memo[k] = (not cmp, cmp)
            return not cmp

        lo, hi = 0, len(g.nodes) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if drifts(mid):
                hi = mid
            else:
                lo = mid + 1
        if not drifts(lo):
            return None
        node = g.nodes[lo]
        cmp = memo[lo][1]
        outs = [t for t in node.output if t]
        if cmp is not None:
            failing = [n for n in outs if n in cmp and not cmp[n]] or cmp.failed
            error = cmp[failing[0]] if failing else cmp.worst
        else:
            error = OutputCompareResult(name=outs[0] if outs else node.name, dtype="", shape=(), passed=False,
                                        tolerance=Tolerance(0, 0), reason="prefix does not build")
        ins = [t for t in node.input if t and not g.is_constant(t)]
        return Culprit(blame=BLAME_LOWERING, kernel=outs[0] if outs else node.name, function="", pattern="",
                       ops=[node.op_type], onnx_nodes=[node.name], onnx_op_types=[node.op_type], onnx_inputs=ins,
                       onnx_outputs=outs, error=error, inputs_agree=True if lo == 0 or not drifts(lo - 1) else None,
                       input_errors={t: 0.0 for t in ins}, via="ONNX-order bisection")

    # -- blame: fusion (fused vs unfused)

    #: candidates whose reproducers are tried before bisect settles for an unconfirmed culprit: each costs
    #: two builds of a cut-out of a few nodes (~1-2 s for a transformer block's group on a 2-vCPU host)
    MAX_CANDIDATES = 4

    def _proven_fusion_culprit(self, fused: _Build, unfused: _Build, alignment: "Alignment",
                               u2onnx: Mapping[str, str], reference: Mapping[str, np.ndarray]) -> Culprit | None:
        """The first diverging fused kernel whose reproducer fails fused vs unfused on its own.

        A kernel that differs from the unfused tensor it was aligned to is only a suspect: a group whose
        structure differs from its unfused parts (a layout transpose the attention kernel needs, absent from
        the unfused build; same shape when head_dim == seq) can align to a tensor holding another value, and
        was blamed with "inputs agree: yes" while the fault sat elsewhere. Each suspect's cut-out is verified
        on its own; one that passes is refuted (listed, not blamed), and its consumers are judged as if it
        agreed. Without --confirm (or when no cut-out can be made) the first suspect is reported, unproven."""
        res = self.result
        first: Culprit | None = None
        unchecked: list[Culprit] = []
        for tried, candidate in enumerate(self._fusion_candidates(fused, unfused, alignment, u2onnx)):
            first = first or candidate
            start = time.perf_counter()
            try:
                repro = self._reproducer(candidate, fused, unfused, alignment, u2onnx, reference,
                                         tag=f"-{tried}" if tried else "")
            except Exception as err:  # noqa: BLE001 - unproven: a later suspect may still prove itself
                res.notes.append(f"no reproducer for {candidate.function or candidate.kernel}: "
                                 f"{type(err).__name__}: {str(err)[:300]}")
                candidate.proven = None
                self.reproducers[id(candidate)] = None
                unchecked.append(candidate)
                self.refuted.add(candidate.kernel)      # searched past, as a refuted suspect is
                continue
            finally:
                self._timed("reproducer", start)
            self.reproducers[id(candidate)] = repro
            if not self.confirm:          # written, not verified: the first suspect, unproven
                return candidate
            if repro.confirmed:
                candidate.proven = True
                if unchecked:
                    res.notes.append(f"earlier suspect(s) without a reproducer: "
                                     f"{', '.join(c.function or c.kernel for c in unchecked)}")
                return candidate
            candidate.proven = False
            res.refuted.append(candidate)
            self.refuted.add(candidate.kernel)
            if tried + 1 >= self.MAX_CANDIDATES:
                res.notes.append(f"stopped after {self.MAX_CANDIDATES} unconfirmed suspects")
                break
        if first is not None and first.proven is False:
            res.notes.append("no suspect's reproducer fails on its own: the first suspect is reported UNCONFIRMED; "
                             "it may hold no fault")
        if first is not None and res.refuted and res.refuted[0] is first:
            res.refuted.pop(0)            # reported as the (unconfirmed) culprit, not as refuted beside it
        return first

    def _fusion_candidates(self, fused: _Build, unfused: _Build, alignment: "Alignment",
                           u2onnx: Mapping[str, str]):
        """Diverging fused kernels in execution order whose inputs agree (or are unknown, or disagree only
        through refuted suspects): each a Culprit record. A fused kernel with no unfused counterpart upstream
        of one is named among its suspects, never skipped."""
        agree: dict[str, float | None] = {p: 0.0 for p in fused.manifest.params}
        refuted = self.refuted
        by_key = fused.manifest.by_key()
        unmapped = set(alignment.unmapped)

        def unmapped_upstream(v: str, seen: set[str]) -> list[str]:
            if v in seen or v not in unmapped:
                return []
            seen.add(v)
            out = [v]
            for w in by_key[v].input_vars:
                out += unmapped_upstream(w, seen)
            return out

        for k in fused.manifest.kernels:
            target = alignment.mapping.get(k.key)
            if target is None or target not in unfused.captures:
                continue
            self.result.compared += 1
            actual, ref = fused.captures[k.key], unfused.captures[target]
            if close(actual, ref, tolerance_for(target, ref, self.tolerances, self.per_output)):
                agree[k.key] = max_abs(actual, ref)
                continue
            input_errors: dict[str, float | None] = {}
            inputs_agree: bool | None = True
            for v in k.input_vars:
                u = alignment.mapping.get(v, v if v in fused.manifest.params else None)
                if v in agree or v in refuted:
                    input_errors[u2onnx.get(u or v, v)] = agree.get(v)
                elif u is not None and v in fused.captures and u in unfused.captures:
                    input_errors[u2onnx.get(u, u)] = max_abs(fused.captures[v], unfused.captures[u])
                    inputs_agree = False
                else:
                    input_errors[v] = None
                    inputs_agree = None if inputs_agree else inputs_agree
            if inputs_agree is False:
                continue        # explained by a diverging input, found earlier
            suspects: list[str] = []
            for v in k.input_vars:
                suspects += unmapped_upstream(v, set())
            ins = [t for v in k.input_vars
                   for u in ([alignment.mapping[v]] if v in alignment.mapping else alignment.regions.get(v, [v]))
                   for t in self._named(u, unfused, u2onnx)]
            record = self._fusion_record(k, target, fused, unfused, alignment, u2onnx.get(target, target), actual,
                                         ref, ins, inputs_agree, input_errors)
            record.suspects = [f"{by_key[s].function} -> {s}" for s in suspects]
            yield record
            if k.key in refuted:          # its reproducer passed: its consumers are judged as if it agreed
                agree[k.key] = max_abs(actual, ref)

    @staticmethod
    def _named(key: str, unfused: _Build, u2onnx: Mapping[str, str], depth: int = 0) -> list[str]:
        """The ONNX tensors a cut-out starting at unfused tensor `key` reads: its own name, or, for a tensor the
        importer made without one (a Split's fields, the fold step's values: "names not found in value_infos"),
        the nearest named tensors upstream, so the cut-out takes in the unnamed steps."""
        if key in u2onnx:
            return [u2onnx[key]]
        producer = unfused.manifest.by_key().get(key)
        if producer is None or depth > 16:
            return [key]
        return [t for w in producer.input_vars for t in _Bisector._named(w, unfused, u2onnx, depth + 1)]

    def _fusion_record(self, k: "CapturedKernel", target: str, fused: _Build, unfused: _Build,
                       alignment: "Alignment", name: str, actual: np.ndarray, ref: np.ndarray,
                       onnx_inputs: Sequence[str], inputs_agree: bool | None,
                       input_errors: dict[str, float | None], fp64: str = "") -> Culprit:
        """The culprit record of fused kernel `k` (aligned to unfused `target`), fp32 and reduced precision alike."""
        members = alignment.members.get(k.key, [target])
        nodes, ops = self.node_names(members)
        group = self._report_group(fused.compiled, k, target)
        return Culprit(
            blame=BLAME_FUSION, kernel=k.key, function=k.function,
            pattern=group.pattern if group else ("" if len(members) <= 1 else "generic"),
            ops=list(group.ops) if group else [stem(unfused.manifest.by_key()[m].function) for m in members],
            onnx_nodes=nodes, onnx_op_types=ops, onnx_inputs=list(dict.fromkeys(onnx_inputs)), onnx_outputs=[name],
            error=compare_one(name, actual, ref, self.tolerances, self.per_output), inputs_agree=inputs_agree,
            input_errors=input_errors, reason=group.reason if group else "", fp64=fp64)

    @staticmethod
    def _report_group(compiled: "CompiledModel", kernel: "CapturedKernel", target: str) -> Any:
        groups = [g for g in compiled.report.groups if g.function == kernel.function]
        for g in groups:
            if g.output_var in (kernel.var, target):
                return g
        return groups[0] if groups else None

    # -- the reproducer

    def _reproducer(self, culprit: Culprit, fused: _Build, unfused: _Build, alignment: "Alignment",
                    u2onnx: Mapping[str, str], reference: Mapping[str, np.ndarray], tag: str = "") -> Reproducer:
        import onnx

        from ...check.reference import run_onnxruntime
        from ...check.model import verify_model

        values: dict[str, np.ndarray] = dict(self.inputs)
        for key, tensor in u2onnx.items():
            if key in unfused.captures:
                values.setdefault(tensor, unfused.captures[key])
        if culprit.blame == BLAME_FUSION:  # the values the fused kernel actually read
            for f_key, u_key in alignment.mapping.items():
                if u_key in u2onnx and f_key in fused.captures and f_key not in self.refuted:
                    values[u2onnx[u_key]] = fused.captures[f_key]
        g = self.graph
        inputs = [t for t in culprit.onnx_inputs if not g.is_constant(t)]
        sub = extract(g.model, inputs, culprit.onnx_outputs)
        needed = [i.name for i in sub.graph.input]
        missing = [n for n in needed if n not in values]
        if missing:
            values.update({k: v for k, v in run_onnxruntime(expose(g.model, missing), self.inputs).items() if k in missing})
        feed = {n: np.ascontiguousarray(values[n]) for n in needed}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        model_path, inputs_path = self.out_dir / f"repro{tag}.onnx", self.out_dir / f"repro{tag}.npz"
        onnx.save(sub, str(model_path))
        np.savez(inputs_path, **feed)
        command = f"fuseguard verify {model_path} --inputs {inputs_path}"
        if not self.options.schedule:
            command += " --no-schedule"
        if self.options.gpu_arch:
            command += f" --gpu-arch {self.options.gpu_arch}"
        if self.options.precision != "fp32":
            command += f" --precision {self.options.precision}"
        if culprit.blame == BLAME_FUSION:
            command += "  # plus the --plugin that made the bad fusion, if it came from one"
        repro = Reproducer(model=str(model_path), inputs=str(inputs_path), command=command)
        if self.confirm:
            user_opts = self.options
            verdict = verify_model(str(model_path), options=user_opts, inputs_file=str(inputs_path),
                                   tolerances=self.tolerances,
                                   per_output=self._per([o.name for o in sub.graph.output]))
            self.result.builds += 2
            # proven only by a comparison that ran: the fused cut-out fails while the unfused one passes (a
            # cut-out that does not build, or whose unfused side fails too, proves nothing about fusion)
            fp64 = getattr(verdict.fused, "fp64", None)       # reduced precision: judged against fp64 too
            fused_failed = verdict.fused.compare is not None and (not verdict.fused.compare
                                                                  or (fp64 is not None and not fp64))
            unfused_ok = verdict.unfused is None or (verdict.unfused.compare is not None and bool(verdict.unfused.compare))
            repro.confirmed = (fused_failed and unfused_ok) if culprit.blame == BLAME_FUSION else not verdict.passed
            parts = [f"{b.config}: {b.compare.summary() if b.compare is not None else b.error}"
                     for b in (verdict.fused, verdict.unfused)]
            fp64 = getattr(verdict.fused, "fp64", None)
            if fp64 is not None:
                parts.append(fp64.summary())
            repro.detail = "verify on the reproducer: " + verdict.status + " (" + "; ".join(parts) + ")"
        return repro


# ----------------------------------------------------------------------------- API


def bisect_model(source: Any, shapes: Mapping[str, Sequence[int]] | None = None,
                 options: "CompileOptions | None" = None,
                 inputs: Mapping[str, np.ndarray] | str | Path | None = None, seed: int | None = None,
                 tolerances: Tolerances = None, out_dir: str | Path = "fuseguard-bisect", *,
                 name: str | None = None, confirm: bool = True, strategy: str = "capture",
                 default_dim: int | None = None) -> BisectResult:
    """Localise output drift to one fused group (blame: fusion) or one lowered operator (import/lowering).

    `source`: ONNX path/bytes/ModelProto, a `LoadedModel` or a `verify.check.model.SuiteSpec`. `inputs`: arrays
    or an .npz path (missing inputs are drawn from `seed`). `strategy="onnx-order"` skips the kernel
    capture for import/lowering blame and bisects ONNX node order instead. The reproducer is written
    to `out_dir`; `confirm` re-verifies it (two more builds).
    """
    from fuseguard.compiler.frontend.importer import fold_shape_computations, import_model
    from fuseguard.compiler.frontend.loader import LoadedModel, load
    from fuseguard.compiler.pipeline import CompileOptions

    from ...check.model import SuiteSpec
    from ...check.inputs import load_npz, make_inputs

    if strategy not in ("capture", "onnx-order"):
        raise UsageError(f"unknown bisect strategy {strategy!r}; use 'capture' or 'onnx-order'")
    options = options or CompileOptions()
    if not options.fusion:
        raise UsageError("bisect compares the fused build with the unfused one: fusion must be on")
    from fuseguard.compiler.plugins import load_env_plugins

    load_env_plugins()
    if isinstance(source, SuiteSpec):
        name = name or source.label
        seed = source.seed if seed is None else seed
        source = source.build()
    seed = 0 if seed is None else seed
    loaded = source if isinstance(source, LoadedModel) else load(source, shapes, name=name, default_dim=default_dim)
    try:
        imported = import_model(loaded)
    except FuseguardError as err:
        if isinstance(err, UsageError):
            raise
        return BisectResult(model=loaded.name, target=options.gpu_arch or "cpu", status="untestable", error=str(err))
    if imported.prepared:  # provenance tags index the shape-folded graph: bisect that one
        loaded = dataclasses.replace(loaded, model=fold_shape_computations(loaded.model))
    user = load_npz(inputs) if isinstance(inputs, (str, Path)) else (dict(inputs) if inputs is not None else None)
    feed = make_inputs(loaded.model, loaded.input_shapes, seed=seed, user=user)
    bisector = _Bisector(loaded, options, feed, tolerances, Path(out_dir), confirm, strategy)
    return bisector.run()


