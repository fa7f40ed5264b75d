"""`fuseguard profile`: per-kernel timing of both builds, fused kernels paired with their unfused parts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fuseguard.verify.perf.profile import SiteTime, group_parts, profile_model

ROOT = Path(__file__).resolve().parent.parent


def _site(kernel: str, nodes: list[str], us: float) -> SiteTime:
    return SiteTime(kernel=kernel, pattern="generic", nodes=nodes, us=us, bytes=0, flops=0)


def _ln_model(tmp_path: Path) -> Path:
    """Add + LayerNorm + Relu on 1 x 17 x 192 (ViT-tiny's LayerNorm), saved as ONNX."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((1, 17, 192)).astype(np.float32), "r"),
             numpy_helper.from_array(np.ones(192, np.float32), "g"),
             numpy_helper.from_array(np.zeros(192, np.float32), "b")]
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "r"], ["s"]),
         helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=1e-6),
         helper.make_node("Relu", ["y"], ["z"])],
        "ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 17, 192])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 17, 192])], inits)
    path = tmp_path / "ln.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_parts_are_the_unfused_kernels_of_the_same_nodes() -> None:
    fused = [_site("f_matmul_add_relu", ["mm", "add", "relu"], 10.0), _site("f_softmax", ["sm"], 3.0)]
    unfused = [_site("matmul", ["mm"], 8.0), _site("add", ["add"], 2.0), _site("relu", ["relu"], 2.0),
               _site("softmax", ["sm"], 4.0), _site("reshape", [], 1.0)]
    first, second = group_parts(fused, unfused)
    assert (first.parts, first.parts_us) == (3, 12.0) and first.speedup == 1.2
    assert (second.parts, second.parts_us) == (1, 4.0)


def test_each_kernel_call_costs_the_vm_its_call_and_a_view_costs_nothing() -> None:
    """A fused group saves the VM's cost of every call it removes (0.2-0.3 us: as large as the whole saving
    of a small Add + LayerNorm group, which the hook and replay both miss); a part that became a view is no call."""
    from fuseguard.verify.perf.profile import ProfileResult, measure_call_us

    def called(kernel: str, nodes: list[str], us: float) -> SiteTime:
        return SiteTime(kernel=kernel, pattern="layernorm", nodes=nodes, us=us, bytes=0, flops=0,
                        samples=[us, us, us])

    fused = [called("f_add_ln", ["add", "ln"], 0.7)]
    view = SiteTime(kernel="reshape", pattern="generic", nodes=["ln"], us=0.0, bytes=0, flops=0, samples=[0.0] * 3)
    unfused = [called("add", ["add"], 0.3), called("ln", ["ln"], 0.4), view]
    (plain,), (charged,) = group_parts(fused, unfused), group_parts(fused, unfused, call_us=0.25)
    assert abs(plain.saving_us) < 1e-9 and abs(charged.saving_us - 0.25) < 1e-9
    assert charged.saving_ci is not None and abs(charged.saving_ci[0] - 0.25) < 1e-9
    result = ProfileResult(model="m", cpu="cpu", threads=2, repeats=3, peak_gflops=1.0, overhead_us=1.0,
                           fused=fused, unfused=unfused, call_us=0.25)
    assert abs(result.unfused_total_us - result.fused_total_us - 0.25) < 1e-9
    assert 0.0 < measure_call_us(calls=16, repeats=3) < 20.0


def test_an_unfused_kernel_spanning_two_groups_is_not_counted_twice() -> None:
    fused = [_site("a", ["n1"], 1.0), _site("b", ["n2"], 1.0)]
    unfused = [_site("ab", ["n1", "n2"], 5.0)]
    assert [g.parts for g in group_parts(fused, unfused)] == [0, 0]


def test_profile_of_a_suite_model() -> None:
    from fuseguard.verify.check.model import SuiteSpec

    result = profile_model(SuiteSpec("mlp_gelu", (("batch", 1), ("seq", 16))), repeats=5)
    assert result.fused and result.unfused and result.peak_gflops > 0
    assert len(result.groups) == len(result.fused)
    assert result.fused_total_us > 0 and result.unfused_total_us > 0
    matmuls = [g for g in result.groups if g.flops > 0]
    assert matmuls and all(g.parts >= 1 for g in matmuls)          # every matmul kernel found its parts
    assert sum(g.parts_us for g in result.groups) <= result.unfused_total_us + 1e-6
    d = result.to_dict()
    assert {"fused_total_us", "unfused_total_us", "groups", "peak_gflops"} <= set(d)
    # A kernel at or under the hook's overhead times as 0 us: no ratio, and the JSON stays JSON (it was NaN).
    import dataclasses

    zero = dataclasses.replace(result, groups=[dataclasses.replace(result.groups[0], fused_us=0.0)])
    assert json.loads(json.dumps(zero.to_dict(), allow_nan=False))["groups"][0]["speedup"] is None


def test_profile_cli_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "profile", "conv_bn_relu", "--repeats", "3",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "fuseguard profile: conv_bn_relu" in proc.stdout
    (entry,) = json.loads(out.read_text()).values()
    assert entry["groups"] and entry["fused_total_us"] > 0
    # fuseguard's own failure (here: the JSON path is a folder) is one line naming the command, exit 3.
    bad = subprocess.run([sys.executable, "-m", "fuseguard.verify.cli", "profile", "conv_bn_relu", "--repeats", "3",
                          "--json", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 3, bad.stderr
    assert "Traceback" not in bad.stderr and bad.stderr.strip().splitlines()[-1].startswith("fuseguard: error: profile")


def test_identical_kernel_calls_keep_their_own_nodes() -> None:
    """bert_tiny's two attention layers share one hand-written kernel: each call still names its own
    layer's ONNX nodes (both had claimed the last layer's, so a profile paired only one with its parts)."""
    from fuseguard.compiler.frontend.loader import load
    from fuseguard.compiler.pipeline import CompileOptions, compile_model
    from fuseguard.verify.check.model import resolve_model_arg

    spec = resolve_model_arg("bert_tiny")
    built = compile_model(load(spec.build(), None, name="bert_tiny"), options=CompileOptions())
    sites = [s for s in built.report.call_sites if s["pattern"] == "attention"]
    assert len(sites) == 2 and len({s["kernel"] for s in sites}) == 1, sites
    first, second = (set(s["nodes"]) for s in sites)
    assert first and second and not first & second, sites


def test_a_node_split_into_several_kernels_pairs_each_with_its_own_kind() -> None:
    """A conv whose layout transform and view carry its node: the unfused conv is a part of the fused conv
    kernel (not of the view listed first), the transform of the transform."""
    def site(kernel: str, nodes: list[str], us: float, flops: int) -> SiteTime:
        return SiteTime(kernel=kernel, pattern="generic", nodes=nodes, us=us, bytes=0, flops=flops)

    fused = [site("expand_dims", ["conv"], 0.0, 0), site("te_layout_transform", ["conv"], 5.0, 0),
             site("fused_conv2d_NCHWc_erf", ["conv", "erf"], 30.0, 1000)]
    unfused = [site("expand_dims", ["conv"], 0.0, 0), site("te_layout_transform1", ["conv"], 5.0, 0),
               site("conv2d_NCHWc", ["conv"], 28.0, 1000), site("erf", ["erf"], 4.0, 0)]
    view, transform, conv = group_parts(fused, unfused)
    assert (view.parts, transform.parts, transform.parts_us) == (1, 1, 5.0)
    assert (conv.parts, conv.parts_us) == (2, 32.0)


def test_tvm_only_timing_keeps_the_pools_spinning(monkeypatch) -> None:
    """profile and tune time TVM alone: the pool spins as deployed (spinning off made every parallel kernel
    pay a wake-up and read bert_tiny's attention 2.7x slower than deployed); bench, which times ONNX Runtime
    in the same process, turns it off on both sides."""
    import fuseguard.verify.cli as cli
    import fuseguard.verify.cli.perf as cli_perf
    import fuseguard.verify.worker as worker_mod

    seen: dict[str, dict[str, str]] = {}

    class Recorder:
        def __init__(self, *, env, **_: object) -> None:
            self.env = env

        def __enter__(self):
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    def fake_each_model(args, worker, task, verb, **kwargs):
        seen[args.command] = dict(worker.env)
        return iter(())

    monkeypatch.setattr(worker_mod, "Worker", Recorder)
    monkeypatch.setattr(cli_perf, "each_model", fake_each_model)
    for command in ("profile", "tune"):
        assert cli.main([command, "mlp_gelu"]) == 0
        assert "TVM_THREAD_POOL_SPIN_COUNT" not in seen[command], command
        assert seen[command]["TVM_NUM_THREADS"]
    from fuseguard.verify.perf import timing
    from fuseguard.verify.perf.timing import timing_env

    assert timing_env(2)["TVM_THREAD_POOL_SPIN_COUNT"] == "0"
    assert timing_env(2, pools="brief")["TVM_THREAD_POOL_SPIN_COUNT"] == str(timing.BRIEF_TVM_SPIN_COUNT)
    assert "TVM_THREAD_POOL_SPIN_COUNT" not in timing_env(2, pools="deployed")


def test_groups_too_short_for_the_hook_are_replayed_whole() -> None:
    """A group whose calls' hook error is more than RESOLUTION of its time is replayed, fused kernel and every
    part; a long group is not, even with a short part (ResNet-18's 800 us convs had been replayed for theirs).
    A group read as 0 us is wanted too: a kernel under the hook's own cost reads 0 (a view, never called, simply
    gets no replay time and stays as read)."""
    from fuseguard.verify.perf.profile import HOOK_ERROR_US, RESOLUTION, replay_wanted

    long_us = 10 * HOOK_ERROR_US / RESOLUTION
    fused = [_site("f_ln", ["add", "ln"], 1.0), _site("f_conv", ["conv", "relu"], long_us),
             _site("f_view", ["r"], 0.0), _site("f_mm", ["mm", "bias"], 30 * HOOK_ERROR_US)]
    unfused = [_site("add", ["add"], 0.1), _site("ln", ["ln"], 0.9), _site("conv", ["conv"], long_us),
               _site("relu", ["relu"], 2.0), _site("reshape", ["r"], 0.0), _site("mm", ["mm"], 28 * HOOK_ERROR_US),
               _site("bias", ["bias"], 2.0)]
    want_fused, want_unfused = replay_wanted(fused, unfused)
    assert want_fused == {0, 2, 3} and want_unfused == {0, 1, 4, 5, 6}


def test_a_group_reads_replays_only_when_all_its_kernels_have_one() -> None:
    def site(kernel: str, nodes: list[str], us: float, replay: float | None) -> SiteTime:
        return SiteTime(kernel=kernel, pattern="generic", nodes=nodes, us=us, bytes=0, flops=0, replay_us=replay)

    fused = [site("f_ln", ["add", "ln"], 1.1, 0.6), site("f_mm", ["mm", "b"], 30.0, 20.0)]
    unfused = [site("add", ["add"], 0.0, 0.1), site("ln", ["ln"], 0.1, 0.7), site("mm", ["mm"], 28.0, None),
               site("b", ["b"], 1.0, 0.5)]
    ln, mm = group_parts(fused, unfused)
    assert (ln.timing, ln.fused_us, round(ln.parts_us, 6)) == ("replay", 0.6, 0.8)
    assert (mm.timing, mm.fused_us, mm.parts_us) == ("model run", 30.0, 29.0)


def test_a_page_is_cold_once_more_distinct_bytes_than_the_caches_hold_were_touched_since() -> None:
    """Four pages of cache: a tensor read again after one 2-page tensor is warm, after an 8-page one cold; a
    tensor never touched before is cold; a view at an offset shares its storage's pages."""
    from fuseguard.verify.perf.profile import cold_bytes_per_call

    page, a, b, c = 4096, 0x10000, 0x20000, 0x30000
    calls = [[(a, 2 * page)], [(b, 2 * page)], [(a, 2 * page)], [(c, 8 * page)], [(a, 2 * page), (b, page)],
             [(c + 4 * page, page)]]
    assert cold_bytes_per_call(calls, capacity=4 * page, page=page) == \
        [[2 * page], [2 * page], [0], [8 * page], [2 * page, page], [0]]
    assert cold_bytes_per_call(calls, capacity=64 * page, page=page)[2:] == [[0], [8 * page], [0, 0], [0]]


def test_a_groups_intermediates_are_not_its_boundary() -> None:
    """An unfused part's output that a later part reads (an unfused attention's scores) is left out: its being
    cold is part of what fusing saves, not of where the plans put the group's inputs and output."""
    from fuseguard.verify.perf.profile import boundary_cold

    x, w, mid, out = (0x1000, 64, 10), (0x2000, 64, 20), (0x3000, 64, 40), (0x4000, 64, 80)
    assert boundary_cold([[x, w, mid], [mid, out]]) == [30, 80]
    assert boundary_cold([[x, w, mid], [x, out]]) == [70, 90]     # mid read by no later part: it crosses
    assert boundary_cold([[], [x, out]]) == [0, 90]                # a part that became a view


def test_a_group_the_memory_plans_leave_cold_apart_is_replayed() -> None:
    """MobileNet-V2 (SPR class): a depthwise group whose fused kernel wrote 1.8 MB into a storage first touched
    at its call read 40 us slower than its parts; where the parts had the cold storage, 70-105 us faster than
    predicted. Such a group is replayed (both sides hot) and marked; equal cold bytes leave it in the model run."""
    from fuseguard.verify.perf.profile import HOOK_ERROR_US, RESOLUTION, plan_bound, replay_wanted

    long_us = 10 * HOOK_ERROR_US / RESOLUTION
    fused = [_site("f_dw", ["dw", "add", "clip"], long_us), _site("f_pw", ["pw", "add2"], long_us)]
    unfused = [_site("dw", ["dw"], long_us), _site("add", ["add"], 20.0), _site("clip", ["clip"], 20.0),
               _site("pw", ["pw"], long_us), _site("add2", ["add2"], 20.0)]
    fused[0].cold_bytes = fused[1].cold_bytes = unfused[3].cold_bytes = 1_800_000
    assert replay_wanted(fused, unfused) == ({0}, {0, 1, 2})
    dw, pw = group_parts(fused, unfused)
    assert dw.plan_bound and not pw.plan_bound and (dw.cold_fused, dw.cold_parts) == (1_800_000, 0)
    assert not plan_bound(4096, 0, long_us)         # a page's difference is inside the resolution
    assert not plan_bound(800_000, 0, 750.0)        # 40 us of a 750 us conv: the paired model run reads it better


def test_a_trace_finds_cold_memory_only_beyond_the_caches(tmp_path: Path) -> None:
    """The trace of a small model: with caches larger than all it touches, nothing is cold in the second run but
    the model's output (the VM allocates it afresh each run, at a new address);
    with a one-page cache, the calls find what earlier calls touched cold; one entry a call site either way."""
    import numpy as np

    from fuseguard.compiler.pipeline import compile_model
    from fuseguard.verify.check.model import load_with_inputs
    from fuseguard.verify.perf.profile import TRACE_PAGE, trace_cold_bytes

    path = _ln_model(tmp_path)
    loaded, inputs = load_with_inputs(str(path), None)
    compiled = compile_model(loaded)
    big = trace_cold_bytes(compiled, inputs, capacity=1 << 30)
    small = trace_cold_bytes(compiled, inputs, capacity=TRACE_PAGE)
    assert len(big) == len(small) == len(compiled.report.call_sites)
    called = [args for args in big if args]
    assert called and all(c == 0 for args in called[:-1] for _, _, c in args)
    assert all(c == 0 for _, _, c in called[-1][:-1])
    assert sum(c > 0 for args in small for _, _, c in args) >= len(called)
    assert all(n > 0 for args in called for _, n, _ in args) and np.all([a > 0 for args in called for a, _, _ in args])


def test_a_small_layernorm_group_is_resolved_by_replay(tmp_path: Path) -> None:
    """Add + LayerNorm + Relu on 17 x 192 (ViT-tiny's LayerNorm): each kernel runs for a microsecond or less,
    the hook's own error. From the model run the Relu read 0 us (under the hook's subtracted cost) and the
    LayerNorm 1.9 us; replayed, 0.08 and 0.85 us. In ViT-tiny the model run read such a fused kernel 1.12 us
    against 0.09 us for its parts (12x)."""
    path = _ln_model(tmp_path)
    result = profile_model(str(path), repeats=5, threads=2)
    (ln,) = [g for g in result.groups if g.pattern == "layernorm"]
    assert ln.timing == "replay" and ln.parts >= 2
    assert 1 / 3 < ln.speedup < 3, (ln.fused_us, ln.parts_us)
    relu = [g for g in result.groups if g.parts and g.pattern != "layernorm"]
    assert relu and all(g.timing == "replay" and g.fused_us > 0 and g.parts_us > 0 for g in relu), relu
    off = profile_model(str(path), repeats=5, threads=2, replay=False)
    assert all(g.timing == "model run" for g in off.groups)


def test_a_loss_counts_only_beyond_the_noise_of_the_paired_rounds() -> None:
    """Regret summed every group's shortfall, and a group whose true saving is 0 reads one half the time
    (ResNet-18's 17 conv groups: 0.3-2.9% of the model between runs). The saving's interval over the paired
    rounds separates a real loss from noise; a replayed group (no rounds) needs RESOLUTION."""
    import numpy as np

    from fuseguard.verify.perf.profile import ProfileResult

    rng = np.random.default_rng(3)

    def site(kernel: str, nodes: list[str], samples: list[float], replay: float | None = None) -> SiteTime:
        return SiteTime(kernel=kernel, pattern="conv2d_bias_act", nodes=nodes, us=float(np.median(samples)),
                        bytes=0, flops=0, samples=samples, replay_us=replay)

    noisy = lambda mean: list(mean + rng.normal(0, 40, 20))  # noqa: E731
    fused = [site("f_loss", ["a", "b"], list(900 + rng.normal(0, 10, 20))), site("f_noise", ["c", "d"], noisy(800)),
             site("f_tiny", ["e", "f"], [1.0] * 20, replay=1.2), site("f_flat", ["g", "h"], [1.0] * 20, replay=1.02)]
    unfused = [site("a", ["a"], list(780 + rng.normal(0, 10, 20))), site("b", ["b"], [20.0] * 20),
               site("c", ["c"], noisy(790)), site("d", ["d"], [10.0] * 20),
               site("e", ["e"], [0.5] * 20, replay=0.5), site("f", ["f"], [0.5] * 20, replay=0.5),
               site("g", ["g"], [0.5] * 20, replay=0.5), site("h", ["h"], [0.5] * 20, replay=0.5)]
    result = ProfileResult(model="m", cpu="cpu", threads=2, repeats=20, peak_gflops=1.0, overhead_us=1.0,
                           fused=fused, unfused=unfused)
    result.groups = group_parts(fused, unfused)
    loss, noise, tiny, flat = result.groups
    assert loss.saving_ci is not None and loss.saving_ci[1] < 0
    assert noise.saving_ci is not None and noise.saving_ci[0] < 0 < noise.saving_ci[1]
    assert tiny.timing == "replay" and tiny.saving_ci is None
    assert [g.kernel for g in result.sure_losses()] == ["f_loss", "f_tiny"]
    assert json.loads(json.dumps(result.to_dict()))["groups"][0]["saving_ci"][1] < 0
