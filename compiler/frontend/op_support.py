"""Which ONNX operators fuseguard can import, and the one-line error naming the first that it cannot.

Kept apart from the importer so the loader can check a model before TVM is imported, without an
import cycle (loader -> importer -> loader).
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx

from ..errors import UnsupportedOperatorError


def supported_ops() -> set[str]:
    """ONNX operators TVM's frontend converts (importing TVM: called only when a model is checked)."""
    from tvm.relax.frontend.onnx import onnx_frontend as _frontend

    from .converters.ops import BUILDER_CONVERTERS, CONVERTERS

    return set(_frontend._get_convert_map()) | {"If", "Constant"} | set(CONVERTERS) | set(BUILDER_CONVERTERS)


DEFAULT_DOMAINS = ("", "ai.onnx")


def _walk(graph: onnx.GraphProto, where: str = "") -> Iterator[tuple[onnx.NodeProto, str]]:
    """Every node with where it sits: "" at the top, "in then_branch of If 'x'" inside subgraphs."""
    for node in graph.node:
        yield node, where
        for attr in node.attribute:
            subs = [attr.g] if attr.HasField("g") else list(attr.graphs)
            for sub in subs:
                inner = f"in {attr.name} of {node.op_type} '{node.name}'"
                yield from _walk(sub, f"{inner}, {where}" if where else inner)


def _why_unsupported(node: onnx.NodeProto, opset: int, known: set[str]) -> str | None:
    """Why TVM cannot import this node (None: it can, as far as an op list can tell)."""
    if node.domain not in DEFAULT_DOMAINS:
        hint = (" (an ONNX Runtime contrib op: export the model without ORT graph optimisations)"
                if node.domain == "com.microsoft" else "")
        return f"TVM's ONNX frontend imports only the default ONNX domain{hint}"
    if node.op_type in known:
        return None
    if not onnx.defs.has(node.op_type, opset, ""):
        return f"not an ONNX operator at opset {opset}"
    return "TVM's ONNX frontend has no converter for it"


def check_supported(model: onnx.ModelProto, label: str) -> None:
    """Name every unsupported operator (and its first node) before ONNX Runtime or TVM fail less clearly.

    Subgraphs (If branches, Loop bodies) are searched too: the frontend converts If branches itself.
    """
    known = supported_ops()
    opset = next((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), 1)
    found: dict[str, tuple[onnx.NodeProto, str, str]] = {}
    for node, where in _walk(model.graph):
        why = _why_unsupported(node, opset, known)
        op = f"{node.domain}::{node.op_type}" if node.domain not in DEFAULT_DOMAINS else node.op_type
        if why is not None and op not in found:
            found[op] = (node, where, why)
    if not found:
        return
    (op, (node, where, why)), *rest = found.items()
    node_text = (f"node '{node.name}'" if node.name else
                 f"unnamed node -> '{node.output[0]}'" if node.output else "unnamed node") + (f" {where}" if where else "")
    also = f"; also unsupported: {', '.join(o for o, _ in rest)}" if rest else ""
    raise UnsupportedOperatorError(f"{label}: unsupported operator {op} ({node_text}): {why}{also}")
