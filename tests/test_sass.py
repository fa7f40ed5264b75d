"""CUDA kernels checked offline: ptxas's resource lines, occupancy, the GPU cost model and the vetoes they
drive. The parsing and the models run anywhere; compiling to SASS needs nvcc (the `cuda-tools` extra) and is
skipped with that reason where there is none."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from fuseguard.compiler.cuda import cost as gpu_cost, sass
from fuseguard.compiler.errors import CompileError
from fuseguard.compiler.hw.hardware import GPU_TABLE
from fuseguard.compiler.kernels.attention import choose_tiles, cuda_tile_budget
from fuseguard.compiler.cuda.occupancy import launch_problems, occupancy
from fuseguard.compiler.pipeline import CompileOptions, compile_model
from fuseguard.suites.models import build_pattern_gemm_gelu, get_model

needs_nvcc = pytest.mark.skipif(sass.find_toolkit() is None,
                                reason="no CUDA toolkit (nvcc): pip install -e '.[cuda-tools]'")

SM80_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'fused_matmul_add_kernel' for 'sm_80'
ptxas info    : Function properties for fused_matmul_add_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 64 registers, 6912 bytes smem, 380 bytes cmem[0]
ptxas info    : Compiling entry function 'hungry_kernel' for 'sm_80'
ptxas info    : Function properties for hungry_kernel
    824 bytes stack frame, 1472 bytes spill stores, 1460 bytes spill loads
ptxas info    : Used 32 registers, 384 bytes cmem[0]
"""
SM90_LOG = """\
ptxas info    : Compiling entry function 'softmax_kernel' for 'sm_90'
ptxas info    : Function properties for softmax_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 25 registers, used 1 barriers, 324 bytes smem
"""


def test_parse_ptxas_both_formats() -> None:
    got = sass.parse_ptxas(SM80_LOG)
    assert got["fused_matmul_add_kernel"] == {"registers": 64, "stack_bytes": 0, "spill_stores": 0,
                                              "spill_loads": 0, "static_smem": 6912, "barriers": 0}
    assert got["hungry_kernel"]["spill_stores"] == 1472 and got["hungry_kernel"]["static_smem"] == 0
    assert sass.parse_ptxas(SM90_LOG)["softmax_kernel"] == {"registers": 25, "stack_bytes": 0, "spill_stores": 0,
                                                            "spill_loads": 0, "static_smem": 324, "barriers": 1}


def test_kernel_names_map_to_primfuncs() -> None:
    assert sass.function_of("fused_conv2d_add_kernel") == "fused_conv2d_add"
    assert sass.function_of("fused_attention_kernel_1") == "fused_attention"
    src = 'extern "C" __global__ void __launch_bounds__(256) f_kernel(float* a) {\n}'
    assert sass.launch_bounds(src) == {"f_kernel": 256}


@pytest.mark.parametrize("arch,threads,regs,smem,blocks,fraction,limit", [
    # hand-computed with NVIDIA's occupancy calculator rules (256-register warp allocation, 1 KiB reserved)
    ("sm_80", 256, 32, 0, 8, 1.0, "registers"),
    ("sm_80", 256, 64, 0, 4, 0.5, "registers"),
    ("sm_80", 128, 72, 6912, 7, 28 / 64, "registers"),
    ("sm_80", 128, 32, 40000, 4, 16 / 64, "shared memory"),
    ("sm_86", 1024, 10, 0, 1, 32 / 48, "threads"),
    ("sm_90", 64, 16, 0, 32, 1.0, "threads"),
    ("sm_80", 32, 16, 0, 32, 0.5, "blocks"),
])
def test_occupancy_calculator(arch: str, threads: int, regs: int, smem: int, blocks: int, fraction: float,
                              limit: str) -> None:
    occ = occupancy(GPU_TABLE[arch], threads, regs, smem)
    assert (occ.blocks_per_sm, occ.limit) == (blocks, limit) and occ.fraction == pytest.approx(fraction)


def test_launch_limits() -> None:
    hw = GPU_TABLE["sm_80"]
    assert launch_problems(hw, 256, 64, 6912, 0) == []
    assert "exceed the limit of 1024" in launch_problems(hw, 2048, 16, 0, 0)[0]
    assert "registers per block" in launch_problems(hw, 1024, 128, 0, 0)[0]
    assert "static limit" in launch_problems(hw, 128, 32, 64 * 1024, 0)[0]
    assert launch_problems(hw, 128, 32, 0, 160 * 1024) == []                 # opt-in dynamic: fits an A100
    assert launch_problems(GPU_TABLE["sm_86"], 128, 32, 0, 160 * 1024)      # ... but not an A10
    assert occupancy(hw, 1024, 128, 0).limit == "launch"


def test_saturation_follows_littles_law() -> None:
    sat = {arch: gpu_cost.saturation(GPU_TABLE[arch]) for arch in ("sm_80", "sm_86", "sm_90")}
    assert 0.3 < sat["sm_80"] < 0.4 and sat["sm_86"] < sat["sm_80"] < sat["sm_90"]


def test_cost_model_weighs_occupancy_against_saved_traffic() -> None:
    hw = GPU_TABLE["sm_80"]
    gemm = 64 << 20                                   # a 64 MiB GEMM with a small epilogue
    # an epilogue that drops the GEMM from 50% to 3% occupancy: slower than GEMM + epilogue kernels
    verdict = gpu_cost.compare(hw, "k", gemm, 0.03, [(gemm, 0.5, 10**9), (2 << 20, 1.0, 0)])
    assert verdict.slower and "occupancy (3%" in verdict.reason(hw)
    # flash attention at 17% occupancy that never writes a 256 MiB scores matrix: faster
    attention = gpu_cost.compare(hw, "a", 8 << 20, 0.17,
                                 [(264 << 20, 0.5, 10**9), (512 << 20, 1.0, 0), (264 << 20, 0.5, 10**9)])
    assert not attention.slower
    # a tiny grid cannot fill the GPU whatever its registers
    assert gpu_cost.effective_occupancy(hw, 0.5, 128, 12) == pytest.approx(12 * 4 / (108 * 64))


def test_attention_tile_shrinks_with_shared_memory() -> None:
    """sm_86 has 100 KiB of shared memory per SM, sm_90 228 KiB: at head size 128 the tile follows, leaving
    room for two resident blocks on each."""
    small = choose_tiles(4096, 4096, 128, "float32", "cuda", cuda_tile_budget(GPU_TABLE["sm_86"]))
    large = choose_tiles(4096, 4096, 128, "float32", "cuda", cuda_tile_budget(GPU_TABLE["sm_90"]))
    assert small is not None and large is not None
    assert small[0] * small[1] < large[0] * large[1]


# ----------------------------------------------------------------------------- with nvcc

def _slash_named_model() -> onnx.ModelProto:
    """caffe2's input naming (`gpu_0/data_0`): before the importer's sanitiser it reached nvcc as a
    parameter `gpu_0/data_0_ptr` and no kernel reading it compiled."""
    x = helper.make_tensor_value_info("gpu_0/data_0", TensorProto.FLOAT, [1, 8, 16])
    y = helper.make_tensor_value_info("gpu_0/out:0", TensorProto.FLOAT, [1, 8, 16])
    graph = helper.make_graph([helper.make_node("Relu", ["gpu_0/data_0"], ["r"]),
                               helper.make_node("Sigmoid", ["r"], ["gpu_0/out:0"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@needs_nvcc
def test_kernels_compile_to_sass(arch: str = "sm_90") -> None:
    build = compile_model(get_model("bert_encoder").make({}, seed=0),
                          options=CompileOptions(gpu_arch=arch, sass="require"))
    rep = sass.SassReport.from_dict(build.report.sass)
    assert rep and rep.arch == arch and len(rep.kernels) >= 5
    assert all(k.registers > 0 and k.threads > 0 and not k.spills for k in rep.kernels)
    attention = [k for k in rep.kernels if k.group == "attention"]
    assert attention and attention[0].static_smem + attention[0].dynamic_smem > 0
    assert {k.schedule for k in rep.kernels} >= {"dlight.gpu.Matmul", "dlight.gpu.GeneralReduction"}
    assert rep.render().row_count == len(rep.kernels)


@needs_nvcc
def test_attention_kernel_fits_each_architecture() -> None:
    """The tile chosen for the architecture's shared memory is what ptxas and the launch check accept."""
    from fuseguard.suites.models import build_attention

    model = build_attention(seq=1024, heads=2, head_dim=128)
    used = {}
    for arch in ("sm_86", "sm_90"):
        build = compile_model(model, options=CompileOptions(gpu_arch=arch, sass="require"))
        rep = sass.SassReport.from_dict(build.report.sass)
        (k,) = [k for k in rep.kernels if k.group == "attention"]
        used[arch] = k.static_smem + k.dynamic_smem
        assert rep and used[arch] <= cuda_tile_budget(GPU_TABLE[arch]) and k.occupancy_limit != "launch"
    assert used["sm_86"] < used["sm_90"]


def test_provenance_tags_are_identifiers() -> None:
    """Tags become kernel parameter names: a merged tag with '+' broke GPT-2's and LLaMA's CUDA."""
    import re

    from fuseguard.compiler.ir import tags

    merged = tags.merged(["n43_MatMul", "n44x45_Add", "lv"], "Matmul")
    assert merged == "n43x44x45_Matmul" and re.fullmatch(r"[A-Za-z_]\w*", merged)
    assert tags.indices(merged) == [43, 44, 45] and tags.indices("lv3") == []


@needs_nvcc
def test_input_names_become_valid_identifiers() -> None:
    build = compile_model(_slash_named_model(), options=CompileOptions(gpu_arch="sm_80", sass="require"))
    assert sass.SassReport.from_dict(build.report.sass).kernels
    assert build.input_names == ["gpu_0/data_0"]       # the user's names are unchanged


def _register_hungry(tokens: int, prefixes: tuple[str, ...] = ("fused_relax_matmul_relax_add_relax_nn_gelu",)):
    """A user pass putting, in place of the PrimFuncs named `prefixes...`, a hand-written matmul + bias + GELU kernel that keeps 128 outputs per thread in registers at 1024
    threads per block: ptxas cannot fit it in the 64 registers a thread may have and spills."""
    from tvm import tirx
    from tvm.script import tirx as T

    K, N, R = 64, 256, 128

    @T.prim_func
    def hungry(x: T.Buffer((T.int64(tokens), T.int64(K)), "float32"), w: T.Buffer((T.int64(K), T.int64(N)), "float32"),
               b: T.Buffer((T.int64(N),), "float32"), out: T.Buffer((T.int64(tokens), T.int64(N)), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for blk in T.thread_binding(tokens * N // R // 1024, thread="blockIdx.x"):
            for t in T.thread_binding(1024, thread="threadIdx.x"):
                acc = T.alloc_buffer((1024, R), "float32", scope="local")
                for j in T.unroll(R):
                    acc[t, j] = b[(t % 2) * R + j]
                for k in range(K):
                    for j in T.unroll(R):
                        acc[t, j] = acc[t, j] + x[blk * 512 + t // 2, k] * w[k, (t % 2) * R + j]
                for j in T.unroll(R):
                    out[blk * 512 + t // 2, (t % 2) * R + j] = acc[t, j] * T.float32(0.5) * (
                        T.float32(1) + T.erf(acc[t, j] * T.float32(0.7071067811865476)))

    def swap(mod):
        for gv, func in list(mod.functions_items()):
            if isinstance(func, tirx.PrimFunc) and gv.name_hint.startswith(prefixes):
                mod[gv] = hungry.with_attr("global_symbol", gv.name_hint)
        return mod

    return swap


@needs_nvcc
def test_register_hungry_fusion_is_vetoed() -> None:
    """The fused kernel spills (ptxas says so): the group is refused with that reason and the build ships
    its parts, which do not spill."""
    swap = _register_hungry(512)
    model = build_pattern_gemm_gelu(tokens=512)
    build = compile_model(model, options=CompileOptions(gpu_arch="sm_80", sass="require",
                                                        extra_passes=(("after_tir_fusion", swap),)))
    vetoed = [d for d in build.report.decisions if d.source == "veto"]
    assert [d.pattern for d in vetoed] == ["matmul_bias_gelu"]
    assert "spills registers" in vetoed[0].reason and "sm_80" in vetoed[0].reason
    assert not build.report.pattern_groups
    assert sass.SassReport.from_dict(build.report.sass)          # what ships has no problem
    # without the swap the same group fuses
    plain = compile_model(model, options=CompileOptions(gpu_arch="sm_80", sass="require"))
    assert [g.pattern for g in plain.report.pattern_groups] == ["matmul_bias_gelu"]


@needs_nvcc
def test_unfixable_kernel_fails_the_build_naming_it() -> None:
    """A problem no veto removes (the parts' own kernel spills too: TVM's FuseOps makes the same
    matmul + add + gelu kernel) fails the build in one line naming the kernel."""
    swap = _register_hungry(512, ("fused_relax_matmul_relax_add_relax_nn_gelu", "fused_matmul_add_gelu"))
    with pytest.raises(CompileError, match=r"kernel fused_matmul_add_gelu_kernel cannot run on sm_80: spills"):
        compile_model(build_pattern_gemm_gelu(tokens=512), options=CompileOptions(
            gpu_arch="sm_80", sass="require", extra_passes=(("after_tir_fusion", swap),)))


# ----------------------------------------------------------------------------- grouped convs on CUDA

def _reference_grouped_conv(x, w, stride, pad, dilation, groups):
    import numpy as np

    n, c, h, wd = x.shape
    f, cg, kh, kw = w.shape
    top, left, bottom, right = pad
    xp = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    oh = (h + top + bottom - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + left + right - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((n, f, oh, ow), dtype=np.float64)
    fg = f // groups
    for o in range(f):
        g = o // fg
        for i in range(kh):
            for j in range(kw):
                patch = xp[:, g * cg:(g + 1) * cg, i * dilation[0]: i * dilation[0] + stride[0] * oh: stride[0],
                           j * dilation[1]: j * dilation[1] + stride[1] * ow: stride[1]]
                out[:, o] += np.einsum("nchw,c->nhw", patch, w[o, :, i, j])
    return out


@pytest.mark.parametrize("shape,groups,stride,pad,dilation", [
    ((1, 96, 13, 13), 2, (1, 1), (2, 2, 2, 2), (1, 1)),       # AlexNet's conv2 at a smaller size
    ((1, 24, 10, 10), 3, (1, 1), (0, 0, 0, 0), (1, 1)),       # ShuffleNet v1's 1x1 group conv
    ((2, 12, 9, 11), 4, (2, 1), (1, 0, 2, 1), (1, 2)),        # strides, asymmetric padding, dilation
])
def test_grouped_conv_as_batched_gemm_computes_the_conv(shape, groups, stride, pad, dilation) -> None:
    """The CUDA legalization's compute (run here through LLVM) equals a direct grouped convolution."""
    import numpy as np
    import tvm
    from tvm import te

    from fuseguard.compiler.cuda.legalize import _grouped_conv2d_te

    rng = np.random.default_rng(0)
    c = shape[1]
    k = 3 if groups != 3 else 1
    x = rng.standard_normal(shape).astype("float32")
    w = rng.standard_normal((2 * c, c // groups, k, k)).astype("float32")
    data, weight = te.placeholder(x.shape, name="x"), te.placeholder(w.shape, name="w")
    out = _grouped_conv2d_te(data, weight, list(stride), list(pad), list(dilation), groups, "float32")
    lib = tvm.compile(tvm.IRModule({"main": te.create_prim_func([data, weight, out])}), target="llvm")
    got = tvm.runtime.tensor(np.zeros([int(d) for d in out.shape], "float32"))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w), got)
    np.testing.assert_allclose(got.numpy(), _reference_grouped_conv(x, w, stride, pad, dilation, groups),
                               rtol=1e-4, atol=1e-4)


@needs_nvcc
def test_grouped_convs_get_gemm_schedules() -> None:
    """AlexNet's groups=2 convs: dlight's Matmul rule, not Fallback (which spilled on sm_80 and sm_90)."""
    build = compile_model(get_model("alexnet").make({}, seed=0), options=CompileOptions(
        gpu_arch="sm_80", sass="require", fusion=False))
    rep = sass.SassReport.from_dict(build.report.sass)
    convs = [k for k in rep.kernels if "conv" in k.kernel]
    assert len(convs) == 5 and {k.schedule for k in convs} == {"dlight.gpu.Matmul"}
    assert rep and not any(k.spills for k in rep.kernels)


def test_reference_provider_follows_the_device() -> None:
    import onnxruntime as ort

    from fuseguard.verify.check.reference import reference_providers

    assert reference_providers(False) == ["CPUExecutionProvider"]
    want = "CUDAExecutionProvider" if "CUDAExecutionProvider" in ort.get_available_providers() else "CPUExecutionProvider"
    assert reference_providers(True)[0] == want


@needs_nvcc
def test_cuda_jit_callback_compiles_what_the_check_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, TVM compiles the kernels' source through `tvm_callback_cuda_compile` when the library loads:
    fuseguard's callback returns a cubin built by the checked nvcc for the device's architecture."""
    import tvm_ffi

    from fuseguard.compiler.cuda import jit as cuda_jit

    monkeypatch.setenv("FUSEGUARD_CUDA_ARCH", "sm_90")
    build = compile_model(get_model("mlp_gelu").make({}, seed=0), options=CompileOptions(gpu_arch="sm_90", sass="off"))
    assert cuda_jit.install()
    cubin = tvm_ffi.get_global_func("tvm_callback_cuda_compile")(build.cuda_source())
    assert bytes(cubin[:4]) == b"\x7fELF"
