"""The layout step (compiler/passes/layout.py): blocked convs right at tile edges, the layout propagated, a switch.

Each case is a conv (+ bias + activation) compiled with the layout step on and off and compared with ONNX
Runtime; the blocked build must take the blocked rule it was written for, so a case that silently stays NCHW
fails too."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from fuseguard.compiler.passes import layout
from fuseguard.compiler.hw.hostcpu import detect_host
from fuseguard.compiler.frontend.loader import load
from fuseguard.compiler.pipeline import CompileOptions, compile_model

RTOL, ATOL = 1e-4, 1e-4


@pytest.fixture
def always_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """These single-conv models are too small for their edge transforms to pay (test_small_models_keep_nchw):
    block them anyway, to test the kernels."""
    monkeypatch.setattr(layout, "MIN_MACS_PER_MOVED", 0)


def _conv_model(c_in: int, c_out: int, hw: int, k: int, stride: int = 1, groups: int = 1, dilation: int = 1,
                act: str = "Relu", second: int | None = None) -> onnx.ModelProto:
    """Conv(+bias) -> act (Relu, or Clip = ReLU6), optionally followed by a 1x1 conv to `second` channels
    and a residual-free max pool, so the layout has something to propagate through."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((c_out, c_in // groups, k, k)) * 0.2).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(c_out).astype(np.float32), "b")]
    pad = dilation * (k // 2)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[pad] * 4, strides=[stride] * 2,
                              kernel_shape=[k, k], group=groups, dilations=[dilation] * 2)]
    if act == "Clip":
        inits += [numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
                  numpy_helper.from_array(np.array(6.0, np.float32), "hi")]
        nodes.append(helper.make_node("Clip", ["y", "lo", "hi"], ["z"]))
    else:
        nodes.append(helper.make_node(act, ["y"], ["z"]))
    out, c = "z", c_out
    ho = (hw + 2 * pad - dilation * (k - 1) - 1) // stride + 1
    if second is not None:
        inits.append(numpy_helper.from_array((rng.standard_normal((second, c_out, 1, 1)) * 0.2).astype(np.float32), "w2"))
        nodes += [helper.make_node("Conv", ["z", "w2"], ["z2"]),
                  helper.make_node("MaxPool", ["z2"], ["p"], kernel_shape=[2, 2], strides=[2, 2])]
        out, c, ho = "p", second, ho // 2
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c_in, hw, hw])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, c, ho, ho])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _build_and_check(model: onnx.ModelProto, c_in: int, hw: int, *, layout_on: bool = True,  # noqa: ANN202
                     mcpu: str | None = None):
    x = np.random.default_rng(1).standard_normal((1, c_in, hw, hw)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    built = compile_model(load(model, None, name="conv"), options=CompileOptions(layout=layout_on, mcpu=mcpu))
    np.testing.assert_allclose(built.run({"x": x})[0], ref, rtol=RTOL, atol=ATOL)
    return built


@pytest.mark.parametrize("case, rule", [
    (dict(c_in=32, c_out=64, hw=14, k=3), "conv2d-NCHWc"),
    (dict(c_in=32, c_out=48, hw=13, k=3, stride=2), "conv2d-NCHWc"),          # odd plane, stride 2, 3 blocks
    (dict(c_in=16, c_out=32, hw=11, k=1), "conv2d-NCHWc"),                    # 1x1 on a prime width
    (dict(c_in=32, c_out=32, hw=15, k=3, dilation=2), "conv2d-NCHWc"),
    (dict(c_in=3, c_out=32, hw=17, k=3, stride=2), "conv2d-NCHWc"),           # the first conv: NCHW in
    (dict(c_in=48, c_out=48, hw=7, k=3, groups=48), "depthwise-conv2d-NCHWc"),
    (dict(c_in=32, c_out=32, hw=9, k=5, stride=2, groups=32, act="Sigmoid"), "depthwise-conv2d-NCHWc"),
    (dict(c_in=64, c_out=64, hw=13, k=3, groups=4), "conv2d-NCHWc"),     # grouped, 16 a group (RegNetX)
    (dict(c_in=64, c_out=128, hw=9, k=3, stride=2, groups=2), "conv2d-NCHWc"),   # grouped, blocks a group
    # weights of a tile past half of L1: input-channel blocks, each reused by a few rows (one a row at 15)
    (dict(c_in=128, c_out=64, hw=29, k=3, stride=2), "conv2d-NCHWc"),
    # a 3.2 MiB input (past half of L2): a block of channel tiles shares each input row
    (dict(c_in=256, c_out=64, hw=56, k=1), "conv2d-NCHWc"),
])
def test_blocked_convs_are_right_and_take_their_rule(case: dict, rule: str, always_block: None) -> None:
    built = _build_and_check(_conv_model(**case), case["c_in"], case["hw"])
    assert rule in built.report.schedules.values(), built.report.schedules
    assert built.report.layout.startswith("layout: NCHW16c for 1 of 1 convs") or \
        built.report.layout.startswith("layout: NCHW8c for 1 of 1 convs"), built.report.layout


@pytest.mark.parametrize("case", [
    dict(c_in=20, c_out=36, hw=14, k=3),            # channels no block (16 or 8) divides
    dict(c_in=24, c_out=48, hw=14, k=3, groups=2),  # grouped, 12 channels a group
])
def test_convs_the_layout_cannot_block_stay_nchw_and_right(case: dict, always_block: None) -> None:
    built = _build_and_check(_conv_model(**case), case["c_in"], case["hw"])
    assert "no conv has channels in whole blocks" in built.report.layout, built.report.layout


@pytest.mark.parametrize("mcpu", [None, "znver3"])
def test_relu6_and_pooling_keep_the_layout_between_convs(mcpu: str | None, always_block: None) -> None:
    """conv -> ReLU6 -> 1x1 conv -> max pool: blocked end to end, transforms only at the two edges (clip has no
    layout rule in TVM; rewritten around ConvertLayout it no longer forces NCHW in between). Also for an AVX2
    target (blocks of 8), whose conv epilogues the pattern check once vetoed, reading 8 lanes as 8 channels."""
    if mcpu and not {"avx2", "fma"} <= detect_host().features:
        pytest.skip(f"{mcpu}'s AVX2 code cannot run on this host")
    model = _conv_model(32, 32, 12, 3, act="Clip", second=32)
    built = _build_and_check(model, 32, 12, mcpu=mcpu)
    assert "2 of 2 convs, 2 layout transforms" in built.report.layout, built.report.layout
    assert "pool-NCHWc" in built.report.schedules.values(), built.report.schedules
    # the conv patterns still see ReLU6 as a clip and fuse it
    assert any(g.pattern == "conv2d_bias_act" and "clip" in g.ops for g in built.report.pattern_groups), \
        [(g.pattern, g.ops) for g in built.report.groups]


def test_the_switch_turns_it_off_and_unfused_builds_follow_the_fused_decision(always_block: None) -> None:
    model = _conv_model(32, 64, 14, 3)
    off = _build_and_check(model, 32, 14, layout_on=False)
    assert off.report.layout == "layout: NCHW (step off)"
    assert "conv2d-NCHWc" not in off.report.schedules.values()
    unfused = compile_model(load(model, None, name="conv"), options=CompileOptions().unfused())
    assert "for 1 of 1 convs" in unfused.report.layout


def test_small_models_keep_nchw_when_the_edge_transforms_cost_more() -> None:
    """One 64-channel conv with NCHW input and output: the two transforms cost more than blocking saves
    (measured 1.23x ORT blocked vs 0.97x NCHW), so the step keeps NCHW and says why -- and hands back the
    module it was given: its ReLU6 still a clip the conv pattern fuses."""
    built = _build_and_check(_conv_model(64, 64, 28, 3, act="Clip"), 64, 28)
    assert built.report.layout.startswith("layout: NCHW (NCHW"), built.report.layout
    assert "conv MACs, under" in built.report.layout
    assert "conv2d-NCHWc" not in built.report.schedules.values()
    assert any("clip" in g.ops for g in built.report.pattern_groups), [(g.pattern, g.ops) for g in built.report.groups]


def test_conv_layout_decisions() -> None:
    from tvm import relax
    from tvm.script import relax as R

    def call(c_in: int, c_out: int, groups: int = 1) -> relax.Call:
        x = relax.Var("x", R.Tensor((1, c_in, 8, 8), "float32"))
        w = relax.Var("w", R.Tensor((c_out, c_in // groups, 3, 3), "float32"))
        return relax.op.nn.conv2d(x, w, groups=groups)

    def normal(c: relax.Call) -> relax.Call:
        bb = relax.BlockBuilder()
        with bb.function("f", list(c.args)):
            out = bb.emit(c)
            bb.emit_func_output(out)
        return bb.get()["f"].body.blocks[0].bindings[0].value

    assert layout.conv_layout(normal(call(32, 64)), 16) == ["NCHW16c", "OIHW16i16o"]
    assert layout.conv_layout(normal(call(3, 64)), 16) == ["NCHW", "OIHW16o", "NCHW16c"]
    assert layout.conv_layout(normal(call(64, 64, 64)), 16) == ["NCHW16c", "OIHW16o"]
    assert layout.conv_layout(normal(call(24, 64)), 16) is None
    assert layout.conv_layout(normal(call(24, 64)), 8) == ["NCHW8c", "OIHW8i8o"]
    assert layout.conv_layout(normal(call(64, 64, 2)), 16) == ["NCHW16c", "OIHW16i16o"]    # 32 a group
    assert layout.conv_layout(normal(call(64, 64, 8)), 16) is None                         # 8 a group
    assert layout.conv_layout(normal(call(64, 64, 8)), 8) == ["NCHW8c", "OIHW8i8o"]


def test_a_layout_failure_keeps_the_model_nchw_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """TVM's ConvertLayout failing on a graph (std::bad_alloc on vit_tiny_dynamo's export) costs the layout
    step, never the build."""
    def broken(mod, block, pad):  # noqa: ANN001, ANN202
        raise RuntimeError("Check failed: something TVM refuses")

    monkeypatch.setattr(layout, "_convert", broken)
    built = _build_and_check(_conv_model(32, 64, 14, 3), 32, 14)
    assert built.report.layout == "layout: NCHW (ConvertLayout failed: Check failed: something TVM refuses)"


def test_rank3_constants_keep_the_layout(always_block: None) -> None:
    """conv -> Mul/Add by [C, 1, 1] constants (a BatchNorm exported as ONNX broadcasting ops, DenseNet's
    pre-activation) -> Relu -> conv: the constants are raised to rank 4 so the layout carries through them
    (left at rank 3, ConvertLayout put a transform on each side: 239 of them in DenseNet-121)."""
    rng = np.random.default_rng(0)
    c = 32
    inits = [numpy_helper.from_array((rng.standard_normal((c, c, 3, 3)) * 0.2).astype(np.float32), "w"),
             numpy_helper.from_array((rng.standard_normal((c, c, 1, 1)) * 0.2).astype(np.float32), "w2"),
             numpy_helper.from_array(rng.standard_normal((c, 1, 1)).astype(np.float32), "s"),
             numpy_helper.from_array(rng.standard_normal((c, 1, 1)).astype(np.float32), "t")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1] * 4, kernel_shape=[3, 3]),
             helper.make_node("Mul", ["y", "s"], ["m"]), helper.make_node("Add", ["m", "t"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Conv", ["r", "w2"], ["z"])]
    graph = helper.make_graph(nodes, "bn_as_ops", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 28, 28])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, c, 28, 28])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    built = _build_and_check(model, c, 28)
    assert "2 of 2 convs, 2 layout transforms" in built.report.layout, built.report.layout


def test_blocked_conv_tiles_are_load_bound_and_may_leave_a_column_tail() -> None:
    """The register tile the blocked kernels take: most useful FMAs per load (MLAS's 4 blocks x 3 columns on
    AVX2), a column tail where no divisor fits (13-wide planes), never a channel-block tail (125 blocks: 5)."""
    from fuseguard.compiler.hw.hostcpu import HostCPU
    from fuseguard.compiler.schedule.cpu_conv_blocked import BlockedConvInfo, blocked_tiles

    avx2 = HostCPU(mcpu="znver3", cores=2, features=frozenset({"avx2", "fma"}))
    avx512 = HostCPU(mcpu="znver4", cores=2, features=frozenset({"avx512f", "avx2", "fma"}))

    def tiles(host: HostCPU, ow: int, blocks: int, lanes: int, **kw: object) -> tuple[int, int] | None:
        return blocked_tiles(BlockedConvInfo(block=None, depthwise=False, blocks=blocks, ow=ow, lanes=lanes, **kw),
                             host)

    assert tiles(avx2, 56, 8, 8) == (3, 4)          # 56 = 18 x 3 + a 2-column tail
    assert tiles(avx2, 13, 125, 8) == (2, 5)        # SqueezeNet's classifier conv: 1000 channels at 13x13
    assert tiles(avx2, 12, 128, 8) == (3, 4)        # the old rule's 12 x 1 ran 1.5x slower
    assert tiles(avx2, 1, 128, 8)[0] == 1
    assert tiles(avx2, 14, 32, 8, group_blocks=2)[1] in (1, 2)      # a tile stays within its group
    mr, nb = tiles(avx512, 56, 8, 16)
    assert mr * nb <= 24 and 8 % nb == 0
    # two 512-bit loads a cycle (Intel): broadcasts are cheap, the weight vectors streamed from L2 are not, so
    # 7- and 14-wide planes take whole rows of 7 columns x 2 blocks (4 x 4 with a tail ran 1.2-1.5x slower)
    spr = HostCPU(mcpu="sapphirerapids", cores=2, features=frozenset({"avx512f", "avx2", "fma"}))
    assert spr.vector_loads_per_cycle == 2 and avx512.vector_loads_per_cycle == 1
    assert tiles(spr, 7, 32, 16) == (7, 2) and tiles(spr, 14, 16, 16) == (7, 2)
    assert tiles(spr, 56, 4, 16) == (4, 4)
    depthwise = blocked_tiles(BlockedConvInfo(block=None, depthwise=True, blocks=12, ow=13, lanes=8), avx2)
    assert depthwise is not None and depthwise[1] == 1
    # the first conv's NCHW input: no column tail (ResNet's 7x7 stem at 112 columns)
    mr, nb = tiles(avx2, 112, 8, 8, nchw_in=True)
    assert 112 % mr == 0 and mr * nb == 8


def test_blocked_conv_weights_stay_in_l1_and_a_big_input_is_read_once() -> None:
    """A tile's weights past half of L1 are split into input-channel blocks reused by every column tile of a few
    rows; an input past half of L2 is read once by a block of channel tiles (ResNet-50 0.95x of its time, SPR)."""
    from fuseguard.compiler.hw.hostcpu import HostCPU
    from fuseguard.compiler.schedule.cpu_conv_blocked import BlockedConvInfo, channel_tile_block, reduction_blocking

    spr = HostCPU(mcpu="sapphirerapids", cores=2, features=frozenset({"avx512f", "avx2", "fma"}),
                  l1d_bytes=48 << 10, l2_bytes=2 << 20)
    # 1x1 512 -> 128 at 28x28, 4 blocks a tile: 4 KiB of weights an input block, 4 blocks (16 KiB) at a time,
    # reused over 2 rows of 28 columns (7 KiB of accumulators a row)
    assert reduction_blocking(32, 1, 16, 4, 4, 16, 28, 28, spr) == (4, 2)
    # 3x3 64 -> 64 at 56x56: one input block's weights (36 KiB) is the least there is; one 56-wide row
    assert reduction_blocking(4, 9, 16, 4, 4, 16, 56, 56, spr) == (1, 1)
    # 7x7 plane: the whole plane reuses each weight block
    assert reduction_blocking(32, 9, 16, 7, 2, 16, 7, 7, spr)[1] == 7
    # the tile's weights fit already (64 -> 256 1x1, 2 blocks: 8 KiB): nothing to split
    assert reduction_blocking(4, 1, 16, 4, 2, 16, 56, 56, spr) is None
    assert reduction_blocking(32, 1, 16, 4, 4, 16, 28, 28, HostCPU(mcpu="x", cores=2, features=frozenset())) is None
    # a tile with a column tail keeps its whole reduction: AVX2's 3 columns on a 56-wide row (1.3-1.5x slower)
    assert reduction_blocking(8, 9, 8, 3, 4, 8, 56, 56, spr) is None

    def info(in_bytes: int, blocks: int) -> BlockedConvInfo:
        return BlockedConvInfo(block=None, depthwise=False, blocks=blocks, ow=56, lanes=16, in_bytes=in_bytes)
    # 256 -> 128 1x1 at 56x56: a 3.2 MiB input, 2 tiles of 4 blocks (64 KiB of weights each) share it
    assert channel_tile_block(info(256 * 56 * 56 * 4, 8), 4, 128 * 256 * 4, spr) == 2
    assert channel_tile_block(info(64 * 56 * 56 * 4, 16), 4, 256 * 64 * 4, spr) is None    # 0.8 MiB stays in L2
    # 2048 -> 512 weights (4 MiB): a block of tiles within 1 MiB of weights, here 4 tiles of 2 blocks
    assert channel_tile_block(info(2048 * 14 * 14 * 4, 32), 2, 512 * 2048 * 4, spr) == 4


def test_a_depthwise_epilogue_runs_on_the_finished_row(always_block: None) -> None:
    """The blocked depthwise conv's epilogue sits under the row loop, beside the column tiles: inside them, a
    SiLU's constants and the taps' hoisted weights spilled, and the fused kernel ran 1.04-1.23x slower than
    the conv and its SiLU as separate kernels (5x5 taps, Zen3; `benchmarks/conv_kernels.py --unfused`)."""
    import tvm_ffi
    from tvm import s_tir

    case = dict(c_in=32, c_out=32, hw=12, k=5, groups=32, act="Sigmoid")
    built = _build_and_check(_conv_model(**case), 32, 12)
    (name,) = [k for k, rule in built.report.schedules.items() if rule == "depthwise-conv2d-NCHWc"]
    sch = s_tir.Schedule(built.lowered[name])
    blocks: list[str] = []
    tvm_ffi.structural_walk(sch.mod["main"], (s_tir.SBlockRealize, lambda r: blocks.append(r.block.name_hint)),
                            order="post")

    def loops(pick) -> list[object]:  # noqa: ANN001
        return [sch.get(lp) for lp in sch.get_loops(sch.get_sblock(next(b for b in blocks if pick(b))))]

    # post order: pad, init, update, the epilogue, root
    conv, epilogue = loops(lambda b: b.endswith("_update")), loops(lambda b: b == blocks[-2])
    shared = [a for a, b in zip(conv, epilogue) if a.same_as(b)]
    names = [str(lp.loop_var) for lp in shared]
    assert shared and not any(n.startswith("x") for n in names), names      # batch, block and row loops only


def test_elementwise_ops_between_conv1ds_keep_the_blocked_layout(always_block: None) -> None:
    """conv1d -> GELU (erf form) -> conv1d, as audio front ends are exported: the GELU stays on the height-1
    conv's 4-D output, so the layout passes from one conv to the next (the squeeze and expand_dims between
    them put a transform on each side of every conv: Wav2Vec2's feature extractor had 15)."""
    rng = np.random.default_rng(0)
    c, width = 16, 41
    inits = [numpy_helper.from_array((rng.standard_normal((c, c, 3)) * 0.2).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.standard_normal((c, c, 3)) * 0.2).astype(np.float32), "w2")]
    consts = [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(np.array(v, np.float32), n))
              for n, v in (("r2", 1.4142135), ("one", 1.0), ("half", 0.5))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["y"], kernel_shape=[3], strides=[2]), *consts,
             helper.make_node("Div", ["y", "r2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["p"]), helper.make_node("Mul", ["y", "p"], ["q"]),
             helper.make_node("Mul", ["q", "half"], ["g"]), helper.make_node("Conv", ["g", "w2"], ["z"], kernel_shape=[3])]
    out_w = (width - 3) // 2 + 1 - 2
    graph = helper.make_graph(nodes, "conv1d", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, width])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, c, out_w])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((1, c, width)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for fusion in (True, False):
        built = compile_model(load(model, None, name="conv1d"), options=CompileOptions(fusion=fusion))
        np.testing.assert_allclose(built.run({"x": x})[0], ref, rtol=RTOL, atol=ATOL)
        assert "2 of 2 convs, 2 layout transforms" in built.report.layout, built.report.layout


def _one_conv(shape: list[int], weight: np.ndarray, bias: np.ndarray | None, relu: bool,
              **attrs) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """One ONNX Conv (+ bias, + Relu) on `shape`, a seeded input, and ONNX Runtime's result for it."""
    inits = [numpy_helper.from_array(weight, "w")] + ([numpy_helper.from_array(bias, "b")] if bias is not None else [])
    nodes = [helper.make_node("Conv", ["x", "w", "b"][:len(inits) + 1], ["c" if relu else "y"], **attrs)]
    nodes += [helper.make_node("Relu", ["c"], ["y"])] if relu else []
    graph = helper.make_graph(nodes, "one_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    return model, x, ref


@pytest.mark.parametrize("k, strides, pads, dilations, groups", [
    ((3, 3, 3), (1, 1, 1), (1, 1, 1, 1, 1, 1), (1, 1, 1), 1),       # R3D's 3x3x3 block conv
    ((3, 7, 7), (1, 2, 2), (1, 3, 3, 1, 3, 3), (1, 1, 1), 1),       # its stem
    ((1, 1, 1), (2, 2, 2), (0, 0, 0, 0, 0, 0), (1, 1, 1), 1),       # the strided 1x1x1 downsample
    ((3, 3, 3), (2, 1, 1), (2, 1, 1, 0, 1, 1), (2, 1, 1), 2),       # temporal stride, dilation, asymmetric pad, groups
], ids=["block", "stem", "downsample", "dilated_grouped"])
def test_conv3d_runs_as_conv2d_taps_on_the_conv_kernels(k, strides, pads, dilations, groups) -> None:
    """conv3d (no CPU rule schedules it: R3D-18 ran minutes a batch) as one conv2d per temporal tap over the
    frames, summed: ONNX Runtime's result, fused and unfused, and every tap is a blocked conv."""
    rng = np.random.default_rng(0)
    cin, cout = 8, 16
    w = (rng.standard_normal((cout, cin // groups, *k)) * 0.2).astype(np.float32)
    bias = rng.standard_normal(cout).astype(np.float32)
    model, x, ref = _one_conv([1, cin, 7, 11, 10], w, bias, True, kernel_shape=list(k), strides=list(strides),
                              pads=list(pads), dilations=list(dilations), group=groups)
    for fusion in (True, False):
        built = compile_model(load(model, None, name="video"), options=CompileOptions(fusion=fusion))
        np.testing.assert_allclose(built.run({"x": x})[0], ref, rtol=RTOL, atol=ATOL)
        assert "conv3d" not in str(built.report.to_dict())
        if groups == 1:             # 4 channels a group are no whole block of 16: that one stays NCHW
            assert f"{k[0]} of {k[0]} convs" in built.report.layout, built.report.layout


@pytest.mark.parametrize("dilation, pads, strides, kernel", [
    ((24, 24), (24, 24, 24, 24), (1, 1), (1, 1)),       # DeepLabV3's ASPP at rate 24 on 14x14: only the centre
    ((36, 12), (36, 12, 36, 12), (1, 1), (1, 3)),       # rows cut, columns partly live: a 1x3 kernel is left
    ((12, 12), (12, 12, 12, 12), (1, 1), (3, 3)),       # every tap reads the input somewhere: unchanged
    ((1, 1), (5, 5, 5, 5), (2, 2), (3, 3)),             # no dilation, padding that every tap still reaches
    ((20, 20), (20, 20, 20, 20), (2, 2), (1, 1)),       # strided
], ids=["aspp24", "rows_only", "aspp12", "plain", "strided"])
def test_kernel_taps_that_only_read_padding_are_cut_off(dilation, pads, strides, kernel) -> None:
    """DropPaddingTaps: a 3x3 conv whose off-centre taps land in the zero padding for every output computes
    what its live taps compute; the result is ONNX Runtime's, fused and unfused, and the kernel left is the
    live taps only."""
    from fuseguard.compiler.frontend.importer import import_model
    from fuseguard.compiler.passes.normalize import DropPaddingTaps
    from fuseguard.compiler.ir.helpers import static_dims

    w = (np.random.default_rng(0).standard_normal((16, 16, 3, 3)) * 0.2).astype(np.float32)
    model, x, ref = _one_conv([1, 16, 14, 14], w, None, False, kernel_shape=[3, 3], strides=list(strides),
                              pads=list(pads), dilations=list(dilation))
    for fusion in (True, False):
        built = compile_model(load(model, None, name="aspp"), options=CompileOptions(fusion=fusion))
        np.testing.assert_allclose(built.run({"x": x})[0], ref, rtol=RTOL, atol=ATOL)
    convs: list[tuple[int, ...]] = []

    def visit(e) -> None:
        if isinstance(e, tvm.relax.Call) and getattr(e.op, "name", "") == "relax.nn.conv2d":
            convs.append(tuple(static_dims(e.args[1])))

    mod = DropPaddingTaps(import_model(load(model, None, name="aspp")).mod)
    tvm.relax.analysis.post_order_visit(mod["main"].body, visit)
    assert set(convs) == {(16, 16, *kernel)}
