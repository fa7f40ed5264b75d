"""The A/B gate end to end: two commits of a temporary git repository, each model compiled by both trees'
compilers in their own workers and timed interleaved in fresh processes.

The effect is one no noise can hide: commit B turns the CPU matmul schedule off, which makes the MLP
model several times slower and leaves the convolution model alone. The 10% decision logic is checked with
synthetic samples (a timing effect that small belongs to a benchmark, not a test)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from fuseguard.verify.perf import ab
from fuseguard.verify.check.model import SuiteSpec
from fuseguard.verify.perf.gate import GatePolicy, Verdict
from fuseguard.verify.perf.timing import timing_env

ROOT = Path(__file__).resolve().parent.parent
SWITCH = "    matmul: bool = True"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def two_commits(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    repo = tmp_path_factory.mktemp("abrepo")
    shutil.copytree(ROOT / "compiler", repo / "compiler", ignore=shutil.ignore_patterns("__pycache__"))
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "A")
    a = _git(repo, "rev-parse", "HEAD")
    cpu = repo / "compiler" / "schedule" / "cpu.py"
    text = cpu.read_text()
    assert SWITCH in text, "the CPU matmul switch moved: update this test's slowing change"
    cpu.write_text(text.replace(SWITCH, "    matmul: bool = False"))
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "B: matmul schedule off")
    return repo, a, _git(repo, "rev-parse", "HEAD")


def test_materialize_is_cached_per_commit(two_commits, tmp_path: Path) -> None:
    repo, a, b = two_commits
    tree_a = ab.materialize(a, repo, cache=tmp_path)
    assert (tree_a / "compiler" / "pipeline.py").exists() and tree_a.name == a
    assert ab.materialize("HEAD~1", repo, cache=tmp_path) == tree_a
    assert "matmul: bool = False" in (ab.materialize(b, repo, cache=tmp_path) / "compiler/schedule/cpu.py").read_text()
    with pytest.raises(Exception, match="not a commit"):
        ab.materialize("no-such-branch", repo, cache=tmp_path)


def test_ab_flags_the_slowed_model_and_not_the_other(two_commits, tmp_path: Path) -> None:
    repo, a, b = two_commits
    tree_a, tree_b = (ab.materialize(c, repo, cache=tmp_path / "cache") for c in (a, b))
    options = __import__("fuseguard.compiler.pipeline", fromlist=["CompileOptions"]).CompileOptions().to_dict()
    common = dict(options=options, threads=2, processes=2, repeats=5, env=timing_env(2), base_commit=a,
                  policy=GatePolicy(factor=1.5), max_processes=4, timeout=600)
    slowed = ab.ab_model(SuiteSpec("mlp_gelu", (("batch", 1), ("seq", 64))), tree_a, tree_b,
                         workdir=tmp_path / "mlp", **common)
    kept = ab.ab_model(SuiteSpec("conv_bn_relu", (("batch", 1), ("size", 16))), tree_a, tree_b,
                       workdir=tmp_path / "conv", **common)
    assert slowed.error is None and kept.error is None, (slowed.error, kept.error)
    assert slowed.gate.verdict is Verdict.SLOWER and not slowed, slowed.line()
    assert slowed.candidate_ms > 1.5 * slowed.base_ms
    assert not kept.gate.regressed and kept, kept.line()
    # Only the schedule changed: both builds compute the same numbers.
    assert slowed.outputs_match and kept.outputs_match, (slowed.outputs_note, kept.outputs_note)


def test_build_arm_refuses_the_wrong_compiler(tmp_path: Path) -> None:
    """The worker must import the base tree's compiler; one that resolves elsewhere is an error, not a
    silent A/A run."""
    with pytest.raises(RuntimeError, match="not from"):
        ab.build_arm(str(tmp_path), "m.onnx", "i.npz", {}, str(tmp_path), "base")


def _runs(ratio: float, processes: int, seed: int, n: int = 15) -> list[dict[str, list[float]]]:
    """Synthetic processes: each with its own speed mode (x0.9-1.1), lognormal noise of 3%."""
    rng = np.random.default_rng(seed)
    runs = []
    for _ in range(processes):
        mode = rng.uniform(0.9, 1.1)
        runs.append({"base": list(mode * np.exp(rng.normal(0, 0.03, n))),
                     "candidate": list(mode * ratio * np.exp(rng.normal(0, 0.03, n)))})
    return runs


@pytest.mark.parametrize("seed", range(5))
def test_decision_at_ten_percent(seed: int) -> None:
    policy = GatePolicy(factor=1.10)
    assert ab.decide("m", _runs(1.15, 3, seed), policy).verdict is Verdict.SLOWER
    assert ab.decide("m", _runs(1.00, 3, seed + 100), policy).verdict is Verdict.SAME
    assert ab.decide("m", _runs(1 / 1.15, 3, seed + 200), policy).verdict is Verdict.FASTER


def test_per_process_modes_cancel() -> None:
    """Two processes at very different speeds, no code change: pooled ratios are centred on 1."""
    runs = [{"base": [1.0, 1.01, 0.99], "candidate": [1.0, 0.99, 1.01]},
            {"base": [1.5, 1.51, 1.49], "candidate": [1.5, 1.49, 1.51]}]
    base, cand = ab.pooled(runs)
    assert np.median(cand) == pytest.approx(1.0, abs=0.02) and np.median(base) == pytest.approx(1.0, abs=0.02)


def test_compile_time_and_planned_memory_are_gated() -> None:
    """Resource gates at Inductor's 1.15x: planned memory exactly; compile time above a noise floor and only
    when every one of five interleaved pairs is over the factor (one-sided signed-rank test)."""
    from fuseguard.verify.perf.gate import GateResult

    def result(pairs, planned) -> ab.ABResult:
        gate = GateResult(name="m", verdict=Verdict.SAME, ratio=1.0, ci=(0.98, 1.02), p_value=0.5, n_candidate=10,
                          n_baseline=10, factor=1.1, confidence=0.95, normalised=True)
        compile_s = {k: float(np.median([p[i] for p in pairs])) for i, k in enumerate(ab.ARMS)} if pairs else None
        return ab.ABResult(model="m", base_commit="0" * 40, gate=gate, compile_s=compile_s, compile_pairs=pairs,
                           planned_bytes=planned)

    mib = {"base": 1 << 20, "candidate": 1 << 20}
    same = result([(10.0, 11.0)], mib)
    assert same and not ab.verdict_is_failure(same)
    slow = result([(10.0, 12.0), (11.0, 13.0), (10.0, 12.5), (12.0, 14.0), (10.0, 12.0)], mib)
    assert not slow and ab.verdict_is_failure(slow)
    assert "compile time 10.0 s -> 12.5 s (1.20x over 5 interleaved pairs, p=0.031)" in slow.line()
    # CI's false alarm: a first pair over the factor, the host drifting; one pair under it clears the model
    drift = result([(5.8, 6.7), (6.0, 6.1), (6.4, 7.5), (6.6, 7.7), (6.5, 7.6)], mib)
    assert drift and not drift.resource_regressions()
    unconfirmed = result([(10.0, 12.0)], mib)         # a suspicion alone is not a regression
    assert unconfirmed
    tiny = result([(0.5, 1.0)] * 5, None)            # under the floor: noise, not gated
    assert tiny and not tiny.resource_regressions()
    big = result([(10.0, 10.0)], {"base": 1 << 20, "candidate": 3 << 19})
    assert not big and "planned memory 1.0 MiB -> 1.5 MiB (1.50x)" in big.line()
    old_base = result([(10.0, 10.0)], {"base": None, "candidate": 1 << 20})
    assert old_base       # a base tree that predates planned memory is not gated on it


def test_compile_confirmation_stops_once_it_cannot_fail() -> None:
    """Early stop: after a pair under the factor, five pairs can no longer reach p < 0.05."""
    assert ab.compile_can_still_fail([(10.0, 12.0)])
    assert ab.compile_can_still_fail([(10.0, 12.0), (10.0, 12.5)])
    assert not ab.compile_can_still_fail([(10.0, 12.0), (10.0, 10.0)])
    assert ab.compile_excess_p([(10.0, 10.0)] * 5) == 1.0


def test_an_option_the_base_tree_lacks_is_refused_unless_at_its_default(tmp_path: Path) -> None:
    """`--precision bf16` against a base that predates it must not time an fp32 base against a bf16 candidate."""
    from fuseguard.compiler.errors import UsageError

    args = dict(tree=str(ab.PROJECT_ROOT), model_path=str(tmp_path / "missing.onnx"),
                inputs_path=str(tmp_path / "missing.npz"), out_dir=str(tmp_path), label="base")
    with pytest.raises(UsageError, match="no option frobnicate \\(frobnicate='on' asked\\)"):
        ab.build_arm(options={"frobnicate": "on"}, defaults={"frobnicate": "off"}, **args)
    with pytest.raises(FileNotFoundError):      # at its default it is dropped, and the build goes on
        ab.build_arm(options={"frobnicate": "off"}, defaults={"frobnicate": "off"}, **args)
