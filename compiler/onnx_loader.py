"""Load untrusted ONNX models safely and pin their input shapes.

Models are only ever parsed, never executed: no pickle, and external data is read only
from inside the model's own folder (no `..`, absolute paths or symlinks leading out).
Everything a user can get wrong ends in one `ModelError`/`ShapeError` line that names the
file, node or input: a file that is not ONNX says what it looks like instead, an operator TVM
cannot import is named with its node, and a shape that cannot fit in memory is refused, with
its size, before anything is allocated.
"""

from __future__ import annotations

import math
import os
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from .errors import ModelError, ShapeError

#: Bytes a model may need before we refuse to build it: inputs + weights + its largest
#: intermediate tensor. Refusing early beats an OOM kill that takes the whole session down.
DEFAULT_MEMORY_LIMIT_BYTES = 8 * 1024**3

#: Highest IR version / default-domain opset the installed onnx package understands.
MAX_IR_VERSION = onnx.IR_VERSION
MAX_OPSET = onnx.defs.onnx_opset_version()

#: A serialized ModelProto cannot exceed protobuf's 2 GiB; bigger weights live in external data.
MAX_PROTOBUF_BYTES = 2**31 - 1

#: Defaults for dynamic dimensions when neither --shape nor --default-dim pins them: batch 1;
#: image height/width 224 (divisible by 32, as detectors like DBNet need); anything else
#: (sequence length, feature count) 16, enough to exercise attention and reductions.
AUTO_BATCH, AUTO_SPATIAL, AUTO_OTHER = 1, 224, 16

#: Tensors at most this big stay in the weightless copy used for shape inference (they may be
#: shapes, axes or pads that inference needs); bigger ones become plain graph inputs.
_SMALL_INIT_BYTES = 4096

_INT64_MAX = 2**63 - 1


@dataclass
class LoadedModel:
    """A checked model with every input shape pinned to concrete integers."""

    name: str
    model: onnx.ModelProto
    input_shapes: dict[str, tuple[int, ...]]
    input_dtypes: dict[str, str]
    output_names: list[str]
    path: Path | None = None
    warnings: list[str] = field(default_factory=list)
    guessed: dict[str, tuple[int, ...]] = field(default_factory=dict)  # inputs whose dynamic dims we chose
    #: dims left symbolic (`dim_param`) in `model` for a dynamic build; `input_shapes` holds one size of them
    dynamic: tuple = ()

    @property
    def num_nodes(self) -> int:
        return len(self.model.graph.node)

    def shape_hint(self) -> str:
        """A suffix for errors that a wrong guess of dynamic dims may explain ("" when none was guessed)."""
        if not self.guessed:
            return ""
        shapes = ", ".join(f"{n}={'x'.join(map(str, s))}" for n, s in self.guessed.items())
        return (f"; the dynamic input dims were guessed ({shapes}): pass --shape NAME=DIMS with the size "
                "the model was exported for")


# ----------------------------------------------------------------------------- --shape parsing

def parse_shape_spec(spec: str) -> tuple[str, tuple[int, ...]]:
    """Parse `name=1x3x224x224` (also `name:1,3,224,224`) into a name and a shape.

    The last `=` (or `:`) separates, so input names may themselves contain `:` (TF exports).
    An empty dims part means a scalar (`name=`).
    """
    for sep in ("=", ":"):
        if sep in spec:
            name, dims = spec.rsplit(sep, 1)
            break
    else:
        raise ShapeError(f"--shape {spec!r}: expected NAME=DIMS, e.g. input=1x3x224x224")
    name = name.strip()
    parts = [p.strip() for p in dims.replace(",", "x").split("x")] if dims.strip() else []
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise ShapeError(f"--shape {spec!r}: dimensions must be integers separated by 'x', got {dims!r}") from None
    if not name:
        raise ShapeError(f"--shape {spec!r}: missing input name before '{sep}'")
    if any(d < 0 for d in shape):
        raise ShapeError(f"--shape {spec!r}: negative dimension")
    if any(d > _INT64_MAX for d in shape):
        raise ShapeError(f"--shape {spec!r}: dimension larger than a 64-bit integer")
    return name, shape


def elem_type_name(elem_type: int) -> str:
    if elem_type == TensorProto.BFLOAT16:
        return "bfloat16"
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name
    except Exception:  # UNDEFINED or a type number this onnx does not know
        return f"onnx-type-{elem_type}"


def _itemsize(elem_type: int) -> int:
    """Bytes per element, at least 1 (4-bit types are rounded up: this is for limits, not layout)."""
    if elem_type in (TensorProto.BFLOAT16, TensorProto.FLOAT16):
        return 2
    try:
        return max(1, np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize)
    except Exception:
        return 1


# ----------------------------------------------------------------------------- file sniffing

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


def _not_onnx(label: str, data: bytes, parsed: bool) -> ModelError:
    what = _sniff(data)
    if what is not None:
        return ModelError(f"{label}: not an ONNX model: looks like {what}")
    problem = "holds no graph" if parsed else "does not parse as an ONNX protobuf"
    if _looks_like_onnx_prefix(data):
        return ModelError(f"{label}: truncated or corrupt ONNX file ({len(data)} bytes): it starts like a "
                          f"model but {problem}")
    return ModelError(f"{label}: not an ONNX model ({len(data)} bytes; {problem})")


# ----------------------------------------------------------------------------- external data

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


def _uses_external_data(model: onnx.ModelProto) -> bool:
    return any(t.data_location == TensorProto.EXTERNAL for t in all_tensors(model))


def _check_external_data(model: onnx.ModelProto, base_dir: Path, label: str) -> None:
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


# ----------------------------------------------------------------------------- loading

def load_model(source: str | os.PathLike | bytes | onnx.ModelProto, *, name: str | None = None,
               check_ops: bool = True) -> tuple[onnx.ModelProto, str, Path | None]:
    """Parse and check a model; return (model, display name, path). Raises ModelError.

    `check_ops` names the first operator TVM cannot import, with its node, before anything else
    (ONNX Runtime, the frontend) fails on it less clearly.
    """
    path: Path | None = None
    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
        label = name or model.graph.name or "model"
    else:
        if isinstance(source, (bytes, bytearray)):
            data = bytes(source)
            label = name or "model"
        else:
            path = Path(source)
            label = str(path)
            if not path.exists():
                raise ModelError(f"{path}: no such file" + (" (a broken symbolic link)" if path.is_symlink() else ""))
            if path.is_dir():
                raise ModelError(f"{path}: is a directory, not an ONNX file")
            if not path.is_file():
                raise ModelError(f"{path}: not a regular file")
            size = path.stat().st_size
            if size > MAX_PROTOBUF_BYTES:
                raise ModelError(f"{path}: {_fmt_bytes(size)} is larger than any ONNX protobuf can be (2 GiB); "
                                 "large weights belong in external data files")
            try:
                data = path.read_bytes()
            except OSError as err:
                raise ModelError(f"{path}: cannot read ({err.strerror})") from None
        if not data:
            raise ModelError(f"{label}: empty file")
        model = onnx.ModelProto()
        try:
            model.ParseFromString(data)
        except Exception:  # protobuf raises DecodeError (or RuntimeWarning-like errors for the C++ impl)
            raise _not_onnx(label, data, parsed=False) from None
        if not model.graph.node and not model.graph.output:
            raise _not_onnx(label, data, parsed=True)
    _check_versions(model, label)
    if path is not None:
        _check_external_data(model, path.parent, label)
        if _uses_external_data(model):
            try:
                onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
            except Exception as err:  # onnx's own checks (symlink races, bounds) say it in their words
                raise ModelError(f"{label}: cannot read external data: {_one_line(str(err))}") from None
    elif _uses_external_data(model):
        raise ModelError(f"{label}: uses external data, which needs the model's file path")
    if model.functions:
        model = _inline_functions(model, label)
    if check_ops:
        from .op_support import check_supported

        check_supported(model, label)
    _check_names(model, label)
    _check_graph(model, label)
    return model, (name or (path.stem if path else label)), path


def _inline_functions(model: onnx.ModelProto, label: str) -> onnx.ModelProto:
    """Model-local functions (torch.onnx's dynamo exporter emits them) are unknown to TVM: inline them."""
    import onnx.inliner

    try:
        return onnx.inliner.inline_local_functions(model)
    except Exception as err:
        raise ModelError(f"{label}: cannot inline its local functions "
                         f"({', '.join(f.name for f in model.functions)}): {_one_line(str(err))}") from None


def _check_graph(model: onnx.ModelProto, label: str) -> None:
    try:
        if model.ByteSize() > MAX_PROTOBUF_BYTES:
            return  # the in-memory checker cannot take it; the per-node checks above still ran
        onnx.checker.check_model(model)
    except Exception as err:  # ValidationError, or InferenceError/ValueError on malformed protos
        raise ModelError(f"{label}: fails onnx.checker: {_one_line(str(err)) or type(err).__name__}") from None


def error_line(err: BaseException, limit: int = 300) -> str:
    """`Type: message` on one line, for wrapping a library's exception into a FuseguardError.

    TVM errors carry a C++ backtrace whose last line is the message; ONNX Runtime prefixes
    "[ONNXRuntimeError] : 1 : FAIL : ", which says nothing to a user.
    """
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    msg = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", lines[-1]) if lines else ""
    name = type(err).__name__
    if msg.startswith(f"{name}: "):
        msg = msg[len(name) + 2:]
    text = f"{name}: {msg}" if msg else name
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(text: str, limit: int = 400) -> str:
    """Checker and onnx errors span lines ("... of node:\\nname: conv OpType: Conv\\n ..."): keep them all."""
    flat = re.sub(r"\s+", " ", text).strip()
    flat = flat.replace("==> Context: ", "context: ")
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _check_versions(model: onnx.ModelProto, label: str) -> None:
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


def _check_names(model: onnx.ModelProto, label: str) -> None:
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


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The real inputs: graph inputs that are not initializers (old exporters list weights too)."""
    inits = {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


# ----------------------------------------------------------------------------- shape pinning

def _auto_dims(dims: Sequence[onnx.TensorShapeProto.Dimension]) -> list[int]:
    """Defaults for the dynamic dims of one input (see AUTO_*): batch, image height/width, or other.

    An input is image-like when it has rank 4 with a fixed channel count of at most 4 at axis 1
    (NCHW) or axis 3 (NHWC); its dynamic height and width get AUTO_SPATIAL.
    """
    fixed = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in dims]
    params = [d.dim_param.lower() if d.HasField("dim_param") else "" for d in dims]
    spatial: set[int] = set()
    if len(dims) == 4:
        if fixed[1] is not None and fixed[1] <= 4:
            spatial = {2, 3}
        elif fixed[3] is not None and fixed[3] <= 4:
            spatial = {1, 2}
    out = []
    for axis, (value, param) in enumerate(zip(fixed, params)):
        if value is not None:
            out.append(value)
        elif axis in spatial or any(k in param for k in ("height", "width")):
            out.append(AUTO_SPATIAL)
        elif (axis == 0 and len(dims) > 1) or "batch" in param:
            out.append(AUTO_BATCH)
        else:
            out.append(AUTO_OTHER)
    return out


def _show_dims(dims: Sequence[onnx.TensorShapeProto.Dimension]) -> str:
    return "[" + ", ".join(str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in dims) + "]"


def _fits(dims: Sequence[onnx.TensorShapeProto.Dimension] | None, shape: Sequence[int]) -> bool:
    if dims is None:
        return True
    return len(dims) == len(shape) and all(
        not (d.HasField("dim_value") and d.dim_value > 0) or d.dim_value == s for d, s in zip(dims, shape))


def pin_shapes(
    model: onnx.ModelProto,
    shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    default_dim: int | None = None,
    label: str = "model",
    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
    shape_hints: Mapping[str, Sequence[int]] | None = None,
    guessed: dict[str, tuple[int, ...]] | None = None,
) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Fix every input dimension in place and refuse shapes that cannot fit in memory.

    Each input's shape comes from `shapes` (--shape: must fit the model, or ShapeError), else
    `shape_hints` (the arrays of --inputs FILE.npz, used where they fit), else the model's fixed
    dims with dynamic ones set to `default_dim` or, when that is None, the AUTO_* defaults.
    Declared dims <= 0 count as dynamic, except that a declared 0 with nothing to pin it is refused.
    Inputs whose dynamic dims were chosen here (not given) are added to `guessed`, if passed.
    """
    shapes = dict(shapes or {})
    hints = dict(shape_hints or {})
    inputs = graph_inputs(model)
    names = [i.name for i in inputs]
    for key in shapes:
        if key not in names:
            raise ShapeError(f"{label}: --shape names '{key}', which is not an input; inputs are: "
                             f"{', '.join(names) or '(none)'}")
    if default_dim is not None and default_dim < 1:
        raise ShapeError(f"--default-dim must be at least 1, got {default_dim}")
    pinned: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for inp in inputs:
        if not inp.type.HasField("tensor_type"):
            raise ModelError(f"{label}: input '{inp.name}' is not a tensor (sequence/map/optional inputs are "
                             "not supported)")
        ttype = inp.type.tensor_type
        dtypes[inp.name] = elem_type_name(ttype.elem_type)
        dims = list(ttype.shape.dim) if ttype.HasField("shape") else None
        given = shapes.get(inp.name)
        if given is not None:
            shape = tuple(int(d) for d in given)
            spec = f"--shape {inp.name}={'x'.join(map(str, shape))}"
            if dims is not None and len(dims) != len(shape):
                raise ShapeError(f"{label}: {spec} has rank {len(shape)}, but the model's input '{inp.name}' "
                                 f"has rank {len(dims)} {_show_dims(dims)}")
            for axis, (d, g) in enumerate(zip(dims or [], shape)):
                if d.HasField("dim_value") and d.dim_value > 0 and d.dim_value != g:
                    raise ShapeError(f"{label}: --shape {inp.name}: dimension {axis} is fixed to {d.dim_value} "
                                     f"in the model {_show_dims(dims)}, got {g}")
            if any(d == 0 for d in shape):
                raise ShapeError(f"{label}: input '{inp.name}' has a zero-size dimension {shape} ({spec}); "
                                 "fuseguard verifies non-empty tensors only")
        elif inp.name in hints and _fits(dims, hints[inp.name]) and all(int(d) > 0 for d in hints[inp.name]):
            shape = tuple(int(d) for d in hints[inp.name])
        elif dims is None:
            raise ShapeError(f"{label}: input '{inp.name}' has no shape in the model; pass --shape {inp.name}=...")
        else:
            zero = [axis for axis, d in enumerate(dims) if d.HasField("dim_value") and d.dim_value == 0]
            if zero:
                raise ShapeError(f"{label}: input '{inp.name}' is declared with a zero-size dimension "
                                 f"{_show_dims(dims)} (axis {zero[0]}); pass --shape {inp.name}=... to verify "
                                 "it at a non-empty size")
            shape = tuple(_auto_dims(dims)) if default_dim is None else tuple(
                d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else default_dim for d in dims)
            if guessed is not None and any(not (d.HasField("dim_value") and d.dim_value > 0) for d in dims):
                guessed[inp.name] = shape
        pinned[inp.name] = shape
    _check_input_memory(model, pinned, label, memory_limit_bytes)
    for inp in inputs:
        new_shape = onnx.TensorShapeProto()
        for d in pinned[inp.name]:
            new_shape.dim.add().dim_value = d
        inp.type.tensor_type.shape.CopyFrom(new_shape)
    _check_activation_memory(model, pinned, label, memory_limit_bytes)
    return pinned, dtypes


def _check_input_memory(model: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]], label: str,
                        limit: int) -> None:
    """Refuse, before allocating anything, inputs and weights that cannot fit."""
    elem = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    total = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * _itemsize(elem[name])
        if nbytes > limit:
            raise ShapeError(f"{label}: input '{name}' of shape {'x'.join(map(str, shape))} needs "
                             f"{_fmt_bytes(nbytes)}, over the {_fmt_bytes(limit)} limit")
        total += nbytes
    total += _weight_bytes(model)
    if total > limit:
        raise ShapeError(f"{label}: inputs and weights need {_fmt_bytes(total)}, over the {_fmt_bytes(limit)} limit")


def _weight_bytes(model: onnx.ModelProto) -> int:
    return sum(math.prod(init.dims) * _itemsize(init.data_type) for init in model.graph.initializer)


def _check_activation_memory(model: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]], label: str,
                             limit: int) -> None:
    """Refuse shapes whose largest intermediate tensor cannot fit, e.g. a 4096x4096 image into a CNN.

    Shape inference runs on a weightless copy (big initializers become inputs of the same type),
    so it costs milliseconds even for large models. Tensors it cannot size are skipped.
    """
    graph = model.graph
    light = _weightless_copy(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(light, strict_mode=False, data_prop=True).graph
    except Exception:  # best effort: an uninferrable model is still checked by its inputs and weights
        return
    producer = {out: node for node in graph.node for out in node.output}
    worst: tuple[int, str, tuple[int, ...]] | None = None
    for vi in [*inferred.value_info, *inferred.output]:
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not tt.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
        if any(d < 0 for d in dims):
            continue
        nbytes = math.prod(dims) * _itemsize(tt.elem_type)
        if worst is None or nbytes > worst[0]:
            worst = (nbytes, vi.name, tuple(dims))
    if worst is None:
        return
    nbytes, name, dims = worst
    inputs = sum(math.prod(s) * _itemsize(next(i.type.tensor_type.elem_type for i in graph.input if i.name == n))
                 for n, s in shapes.items())
    total = nbytes + inputs + _weight_bytes(model)
    if nbytes > limit or total > limit:
        node = producer.get(name)
        where = f" (output of node '{node.name or node.op_type}')" if node is not None else ""
        given = ", ".join(f"{n}={'x'.join(map(str, s))}" for n, s in shapes.items())
        raise ShapeError(f"{label}: with inputs {given}, tensor '{name}'{where} of shape {'x'.join(map(str, dims))} "
                         f"needs {_fmt_bytes(nbytes)} ({_fmt_bytes(total)} with inputs and weights), over the "
                         f"{_fmt_bytes(limit)} limit; pass a smaller --shape")


def _weightless_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its big initializers turned into graph inputs of the same type and dims:
    shape inference needs only their dims, and copying megabytes of weights would dominate."""
    g = model.graph
    light = helper.make_model(
        helper.make_graph([], g.name or "g", [], []), opset_imports=list(model.opset_import),
        ir_version=model.ir_version)
    lg = light.graph
    lg.node.extend(g.node)
    lg.input.extend(g.input)
    lg.output.extend(g.output)
    existing = {i.name for i in g.input}
    for init in g.initializer:
        if math.prod(init.dims) * _itemsize(init.data_type) <= _SMALL_INIT_BYTES:
            lg.initializer.append(init)
        elif init.name not in existing:
            lg.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    light.functions.extend(model.functions)
    return light


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def name_nodes(model: onnx.ModelProto) -> None:
    """Give every unnamed node a unique name so fused groups can name the ONNX nodes they came from."""
    used = {n.name for n in model.graph.node if n.name}
    for i, node in enumerate(model.graph.node):
        if not node.name:
            candidate = f"{node.op_type}_{i}"
            while candidate in used:
                candidate += "_"
            node.name = candidate
            used.add(candidate)


def load(
    source: str | os.PathLike | bytes | onnx.ModelProto,
    shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    name: str | None = None,
    default_dim: int | None = None,
    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
    shape_hints: Mapping[str, Sequence[int]] | None = None,
    check_ops: bool = True,
    dynamic: Sequence = (),
) -> LoadedModel:
    """Load, check, name nodes and pin shapes: the one entry point for ONNX input.

    Dims named in `dynamic` (compiler/dynamic.py DynamicDims) are pinned in `input_shapes` (one size to
    draw inputs at) but stay `dim_param`s in the model, for a symbolic build and ONNX Runtime at any size."""
    from .dynamic import check_names, keep_symbolic

    model, display, path = load_model(source, name=name, check_ops=check_ops)
    label = str(path) if path else display
    name_nodes(model)
    axes = check_names(model, dynamic, label) if dynamic else {}
    symbolic = {d.name for d in dynamic}
    # a guess of a dim the build keeps symbolic (--dynamic) cannot be what went wrong: not a guess to report
    only_symbolic = {i.name for i in model.graph.input if symbolic and
                     {d.dim_param for d in i.type.tensor_type.shape.dim if not d.HasField("dim_value")} <= symbolic}
    guessed: dict[str, tuple[int, ...]] = {}
    pinned, dtypes = pin_shapes(model, shapes, default_dim=default_dim, label=label,
                                memory_limit_bytes=memory_limit_bytes, shape_hints=shape_hints, guessed=guessed)
    if axes:
        keep_symbolic(model, axes)
    warnings = _weight_warnings(model, label)
    guessed = {k: v for k, v in guessed.items() if k not in only_symbolic}
    return LoadedModel(name=display, model=model, input_shapes=pinned, input_dtypes=dtypes,
                       output_names=[o.name for o in model.graph.output], path=path, warnings=warnings,
                       guessed=guessed, dynamic=tuple(dynamic))


def _weight_warnings(model: onnx.ModelProto, label: str) -> list[str]:
    """NaN/Inf in weights is worth a warning, not a refusal: verification still runs."""
    out = []
    for init in model.graph.initializer:
        if init.data_type not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16):
            continue
        arr = onnx.numpy_helper.to_array(init).astype(np.float32, copy=False)
        bad_nan, bad_inf = int(np.isnan(arr).sum()), int(np.isinf(arr).sum())
        if bad_nan or bad_inf:
            out.append(f"{label}: initializer '{init.name}' has {bad_nan} NaN and {bad_inf} Inf values "
                       f"(of {arr.size}); outputs may be NaN, which never compare equal")
    return out
