"""Is a candidate group legal to fuse? Checked for every match before the cost model sees it.

A fused group becomes one call. That is only well-formed when the group is *convex*: no path leaves
the group and comes back into it. Otherwise one of the call's arguments is computed from the call's
own result. The pre-LN transformer is the case met in real exports (vit_b_16, GPT-2, Whisper,
Wav2Vec2): `e = x + pos; y = LayerNorm(e); z = e + f(y); LayerNorm(z)` let the bias+residual LayerNorm
variant take `x + pos` as its "bias" add while its residual input `f(y)` is computed from that add,
and code generation stopped with `Var n71_Add is not defined`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tvm import relax


def _reads(value: relax.Expr) -> set[relax.Var]:
    found: set[relax.Var] = set()

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Var):
            found.add(expr)

    relax.analysis.post_order_visit(value, visit)
    return found


def convexity_violation(bindings: Mapping[relax.Var, relax.Expr],
                        var_usages: Mapping[relax.Var, Iterable[relax.Var]]) -> str | None:
    """Why the group `bindings` is not convex in the function whose `var_usages` are given (None: it is).

    Walks forward from the group's vars through their users outside the group; reaching a var the group
    reads means a path left the group and comes back.
    """
    inside = set(bindings)
    inputs = set().union(*(_reads(v) for v in bindings.values())) - inside if bindings else set()
    # (outside var, the group var the path left from), walked depth-first
    frontier = [(u, var) for var in inside for u in var_usages.get(var, ()) if u not in inside]
    seen: set[relax.Var] = set()
    while frontier:
        var, origin = frontier.pop()
        if var in seen:
            continue
        seen.add(var)
        if var in inputs:
            return (f"not convex: the group's input '{var.name}' is computed from its own '{origin.name}' "
                    f"(a path leaves the group and comes back), so the fused call would consume its own output")
        frontier.extend((u, origin) for u in var_usages.get(var, ()) if u not in inside)
    return None
