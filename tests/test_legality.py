"""Fusion legality: every fused group is convex, on the pre-LN reproducer and on random DAGs.

The property tests draw DAGs over the pattern ops (suites/dags.py): a few hundred are lowered fused and
checked well-formed at the IR level (a non-convex group leaves a call consuming its own output, which
well_formed rejects), and a few dozen are compiled fused and unfused and compared with ONNX Runtime.
"""

from __future__ import annotations

import os

import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from tvm import relax

from fuseguard.compiler.frontend.importer import import_model
from fuseguard.compiler.fusion.legality import convexity_violation
from fuseguard.compiler.frontend.loader import load
from fuseguard.compiler.pipeline import CompileOptions, compile_model, lower
from fuseguard.compiler.hw.target import resolve
from fuseguard.suites.dags import Recipe, build_dag
from fuseguard.suites.strategies import dag_recipes
from fuseguard.verify.check.model import verify_model

#: e = x + pos; y = LayerNorm(e); z = e + f(y); LayerNorm(z): the pre-LN transformer block that broke
#: every fused vit_b_16 / GPT-2 / Whisper / Wav2Vec2 build ("Var n71_Add is not defined").
PRE_LN = Recipe("seq", (("add_const", (0,)), ("layernorm", (1,)), ("matmul", (2,)), ("add", (1, 3)),
                        ("layernorm", (4,))))


def _lowered(model: onnx.ModelProto, options: CompileOptions = CompileOptions(schedule=False)):
    imported = import_model(load(model, name="dag"))
    return lower(imported.mod, resolve(None, None), options, name="dag")


def test_pre_ln_block_builds_fused_and_matches() -> None:
    verdict = verify_model(build_dag(PRE_LN), name="pre_ln")
    assert verdict.status == "PASS", (verdict.fused.error, verdict.fused.compare)
    assert verdict.fused.pattern_groups >= 1
    reasons = [d.reason for d in verdict.fused.report.decisions]
    assert any("not convex" in r for r in reasons), reasons


def test_convexity_violation_names_the_cycle() -> None:
    imported = import_model(load(build_dag(PRE_LN), name="pre_ln"))
    func = imported.mod["main"]
    bindings = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    by_op: dict[str, list[relax.Var]] = {}
    for var, value in bindings.items():
        by_op.setdefault(var.name.split("_", 1)[-1], []).append(var)
    # uses: var -> vars whose value reads it
    uses: dict[relax.Var, list[relax.Var]] = {}
    for var, value in bindings.items():
        relax.analysis.post_order_visit(value, lambda e, var=var: uses.setdefault(e, []).append(var)
                                        if isinstance(e, relax.Var) else None)
    first_add = by_op["Add"][0]
    residual_add = by_op["Add"][1]
    second_ln = [v for v, value in bindings.items() if "LayerNormalization" in v.name
                 and isinstance(value, relax.Call)][-1]
    group = {v: bindings[v] for v in (first_add, residual_add, second_ln)}
    why = convexity_violation(group, uses)
    assert why is not None and "not convex" in why and first_add.name in why, why
    legal = {v: bindings[v] for v in (residual_add, second_ln)}
    assert convexity_violation(legal, uses) is None


#: The default run draws the same examples every time (a red CI blocks landing); FUSEGUARD_DAG_EXPLORE=1
#: (the nightly workflow) draws new ones and FUSEGUARD_DAG_EXAMPLES raises the count. Every failure found
#: so far is a regression test below. 100 by default: 200 took 78 s of the default run, which is held to ~30
#: minutes on CI's 2 cores (34 min on a slow Zen3 VM); the nightly draws 1000.
_CI = not os.environ.get("FUSEGUARD_DAG_EXPLORE")
_EXAMPLES = int(os.environ.get("FUSEGUARD_DAG_EXAMPLES", "100"))


@settings(max_examples=_EXAMPLES, deadline=None, derandomize=_CI, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=dag_recipes(max_steps=8))
def test_random_dags_lower_to_well_formed_ir(recipe: Recipe) -> None:
    lowered, report = _lowered(build_dag(recipe))
    # TVM 0.27's well_formed raises on an ill-formed module (e.g. a DataflowVar used outside its block,
    # what a non-convex group leaves behind) and returns None or True otherwise.
    assert relax.analysis.well_formed(lowered) is not False, recipe
    for decision in report.decisions:
        if decision.fused:
            assert "not convex" not in decision.reason


@settings(max_examples=max(25, _EXAMPLES // 8), deadline=None, derandomize=_CI,
          suppress_health_check=[HealthCheck.too_slow])
@given(recipe=dag_recipes(max_steps=6))
def test_random_dags_fused_match_unfused_and_ort(recipe: Recipe) -> None:
    verdict = verify_model(build_dag(recipe), name="dag")
    assert verdict.status == "PASS", (recipe, verdict.fused.error, verdict.unfused.error,
                                      verdict.fused.compare and verdict.fused.compare.summary())


def test_recipe_validation() -> None:
    with pytest.raises(ValueError, match="operands"):
        Recipe("seq", (("add", (0, 1)),))
    with pytest.raises(ValueError, match="family"):
        Recipe("nope", ())
    with pytest.raises(ValueError, match="not in the image family"):
        Recipe("image", (("softmax", (0,)),))


def test_inference_dropout_is_removed_at_import() -> None:
    """AlexNet's classifier: MatMul + Add + ReLU + Dropout. Dropout kept as an op sat in the fused group as a
    second output and the matmul fell to a generic schedule (fused 12x slower than unfused)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.random.default_rng(0).normal(size=(32, 32)).astype(np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["a"]), helper.make_node("Relu", ["a"], ["r"]),
         helper.make_node("Dropout", ["r"], ["y", "mask"])], "dropout",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 32]),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, [4, 32])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    imported = import_model(load(model, name="dropout"))
    assert "dropout" not in str(imported.mod["main"])
    verdict = verify_model(model, name="dropout")
    assert verdict.status == "PASS"
    mask = verdict.fused.compare["mask"]
    assert mask.dtype == "bool" and mask.passed


def test_two_convex_matches_that_depend_on_each_other_are_split() -> None:
    """Found by the DAG property test in CI: each LayerNorm match is convex, but together each group needs
    the other's output (FuseOpsByPattern: "cyclic dependency detected between the groups")."""
    recipe = Recipe("seq", (("add_const", (0,)), ("add_const", (1,)), ("add", (2, 2)), ("layernorm", (2,)),
                            ("layernorm", (3,))))
    verdict = verify_model(build_dag(recipe), name="cycle")
    assert verdict.status == "PASS", verdict.fused.error
    assert any("dependency cycle" in d.reason for d in verdict.fused.report.decisions)


def test_conv_with_a_second_output_is_not_fused() -> None:
    """Found by the DAG property test in CI: the conv output is also read outside its Conv+Clip group; the
    conv schedule tiles one output (and its weight packing broke on the second)."""
    recipe = Recipe("image", (("add_const", (0,)), ("conv", (1,)), ("add_const", (2,)), ("clip", (2,))))
    verdict = verify_model(build_dag(recipe), name="two_outputs")
    assert verdict.status == "PASS", verdict.fused.error
    assert any("second output" in d.reason for d in verdict.fused.report.decisions if not d.fused)
