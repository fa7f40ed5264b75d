"""The fused attention kernel: numerics (numpy float64, ONNX Runtime), O(S) memory, CUDA codegen.

The CUDA kernel cannot run without a GPU, so its algorithm is also checked through
``emulate_cuda=True``: the same phases with serial loops instead of thread bindings, on the CPU.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax

from fuseguard.compiler.kernels import (
    allocated_buffers,
    attention_call,
    attention_primfunc,
    attention_scratch_bytes,
    attention_smem_bytes,
    choose_tiles,
    cuda_max_shared_bytes,
    host_target,
)
from fuseguard.compiler.hw.target import cuda_device_present

CPU = host_target()
SM80 = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
SM90 = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, mask: np.ndarray | None) -> np.ndarray:
    """softmax(scale Q K^T + mask) V in float64."""
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k.astype(np.float64)) * scale
    if mask is not None:
        s = s + mask.astype(np.float64)
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhij,bhjd->bhid", p, v.astype(np.float64))


def make_inputs(b: int, h: int, sq: int, sk: int, d: int, mask_shape: tuple[int, ...] | None, seed: int = 0,
                dtype: str = "float32") -> tuple[np.ndarray, ...]:
    """Random Q/K/V and a 0/-10000 mask that hides ~30% of keys but never the first one."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, sq, d)).astype(dtype)
    k = rng.standard_normal((b, h, sk, d)).astype(dtype)
    v = rng.standard_normal((b, h, sk, d)).astype(dtype)
    if mask_shape is None:
        return q, k, v, None
    mask = np.where(rng.random(mask_shape) < 0.3, -10000.0, 0.0).astype(dtype)
    mask[..., 0] = 0.0
    return q, k, v, mask


def run_kernel(func: tvm.tirx.PrimFunc, target: tvm.target.Target, q, k, v, mask) -> np.ndarray:
    lib = tvm.compile(func, target=target)
    out = tvm.runtime.tensor(np.zeros(q.shape, q.dtype))
    args = [tvm.runtime.tensor(x) for x in (q, k, v)]
    if mask is not None:
        args.append(tvm.runtime.tensor(mask))
    lib["fused_attention"](*args, out)
    return out.numpy()


CPU_CASES = [
    # (batch, heads, seq_q, seq_k, head_dim, mask shape)
    (1, 12, 1, 1, 64, None),
    (1, 12, 1, 1, 64, (1, 1, 1, 1)),
    (2, 12, 7, 7, 64, (2, 1, 1, 7)),
    (1, 12, 128, 128, 64, (1, 1, 1, 128)),
    (1, 12, 257, 257, 64, None),
    (2, 3, 257, 130, 16, (2, 1, 257, 130)),  # full per-row mask, Sq != Sk
    (1, 2, 7, 300, 8, (7, 300)),  # rank-2 mask broadcast over batch and heads
    (2, 4, 33, 9, 12, (1, 4, 1, 9)),  # per-head mask, head_dim not a multiple of 8
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"-m{c[5]}")
def test_cpu_matches_numpy(case: tuple) -> None:
    b, h, sq, sk, d, mask_shape = case
    q, k, v, mask = make_inputs(b, h, sq, sk, d, mask_shape)
    scale = 1.0 / np.sqrt(d)
    func = attention_primfunc(b, h, sq, sk, d, mask_shape=mask_shape, scale=scale, target=CPU)
    got = run_kernel(func, CPU, q, k, v, mask)
    np.testing.assert_allclose(got, reference(q, k, v, scale, mask), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("value_dim", [64, 24, 6, 5])
def test_cpu_value_head_size_differs_from_the_key_head_size(value_dim: int) -> None:
    """LeViT's V rows are 4x its Q/K rows (16 -> 64); register tiles of 4, 2 and 1 value columns."""
    b, h, sq, sk, d = 1, 4, 49, 49, 16
    q, k, _, mask = make_inputs(b, h, sq, sk, d, (1, h, sq, sk))
    v = np.random.default_rng(5).standard_normal((b, h, sk, value_dim)).astype("float32")
    func = attention_primfunc(b, h, sq, sk, d, mask_shape=mask.shape, scale=0.25, target=CPU, value_dim=value_dim)
    lib = tvm.compile(func, target=CPU)
    out = tvm.runtime.tensor(np.zeros((b, h, sq, value_dim), "float32"))
    lib["fused_attention"](*(tvm.runtime.tensor(x) for x in (q, k, v, mask)), out)
    np.testing.assert_allclose(out.numpy(), reference(q, k, v, 0.25, mask), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="head size"):
        attention_primfunc(b, h, sq, sk, d, scale=0.25, target=SM80, value_dim=value_dim + 1)


def test_cpu_symbolic_sequences_one_kernel_for_every_size() -> None:
    """Batch and both sequences symbolic (a per-key mask over them too): one compiled kernel, any size."""
    b, sq, sk = (tvm.tirx.Var(n, "int64") for n in ("b", "sq", "sk"))
    func = attention_primfunc(b, 4, sq, sk, 16, mask_shape=(b, 1, 1, sk), scale=0.25, target=CPU,
                              tile_sizes=(16, 16))
    lib = tvm.compile(func, target=CPU)
    for bs, q_len, k_len in ((1, 1, 1), (2, 17, 5), (1, 40, 33)):
        q, k, v, mask = make_inputs(bs, 4, q_len, k_len, 16, (bs, 1, 1, k_len), seed=q_len)
        out = tvm.runtime.tensor(np.zeros(q.shape, q.dtype))
        lib["fused_attention"](*(tvm.runtime.tensor(x) for x in (q, k, v, mask)), out)
        np.testing.assert_allclose(out.numpy(), reference(q, k, v, 0.25, mask), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="specialised per shape"):
        attention_primfunc(1, 4, sq, sq, 16, scale=0.25, target=SM80, tile_sizes=(16, 16))
    with pytest.raises(ValueError, match="tile_sizes"):
        attention_primfunc(1, 4, sq, sq, 16, scale=0.25, target=CPU)


def test_cpu_masked_keys_get_no_weight() -> None:
    """With -10000 on a key, changing that key's V row must not change the output."""
    b, h, s, d = 1, 2, 37, 16
    q, k, v, _ = make_inputs(b, h, s, s, d, None)
    mask = np.zeros((b, 1, 1, s), np.float32)
    mask[..., 5::3] = -10000.0
    func = attention_primfunc(b, h, s, s, d, mask_shape=mask.shape, scale=0.25, target=CPU)
    base = run_kernel(func, CPU, q, k, v, mask)
    v2 = v.copy()
    v2[:, :, 5::3, :] = 1e3
    np.testing.assert_allclose(run_kernel(func, CPU, q, k, v2, mask), base, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tiles", [(8, 4), (16, 12), (64, 64)])
def test_cpu_explicit_tiles(tiles: tuple[int, int]) -> None:
    """Tiles that do not divide the sequence (and a block_k that is not a multiple of 4)."""
    b, h, sq, sk, d = 1, 3, 45, 51, 32
    q, k, v, mask = make_inputs(b, h, sq, sk, d, (1, 1, 1, sk), seed=3)
    func = attention_primfunc(b, h, sq, sk, d, mask_shape=mask.shape, scale=0.2, target=CPU,
                              block_q=tiles[0], block_k=tiles[1])
    np.testing.assert_allclose(run_kernel(func, CPU, q, k, v, mask), reference(q, k, v, 0.2, mask),
                               rtol=1e-4, atol=1e-4)


def test_cpu_float16() -> None:
    b, h, s, d = 1, 2, 40, 64
    q, k, v, mask = make_inputs(b, h, s, s, d, (b, 1, 1, s), dtype="float16")
    func = attention_primfunc(b, h, s, s, d, dtype="float16", mask_shape=mask.shape, scale=0.125, target=CPU)
    got = run_kernel(func, CPU, q, k, v, mask)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), reference(q, k, v, 0.125, mask), rtol=2e-3, atol=2e-3)


EMULATED_CASES = [
    (2, 3, 7, 7, 16, None, None),
    (1, 2, 70, 45, 64, (1, 1, 1, 45), None),
    (2, 2, 33, 70, 8, (2, 1, 33, 70), None),
    (1, 2, 65, 130, 32, (1, 1, 1, 130), (64, 64)),  # the opt-in (dynamic shared memory) tile size
]


@pytest.mark.parametrize("case", EMULATED_CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"-m{c[5]}-t{c[6]}")
def test_cuda_algorithm_emulated_on_cpu(case: tuple) -> None:
    b, h, sq, sk, d, mask_shape, tiles = case
    q, k, v, mask = make_inputs(b, h, sq, sk, d, mask_shape, seed=1)
    bq, bk = tiles if tiles else (None, None)
    func = attention_primfunc(b, h, sq, sk, d, mask_shape=mask_shape, scale=0.3, target=CPU,
                              emulate_cuda=True, block_q=bq, block_k=bk, max_shared_bytes=10**6)
    np.testing.assert_allclose(run_kernel(func, CPU, q, k, v, mask), reference(q, k, v, 0.3, mask),
                               rtol=1e-4, atol=1e-4)


def _onnx_attention(b: int, h: int, s: int, d: int, scale: float):
    """The unfused ONNX subgraph MatMul(Q, K^T) -> Mul(scale) -> Add(mask) -> Softmax -> MatMul(V)."""
    from onnx import TensorProto, helper, numpy_helper

    f32 = TensorProto.FLOAT
    nodes = [
        helper.make_node("Transpose", ["K"], ["Kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["Q", "Kt"], ["S"]),
        helper.make_node("Mul", ["S", "scale"], ["Ss"]),
        helper.make_node("Add", ["Ss", "mask"], ["Sm"]),
        helper.make_node("Softmax", ["Sm"], ["P"], axis=-1),
        helper.make_node("MatMul", ["P", "V"], ["O"]),
    ]
    graph = helper.make_graph(
        nodes, "attention",
        [helper.make_tensor_value_info("Q", f32, [b, h, s, d]),
         helper.make_tensor_value_info("K", f32, [b, h, s, d]),
         helper.make_tensor_value_info("V", f32, [b, h, s, d]),
         helper.make_tensor_value_info("mask", f32, [b, 1, 1, s])],
        [helper.make_tensor_value_info("O", f32, [b, h, s, d])],
        initializer=[numpy_helper.from_array(np.array(scale, np.float32), "scale")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("seq", [7, 128])
def test_cpu_matches_onnxruntime(seq: int) -> None:
    ort = pytest.importorskip("onnxruntime")
    b, h, d = 2, 12, 64
    scale = 0.125
    q, k, v, mask = make_inputs(b, h, seq, seq, d, (b, 1, 1, seq), seed=7)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(_onnx_attention(b, h, seq, d, scale).SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    expected = sess.run(None, {"Q": q, "K": k, "V": v, "mask": mask})[0]
    func = attention_primfunc(b, h, seq, seq, d, mask_shape=mask.shape, scale=scale, target=CPU)
    np.testing.assert_allclose(run_kernel(func, CPU, q, k, v, mask), expected, rtol=1e-4, atol=1e-4)


def _scratch(func: tvm.tirx.PrimFunc) -> list[tuple[str, int, int]]:
    """(scope, elements, bytes) of every allocated buffer."""
    rows = []
    for buf in allocated_buffers(func):
        n = int(np.prod([int(x) for x in buf.shape]))
        rows.append((buf.scope(), n, n * tvm.runtime.DataType(buf.dtype).bits // 8))
    return rows


@pytest.mark.parametrize("target", [CPU, SM80], ids=["cpu", "cuda"])
def test_memory_is_linear_in_seq(target: tvm.target.Target) -> None:
    """No buffer of S*S elements at S = 1024, and scratch is the same at S = 1024 and 4096."""
    per_seq = {}
    for seq in (1024, 4096):
        func = attention_primfunc(1, 12, seq, seq, 64, mask_shape=(1, 1, 1, seq), scale=0.125, target=target)
        rows = _scratch(func)
        assert rows, "expected scratch allocations in the kernel"
        assert max(n for _, n, _ in rows) < seq * seq
        per_seq[seq] = sorted(rows)
    assert per_seq[1024] == per_seq[4096]


def test_scratch_matches_cost_model() -> None:
    """attention_scratch_bytes / attention_smem_bytes account for exactly what the kernels allocate."""
    s, d = 1000, 64
    bq, bk = choose_tiles(s, s, d, "float32", "llvm", None)
    cpu = attention_primfunc(1, 2, s, s, d, mask_shape=None, scale=0.1, target=CPU, block_q=bq, block_k=bk)
    # The CPU kernel also keeps two register tiles (c, c2) and the m_new row: not tile scratch.
    tile_bytes = sum(nbytes for _, n, nbytes in _scratch(cpu) if n >= bq * min(bk, d))
    assert tile_bytes + 16 * bq == attention_scratch_bytes(bq, bk, d)
    bq, bk = choose_tiles(s, s, d, "float32", "llvm", None, 2 * d)      # LeViT: wider value rows
    cpu = attention_primfunc(1, 2, s, s, d, scale=0.1, target=CPU, block_q=bq, block_k=bk, value_dim=2 * d)
    tile_bytes = sum(nbytes for _, n, nbytes in _scratch(cpu) if n >= bq * min(bk, d))
    assert tile_bytes + 16 * bq == attention_scratch_bytes(bq, bk, d, 2 * d) > attention_scratch_bytes(bq, bk, d)
    for dtype in ("float32", "float16"):
        bq, bk = choose_tiles(s, s, d, dtype, "cuda", 48 * 1024)
        gpu = attention_primfunc(1, 2, s, s, d, dtype=dtype, scale=0.1, target=SM80, block_q=bq, block_k=bk)
        shared = sum(nbytes for scope, _, nbytes in _scratch(gpu) if scope.startswith("shared"))
        assert shared == attention_smem_bytes(bq, bk, d, dtype) <= 48 * 1024


def _cuda_source(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> str:
    exe = tvm.compile(func, target=target)
    return "\n".join(m.inspect_source() for m in exe.mod.imports)


@pytest.mark.parametrize("target", [SM80, SM90], ids=["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_source_uses_shared_memory(target: tvm.target.Target, dtype: str) -> None:
    seq = 1024
    func = attention_primfunc(1, 12, seq, seq, 64, dtype=dtype, mask_shape=(1, 1, 1, seq), scale=0.125,
                              target=target)
    src = _cuda_source(func, target)
    assert "__global__" in src and "__shared__" in src and "__syncthreads" in src
    sizes = [int(n) for n in re.findall(r"\[(\d+)\];", src)]
    assert sizes and max(sizes) < seq * seq


@pytest.mark.parametrize("target", [SM80, SM90], ids=["sm_80", "sm_90"])
def test_cuda_opt_in_shared_memory_is_dynamic(target: tvm.target.Target) -> None:
    """Tiles above 48 KiB (opt-in on sm_80/sm_90) must use dynamic shared memory to compile."""
    budget = cuda_max_shared_bytes(target)
    assert budget > 48 * 1024
    bq, bk = choose_tiles(2048, 2048, 64, "float32", "cuda", budget)
    assert attention_smem_bytes(bq, bk, 64, "float32") > 48 * 1024
    func = attention_primfunc(1, 12, 2048, 2048, 64, scale=0.125, target=target, max_shared_bytes=budget)
    src = _cuda_source(func, target)
    assert re.search(r"extern\s+__shared__|__shared__[^;]*\[\];", src)


def test_choose_tiles_budget() -> None:
    assert choose_tiles(512, 512, 64, "float32", "cuda", 1024) is None
    assert choose_tiles(512, 512, 64, "float32", "llvm", 64) is None
    for budget in (16 * 1024, 48 * 1024, 163 * 1024):
        bq, bk = choose_tiles(512, 512, 64, "float16", "cuda", budget)
        assert attention_smem_bytes(bq, bk, 64, "float16") <= budget
    small = choose_tiles(1, 3, 64, "float32", "llvm", None)
    assert small is not None and small[0] <= 8 and small[1] <= 4
    with pytest.raises(ValueError):
        attention_primfunc(1, 1, 512, 512, 64, scale=1.0, target=SM80, max_shared_bytes=1024)


def test_rejects_bad_mask_shape() -> None:
    with pytest.raises(ValueError, match="broadcast"):
        attention_primfunc(1, 2, 8, 8, 16, mask_shape=(1, 3, 1, 8), scale=1.0, target=CPU)


@pytest.mark.parametrize("with_mask", [True, False])
def test_relax_call_tir_end_to_end(with_mask: bool) -> None:
    """attention_call inside a BlockBuilder function; compiled by tvm.compile and run on the VM."""
    b, h, s, d = 2, 4, 19, 16
    q, k, v, mask = make_inputs(b, h, s, s, d, (b, 1, 1, s) if with_mask else None, seed=5)
    target = tvm.target.Target({"kind": "llvm"})
    bb = relax.BlockBuilder()
    qv = relax.Var("q", relax.TensorType((b, h, s, d), "float32"))
    kv = relax.Var("k", relax.TensorType((b, h, s, d), "float32"))
    vv = relax.Var("v", relax.TensorType((b, h, s, d), "float32"))
    params = [qv, kv, vv]
    mv = None
    if with_mask:
        mv = relax.Var("mask", relax.TensorType(mask.shape, "float32"))
        params.append(mv)
    with bb.function("main", params):
        with bb.dataflow():
            att = bb.emit(attention_call(bb, qv, kv, vv, mv, 0.25, target))
            out = bb.emit_output(relax.op.add(att, relax.const(1.0, "float32")))
        bb.emit_func_output(out)
    mod = bb.get()
    assert any(isinstance(f, tvm.tirx.PrimFunc) for f in mod.functions.values())
    exe = tvm.compile(mod, target=target)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    args = [tvm.runtime.tensor(x) for x in (q, k, v)] + ([tvm.runtime.tensor(mask)] if with_mask else [])
    got = vm["main"](*args).numpy()
    np.testing.assert_allclose(got, reference(q, k, v, 0.25, mask) + 1.0, rtol=1e-4, atol=1e-4)



@pytest.mark.gpu
@pytest.mark.skipif(not cuda_device_present(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_device_matches_numpy(dtype: str) -> None:
    dev = tvm.cuda(0)
    target = tvm.target.Target.from_device(dev)
    b, h, s, d = 2, 12, 257, 64
    q, k, v, mask = make_inputs(b, h, s, s, d, (b, 1, 1, s), seed=11, dtype=dtype)
    for budget in (None, cuda_max_shared_bytes(target)):
        func = attention_primfunc(b, h, s, s, d, dtype=dtype, mask_shape=mask.shape, scale=0.125,
                                  target=target, max_shared_bytes=budget)
        lib = tvm.compile(func, target=target)
        out = tvm.runtime.tensor(np.zeros(q.shape, dtype), dev)
        lib["fused_attention"](*[tvm.runtime.tensor(x, dev) for x in (q, k, v, mask)], out)
        tol = 1e-4 if dtype == "float32" else 2e-3
        np.testing.assert_allclose(out.numpy().astype(np.float64), reference(q, k, v, 0.125, mask),
                                   rtol=tol, atol=tol)


@pytest.mark.parametrize("emulate_cuda", [False, True], ids=["cpu", "cuda-emulated"])
def test_a_row_masked_with_finfo_min_is_ordinary_and_one_of_minus_inf_is_nan(emulate_cuda: bool) -> None:
    """As an unfused softmax: a query row whose keys are all masked with finfo.min (HF's mask value) averages
    V uniformly; all -inf gives NaN (0/0). Both kernels took scores below -3e38 for masked, so the
    finfo.min row came out 0 (CPU) or NaN (CUDA) fused while the unfused build averaged it. Tiles of 8
    keys make the row span several key blocks (the running max must start at -inf, not a finite floor)."""
    b, h, s, d = 1, 2, 20, 16
    q, k, v, _ = make_inputs(b, h, s, s, d, None, seed=4)
    mask = np.zeros((b, 1, s, s), np.float32)
    mask[..., 3, :] = np.finfo(np.float32).min
    mask[..., 7, :] = -np.inf
    mask[..., 11, 5:] = np.finfo(np.float32).min          # a later block all finfo.min after finite scores
    func = attention_primfunc(b, h, s, s, d, mask_shape=mask.shape, scale=0.25, target=CPU, block_q=8, block_k=8,
                              emulate_cuda=emulate_cuda, max_shared_bytes=10**6)
    got = run_kernel(func, CPU, q, k, v, mask)
    np.testing.assert_allclose(got[:, :, 3], v.mean(axis=2), rtol=1e-4, atol=1e-5)
    assert np.isnan(got[:, :, 7]).all()
    finite = [i for i in range(s) if i != 7]
    with np.errstate(invalid="ignore"):
        want = reference(q, k, v, 0.25, mask)
    np.testing.assert_allclose(got[:, :, finite], want[:, :, finite], rtol=1e-4, atol=1e-5)
