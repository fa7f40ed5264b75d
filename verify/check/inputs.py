"""Seeded inputs for an ONNX model that the model will accept: right shape, dtype and value range.

Random floats are harmless, random integers are not: an id beyond the embedding table makes
ONNX Runtime fail and TVM read out of bounds, so a "mismatch" would be an artefact of the input.
Integer inputs are therefore traced through the graph to what consumes them:

* indices of ``Gather`` / ``GatherElements`` (directly or via Cast, Reshape, Unsqueeze, Squeeze,
  Flatten, Identity, Transpose, Expand, Tile, Slice, Concat): uniform in ``[0, table_size)``,
  where table_size is the gathered tensor's size along ``axis`` (initializer, Constant, or shape
  inference with the pinned input shapes). This covers input_ids, position_ids and
  token_type_ids of embedding layers, and exercises every row of small tables.
* masks (named like ``*mask*``, or reaching Sub/Mul through a Cast, as in ``(1 - mask) * -1e4``):
  all ones. A random 0/1 mask can mask out a whole row, and softmax over an all-masked row is
  ill-conditioned (uniform, or NaN with -inf), so fused and unfused runs may differ legitimately.
* token types (``*token_type*`` / ``*segment*``) not traced to a table: zeros, the only id every
  token-type table has.
* anything else: small non-negative integers in ``[0, 16)``; bools: random bits.

Floats are standard normal. Every input draws from its own PCG64 stream, seeded by
``SeedSequence(seed, spawn_key=(crc32(name),))``, so a seed reproduces exactly and supplying one
input from a file does not change the random values of the others.

Consumers inside control-flow subgraphs (If/Loop/Scan bodies) are not traced.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from fuseguard.compiler.errors import InputError, ModelError, ShapeError, UsageError

#: Ops whose data input (index 0) reaches the output with its values unchanged.
_VALUE_PRESERVING = frozenset({"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity",
                               "Transpose", "Expand", "Tile", "Slice"})
_INDEXING = frozenset({"Gather", "GatherElements"})
_SMALL_INT_HIGH = 16


@dataclass(frozen=True)
class _Usage:
    """What an input's values must satisfy, as found by tracing its consumers."""

    table_size: int | None = None  # indices into a table with this many rows (smallest found)
    table_node: str = ""
    mask_like: bool = False


def _is_onnx_domain(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx")


def _dims(value_info: onnx.ValueInfoProto) -> list[int | str | None] | None:
    """Declared dims (int, symbolic name, or None for unknown); None when the rank is unknown."""
    tensor_type = value_info.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    out: list[int | str | None] = []
    for dim in tensor_type.shape.dim:
        if dim.HasField("dim_value"):
            out.append(int(dim.dim_value))
        else:
            out.append(dim.dim_param or None)
    return out


class _Graph:
    """Consumer edges and static tensor shapes of the top-level graph, for tracing inputs."""

    def __init__(self, model: onnx.ModelProto, pinned: Mapping[str, tuple[int, ...]]) -> None:
        self.model = model
        self.pinned = pinned
        self.consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for node in model.graph.node:
            for index, name in enumerate(node.input):
                if name:
                    self.consumers.setdefault(name, []).append((node, index))
        self.static: dict[str, tuple[int, ...]] = {
            init.name: tuple(int(d) for d in init.dims) for init in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type == "Constant" and _is_onnx_domain(node):
                for attr in node.attribute:
                    if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
                        self.static[node.output[0]] = tuple(int(d) for d in attr.t.dims)
        self._inferred: dict[str, list[int | str | None] | None] | None = None

    def _infer(self) -> dict[str, list[int | str | None] | None]:
        """Shapes of intermediate tensors, from ONNX shape inference with the pinned input shapes."""
        if self._inferred is None:
            copy = onnx.ModelProto()
            copy.CopyFrom(self.model)
            for value_info in copy.graph.input:
                if value_info.name in self.pinned:
                    shape = value_info.type.tensor_type.shape
                    shape.ClearField("dim")
                    for d in self.pinned[value_info.name]:
                        shape.dim.add().dim_value = d
            try:
                graph = onnx.shape_inference.infer_shapes(copy).graph
            except Exception:  # shape inference is a best effort here; unknown sizes fall back
                graph = copy.graph
            self._inferred = {vi.name: _dims(vi) for vi in [*graph.value_info, *graph.input, *graph.output]}
        return self._inferred

    def dim(self, tensor: str, axis: int) -> int | None:
        dims: Sequence[int | str | None] | None = self.static.get(tensor)
        if dims is None:
            dims = self._infer().get(tensor)
        if dims is None or not -len(dims) <= axis < len(dims):
            return None
        size = dims[axis]
        return size if isinstance(size, int) else None

    def trace(self, name: str) -> _Usage:
        table_size, table_node, mask_like = None, "", False
        frontier, seen = [(name, False)], set()
        while frontier:
            tensor, via_cast = frontier.pop()
            if (tensor, via_cast) in seen:
                continue
            seen.add((tensor, via_cast))
            for node, index in self.consumers.get(tensor, []):
                if not _is_onnx_domain(node):
                    continue
                op = node.op_type
                if (op in _VALUE_PRESERVING and index == 0) or op == "Concat":
                    frontier.append((node.output[0], via_cast or op == "Cast"))
                elif op in _INDEXING and index == 1:
                    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
                    size = self.dim(node.input[0], int(axis))
                    if size is not None and (table_size is None or size < table_size):
                        table_size, table_node = size, node.name or f"{op} -> {node.output[0]}"
                elif op in ("Sub", "Mul") and via_cast:
                    mask_like = True
        return _Usage(table_size, table_node, mask_like)


def _np_dtype(value_info: onnx.ValueInfoProto) -> np.dtype:
    if not value_info.type.HasField("tensor_type"):
        raise ModelError(f"input {value_info.name!r} is not a tensor (sequence/map/optional inputs "
                         "are not supported)")
    elem = value_info.type.tensor_type.elem_type
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem))
    except Exception as exc:
        raise ModelError(f"input {value_info.name!r} has unknown ONNX element type {elem}") from exc
    if dtype.kind in "OUSV" and dtype.name != "bfloat16" and not _narrow(dtype):
        raise ModelError(f"input {value_info.name!r} has element type "
                         f"{onnx.TensorProto.DataType.Name(elem)}, which fuseguard cannot generate")
    return dtype


def _expected_shape(name: str, declared: list[int | str | None] | None,
                    pinned: Sequence[int] | None) -> tuple[int, ...] | None:
    """The pinned shape checked against the declared one; the declared one when fully static."""
    if pinned is None:
        if declared is not None and all(isinstance(d, int) for d in declared):
            return tuple(declared)  # type: ignore[arg-type]
        return None
    shape = tuple(int(d) for d in pinned)
    if any(d < 0 for d in shape):
        raise ShapeError(f"input {name!r}: pinned shape {shape} has a negative dimension")
    if declared is not None:
        if len(declared) != len(shape):
            raise ShapeError(f"input {name!r}: pinned shape {shape} has rank {len(shape)}, "
                             f"the model declares rank {len(declared)} {_show(declared)}")
        for axis, (want, got) in enumerate(zip(declared, shape)):
            if isinstance(want, int) and want != got:
                raise ShapeError(f"input {name!r}: pinned shape {shape} has {got} at axis {axis}, "
                                 f"the model fixes it to {want} {_show(declared)}")
    return shape


def _show(dims: Sequence[int | str | None]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(
        np.random.SeedSequence(seed, spawn_key=(zlib.crc32(name.encode("utf-8")),))))


def _narrow(dtype: np.dtype) -> str | None:
    """"int" or "float" for ml_dtypes' narrow types (4/2-bit integers, 8/4-bit floats), else None."""
    if dtype.name in ("int4", "uint4", "int2", "uint2"):
        return "int"
    if dtype.name.startswith(("float8_", "float4_")):
        return "float"
    return None


def _draw(name: str, dtype: np.dtype, shape: tuple[int, ...], usage: _Usage,
          rng: np.random.Generator) -> np.ndarray:
    lowered = name.lower()
    narrow = _narrow(dtype)
    if narrow == "int":            # the type's whole range (ml_dtypes' iinfo), drawn wide and cast exactly
        import ml_dtypes

        info = ml_dtypes.iinfo(dtype)
        return rng.integers(int(info.min), int(info.max) + 1, size=shape).astype(dtype)
    if narrow == "float":          # a normal draw rounded to the format (saturated to its finite range)
        import ml_dtypes

        big = float(ml_dtypes.finfo(dtype).max)
        return np.clip(rng.standard_normal(shape, dtype=np.float32), -big, big).astype(dtype)
    is_mask = "mask" in lowered or usage.mask_like
    if dtype.kind == "b":
        return np.ones(shape, dtype=bool) if is_mask else rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        high = usage.table_size if usage.table_size is not None else _SMALL_INT_HIGH
        high = min(high, int(np.iinfo(dtype).max) + 1)
        if is_mask:
            return np.full(shape, 1 if high > 1 else 0, dtype=dtype)
        if usage.table_size is None and ("token_type" in lowered or "segment" in lowered):
            return np.zeros(shape, dtype=dtype)
        return rng.integers(0, max(high, 1), size=shape, dtype=dtype)
    if "mask" in lowered:
        return np.ones(shape, dtype=dtype)
    if dtype == np.float64:
        return rng.standard_normal(shape, dtype=np.float64)
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def _accept_user(name: str, value: object, dtype: np.dtype, expected: tuple[int, ...] | None,
                 declared: list[int | str | None] | None, usage: _Usage) -> np.ndarray:
    """A user array, cast only where no value can change, with the checks ORT would fail on."""
    array = np.asarray(value)
    if dtype.name == "bfloat16" and array.dtype.kind == "V" and array.dtype.itemsize == 2:
        array = array.view(dtype)  # .npz stores bfloat16 as raw 2-byte voids
    if array.dtype != dtype:
        if array.dtype.kind in "OUSV" or not np.can_cast(array.dtype, dtype, casting="safe"):
            raise InputError(f"input {name!r}: expected dtype {dtype.name}, got {array.dtype.name}, which "
                             f"cannot be cast without changing values; save it with .astype(np.{dtype.name})")
        array = array.astype(dtype)
    if expected is not None:
        if tuple(array.shape) != expected:
            raise InputError(f"input {name!r}: expected shape {expected}, got {tuple(array.shape)}")
    elif declared is not None:  # the array pins a dynamic input, but rank and fixed dims must fit
        fits = len(declared) == array.ndim and all(
            not isinstance(want, int) or want == got for want, got in zip(declared, array.shape))
        if not fits:
            raise InputError(f"input {name!r}: expected shape {_show(declared)}, got {tuple(array.shape)}")
    if usage.table_size is not None and dtype.kind in "iu" and array.size:
        low, high = int(array.min()), int(array.max())
        if low < -usage.table_size or high >= usage.table_size:
            raise InputError(f"input {name!r}: indexes a table of {usage.table_size} entries "
                             f"({usage.table_node}), so values must lie in [{-usage.table_size}, "
                             f"{usage.table_size}); got values in [{low}, {high}]")
    return array


def model_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Graph inputs a caller must feed: ``graph.input`` minus initializers (which have defaults)."""
    initializers = {init.name for init in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in initializers]


def make_inputs(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]], seed: int = 0,
                user: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """One valid array per model input, in graph order: the user's where given, else seeded random.

    ``shapes`` pins dynamic inputs; an input with only static dims may be left out, and so may
    one the user supplies (its array pins it, after checking rank and fixed dims).
    """
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise UsageError(f"seed must be a non-negative integer, got {seed!r}")
    inputs = model_inputs(model)
    names = [vi.name for vi in inputs]
    listing = ", ".join(names) or "(none)"
    unknown = [n for n in shapes if n not in names]
    if unknown:
        raise ShapeError(f"shape given for unknown input {unknown[0]!r}; the model's inputs are: {listing}")
    user = dict(user or {})
    unknown = [n for n in user if n not in names]
    if unknown:
        raise InputError(f"inputs file has unknown input {unknown[0]!r}; the model's inputs are: {listing}")

    pinned = {vi.name: _expected_shape(vi.name, _dims(vi), shapes.get(vi.name)) for vi in inputs}
    graph = _Graph(model, {n: s for n, s in pinned.items() if s is not None})
    out: dict[str, np.ndarray] = {}
    for vi in inputs:
        name, dtype, declared, expected = vi.name, _np_dtype(vi), _dims(vi), pinned[vi.name]
        usage = graph.trace(name) if dtype.kind in "iub" else _Usage()
        if name in user:
            out[name] = _accept_user(name, user[name], dtype, expected, declared, usage)
            continue
        if expected is None:
            raise ShapeError(f"input {name!r} has dynamic dims {_show(declared or [])}; pin them, e.g. "
                             f"--shape {name}:" + ",".join("1" if not isinstance(d, int) else str(d)
                                                            for d in declared or []))
        out[name] = _draw(name, dtype, expected, usage, _rng(int(seed), name))
    return out


def load_npz(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Arrays from an ``.npz`` of name -> array; never unpickles (a pickle runs arbitrary code)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"inputs file {str(path)!r} does not exist or is not a file")
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise InputError(f"inputs file {str(path)!r} holds a single array, not an archive of named "
                             "arrays; save one with numpy.savez(path, input_name=array, ...)")
        with loaded:
            return {name: loaded[name] for name in loaded.files}
    except InputError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise InputError(f"inputs file {str(path)!r} is not a readable .npz archive of plain arrays: "
                         f"{exc}") from None
