"""The fusion report: each fused group, its ops, the pattern that made it and the ONNX nodes it came from."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import tvm
from tvm import relax

from ..ir import tags
from ..ir.analysis import call_tir_sites, function_ops, kernel_flops
from .cost import Decision


@dataclass
class FusedGroup:
    function: str                 # the Relax function holding the group (becomes one kernel)
    pattern: str                  # a rule name from compiler.patterns, or "generic" (TVM FuseOps)
    ops: list[str]
    onnx_nodes: list[str]
    reason: str = ""
    output_var: str = ""
    predicted_us: float = 0.0     # the cost model's predicted saving for this group (0 for generic groups)
    bytes_saved: int = 0
    kernel: str = ""              # the PrimFunc it became (FuseTIR may share one between identical groups)
    call_var: str = ""            # the var `main` binds the group's result to
    decision_key: str = ""        # the deciding Decision's key (compiler/fusion/decisions.py); "" for generic groups
    decided_by: str = ""          # "estimate" or "measured" for pattern groups

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class FusionReport:
    model: str
    target: str
    fusion: bool
    disabled_patterns: list[str]
    groups: list[FusedGroup] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    kernels: int = 0              # call_tir sites in the final module: what actually runs
    traffic_bytes: int = 0        # bytes every kernel reads and writes, summed (global-memory traffic)
    min_traffic_bytes: int = 0    # model inputs + weights + outputs, each touched once
    ops_before_fusion: int = 0    # Relax operator calls after legalisation, before any fusion
    compile_s: float = 0.0
    stage_s: dict[str, float] = field(default_factory=dict)
    #: "onnx" (imported as given) or "onnxruntime-fold" (shape subgraphs folded by ONNX Runtime first)
    imported_via: str = "onnx"
    #: kernel (PrimFunc) -> the schedule rule that took it, or "left alone: <why>"
    schedules: dict[str, str] = field(default_factory=dict)
    #: every kernel call `main` makes, in execution order (see `kernel_call_sites`)
    call_sites: list[dict] = field(default_factory=list)
    #: CUDA builds: every kernel compiled to SASS and its resources (compiler/sass.SassReport.to_dict)
    sass: dict | None = None
    #: device storage the static memory plan allocates (`planned_bytes`)
    planned_bytes: int = 0
    #: dims kept symbolic (`--dynamic`, as NAME or NAME<=BOUND): planned_bytes is then for the bounds
    dynamic: list[str] = field(default_factory=list)
    #: --precision of the build, and for reduced ones {op: {output dtype: calls}} after conversion
    precision: str = "fp32"
    dtypes: dict[str, dict[str, int]] = field(default_factory=dict)
    #: what the layout step did (compiler/layout.LayoutSummary.line)
    layout: str = ""
    #: what the QDQ step did (compiler/qdq.QdqSummary.line), "" for models without Quantize/Dequantize
    qdq: str = ""
    #: what memory planning changed beyond TVM's plan (compiler/passes/concat_in_place.py), "" for nothing
    memory: str = ""

    def precision_line(self) -> str:
        """Which ops run in which type: "bf16: matmul x8 bf16 operands, fp32 accumulate; ..." (or "")."""
        if self.precision == "fp32":
            return ""
        casts = sum(self.dtypes.get("astype", {}).values())
        fp32 = sorted(op for op, by in self.dtypes.items() if op != "astype" and "float32" in by)
        low = sorted(op for op, by in self.dtypes.items() if op != "astype" and any(t != "float32" for t in by))
        gemms = ", ".join(o for o in fp32 if "matmul" in o or "conv" in o) or "no GEMM"
        return (f"{self.precision}: operands of {gemms} in {self.precision}, accumulated in fp32; "
                f"in {self.precision}: {', '.join(low) or 'nothing else'}; in fp32: {', '.join(fp32) or 'nothing'}; "
                f"{casts} casts")

    @property
    def pattern_groups(self) -> list[FusedGroup]:
        return [g for g in self.groups if g.pattern != "generic"]

    def count(self, pattern: str) -> int:
        return sum(1 for g in self.groups if g.pattern == pattern)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "target": self.target, "fusion": self.fusion,
            "disabled_patterns": list(self.disabled_patterns), "kernels": self.kernels,
            "ops_before_fusion": self.ops_before_fusion, "compile_s": self.compile_s,
            "traffic_bytes": self.traffic_bytes, "min_traffic_bytes": self.min_traffic_bytes,
            "stage_s": dict(self.stage_s), "imported_via": self.imported_via, "schedules": dict(self.schedules),
            "call_sites": [dict(c) for c in self.call_sites], "sass": self.sass, "planned_bytes": self.planned_bytes,
            "dynamic": list(self.dynamic), "precision": self.precision, "dtypes": self.dtypes, "layout": self.layout, "qdq": self.qdq,
            "memory": self.memory,
            "groups": [g.to_dict() for g in self.groups],
            "decisions": [d.to_dict() for d in self.decisions],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "FusionReport":
        """The inverse of `to_dict` (the build cache stores reports as JSON)."""
        known = {f for f in cls.__dataclass_fields__}
        plain = {k: v for k, v in d.items() if k in known and k not in ("groups", "decisions")}
        rep = cls(**plain)
        rep.groups = [FusedGroup(**g) for g in d.get("groups", [])]
        rep.decisions = [Decision(**x) for x in d.get("decisions", [])]
        return rep

    def render(self, *, max_rows: int = 200) -> "object":
        from rich.table import Table

        via = " (imported through ONNX Runtime's shape folding)" if self.imported_via != "onnx" else ""
        table = Table(title=f"fusion report: {self.model} on {self.target} "
                            f"({len(self.groups)} fused groups, {self.kernels} kernels){via}",
                      caption="; ".join(x for x in (self.layout, self.qdq, self.memory, self.precision_line()) if x)
                      or None)
        for col in ("group", "pattern", "ops", "ONNX nodes", "why"):
            table.add_column(col, overflow="fold")
        for g in self.groups[:max_rows]:
            nodes = ", ".join(g.onnx_nodes[:4]) + (f" (+{len(g.onnx_nodes) - 4})" if len(g.onnx_nodes) > 4 else "")
            table.add_row(g.function, g.pattern, " + ".join(g.ops), nodes, g.reason)
        for d in self.decisions:
            if not d.fused:
                table.add_row("(not fused)", d.pattern, " + ".join(d.ops), ", ".join(d.onnx_nodes[:4]), d.reason)
        return table


def _groups_by_site(sites: list[tuple[str, str]], groups: list[FusedGroup]) -> list[FusedGroup | None]:
    """The group behind each call site. FuseTIR turns each group call into one call_tir in place and
    names the PrimFunc after the group's function, so walking both in order ties them (var names do
    not: FuseOpsByPattern names many calls `lv`); a site with no group in turn (a kernel emitted outside
    fusion, e.g. a replacement's transpose) gets None."""
    import re

    def base(name: str) -> str:   # FuseTIR shares one PrimFunc between identical groups (`f`, `f1`, ...)
        return re.sub(r"\d+$", "", name)

    out: list[FusedGroup | None] = []
    i = 0
    for _, kernel, _ in sites:
        if i < len(groups) and (kernel in (groups[i].function, groups[i].kernel)
                                or base(kernel) == base(groups[i].function)):
            out.append(groups[i])
            i += 1
        else:
            out.append(None)
    return out


def kernel_call_sites(mod: tvm.IRModule, groups: list[FusedGroup], provenance) -> list[dict]:
    """The call_tir sites of `main` in execution order: var, kernel, the ONNX nodes it computes (a fused
    group's nodes, else the provenance of the var it binds), its pattern ("generic", a rule name, or
    "single op"), bytes at its boundary and FLOPs. The VM runs them in this order, which is how a
    per-call timing is tied back to the graph (verify/perf/profile.py)."""
    sites = call_tir_sites(mod)
    flops = kernel_flops(mod)
    out = []
    for (var, kernel, nbytes), g in zip(sites, _groups_by_site(sites, groups)):
        out.append({"var": var, "kernel": kernel, "nodes": list(g.onnx_nodes) if g is not None else
                    list(provenance([var])), "pattern": g.pattern if g is not None else "single op",
                    "reason": g.reason if g is not None else "", "bytes": nbytes, "flops": flops.get(kernel, 0),
                    "key": g.decision_key if g is not None else "",
                    "predicted_us": g.predicted_us if g is not None else 0.0})
    return out


def without_calls(sites: list[dict], dropped: list[tuple[str, frozenset]]) -> list[dict]:
    """`sites` less the calls a later step dropped, each given as its kernel and the names bound to its output
    (the site's `var` among them). By name, not by position among the kernel's sites: when only some of one
    kernel's calls are dropped, the n-th dropped is not the n-th site (ShuffleNet's unfused concats)."""
    out = list(sites)
    for kernel, names in dropped:
        j = next((k for k, site in enumerate(out) if site["kernel"] == kernel and site["var"] in names), None)
        if j is not None:
            del out[j]
    return out


def attach_kernels(mod: tvm.IRModule, groups: list[FusedGroup]) -> None:
    """After FuseTIR: record which PrimFunc each group's call became."""
    sites = call_tir_sites(mod)
    for (_, kernel, _), g in zip(sites, _groups_by_site(sites, groups)):
        if g is not None:
            g.kernel = kernel
    for g in groups:
        g.kernel = g.kernel or g.function


def link_decisions(mod: tvm.IRModule, decisions: list[Decision]) -> dict[str, Decision]:
    """Right after pattern fusion: composite function name -> the decision that made it.

    Each composite function carries `fuseguard.decision`, the index its check stamped on it; the
    call's input names are the fallback for composites made without that stamp.
    """
    links: dict[str, Decision] = {}
    fused = [d for d in decisions if d.fused]
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function) or func.attrs is None or "Composite" not in func.attrs:
            continue
        if "fuseguard.decision" in func.attrs:
            index = int(str(func.attrs["fuseguard.decision"]))
            if 0 <= index < len(decisions):
                links[gv.name_hint] = decisions[index]

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, relax.GlobalVar) and expr.op.name_hint not in links:
            func = mod[expr.op]
            if not isinstance(func, relax.Function) or func.attrs is None or "Composite" not in func.attrs:
                return
            pattern = str(func.attrs["Composite"]).split(".", 1)[-1]
            args = sorted(a.name for a in expr.args if isinstance(a, relax.Var))
            for d in fused:
                if d.pattern == pattern and d.inputs == args and d not in links.values():
                    links[expr.op.name_hint] = d
                    break

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return links


def fused_groups(mod: tvm.IRModule, provenance, decisions: list[Decision],
                 links: dict[str, Decision] | None = None,
                 sites: list[list[str]] | None = None,
                 replaced_calls: list[tuple[str, Decision]] | None = None) -> list[FusedGroup]:
    """Groups called from `main`, in execution order, after FuseOps (before FuseTIR).

    A pattern group is tied to its cost-model decision through the provenance-tagged var names
    (`n<index>_<Op>`) that both share; untagged names (lv, gv) are not unique and are ignored. A call of a
    hand-written kernel takes the decision of the replaced call at its place in `replaced_calls` (one
    kernel serves every identical call: keyed by its name, all 12 of ViT's attention calls had claimed
    the last layer's ONNX nodes, and a profile paired only that one with its unfused parts).
    """
    pending: dict[str, list[Decision]] = {}
    for kernel, decision in replaced_calls or []:
        pending.setdefault(kernel, []).append(decision)
    by_name: dict[str, Decision] = {}
    for d in decisions:
        if d.fused:
            for n in d.var_names:
                if tags.is_tagged(n):
                    by_name[n] = d
    main = mod["main"]
    groups: list[FusedGroup] = []
    call_index = [0]

    def visit_seq(seq: relax.SeqExpr) -> None:
        for block in seq.blocks:
            for binding in block.bindings:
                value = binding.value
                if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) \
                        and value.op.name == "relax.call_tir" and value.args[0].name_hint in (links or {}):
                    queue = pending.get(value.args[0].name_hint)
                    decision = queue.pop(0) if queue else links[value.args[0].name_hint]
                    decision.onnx_nodes = provenance(decision.var_names)
                    groups.append(FusedGroup(function=value.args[0].name_hint, pattern=decision.pattern,
                                             ops=list(decision.ops), onnx_nodes=decision.onnx_nodes,
                                             reason=decision.reason + "; hand-written tiled kernel",
                                             output_var=decision.anchor, predicted_us=decision.predicted_us,
                                             bytes_saved=decision.bytes_saved, kernel=value.args[0].name_hint,
                                             call_var=binding.var.name, decision_key=decision.key,
                                             decided_by=decision.source))
                    continue
                if not (isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar)):
                    continue
                func = mod[value.op]
                if not isinstance(func, relax.Function) or func.attrs is None or "Primitive" not in func.attrs:
                    continue
                ops, names = function_ops(func, mod)
                site = sites[call_index[0]] if sites is not None and call_index[0] < len(sites) else None
                call_index[0] += 1
                names += [p.name for p in func.params]
                composite = str(func.attrs["Composite"]) if "Composite" in func.attrs else None
                pattern, reason, anchor = "generic", "TVM FuseOps: injective/reduction ops merged into their producer", ""
                predicted, saved = 0.0, 0
                key, decided_by = "", ""
                nodes = provenance(site if site else [n for n in names if n not in {p.name for p in func.params}])
                if composite:
                    pattern = composite.split(".", 1)[-1]
                    decision = (links or {}).get(value.op.name_hint) or \
                        next((by_name[n] for n in names if n in by_name), None)
                    if decision is not None:
                        reason, anchor = decision.reason, decision.anchor
                        predicted, saved = decision.predicted_us, decision.bytes_saved
                        key, decided_by = decision.key, decision.source
                        nodes = provenance(decision.var_names)
                        decision.onnx_nodes = nodes
                if len(ops) < 2 and pattern == "generic":
                    continue
                groups.append(FusedGroup(function=value.op.name_hint, pattern=pattern, ops=ops, onnx_nodes=nodes,
                                         reason=reason, output_var=anchor or binding.var.name,
                                         predicted_us=predicted, bytes_saved=saved, call_var=binding.var.name,
                                         decision_key=key, decided_by=decided_by))

    if isinstance(main.body, relax.SeqExpr):
        visit_seq(main.body)
    return groups
