"""The vocabulary of fusion rules: what a rule is (`PatternRule`), what its check and cost functions see of
a candidate group (`Match`) and return (`CostEstimate`), and the pattern builders rules share.

Its own module so that the table (fusion/patterns.py), the cost model (fusion/cost.py) and the rules that
live beside their kernels (fusion/attention.py) all import it and none imports another for its types."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op

from ..hw.hardware import Hardware
from ..ir import tags


@dataclass
class CostEstimate:
    """Predicted benefit of fusing one group on one target."""

    bytes_saved: int          # global-memory traffic avoided (intermediates not written and re-read)
    launches_saved: int       # kernels (GPU launches / CPU parallel regions) avoided
    predicted_us: float       # each intermediate at its cache level's bandwidth + launches x launch overhead

    @property
    def beneficial(self) -> bool:
        return self.predicted_us > 0


@dataclass
class Match:
    """What a check or cost function sees of one candidate group."""

    pattern: str
    variant: str
    annotated: Mapping[str, relax.Expr]
    bindings: Mapping[relax.Var, relax.Expr]       # the bindings that would move into the group
    var_usages: Mapping[relax.Var, list[relax.Var]]

    @property
    def vars(self) -> list[relax.Var]:
        return list(self.bindings.keys())

    @property
    def var_names(self) -> list[str]:
        return [v.name for v in self.bindings]

    @property
    def input_names(self) -> list[str]:
        """Vars the group reads but does not bind: the arguments of its call once fused."""
        bound = set(self.bindings)
        names: list[str] = []

        def visit(expr: relax.Expr) -> None:
            if isinstance(expr, relax.Var) and expr not in bound and expr.name not in names:
                names.append(expr.name)

        for value in self.bindings.values():
            relax.analysis.post_order_visit(value, visit)
        return sorted(names)

    @property
    def ops(self) -> list[str]:
        """Operator names in graph order (by provenance tag; untagged bindings keep their place)."""
        def order(item: tuple[relax.Var, relax.Expr]) -> int:
            found = tags.indices(item[0].name)
            return found[0] if found else 1 << 30

        names = []
        for _, value in sorted(self.bindings.items(), key=order):
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
                names.append(value.op.name.removeprefix("relax.").removeprefix("nn."))
        return names

    def input_vars(self) -> list[relax.Var]:
        """Vars the group reads but does not bind, in first-use order."""
        bound, found = set(self.bindings), []

        def visit(expr: relax.Expr) -> None:
            if isinstance(expr, relax.Var) and expr not in bound and expr not in found:
                found.append(expr)

        for value in self.bindings.values():
            relax.analysis.post_order_visit(value, visit)
        return found

    def constants(self) -> list[relax.Expr]:
        """Tensor constants the group reads (weights, biases, scales)."""
        found: list[relax.Expr] = []

        def visit(expr: relax.Expr) -> None:
            if not isinstance(expr, (relax.Var, relax.Call)) and isinstance(getattr(expr, "ty", None), relax.TensorType) \
                    and hasattr(getattr(expr, "value", None), "numpy"):
                found.append(expr)

        for value in self.bindings.values():
            relax.analysis.post_order_visit(value, visit)
        return found

    def escaping(self) -> list[relax.Var]:
        """Bound vars other than the group's output that are also read outside the group (the fused call
        must then return them too, as a tuple)."""
        inside = set(self.bindings)
        out = self.output_var()
        return [v for v in self.bindings if v is not out
                and any(u not in inside for u in self.var_usages.get(v, []))]

    def output_var(self) -> relax.Var | None:
        """The group's result: the one bound var not consumed inside the group."""
        inside = set(self.bindings)
        for var in self.bindings:
            users = self.var_usages.get(var, [])
            if not any(u in inside for u in users):
                return var
        return None


CheckFn = Callable[[Match, Hardware], "str | None"]     # a reason not to fuse, or None


CostFn = Callable[[Match, Hardware], CostEstimate]


@dataclass
class PatternRule:
    """A named fusion rule. `variants` maps a variant name to (pattern, annotations)."""

    name: str
    description: str
    variants: Callable[[], list[tuple[str, DFPattern, dict[str, DFPattern]]]]
    check: CheckFn | None = None
    cost: CostFn | None = None
    tags: tuple[str, ...] = field(default_factory=tuple)
    #: Optional rewrite run before matching while the rule is enabled (e.g. recognising a decomposed
    #: LayerNorm as one op): IRModule -> (IRModule, names of the bindings each rewrite consumed).
    prepare: Callable[[tvm.IRModule], tuple[tvm.IRModule, list[list[str]]]] | None = None
    #: Optional replacement kernel: (composite Relax function, TargetSpec) -> new function or None.
    #: Applied right after fusion; None keeps TVM's generated kernel for the group.
    replacement: Callable[..., object] | None = None


def commutative(op: str, a: DFPattern, b: DFPattern) -> DFPattern:
    return is_op(op)(a, b) | is_op(op)(b, a)


def scaled(x: DFPattern) -> DFPattern:
    return commutative("relax.multiply", x, is_const()) | is_op("relax.divide")(x, is_const())
