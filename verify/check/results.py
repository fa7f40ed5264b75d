"""What verifying a model finds, as values: each build's result (`BuildResult`) and the model's verdict
(`ModelVerdict`, truthy when every output of both builds matched), as plain dicts for JSON and the workers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fuseguard.compiler.fusion.report import FusionReport

from .compare import CompareResult


@dataclass
class BuildResult:
    config: str
    compile_s: float = 0.0
    kernels: int = 0
    groups: int = 0
    pattern_groups: int = 0
    ran: bool = False
    run_s: float = 0.0
    compare: CompareResult | None = None
    error: str | None = None
    traceback: str | None = None    # the worker-side traceback of `error` (shown with --debug)
    report: FusionReport | None = None     # the build's own report: a dataclass that pickles
    cached: bool = False            # served from the build cache (compile_s is then the original build's)
    #: reduced-precision builds (the fused side): its error against fp64 beside the unfused build's
    fp64: Any = None                # verify.check.precision.Fp64Check

    @property
    def passed(self) -> bool:
        return self.error is None and (self.compare is None or bool(self.compare)) \
            and (self.fp64 is None or bool(self.fp64))

    @property
    def max_abs_error(self) -> float | None:
        """The worst finite error over outputs that have one (a shape mismatch or a missing output has
        none); None when no output has one."""
        if self.compare is None:
            return None
        errors = [r.max_abs_error for r in self.compare.values() if r.max_abs_error is not None]
        return max(errors) if errors else None

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("compare", "fp64", "report")}
        d["report"] = self.report.to_dict() if self.report is not None else {}
        d["compare"] = self.compare.to_dict() if self.compare is not None else None
        d["fp64"] = self.fp64.to_dict() if self.fp64 is not None else None
        d["max_abs_error"] = self.max_abs_error
        d["passed"] = self.passed
        return d


@dataclass
class ModelVerdict:
    model: str
    target: str
    nodes: int
    input_shapes: dict[str, tuple[int, ...]]
    seed: int
    fused: BuildResult
    unfused: BuildResult
    skipped_run: str | None = None
    warnings: list[str] = field(default_factory=list)
    precision: str = "fp32"
    #: int8 QDQ models: each build's and ONNX Runtime's distance from the fp32 model (information only)
    quantisation: Any = None        # verify.check.precision.QuantisationError

    @property
    def status(self) -> str:
        if self.fused.error or self.unfused.error:
            return "ERROR"
        if self.skipped_run:
            return "COMPILED"
        return "PASS" if self.fused.passed and self.unfused.passed else "FAIL"

    @property
    def passed(self) -> bool:
        return self.status in ("PASS", "COMPILED")

    def __bool__(self) -> bool:
        return self.passed

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "target": self.target, "nodes": self.nodes,
                "input_shapes": {k: list(v) for k, v in self.input_shapes.items()}, "seed": self.seed,
                "status": self.status, "precision": self.precision, "skipped_run": self.skipped_run, "warnings": list(self.warnings),
                "fused": self.fused.to_dict(), "unfused": self.unfused.to_dict(),
                "quantisation": self.quantisation.to_dict() if self.quantisation is not None else None}
