"""Fused attention kernel vs the unfused TVM path and ONNX Runtime: latency and peak memory.

Workload: BERT-style self-attention, B=1, H=12, D=64, mask [1, 1, 1, S], S in 128..2048.

* fused   — compiler.kernels.attention_primfunc for this host's CPU (one PrimFunc).
* unfused — Relax matmul -> multiply -> add -> softmax -> matmul through LegalizeOps,
            AnnotateTIROpPattern, FoldConstant, FuseOps, FuseTIR: the stock, unscheduled TVM path,
            which materialises the S x S scores (twice: before and after the softmax).
* ort     — ONNX Runtime on the same subgraph built with onnx.helper, 2 intra-op threads.

Every (implementation, S) is timed in a fresh subprocess that only loads a prebuilt library (no
compiler in the process). Right before the first run the worker resets the kernel's RSS
high-water mark (/proc/self/clear_refs, else getrusage ru_maxrss is used); "exec MB" is how far
that mark rose above the RSS at that moment while running: the memory the implementation
really touched (scores, workspace, thread stacks), not the import-time peak. TVM_NUM_THREADS=2, equal to ORT's threads. Latency: median of --runs runs
after one warm-up.

    python benchmarks/attention.py                   # S = 128 512 1024 2048, 7 runs each
    python benchmarks/attention.py --sizes 128 512   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCH, HEADS, HEAD_DIM = 1, 12, 64
THREADS = 2
IMPLS = ("fused", "unfused", "ort")


def make_inputs(seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (BATCH, HEADS, seq, HEAD_DIM)
    mask = np.where(rng.random((BATCH, 1, 1, seq)) < 0.2, -10000.0, 0.0).astype(np.float32)
    mask[..., 0] = 0.0
    return {"Q": rng.standard_normal(shape, dtype=np.float32), "K": rng.standard_normal(shape, dtype=np.float32),
            "V": rng.standard_normal(shape, dtype=np.float32), "mask": mask}


def scale() -> float:
    return 1.0 / float(np.sqrt(HEAD_DIM))


# ---------------------------------------------------------------------------------------------
# Building (parent process)


def build_fused(seq: int, path: Path) -> None:
    import tvm

    from fuseguard.compiler.kernels import attention_primfunc, host_target

    target = host_target()
    func = attention_primfunc(BATCH, HEADS, seq, seq, HEAD_DIM, mask_shape=(BATCH, 1, 1, seq), scale=scale(),
                              target=target)
    tvm.compile(func, target=target).export_library(str(path))


def build_unfused(seq: int, path: Path) -> None:
    import tvm
    from tvm import relax

    from fuseguard.compiler.kernels import host_target

    shape = (BATCH, HEADS, seq, HEAD_DIM)
    bb = relax.BlockBuilder()
    q, k, v = (relax.Var(n, relax.TensorType(shape, "float32")) for n in "qkv")
    mask = relax.Var("mask", relax.TensorType((BATCH, 1, 1, seq), "float32"))
    with bb.function("main", [q, k, v, mask]):
        with bb.dataflow():
            kt = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
            s = bb.emit(relax.op.matmul(q, kt))
            s = bb.emit(relax.op.multiply(s, relax.const(scale(), "float32")))
            s = bb.emit(relax.op.add(s, mask))
            p = bb.emit(relax.op.nn.softmax(s, axis=-1))
            out = bb.emit_output(relax.op.matmul(p, v))
        bb.emit_func_output(out)
    mod = tvm.transform.Sequential([
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
        relax.transform.FuseOps(), relax.transform.FuseTIR(),
    ])(bb.get())
    tvm.compile(mod, target=host_target()).export_library(str(path))


def build_ort(seq: int, path: Path) -> None:
    from onnx import TensorProto, helper, numpy_helper, save

    f32 = TensorProto.FLOAT
    shape = [BATCH, HEADS, seq, HEAD_DIM]
    nodes = [
        helper.make_node("Transpose", ["K"], ["Kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["Q", "Kt"], ["S"]),
        helper.make_node("Mul", ["S", "scale"], ["Ss"]),
        helper.make_node("Add", ["Ss", "mask"], ["Sm"]),
        helper.make_node("Softmax", ["Sm"], ["P"], axis=-1),
        helper.make_node("MatMul", ["P", "V"], ["O"]),
    ]
    graph = helper.make_graph(
        nodes, "attention",
        [helper.make_tensor_value_info(n, f32, shape) for n in "QKV"]
        + [helper.make_tensor_value_info("mask", f32, [BATCH, 1, 1, seq])],
        [helper.make_tensor_value_info("O", f32, shape)],
        initializer=[numpy_helper.from_array(np.array(scale(), np.float32), "scale")],
    )
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


BUILDERS = {"fused": (build_fused, ".so"), "unfused": (build_unfused, ".so"), "ort": (build_ort, ".onnx")}


# ---------------------------------------------------------------------------------------------
# Measuring (fresh worker process per configuration)


def _status_mb(field: str) -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0  # kB
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _reset_peak_rss() -> bool:
    """Restart the kernel's RSS high-water mark (VmHWM) at the current RSS (Linux >= 4.0).

    Without it the mark keeps the transient peak of importing TVM/ORT, which hides the memory
    of the runs themselves.
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb(reset_ok: bool) -> float:
    if reset_ok:
        return _status_mb("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def reference(inputs: dict[str, np.ndarray]) -> np.ndarray:
    q, k, v, mask = (inputs[n].astype(np.float64) for n in ("Q", "K", "V", "mask"))
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale() + mask
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhij,bhjd->bhid", p, v)


def worker(impl: str, seq: int, artifact: str, runs: int) -> dict[str, float]:
    inputs = make_inputs(seq)
    if impl == "ort":
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = THREADS
        opts.inter_op_num_threads = 1
        sess = ort.InferenceSession(artifact, opts, providers=["CPUExecutionProvider"])

        def call() -> np.ndarray:
            return sess.run(None, inputs)[0]
    else:
        import tvm
        from tvm import relax

        lib = tvm.runtime.load_module(artifact)
        args = [tvm.runtime.tensor(inputs[n]) for n in ("Q", "K", "V", "mask")]
        if impl == "fused":
            out = tvm.runtime.tensor(np.zeros(inputs["Q"].shape, np.float32))
            kernel = lib["fused_attention"]

            def call() -> np.ndarray:
                kernel(*args, out)
                return out
        else:
            vm = relax.VirtualMachine(lib, tvm.cpu())

            def call() -> np.ndarray:
                return vm["main"](*args)

    reset_ok = _reset_peak_rss()
    rss_before = _status_mb("VmRSS")
    result = call()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - start)
    peak = _peak_rss_mb(reset_ok)
    got = result if isinstance(result, np.ndarray) else result.numpy()
    err = float(np.abs(got - reference(inputs)).max())
    return {"median_ms": 1e3 * float(np.median(times)), "rss_before_mb": rss_before, "peak_mb": peak,
            "exec_mb": max(peak - rss_before, 0.0), "max_err": err}


def measure(impl: str, seq: int, artifact: Path, runs: int) -> dict[str, float]:
    env = dict(os.environ, TVM_NUM_THREADS=str(THREADS), OMP_NUM_THREADS=str(THREADS))
    cmd = [sys.executable, __file__, "--worker", impl, "--seq", str(seq), "--artifact", str(artifact),
           "--runs", str(runs)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} S={seq} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 512, 1024, 2048])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--artifact", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.seq, args.artifact, args.runs)))
        return
    if args.runs < 7:
        parser.error("--runs must be >= 7 (medians of fewer runs are too noisy here)")

    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(160, Console().width))
    results: dict[tuple[str, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seq in args.sizes:
            for impl in args.impls:
                build, ext = BUILDERS[impl]
                artifact = Path(tmp) / f"{impl}_{seq}{ext}"
                start = time.perf_counter()
                build(seq, artifact)
                built = time.perf_counter() - start
                results[impl, seq] = res = measure(impl, seq, artifact, args.runs)
                console.print(f"S={seq:5d} {impl:8s} build {built:5.1f}s  median {res['median_ms']:10.2f} ms  "
                              f"peak {res['peak_mb']:7.1f} MB  exec {res['exec_mb']:7.1f} MB  "
                              f"max|err| {res['max_err']:.1e}")

    table = Table(title=f"attention B={BATCH} H={HEADS} D={HEAD_DIM}, fp32, {THREADS} threads, "
                        f"median of {args.runs}")
    table.add_column("S", justify="right")
    for impl in args.impls:
        table.add_column(f"{impl} ms", justify="right")
    for other in (i for i in args.impls if i != "fused"):
        table.add_column(f"{other}/fused", justify="right")
    for impl in args.impls:
        table.add_column(f"{impl} peak/exec MB", justify="right")
    for seq in args.sizes:
        row = [str(seq)]
        row += [f"{results[i, seq]['median_ms']:.2f}" for i in args.impls]
        if "fused" in args.impls:
            row += [f"{results[i, seq]['median_ms'] / results['fused', seq]['median_ms']:.1f}x"
                    for i in args.impls if i != "fused"]
        row += [f"{results[i, seq]['peak_mb']:.0f} / {results[i, seq]['exec_mb']:.1f}" for i in args.impls]
        table.add_row(*row)
    console.print(table)
    for impl in args.impls:
        sizes = [s for s in args.sizes if results[impl, s]["exec_mb"] > 0]
        if len(sizes) >= 2:
            lo, hi = sizes[0], sizes[-1]
            growth = results[impl, hi]["exec_mb"] / max(results[impl, lo]["exec_mb"], 1e-3)
            console.print(f"{impl}: exec memory x{growth:.1f} from S={lo} to S={hi} "
                          f"(linear would be x{hi / lo:.0f}, quadratic x{(hi / lo) ** 2:.0f})")


if __name__ == "__main__":
    main()
