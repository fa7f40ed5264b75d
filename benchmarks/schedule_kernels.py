"""Per-kernel latency of the CPU schedules vs the default (unscheduled) pipeline and ONNX Runtime.

All three are measured in the same run (the machine is shared and noisy: only same-run ratios mean
anything). TVM's thread pool gets as many threads as ORT's intra-op pool (TVM_NUM_THREADS is set
before tvm is imported).

    python benchmarks/schedule_kernels.py                   # all workloads, 2 threads
    python benchmarks/schedule_kernels.py --only mlp conv --repeat 11 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help="workload names (default: all)")
    ap.add_argument("--repeat", type=int, default=7, help="timed runs after warm-up (median reported)")
    ap.add_argument("--threads", type=int, default=2, help="ORT intra-op threads = TVM_NUM_THREADS")
    ap.add_argument("--default-limit", type=float, default=3.0, help="skip repeats of the default pipeline above this (s)")
    ap.add_argument("--exact-math", action="store_true", help="turn the fast exp/erf/tanh approximations off")
    return ap.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import tvm  # noqa: E402

from fuseguard.compiler.hw.hostcpu import detect_host, host_target  # noqa: E402
from fuseguard.compiler.schedule import workloads  # noqa: E402
from fuseguard.compiler.schedule.cpu import CpuScheduleOptions, schedule_cpu_module_with_report  # noqa: E402


def _workloads() -> dict[str, Callable[[], onnx.ModelProto]]:
    return {
        "mlp": lambda: workloads.mlp_gelu(128, 768, 3072),
        "conv": lambda: workloads.conv_bn_relu(1, 64, 56, 64, 3),
        "conv1x1_13": lambda: workloads.conv_bn_relu(1, 512, 13, 1000, 1),  # SqueezeNet conv10: odd width
        "layernorm": lambda: workloads.layernorm(128, 768),
        "softmax": lambda: workloads.softmax((1, 12, 128, 128)),
        "masked_smx": lambda: workloads.masked_softmax(4, 64),   # LLaMA's causal mask: no denormals in exp
        "bert_layer": lambda: workloads.bert_layer(128, 768, 12, 3072),
        "resnet50": lambda: onnx.load(str(workloads.light_model_path("resnet50"))),
    }


def _median_ms(fn: Callable[[], object], repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _bench_one(name: str, model: onnx.ModelProto, args: argparse.Namespace, target: tvm.target.Target) -> dict[str, object]:
    inputs = workloads.random_inputs(model)
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ref = sess.run(None, inputs)[0]

    row: dict[str, object] = {"name": name}
    t0 = time.perf_counter()
    fused = workloads.import_and_fuse(model, target)
    row["import_s"] = time.perf_counter() - t0

    # Default pipeline: no schedule. One run first; repeat only when it is fast enough.
    t0 = time.perf_counter()
    call_default, _ = workloads.run_vm(fused, target, inputs)
    row["default_compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    call_default()
    once = time.perf_counter() - t0
    row["default_ms"] = _median_ms(call_default, args.repeat, warmup=0) if once <= args.default_limit else once * 1e3
    row["default_note"] = "" if once <= args.default_limit else "(1 run)"

    opts = CpuScheduleOptions(fast_math=not args.exact_math)
    t0 = time.perf_counter()
    with target:
        sched, report = schedule_cpu_module_with_report(fused, target, options=opts)
    call_sched, out = workloads.run_vm(sched, target, inputs)
    row["sched_compile_s"] = time.perf_counter() - t0
    row["max_abs_err"] = float(np.max(np.abs(out - ref)))
    row["left_alone"] = len(report.left_alone)
    row["sched_ms"] = _median_ms(call_sched, args.repeat)
    row["ort_ms"] = _median_ms(lambda: sess.run(None, inputs), args.repeat)
    return row


def main() -> None:
    args = ARGS or _parse()
    host = detect_host()
    target = host_target()
    print(f"host: {host.model_name} ({host.vendor}) mcpu={host.mcpu} cores={host.cores} SIMD={host.vector_bits}b")
    print(f"TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS')} ORT intra-op threads={args.threads} repeat={args.repeat} fast_math={not args.exact_math}\n")
    table = _workloads()
    names = args.only or list(table)
    hdr = f"{'workload':<11} {'default ms':>14} {'sched ms':>9} {'ORT ms':>8} {'sched/ORT':>9} {'default/sched':>13} {'compile s':>9} {'max|err|':>9} {'unsched':>7}"
    print(hdr)
    print("-" * len(hdr))
    for name in names:
        row = _bench_one(name, table[name](), args, target)
        d = f"{row['default_ms']:.1f}{row['default_note']}"
        print(
            f"{name:<11} {d:>14} {row['sched_ms']:>9.2f} {row['ort_ms']:>8.2f} "
            f"{row['sched_ms'] / row['ort_ms']:>8.2f}x {row['default_ms'] / row['sched_ms']:>12.1f}x "
            f"{row['sched_compile_s']:>9.1f} {row['max_abs_err']:>9.1e} {row['left_alone']:>7}",
            flush=True,
        )


if __name__ == "__main__":
    main()
