"""One convolution at a time (conv + bias + activation): fuseguard's kernel against ONNX Runtime, interleaved.

Why: a model's time is spread over dozens of convolutions of different shapes; a schedule change is judged
on the shapes it targets first. Each case is compiled with the default schedules and, with `--off SWITCH`,
once more with that `CpuScheduleOptions` switch off (`FUSEGUARD_CPU_SCHEDULE_OFF`), and all arms are timed
interleaved in this one process (`verify.perf.timing.measure_interleaved`, both thread pools not spinning).

    python benchmarks/conv_kernels.py                          # the default shape list
    python benchmarks/conv_kernels.py --off conv_pointwise     # the pointwise kernel against the old one
    python benchmarks/conv_kernels.py --case 240,240,28,5,2,240,silu --off depthwise_deinterleave
    python benchmarks/conv_kernels.py --nchw                   # the blocked layout against NCHW (--no-layout)
    python benchmarks/conv_kernels.py --unfused --case 240,240,28,5,1,240,silu  # fused against conv + its ops
    python benchmarks/conv_kernels.py --force-blocked --case 512,1000,13,1,1   # a blocked kernel on its own

A case is C_IN,C_OUT,HW,K,STRIDE[,GROUPS[,ACT]] (ACT relu, relu6, silu or gelu).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TVM_NUM_THREADS", "2")
os.environ["TVM_THREAD_POOL_SPIN_COUNT"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fuseguard.compiler.frontend.loader import load  # noqa: E402
from fuseguard.compiler.pipeline import CompileOptions, compile_model  # noqa: E402
from fuseguard.verify.perf.timing import measure_interleaved, ort_timing_options  # noqa: E402

DEFAULT_CASES = [
    "64,64,56,3,1", "128,128,56,3,2", "128,128,28,3,1", "256,256,14,3,1",
    "16,96,112,1,1", "16,64,112,1,1", "64,384,14,1,1", "64,256,56,1,1",
    "96,96,112,3,2,96,silu", "144,144,56,3,2,144,silu", "240,240,28,5,2,240,silu", "1152,1152,7,3,1,1152,silu",
]


def model_of(c_in: int, c_out: int, hw: int, k: int, stride: int, groups: int = 1, act: str = "relu"):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((c_out, c_in // groups, k, k)) * 0.1).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(c_out).astype(np.float32), "b")
    pad = k // 2
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[pad] * 4, strides=[stride] * 2,
                              kernel_shape=[k, k], group=groups)]
    if act == "silu":
        nodes += [helper.make_node("Sigmoid", ["y"], ["s"]), helper.make_node("Mul", ["y", "s"], ["z"])]
    elif act == "gelu":     # the erf form exporters write: x * 0.5 * (1 + erf(x / sqrt 2))
        consts = [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(np.array(v, np.float32), n))
                  for n, v in (("r2", 1.4142135), ("one", 1.0), ("half", 0.5))]
        nodes += consts + [helper.make_node("Div", ["y", "r2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                           helper.make_node("Add", ["e", "one"], ["p"]), helper.make_node("Mul", ["y", "p"], ["q"]),
                           helper.make_node("Mul", ["q", "half"], ["z"])]
    elif act == "relu6":    # MobileNet-V2's Clip(0, 6)
        lo, hi = (numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("lo", 0.0), ("hi", 6.0)))
        nodes += [helper.make_node("Constant", [], ["lo"], value=lo),
                  helper.make_node("Constant", [], ["hi"], value=hi),
                  helper.make_node("Clip", ["y", "lo", "hi"], ["z"])]
    else:
        nodes += [helper.make_node("Relu", ["y"], ["z"])]
    ho = (hw + 2 * pad - k) // stride + 1
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c_in, hw, hw])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, c_out, ho, ho])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), 2 * c_in // groups * c_out * k * k * ho * ho


def parse_case(text: str) -> tuple:
    parts = text.split(",")
    nums = [int(p) for p in parts[:6]]
    act = parts[6] if len(parts) > 6 else "relu"
    return (*nums, *([1] if len(nums) == 5 else []), act)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", default=[], help="C_IN,C_OUT,HW,K,STRIDE[,GROUPS[,ACT]] (repeatable)")
    p.add_argument("--off", default=None, metavar="SWITCH", help="also time a build with this schedule switch off")
    p.add_argument("--nchw", action="store_true", help="also time the NCHW build (the layout step off)")
    p.add_argument("--unfused", action="store_true", help="also time the unfused build (conv, bias, activation apart)")
    p.add_argument("--force-blocked", action="store_true",
                   help="block every convertible conv even where its edge transforms cost more than blocking saves")
    p.add_argument("--repeats", type=int, default=25)
    args = p.parse_args(argv)
    if args.force_blocked:
        from fuseguard.compiler.passes import layout
        layout.MIN_MACS_PER_MOVED = 0
    threads = int(os.environ["TVM_NUM_THREADS"])
    print(f"{'case':34s} {'tvm ms':>8s} {'GFLOP/s':>8s} {'ort ms':>8s} {'tvm/ort':>8s}"
          + (f" {'off ms':>8s} {'tvm/off':>8s}" if args.off else "")
          + (f" {'nchw ms':>8s} {'tvm/nchw':>8s}" if args.nchw else "")
          + (f" {'unf ms':>8s} {'tvm/unf':>8s}" if args.unfused else "") + "  rule")
    for text in args.case or DEFAULT_CASES:
        case = parse_case(text)
        model, flops = model_of(*case)
        x = np.random.default_rng(1).standard_normal((1, case[0], case[2], case[2])).astype(np.float32)
        session = ort.InferenceSession(model.SerializeToString(), ort_timing_options(threads),
                                       providers=["CPUExecutionProvider"])
        ref = session.run(None, {"x": x})[0]
        fns, rule = {}, ""
        wanted = {"tvm": True, "off": bool(args.off), "nchw": args.nchw, "unf": args.unfused}
        for label in (k for k, on in wanted.items() if on):
            os.environ["FUSEGUARD_CPU_SCHEDULE_OFF"] = args.off if label == "off" else ""
            options = CompileOptions(layout=label != "nchw", fusion=label != "unf")
            built = compile_model(load(model, None, name="conv"), options=options)
            err = float(np.abs(built.run({"x": x})[0] - ref).max())
            if err > 1e-3:
                print(f"{text}: {label} build differs from ORT by {err:.2e}", file=sys.stderr)
                return 1
            fns[label] = built.time_fn({"x": x})
            if label == "tvm":
                rule = ", ".join(sorted(set(built.report.schedules.values())))
        os.environ.pop("FUSEGUARD_CPU_SCHEDULE_OFF", None)
        fns["ort"] = lambda: session.run(None, {"x": x})
        med = {k: v.median_ms for k, v in measure_interleaved(fns, warmup=3, repeats=args.repeats).items()}
        line = (f"{text:34s} {med['tvm']:8.3f} {flops / med['tvm'] / 1e6:8.1f} {med['ort']:8.3f} "
                f"{med['tvm'] / med['ort']:8.2f}")
        if args.off:
            line += f" {med['off']:8.3f} {med['tvm'] / med['off']:8.2f}"
        if args.nchw:
            line += f" {med['nchw']:8.3f} {med['tvm'] / med['nchw']:8.2f}"
        if args.unfused:
            line += f" {med['unf']:8.3f} {med['tvm'] / med['unf']:8.2f}"
        print(line + f"  {rule}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
