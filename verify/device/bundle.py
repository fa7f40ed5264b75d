"""The device check's bundle, made where TVM is: prebuilt libraries and what running them needs, nothing more.

The GPU machine the checks run on has Python, NumPy, PyTorch and nvcc but no TVM, and at most 64 MiB of
files travel to it with the working tree (the apache-tvm wheel alone is ~96 MiB). So the CUDA builds are
compiled and exported here, fused and unfused, with inputs and ONNX Runtime's expected outputs; TVM's
runtime libraries (not the compiler) and the tvm-ffi wheel for the device's Python go beside them.
verify/device/check.py runs the bundle there; `scripts/gpu-check.sh` is the one command.

Weights are embedded in the libraries, so the models are the small ones: the attention kernel at several
sequence lengths (no weights), the built-in conv/LayerNorm models and the tiny BERT, GPT-2 and LLaMA
exports. ResNet-50 (98 MiB of weights) and BERT-base do not fit the 64 MiB a call may carry.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: What may travel to the device in one call, the working tree included (the device tool's limit).
CARRY_LIMIT_BYTES = 64 * 2**20
#: Room left for the working tree itself (about 2 MiB tracked today) and slack.
TREE_ALLOWANCE_BYTES = 6 * 2**20
DEVICE_PYTHON = "3.12"
TVM_FFI = "apache-tvm-ffi==0.1.14.post0"


@dataclass(frozen=True)
class BundleItem:
    name: str
    smoke: bool                   # in the <5-minute smoke mode (the full mode runs everything)
    seq: int | None = None        # attention entries: the sequence length, checked against PyTorch's SDPA


#: smoke: one attention shape, one conv model, one transformer; full adds the long sequences and the rest.
ITEMS = (
    BundleItem("attention", True, seq=512),
    BundleItem("attention", False, seq=1024),
    BundleItem("attention", False, seq=2048),
    BundleItem("attention", False, seq=4096),
    BundleItem("conv_bn_relu", True),
    BundleItem("bert_tiny", True),
    BundleItem("softmax_layernorm", False),
    BundleItem("gpt2_tiny", False),
    BundleItem("llama_tiny", False),
)


#: Stored expected outputs up to this size; beyond it the device compares fused with unfused and with SDPA.
EXPECTED_MAX_BYTES = 4 * 2**20
ATTENTION_HEADS, ATTENTION_HEAD_DIM = 8, 64


def _suite_source(item: BundleItem) -> tuple[Any, dict[str, np.ndarray], dict | None]:
    """(ONNX model, inputs, the recipe regenerating them on the device or None) for a bundle item."""
    from fuseguard.compiler.frontend.loader import load
    from fuseguard.suites.models import build_attention, get_model, zoo_models

    from .check import generated_inputs
    from ..check.inputs import make_inputs

    if item.seq is not None:
        model = build_attention(seq=item.seq, heads=ATTENTION_HEADS, head_dim=ATTENTION_HEAD_DIM)
        recipe = {"seed": item.seq, "shape": [1, ATTENTION_HEADS, item.seq, ATTENTION_HEAD_DIM],
                  "dtype": "float32", "count": len(model.graph.input)}
        return model, dict(zip([i.name for i in model.graph.input], generated_inputs(recipe))), recipe
    zoo = {m.name: m for m in zoo_models()}
    suite = zoo.get(item.name) or get_model(item.name)
    model = suite.make(suite.default_dims, seed=0)
    loaded = load(model, suite.input_shapes(suite.default_dims), name=item.name)
    return model, make_inputs(loaded.model, loaded.input_shapes, seed=0), None


def _runtime_files(out: Path) -> None:
    """TVM's runtime libraries from the installed wheel, and tvm-ffi's wheel for the device's Python."""
    import tvm

    lib = Path(tvm.__file__).parent / "lib"
    runtime = out / "runtime"
    runtime.mkdir(parents=True, exist_ok=True)
    for name in ("libtvm_runtime.so", "libtvm_runtime_cuda.so"):
        shutil.copy2(lib / name, runtime / name)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", DEVICE_PYTHON, "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
           "-d", str(runtime), TVM_FFI]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not list(runtime.glob("apache_tvm_ffi-*.whl")):
        from fuseguard.compiler.errors import UsageError

        raise UsageError(f"device bundle: could not download {TVM_FFI} for Python {DEVICE_PYTHON}: "
                         f"{(proc.stderr.strip().splitlines() or ['no wheel'])[-1]}")


def make_bundle(out_dir: str | Path, *, target: str = "sm_90", mode: str = "full",
                items: tuple[BundleItem, ...] = ITEMS, runtime: bool = True) -> dict:
    """Build every item fused and unfused for `target` (sm_XX, or "cpu" to test the runner here), export
    the libraries, write inputs, expected outputs and manifest.json; refuse past the carry limit."""
    from fuseguard.compiler.errors import UsageError
    from fuseguard.compiler.frontend.loader import load
    from fuseguard.compiler.pipeline import CompileOptions, compile_model

    from ..check.reference import run_onnxruntime

    out = Path(out_dir)
    (out / "lib").mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir(parents=True, exist_ok=True)
    gpu = target.startswith("sm_")
    entries = []
    for item in items:
        if mode == "smoke" and not item.smoke:
            continue
        model, inputs, recipe = _suite_source(item)
        label = item.name if item.seq is None else f"{item.name}_seq{item.seq}"
        loaded = load(model, {k: v.shape for k, v in inputs.items()}, name=label)
        expected = list(run_onnxruntime(loaded.model, inputs).values())
        libs = {}
        for config, options in (("fused", CompileOptions(gpu_arch=target if gpu else None)),
                                ("unfused", CompileOptions(gpu_arch=target if gpu else None, fusion=False))):
            build = compile_model(loaded, options=options)
            path = out / "lib" / f"{label}-{config}.so"
            build.executable.export_library(str(path))
            libs[config] = str(path.relative_to(out))
        ordered = [inputs[n] for n in loaded.input_shapes]
        arrays = {} if recipe else {f"input_{i}": a for i, a in enumerate(ordered)}
        if sum(e.nbytes for e in expected) <= EXPECTED_MAX_BYTES:
            arrays.update({f"expected_{i}": e for i, e in enumerate(expected)})
        np.savez(out / "data" / f"{label}.npz", **arrays)
        entry = {"name": label, "smoke": item.smoke, "libs": libs, "data": f"data/{label}.npz",
                 "inputs": len(ordered), "outputs": len(expected), "rtol": 1e-3, "atol": 1e-4}
        if recipe:
            entry.update(generate=recipe, seq=item.seq, scale=float(1.0 / np.sqrt(ATTENTION_HEAD_DIM)))
        entries.append(entry)
    if runtime:
        _runtime_files(out)
    manifest = {"target": target, "mode": mode, "entries": entries}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    if size > CARRY_LIMIT_BYTES - TREE_ALLOWANCE_BYTES:
        raise UsageError(f"device bundle {out}: {size / 2**20:.1f} MiB is over the "
                         f"{(CARRY_LIMIT_BYTES - TREE_ALLOWANCE_BYTES) / 2**20:.0f} MiB a device call may carry "
                         f"beside the working tree; use --mode smoke or fewer models")
    manifest["bytes"] = size
    return manifest
