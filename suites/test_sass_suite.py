"""Every suite model compiled for sm_80 and sm_90 down to SASS, on a machine with no GPU: no kernel spills,
none asks for more registers, threads or shared memory than a block may have (compiler/cuda/sass.py).

The default run compiles each built-in model for one architecture (alternating, so both are covered: ~100 s
for all of them on both, cold, 2-core Zen3) and one real model of each kind on one; `pytest --sass-full`
(nightly) compiles every model on both. Needs nvcc (the `cuda-tools` extra); skipped with that reason where there is none.
"""

from __future__ import annotations

import pytest

from fuseguard.compiler.cuda import sass
from fuseguard.compiler.pipeline import CompileOptions, compile_model
from fuseguard.suites.light import LIGHT_ARCHITECTURES
from fuseguard.suites.models import SuiteModel, suite_models, zoo_models

ARCHS = ("sm_80", "sm_90")
#: Real models in the default run, each on one architecture (both with --sass-full, with every other real
#: model): a convnet from the onnx wheel (24 s cold on a 2-core Zen4) and two transformers exported by torch
#: (GPT-2's rewritten Conv1D matmuls carry merged provenance tags; 6-7 s each). MobileNet-V2 (28 s) and the
#: other convnets run nightly.
DEFAULT_REAL = {"squeezenet": "sm_80", "bert_tiny": "sm_80", "gpt2_tiny": "sm_90"}


def _params() -> list:
    out = []
    for index, model in enumerate([*suite_models(), *zoo_models()]):
        for arch in ARCHS:
            if _is_real(model):
                heavy = model.slow or DEFAULT_REAL.get(model.name) != arch
            else:  # built-ins alternate: each on one architecture, half of them on each
                heavy = arch != ARCHS[index % len(ARCHS)]
            out.append(pytest.param(model, arch, id=f"{model.name}-{arch}",
                                    marks=[pytest.mark.sass_full] if heavy else []))
    return out


def _is_real(model: SuiteModel) -> bool:
    """A model nobody here wrote: the onnx wheel's architectures (suites/light.py) or a torch export."""
    return model.name in {a.name for a in LIGHT_ARCHITECTURES} | {m.name for m in zoo_models()}


@pytest.mark.skipif(sass.find_toolkit() is None, reason="no CUDA toolkit (nvcc): pip install -e '.[cuda-tools]'")
@pytest.mark.parametrize("model,arch", _params())
def test_compiles_to_sass(model: SuiteModel, arch: str) -> None:
    build = compile_model(model.make(model.default_dims, seed=0), name=model.name,
                          options=CompileOptions(gpu_arch=arch, sass="require"))
    rep = sass.SassReport.from_dict(build.report.sass)
    print(f"{model.name} {arch}: {len(rep.kernels)} kernels, max {max(k.registers for k in rep.kernels)} registers, "
          f"{sum(1 for k in rep.kernels if k.stack_bytes)} with local memory, lowest occupancy "
          f"{min(k.occupancy for k in rep.kernels):.0%}, nvcc {rep.compile_s:.1f} s")
    assert rep.kernels, f"{model.name}: no CUDA kernels were compiled"
    assert rep, f"{model.name} on {arch}: " + "; ".join(f"{k.kernel}: {k.problems}" for k in rep.problems())
    assert not any(k.spills for k in rep.kernels)
