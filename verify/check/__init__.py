"""Verdicts on a model's numerics: the fused and unfused builds against ONNX Runtime (model), the
comparison (compare), seeded inputs, reduced precision, dynamic shapes, ONNX conformance and shipped artifacts."""
