"""A concat whose inputs' kernels write the output in place (compiler/passes/concat_in_place.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuseguard.compiler.passes.concat_in_place import concat_axis
from fuseguard.compiler.frontend.loader import load
from fuseguard.compiler.pipeline import CompileOptions, compile_model
from fuseguard.verify.check.reference import run_onnxruntime
from fuseguard.verify.check.inputs import make_inputs


def _fire(*, batch: int = 1, channels: tuple[int, int] = (32, 32), hw: int = 14, axis: int = 1,
          concat_input: bool = False, reuse: bool = False, fires: int = 2) -> onnx.ModelProto:
    """SqueezeNet's start: a stem conv, then fire modules (a 1x1 squeeze conv, a 1x1 and a 3x3 expand conv and
    their concat), a conv after. `concat_input`: the graph input is concatenated too; `reuse`: an expand
    output is read again after the last concat."""
    rng = np.random.default_rng(0)
    inits: list = []

    def conv(name: str, x: str, cin: int, cout: int, k: int) -> list:
        w = numpy_helper.from_array((rng.standard_normal((cout, cin, k, k)) * 0.2).astype(np.float32), f"{name}_w")
        b = numpy_helper.from_array(rng.standard_normal(cout).astype(np.float32), f"{name}_b")
        inits.extend([w, b])
        return [helper.make_node("Conv", [x, w.name, b.name], [f"{name}_c"], kernel_shape=[k, k], pads=[k // 2] * 4),
                helper.make_node("Relu", [f"{name}_c"], [name])]

    cin, total = 16, sum(channels)
    nodes, x, c = conv("stem", "x", cin, total, 3), "stem", total
    for f in range(fires):
        nodes += conv(f"s{f}", x, c, 8, 1) + conv(f"e1_{f}", f"s{f}", 8, channels[0], 1) + \
            conv(f"e3_{f}", f"s{f}", 8, channels[1], 3)
        parts = [f"e1_{f}", f"e3_{f}"] + (["x"] if concat_input and f == 0 else [])
        nodes.append(helper.make_node("Concat", parts, [f"cat{f}"], axis=axis))
        x, c = f"cat{f}", total + (cin if concat_input and f == 0 else 0)
        if axis != 1:
            break
    if axis == 1:
        nodes += conv("after", x, c, 16, 1)
        out_shape = [batch, 16, hw, hw]
    else:           # rows: two 32-channel planes stacked, then a conv
        nodes += conv("after", x, channels[0], 16, 1)
        out_shape = [batch, 16, 2 * hw, hw]
    outputs = [helper.make_tensor_value_info("after", TensorProto.FLOAT, out_shape)]
    if reuse:
        nodes.append(helper.make_node("Neg", ["e1_0"], ["e1_again"]))
        outputs.append(helper.make_tensor_value_info("e1_again", TensorProto.FLOAT, [batch, channels[0], hw, hw]))
    graph = helper.make_graph(nodes, "fire", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                           [batch, cin, hw, hw])], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _build_and_check(model: onnx.ModelProto, **opts):  # noqa: ANN202
    build = compile_model(model, options=CompileOptions(**opts))
    loaded = load(model)
    inputs = make_inputs(loaded.model, loaded.input_shapes, seed=1)
    for got, want in zip(build.run(inputs), run_onnxruntime(loaded.model, inputs).values()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    return build


def test_contiguous_slices_are_recognised() -> None:
    assert concat_axis([[1, 4, 5, 5, 16], [1, 2, 5, 5, 16]], [1, 6, 5, 5, 16]) == 1     # NCHW16c, batch 1
    assert concat_axis([[1, 3, 7], [1, 5, 7]], [1, 8, 7]) == 1
    assert concat_axis([[2, 3, 7], [2, 5, 7]], [2, 8, 7]) is None      # batch 2: each input is two slices
    assert concat_axis([[1, 3, 2, 7], [1, 3, 4, 7]], [1, 3, 6, 7]) is None     # a non-unit dim before the axis
    assert concat_axis([[1, 3, 7], [1, 5, 7]], [1, 9, 7]) is None      # not the inputs' sum
    assert concat_axis([[1, 3, 7]], [1, 3, 7]) is None                 # one input: nothing to place


@pytest.mark.parametrize("fusion", [True, False])
@pytest.mark.parametrize("layout", [True, False], ids=["blocked", "nchw"])
def test_fire_module_concats_are_written_in_place_and_right(fusion: bool, layout: bool) -> None:
    """Both builds, NCHW and NCHW16c (32 channels: whole blocks, 64-byte aligned slices): the concat kernels
    are gone (the fused build's both; the unfused plan has a free storage for one), the plan needs no more
    memory than with the copies, and the outputs are ONNX Runtime's."""
    on = _build_and_check(_fire(), fusion=fusion, layout=layout)
    off = _build_and_check(_fire(), fusion=fusion, layout=layout, concat_in_place=False)
    moved = int(on.report.memory.split()[1]) if on.report.memory.startswith("memory: ") else 0
    assert moved == (2 if fusion else 1), on.report.memory
    assert not off.report.memory
    assert on.report.kernels == off.report.kernels - moved
    concats = [site for site in on.report.call_sites if site["kernel"].startswith("concatenate")]
    assert len(concats) == 2 - moved
    assert on.report.planned_bytes <= off.report.planned_bytes
    assert on.report.traffic_bytes < off.report.traffic_bytes      # the copies' reads and writes are gone


@pytest.mark.parametrize("case", [
    dict(batch=2),                      # each input two slices of the output
    dict(axis=2),                       # rows, with 32 channels before them
    dict(concat_input=True),            # the graph input: no kernel writes it
    dict(channels=(3, 5), hw=5),        # NCHW, a 3x5x5 slice: 300 bytes, off the 64-byte alignment
])
def test_a_concat_that_cannot_be_placed_keeps_its_copy(case: dict) -> None:
    build = _build_and_check(_fire(fires=1, **case), layout=False)
    assert not build.report.memory, build.report.memory
    assert any(site["kernel"].startswith("concatenate") for site in build.report.call_sites)


def test_an_input_read_again_after_the_concat_is_still_right() -> None:
    """The expand output lives on in the concat's storage; a later reader sees the same values."""
    build = _build_and_check(_fire(reuse=True), layout=False)
    assert build.report.memory.startswith("memory: 2 concatenation"), build.report.memory


@pytest.mark.parametrize("fires", [2, 3])
def test_the_call_sites_line_up_when_only_some_concats_are_placed(fires: int) -> None:
    """The unfused build places some of its fire modules' concats (one kernel, same shapes): the report's call
    sites must lose the placed calls' sites, not the first of the kernel's, or the per-kernel profile ties a
    kernel's time to another call (on ShuffleNet-V2's unfused build it raised)."""
    import tvm
    from tvm import relax

    build = _build_and_check(_fire(fires=fires), fusion=False, layout=False)
    moved = int(build.report.memory.split()[1])
    assert 0 < moved < fires, build.report.memory
    calls: list[str] = []

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.GlobalVar) \
                and isinstance(build.lowered[expr.op], tvm.tirx.PrimFunc):
            calls.append(expr.op.name_hint)

    relax.analysis.post_order_visit(build.lowered["main"].body, visit)
    assert [site["kernel"] for site in build.report.call_sites] == calls


def test_a_dropped_call_takes_its_own_site_not_the_first_of_its_kernel() -> None:
    """ShuffleNet-V2's unfused build keeps a concat and places a later one of the same kernel: removed by
    position among the kernel's sites, the kept call's site went, and the profile raised (or tied a time to
    the wrong call)."""
    from fuseguard.compiler.fusion.report import without_calls

    sites = [{"kernel": "concatenate", "var": "cat_kept"}, {"kernel": "conv2d", "var": "c"},
             {"kernel": "concatenate", "var": "cat_placed"}, {"kernel": "concatenate", "var": "cat_other"}]
    left = without_calls(sites, [("concatenate", frozenset({"alloc7", "cat_placed"}))])
    assert [s["var"] for s in left] == ["cat_kept", "c", "cat_other"]


def test_a_failing_step_is_a_one_line_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module the step misreads fails that model's build as a CompileError naming the stage, as a TVM pass
    failing does, not with a bare traceback."""
    from fuseguard.compiler.passes import concat_in_place as step
    from fuseguard.compiler.errors import CompileError

    def broken(mod):  # noqa: ANN001, ANN202 - stands in for the step
        raise ValueError("an unexpected binding")

    monkeypatch.setattr(step, "concat_in_place", broken)
    with pytest.raises(CompileError, match="fire: stage 'concat_in_place' failed .*an unexpected binding") as info:
        compile_model(_fire(), options=CompileOptions(layout=False))
    assert "\n" not in str(info.value)
