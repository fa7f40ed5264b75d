"""What a bisection finds: the culprit, its reproducer and the result, with their rendering."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ...check.compare import CompareResult, OutputCompareResult


EXIT_NO_DRIFT, EXIT_DRIFT, EXIT_USAGE, EXIT_UNTESTABLE = 0, 1, 2, 125
BLAME_FUSION = "fusion"
BLAME_LOWERING = "import/lowering"


@dataclass
class Culprit:
    """The first kernel (fused group or operator) whose output drifts while its inputs agree."""

    blame: str                      # "fusion" (fused != unfused) or "import/lowering" (unfused != ORT)
    kernel: str                     # capture key of its output in the build where it drifts
    function: str                   # the PrimFunc that ran ("" when found by ONNX-order bisection)
    pattern: str                    # fusion rule, "generic" (TVM FuseOps) or "" (a single operator)
    ops: list[str]
    onnx_nodes: list[str]
    onnx_op_types: list[str]
    onnx_inputs: list[str]          # ONNX tensors the culprit reads
    onnx_outputs: list[str]         # ONNX tensor it produces
    error: OutputCompareResult      # its output vs the reference (unfused build, or ORT)
    inputs_agree: bool | None       # None: some input could not be compared
    input_errors: dict[str, float | None] = field(default_factory=dict)   # max abs error per input
    reason: str = ""                # the cost model's reason for fusing it
    via: str = "kernel capture"     # or "ONNX-order bisection"
    fp64: str = ""                  # reduced precision: its error against fp64 beside the unfused kernel's
    #: True: its reproducer fails fused vs unfused on its own; False: it passes (the culprit is unconfirmed);
    #: None: not checked (--no-confirm, or no reproducer could be cut)
    proven: bool | None = None
    #: fused kernels with no unfused counterpart upstream of it, compared together with it: suspects too
    suspects: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "error"}
        d["error"] = self.error.to_dict()
        return d


@dataclass
class Reproducer:
    """The culprit cut out as its own ONNX model with the input values it saw."""

    model: str
    inputs: str
    command: str
    confirmed: bool | None = None   # did `verify` on the reproducer fail as the full model did?
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class BisectResult:
    """Truthy when there is no drift. `exit_code` is what `git bisect run` wants."""

    model: str
    target: str
    status: str                                  # "no-drift" | "drift" | "untestable"
    culprit: Culprit | None = None
    other: list[Culprit] = field(default_factory=list)   # a second culprit of the other blame, if any
    fused_vs_reference: CompareResult | None = None
    unfused_vs_reference: CompareResult | None = None
    compared: int = 0                            # intermediate tensors compared
    unmapped: list[str] = field(default_factory=list)    # fused kernels with no unfused counterpart
    builds: int = 0
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    reproducer: Reproducer | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    #: culprits whose reproducer passed on its own (misaligned or innocent), in the order they were tried
    refuted: list[Culprit] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.status == "no-drift"

    @property
    def exit_code(self) -> int:
        return {"no-drift": EXIT_NO_DRIFT, "drift": EXIT_DRIFT}.get(self.status, EXIT_UNTESTABLE)

    def summary(self) -> str:
        if self.status == "untestable":
            return f"{self.model}: cannot be tested: {self.error}"
        if self.status == "no-drift":
            also = f", {self.compared} intermediates too" if self.compared else ""
            return (f"{self.model}: no drift (fused, unfused and ONNX Runtime agree{also}; {self.builds} builds, "
                    f"{self.seconds:.1f} s)")
        if self.culprit is None:
            return f"{self.model}: drift, not localised ({'; '.join(self.notes) or 'no kernel diverged'})"
        c = self.culprit
        what = f"{c.pattern} group" if c.pattern else "operator"
        proof = {True: "proven", False: "UNCONFIRMED", None: "not confirmed"}[c.proven]
        return (f"{self.model}: {c.blame} drift at {what} {c.function or c.kernel} [{proof}] "
                f"({', '.join(c.onnx_nodes[:6])}{' ...' if len(c.onnx_nodes) > 6 else ''}): "
                f"max abs err {_fmt(c.error.max_abs_error)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "target": self.target, "status": self.status, "summary": self.summary(),
            "culprit": self.culprit.to_dict() if self.culprit else None,
            "other": [c.to_dict() for c in self.other],
            # `is not None`: a CompareResult is falsy when it failed, the comparison that matters most.
            "fused_vs_reference": None if self.fused_vs_reference is None else self.fused_vs_reference.to_dict(),
            "unfused_vs_reference": (None if self.unfused_vs_reference is None
                                     else self.unfused_vs_reference.to_dict()),
            "compared": self.compared, "unmapped": list(self.unmapped), "builds": self.builds,
            "seconds": self.seconds, "timings": dict(self.timings),
            "reproducer": self.reproducer.to_dict() if self.reproducer else None,
            "error": self.error, "notes": list(self.notes), "exit_code": self.exit_code,
            "refuted": [c.to_dict() for c in self.refuted],
        }

    def __rich__(self) -> Any:
        return self.render()

    def render(self) -> Any:
        from rich.console import Group
        from rich.markup import escape
        from rich.table import Table

        colour = {"no-drift": "green", "drift": "red"}.get(self.status, "yellow")
        head = Table(title=f"fuseguard bisect: {escape(self.model)} on {self.target}", show_header=False,
                     title_justify="left")
        head.add_column("", style="bold")
        head.add_column("", overflow="fold")
        head.add_row("verdict", f"[{colour}]{escape(self.summary())}[/]")
        for label, res in (("fused vs ORT", self.fused_vs_reference), ("unfused vs ORT", self.unfused_vs_reference)):
            if res is not None:
                head.add_row(label, escape(res.summary()))
        head.add_row("cost", f"{self.builds} builds, {self.seconds:.1f} s, {self.compared} intermediates compared"
                     + (f", {len(self.unmapped)} fused kernels unmapped" if self.unmapped else ""))
        parts: list[Any] = [head]
        for c in [self.culprit, *self.other]:
            if c is None:
                continue
            t = Table(title=f"culprit ({c.blame}, found by {c.via})", show_header=False, title_justify="left")
            t.add_column("", style="bold")
            t.add_column("", overflow="fold")
            t.add_row("kernel", escape(f"{c.function} -> {c.kernel}" if c.function else c.kernel))
            t.add_row("pattern", escape(c.pattern or "(not fused: a single operator)"))
            t.add_row("ops", escape(" + ".join(c.ops)))
            t.add_row("ONNX nodes", escape(", ".join(f"{n} ({o})" for n, o in zip(c.onnx_nodes, c.onnx_op_types))))
            t.add_row("ONNX tensors", escape(f"{', '.join(c.onnx_inputs)} -> {', '.join(c.onnx_outputs)}"))
            e = c.error
            t.add_row("error", escape(f"max abs {_fmt(e.max_abs_error)} at {e.max_abs_index}, mean abs "
                                      f"{_fmt(e.mean_abs_error)}, max rel {_fmt(e.max_rel_error)}, "
                                      f"{e.mismatches}/{e.size} out of {e.tolerance}"))
            agree = {True: "yes", False: "NO", None: "unknown"}[c.inputs_agree]
            t.add_row("inputs agree", escape(f"{agree} ({', '.join(f'{k}: {_fmt(v)}' for k, v in c.input_errors.items())})"))
            if c.fp64:
                t.add_row("vs fp64", escape(c.fp64))
            if c.reason:
                t.add_row("why fused", escape(c.reason))
            if c.suspects:
                t.add_row("suspects too", escape(", ".join(c.suspects) + " (no unfused counterpart, compared "
                                                 "together with it)"))
            t.add_row("proof", {True: "[red]proven[/]: its reproducer fails fused vs unfused on its own",
                                False: "[yellow]UNCONFIRMED[/]: its reproducer passes on its own",
                                None: "not checked"}[c.proven])
            parts.append(t)
        for c in self.refuted:
            parts.append(f"[yellow]refuted:[/] {escape(c.function or c.kernel)} ({escape(c.pattern or 'operator')}) "
                         f"differed from {escape(', '.join(c.onnx_outputs))} by {_fmt(c.error.max_abs_error)}, but its "
                         f"reproducer passes on its own: a kernel with no exact unfused counterpart, not blamed")
        if self.reproducer is not None:
            r = self.reproducer
            state = {True: "[red]fails verify on its own[/]", False: "[yellow]passes verify on its own[/]",
                     None: "not checked"}[r.confirmed]
            parts.append(f"reproducer: {escape(r.model)} + {escape(r.inputs)} ({state})\n  {escape(r.command)}"
                         + (f"\n  {escape(r.detail)}" if r.detail else ""))
        for note in self.notes:
            parts.append(f"[yellow]note:[/] {escape(note)}")
        return Group(*parts)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


