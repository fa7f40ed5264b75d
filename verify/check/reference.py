"""The reference run: ONNX Runtime on the same inputs, graph optimisations off unless asked, on the provider
that matches the build's device."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx


def reference_providers(gpu: bool) -> list[str]:
    """ONNX Runtime's providers for the reference: its CUDA provider when the build is a GPU's and
    onnxruntime-gpu is installed (same device, same math library family), else its CPU provider."""
    import onnxruntime as ort

    if gpu and "CUDAExecutionProvider" in ort.get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def run_onnxruntime(model: onnx.ModelProto, inputs: Mapping[str, np.ndarray], *, optimize: bool = False,
                    threads: int | None = None, providers: list[str] | None = None) -> dict[str, np.ndarray]:
    """The reference: ONNX Runtime (its CPU provider unless `providers`), graph optimisations off unless asked."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=providers or ["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    feed = {i.name: inputs[i.name] for i in session.get_inputs()}
    return dict(zip(names, session.run(names, feed)))
