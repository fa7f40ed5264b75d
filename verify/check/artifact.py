"""Versioned, deployable builds: `fuseguard compile MODEL --out DIR` and `fuseguard verify --artifact DIR`.

Why: a release must be traceable to what was verified. `compile` writes, per architecture class,
`DIR/<class>/model.so` (the fused build, loadable with `tvm.runtime.load_module` + `relax.VirtualMachine`)
beside `manifest.json`: the model's sha256, the target, the versions of TVM, tvm-ffi and fuseguard, the
compiler's source hash and git commit, the options, every fusion decision, and the verification verdict
(fused vs ONNX Runtime on seeded inputs, with the tolerance used). `verify --artifact DIR` re-verifies a
shipped library without compiling: the manifest's model (kept as `model.onnx`) and seed give the same
inputs, ONNX Runtime the reference, and a model or target that no longer matches is said, not ignored.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fuseguard.compiler.errors import InputError, UsageError

MANIFEST = "manifest.json"
LIBRARY = "model.so"
MODEL = "model.onnx"
SCHEMA = 1


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _versions() -> dict[str, Any]:
    import tvm
    import tvm_ffi

    from fuseguard.compiler.cache import compiler_source_hash
    from fuseguard.compiler.fusion.decisions import versions

    from ..perf.baselines import git_commit

    return {**versions(), "tvm_ffi": getattr(tvm_ffi, "__version__", "?"), "tvm": getattr(tvm, "__version__", "?"),
            "compiler_sources": compiler_source_hash(), "git_commit": git_commit()}


def write_artifact(source: Any, out_dir: str, *, options: Any, shapes: dict | None = None, seed: int = 0) -> dict:
    """In a worker: compile the fused build, verify it against ONNX Runtime, write library + manifest."""
    from fuseguard.compiler.cache import compile_cached
    from fuseguard.compiler.frontend.loader import load
    from fuseguard.compiler.plugins import load_env_plugins

    from .compare import compare_outputs
    from .model import SuiteSpec
    from .reference import run_onnxruntime
    from .inputs import make_inputs

    load_env_plugins()
    name = source.label if isinstance(source, SuiteSpec) else None
    if isinstance(source, SuiteSpec):
        seed = source.seed or seed
        source = source.build()
    loaded = load(source, shapes, name=name)
    compiled = compile_cached(loaded, options)
    inputs = make_inputs(loaded.model, loaded.input_shapes, seed=seed)
    reference = run_onnxruntime(loaded.model, inputs)
    outputs = dict(zip(loaded.output_names, compiled.run(inputs)))
    result = compare_outputs(outputs, reference)
    target_dir = Path(out_dir) / compiled.target.class_id
    target_dir.mkdir(parents=True, exist_ok=True)
    model_bytes = loaded.model.SerializeToString()
    if compiled.library_path:
        shutil.copyfile(compiled.library_path, target_dir / LIBRARY)
    else:
        compiled.executable.export_library(str(target_dir / LIBRARY))
    (target_dir / MODEL).write_bytes(model_bytes)
    worst = max((r.max_abs_error for r in result.values() if r.max_abs_error is not None), default=None)
    manifest = {
        "schema": SCHEMA, "model": loaded.name, "model_sha256": _sha256(model_bytes),
        "library_sha256": _sha256((target_dir / LIBRARY).read_bytes()),
        "target": {"label": compiled.target.label, "kind": compiled.target.kind, "arch": compiled.target.arch,
                   "class_id": compiled.target.class_id},
        "versions": _versions(),
        "options": options.to_dict(),
        "input_names": compiled.input_names,
        "input_shapes": {k: list(v) for k, v in loaded.input_shapes.items()},
        "output_names": list(loaded.output_names), "seed": seed,
        "fusion": compiled.report.to_dict(),
        "verification": {"passed": bool(result), "reference": "onnxruntime-cpu (graph optimisations off)",
                         "max_abs_error": worst, "summary": result.summary(),
                         "tolerances": "fuseguard defaults per dtype (verify/check/compare.py)"},
    }
    (target_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
    return {"directory": str(target_dir), "passed": bool(result), "max_abs_error": worst,
            "class_id": compiled.target.class_id}


@dataclass
class ArtifactVerdict:
    """Re-verification of a shipped build; truthy when it still computes what ORT computes."""

    directory: str
    model: str
    passed: bool
    max_abs_error: float | None
    summary: str
    notes: list[str]

    def __bool__(self) -> bool:
        return self.passed

    def line(self) -> str:
        err = f"{self.max_abs_error:.2e}" if self.max_abs_error is not None else "-"
        text = f"{self.model} ({self.directory}): {'PASS' if self.passed else 'FAIL'}, max err {err}"
        return text + ("; " + "; ".join(self.notes) if self.notes else "")


def _find(directory: Path) -> Path:
    if (directory / MANIFEST).is_file():
        return directory
    from fuseguard.compiler.hw.target import resolve

    mine = directory / resolve().class_id
    if (mine / MANIFEST).is_file():
        return mine
    found = sorted(p.parent for p in directory.glob(f"*/{MANIFEST}"))
    if not found:
        raise InputError(f"{directory}: no {MANIFEST} (write one with `fuseguard compile MODEL --out {directory}`)")
    raise UsageError(f"{directory}: no build for this machine's class {mine.name}; it holds "
                     f"{', '.join(p.name for p in found)} (pass one of those directories)")


def verify_artifact(directory: str) -> dict:
    """In a worker: load the shipped library, run it on the manifest's inputs, compare with ORT."""
    import onnx
    import tvm
    from tvm import relax

    from .compare import compare_outputs
    from .reference import run_onnxruntime
    from .inputs import make_inputs

    d = _find(Path(directory))
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"{d / MANIFEST}: unreadable manifest ({err})") from None
    notes = []
    lib_bytes = (d / LIBRARY).read_bytes()
    if _sha256(lib_bytes) != manifest.get("library_sha256"):
        raise InputError(f"{d / LIBRARY}: does not match its manifest (sha256 differs): not the verified build")
    model_bytes = (d / MODEL).read_bytes()
    if _sha256(model_bytes) != manifest.get("model_sha256"):
        notes.append("model.onnx changed since the build was verified")
    from fuseguard.compiler.hw.target import resolve

    here = resolve().class_id
    if manifest["target"]["kind"] == "llvm" and manifest["target"]["class_id"] != here:
        notes.append(f"built for {manifest['target']['class_id']}, running on {here}")
    model = onnx.load_from_string(model_bytes)
    inputs = make_inputs(model, {k: tuple(v) for k, v in manifest["input_shapes"].items()}, seed=manifest["seed"])
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(d / LIBRARY)), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(inputs[n])) for n in manifest["input_names"]])
    from fuseguard.compiler.pipeline import flatten_outputs, to_numpy

    outputs = dict(zip(manifest["output_names"], [to_numpy(t) for t in flatten_outputs(out)]))
    result = compare_outputs(outputs, run_onnxruntime(model, inputs))
    worst = max((r.max_abs_error for r in result.values() if r.max_abs_error is not None), default=None)
    was = manifest.get("verification", {}).get("max_abs_error")
    if was is not None and worst is not None and worst > 0 and abs(worst - was) > max(1e-12, 1e-3 * was):
        notes.append(f"max error {worst:.2e} now vs {was:.2e} when shipped")
    return {"directory": str(d), "model": manifest["model"], "passed": bool(result), "max_abs_error": worst,
            "summary": result.summary(), "notes": notes}
