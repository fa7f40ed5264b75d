"""Relax IR helpers every step shares: expression queries (helpers), whole-module analysis (analysis) and
the provenance tags that tie a binding to its ONNX nodes (tags)."""
