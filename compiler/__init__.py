"""fuseguard's compiler (`fuseguard.compiler`): ONNX in, a fused TVM Relax build out (see pipeline.py).

Imports inside this package are relative only, so a base revision's compiler can be loaded from its own
tree under its folder name (the A/B gate); `tests/test_structure.py` checks it."""

from . import _aliases

_aliases.install()
