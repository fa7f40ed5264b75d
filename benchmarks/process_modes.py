"""Per-process speed modes: the same exported build timed in many fresh processes, with and without ASLR.

    python benchmarks/process_modes.py mlp_gelu bert_encoder --processes 20
    python benchmarks/process_modes.py mlp_gelu --layouts default,hugepages --processes 10

Each model is compiled and exported once (verify.perf.bench.prepare_bench); each fresh process loads it and
times fused, unfused and ONNX Runtime interleaved (verify.perf.bench.time_prepared). Printed per model and
layout: the per-process medians, within-process spread (median IQR / median), between-process spread
((max - min) / median) and how many processes ran > 25% slower than the fastest. `setarch -R` turns
address-space randomisation off for the timing process; `hugepages` sets `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`
(malloc asks for transparent huge pages: TVM's constants and ONNX Runtime's weights). Per layout, also the
fused / ORT ratio as `bench` reads it: the geometric mean of the per-process ratios with its 95% interval
(docs/measurement.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

CHILD = ("import json, sys; from fuseguard.verify.perf.bench import time_prepared; "
         "print(json.dumps(time_prepared(sys.argv[1], threads=int(sys.argv[2]), repeats=9, "
         "contenders=('tvm_fused', 'tvm_unfused', 'ort'))))")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+")
    p.add_argument("--processes", type=int, default=20)
    p.add_argument("--layouts", default="default,aslr-off", help="comma-separated: default, aslr-off, hugepages")
    args = p.parse_args(argv)
    layouts = {"default": ("ASLR on", [], {}), "aslr-off": ("ASLR off", ["setarch", "-R"], {}),
               "hugepages": ("huge pages", [], {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})}
    from fuseguard.compiler.hw.target import host_cores
    from fuseguard.verify.perf.bench import prepare_bench
    from fuseguard.verify.check.model import resolve_model_arg
    from fuseguard.verify.perf.timing import timing_env

    threads = host_cores()
    env = {**os.environ, **timing_env(threads), "PYTHONPATH": str(ROOT)}
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            prepare_bench(resolve_model_arg(name), tmp)
            for layout, prefix, extra in (layouts[k] for k in args.layouts.split(",")):
                runs = []
                for _ in range(args.processes):
                    out = subprocess.run([*prefix, sys.executable, "-c", CHILD, tmp, str(threads)],
                                         env={**env, **extra}, capture_output=True, text=True, check=True,
                                         cwd=ROOT).stdout
                    runs.append(json.loads(out.strip().splitlines()[-1]))
                for contender in ("tvm_fused", "tvm_unfused", "ort"):
                    med = np.array([np.median(r[contender]) for r in runs])
                    within = np.median([np.subtract(*np.percentile(r[contender], [75, 25])) / np.median(r[contender])
                                        for r in runs])
                    slow = int((med > 1.25 * med.min()).sum())
                    print(f"{name:14s} {layout:9s} {contender:12s} median {np.median(med):7.3f} ms  within "
                          f"{100 * within:5.1f}%  between {100 * (med.max() - med.min()) / np.median(med):6.1f}%  "
                          f"slow processes {slow}/{len(med)}  [{', '.join(f'{m:.2f}' for m in med)}]")
                ratios = np.log([np.median(r["tvm_fused"]) / np.median(r["ort"]) for r in runs])
                half = stats.t.ppf(0.975, len(ratios) - 1) * ratios.std(ddof=1) / np.sqrt(len(ratios))
                print(f"{name:14s} {layout:9s} fused / ORT {np.exp(ratios.mean()):.3f}x "
                      f"[{np.exp(ratios.mean() - half):.3f}, {np.exp(ratios.mean() + half):.3f}], half-width "
                      f"{100 * (np.exp(half) - 1):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
