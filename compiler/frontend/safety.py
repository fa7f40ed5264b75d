"""Untrusted ONNX bytes, checked before anything uses them: what a file that is not ONNX looks like, IR and
opset versions this onnx understands, external data only from inside the model's own folder (no `..`,
absolute paths or symlinks leading out), node and tensor names, graph structure. Models are only ever
parsed, never executed: no pickle."""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import ModelError

_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
    (b"%PDF", "a PDF document"),
    (b"PK\x03\x04", "a zip archive (a PyTorch .pt/.pth checkpoint, an .npz or a zipped model?)"),
    (b"\x1f\x8b", "a gzip-compressed file (decompress it first)"),
    (b"\x89HDF", "an HDF5 file (a Keras .h5 model?)"),
    (b"\x93NUMPY", "a NumPy .npy array"),
    (b"GGUF", "a GGUF (llama.cpp) model"),
    (b"\x7fELF", "an executable (ELF)"),
    (b"version https://git-lfs", "a Git LFS pointer, not the model itself (run `git lfs pull`)"),
)


#: Highest IR version / default-domain opset the installed onnx package understands.
MAX_IR_VERSION = onnx.IR_VERSION


MAX_OPSET = onnx.defs.onnx_opset_version()


#: A serialized ModelProto cannot exceed protobuf's 2 GiB; bigger weights live in external data.
MAX_PROTOBUF_BYTES = 2**31 - 1


def elem_type_name(elem_type: int) -> str:
    if elem_type == TensorProto.BFLOAT16:
        return "bfloat16"
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name
    except Exception:  # UNDEFINED or a type number this onnx does not know
        return f"onnx-type-{elem_type}"


def itemsize(elem_type: int) -> int:
    """Bytes per element, at least 1 (4-bit types are rounded up: this is for limits, not layout)."""
    if elem_type in (TensorProto.BFLOAT16, TensorProto.FLOAT16):
        return 2
    try:
        return max(1, np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize)
    except Exception:  # noqa: BLE001 - a type numpy lacks (4-bit, float8): count a byte for the memory budget
        return 1


def _sniff(data: bytes) -> str | None:
    """What a non-ONNX file looks like, for the error message; None when it is a mystery."""
    for magic, what in _MAGIC:
        if data.startswith(magic):
            return what
    if len(data) >= 8 and data[4:8] == b"TFL3":
        return "a TensorFlow Lite model"
    if len(data) >= 8 and data[4:8] == b"ORTM":
        return "an ONNX Runtime .ort model (convert from the original .onnx instead)"
    if len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= 5:
        return "a Python pickle (a PyTorch checkpoint?); it is never unpickled"
    if len(data) >= 10:
        (header_len,) = struct.unpack("<Q", data[:8])
        if 0 < header_len < len(data) and data[8:10] == b'{"':
            return "a safetensors weight file"
    head = data[:4096]
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and text.strip() and sum(c.isprintable() or c in "\r\n\t" for c in text) >= 0.95 * len(text):
        stripped = text.lstrip()
        if stripped.startswith(("{", "[")):
            return "a JSON/text file"
        if stripped.startswith("<"):
            return "an XML/HTML file"
        return "a text file"
    return None


def _looks_like_onnx_prefix(data: bytes) -> bool:
    """A ModelProto starts with field 1 (ir_version, varint): 0x08 then a small version number."""
    return len(data) >= 2 and data[0] == 0x08 and 1 <= data[1] <= 64


def not_onnx(label: str, data: bytes, parsed: bool) -> ModelError:
    what = _sniff(data)
    if what is not None:
        return ModelError(f"{label}: not an ONNX model: looks like {what}")
    problem = "holds no graph" if parsed else "does not parse as an ONNX protobuf"
    if _looks_like_onnx_prefix(data):
        return ModelError(f"{label}: truncated or corrupt ONNX file ({len(data)} bytes): it starts like a "
                          f"model but {problem}")
    return ModelError(f"{label}: not an ONNX model ({len(data)} bytes; {problem})")


def all_tensors(model: onnx.ModelProto) -> Iterator[TensorProto]:
    """Every TensorProto in the model: initializers, sparse ones, attribute tensors, in all subgraphs
    and local functions (external data may hide in any of them)."""
    def from_graph(graph: onnx.GraphProto) -> Iterator[TensorProto]:
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        yield from from_nodes(graph.node)

    def from_nodes(nodes: Sequence[onnx.NodeProto]) -> Iterator[TensorProto]:
        for node in nodes:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("sparse_tensor"):
                    yield attr.sparse_tensor.values
                    yield attr.sparse_tensor.indices
                if attr.HasField("g"):
                    yield from from_graph(attr.g)
                for sub in attr.graphs:
                    yield from from_graph(sub)

    yield from from_graph(model.graph)
    for function in model.functions:
        yield from from_nodes(function.node)


def uses_external_data(model: onnx.ModelProto) -> bool:
    return any(t.data_location == TensorProto.EXTERNAL for t in all_tensors(model))


def check_external_data(model: onnx.ModelProto, base_dir: Path, label: str) -> None:
    """Reject external-data locations that leave the model folder (CVE-2022-25882, CVE-2024-27318)."""
    base = base_dir.resolve()
    for tensor in all_tensors(model):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        where = f"{label}: initializer '{tensor.name}' external data {location!r}"
        if not location:
            raise ModelError(f"{where}: no location given")
        if "\0" in location:
            raise ModelError(f"{where}: NUL byte in the location")
        if os.path.isabs(location) or location.startswith(("/", "\\")) or (len(location) > 1 and location[1] == ":"):
            raise ModelError(f"{where}: absolute paths are not allowed (external data must sit in the model's folder)")
        if ".." in Path(location.replace("\\", "/")).parts:
            raise ModelError(f"{where}: '..' leads outside the model folder")
        candidate = base / location
        inside = [p for p in (candidate, *candidate.parents) if p == base or base in p.parents]
        if any(p.is_symlink() for p in inside if p != base):
            raise ModelError(f"{where}: symbolic links are not followed (copy the file into the model folder)")
        resolved = candidate.resolve()
        if base not in resolved.parents:
            raise ModelError(f"{where}: resolves outside the model folder")
        if not resolved.is_file():
            raise ModelError(f"{where}: file not found next to the model")
        if os.stat(resolved).st_nlink > 1:
            raise ModelError(f"{where}: file has several hard links; refusing it (copy it instead)")
        try:
            offset = int(info.get("offset", 0) or 0)
            length = int(info["length"]) if info.get("length") not in (None, "") else None
        except ValueError:
            raise ModelError(f"{where}: offset/length are not integers ({info.get('offset')!r}, "
                             f"{info.get('length')!r})") from None
        size = resolved.stat().st_size
        if offset < 0 or offset > size or (length is not None and (length < 0 or offset + length > size)):
            raise ModelError(f"{where}: offset/length ({offset}, {length}) past the end of a {size}-byte file")


def check_graph(model: onnx.ModelProto, label: str) -> None:
    try:
        if model.ByteSize() > MAX_PROTOBUF_BYTES:
            return  # the in-memory checker cannot take it; the per-node checks above still ran
        onnx.checker.check_model(model)
    except Exception as err:  # ValidationError, or InferenceError/ValueError on malformed protos
        raise ModelError(f"{label}: fails onnx.checker: {one_line(str(err)) or type(err).__name__}") from None


def one_line(text: str, limit: int = 400) -> str:
    """Checker and onnx errors span lines ("... of node:\\nname: conv OpType: Conv\\n ..."): keep them all."""
    flat = re.sub(r"\s+", " ", text).strip()
    flat = flat.replace("==> Context: ", "context: ")
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def check_versions(model: onnx.ModelProto, label: str) -> None:
    if model.ir_version < 3:
        raise ModelError(f"{label}: IR version {model.ir_version} is too old (need >= 3; "
                         "upgrade it with onnx.version_converter)")
    if model.ir_version > MAX_IR_VERSION:
        raise ModelError(f"{label}: IR version {model.ir_version} is newer than this onnx "
                         f"{onnx.__version__} supports ({MAX_IR_VERSION})")
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > MAX_OPSET:
            raise ModelError(f"{label}: opset {opset.version} is newer than this onnx "
                             f"{onnx.__version__} supports ({MAX_OPSET})")


def check_names(model: onnx.ModelProto, label: str) -> None:
    """Duplicate value names make any name-based mapping (inputs, bisection) ambiguous.

    Runs before onnx.checker, which catches most of these too but cannot tell an initializer
    from a node output, and cannot check a model over 2 GiB at all.
    """
    seen: dict[str, str] = {}
    g = model.graph
    for init in g.initializer:
        if init.name in seen:
            raise ModelError(f"{label}: duplicate tensor name '{init.name}' (two initializers)")
        seen[init.name] = "initializer"
    for inp in g.input:
        if inp.name in seen and seen[inp.name] != "initializer":
            raise ModelError(f"{label}: duplicate tensor name '{inp.name}' (two graph inputs)")
        seen[inp.name] = "input"
    for node in g.node:
        for out in node.output:
            if not out:
                continue
            if out in seen:
                raise ModelError(f"{label}: duplicate tensor name '{out}' (node '{node.name or node.op_type}' "
                                 f"redefines {'an' if seen[out] == 'initializer' else 'a'} {seen[out]})")
            seen[out] = "node output"
