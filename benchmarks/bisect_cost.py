"""What `fuseguard bisect` costs: seconds and builds to localise a known-wrong fused group.

For ResNet-50 and the BERT encoder layer, a clean run (two builds, no drift) and a run with one fused
group broken through the `after_fusion` pass hook (a dropped bias), both unscheduled (`schedule=False`,
as the tests build) unless --schedule is given. Prints one table; `--json FILE` keeps the numbers.

    python benchmarks/bisect_cost.py [--schedule] [--models resnet50,bert_encoder] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import tvm  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from tvm import relax  # noqa: E402

from fuseguard.compiler.pipeline import CompileOptions  # noqa: E402
from fuseguard.suites.models import get_model  # noqa: E402
from fuseguard.verify.debug.bisect import bisect_model  # noqa: E402


def _cases(schedule: bool) -> dict[str, tuple[dict, str, object]]:
    from test_bisect import Perturb, drop_bias

    def layer3_reduction(call: relax.Call) -> bool:
        w = call.args[1]
        return isinstance(w, tvm.ir.Constant) and tuple(w.value.numpy().shape) == (256, 512, 1, 1)

    return {
        "resnet50": ({}, "conv2d_bias_act", lambda: Perturb("conv_drop_bias", "conv2d_bias_act", drop_bias,
                                                             layer3_reduction)),
        "bert_encoder": ({"seq": 16}, "matmul_bias_gelu",
                         lambda: Perturb("gelu_drop_bias", "matmul_bias_gelu", drop_bias)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", action="store_true", help="build with the CPU schedules")
    parser.add_argument("--models", default="resnet50,bert_encoder")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    for name, (dims, pattern, make) in _cases(args.schedule).items():
        if name not in args.models.split(","):
            continue
        model = get_model(name).make(dims, seed=0)
        for label in ("clean", f"broken {pattern}"):
            passes = () if label == "clean" else (("after_fusion", make()),)
            options = CompileOptions(schedule=args.schedule, extra_passes=passes)
            with tempfile.TemporaryDirectory() as out:
                r = bisect_model(model, options=options, out_dir=out)
            t = r.timings
            rows.append({
                "model": name, "case": label, "nodes": len(model.graph.node), "verdict": r.summary(),
                "culprit": r.culprit.function if r.culprit else None, "builds": r.builds, "seconds": r.seconds,
                "build_s": sum(v for k, v in t.items() if k.startswith("build")),
                "run_s": sum(v for k, v in t.items() if k.startswith("run")),
                "ort_s": t.get("onnxruntime", 0.0), "align_s": t.get("align", 0.0),
                "reproducer_s": t.get("reproducer", 0.0), "compared": r.compared, "unmapped": len(r.unmapped),
            })
    table = Table(title=f"fuseguard bisect cost ({'scheduled' if args.schedule else 'unscheduled'} CPU builds)")
    for col in ("model", "case", "ONNX nodes", "builds", "total s", "build s", "run s", "ORT s", "align s",
                "reproducer s", "compared", "unmapped", "culprit"):
        table.add_column(col, justify="left" if col in ("model", "case", "culprit") else "right")
    for r in rows:
        table.add_row(r["model"], r["case"], str(r["nodes"]), str(r["builds"]), f"{r['seconds']:.1f}",
                      f"{r['build_s']:.1f}", f"{r['run_s']:.1f}", f"{r['ort_s']:.1f}", f"{r['align_s']:.2f}",
                      f"{r['reproducer_s']:.1f}", str(r["compared"]), str(r["unmapped"]), r["culprit"] or "-")
    Console(width=200).print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
