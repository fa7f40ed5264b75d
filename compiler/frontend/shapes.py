"""Input shapes: `--shape NAME=DIMS` parsing, dynamic dims pinned (batch 1, images 224, else 16, or
what the user says), and the memory budget: a shape whose inputs, weights and largest intermediate
cannot fit is refused with its size before anything is allocated."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import onnx
from onnx import helper

from ..errors import ModelError, ShapeError
from .safety import elem_type_name, itemsize


#: Bytes a model may need before we refuse to build it: inputs + weights + its largest
#: intermediate tensor. Refusing early beats an OOM kill that takes the whole session down.
DEFAULT_MEMORY_LIMIT_BYTES = 8 * 1024**3


#: Defaults for dynamic dimensions when neither --shape nor --default-dim pins them: batch 1;
#: image height/width 224 (divisible by 32, as detectors like DBNet need); anything else
#: (sequence length, feature count) 16, enough to exercise attention and reductions.
AUTO_BATCH, AUTO_SPATIAL, AUTO_OTHER = 1, 224, 16


#: Tensors at most this big stay in the weightless copy used for shape inference (they may be
#: shapes, axes or pads that inference needs); bigger ones become plain graph inputs.
_SMALL_INIT_BYTES = 4096

_INT64_MAX = 2**63 - 1


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


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The real inputs: graph inputs that are not initializers (old exporters list weights too)."""
    inits = {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


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
        nbytes = math.prod(shape) * itemsize(elem[name])
        if nbytes > limit:
            raise ShapeError(f"{label}: input '{name}' of shape {'x'.join(map(str, shape))} needs "
                             f"{fmt_bytes(nbytes)}, over the {fmt_bytes(limit)} limit")
        total += nbytes
    total += _weight_bytes(model)
    if total > limit:
        raise ShapeError(f"{label}: inputs and weights need {fmt_bytes(total)}, over the {fmt_bytes(limit)} limit")


def _weight_bytes(model: onnx.ModelProto) -> int:
    return sum(math.prod(init.dims) * itemsize(init.data_type) for init in model.graph.initializer)


def _check_activation_memory(model: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]], label: str,
                             limit: int) -> None:
    """Refuse shapes whose largest intermediate tensor cannot fit, e.g. a 4096x4096 image into a CNN.

    Shape inference runs on a weightless copy (big initializers become inputs of the same type),
    so it costs milliseconds even for large models. Tensors it cannot size are skipped.
    """
    graph = model.graph
    light = weightless_copy(model)
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
        nbytes = math.prod(dims) * itemsize(tt.elem_type)
        if worst is None or nbytes > worst[0]:
            worst = (nbytes, vi.name, tuple(dims))
    if worst is None:
        return
    nbytes, name, dims = worst
    inputs = sum(math.prod(s) * itemsize(next(i.type.tensor_type.elem_type for i in graph.input if i.name == n))
                 for n, s in shapes.items())
    total = nbytes + inputs + _weight_bytes(model)
    if nbytes > limit or total > limit:
        node = producer.get(name)
        where = f" (output of node '{node.name or node.op_type}')" if node is not None else ""
        given = ", ".join(f"{n}={'x'.join(map(str, s))}" for n, s in shapes.items())
        raise ShapeError(f"{label}: with inputs {given}, tensor '{name}'{where} of shape {'x'.join(map(str, dims))} "
                         f"needs {fmt_bytes(nbytes)} ({fmt_bytes(total)} with inputs and weights), over the "
                         f"{fmt_bytes(limit)} limit; pass a smaller --shape")


def weightless_copy(model: onnx.ModelProto) -> onnx.ModelProto:
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
        if math.prod(init.dims) * itemsize(init.data_type) <= _SMALL_INIT_BYTES:
            lg.initializer.append(init)
        elif init.name not in existing:
            lg.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    light.functions.extend(model.functions)
    return light


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"
