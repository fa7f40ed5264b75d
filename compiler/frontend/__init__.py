"""Pipeline step 0, import: untrusted ONNX bytes checked (safety), loaded with shapes pinned (loader, shapes;
the dims kept symbolic are compiler/dynamic.py's), the operators checked (op_support), and converted to Relax
(importer, converters/)."""
