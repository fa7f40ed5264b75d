"""The device check: run a bundle of prebuilt fuseguard libraries on a GPU machine that has no TVM.

Runs where only Python, NumPy and (optionally) PyTorch are installed: the bundle (`fuseguard device-bundle`,
verify/device/bundle.py) carries the exported libraries, TVM's runtime (libtvm_runtime*.so, not the
compiler) and the tvm-ffi wheel. Kernels are compiled from their CUDA source when a library loads, by the
machine's nvcc with the flags the offline SASS check used (compiler/cuda/sass.py). For each model: fused and
unfused outputs against the expected ones (ONNX Runtime's, computed where the bundle was made), both timed;
each attention kernel against PyTorch's scaled_dot_product_attention, numerics and time. One JSON summary.

    python3 -m fuseguard.verify.devicecheck BUNDLE [--mode smoke|full] [--json OUT.json]

Imports nothing of TVM's Python package and nothing of fuseguard's that does (compiler.cuda.sass only for nvcc).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

KDL_CPU, KDL_CUDA = 1, 2
POOLED_ALLOCATOR = 2


def load_runtime(bundle: Path, device: str) -> Any:
    """tvm-ffi plus TVM's runtime libraries (RTLD_GLOBAL, so the VM's loaders register); the CUDA JIT."""
    import tvm_ffi

    ctypes.CDLL(str(bundle / "runtime" / "libtvm_runtime.so"), mode=ctypes.RTLD_GLOBAL)
    if device == "cuda":
        _preload_cudart()
        ctypes.CDLL(str(bundle / "runtime" / "libtvm_runtime_cuda.so"), mode=ctypes.RTLD_GLOBAL)
        from fuseguard.compiler.cuda.jit import install

        if not install():
            raise RuntimeError("no nvcc on this machine: the kernels' CUDA source cannot be compiled")
    return tvm_ffi


def _preload_cudart() -> None:
    """libtvm_runtime_cuda.so needs libcudart.so.13: from the system, else from PyTorch's NVIDIA wheels."""
    try:
        ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    for entry in sys.path:
        for found in Path(entry).glob("nvidia/cu13/lib/libcudart.so.13*") if Path(entry).is_dir() else []:
            ctypes.CDLL(str(found), mode=ctypes.RTLD_GLOBAL)
            return
    raise RuntimeError("libcudart.so.13 not found (system or nvidia/cu13 wheels)")


class Runner:
    """One exported library run through the Relax VM by FFI alone."""

    def __init__(self, ffi: Any, path: Path, device: str) -> None:
        self.device = device
        self.dev_type = KDL_CUDA if device == "cuda" else KDL_CPU
        self.vm = ffi.load_module(str(path))["vm_load_executable"]()
        self.vm["vm_initialization"](self.dev_type, 0, POOLED_ALLOCATOR, KDL_CPU, 0, POOLED_ALLOCATOR)
        self.main = self.vm["main"]
        self.ffi = ffi

    def upload(self, arrays: list[np.ndarray]) -> list[Any]:
        if self.device == "cuda":
            import torch

            return [self.ffi.from_dlpack(torch.from_numpy(np.ascontiguousarray(a)).cuda()) for a in arrays]
        self._keep = [_aligned(a) for a in arrays]
        return [self.ffi.from_dlpack(a) for a in self._keep]

    def run(self, args: list[Any]) -> list[np.ndarray]:
        out = self.main(*args)
        outs = list(out) if isinstance(out, (list, tuple)) or type(out).__name__ == "Array" else [out]
        return [_to_numpy(o) for o in outs]

    def time_ms(self, args: list[Any], repeats: int) -> float:
        return _time_ms(lambda: self.main(*args), self.device, repeats)


def _time_ms(call: Any, device: str, repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of `call()`, the device synchronised after each."""
    sync = _sync(device)
    for _ in range(warmup):
        call()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return float(np.median(samples))


def _aligned(a: np.ndarray, alignment: int = 64) -> np.ndarray:
    """A copy of `a` at a 64-byte aligned address: TVM's CPU kernels use aligned vector loads (an npz array
    at a 16-byte boundary crashed the attention kernel), and its own tensors are allocated that way."""
    raw = np.empty(a.nbytes + alignment, dtype=np.uint8)
    offset = -raw.ctypes.data % alignment
    out = raw[offset: offset + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _sync(device: str):
    if device == "cuda":
        import torch

        return torch.cuda.synchronize
    return lambda: None


def _to_numpy(value: Any) -> np.ndarray:
    try:
        return np.from_dlpack(value)
    except (RuntimeError, TypeError, BufferError):   # a device tensor: through PyTorch
        import torch

        return torch.from_dlpack(value).cpu().numpy()


def _close(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> tuple[bool, float]:
    err = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))) if got.size else 0.0
    ok = got.shape == want.shape and bool(np.allclose(got, want, rtol=rtol, atol=atol))
    return ok, err


def generated_inputs(spec: dict) -> list[np.ndarray]:
    """Inputs regenerated from a seed (the bundle stores only the recipe: long attention inputs are too big
    to carry). NumPy's PCG64 streams are the same on every platform."""
    rng = np.random.default_rng(spec["seed"])
    return [rng.standard_normal(spec["shape"]).astype(spec["dtype"]) for _ in range(spec["count"])]


def _entry_arrays(bundle: Path, entry: dict) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    data = np.load(bundle / entry["data"]) if entry.get("data") else {}
    if "generate" in entry:
        inputs = generated_inputs(entry["generate"])
    else:
        inputs = [data[f"input_{i}"] for i in range(entry["inputs"])]
    expected = [data[f"expected_{i}"] for i in range(entry["outputs"])] if "expected_0" in data else None
    return inputs, expected


def check_model(ffi: Any, bundle: Path, entry: dict, device: str, repeats: int) -> dict:
    return _check_builds(ffi, bundle, entry, device, repeats)[0]


def _check_builds(ffi: Any, bundle: Path, entry: dict, device: str,
                  repeats: int) -> tuple[dict, dict[str, list[np.ndarray]]]:
    """The row for one entry, and each build's outputs (for comparisons beyond the bundle's own)."""
    inputs, expected = _entry_arrays(bundle, entry)
    row: dict[str, Any] = {"model": entry["name"], "kind": "model"}
    outputs: dict[str, list[np.ndarray]] = {}
    for config in ("unfused", "fused"):
        start = time.perf_counter()
        try:
            runner = Runner(ffi, bundle / entry["libs"][config], device)
            args = runner.upload(inputs)
            got = outputs[config] = runner.run(args)
            load_s = time.perf_counter() - start
            # no stored expectation (a long attention): the unfused build is the reference of the fused one
            want = expected if expected is not None else outputs.get("unfused")
            checks = [_close(g, w, entry["rtol"], entry["atol"]) for g, w in zip(got, want)] if want else []
            row[config] = {"passed": want is None or (len(got) == len(want) and all(ok for ok, _ in checks)),
                           "max_abs_error": max((e for _, e in checks), default=0.0),
                           "ms": runner.time_ms(args, repeats), "load_s": load_s,
                           "reference": "expected" if expected is not None else "unfused build"}
        except Exception as err:  # one model's failure is reported, the rest still run
            row[config] = {"passed": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    if "ms" in row["fused"] and "ms" in row["unfused"]:
        row["unfused_over_fused"] = row["unfused"]["ms"] / row["fused"]["ms"]
    row["passed"] = row["fused"]["passed"] and row["unfused"]["passed"]
    return row, outputs


def check_attention(ffi: Any, bundle: Path, entry: dict, device: str, repeats: int) -> dict:
    """The fused attention kernel against PyTorch's SDPA (where PyTorch is installed) at one shape."""
    row, outputs = _check_builds(ffi, bundle, entry, device, repeats)
    row["kind"] = "attention"
    row["seq"] = entry["seq"]
    try:
        import torch
        import torch.nn.functional as F

        arrays, _ = _entry_arrays(bundle, entry)
        q, k, v = (torch.from_numpy(a) for a in arrays[:3])
        if device == "cuda":
            q, k, v = q.cuda(), k.cuda(), v.cuda()
        ref = F.scaled_dot_product_attention(q, k, v, scale=entry["scale"])
        row["sdpa_ms"] = _time_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=entry["scale"]), device, repeats)
        fused = outputs.get("fused")          # the fused build's run above (its kernels compiled once)
        ok, err = _close(fused[0], ref.cpu().numpy(), entry["rtol"], entry["atol"]) if fused else (False, float("nan"))
        row["fused_matches_sdpa"], row["fused_vs_sdpa_max_abs_error"] = ok, err
        row["passed"] = row["passed"] and ok
        if "ms" in row.get("fused", {}):
            row["fused_over_sdpa"] = row["fused"]["ms"] / row["sdpa_ms"]
    except ImportError:
        row["sdpa"] = "PyTorch not installed"
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="devicecheck", description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--mode", choices=("smoke", "full"), default="smoke")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args(argv)
    manifest = json.loads((args.bundle / "manifest.json").read_text())
    device = "cuda" if manifest["target"].startswith("sm_") else "cpu"
    repeats = args.repeats or (20 if args.mode == "smoke" else 50)
    start = time.perf_counter()
    ffi = load_runtime(args.bundle, device)
    summary: dict[str, Any] = {"bundle_target": manifest["target"], "mode": args.mode, "device": device,
                               "host": platform.node(), "python": platform.python_version(), "results": []}
    if device == "cuda":
        import torch

        summary["gpu"] = torch.cuda.get_device_name(0)
        summary["gpu_arch"] = "sm_%d%d" % torch.cuda.get_device_capability(0)
    for entry in manifest["entries"]:
        if args.mode == "smoke" and not entry.get("smoke"):
            continue
        check = check_attention if entry.get("seq") else check_model
        row = check(ffi, args.bundle, entry, device, repeats)
        summary["results"].append(row)
        fused = row["fused"]
        print(f"{row['model']}: {'PASS' if row['passed'] else 'FAIL'} fused "
              f"{fused.get('ms', float('nan')):.3f} ms, unfused {row['unfused'].get('ms', float('nan')):.3f} ms"
              + (f", SDPA {row['sdpa_ms']:.3f} ms" if "sdpa_ms" in row else "")
              + (f" ({fused.get('error') or row['unfused'].get('error')})" if not row["passed"] else ""), flush=True)
    summary["passed"] = all(r["passed"] for r in summary["results"])
    summary["wall_s"] = time.perf_counter() - start
    text = json.dumps(summary, indent=1, default=str)
    if args.json:
        args.json.write_text(text)
    print(f"devicecheck: {sum(r['passed'] for r in summary['results'])}/{len(summary['results'])} passed "
          f"in {summary['wall_s']:.0f} s", flush=True)
    return 0 if summary["passed"] else 1
