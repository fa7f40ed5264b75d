"""ONNX operators converted by fuseguard where TVM's frontend has none or gets ONNX's semantics wrong:
ops, attention, recurrent layers, semantics fixes, 8-bit floats and the 4/2-bit types (all called from
frontend/importer.py)."""
