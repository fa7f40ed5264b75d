"""`fuseguard bisect`: known-wrong fusions injected through the public pass hook are found exactly.

Each perturbation is a pass at the ``after_fusion`` stage that rewrites ONE composite function made
by FuseOpsByPattern (a dropped bias, a tanh-GELU for the erf one, a softmax over the wrong axis, a
wrong LayerNorm epsilon). Composites exist only in the fused build, so the unfused build stays
right, and the bisector must name that group — and no other — with the ONNX nodes it came from.
A perturbation at ``before_fusion`` hits both builds and must be blamed on import/lowering.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from tvm import relax

from fuseguard.compiler.pipeline import CompileOptions
from fuseguard.suites.models import get_model
from fuseguard.verify.debug.bisect import (BLAME_FUSION, BLAME_LOWERING, EXIT_DRIFT, EXIT_NO_DRIFT, EXIT_UNTESTABLE,
                                           bisect_model)
from fuseguard.verify.check.model import verify_model

NO_SCHED = CompileOptions(schedule=False)


# ----------------------------------------------------------------------------- perturbations


@relax.expr_functor.mutator
class _Mutator(relax.PyExprMutator):
    """Rewrites the first binding `rewrite` accepts; a Var result aliases the binding to that var."""

    def __init__(self, mod: tvm.IRModule, rewrite: Callable) -> None:
        super().__init__(mod)
        self.rewrite, self.values, self.hits = rewrite, {}, 0

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.values[binding.var] = binding.value
        new = self.rewrite(binding.value, self.values) if self.hits == 0 else None
        if new is None:
            super().visit_var_binding_(binding)
            return
        self.hits += 1
        new = self.visit_expr(new)
        self.set_var_remap(binding.var, new if isinstance(new, relax.Var) else self.builder_.emit(new, binding.var.name))


def _is(expr: relax.Expr, op: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == op


class Perturb:
    """An `after_fusion` pass: rewrite one binding in the first selected composite of one pattern."""

    def __init__(self, name: str, composite: str, rewrite: Callable, select: Callable | None = None) -> None:
        self.__name__ = name
        self.composite, self.rewrite = f"fuseguard.{composite}", rewrite
        self.select = select or (lambda call: True)
        self.functions: list[str] = []          # the composite it changed, per build

    def __call__(self, mod: tvm.IRModule) -> tvm.IRModule:
        targets: list[relax.GlobalVar] = []

        def visit(e: relax.Expr) -> None:
            if isinstance(e, relax.Call) and isinstance(e.op, relax.GlobalVar) and e.op not in targets:
                f = mod[e.op]
                if isinstance(f, relax.Function) and f.attrs and str(f.attrs.get("Composite", "")) == self.composite \
                        and self.select(e):
                    targets.append(e.op)

        relax.analysis.post_order_visit(mod["main"].body, visit)
        for gv in targets:
            mutator = _Mutator(mod, self.rewrite)
            new = mutator.visit_expr(mod[gv])
            if mutator.hits:
                mod = tvm.IRModule(dict(mod.functions.items()), attrs=mod.attrs)
                mod[gv] = new
                self.functions.append(gv.name_hint)
                break
        return mod


def drop_bias(value: relax.Expr, values: dict) -> relax.Expr | None:
    """add(matmul | conv2d, bias) -> the matmul/conv alone."""
    if _is(value, "relax.add") and isinstance(value.args[0], relax.Var):
        producer = values.get(value.args[0])
        if _is(producer, "relax.matmul") or _is(producer, "relax.nn.conv2d"):
            return value.args[0]
    return None


def erf_to_tanh(value: relax.Expr, values: dict) -> relax.Expr | None:
    """erf(z) -> tanh(2/sqrt(pi) (z + 2 * 0.044715 z^3)): the tanh GELU where the exact one was."""
    if _is(value, "relax.erf"):
        z = value.args[0]
        cube = relax.op.multiply(relax.op.multiply(z, z), z)
        inner = relax.op.add(z, relax.op.multiply(cube, relax.const(2 * 0.044715, "float32")))
        return relax.op.tanh(relax.op.multiply(inner, relax.const(2 / math.sqrt(math.pi), "float32")))
    return None


def softmax_wrong_axis(value: relax.Expr, values: dict) -> relax.Expr | None:
    return relax.op.nn.softmax(value.args[0], axis=-2) if _is(value, "relax.nn.softmax") else None


def layernorm_wrong_eps(value: relax.Expr, values: dict) -> relax.Expr | None:
    if not _is(value, "relax.nn.layer_norm"):
        return None
    a = value.attrs
    return relax.op.nn.layer_norm(*value.args[:3], axes=list(a.axes), epsilon=0.1, center=bool(a.center),
                                  scale=bool(a.scale))


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def bert() -> onnx.ModelProto:
    return get_model("bert_encoder").make({"seq": 16}, seed=0)


def _node_types(model: onnx.ModelProto) -> dict[str, str]:
    return {n.name: n.op_type for n in model.graph.node}


# ----------------------------------------------------------------------------- fusion bugs


def test_clean_model_reports_no_drift(bert, tmp_path: Path) -> None:
    result = bisect_model(bert, options=NO_SCHED, out_dir=tmp_path)
    assert result, result.summary()
    assert result.status == "no-drift" and result.exit_code == EXIT_NO_DRIFT
    assert result.culprit is None and result.reproducer is None
    # Kernels with no unfused counterpart (e.g. the layout transpose the attention kernel adds) stay unmapped.
    assert result.builds == 2 and len(result.unmapped) <= 2
    json.dumps(result.to_dict())


def test_dropped_bias_in_gelu_group_is_named_and_reproduced(bert, tmp_path: Path) -> None:
    perturb = Perturb("gelu_drop_bias", "matmul_bias_gelu", drop_bias)
    options = CompileOptions(schedule=False, extra_passes=(("after_fusion", perturb),))
    result = bisect_model(bert, options=options, out_dir=tmp_path)
    assert not result and result.exit_code == EXIT_DRIFT
    c = result.culprit
    assert c is not None and c.blame == BLAME_FUSION
    assert c.pattern == "matmul_bias_gelu" and c.function == perturb.functions[0]
    types = _node_types(bert)
    assert sorted(types[n] for n in c.onnx_nodes) == sorted(["MatMul", "Add", "Div", "Erf", "Add", "Mul", "Mul"])
    assert c.inputs_agree is True and c.error.max_abs_error > 1e-2 and not c.error
    assert result.fused_vs_reference is not None and not result.fused_vs_reference
    assert result.unfused_vs_reference

    # The reproducer fails `verify` on its own with the bad fusion loaded, and passes without it.
    repro = result.reproducer
    assert repro is not None and repro.confirmed is True
    sub = onnx.load(repro.model)
    assert len(sub.graph.node) == 7 and [o.name for o in sub.graph.output] == c.onnx_outputs
    with np.load(repro.inputs) as feed:
        assert sorted(feed.files) == sorted(i.name for i in sub.graph.input)
    bad = verify_model(repro.model, inputs_file=repro.inputs, options=options)
    assert bad.status == "FAIL" and not bad.fused.passed and bad.unfused.passed
    assert verify_model(repro.model, inputs_file=repro.inputs, options=NO_SCHED).passed


def _zero_head(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its output multiplied by a zero matrix: all zeros whatever the input, as a random-weight
    export with a zero-initialised head (torchvision's ViT) is."""
    from onnx import helper, numpy_helper

    out = model.graph.output[0]
    hidden = out.type.tensor_type.shape.dim[-1].dim_value
    zeroed = onnx.ModelProto()
    zeroed.CopyFrom(model)
    zeroed.graph.initializer.append(numpy_helper.from_array(np.zeros((hidden, 4), np.float32), "zero_head_w"))
    zeroed.graph.node.append(helper.make_node("MatMul", [out.name, "zero_head_w"], ["head"], name="zero_head"))
    del zeroed.graph.output[:]
    dims = [d.dim_value or d.dim_param for d in out.type.tensor_type.shape.dim][:-1] + [4]
    zeroed.graph.output.append(helper.make_tensor_value_info("head", onnx.TensorProto.FLOAT, dims))
    return zeroed


def test_a_fusion_bug_behind_an_all_zero_output_is_still_found(bert, tmp_path: Path) -> None:
    """The dropped bias of the GELU group changes nothing the output shows (it is 0 whatever the input): bisect
    compares every intermediate instead of stopping at outputs that agree, and names the group; the same model
    without the bug is "no drift" with its intermediates counted."""
    model = _zero_head(bert)
    perturb = Perturb("gelu_drop_bias", "matmul_bias_gelu", drop_bias)
    options = CompileOptions(schedule=False, extra_passes=(("after_fusion", perturb),))
    result = bisect_model(model, options=options, out_dir=tmp_path, confirm=False)
    assert result.fused_vs_reference and result.unfused_vs_reference      # the outputs agree: all zeros
    assert not result and result.exit_code == EXIT_DRIFT, result.summary()
    c = result.culprit
    assert c is not None and c.blame == BLAME_FUSION and c.pattern == "matmul_bias_gelu"
    assert any("cannot show a wrong result" in n for n in result.notes)
    clean = bisect_model(model, options=NO_SCHED, out_dir=tmp_path / "clean", confirm=False)
    assert clean and clean.compared > 10 and "intermediates too" in clean.summary()


@pytest.mark.parametrize("pattern, rewrite, op_type, disabled", [
    # Same group as the dropped-bias case, a subtler error (~5e-4): slow-marked to keep the default run short.
    pytest.param("matmul_bias_gelu", erf_to_tanh, "Erf", frozenset(), marks=pytest.mark.slow),
    # The attention pattern takes the softmax into a hand-written kernel; without it, the softmax rule fuses it.
    ("softmax", softmax_wrong_axis, "Softmax", frozenset({"attention"})),
    ("layernorm", layernorm_wrong_eps, "LayerNormalization", frozenset()),
], ids=["tanh_gelu", "softmax_axis", "layernorm_eps"])
def test_wrong_fused_group_is_named(bert, tmp_path: Path, pattern: str, rewrite: Callable, op_type: str,
                                    disabled: frozenset[str]) -> None:
    perturb = Perturb(f"wrong_{pattern}", pattern, rewrite)
    options = CompileOptions(schedule=False, disabled_patterns=disabled, extra_passes=(("after_fusion", perturb),))
    result = bisect_model(bert, options=options, out_dir=tmp_path, confirm=False)
    assert perturb.functions, f"pattern {pattern!r} fused nothing in bert_encoder: the test lost its target"
    c = result.culprit
    assert c is not None, result.summary()
    assert c.blame == BLAME_FUSION and c.pattern == pattern and c.function == perturb.functions[0]
    assert op_type in [_node_types(bert)[n] for n in c.onnx_nodes]
    assert c.inputs_agree is True
    assert Path(result.reproducer.model).is_file()


@pytest.mark.slow  # ~25-35 s: two unscheduled ResNet-50 builds and runs; --models-full (nightly)
@pytest.mark.models_full
def test_resnet50_one_conv_group_with_dropped_bias(tmp_path: Path) -> None:
    model = get_model("resnet50").make({}, seed=0)
    shapes = {i.name: tuple(i.dims) for i in model.graph.initializer}
    conv = [n for n in model.graph.node if n.op_type == "Conv" and shapes.get(n.input[1]) == (256, 512, 1, 1)]
    assert len(conv) == 1  # layer3's first 1x1 reduction: one group among ~50 conv groups

    def select(call: relax.Call) -> bool:
        w = call.args[1]
        return isinstance(w, tvm.ir.Constant) and tuple(w.value.numpy().shape) == (256, 512, 1, 1)

    perturb = Perturb("conv_drop_bias", "conv2d_bias_act", drop_bias, select)
    options = CompileOptions(schedule=False, extra_passes=(("after_fusion", perturb),))
    result = bisect_model(model, options=options, out_dir=tmp_path)
    c = result.culprit
    assert c is not None and c.blame == BLAME_FUSION, result.summary()
    assert c.pattern == "conv2d_bias_act" and c.function == perturb.functions[0]
    assert conv[0].name in c.onnx_nodes and len(c.onnx_nodes) == 3  # Conv, BatchNormalization, Relu
    assert c.inputs_agree is True and not result.unmapped
    assert result.reproducer is not None and result.reproducer.confirmed is True


# ----------------------------------------------------------------------------- import/lowering bugs


def _softmax_wrong_axis_everywhere(mod: tvm.IRModule) -> tvm.IRModule:
    """A lowering bug: every build, fused or not, gets the softmax over the wrong axis."""
    mutator = _Mutator(mod, softmax_wrong_axis)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get()


@pytest.mark.parametrize("strategy", ["capture", "onnx-order"])
def test_lowering_bug_is_blamed_on_import_lowering(tmp_path: Path, strategy: str) -> None:
    model = get_model("softmax_layernorm").make({"seq": 8}, seed=0)
    options = CompileOptions(schedule=False, extra_passes=(("before_fusion", _softmax_wrong_axis_everywhere),))
    result = bisect_model(model, options=options, out_dir=tmp_path, strategy=strategy)
    c = result.culprit
    assert c is not None and c.blame == BLAME_LOWERING, result.summary()
    assert [_node_types(model)[n] for n in c.onnx_nodes] == ["Softmax"]
    assert c.via == ("kernel capture" if strategy == "capture" else "ONNX-order bisection")
    assert result.unfused_vs_reference is not None and not result.unfused_vs_reference
    if strategy == "onnx-order":  # log2(N) prefix builds on top of the two full ones
        assert result.builds <= 2 + math.ceil(math.log2(len(model.graph.node))) + 1 + 2
    assert result.reproducer is not None and result.reproducer.confirmed is True


def test_unbuildable_commit_exits_125(tmp_path: Path) -> None:
    def broken(mod: tvm.IRModule) -> tvm.IRModule:
        raise RuntimeError("this commit's pass crashes")

    model = get_model("softmax_layernorm").make({"seq": 8}, seed=0)
    result = bisect_model(model, options=CompileOptions(schedule=False, extra_passes=(("after_fusion", broken),)),
                          out_dir=tmp_path)
    assert result.status == "untestable" and result.exit_code == EXIT_UNTESTABLE and "crashes" in result.error


def test_cli_exit_codes(tmp_path: Path) -> None:
    import argparse

    from fuseguard.verify.debug.bisect import add_bisect_parser, run_bisect

    path = tmp_path / "m.onnx"
    onnx.save(get_model("softmax_layernorm").make({"seq": 8}, seed=0), str(path))
    parser = argparse.ArgumentParser()
    add_bisect_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bisect", str(path), "--no-schedule", "--out", str(tmp_path / "out"),
                              "--json", str(tmp_path / "r.json")])
    assert run_bisect(args) == EXIT_NO_DRIFT
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "no-drift"
