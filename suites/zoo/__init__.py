"""Real `torch.onnx.export` output of torchvision and transformers architectures, committed without weights.

`suites/zoo/export.py` (needs the optional `[zoo]` extra: torch, torchvision, transformers) exports each
architecture with random weights both ways users do, TorchScript (`dynamo=False`, opset 17) and dynamo
(opset 18), and strips every large float initializer down to its name, dtype and dims (`strip_weights`):
the graphs stay small and CI needs no torch. `load_zoo_model` redraws the weights from a seed, by the
role each tensor plays for the op that consumes it, so outputs are not degenerate:

- Conv / Gemm / MatMul weights: He / LeCun normal on their fan-in (activations stay unit-scale);
- LayerNorm and BatchNorm scales uniform in [0.5, 1.5], their shifts and other added tensors N(0, 0.1)
  (no zero-initialised heads, no 1e-6 layer scales), embedding tables N(0, 1);
- BatchNorm mean and variance measured on a random image (`suites.light.batchnorm_statistics`), as in
  a trained network.

With `peaked=True` the weights that produce attention scores are scaled up so the attention softmax is
peaked (large logits), where fused attention numerics differ most.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

ZOO_DIR = Path(__file__).resolve().parent
STRIPPED = "fuseguard:stripped"
#: Float initializers with at least this many elements are weights to strip; smaller ones (scalars such
#: as sqrt(d), epsilons, masks' fill values) are graph semantics and stay.
STRIP_MIN_ELEMENTS = 64
_PASS_THROUGH = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Transpose", "Cast"})
#: Gain on the attention-score weights in the peaked variant: logits grow ~gain^2. Measured mean of the
#: first softmax's row maximum, plain -> peaked: bert_tiny 0.11 -> 0.84, gpt2_tiny 0.21 -> 0.84,
#: llama_tiny 0.24 -> 0.58, vit_tiny 0.27 -> 0.84.
PEAKED_GAIN = 3.0


@dataclass(frozen=True)
class ZooEntry:
    """One committed export: file, inputs (name -> shape, dtype) and what it exercises."""

    name: str
    file: str
    inputs: dict[str, tuple[tuple[int, ...], str]]
    source: str
    exporter: str
    slow: bool = False
    tags: tuple[str, ...] = ()
    vocab: int = 0                 # int inputs (token ids) are drawn in [0, vocab)
    #: an export with these dims symbolic (`<name>_dyn`, torch's dynamic_axes): for symbolic builds only
    dynamic: tuple[str, ...] = ()


def strip_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """Large float initializers become name + dtype + dims only (marked in doc_string); the rest stays."""
    out = onnx.ModelProto.FromString(model.SerializeToString())
    for node in out.graph.node:             # the dynamo exporter's per-node stack traces: 10x the graph
        node.doc_string = ""
        del node.metadata_props[:]
    for init in out.graph.initializer:
        if init.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16) and \
                math.prod(init.dims) >= STRIP_MIN_ELEMENTS:
            stripped = onnx.TensorProto(name=init.name, data_type=init.data_type, dims=list(init.dims),
                                        doc_string=STRIPPED)
            init.CopyFrom(stripped)
    return out


def _consumers(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for slot, name in enumerate(node.input):
            uses.setdefault(name, []).append((node, slot))
    return uses


def _final_uses(name: str, uses: dict[str, list[tuple[onnx.NodeProto, int]]],
                depth: int = 0) -> Iterable[tuple[onnx.NodeProto, int, bool]]:
    """(consumer, slot, transposed on the way) past shape-only ops."""
    for node, slot in uses.get(name, []):
        if node.op_type in _PASS_THROUGH and slot == 0 and depth < 4:
            for consumer, s, t in _final_uses(node.output[0], uses, depth + 1):
                yield consumer, s, t or node.op_type == "Transpose"
        else:
            yield node, slot, False


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(helper.get_attribute_value(a))
    return default


def _draw(shape: tuple[int, ...], uses: list[tuple[onnx.NodeProto, int, bool]],
          rng: np.random.Generator) -> tuple[np.ndarray, str]:
    node, slot, transposed = uses[0] if uses else (None, -1, False)
    op = node.op_type if node is not None else ""
    if op == "Conv" and slot == 1:
        fan_in = math.prod(shape[1:])
        return rng.normal(0.0, math.sqrt(2.0 / fan_in), shape), "conv_weight"
    if op in ("MatMul", "Gemm") and len(shape) >= 2:
        if op == "Gemm":
            trans = _attr(node, "transB" if slot == 1 else "transA", 0)
            fan_in = shape[1] if trans else shape[0]
        else:
            fan_in = shape[-1] if transposed else shape[-2] if slot == 1 else shape[-1]
        return rng.normal(0.0, 1.0 / math.sqrt(fan_in), shape), "dense_weight"
    if op in ("LayerNormalization", "BatchNormalization", "InstanceNormalization", "GroupNormalization") \
            or op == "SimplifiedLayerNormalization":
        if slot == 1:
            return rng.uniform(0.5, 1.5, shape), "norm_scale"
        if op == "BatchNormalization" and slot == 4:
            return rng.uniform(0.5, 1.5, shape), "bn_var"
        return rng.normal(0.0, 0.1, shape), "norm_shift"
    if op == "Gather" and slot == 0:
        return rng.normal(0.0, 1.0, shape), "embedding"
    if op == "Mul":
        return rng.uniform(0.5, 1.5, shape), "scale"
    return rng.normal(0.0, 0.1, shape), "shift"


def _attention_score_weights(graph: onnx.GraphProto) -> set[str]:
    """Dense weights whose path reaches the left or right operand of a MatMul feeding a Softmax."""
    producers = {o: n for n in graph.node for o in n.output}
    uses = _consumers(graph)
    weights: set[str] = set()
    stripped = {i.name for i in graph.initializer if i.doc_string == STRIPPED}
    for node in graph.node:
        if node.op_type != "Softmax":
            continue
        # walk up through scale / mask / reshape to the scores MatMul
        cur = producers.get(node.input[0])
        for _ in range(6):
            if cur is None or cur.op_type == "MatMul":
                break
            cur = producers.get(cur.input[0])
        if cur is None or cur.op_type != "MatMul":
            continue
        stack, seen = list(cur.input), set()
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in stripped:
                if any(n.op_type in ("MatMul", "Gemm") for n, _, _ in _final_uses(name, uses)):
                    weights.add(name)
                continue
            prod = producers.get(name)
            if prod is not None and prod.op_type not in ("LayerNormalization", "Softmax") and len(seen) < 64:
                stack.extend(prod.input)
    return weights


def fill_weights(model: onnx.ModelProto, seed: int, *, peaked: bool = False,
                 calibrate: bool = True) -> onnx.ModelProto:
    """Draw every stripped initializer from `seed` by its role (module docstring)."""
    out = onnx.ModelProto.FromString(model.SerializeToString())
    graph = out.graph
    uses = _consumers(graph)
    rng = np.random.default_rng(seed)
    gain_for = _attention_score_weights(graph) if peaked else set()
    for init in sorted(graph.initializer, key=lambda i: i.name):
        if init.doc_string != STRIPPED:
            continue
        shape = tuple(init.dims)
        arr, _ = _draw(shape, list(_final_uses(init.name, uses)), rng)
        if init.name in gain_for:
            arr = arr * PEAKED_GAIN
        dtype = np.float16 if init.data_type == onnx.TensorProto.FLOAT16 else np.float32
        init.CopyFrom(numpy_helper.from_array(arr.astype(dtype), init.name))
    if calibrate and any(n.op_type == "BatchNormalization" for n in graph.node):
        out = _calibrate_batchnorm(out, rng)
    return out


def _calibrate_batchnorm(model: onnx.ModelProto, rng: np.random.Generator) -> onnx.ModelProto:
    from fuseguard.suites.light import batchnorm_statistics

    graph = model.graph
    (data,) = [i for i in graph.input if i.name not in {t.name for t in graph.initializer}]
    shape = tuple(d.dim_value for d in data.type.tensor_type.shape.dim)
    stats = batchnorm_statistics(model, {}, rng.standard_normal(shape, dtype=np.float32))
    for init in graph.initializer:
        if init.name in stats:
            init.CopyFrom(numpy_helper.from_array(stats[init.name].astype(np.float32), init.name))
    return model


@functools.lru_cache(maxsize=1)
def zoo_entries() -> tuple[ZooEntry, ...]:
    """The committed exports, from suites/zoo/index.json (written by export.py)."""
    index = ZOO_DIR / "index.json"
    if not index.is_file():
        return ()
    entries = []
    for item in json.loads(index.read_text()):
        entries.append(ZooEntry(name=item["name"], file=item["file"],
                                inputs={k: (tuple(v[0]), v[1]) for k, v in item["inputs"].items()},
                                source=item["source"], exporter=item["exporter"], slow=item.get("slow", False),
                                tags=tuple(item.get("tags", ())), vocab=item.get("vocab", 0),
                                dynamic=tuple(item.get("dynamic", ()))))
    return tuple(entries)


def zoo_entry(name: str) -> ZooEntry:
    for e in zoo_entries():
        if e.name == name:
            return e
    raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(e.name for e in zoo_entries())}")


def load_zoo_model(name: str, *, seed: int = 0, peaked: bool = False) -> onnx.ModelProto:
    """The committed graph with weights drawn from `seed`."""
    entry = zoo_entry(name)
    model = onnx.load(str(ZOO_DIR / entry.file))
    return fill_weights(model, seed, peaked=peaked)
