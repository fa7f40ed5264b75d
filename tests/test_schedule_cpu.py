"""CPU schedules: each kernel family is scheduled by the intended rule and matches ONNX Runtime;
host detection maps canned /proc/cpuinfo texts to the right LLVM CPU; approximation errors stay in
their stated bounds. Speed is measured in benchmarks/schedule_kernels.py, never asserted here."""

from __future__ import annotations

import re
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import scipy.special
import tvm
import tvm_ffi
from tvm import s_tir, tirx

from fuseguard.compiler.hw.hostcpu import (MCPU_ENV, HostCPU, detect_host, host_from_target, host_target,
                                           mcpu_from_cpuinfo)
from fuseguard.compiler.schedule import approx, workloads
from fuseguard.compiler.schedule.cpu import (
    SCHEDULE_ATTR,
    CpuScheduleOptions,
    describe_module,
    schedule_cpu_module,
    schedule_cpu_module_with_report,
)
from fuseguard.compiler.schedule.packing import pack_array, panel_index_map
from fuseguard.compiler.schedule.tir_analysis import calls_in

RTOL = ATOL = 1e-4


@pytest.fixture(scope="module")
def target() -> tvm.target.Target:
    return host_target()


#: The machine the blocking tests decide for, whatever runs them: Zen3 (AVX2, 16 vector registers, L1D
#: 32 KiB, L2 512 KiB), where their cases were measured. Their rules read vector width and cache sizes, so
#: on the host's own facts the same case lands elsewhere (a Zen4's 1 MiB L2 and 16-lane tiles: the
#: 1024 -> 64 1x1 on 14x14 already has its plane as the tile, a 12-channel group fits a 4-wide tile).
#: AVX2 code runs on every CPU class CI lands on.
PINNED_HOST = HostCPU(mcpu="znver3", cores=2, features=frozenset({"avx", "avx2", "fma"}), vendor="AuthenticAMD",
                      model_name="pinned Zen3 profile", family=0x19, model=0x01, l1d_bytes=32 << 10,
                      l2_bytes=512 << 10, l3_bytes=32 << 20)


@pytest.fixture
def pinned_target(monkeypatch: pytest.MonkeyPatch) -> tvm.target.Target:
    """A Zen3 target whose schedules see PINNED_HOST's caches (the host must run AVX2)."""
    import fuseguard.compiler.hw.hostcpu as hostcpu

    if not {"avx2", "fma"} <= detect_host().features:
        pytest.skip("the pinned Zen3 profile's AVX2 code cannot run on this host")
    monkeypatch.setattr(hostcpu, "detect_host", lambda cpuinfo_text=None: PINNED_HOST)
    return tvm.target.Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})


def _ort(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, inputs)[0]


def _check(model: onnx.ModelProto, target: tvm.target.Target, *, fuse: bool = True, options: CpuScheduleOptions | None = None):  # noqa: ANN202
    """Import + fuse + schedule + run; assert match with ORT; return (report, scheduled module)."""
    inputs = workloads.random_inputs(model)
    mod = workloads.import_and_fuse(model, target, fuse=fuse)
    with target:
        sched, report = schedule_cpu_module_with_report(mod, target, options=options or CpuScheduleOptions())
    _, out = workloads.run_vm(sched, target, inputs)
    np.testing.assert_allclose(out, _ort(model, inputs), rtol=RTOL, atol=ATOL)
    return report, sched


# --- kernel families --------------------------------------------------------------------------


def test_matmul_bias_gelu_packed(target: tvm.target.Target) -> None:
    report, mod = _check(workloads.mlp_gelu(64, 96, 256), target)
    assert list(report.scheduled.values()) == ["matmul+packed"]
    assert report.packed_weights
    # The packed weight is now a 3-D panel constant: [N / w, K, w], w a cache line of columns (or the tile's
    # nr = two vectors where that is less: AVX2's 16)
    from fuseguard.compiler.schedule.cpu_matmul import PANEL_BYTES

    shapes = [tuple(int(d) for d in p.shape) for f in mod.functions.values() if isinstance(f, tirx.PrimFunc) for p in f.params]
    w = min(2 * host_from_target(target).fp32_lanes, PANEL_BYTES // 4)
    assert (256 // w, 96, w) in shapes


def test_matmul_without_packing_and_odd_sizes(target: tvm.target.Target) -> None:
    # N = 99 splits into no vector panel: without padding, no packing, unvectorised columns, still exact.
    report, _ = _check(workloads.mlp_gelu(30, 50, 99), target, options=CpuScheduleOptions(pad_weight_columns=False))
    assert list(report.scheduled.values()) == ["matmul"]
    report, _ = _check(workloads.mlp_gelu(64, 96, 256), target, options=CpuScheduleOptions(pack_weights=False))
    assert list(report.scheduled.values()) == ["matmul"] and not report.packed_weights


@pytest.mark.parametrize("n", [99, 344])
def test_a_weight_no_vector_divides_is_padded_to_whole_column_tiles(target: tvm.target.Target, n: int) -> None:
    """N = 344 (LLaMA-tiny's gate and up projections) has 8 columns as its widest dividing tile: the weight
    is zero-padded to whole 2-vector tiles at compile time and packed, every tile vectorised, no copy at run
    time, the padded columns never stored (86 -> 147 GFLOP/s at 64 x 128 x 344, SPR class); the epilogue
    (GELU here) runs over the real columns after the tiles, in whole vectors and a tail."""
    report, mod = _check(workloads.mlp_gelu(30, 50, n), target)
    assert list(report.scheduled.values()) == ["matmul+packed"]
    from fuseguard.compiler.schedule.cpu_matmul import panel_width

    nr = 2 * host_from_target(target).fp32_lanes
    w = panel_width(nr)     # packed in cache-line panels, two to an AVX-512 tile
    func = next(f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc))
    shapes = [tuple(int(d) for d in p.shape) for p in func.params]
    assert (-(-n // nr) * nr // w, 50, w) in shapes, shapes
    script = func.script()
    assert "_pad\"" not in script.replace("matmul_pad", ""), script    # no run-time copy of the weight
    widths = [int(lp.extent) for lp in _loops(func) if lp.kind == tirx.ForKind.VECTORIZED]
    assert min(widths) >= 8 and nr in widths, script


@pytest.mark.parametrize("rows", [197, 11, 13])
def test_a_prime_row_count_keeps_a_full_row_tile(target: tvm.target.Target, rows: int) -> None:
    """197 tokens (ViT) has no divisor for the row tile: the rows are padded to whole tiles (the pad rows
    reading the last real row again) instead of falling to 1-row tiles, and every real row is right."""
    report, mod = _check(workloads.mlp_gelu(rows, 96, 256), target)
    assert list(report.scheduled.values()) == ["matmul+packed"]
    script = next(f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)).script()
    assert f"T.min(v_i0, T.int64({rows - 1}))" in script or f"T.min(v_i1, T.int64({rows - 1}))" in script, script


@pytest.mark.parametrize("shape", [(37, 1, 64), (19, 2, 64)])
def test_a_sequence_first_matmul_tiles_its_tokens(target: tvm.target.Target, shape: tuple[int, ...]) -> None:
    """[tokens, batch, hidden] x [hidden, N] (torchvision's MultiheadAttention in-projection): the output's
    row axis is the batch of 1 or 2, so the tile's rows run over the tokens, which the weight does not
    depend on. Tiled on the 1-row axis, ViT-B/16's in-projection ran 2.9x ORT (0.94x after, Zen3)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((shape[-1], 32)) * 0.1).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"])]
    graph = helper.make_graph(nodes, "seq_first", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [*shape[:-1], 32])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    report, mod = _check(model, target)
    assert list(report.scheduled.values()) == ["matmul+packed"]
    func = next(f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc))
    rows = [int(lp.extent) for lp in _loops(func) if lp.kind == tirx.ForKind.UNROLLED]
    assert rows and max(rows) >= 4, func.script()


def test_an_activation_times_activation_matmul_pads_odd_columns_to_vectors(target: tvm.target.Target) -> None:
    """Q K^T at 37 tokens: N no vector divides, and B is not a weight, so its copy padded to whole column
    tiles costs one pass: the tile is vectorised, not 1-column scalar code (ViT's 197-token scores ran
    6.7x ORT that way, 1.2-1.3x padded; Zen3)."""
    from onnx import TensorProto, helper

    a, b = (3, 21, 16), (3, 16, 37)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "y"], ["z"])], "qk",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, a),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, b)],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, (3, 21, 37))])
    report, mod = _check(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), target)
    assert list(report.scheduled.values()) == ["matmul"]
    func = next(f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc))
    lanes = host_from_target(target).fp32_lanes
    widths = [int(lp.extent) for lp in _loops(func) if lp.kind == tirx.ForKind.VECTORIZED]
    assert widths and max(widths) >= lanes, func.script()


@pytest.mark.parametrize("shape, merged", [((1, 7, 7, 96), "7-row tiles"), ((1, 56, 56, 16), "always"),
                                           ((64, 49, 32), "never")], ids=["nhwc7", "nhwc56", "windows"])
def test_an_activation_batch_the_weight_ignores_is_merged_into_the_rows(target: tvm.target.Target,
                                                                       shape: tuple[int, ...], merged: str) -> None:
    """ConvNeXt's NHWC pointwise MLP ([1, 7, 7, C] x [C, 4C]) tiled rows of 7 under a batch loop the weight does
    not depend on: each weight panel was read once per H (7 x 9.4 MB a call at the last stage). merge_rows makes
    the batch part of the rows where the merged row tile divides one entry's rows (ConvNeXt-T 80.3 -> 60.0 ms,
    Swin-V2-T 79.1 -> 64.7 ms, 2-core Sapphire Rapids). 49-token windows (Swin, MaxViT) keep their batch loop: a
    row tile chosen to divide 49 and merged across windows measured slower (MaxViT 88.7 -> 117.1 ms).
    A 7-row tile needs 32 vector registers (AVX-512): with 16 (AVX2) the 7x7 map keeps its batch loop too. Either
    way the result is ORT's."""
    from onnx import TensorProto, helper, numpy_helper
    from tvm import s_tir

    from fuseguard.compiler.schedule.cpu_matmul import match_matmul, merge_rows
    from fuseguard.compiler.schedule.tir_analysis import root_blocks

    rng = np.random.default_rng(0)
    k, n = shape[-1], 64
    inits = [numpy_helper.from_array((rng.standard_normal((k, n)) * 0.1).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"])]
    graph = helper.make_graph(nodes, "nhwc", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [*shape[:-1], n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    report, _ = _check(model, target)
    assert list(report.scheduled.values()) == ["matmul+packed"]
    mod = workloads.import_and_fuse(model, target)
    func = next(f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc))
    sch = s_tir.Schedule(func)
    info = next(i for i in (match_matmul(sch, b) for b in root_blocks(sch)) if i is not None)
    host = host_from_target(target)
    out = merge_rows(sch, info, host)
    if merged == "always" or (merged == "7-row tiles" and host.vector_registers >= 32):
        assert out.rows_merged and out.m == int(np.prod(shape[:-1])) and not out.batch_iters
    else:
        assert out is info and not out.rows_merged


def _loops(func: tirx.PrimFunc) -> list[tirx.For]:
    found: list[tirx.For] = []
    tvm_ffi.structural_walk(func, (tirx.For, found.append), order="post")
    return found


def test_bert_layer_batched_matmul_softmax_layernorm(target: tvm.target.Target) -> None:
    report, _ = _check(workloads.bert_layer(seq=32, hidden=64, heads=2, ffn=128), target)
    assert not report.left_alone, report.summary()
    rules = list(report.scheduled.values())
    assert rules.count("matmul") >= 2  # Q.K^T and P.V: activations, not packed
    assert "matmul+packed" in rules and "row-reduction+vector" in rules


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(c=16, hw=14, oc=32, k=3),
        dict(c=16, hw=14, oc=32, k=1),
        dict(c=8, hw=15, oc=16, k=3, stride=2),
        dict(c=16, hw=12, oc=16, k=3, group=16),  # depthwise
    ],
    ids=["3x3", "1x1", "stride2", "depthwise"],
)
def test_conv_bn_relu(target: tvm.target.Target, kwargs: dict) -> None:
    report, _ = _check(workloads.conv_bn_relu(**kwargs), target)
    wanted = "depthwise-conv2d" if kwargs.get("group") == kwargs["c"] else "conv2d"
    assert any(r.startswith(wanted) for r in report.scheduled.values()), report.summary()
    assert not report.left_alone


@pytest.mark.parametrize("kwargs", [
    dict(c=32, hw=28, oc=32, k=3, group=32),
    dict(c=96, hw=56, oc=96, k=3, group=96, stride=2),
    dict(c=24, hw=7, oc=24, k=5, group=24),          # 5x5 taps (EfficientNet), a 7-wide row
    dict(c=58, hw=28, oc=58, k=1),                   # ShuffleNet: 58 channels, no 4-multiple divides them
    dict(c=24, hw=28, oc=58, k=1, stride=1),         # ... and its 24 -> 58 branch conv
    dict(c=116, hw=14, oc=116, k=1),                 # a 196-column plane: whole vectors and a tail
])
def test_depthwise_and_odd_channel_convs_are_vectorised_and_right(target: tvm.target.Target, kwargs: dict) -> None:
    report, _ = _check(workloads.conv_bn_relu(**kwargs), target)
    rules = set(report.scheduled.values())
    assert rules & {"depthwise-conv2d", "conv2d-row", "conv2d+packed", "conv2d", "conv2d-1x1", "conv2d-1x1+packed"}, \
        report.summary()
    assert not rules & {"row-reduction", "row-reduction+vector", "reduction"}, report.summary()
    if kwargs["k"] == 1:
        # a 28- or 14-wide row fits no whole vector: the pointwise GEMM over the plane, a tail loop after
        # its last whole vector (the per-plane rule 58 channels took before ran 3.2x ORT, Zen3)
        assert rules & {"conv2d-1x1", "conv2d-1x1+packed"}, report.summary()
    if kwargs.get("group") == kwargs["c"]:
        # the depthwise rule itself, not a fallback after it raised (a swallowed AttributeError once
        # sent every depthwise conv to the dense kernel, 3-7x slower, with every output still right)
        assert "depthwise-conv2d" in rules, report.summary()


def _enclosing_extents(func: tirx.PrimFunc, block_prefix: str) -> list[int]:
    """Extents of the loops around the first block whose name starts with ``block_prefix``, outermost first."""
    found: list[list[int]] = []

    def walk(stmt: object, stack: list[int]) -> None:
        if found:
            return
        if isinstance(stmt, tirx.For):
            walk(stmt.body, stack + [int(stmt.extent)])
        elif isinstance(stmt, tirx.SeqStmt):
            for sub in stmt.seq:
                walk(sub, stack)
        elif isinstance(stmt, s_tir.SBlockRealize):
            if stmt.block.name_hint.startswith(block_prefix):
                found.append(stack)
            else:
                walk(stmt.block.body, stack)
        elif hasattr(stmt, "body"):
            walk(stmt.body, stack)

    walk(func.body, [])
    assert found, f"no block {block_prefix!r}"
    return found[0]


@pytest.mark.parametrize("kwargs, planes", [
    (dict(c=232, hw=14, oc=232, k=3, group=232, stride=2), 2),   # ShuffleNet stage 4: a 1 KiB padded plane
    (dict(c=232, hw=7, oc=232, k=3, group=232), 4),              # a 7x7 plane, 324 bytes padded
    (dict(c=58, hw=56, oc=58, k=3, group=58, stride=2), 1),      # a 13 KiB plane: one a task
])
def test_small_padded_planes_are_written_several_before_the_first_is_convolved(
        target: tvm.target.Target, kwargs: dict, planes: int) -> None:
    """One small plane padded then convolved at once made the conv's loads wait on the padding's stores
    (ShuffleNet's 232-channel 14x14 stride-2 depthwise conv: 160 us, 10.4 with two planes a task)."""
    report, mod = _check(workloads.conv_bn_relu(**kwargs), target)
    assert "depthwise-conv2d" in report.scheduled.values(), report.summary()
    func = next(f for gv, f in mod.functions_items() if report.scheduled.get(gv.name_hint) == "depthwise-conv2d")
    pad, conv = _enclosing_extents(func, "pad_temp"), _enclosing_extents(func, "group_conv2d_nchw_update")
    channels = kwargs["c"] // planes
    assert pad[0] == conv[0] == channels, (pad, conv)
    if planes > 1:
        assert conv[1] == planes and pad[1] != planes, (pad, conv)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(c=64, hw=13, oc=1000, k=1),  # SqueezeNet conv10: oc not a multiple of the vector width
        dict(c=48, hw=13, oc=192, k=3),  # odd width: one-vector nr, mr = 13
        dict(c=32, hw=27, oc=128, k=3),
        dict(c=16, hw=55, oc=64, k=1),
        dict(c=24, hw=7, oc=40, k=3),  # 7x7, oc = 40 (multiple of 8 only)
        dict(c=20, hw=14, oc=36, k=1),  # oc = 36: 4-wide panels
        dict(c=8, hw=15, oc=16, k=3, stride=2),
        dict(c=16, hw=12, oc=16, k=3, group=16),  # depthwise
    ],
    ids=["1x1-13-oc1000", "3x3-13", "3x3-27", "1x1-55", "3x3-7-oc40", "1x1-14-oc36", "stride2", "depthwise"],
)
def test_conv_tile_search(target: tvm.target.Target, kwargs: dict) -> None:
    report, _ = _check(workloads.conv_bn_relu(**kwargs), target, options=CpuScheduleOptions(conv_tile_search=True))
    wanted = "depthwise-conv2d" if kwargs.get("group") == kwargs["c"] else "conv2d"
    assert any(r.startswith(wanted) for r in report.scheduled.values()), report.summary()
    assert not report.left_alone


def _parallel_extents(mod: tvm.IRModule) -> list[int]:
    return [int(f.extent) for func in mod.functions.values() if isinstance(func, tvm.tirx.PrimFunc)
            for f in _loops(func) if f.kind == tvm.tirx.ForKind.PARALLEL]


@pytest.mark.parametrize("kwargs", [
    dict(c=1024, hw=14, oc=64, k=1, stride=1),   # ResNet layer3's 1024 -> 256 reduction, fewer channels out
    dict(c=256, hw=13, oc=40, k=3, stride=2),    # odd plane (7x7 out), a 3x3 stride-2 conv, oc not a multiple of 16
])
def test_a_small_plane_is_the_tile_a_weight_block_is_reused_over(pinned_target: tvm.target.Target,
                                                                  kwargs: dict) -> None:
    """On the pinned Zen3 profile: With the weights of one channel tile bigger than L1 and the output plane small, the whole plane is the
    tile (one parallel task per channel tile, not per row), and it computes what ORT computes."""
    model, target = workloads.conv_bn_relu(**kwargs), pinned_target
    on, on_mod = _check(model, target, options=CpuScheduleOptions(conv_pointwise=False, conv_channel_block=False))
    off, off_mod = _check(model, target, options=CpuScheduleOptions(conv_pointwise=False, conv_plane_tile=False,
                                                                    conv_channel_block=False))
    assert any(r.startswith("conv2d") for r in on.scheduled.values()), on.summary()
    oh = (kwargs["hw"] + 2 * (kwargs["k"] // 2) - kwargs["k"]) // kwargs["stride"] + 1
    # The conv's parallel loop: one task per channel tile with the plane as the tile, one per (tile, row) without.
    # (The other parallel loop is the BN epilogue or the zero-padding producer, the same in both.)
    on_conv, off_conv = (sorted(set(_parallel_extents(m)) - set(_parallel_extents(o))) for m, o in
                         ((on_mod, off_mod), (off_mod, on_mod)))
    assert len(on_conv) == 1 and [on_conv[0] * oh] == off_conv, (on_conv, off_conv)


@pytest.mark.parametrize("kwargs", [
    dict(c=64, hw=56, oc=256, k=1, stride=1),   # ResNet's 64 -> 256 expansion: the pointwise kernel, 800 KB in
    dict(c=256, hw=56, oc=128, k=1, stride=2),  # a stride-2 projection: the channel-vector kernel, 3.2 MB in
    dict(c=20, hw=60, oc=40, k=3, stride=1),    # channels not a multiple of the vector, odd tiles
])
def test_an_input_bigger_than_l2_is_shared_by_a_block_of_channel_tiles(pinned_target: tvm.target.Target,
                                                                       kwargs: dict) -> None:
    """On the pinned Zen3 profile: with the input image bigger than half of L2, output-channel tiles go inside the row loop in L2-sized
    blocks (fewer parallel tasks than one per tile and row), and the result is what ORT computes."""
    model, target = workloads.conv_bn_relu(**kwargs), pinned_target
    on, on_mod = _check(model, target)
    off, off_mod = _check(model, target, options=CpuScheduleOptions(conv_channel_block=False))
    assert on.scheduled == off.scheduled   # the same rules, in another loop order
    assert sorted(_parallel_extents(on_mod)) != sorted(_parallel_extents(off_mod))


@pytest.mark.parametrize("kwargs", [
    dict(c=16, hw=32, oc=96, k=1),       # MobileNet-style expansion: few input channels, wide rows
    dict(c=24, hw=64, oc=36, k=1),       # oc 36: a 12- or 9-channel tile
    dict(c=8, hw=32, oc=1000, k=1),
])
def test_pointwise_convs_use_the_row_vector_kernel(target: tvm.target.Target, kwargs: dict) -> None:
    """1x1 stride-1 convs with whole-vector rows run as W[f, c] x X[c, row] (the epilogue reads rows,
    not a channel-strided tile), with the BN/ReLU epilogue fused, and compute what ORT computes."""
    report, _ = _check(workloads.conv_bn_relu(**kwargs), target)
    assert any(r.startswith("conv2d-1x1") for r in report.scheduled.values()), report.summary()
    off, _ = _check(workloads.conv_bn_relu(**kwargs), target, options=CpuScheduleOptions(conv_pointwise=False))
    assert not any(r.startswith("conv2d-1x1") for r in off.scheduled.values()), off.summary()


def test_search_conv_tiles_shapes() -> None:
    from fuseguard.compiler.schedule.cpu_conv import ConvInfo, conv_tiles, search_conv_tiles

    avx512 = HostCPU(mcpu="znver4", cores=2, features=frozenset({"avx512f", "avx2", "fma"}))
    avx2 = HostCPU(mcpu="znver1", cores=2, features=frozenset({"avx2", "fma"}))

    def info(oc: int, ow: int) -> ConvInfo:
        return ConvInfo(block=None, n_iter=0, f_iter=1, y_iter=2, x_iter=3, red_iters=(4, 5, 6), w_buffer=None, f_dim=0, oc=oc, ow=ow)

    assert conv_tiles(info(1000, 13), avx512) == (1, 8)  # the old rule: one column per tile
    assert search_conv_tiles(info(1000, 13), avx512) == (13, 8)
    assert search_conv_tiles(info(256, 13), avx512) == (13, 16)
    assert search_conv_tiles(info(64, 56), avx512) == (8, 32)
    # AVX2: no divisor of 13 fits 5/8 of 16 registers; a one-vector column takes 13 of them, not 1
    assert search_conv_tiles(info(1000, 13), avx2) == (13, 8)
    # a grouped conv's channel tile divides its group: RegNetY's 8 channels a group (48 channels) take 8, not 16
    # (no group holds 16: the per-plane rule took it at 7-13 GFLOP/s); 12 a group on AVX2 has no tile of 8 or more
    def grouped(oc: int, ow: int, group_out: int) -> ConvInfo:
        return ConvInfo(block=None, n_iter=0, f_iter=1, y_iter=2, x_iter=3, red_iters=(4, 5, 6), w_buffer=None,
                        f_dim=0, oc=oc, ow=ow, group_out=group_out)

    assert search_conv_tiles(grouped(48, 56, 8), avx512)[1] == 8 and conv_tiles(grouped(208, 14, 8), avx512)[1] == 8
    assert search_conv_tiles(grouped(48, 5, 12), avx2)[1] < 8
    for host in (avx512, avx2):
        for oc, ow in ((1000, 13), (256, 13), (64, 55), (128, 27), (512, 7), (36, 14), (64, 111)):
            mr, nr = search_conv_tiles(info(oc, ow), host)
            assert oc % nr == 0 and ow % mr == 0
            vectors = -(-nr // host.fp32_lanes)
            assert mr * vectors <= host.vector_registers * 5 // 8 or mr == 1 or \
                (vectors == 1 and mr <= host.vector_registers - 3)


def test_grouped_convs_take_the_per_plane_rule_only_when_no_dense_tile_fits_a_group(
        pinned_target: tvm.target.Target) -> None:
    """On the pinned Zen3 profile: a grouped conv with a real kernel (AlexNet's 5x5/3x3, 2 groups) goes to the dense micro-kernel (per plane,
    30x slower). A 1x1 group conv goes there too when a channel tile fits inside one group (ShuffleNet's
    3-group 1x1s, 4-5x faster than per plane); one whose group no tile divides (12 channels against a 16-wide
    tile: the dense kernel's lanes would read two groups, a gather, 0.5 GFLOP/s) and whose plane is too small
    for the pointwise kernel runs per plane."""
    target = pinned_target
    report, _ = _check(workloads.conv_bn_relu(c=96, hw=13, oc=128, k=3, group=2), target)
    assert set(report.scheduled.values()) & {"conv2d+packed", "conv2d"}, report.summary()
    assert "grouped-conv2d" not in report.scheduled.values()
    report, _ = _check(workloads.conv_bn_relu(c=48, hw=5, oc=48, k=1, group=4), target)
    assert "grouped-conv2d" in report.scheduled.values(), report.summary()
    # ... unless the pointwise GEMM over the plane fits (its channel tile inside a group, the plane's columns
    # the vector axis)
    report, _ = _check(workloads.conv_bn_relu(c=48, hw=14, oc=48, k=1, group=4), target)
    assert set(report.scheduled.values()) & {"conv2d-1x1", "conv2d-1x1+packed"}, report.summary()
    for kwargs in (dict(c=120, hw=14, oc=96, k=1, group=3), dict(c=96, hw=16, oc=192, k=1, group=3)):
        report, _ = _check(workloads.conv_bn_relu(**kwargs), target)
        assert "grouped-conv2d" not in report.scheduled.values(), (kwargs, report.summary())
        assert set(report.scheduled.values()) & {"conv2d+packed", "conv2d", "conv2d-1x1+packed", "conv2d-1x1"}
        off, _ = _check(workloads.conv_bn_relu(**kwargs), target, options=CpuScheduleOptions(grouped_pointwise=False))
        assert "grouped-conv2d" in off.scheduled.values(), (kwargs, off.summary())


def test_layernorm_and_softmax(target: tvm.target.Target) -> None:
    """Rows keep their sums and maxima in vectors whatever their width: one no vector divides (ViT's 197
    keys, here 45 and 771: neither 8 nor 16 lanes divide them, and both are at least two vectors wide, the
    rule's minimum) has its reduction padded with the identity, clamped so nothing past the row is
    read (rfactor had dropped the split's predicate: the partial sums read the next row). Softmax's exp
    stays one block per row, computed once for its sum and its normalisation. Each row's partial results
    combine as a tree, and softmax multiplies by its row's reciprocal ([1, 4, 64, 64]: 14 -> 10 us, ORT 7.7,
    SPR class). All match ONNX Runtime; switched off, dlight's rule (scalar reduction chains)."""
    for model in (workloads.layernorm(rows=64, hidden=256), workloads.softmax((1, 4, 32, 48)),
                  workloads.softmax((1, 4, 32, 45)), workloads.layernorm(rows=37, hidden=771)):
        report, mod = _check(model, target)
        assert list(report.scheduled.values()) == ["row-reduction+vector"], report.summary()
        (func,) = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
        lanes = host_from_target(target).fp32_lanes
        # each row's lanes combined as a tree (no loop over the partial results left), and a softmax
        # normalised by one reciprocal a row, not a division a vector
        script = func.script()
        partials = re.findall(r"(\w+_rf) = T.sblock_alloc_buffer", script)
        tree = [re.search(rf"{name}\[[^\]]*T\.int64\({lanes - 1}\)\]", script) for name in partials]
        assert partials and all(tree), script
        if model.graph.name == "softmax":
            assert "T_softmax_exp" in func.script()       # kept, not inlined into both readers
            assert "T.float32(1.0) / T_softmax_expsum" in func.script(), func.script()
        report, _ = _check(model, target, options=CpuScheduleOptions(vector_reductions=False))
        assert list(report.scheduled.values()) == ["row-reduction"]


def test_a_keepdims_reduction_takes_the_vector_row_rule_without_recomputing() -> None:
    """GroupNorm as Wav2Vec2 exports it (InstanceNormalization over [1, C, T], T = 3199 audio frames): the
    mean reduces to [1, C, 1], whose unit axis stood where the rows have their columns. Counted as a row
    axis, the mean moved under every column (640x the work, so the kernel fell to dlight's scalar rule:
    3.5 ms, ORT 1.4 ms; now 0.55 ms, Zen3). Matches ORT."""
    from onnx import TensorProto, helper, numpy_helper

    from fuseguard.compiler.frontend.loader import load
    from fuseguard.compiler.pipeline import CompileOptions, compile_model

    rng = np.random.default_rng(0)
    channels, frames = 24, 203
    inits = [numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "g"),
             numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "b")]
    nodes = [helper.make_node("InstanceNormalization", ["x", "g", "b"], ["y"], epsilon=1e-5)]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, channels, frames]) for n in ("x", "y")]
    model = helper.make_model(helper.make_graph(nodes, "gn", io[:1], io[1:], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    inputs = {"x": rng.standard_normal((1, channels, frames)).astype(np.float32)}
    built = compile_model(load(model, None, name="gn"), options=CompileOptions())
    assert built.report.schedules and set(built.report.schedules.values()) == {"row-reduction+vector"}, \
        built.report.schedules
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)
    np.testing.assert_allclose(built.run(inputs)[0], want[0], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_resnet_block_every_primfunc_scheduled(target: tvm.target.Target, fuse: bool) -> None:
    report, mod = _check(workloads.resnet_block(), target, fuse=fuse)
    assert not report.left_alone, report.summary()
    assert all(rule != "-" for rule in describe_module(mod).values())
    rules = set(report.scheduled.values())
    assert {"conv2d+packed", "injective"} <= rules
    assert rules & {"reduction", "row-reduction", "row-reduction+vector"}  # pooling / global average pool


def test_disabled_is_identity_and_switches(target: tvm.target.Target) -> None:
    mod = workloads.import_and_fuse(workloads.mlp_gelu(16, 32, 64), target)
    with target:
        assert schedule_cpu_module(mod, target, enabled=False).same_as(mod)
        exact = schedule_cpu_module(mod, target, options=CpuScheduleOptions(fast_math=False))
        fast = schedule_cpu_module(mod, target, options=CpuScheduleOptions(fast_math=True))
        off = schedule_cpu_module(mod, target, options=CpuScheduleOptions(matmul=False, reduction=False))

    def ops(m: tvm.IRModule) -> set[str]:
        return {c.op.name for f in m.functions.values() if isinstance(f, tirx.PrimFunc) for c in calls_in(f.body) if hasattr(c.op, "name")}

    assert "tirx.erf" in ops(exact) and "tirx.erf" not in ops(fast)
    assert set(describe_module(off).values()) == {"-"}


def test_env_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEGUARD_CPU_SCHEDULE_OFF", "pack_weights,fast_math")
    opts = CpuScheduleOptions.from_env()
    assert not opts.pack_weights and not opts.fast_math and opts.matmul
    monkeypatch.setenv("FUSEGUARD_CPU_SCHEDULE_OFF", "no_such_switch")
    with pytest.raises(ValueError, match="no_such_switch"):
        CpuScheduleOptions.from_env()


def test_pack_array_matches_index_map() -> None:
    rng = np.random.default_rng(0)
    for shape, j_dim, nr in (((6, 32), 1, 16), ((32, 3, 2, 2), 0, 8), ((2, 5, 24), 2, 8)):
        arr = rng.standard_normal(shape).astype("float32")
        packed = pack_array(arr, j_dim, nr)
        imap = panel_index_map(len(shape), j_dim, nr)
        for idx in np.ndindex(*shape):
            new_idx = tuple(int(e) for e in imap(*idx))  # the same map, evaluated on ints
            assert packed[new_idx] == arr[idx]


# --- approximations -----------------------------------------------------------------------------


def _eval_unary(op_name: str, xs: np.ndarray, target: tvm.target.Target) -> np.ndarray:
    from tvm import te

    a = te.placeholder((xs.size,), "float32", name="A")
    fn = {"erf": te.erf, "tanh": te.tanh, "exp": te.exp, "sigmoid": te.sigmoid}[op_name]
    b = te.compute((xs.size,), lambda i: fn(a[i]), name="B")
    func = approx.rewrite_fast_math(te.create_prim_func([a, b]))
    assert all(getattr(c.op, "name", "") != f"tirx.{op_name}" for c in calls_in(func.body))
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    out = tvm.runtime.tensor(np.zeros_like(xs))
    lib["main"](tvm.runtime.tensor(xs), out)
    return out.numpy()


def test_fast_exp_computes_no_denormal_for_a_lane_below_its_range(target: tvm.target.Target) -> None:
    """A causal mask's -3.4e38 lanes: the polynomial path must see an in-range value, since clamped to the range's
    bound it made 2^-126 x 0.999997, a denormal, and a masked [1, 4, 64, 64] softmax ran 3.4x slower (SPR class).
    The result stays exactly 0 there and exact elsewhere."""
    x = tirx.Var("x", "float32")
    lets: dict[str, tirx.Expr] = {}

    def visit(node: object) -> None:
        if isinstance(node, tirx.Let):
            lets[node.var.name] = node.value
        for field in ("value", "body", "condition", "true_value", "false_value", "a", "b"):
            if hasattr(node, field):
                visit(getattr(node, field))
        for arg in getattr(node, "args", None) or ():
            visit(arg)

    visit(approx.fast_exp(x))
    clamp = lets["xc"]
    assert isinstance(clamp, tirx.Select) and isinstance(clamp.true_value, tirx.FloatImm)
    assert clamp.true_value.value == 0.0            # exp(0) computed, then dropped by the outer select
    xs = np.array([np.finfo(np.float32).min, -1e4, -87.5, -87.0, -1.0, 0.0, 3.0], dtype="float32")
    got = _eval_unary("exp", xs, target)
    assert (got[:3] == 0.0).all()
    np.testing.assert_allclose(got[3:], np.exp(xs[3:].astype(np.float64)), rtol=approx.MAX_REL_ERR["exp"])


@pytest.mark.parametrize("op_name", ["erf", "tanh", "exp", "sigmoid"])
def test_approximation_error_bounds(op_name: str, target: tvm.target.Target) -> None:
    if op_name == "exp":
        xs = np.linspace(-87.0, 88.0, 200_001, dtype="float32")
    else:
        xs = np.linspace(-10.0, 10.0, 200_001, dtype="float32")
    refs = {"erf": scipy.special.erf, "tanh": np.tanh, "exp": np.exp, "sigmoid": scipy.special.expit}
    if op_name == "sigmoid":
        xs = np.linspace(-100.0, 100.0, 200_001, dtype="float32")
    ref = refs[op_name](xs.astype(np.float64))
    got = _eval_unary(op_name, xs, target).astype(np.float64)
    if op_name == "exp":
        err = float(np.max(np.abs(got - ref) / ref))
        assert err <= approx.MAX_REL_ERR["exp"], err
    else:
        err = float(np.max(np.abs(got - ref)))
        assert err <= approx.MAX_ABS_ERR[op_name], err
    special = np.array([np.nan, np.inf, -np.inf, -200.0, 200.0, 0.0], dtype="float32")
    got_s = _eval_unary(op_name, special, target)
    with np.errstate(over="ignore"):
        want = refs[op_name](special)
    np.testing.assert_allclose(got_s, want, rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("op_name", ["erf", "tanh", "exp", "sigmoid"])
def test_approximation_stays_vectorised(op_name: str, target: tvm.target.Target) -> None:
    """TVM scalarises a vectorised loop holding any call it does not know to be vectorisable: `isnan`
    (the approximations' NaN guard) was one, so every fused GELU/SiLU epilogue ran as scalar TIR that LLVM
    re-vectorised at 256 bits. The loop must reach LLVM as 16-lane vectors and keep NaN/inf right there."""
    from tvm import s_tir, te

    n = 64
    a = te.placeholder((n,), "float32", name="A")
    fn = {"erf": te.erf, "tanh": te.tanh, "exp": te.exp, "sigmoid": te.sigmoid}[op_name]
    b = te.compute((n,), lambda i: fn(a[i]), name="B")
    sch = s_tir.Schedule(approx.rewrite_fast_math(te.create_prim_func([a, b])))
    (loop,) = sch.get_loops(sch.get_sblock("B"))
    sch.vectorize(sch.split(loop, [None, 16])[1])
    lib = tvm.tirx.build(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=target)
    assert "<16 x float>" in lib.inspect_source("ll")
    xs = np.resize(np.array([np.nan, np.inf, -np.inf, -200.0, 200.0, 0.0, 0.5, -1.5], dtype="float32"), n)
    out = tvm.runtime.tensor(np.zeros_like(xs))
    lib["main"](tvm.runtime.tensor(xs), out)
    refs = {"erf": scipy.special.erf, "tanh": np.tanh, "exp": np.exp, "sigmoid": scipy.special.expit}
    with np.errstate(over="ignore"):
        want = refs[op_name](xs)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6, atol=1e-6, equal_nan=True)


def _scalarised(func: tirx.PrimFunc, target: tvm.target.Target) -> bool:
    """Did TVM's VectorizeLoop fall back to a scalar loop (its `<var>_s` loops) anywhere in `func`? Lowered with
    the steps of TVM's default TIR pipeline up to and including VectorizeLoop."""
    import re

    from tvm import s_tir

    mod = tvm.IRModule({"f": func.with_attr("global_symbol", "f").with_attr("target", target)})
    steps = tvm.transform.Sequential([
        s_tir.transform.CanonicalizeLoop(), s_tir.transform.LowerInitBlock(),
        s_tir.transform.PlanAndUpdateBufferAllocationLocation(), s_tir.transform.ConvertBlocksToOpaque(),
        s_tir.transform.CompactBufferAllocation(), s_tir.transform.LowerMatchBuffer(), s_tir.transform.StmtSimplify(),
        s_tir.transform.LowerOpaqueBlock(), tirx.transform.FlattenBuffer(), tirx.transform.NarrowDataType(32),
        s_tir.transform.LoopPartition(), tirx.transform.VectorizeLoop(True)])
    with target:
        return re.search(r"for \w+_s in range", steps(mod).script()) is not None


@pytest.mark.parametrize("name", ["mlp_gelu", "mlp_gelu_tanh", "pattern_conv_silu", "softmax_layernorm", "attention"])
def test_no_suite_kernel_falls_back_to_scalar_code(name: str, target: tvm.target.Target) -> None:
    """Every loop a schedule vectorises stays vector through TVM's lowering, fused and unfused: one op TVM does not
    know to be vectorisable (`isnan` in the fast-math epilogues was one) turns a whole loop scalar, silently."""
    from fuseguard.compiler.pipeline import CompileOptions, compile_model
    from fuseguard.suites.models import get_model

    for fusion in (True, False):
        built = compile_model(get_model(name).make(), None, CompileOptions(fusion=fusion))
        scalar = [gv.name_hint for gv, f in built.lowered.functions.items()
                  if isinstance(f, tirx.PrimFunc) and _scalarised(f, target)]
        assert not scalar, (fusion, scalar)


# --- host detection -----------------------------------------------------------------------------

ZEN1_EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 1
model name\t: AMD EPYC 7551 32-Core Processor
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma bmi2 adx sha_ni

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 1
model name\t: AMD EPYC 7551 32-Core Processor
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma bmi2 adx sha_ni
"""

SKYLAKE_X = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 85
model name\t: Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz
flags\t\t: fpu sse sse2 avx avx2 fma adx rdseed clflushopt avx512f avx512dq avx512cd avx512bw avx512vl
"""

ARM_NEOVERSE = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm
CPU implementer\t: 0x41
CPU architecture: 8
CPU part\t: 0xd0c
"""

ZEN4 = ZEN1_EPYC.replace("cpu family\t: 23", "cpu family\t: 25").replace("model\t\t: 1", "model\t\t: 17").replace("sha_ni", "sha_ni avx512f avx512bw")
UNKNOWN_X86 = "processor\t: 0\nvendor_id\t: HygonGenuine\nflags\t\t: sse2 avx avx2 fma\n"
OLD_X86 = "processor\t: 0\nvendor_id\t: SomeVendor\nflags\t\t: sse sse2\n"


@pytest.mark.parametrize(
    ("text", "mcpu", "bits", "cores"),
    [
        (ZEN1_EPYC, "znver1", 256, 2),
        (SKYLAKE_X, "skylake-avx512", 512, 1),
        (ARM_NEOVERSE, "generic", 128, 1),
        (ZEN4, "znver4", 512, 2),
        (UNKNOWN_X86, "core-avx2", 256, 1),
        (OLD_X86, "x86-64", 128, 1),
    ],
    ids=["zen1-epyc", "skylake-x", "arm", "zen4", "avx2-unknown-vendor", "sse-only"],
)
def test_detect_host_from_cpuinfo(monkeypatch: pytest.MonkeyPatch, text: str, mcpu: str, bits: int, cores: int) -> None:
    monkeypatch.delenv(MCPU_ENV, raising=False)
    host = detect_host(text)
    assert isinstance(host, HostCPU)
    assert host.mcpu == mcpu and host.vector_bits == bits and host.cores == cores
    assert mcpu_from_cpuinfo(text)[0] == mcpu


def test_mcpu_override_and_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MCPU_ENV, "haswell")
    assert detect_host(ZEN1_EPYC).mcpu == "haswell"
    tgt = host_target(num_cores=3)
    assert tgt.kind.name == "llvm" and str(tgt.attrs["mcpu"]) == "haswell" and int(tgt.attrs["num-cores"]) == 3
    assert host_from_target(tgt).vector_bits == 256  # haswell: AVX2 regardless of the build host
    assert str(host_target(mcpu="znver1").attrs["mcpu"]) == "znver1"


def test_scheduled_functions_are_marked(target: tvm.target.Target) -> None:
    mod = workloads.import_and_fuse(workloads.softmax((1, 2, 8, 16)), target)
    with target:
        out = schedule_cpu_module(mod, target)
    funcs = [f for f in out.functions.values() if isinstance(f, tirx.PrimFunc)]
    assert funcs and all(f.attrs[SCHEDULE_ATTR] for f in funcs)
    with target:  # idempotent: already-scheduled functions are left as they are
        again, report = schedule_cpu_module_with_report(out, target)
    assert set(report.left_alone.values()) == {"already scheduled"}


def test_symbolic_kernels_go_parallel_only_when_the_call_has_the_work(target: tvm.target.Target) -> None:
    """A symbolic extent used to count as large, so every symbolic kernel ran in parallel and small calls
    paid the pool's wake-up (4x at seq 5). Now the parallel loop nest is kept beside a serial copy and each
    call picks by its work; both branches compute the same."""
    from tvm import te

    from fuseguard.compiler.schedule.cpu import PARALLEL_MIN_WORK

    n = tirx.Var("n", "int64")
    a = te.placeholder((n, 1024), name="A")
    b = te.compute((n, 1024), lambda i, j: a[i, j] * 2.0 + 1.0, name="B")
    mod = tvm.IRModule({"scale": te.create_prim_func([a, b]).with_attr("global_symbol", "scale")})
    with target:
        sched, report = schedule_cpu_module_with_report(mod, target, num_threads=2)
    assert report.scheduled == {"scale": "injective"}
    script = sched["scale"].script()
    assert "T.parallel" in script and f">= {PARALLEL_MIN_WORK}" in script.replace("T.int64(", "").replace(")", "")
    off, _ = schedule_cpu_module_with_report(mod, target, num_threads=2,
                                             options=CpuScheduleOptions(parallel_when_worth=False))
    assert "if" not in off["scale"].script()
    lib = tvm.compile(sched, target=target)
    for rows in (3, PARALLEL_MIN_WORK // 1024 + 7):     # the serial branch, then the parallel one
        x = np.random.default_rng(rows).standard_normal((rows, 1024)).astype("float32")
        out = tvm.runtime.tensor(np.zeros_like(x))
        lib["scale"](tvm.runtime.tensor(x), out)
        np.testing.assert_array_equal(out.numpy(), x * 2.0 + 1.0)


@pytest.mark.parametrize("mcpu, regs", [("znver5", 32), ("znver4", 32), ("sapphirerapids", 32), ("znver3", 16),
                                        ("haswell", 16)])
def test_cost_model_vector_registers_follow_the_isa(mcpu: str, regs: int) -> None:
    """The cost model's table row asks LLVM for the ISA as the schedules do (a name list had missed znver5)."""
    from fuseguard.compiler.hw.hardware import host_cpu

    assert host_cpu(mcpu).vector_regs == regs


@pytest.mark.parametrize("sizes, shape", [
    ([8] + [4] * 20, (14, 14, 8)),      # DenseNet's concat of every earlier layer, blocked (NCHW8c)
    ([3, 5, 7], (9, 11)),               # NCHW, odd widths
])
def test_a_concatenation_is_cut_into_one_loop_nest_per_input(sizes: list[int], shape: tuple[int, ...]) -> None:
    """concat + ReLU: each input its own loop nest, the if_then_else chain folded away (every branch was
    loaded and selected per vector: a 21-input concat 10x slower, Zen3); the values unchanged."""
    from tvm import relax, s_tir
    from tvm.script import relax as R

    from fuseguard.compiler.schedule.cpu_elementwise import schedule_injective

    bb = relax.BlockBuilder()
    xs = [relax.Var(f"x{i}", R.Tensor((1, n, *shape), "float32")) for i, n in enumerate(sizes)]
    with bb.function("main", xs):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.relu(relax.op.concat(xs, axis=1))))
        bb.emit_func_output(out)
    mod = relax.transform.FuseTIR()(relax.transform.FuseOps()(relax.transform.AnnotateTIROpPattern()(
        relax.transform.LegalizeOps()(bb.get()))))
    func = next(mod[g] for g in mod.get_global_vars() if g.name_hint != "main")
    sch = s_tir.Schedule(func)
    assert schedule_injective(sch, detect_host(), num_threads=2)
    copies = []
    tvm_ffi.structural_walk(sch.mod["main"], (s_tir.SBlock, lambda b: copies.append(b.name_hint)), order="post")
    assert len([c for c in copies if not c.endswith(("_partition", "_common")) and c != "root"]) == len(sizes), copies
    lib = tvm.compile(sch.mod["main"].with_attr("global_symbol", "main"), target=host_target())
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((1, n, *shape)).astype(np.float32) for n in sizes]
    out = tvm.runtime.tensor(np.zeros((1, sum(sizes), *shape), np.float32))
    lib["main"](*[tvm.runtime.tensor(a) for a in args], out)
    np.testing.assert_array_equal(out.numpy(), np.maximum(np.concatenate(args, 1), 0))


def test_long_odd_rows_are_vectorised_along_each_row_with_a_tail() -> None:
    """A per-row scale + sigmoid on 8 rows of 301 (an audio frame's odd length, past ROW_VECTOR_MAX): whole
    vectors along each row and the last columns as their own loop. Fused across rows, each vector
    straddled row ends with a div/mod and a gather per lane (Wav2Vec2's 128 x 3199 kernel 1.49 -> 0.55 ms,
    Zen3)."""
    from tvm import relax, s_tir
    from tvm.script import relax as R

    from fuseguard.compiler.schedule.cpu_elementwise import schedule_injective

    rows, width = 8, 301
    bb = relax.BlockBuilder()
    x, scale = relax.Var("x", R.Tensor((1, rows, width), "float32")), relax.Var("s", R.Tensor((rows, 1), "float32"))
    with bb.function("main", [x, scale]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.sigmoid(relax.op.multiply(x, scale))))
        bb.emit_func_output(out)
    mod = relax.transform.FuseTIR()(relax.transform.FuseOps()(relax.transform.AnnotateTIROpPattern()(
        relax.transform.LegalizeOps()(bb.get()))))
    func = next(mod[g] for g in mod.get_global_vars() if g.name_hint != "main")
    sch = s_tir.Schedule(func)
    host = detect_host()
    assert schedule_injective(sch, host, num_threads=2)
    widths = sorted({int(lp.extent) for lp in _loops(sch.mod["main"]) if lp.kind == tirx.ForKind.VECTORIZED})
    assert widths == sorted({host.fp32_lanes, width % host.fp32_lanes}), sch.mod["main"].script()
    lib = tvm.compile(sch.mod["main"].with_attr("global_symbol", "main"), target=host_target())
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((1, rows, width)).astype(np.float32), rng.standard_normal((rows, 1)).astype(np.float32)
    got = tvm.runtime.tensor(np.zeros((1, rows, width), np.float32))
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), got)
    np.testing.assert_allclose(got.numpy(), 1 / (1 + np.exp(-a * b)), rtol=1e-6, atol=1e-6)


def test_a_layernorm_that_also_outputs_its_residual_sum_keeps_the_vector_rule() -> None:
    """Pre-LN blocks: ``s = x + r`` feeds the LayerNorm and the next layer, so the fused kernel has two
    outputs. The residual's loop nest could not move under the row loop (an output block); it now runs on
    its own before the rows instead of sending the kernel to the generic reduction rule (Whisper's add +
    LayerNorm: 2.5x slower than its unfused parts, Zen3). Both outputs match ORT."""
    from onnx import TensorProto, helper, numpy_helper

    from fuseguard.compiler.frontend.loader import load
    from fuseguard.compiler.pipeline import CompileOptions, compile_model

    rng = np.random.default_rng(0)
    rows, width = 300, 128
    inits = [numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), "g"),
             numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), "b")]
    nodes = [helper.make_node("Add", ["x", "r"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=1e-5)]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, rows, width]) for n in ("x", "r", "y", "s")]
    model = helper.make_model(helper.make_graph(nodes, "preln", io[:2], io[2:], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    inputs = {n: rng.standard_normal((1, rows, width)).astype(np.float32) for n in ("x", "r")}
    built = compile_model(load(model, None, name="preln"), options=CompileOptions())
    rules = {k: v for k, v in built.report.schedules.items() if "layer_norm" in k}
    assert rules and set(rules.values()) == {"row-reduction+vector"}, built.report.schedules
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)
    for got, ref in zip(built.run(inputs), want):
        np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)


def test_only_a_softmax_divides_by_its_rows_reciprocal(target: tvm.target.Target) -> None:
    """A softmax's row sum holds exp(0) = 1, so x * (1 / sum) cannot overflow; a row divided by any other
    row sum (an L1 normalisation) keeps its division: a sum under float32's smallest normal has no finite
    reciprocal."""
    from tvm import te, topi

    x = te.placeholder((64, 96), name="x")
    softmax = te.create_prim_func([x, topi.nn.softmax(x, axis=-1)]).with_attr("global_symbol", "softmax")
    total = topi.sum(x, axis=-1, keepdims=True)
    l1 = te.create_prim_func([x, te.compute((64, 96), lambda i, j: x[i, j] / total[i, 0], name="y")]) \
        .with_attr("global_symbol", "l1")
    with target:
        sched, report = schedule_cpu_module_with_report(tvm.IRModule({"softmax": softmax, "l1": l1}), target)
    assert set(report.scheduled.values()) == {"row-reduction+vector"}, report.scheduled
    scripts = {gv.name_hint: func.script() for gv, func in sched.functions_items()}
    assert "T.float32(1.0) / T_softmax_expsum" in scripts["softmax"], scripts["softmax"]
    assert "T.float32(1.0) /" not in scripts["l1"], scripts["l1"]
    tiny = np.full((64, 96), 1e-45, dtype=np.float32)       # denormal rows: their sums too
    exe = tvm.compile(sched, target=target)
    out = tvm.runtime.tensor(np.empty_like(tiny))
    exe["l1"](tvm.runtime.tensor(tiny), out)
    np.testing.assert_allclose(out.numpy(), tiny / tiny.sum(axis=-1, keepdims=True), rtol=1e-6)


def test_a_transcendental_kernel_goes_parallel_at_fewer_iterations(target: tvm.target.Target) -> None:
    """ViT's [2364, 197] softmax has 1.9 M block iterations, under the parallel threshold when each counts
    one, so it ran serial (670 us; 302 us on two threads, Zen3). Its exp (a fast-math Let chain) weighs
    TRANSCENDENTAL_WORK per element: the rows run parallel. The same rows of an add-only kernel stay serial."""
    from tvm import te, topi

    from fuseguard.compiler.schedule.cpu import PARALLEL_MIN_WORK, TRANSCENDENTAL_WORK

    shape = (12, 197, 197)
    elements = 12 * 197 * 197
    assert 4 * elements < PARALLEL_MIN_WORK <= (3 + TRANSCENDENTAL_WORK) * elements
    x = te.placeholder(shape, name="x")
    softmax = te.create_prim_func([x, topi.nn.softmax(x, axis=-1)]).with_attr("global_symbol", "softmax")
    small = te.placeholder((4, 197, 197), name="x")     # 1.2 MB: under PARALLEL_MIN_BYTES too
    plain = te.create_prim_func([small, te.compute(small.shape, lambda i, j, k: small[i, j, k] + 1.0, name="y")]) \
        .with_attr("global_symbol", "plain")
    with target:
        sched, _ = schedule_cpu_module_with_report(tvm.IRModule({"softmax": softmax, "plain": plain}), target,
                                                   num_threads=2)
    parallel = {gv.name_hint: any(f.kind == tirx.ForKind.PARALLEL for f in _loops(func))
                for gv, func in sched.functions_items()}
    assert parallel == {"softmax": True, "plain": False}, parallel


def test_a_kernel_reading_megabytes_goes_parallel_at_few_iterations(target: tvm.target.Target) -> None:
    """ResNet-50's classifier, [1, 2048] x [2048, 1000]: 2 M multiply-adds, under PARALLEL_MIN_WORK, but 8 MB of
    weights to read, so it is bound by one core's bandwidth serial (541 us against ORT's 213, SPR class). Its
    buffers reach PARALLEL_MIN_BYTES: parallel. The same matmul over 256 inputs (1 MB) stays serial. (1024
    columns here: a B that is not a constant and no vector divides is padded by a parallel copy.)"""
    from tvm import te

    from fuseguard.compiler.schedule.cpu import PARALLEL_MIN_BYTES, PARALLEL_MIN_WORK

    def matvec(k_dim: int, name: str) -> tirx.PrimFunc:
        x, w = te.placeholder((1, k_dim), name="x"), te.placeholder((k_dim, 1024), name="w")
        k = te.reduce_axis((0, k_dim), name="k")
        y = te.compute((1, 1024), lambda i, j: te.sum(x[i, k] * w[k, j], axis=k), name="y")
        return te.create_prim_func([x, w, y]).with_attr("global_symbol", name)

    assert 2048 * 1024 < PARALLEL_MIN_WORK and 256 * 1024 * 4 < PARALLEL_MIN_BYTES <= 2048 * 1024 * 4
    with target:
        sched, report = schedule_cpu_module_with_report(tvm.IRModule({"big": matvec(2048, "big"),
                                                                      "small": matvec(256, "small")}),
                                                        target, num_threads=2)
    assert set(report.scheduled.values()) == {"matmul"}, report.summary()
    parallel = {gv.name_hint: any(f.kind == tirx.ForKind.PARALLEL for f in _loops(func))
                for gv, func in sched.functions_items()}
    assert parallel == {"big": True, "small": False}, parallel


def test_a_packed_weight_panel_is_a_cache_line_of_columns() -> None:
    """A tile wider than a cache line reads one line a step from each of its panels (several streams when the
    weight comes from L3 or DRAM); a tile of a line or less is one panel (AVX2's 16 columns, odd tiles)."""
    from fuseguard.compiler.schedule.cpu_matmul import PANEL_BYTES, panel_width

    assert PANEL_BYTES == 64
    assert panel_width(32) == 16 and panel_width(64) == 16
    assert panel_width(16) == 16 and panel_width(8) == 8 and panel_width(24) == 24
    assert panel_width(32, bits=16) == 32      # a line of fp16 columns
