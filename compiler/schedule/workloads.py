"""ONNX reference workloads for the CPU schedules (shared by tests and benchmarks/schedule_kernels.py).

Small onnx.helper graphs that exercise each kernel family exactly as the pipeline sees it after
import: MatMul + bias + erf-GELU, Conv + BatchNorm + ReLU, LayerNorm, Softmax, a BERT encoder layer
and a ResNet-style bottleneck block. Weights are seeded random constants (initializers), so the
importer turns them into Relax constants that the schedules may pre-pack.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float = 0.05, offset: float = 0.0) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale + offset).astype("float32"), name)


def _scalar(name: str, value: float) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, dtype="float32"), name)


def _model(nodes: list, name: str, inputs: list, outputs: list, inits: list) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model


def _vi(name: str, shape: list[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _gelu_nodes(x: str, out: str, prefix: str) -> list:
    """GELU in the erf form exporters emit: 0.5 * x * (1 + erf(x / sqrt(2)))."""
    return [
        helper.make_node("Div", [x, "c_sqrt2"], [f"{prefix}_d"]),
        helper.make_node("Erf", [f"{prefix}_d"], [f"{prefix}_e"]),
        helper.make_node("Add", [f"{prefix}_e", "c_one"], [f"{prefix}_e1"]),
        helper.make_node("Mul", [x, f"{prefix}_e1"], [f"{prefix}_m"]),
        helper.make_node("Mul", [f"{prefix}_m", "c_half"], [out]),
    ]


def _gelu_consts() -> list[onnx.TensorProto]:
    return [_scalar("c_sqrt2", float(np.sqrt(2.0))), _scalar("c_one", 1.0), _scalar("c_half", 0.5)]


def mlp_gelu(m: int = 128, k: int = 768, n: int = 3072, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("MatMul", ["X", "W"], ["mm"]), helper.make_node("Add", ["mm", "B"], ["y"])]
    nodes += _gelu_nodes("y", "Z", "g")
    inits = [_init(rng, "W", (k, n)), _init(rng, "B", (n,), 1.0), *_gelu_consts()]
    return _model(nodes, "mlp_gelu", [_vi("X", [m, k])], [_vi("Z", [m, n])], inits)


def _bn_inits(rng: np.random.Generator, prefix: str, c: int) -> list[onnx.TensorProto]:
    return [
        numpy_helper.from_array((rng.random(c) + 0.5).astype("float32"), f"{prefix}_s"),
        _init(rng, f"{prefix}_b", (c,), 0.5),
        _init(rng, f"{prefix}_m", (c,), 0.1),
        numpy_helper.from_array((rng.random(c) + 0.5).astype("float32"), f"{prefix}_v"),
    ]


def _conv_bn(x: str, out: str, prefix: str, cin: int, cout: int, k: int, rng: np.random.Generator, *, stride: int = 1, group: int = 1, relu: bool = True) -> tuple[list, list]:
    pad = k // 2
    w = _init(rng, f"{prefix}_w", (cout, cin // group, k, k), scale=float(np.sqrt(2.0 / (cin // group * k * k))))
    nodes = [
        helper.make_node("Conv", [x, f"{prefix}_w"], [f"{prefix}_c"], pads=[pad] * 4, strides=[stride] * 2, kernel_shape=[k, k], group=group),
        helper.make_node("BatchNormalization", [f"{prefix}_c", f"{prefix}_s", f"{prefix}_b", f"{prefix}_m", f"{prefix}_v"], [f"{prefix}_bn" if relu else out]),
    ]
    if relu:
        nodes.append(helper.make_node("Relu", [f"{prefix}_bn"], [out]))
    return nodes, [w, *_bn_inits(rng, prefix, cout)]


def conv_bn_relu(n: int = 1, c: int = 64, hw: int = 56, oc: int = 64, k: int = 3, stride: int = 1, group: int = 1, seed: int = 1) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes, inits = _conv_bn("X", "Z", "cv", c, oc, k, rng, stride=stride, group=group)
    ohw = (hw + 2 * (k // 2) - k) // stride + 1
    return _model(nodes, "conv_bn_relu", [_vi("X", [n, c, hw, hw])], [_vi("Z", [n, oc, ohw, ohw])], inits)


def layernorm(rows: int = 128, hidden: int = 768, seed: int = 2) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("LayerNormalization", ["X", "g", "b"], ["Z"], axis=-1, epsilon=1e-5)]
    inits = [_init(rng, "g", (hidden,), 0.2, 1.0), _init(rng, "b", (hidden,), 0.2)]
    return _model(nodes, "layernorm", [_vi("X", [1, rows, hidden])], [_vi("Z", [1, rows, hidden])], inits)


def softmax(shape: tuple[int, ...] = (1, 12, 128, 128)) -> onnx.ModelProto:
    nodes = [helper.make_node("Softmax", ["X"], ["Z"], axis=-1)]
    return _model(nodes, "softmax", [_vi("X", list(shape))], [_vi("Z", list(shape))], [])


def masked_softmax(heads: int = 4, seq: int = 64) -> onnx.ModelProto:
    """Softmax of scores plus a causal mask of float32's lowest value above the diagonal, as LLaMA exports
    it: the masked lanes are what the fast exp must not turn into denormals (compiler/schedule/approx.py)."""
    mask = np.triu(np.full((seq, seq), np.finfo(np.float32).min, np.float32), 1)
    nodes = [helper.make_node("Add", ["X", "mask"], ["S"]), helper.make_node("Softmax", ["S"], ["Z"], axis=-1)]
    shape = [1, heads, seq, seq]
    return _model(nodes, "masked_softmax", [_vi("X", shape)], [_vi("Z", shape)],
                  [numpy_helper.from_array(mask, "mask")])


def bert_layer(seq: int = 128, hidden: int = 768, heads: int = 12, ffn: int = 3072, seed: int = 3) -> onnx.ModelProto:
    """One BERT-base encoder layer (post-LN), batch 1, as exporters write it (erf GELU, MatMul + Add)."""
    rng = np.random.default_rng(seed)
    dh = hidden // heads
    inits: list[onnx.TensorProto] = [*_gelu_consts()]
    nodes: list = []

    def dense(x: str, out: str, name: str, kin: int, kout: int) -> None:
        inits.extend([_init(rng, f"{name}_w", (kin, kout)), _init(rng, f"{name}_b", (kout,), 0.1)])
        nodes.extend([helper.make_node("MatMul", [x, f"{name}_w"], [f"{name}_mm"]), helper.make_node("Add", [f"{name}_mm", f"{name}_b"], [out])])

    inits.append(numpy_helper.from_array(np.array([1, seq, heads, dh], dtype="int64"), "shape_heads"))
    inits.append(numpy_helper.from_array(np.array([1, seq, hidden], dtype="int64"), "shape_hidden"))
    inits.append(_scalar("c_scale", 1.0 / float(np.sqrt(dh))))
    for name in ("q", "k", "v"):
        dense("X", f"{name}_lin", name, hidden, hidden)
        nodes.append(helper.make_node("Reshape", [f"{name}_lin", "shape_heads"], [f"{name}_r"]))
        perm = [0, 2, 3, 1] if name == "k" else [0, 2, 1, 3]
        nodes.append(helper.make_node("Transpose", [f"{name}_r"], [f"{name}_t"], perm=perm))
    nodes += [
        helper.make_node("MatMul", ["q_t", "k_t"], ["scores"]),
        helper.make_node("Mul", ["scores", "c_scale"], ["scores_s"]),
        helper.make_node("Softmax", ["scores_s"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v_t"], ["ctx"]),
        helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ctx_t", "shape_hidden"], ["ctx_r"]),
    ]
    dense("ctx_r", "attn_out", "o", hidden, hidden)
    nodes.append(helper.make_node("Add", ["attn_out", "X"], ["res1"]))
    inits += [_init(rng, "ln1_g", (hidden,), 0.1, 1.0), _init(rng, "ln1_b", (hidden,), 0.1)]
    nodes.append(helper.make_node("LayerNormalization", ["res1", "ln1_g", "ln1_b"], ["h1"], axis=-1, epsilon=1e-12))
    dense("h1", "ff1", "f1", hidden, ffn)
    nodes += _gelu_nodes("ff1", "ff1_g", "gelu")
    dense("ff1_g", "ff2", "f2", ffn, hidden)
    nodes.append(helper.make_node("Add", ["ff2", "h1"], ["res2"]))
    inits += [_init(rng, "ln2_g", (hidden,), 0.1, 1.0), _init(rng, "ln2_b", (hidden,), 0.1)]
    nodes.append(helper.make_node("LayerNormalization", ["res2", "ln2_g", "ln2_b"], ["Z"], axis=-1, epsilon=1e-12))
    return _model(nodes, "bert_layer", [_vi("X", [1, seq, hidden])], [_vi("Z", [1, seq, hidden])], inits)


def resnet_block(hw: int = 16, c: int = 64, mid: int = 16, seed: int = 4) -> onnx.ModelProto:
    """Bottleneck (1x1 -> 3x3 -> 1x1, residual add, ReLU) + stride-2 3x3 + max pool + depthwise conv +
    global average pool + Gemm head: one of each PrimFunc kind a CNN produces."""
    rng = np.random.default_rng(seed)
    nodes: list = []
    inits: list = []
    for args in (
        ("X", "a", "b1", c, mid, 1),
        ("a", "b", "b2", mid, mid, 3),
    ):
        n_, i_ = _conv_bn(*args[:3], args[3], args[4], args[5], rng)
        nodes += n_
        inits += i_
    n_, i_ = _conv_bn("b", "cc", "b3", mid, c, 1, rng, relu=False)
    nodes += n_
    inits += i_
    nodes += [helper.make_node("Add", ["cc", "X"], ["r"]), helper.make_node("Relu", ["r"], ["rr"])]
    n_, i_ = _conv_bn("rr", "s", "s2", c, c, 3, rng, stride=2)
    nodes += n_
    inits += i_
    nodes.append(helper.make_node("MaxPool", ["s"], ["p"], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1]))
    n_, i_ = _conv_bn("p", "dw", "dw", c, c, 3, rng, group=c)
    nodes += n_
    inits += i_
    nodes += [
        helper.make_node("GlobalAveragePool", ["dw"], ["g"]),
        helper.make_node("Flatten", ["g"], ["gf"]),
        helper.make_node("Gemm", ["gf", "fc_w", "fc_b"], ["Z"], transB=1),
    ]
    inits += [_init(rng, "fc_w", (10, c), 0.1), _init(rng, "fc_b", (10,), 0.1)]
    return _model(nodes, "resnet_block", [_vi("X", [1, c, hw, hw])], [_vi("Z", [1, 10])], inits)


def light_model_path(name: str) -> Path:
    """Path of an onnx wheel's ``backend/test/data/light`` model (e.g. ``resnet50``)."""
    return Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / f"light_{name}.onnx"


def random_inputs(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    init_names = {i.name for i in model.graph.initializer}
    out: dict[str, np.ndarray] = {}
    for inp in model.graph.input:
        if inp.name in init_names:
            continue
        shape = [d.dim_value or 1 for d in inp.type.tensor_type.shape.dim]
        out[inp.name] = rng.standard_normal(shape).astype("float32")
    return out


def import_and_fuse(model: onnx.ModelProto, target, *, fuse: bool = True):  # noqa: ANN001, ANN201 - tvm types
    """The pipeline prefix the CPU schedules run after (import, decompose, legalise, fold, fuse)."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend import onnx as relax_onnx

    mod = relax_onnx.from_onnx(model, keep_params_in_input=False)
    passes = [relax.transform.DecomposeOpsForInference(), relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant()]
    if fuse:
        passes += [relax.transform.FuseOps(), relax.transform.FuseTIR()]
    with target:
        return tvm.ir.transform.Sequential(passes)(mod)


def run_vm(mod, target, inputs: dict[str, np.ndarray]):  # noqa: ANN001, ANN201 - tvm types
    """Compile ``mod`` and return (callable running it on ``inputs``, first output as numpy)."""
    import tvm
    from tvm import relax

    exe = tvm.compile(mod, target=target)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    args = [tvm.runtime.tensor(v) for v in inputs.values()]

    def call():  # noqa: ANN202
        return vm["main"](*args)

    out = call()
    while not hasattr(out, "numpy"):
        out = out[0]
    return call, out.numpy()
