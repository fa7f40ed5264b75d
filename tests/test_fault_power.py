"""A sample of the fault-injection power benchmark (benchmarks/fault_power.py runs the full table).

Faults placed in one fused kernel of real exports' fused builds only (verify/debug/faults.py), each the
case that once sent bisect to a correct group: a LLaMA gated MLP (the add + RMSNorm group before it has two
outputs, both were aligned to the norm and the residual sum was blamed), the tiled attention kernel, and
a GPT-2 layer norm downstream of a transpose group that has no unfused counterpart (the attention kernel
needs K untransposed; with head_dim == seq it has the shape of K^T and was aligned to it, then blamed).
Each must be caught, localised to the faulty kernel and proven by its reproducer; a clean build must not
alarm, and the build cache must never serve a faulty build for a clean one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fuseguard.compiler.frontend.loader import load
from fuseguard.compiler.pipeline import CompileOptions
from fuseguard.suites.zoo import load_zoo_model, zoo_entry
from fuseguard.verify.debug.faults import KernelFault, fused_sites, prepared, run_fault


def _loaded(name: str):
    entry = zoo_entry(name)
    return prepared(load(load_zoo_model(name, seed=0), {k: v[0] for k, v in entry.inputs.items()}, name=name))


@pytest.fixture(scope="module")
def llama():
    loaded = _loaded("llama_tiny")
    return loaded, fused_sites(loaded, CompileOptions())


@pytest.mark.parametrize("kind, fault, size", [("gated_mlp", "scale", 0.1), ("attention", "drop", 0.1),
                                               ("rmsnorm", "clip", 0.1)])
def test_llama_fault_is_caught_localised_and_proven(llama, tmp_path: Path, kind: str, fault: str, size: float) -> None:
    loaded, sites = llama
    site = [s for s in sites if s.kind == kind][-1]         # the last layer's: repeated shapes before it
    out = run_fault(loaded, CompileOptions(), site, fault, size, tmp_path)
    assert out.applied, out.detail
    assert out.caught and out.localised and out.proven, out.detail


def test_gpt2_layernorm_fault_past_a_group_without_counterpart(tmp_path: Path) -> None:
    loaded = _loaded("gpt2_tiny")
    site = next(s for s in fused_sites(loaded, CompileOptions()) if s.kind == "layernorm")
    out = run_fault(loaded, CompileOptions(), site, "scale", 0.1, tmp_path)
    assert out.caught and out.localised and out.proven, out.detail


def test_fault_is_never_served_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fuseguard.compiler import cache as build_cache

    monkeypatch.setenv(build_cache.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(build_cache.ENV_OFF, raising=False)
    loaded = _loaded("llama_tiny")
    site = next(s for s in fused_sites(loaded, CompileOptions()) if s.kind == "gated_mlp")
    clean = CompileOptions()
    faulty = CompileOptions(extra_passes=(("after_tir_fusion", KernelFault(site.kernel, "scale", 0.1, site.call)),))
    other = CompileOptions(extra_passes=(("after_tir_fusion", KernelFault(site.kernel, "scale", 0.2, site.call)),))
    shapes, data = loaded.input_shapes, loaded.model.SerializeToString()
    from fuseguard.compiler.hw.target import resolve

    keys = {build_cache.build_key(data, shapes, o, resolve(), name=loaded.name) for o in (clean, faulty, other)}
    assert len(keys) == 3
    assert faulty.unfused().extra_passes == ()              # the unfused build stays the correct reference
