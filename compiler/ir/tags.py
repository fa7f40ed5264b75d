"""Provenance tags: the Relax var names that tie a binding to the ONNX nodes it computes.

`n12_Conv` is ONNX node 12; a rewrite standing for several nodes is `n1x2x9_LayerNorm`. Tags end up as C
identifiers in generated kernels (FuseTIR names a kernel's parameters after the vars it reads), so they use
only [0-9A-Za-z_]: with '+' as the separator GPT-2's and LLaMA's CUDA did not compile
(`float* n43+44+45_Matmul_ptr`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

SEP = "x"
_TAG = re.compile(r"^n(\d+(?:x\d+)*)(?:_|$)")


def tag(index: int, op: str) -> str:
    return f"n{index}_{op}"


def is_tagged(name: str) -> bool:
    return _TAG.match(name) is not None


def indices(name: str) -> list[int]:
    """Every ONNX node index a tagged name stands for (`n1x2x9_LayerNorm` -> [1, 2, 9]; untagged -> [])."""
    m = _TAG.match(name)
    return sorted(int(i) for i in m.group(1).split(SEP)) if m else []


def label(name: str) -> str:
    """The op a tagged name stands for (`n1x2x9_LayerNorm` -> 'LayerNorm'; untagged -> '')."""
    m = _TAG.match(name)
    return name[m.end():] if m else ""


def merged(names: Iterable[str], op: str) -> str:
    """A tag naming every node the tagged `names` stand for, for a binding that replaces them all."""
    found = sorted({i for n in names for i in indices(n)})
    return f"n{SEP.join(map(str, found))}_{op}" if found else op
