"""Symbolic dimensions: one build that serves every size of the dims a user names (`--dynamic seq<=512`).

An ONNX model names its variable dims with `dim_param` (torch's `dynamic_axes`, Hugging Face's
`batch_size`/`sequence_length`). `--dynamic NAME` keeps the dims called NAME symbolic through import
(one `tir.Var` per name, shared by every input that has it), so Relax carries them as shape variables
and the VM evaluates shape functions per call. An upper bound (`NAME<=N`) becomes the function's
`tir_var_upper_bound`, which lets StaticPlanBlockMemory plan storage for the bound instead of
allocating per call, and gives the cost model a size to decide with.

Models whose dims are all fixed (the built-in suite) are relabelled first (`relabel`): the axes that a
suite model's dim changes get the dim's name, as `torch.onnx.export(dynamic_axes=...)` would write.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import onnx

from .errors import UsageError

#: When a dynamic dim has no bound: the size the cost model decides with (and says so). 128 tokens is
#: the middle of the sequence lengths the suites and the cliff benchmark time (16-384).
REPRESENTATIVE_SIZE = 128

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class DynamicDim:
    """One symbolic dim: its ONNX `dim_param` name and an optional inclusive upper bound."""

    name: str
    upper: int | None = None

    def __str__(self) -> str:
        return self.name if self.upper is None else f"{self.name}<={self.upper}"

    @property
    def decide_size(self) -> int:
        """The size the cost model decides with: the bound, else REPRESENTATIVE_SIZE."""
        return self.upper if self.upper is not None else REPRESENTATIVE_SIZE


def parse_dynamic(spec: str | Iterable[str]) -> tuple[DynamicDim, ...]:
    """`"seq<=512,batch"` (or a list of such items) -> DynamicDims; a one-line UsageError otherwise."""
    items = [spec] if isinstance(spec, str) else list(spec)
    out: dict[str, DynamicDim] = {}
    for item in (part.strip() for text in items for part in text.split(",")):
        if not item:
            continue
        name, sep, bound = item.partition("<=")
        name = name.strip()
        if not _NAME.match(name):
            raise UsageError(f"--dynamic {item!r}: expected NAME or NAME<=N (NAME a dimension name such as seq)")
        upper = None
        if sep:
            if not bound.strip().isdigit() or int(bound) < 1:
                raise UsageError(f"--dynamic {item!r}: the bound must be an integer >= 1")
            upper = int(bound)
        if name in out and out[name] != DynamicDim(name, upper):
            raise UsageError(f"--dynamic names {name!r} twice with different bounds")
        out[name] = DynamicDim(name, upper)
    return tuple(out.values())


def as_spec(dims: Sequence[DynamicDim]) -> str:
    return ",".join(str(d) for d in dims)


def dim_params(model: onnx.ModelProto) -> dict[str, list[tuple[str, int]]]:
    """{dim_param name: [(input, axis), ...]} over the model's real inputs (initializers excluded)."""
    inits = {i.name for i in model.graph.initializer}
    out: dict[str, list[tuple[str, int]]] = {}
    for inp in (i for i in model.graph.input if i.name not in inits):
        if not inp.type.tensor_type.HasField("shape"):
            continue
        for axis, d in enumerate(inp.type.tensor_type.shape.dim):
            if d.HasField("dim_param") and d.dim_param:
                out.setdefault(d.dim_param, []).append((inp.name, axis))
    return out


def check_names(model: onnx.ModelProto, dims: Sequence[DynamicDim], label: str) -> dict[str, list[tuple[str, int]]]:
    """The (input, axis) pairs of each dynamic dim; a one-line UsageError naming the model's own dim
    names when one of `dims` is not among them."""
    params = dim_params(model)
    for d in dims:
        if d.name not in params:
            have = ", ".join(f"{n} ({', '.join(f'{i}[{a}]' for i, a in where)})" for n, where in params.items())
            raise UsageError(f"{label}: --dynamic {d.name}: no input dimension is named {d.name!r}; the model's "
                             f"named dimensions are: {have or '(none: every input dimension is fixed)'}")
    return {d.name: params[d.name] for d in dims}


def keep_symbolic(model: onnx.ModelProto, axes: Mapping[str, list[tuple[str, int]]]) -> None:
    """Write the dim_param names back onto pinned inputs (in place), so ONNX Runtime and the shape fold
    see those dims as variables while the others stay pinned."""
    where = {(i, a): name for name, pairs in axes.items() for i, a in pairs}
    for inp in model.graph.input:
        if not inp.type.tensor_type.HasField("shape"):
            continue
        for axis, d in enumerate(inp.type.tensor_type.shape.dim):
            name = where.get((inp.name, axis))
            if name is not None:
                d.Clear()
                d.dim_param = name


def relabel(model: onnx.ModelProto, axes: Mapping[str, Mapping[int, str]]) -> onnx.ModelProto:
    """A copy whose listed axes ({tensor: {axis: name}}, inputs and outputs) carry `dim_param` names,
    with inner value_info dropped (its static sizes would contradict other sizes)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for vi in list(out.graph.input) + list(out.graph.output):
        for axis, name in axes.get(vi.name, {}).items():
            d = vi.type.tensor_type.shape.dim[axis]
            d.Clear()
            d.dim_param = name
    del out.graph.value_info[:]
    return out


def symbolic_shapes(shapes: Mapping[str, Sequence[int]], axes: Mapping[str, list[tuple[str, int]]],
                    ) -> dict[str, list]:
    """Pinned input shapes with each dynamic axis replaced by its (shared) int64 `tir.Var`."""
    from tvm import tirx

    tvars = {name: tirx.Var(name, "int64") for name in axes}
    out = {k: list(v) for k, v in shapes.items()}
    for name, pairs in axes.items():
        for inp, axis in pairs:
            out[inp][axis] = tvars[name]
    return out


def upper_bounds(dims: Sequence[DynamicDim]) -> dict[str, int]:
    return {d.name: d.upper for d in dims if d.upper is not None}
