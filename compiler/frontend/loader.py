"""Load untrusted ONNX models safely and pin their input shapes: the one entry point for ONNX input.

The checks of untrusted bytes live in `onnx_safety` (models are only ever parsed, never executed;
external data only from inside the model's own folder), shapes and the memory budget in
`onnx_shapes`; this module strings them together. Everything a user can get wrong ends in one `ModelError`/`ShapeError` line that names the
file, node or input: a file that is not ONNX says what it looks like instead, an operator TVM
cannot import is named with its node, and a shape that cannot fit in memory is refused, with
its size, before anything is allocated.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from ..errors import ModelError
from .safety import (MAX_IR_VERSION, MAX_OPSET, MAX_PROTOBUF_BYTES, all_tensors, check_external_data, check_graph,
                     check_names, check_versions, elem_type_name, not_onnx, one_line, uses_external_data)
from .shapes import (AUTO_BATCH, AUTO_OTHER, AUTO_SPATIAL, DEFAULT_MEMORY_LIMIT_BYTES, fmt_bytes, graph_inputs,
                     parse_shape_spec, pin_shapes, weightless_copy)


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
    #: this model's Relax imports, made once and shared by every build from this object (fused and unfused):
    #: {(how, dynamic dims): compiler.frontend.importer.ImportResult}; see `compiler.pipeline.compile_model`
    imports: dict = field(default_factory=dict, repr=False, compare=False)

    def __getstate__(self) -> dict:
        """Pickled without its imports (Relax modules): a worker that receives it imports for itself."""
        return {**self.__dict__, "imports": {}}

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







# ----------------------------------------------------------------------------- file sniffing

# ----------------------------------------------------------------------------- external data







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
                raise ModelError(f"{path}: {fmt_bytes(size)} is larger than any ONNX protobuf can be (2 GiB); "
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
            raise not_onnx(label, data, parsed=False) from None
        if not model.graph.node and not model.graph.output:
            raise not_onnx(label, data, parsed=True)
    check_versions(model, label)
    if path is not None:
        check_external_data(model, path.parent, label)
        if uses_external_data(model):
            try:
                onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
            except Exception as err:  # onnx's own checks (symlink races, bounds) say it in their words
                raise ModelError(f"{label}: cannot read external data: {one_line(str(err))}") from None
    elif uses_external_data(model):
        raise ModelError(f"{label}: uses external data, which needs the model's file path")
    if model.functions:
        model = _inline_functions(model, label)
    if check_ops:
        from .op_support import check_supported

        check_supported(model, label)
    check_names(model, label)
    check_graph(model, label)
    return model, (name or (path.stem if path else label)), path


def _inline_functions(model: onnx.ModelProto, label: str) -> onnx.ModelProto:
    """Model-local functions (torch.onnx's dynamo exporter emits them) are unknown to TVM: inline them."""
    import onnx.inliner

    try:
        return onnx.inliner.inline_local_functions(model)
    except Exception as err:
        raise ModelError(f"{label}: cannot inline its local functions "
                         f"({', '.join(f.name for f in model.functions)}): {one_line(str(err))}") from None




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










# ----------------------------------------------------------------------------- shape pinning



















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
    from ..dynamic import check_names, keep_symbolic

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
