"""Is the cost model right? Predicted benefit of each fusion decision vs its measured speedup.

For every pattern group the cost model fused in the chosen models, the group's own Relax function (weights
bound as constants) is compiled twice, fused and unfused, and both are timed interleaved on this machine.
The script prints each decision and the Spearman rank correlation between predicted saving (us) and
measured saving (unfused - fused, us).

    python benchmarks/cost_model.py [--models resnet50 bert_encoder ...] [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from scipy import stats  # noqa: E402
from tvm import relax  # noqa: E402

from fuseguard.compiler.pipeline import CompileOptions, compile_model, compile_relax  # noqa: E402
from fuseguard.suites.models import get_model  # noqa: E402
from fuseguard.verify.perf.timing import measure_interleaved  # noqa: E402


def composite_groups(model, options: CompileOptions) -> tuple[list[tuple[str, tvm.IRModule]], object]:
    """Each pattern group as a standalone module (constants bound), captured right after pattern fusion."""
    captured: list[tuple[str, tvm.IRModule]] = []

    def capture(mod: tvm.IRModule) -> tvm.IRModule:
        main = mod["main"]
        calls: dict[str, relax.Call] = {}

        def visit(expr: relax.Expr) -> None:
            if isinstance(expr, relax.Call) and isinstance(expr.op, relax.GlobalVar):
                calls[expr.op.name_hint] = expr

        relax.analysis.post_order_visit(main.body, visit)
        for gv, func in mod.functions.items():
            if not isinstance(func, relax.Function) or func.attrs is None or "Composite" not in func.attrs:
                continue
            call = calls.get(gv.name_hint)
            if call is None:
                continue
            binds = {p: a for p, a in zip(func.params, call.args) if not isinstance(a, relax.Var)}
            body = func.bind_params(binds) if binds else func
            body = body.without_attr("Composite").without_attr("Primitive").with_attr("global_symbol", "main")
            captured.append((gv.name_hint, tvm.IRModule({"main": body})))
        return mod

    build = compile_model(model, options=CompileOptions(**{**options.__dict__, "extra_passes": (("after_fusion", capture),)}))
    return captured, build.report


def random_inputs(mod: tvm.IRModule, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for p in mod["main"].params:
        shape = [int(d) for d in p.ty.shape.values]
        out[p.name] = rng.standard_normal(shape).astype(str(p.ty.dtype))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["resnet50", "bert_encoder", "mlp_gelu", "conv_bn_relu",
                                                        "softmax_layernorm", "squeezenet"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--no-schedule", action="store_true")
    args = parser.parse_args()
    options = CompileOptions(schedule=not args.no_schedule)
    console = Console(width=180)
    rows, ablations = [], []
    for name in args.models:
        m = get_model(name)
        groups, report = composite_groups(m.make({}, seed=0), options)
        by_function = {g.function: g for g in report.groups}
        for fn_name, mod in groups:
            group = by_function.get(fn_name)
            if group is None or len(group.ops) < 2:
                continue
            fused = compile_relax(mod, options, name=fn_name)
            unfused = compile_relax(mod, options.unfused(), name=fn_name)
            inputs = random_inputs(mod, 0)
            s = measure_interleaved({"fused": fused.time_fn(inputs), "unfused": unfused.time_fn(inputs)},
                                    warmup=2, repeats=args.repeats)
            f_us, u_us = (float(np.median(s[k].usable_ms)) * 1e3 for k in ("fused", "unfused"))
            rows.append((name, group.pattern, " + ".join(group.ops), group.predicted_us, u_us - f_us, u_us / f_us,
                         group.bytes_saved))
        # Ablation: the whole model with each pattern switched off, against everything on. This also covers
        # rewrites a standalone group cannot show (a recognised decomposed LayerNorm is one op in both).
        full = compile_model(m.make({}, seed=0), options=options)
        inputs = None
        for pattern in sorted({g.pattern for g in report.groups if g.pattern != "generic"}):
            off = compile_model(m.make({}, seed=0),
                                options=CompileOptions(**{**options.__dict__,
                                                          "disabled_patterns": frozenset({pattern})}))
            if inputs is None:
                from fuseguard.verify.check.inputs import make_inputs
                from fuseguard.compiler.frontend.loader import load

                loaded = load(m.make({}, seed=0))
                inputs = make_inputs(loaded.model, loaded.input_shapes, seed=0)
            s = measure_interleaved({"all": full.time_fn(inputs), "off": off.time_fn(inputs)},
                                    warmup=2, repeats=args.repeats)
            a_us, o_us = (float(np.median(s[k].usable_ms)) * 1e3 for k in ("all", "off"))
            predicted = sum(g.predicted_us for g in report.groups if g.pattern == pattern)
            saved = sum(g.bytes_saved for g in report.groups if g.pattern == pattern)
            ablations.append((name, pattern, f"whole model, {report.count(pattern)} group(s)", predicted, o_us - a_us,
                              o_us / a_us, saved))
    _print(console, "per fused group (group compiled alone)", rows)
    _print(console, "per pattern (whole model with the pattern off vs on)", ablations)


def _print(console: Console, title: str, rows: list) -> None:
    table = Table(title=f"cost model: predicted vs measured saving, {title} ({os.cpu_count()} cores)")
    for col in ("model", "pattern", "ops", "predicted us", "measured us", "unfused/fused", "bytes saved"):
        table.add_column(col, justify="left" if col in ("model", "pattern", "ops") else "right")
    for r in rows:
        table.add_row(r[0], r[1], r[2], f"{r[3]:.1f}", f"{r[4]:.1f}", f"{r[5]:.2f}x", f"{r[6] / 1024:.0f} KiB")
    console.print(table)
    if len(rows) >= 3:
        rho, p = stats.spearmanr([r[3] for r in rows], [r[4] for r in rows])
        console.print(f"Spearman rank correlation (predicted vs measured saving): rho={rho:.3f} (p={p:.2g}, n={len(rows)})")
        wrong = [r for r in rows if r[4] < 0]
        console.print(f"fusions measured slower than unfused: {len(wrong)} of {len(rows)}"
                      + "".join(f"\n  {r[0]} {r[1]} ({r[2]}): {r[4]:.1f} us" for r in wrong))


if __name__ == "__main__":
    main()
