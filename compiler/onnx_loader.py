"""Load untrusted ONNX models safely and pin their input shapes.

Models are only ever parsed, never executed: no pickle, and external data is read only
from inside the model's own folder (no `..`, absolute paths or symlinks leading out).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from .errors import ModelError, ShapeError

#: Bytes a model's tensors may need before we refuse to build it (inputs + weights + largest
#: activation). Refusing early beats an OOM kill that takes the whole session down.
DEFAULT_MEMORY_LIMIT_BYTES = 8 * 1024**3

#: Highest IR version / default-domain opset the installed onnx package understands.
MAX_IR_VERSION = onnx.IR_VERSION
MAX_OPSET = onnx.defs.onnx_opset_version()


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

    @property
    def num_nodes(self) -> int:
        return len(self.model.graph.node)


def parse_shape_spec(spec: str) -> tuple[str, tuple[int, ...]]:
    """Parse `name=1x3x224x224` (also `name:1,3,224,224`) into a name and a shape."""
    for sep in ("=", ":"):
        if sep in spec:
            name, dims = spec.rsplit(sep, 1)
            break
    else:
        raise ShapeError(f"--shape {spec!r}: expected NAME=DxDxD, e.g. input=1x3x224x224")
    parts = dims.replace(",", "x").split("x") if dims else []
    try:
        shape = tuple(int(p) for p in parts if p != "")
    except ValueError:
        raise ShapeError(f"--shape {spec!r}: dimensions must be integers, got {dims!r}") from None
    if not name:
        raise ShapeError(f"--shape {spec!r}: missing input name before '{sep}'")
    if any(d < 0 for d in shape):
        raise ShapeError(f"--shape {spec!r}: negative dimension")
    return name, shape


def elem_type_name(elem_type: int) -> str:
    return helper.tensor_dtype_to_np_dtype(elem_type).name if elem_type != TensorProto.BFLOAT16 else "bfloat16"


def _check_external_data(model: onnx.ModelProto, base_dir: Path, label: str) -> None:
    """Reject external-data locations that leave the model folder (CVE-2022-25882, CVE-2024-27318)."""
    base = base_dir.resolve()
    for tensor in _all_tensors(model):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        where = f"{label}: initializer '{tensor.name}' external data {location!r}"
        if not location:
            raise ModelError(f"{where}: no location given")
        if os.path.isabs(location) or location.startswith(("/", "\\")) or (len(location) > 1 and location[1] == ":"):
            raise ModelError(f"{where}: absolute paths are not allowed")
        if ".." in Path(location.replace("\\", "/")).parts:
            raise ModelError(f"{where}: '..' leads outside the model folder")
        candidate = base / location
        if candidate.is_symlink() or any(p.is_symlink() for p in candidate.parents if base in p.parents or p == base):
            raise ModelError(f"{where}: symbolic links are not followed")
        resolved = candidate.resolve()
        if base not in resolved.parents:
            raise ModelError(f"{where}: resolves outside the model folder")
        if not resolved.is_file():
            raise ModelError(f"{where}: file not found next to the model")
        if os.stat(resolved).st_nlink > 1:
            raise ModelError(f"{where}: file has several hard links; refusing it")
        offset = int(info.get("offset", 0) or 0)
        length = info.get("length")
        size = resolved.stat().st_size
        if offset < 0 or offset > size or (length is not None and offset + int(length) > size):
            raise ModelError(f"{where}: offset/length ({offset}, {length}) past the end of a {size}-byte file")


def _all_tensors(model: onnx.ModelProto):
    yield from model.graph.initializer
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t


def load_model(source: str | os.PathLike | bytes | onnx.ModelProto, *, name: str | None = None) -> tuple[onnx.ModelProto, str, Path | None]:
    """Parse and check a model; return (model, display name, path). Raises ModelError."""
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
            label = name or path.name
            if not path.exists():
                raise ModelError(f"{path}: no such file")
            if path.is_dir():
                raise ModelError(f"{path}: is a directory, not an ONNX file")
            try:
                data = path.read_bytes()
            except OSError as err:
                raise ModelError(f"{path}: cannot read ({err.strerror})") from None
            label = str(path)
        if not data:
            raise ModelError(f"{label}: empty file")
        model = onnx.ModelProto()
        try:
            model.ParseFromString(data)
        except Exception as err:  # protobuf raises DecodeError or RuntimeWarning-like errors
            raise ModelError(f"{label}: not an ONNX model or truncated (protobuf parse failed: {err})") from None
        if not model.graph.node and not model.graph.output:
            raise ModelError(f"{label}: not an ONNX model (no graph found; is the file truncated or of another format?)")
    _check_versions(model, label)
    if path is not None:
        _check_external_data(model, path.parent, label)
        if any(t.data_location == TensorProto.EXTERNAL for t in _all_tensors(model)):
            onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
    elif any(t.data_location == TensorProto.EXTERNAL for t in _all_tensors(model)):
        raise ModelError(f"{label}: uses external data, which needs the model's file path")
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "invalid"
        raise ModelError(f"{label}: fails onnx.checker: {first}") from None
    _check_names(model, label)
    return model, (name or (Path(label).stem if path else label)), path


def _check_versions(model: onnx.ModelProto, label: str) -> None:
    if model.ir_version < 3:
        raise ModelError(f"{label}: IR version {model.ir_version} is too old (need >= 3)")
    if model.ir_version > MAX_IR_VERSION:
        raise ModelError(f"{label}: IR version {model.ir_version} is newer than this onnx supports ({MAX_IR_VERSION})")
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > MAX_OPSET:
            raise ModelError(f"{label}: opset {opset.version} is newer than this onnx supports ({MAX_OPSET})")


def _check_names(model: onnx.ModelProto, label: str) -> None:
    """Duplicate value names make any name-based mapping (inputs, bisection) ambiguous."""
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
                raise ModelError(f"{label}: duplicate tensor name '{out}' (node '{node.name or node.op_type}' redefines it)")
            seen[out] = "node"


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The real inputs: graph inputs that are not initializers (old exporters list weights too)."""
    inits = {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def pin_shapes(
    model: onnx.ModelProto,
    shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    default_dim: int = 1,
    label: str = "model",
    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Fix every input dimension (given shapes, else the model's own, else `default_dim`) in place."""
    shapes = dict(shapes or {})
    inputs = graph_inputs(model)
    names = [i.name for i in inputs]
    for key in shapes:
        if key not in names:
            raise ShapeError(f"{label}: --shape names '{key}', which is not an input; inputs are: {', '.join(names) or '(none)'}")
    pinned: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for inp in inputs:
        ttype = inp.type.tensor_type
        if not inp.type.HasField("tensor_type"):
            raise ModelError(f"{label}: input '{inp.name}' is not a tensor (sequence/map inputs are not supported)")
        dtypes[inp.name] = elem_type_name(ttype.elem_type)
        dims = list(ttype.shape.dim) if ttype.HasField("shape") else None
        given = shapes.get(inp.name)
        if given is not None:
            given = tuple(int(d) for d in given)
            if dims is not None and len(dims) != len(given):
                raise ShapeError(f"{label}: --shape {inp.name}={'x'.join(map(str, given))} has rank {len(given)}, "
                                 f"but the model's input has rank {len(dims)}")
            if dims is not None:
                for axis, (d, g) in enumerate(zip(dims, given)):
                    if d.HasField("dim_value") and d.dim_value != g:
                        raise ShapeError(f"{label}: --shape {inp.name}: dimension {axis} is fixed to {d.dim_value} "
                                         f"in the model, got {g}")
            shape = given
        elif dims is None:
            raise ShapeError(f"{label}: input '{inp.name}' has no shape in the model; pass --shape {inp.name}=...")
        else:
            shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else default_dim for d in dims)
        if any(d == 0 for d in shape):
            raise ShapeError(f"{label}: input '{inp.name}' has a zero-size dimension {shape}")
        pinned[inp.name] = shape
        new_shape = onnx.TensorShapeProto()
        for d in shape:
            new_shape.dim.add().dim_value = d
        ttype.shape.CopyFrom(new_shape)
    _check_memory(model, pinned, dtypes, label, memory_limit_bytes)
    return pinned, dtypes


def _check_memory(model: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str],
                  label: str, limit: int) -> None:
    """Refuse, before allocating anything, a model whose inputs or weights cannot fit."""
    total = 0
    for name, shape in shapes.items():
        itemsize = 2 if dtypes[name] == "bfloat16" else np.dtype(dtypes[name]).itemsize
        nbytes = math.prod(shape) * itemsize
        if nbytes > limit:
            raise ShapeError(f"{label}: input '{name}' of shape {'x'.join(map(str, shape))} needs "
                             f"{_fmt_bytes(nbytes)}, over the {_fmt_bytes(limit)} limit")
        total += nbytes
    for init in model.graph.initializer:
        total += math.prod(init.dims) * max(1, helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
                                            if init.data_type != TensorProto.BFLOAT16 else 2)
    if total > limit:
        raise ShapeError(f"{label}: inputs and weights need {_fmt_bytes(total)}, over the {_fmt_bytes(limit)} limit")


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
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
    default_dim: int = 1,
    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
) -> LoadedModel:
    """Load, check, name nodes and pin shapes: the one entry point for ONNX input."""
    model, display, path = load_model(source, name=name)
    label = str(path) if path else display
    pinned, dtypes = pin_shapes(model, shapes, default_dim=default_dim, label=label,
                                memory_limit_bytes=memory_limit_bytes)
    name_nodes(model)
    warnings = _weight_warnings(model, label)
    return LoadedModel(name=display, model=model, input_shapes=pinned, input_dtypes=dtypes,
                       output_names=[o.name for o in model.graph.output], path=path, warnings=warnings)


def _weight_warnings(model: onnx.ModelProto, label: str) -> list[str]:
    """NaN/Inf in weights is worth a warning, not a refusal: verification still runs."""
    out = []
    for init in model.graph.initializer:
        if init.data_type not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE):
            continue
        arr = onnx.numpy_helper.to_array(init)
        bad_nan, bad_inf = int(np.isnan(arr).sum()), int(np.isinf(arr).sum())
        if bad_nan or bad_inf:
            out.append(f"{label}: initializer '{init.name}' has {bad_nan} NaN and {bad_inf} Inf values")
    return out
