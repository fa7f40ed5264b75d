"""Built-in models quantised to int8 QDQ by ONNX Runtime's own quantiser, for the QDQ tests."""

from __future__ import annotations

from pathlib import Path

import onnx


def quantised(tmp_path: Path, name: str) -> Path:
    """A built-in model quantised to int8 QDQ by ONNX Runtime's own quantiser (4 calibration draws)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from fuseguard.compiler.frontend.loader import load
    from fuseguard.suites.models import get_model
    from fuseguard.verify.check.inputs import make_inputs

    loaded = load(get_model(name).make(), None, name=name)
    src, dst = tmp_path / f"{name}.onnx", tmp_path / f"{name}_int8.onnx"
    onnx.save(loaded.model, src)

    class Draws(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter([make_inputs(loaded.model, loaded.input_shapes, seed=s) for s in range(4)])

        def get_next(self):  # noqa: ANN202 - ORT's interface
            return next(self.it, None)

    quantize_static(str(src), str(dst), Draws(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8,
                    weight_type=QuantType.QInt8)
    return dst
