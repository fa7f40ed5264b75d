"""verify.perf.gate (and the verify.perf.timing it consumes): verdicts on seeded synthetic samples, no wall-clock asserts."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

import fuseguard.verify.perf.timing as timing
from fuseguard.compiler.errors import UsageError
from fuseguard.verify.perf.baselines import BaselineFile, Entry, Metadata
from fuseguard.verify.perf.gate import Gate, GatePolicy, Measurement, Verdict, _decide, compare, p_value
from fuseguard.verify.perf.timing import Samples, measure, measure_interleaved

META = Metadata(device="test", tvm_version="0.27.0", fuseguard_version="0.1.0", date="2026-01-01T00:00:00+00:00",
                threads=1, reference_kind="onnxruntime")
RAW_META = Metadata(device="test", tvm_version="0.27.0", fuseguard_version="0.1.0", date="2026-01-01T00:00:00+00:00")


def noisy(rng: np.random.Generator, median: float, n: int, sigma: float = 0.03) -> np.ndarray:
    return median * rng.lognormal(0.0, sigma, n)


def baseline(seed: int = 0, n: int = 30, sigma: float = 0.03, reference: bool = True) -> Entry:
    rng = np.random.default_rng(seed)
    if not reference:
        return Entry.from_samples(noisy(rng, 10.0, n, sigma), RAW_META)
    return Entry.from_samples(noisy(rng, 10.0, n, sigma), META, reference_ms=noisy(rng, 5.0, n, sigma))


def candidate(slowdown: float, seed: int = 1, n: int = 15, sigma: float = 0.03, host: float = 1.0) -> Measurement:
    """A run ``slowdown`` times slower than the baseline on a host ``host`` times slower overall."""
    rng = np.random.default_rng(seed)
    return Measurement.of(noisy(rng, 10.0 * slowdown * host, n, sigma), noisy(rng, 5.0 * host, n, sigma),
                          "onnxruntime")


def sampler(slowdown: float, seed: int = 2, sigma: float = 0.03) -> tuple[Callable[[int], Measurement], list[int]]:
    rng = np.random.default_rng(seed)
    asked: list[int] = []

    def more(n: int) -> Measurement:
        asked.append(n)
        return Measurement.of(noisy(rng, 10.0 * slowdown, n, sigma), noisy(rng, 5.0, n, sigma), "onnxruntime")

    return more, asked


# ------------------------------------------------------------------------------------------- verdicts


def test_a_20_percent_slowdown_is_slower_and_renders_one_line() -> None:
    result = compare("resnet50", candidate(1.20), baseline())
    assert result.verdict is Verdict.SLOWER and result.regressed
    assert result.ci is not None and result.ci[0] < 1.2 < result.ci[1]
    assert result.ci[0] < result.ratio < result.ci[1]
    assert result.p_value is not None and result.p_value < 0.01
    assert re.fullmatch(r"resnet50: slower 1\.\d\dx \(95% CI 1\.\d\d-1\.\d\d, p=\d(\.\d+)?e-\d+, n=15 vs 30\)",
                        str(result)), str(result)


def test_no_change_is_same() -> None:
    result = compare("resnet50", candidate(1.0), baseline())
    assert result.verdict is Verdict.SAME and not result.regressed
    assert result.ci is not None and 1 / 1.1 <= result.ci[0] and result.ci[1] <= 1.1


def test_a_significant_3_percent_shift_under_a_10_percent_factor_is_same() -> None:
    result = compare("resnet50", candidate(1.03, n=30, sigma=0.005), baseline(sigma=0.005))
    assert result.p_value is not None and result.p_value < 0.01  # real, just small
    assert result.verdict is Verdict.SAME
    assert "within the 1.1x factor" in result.note


def test_a_speedup_is_faster_with_a_hint_to_update_the_baseline() -> None:
    result = compare("resnet50", candidate(0.8), baseline())
    assert result.verdict is Verdict.FASTER and not result.regressed
    assert "update the baseline" in str(result)


def test_no_baseline_is_its_own_state_and_samples_nothing_more() -> None:
    more, asked = sampler(1.0)
    result = compare("resnet50", candidate(1.0), None, more=more)
    assert result.verdict is Verdict.NO_BASELINE and not result.regressed
    assert str(result).startswith("resnet50: no baseline (n=15)")
    assert asked == []


def test_small_noisy_runs_buy_more_samples_up_to_the_budget() -> None:
    more, asked = sampler(1.0, sigma=0.3)
    result = compare("resnet50", candidate(1.0, n=4, sigma=0.3), baseline(n=6, sigma=0.3), more=more)
    assert asked and sum(asked) == result.n_candidate - 4
    assert result.rounds == len(asked) and result.n_candidate <= GatePolicy().max_samples
    assert result.verdict in (Verdict.SAME, Verdict.INCONCLUSIVE)


def test_without_a_sampler_an_unclear_run_is_decided_on_what_there_is() -> None:
    result = compare("resnet50", candidate(1.0, n=4, sigma=0.3), baseline(n=6, sigma=0.3))
    assert result.rounds == 0 and result.n_candidate == 4
    assert result.verdict in (Verdict.SAME, Verdict.INCONCLUSIVE)


def test_a_sampler_that_runs_dry_ends_the_loop() -> None:
    asked: list[int] = []

    def empty(n: int) -> list[float]:
        asked.append(n)
        return []

    result = compare("m", candidate(1.0, n=4, sigma=0.3), baseline(n=6, sigma=0.3), more=empty)
    assert len(asked) == 1 and result.n_candidate == 4


def test_plain_sample_lists_extend_the_candidate_only() -> None:
    rng = np.random.default_rng(5)
    grown = candidate(1.0, n=4).extend(list(noisy(rng, 10.0, 3)))
    assert len(grown.samples_ms) == 7 and grown.reference_ms is not None and len(grown.reference_ms) == 4


# ------------------------------------------------------------------------------------------- decision table

POLICY = GatePolicy()


@pytest.mark.parametrize("p, r, lo, hi, exhausted, expected", [
    (1e-6, 1.25, 1.20, 1.30, False, Verdict.SLOWER),
    (1e-6, 1.08, 1.06, 1.11, False, None),           # real, below the factor, CI reaches it: sample more
    (1e-6, 1.08, 1.06, 1.11, True, Verdict.SLOWER),  # ... and at the budget flag it
    (1e-6, 1.03, 1.02, 1.04, False, Verdict.SAME),   # significant but inside the band
    (1e-6, 0.80, 0.78, 0.82, False, Verdict.FASTER),
    (1e-6, 0.93, 0.90, 0.95, False, None),
    (0.30, 1.00, 0.97, 1.03, False, Verdict.SAME),   # CI inside the band
    (0.30, 1.00, 0.80, 1.30, False, None),           # wide CI, budget left: sample more
    (0.30, 1.00, 0.80, 1.30, True, Verdict.SAME),    # high p after the budget
    (0.05, 1.05, 0.85, 1.30, True, Verdict.INCONCLUSIVE),
    (1e-5, 0.89, 0.81, 1.12, False, None),           # "significant" but the CI holds 1: the two disagree
    (1e-5, 0.89, 0.81, 1.12, True, Verdict.INCONCLUSIVE),
    (1e-5, 1.15, 0.99, 1.40, True, Verdict.INCONCLUSIVE),
])
def test_decision_table(p: float, r: float, lo: float, hi: float, exhausted: bool, expected: Verdict | None) -> None:
    decided = _decide(p, r, lo, hi, POLICY, exhausted)
    assert (None if decided is None else decided[0]) is expected


def test_p_value_is_the_smaller_of_mann_whitney_and_ks() -> None:
    rng = np.random.default_rng(3)
    a, b = noisy(rng, 10, 20), noisy(rng, 10.3, 20)
    expected = min(stats.mannwhitneyu(a, b, alternative="two-sided").pvalue, stats.ks_2samp(a, b).pvalue)
    assert p_value(a, b) == pytest.approx(expected)
    assert p_value([1.0, 1.0], [1.0, 1.0]) == 1.0


# ------------------------------------------------------------------------------------------- normalisation


def test_a_slower_host_is_cancelled_by_the_same_run_reference() -> None:
    host_slow = candidate(1.0, host=1.25)
    assert compare("m", host_slow, baseline()).verdict is Verdict.SAME
    raw = Measurement(host_slow.samples_ms)
    result = compare("m", raw, baseline())
    assert result.verdict is Verdict.SLOWER and "[raw]; this run measured no reference" in str(result)


def test_a_different_reference_kind_is_compared_raw_and_says_so() -> None:
    run = candidate(1.0)
    other = Measurement(run.samples_ms, run.reference_ms, "calibration")
    result = compare("m", other, baseline())
    assert not result.normalised
    assert "references differ (calibration now vs onnxruntime in the baseline)" in result.note


def test_baselines_without_reference_samples_still_normalise() -> None:
    entry = baseline()
    bare = Entry(entry.median_ms, entry.iqr_ms, entry.n, entry.samples_ms, entry.reference_median_ms,
                 entry.normalised, entry.metadata, reference_samples_ms=None)
    result = compare("m", candidate(1.2), bare)
    assert result.normalised and result.verdict is Verdict.SLOWER


def test_no_reference_anywhere_compares_raw() -> None:
    rng = np.random.default_rng(4)
    result = compare("m", list(noisy(rng, 12.0, 15)), baseline(reference=False))
    assert result.verdict is Verdict.SLOWER and not result.normalised and result.note == ""


# ------------------------------------------------------------------------------------------- policies


def test_per_model_overrides_of_factor_and_budget() -> None:
    gate = Gate.from_config({"resnet50": {"factor": 1.3}, "bert|ids=1x128|fused": {"max_samples": 20}})
    base = BaselineFile(path=Path("sm_80.json"), arch="sm_80",
                        entries={"resnet50|data=1x3x224x224|fused": baseline(),
                                 "vgg|data=1x3x224x224|fused": baseline()})
    assert gate.check("resnet50|data=1x3x224x224|fused", candidate(1.2), base).verdict is Verdict.SAME
    assert gate.check("vgg|data=1x3x224x224|fused", candidate(1.2), base).verdict is Verdict.SLOWER
    assert gate.check("bert|ids=1x128|fused", candidate(1.2), base).verdict is Verdict.NO_BASELINE
    assert gate.policy_for("bert|ids=1x128|fused").max_samples == 20
    assert gate.policy_for("bert|ids=1x128|unfused").max_samples == 60
    with pytest.raises(UsageError, match="unknown field.*'facter'"):
        Gate.from_config({"resnet50": {"facter": 1.3}})


@pytest.mark.parametrize("kwargs, message", [
    ({"factor": 1.0}, "factor must be > 1"),
    ({"alpha": 0.2}, "need 0 < alpha < same_p < 1"),
    ({"max_samples": 1}, "max_samples >= 2"),
    ({"confidence": 1.5}, "confidence must be in"),
])
def test_policy_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        GatePolicy(**kwargs)


# ------------------------------------------------------------------------------------------- timing


def test_outliers_are_flagged_and_kept() -> None:
    run = Samples(tuple(v * 1e6 for v in [1.0, 1.1, 0.9, 1.05, 0.95, 9.0, 1.0, 1.02]))
    assert run.outliers == (5,)
    assert run.n == 8 and 9.0 in run.ms
    assert "1 outlier kept" in run.summary()


def test_preempted_samples_are_set_aside_only_when_enough_clean_ones_remain() -> None:
    times = tuple(v * 1e6 for v in [1.0, 5.0, 1.01, 0.99, 6.0, 1.02, 1.0])
    run = Samples(times, preempted=(0, 2, 0, 0, 1, 0, 0))
    assert run.n_clean == 5 and 5.0 not in run.usable_ms and len(run.usable_ms) == 5
    assert "2 preempted" in run.summary()
    busy = Samples(times, preempted=(1, 1, 1, 0, 1, 1, 1))
    assert len(busy.usable_ms) == 7  # too few clean samples: compare everything
    m = Measurement.of(run, busy, "onnxruntime")
    assert m.set_aside == 2 and m.noisy
    assert "noisy host" in compare("m", m, baseline()).note


def test_measure_counts_calls_and_syncs_per_sample() -> None:
    calls, syncs = [], []
    run = measure(lambda: calls.append(1), warmup=2, repeats=7, min_time_s=0.0, sync=lambda: syncs.append(1),
                  threads=3)
    assert run.n >= 7 and run.inner == 1 and run.threads == 3
    assert len(calls) == 2 + run.n and len(syncs) == 2 + run.n
    assert run.n_clean >= 7 or run.n == 28  # preempted samples are retried, within 4 x repeats


def test_measure_batches_calls_too_short_to_time_alone() -> None:
    calls = []
    run = measure(lambda: calls.append(1), warmup=1, repeats=3, min_time_s=1e-3)
    assert run.inner > 1
    assert len(calls) >= 1 + 3 * run.inner


def test_interleaving_alternates_direction_each_round(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing, "_preemptions", None)
    order: list[str] = []
    measure_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, warmup=0, repeats=4,
                        min_time_s=0.0)
    assert "".join(order) == "abbaabba"


def test_contenders_are_timed_from_a_thread_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """From the main thread (its stack at a random offset within a page), 2-3 of 60 fresh processes ran two of
    SqueezeNet's TVM convs 3x slower; from a thread, none (`timing.TIME_ON_OWN_THREAD`). One thread for every
    call of a process (TVM starts a thread pool a calling thread); switched off, the caller's thread."""
    import threading

    monkeypatch.setattr(timing, "_preemptions", None)
    seen: list[int] = []
    fns = {"a": lambda: seen.append(threading.get_ident())}
    measure_interleaved(fns, warmup=0, repeats=2, min_time_s=0.0)
    measure_interleaved(fns, warmup=0, repeats=2, min_time_s=0.0)
    assert len(set(seen)) == 1 and seen[0] != threading.main_thread().ident
    with pytest.raises(UsageError, match="min_sampled_s"):      # errors reach the caller
        measure_interleaved(fns, repeats=3, min_sampled_s=-1.0)
    monkeypatch.setattr(timing, "TIME_ON_OWN_THREAD", False)
    seen.clear()
    measure_interleaved(fns, warmup=0, repeats=2, min_time_s=0.0)
    assert set(seen) == {threading.get_ident()}


def test_sampling_budget_adds_rounds_until_every_contender_ran_that_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """``min_sampled_s``: a fast contender gets rounds beyond ``repeats`` until its samples add up to the budget
    (the slower one gets as many rounds: interleaved); the rounds stop at ``BUDGET_MAX_ROUNDS``; 0 keeps
    ``repeats``."""
    import time

    monkeypatch.setattr(timing, "_preemptions", None)

    def sleeper(seconds: float):
        return lambda: time.sleep(seconds)

    runs = measure_interleaved({"fast": sleeper(0.002), "slow": sleeper(0.004)}, warmup=0, repeats=3,
                               min_time_s=0.0, min_sampled_s=0.03)
    fast = runs["fast"]
    assert runs["slow"].n == fast.n and 3 < fast.n <= 15
    assert fast.ms.sum() >= 30 and fast.ms[:-1].sum() < 30      # stopped at the round that reached the budget
    assert measure_interleaved({"a": lambda: None}, warmup=0, repeats=3, min_time_s=0.0)["a"].n == 3
    capped = measure_interleaved({"a": lambda: None}, warmup=0, repeats=3, min_time_s=0.0, min_sampled_s=60.0)
    assert capped["a"].n == timing.BUDGET_MAX_ROUNDS
    with pytest.raises(UsageError, match="min_sampled_s"):
        measure_interleaved({"a": lambda: None}, repeats=3, min_sampled_s=-1.0)


def test_settled_sampling_waits_for_idle_and_warms_each_contender(monkeypatch: pytest.MonkeyPatch) -> None:
    """``settle``: before each sample the process goes idle and the contender runs once untimed (its own pool
    warm, no other pool spinning): with a/b interleaved every sample is preceded by a call of the same one."""
    monkeypatch.setattr(timing, "_preemptions", None)
    waits: list[int] = []
    monkeypatch.setattr(timing, "wait_until_idle", lambda: waits.append(1))
    order: list[str] = []
    measure_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, warmup=0, repeats=2,
                        min_time_s=0.0, settle=True)
    assert "".join(order) == "aabbbbaa" and len(waits) == 4


def test_waiting_until_idle_outlasts_a_spinning_thread() -> None:
    """A thread spin-waiting 60 ms (as a runtime's pool does after a run) keeps the process busy: the wait
    returns only once it stopped; an idle process settles within a few windows."""
    import threading
    import time

    stop = time.perf_counter() + 0.06
    spinner = threading.Thread(target=lambda: [None for _ in iter(lambda: time.perf_counter() < stop, False)])
    spinner.start()
    waited = timing.wait_until_idle()
    spinner.join()
    assert waited is not None and waited >= 0.05
    assert timing.wait_until_idle() < 0.05
    assert timing.wait_until_idle(cap_s=0.0) is None


def test_ort_spins_only_when_asked() -> None:
    parked = timing.ort_timing_options(2)
    assert parked.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    brief = timing.ort_timing_options(2, pools="brief")
    assert brief.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert brief.get_session_config_entry("session.intra_op.spin_duration_us") == str(timing.BRIEF_ORT_SPIN_US)
    spinning = timing.ort_timing_options(2, pools="deployed")      # ORT's default: the key is not set
    with pytest.raises(RuntimeError, match="allow_spinning"):
        spinning.get_session_config_entry("session.intra_op.allow_spinning")
    with pytest.raises(UsageError, match="thread pools: 'spinning' is not one of parked, brief, deployed"):
        timing.ort_timing_options(2, pools="spinning")


def test_a_pause_separates_contenders_only_where_they_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """``switch_pause_s``: a sleep before each sample whose contender differs from the one before (A B | B A:
    none at the turn), so a briefly spinning pool has parked; none by default."""
    monkeypatch.setattr(timing, "_preemptions", None)
    events: list[str] = []
    monkeypatch.setattr(timing.time, "sleep", lambda s: events.append(f"pause{s}"))
    fns = {"a": lambda: events.append("a"), "b": lambda: events.append("b")}
    measure_interleaved(fns, warmup=0, repeats=2, min_time_s=0.0, switch_pause_s=0.5)
    assert events == ["a", "pause0.5", "b", "b", "pause0.5", "a"]
    events.clear()
    measure_interleaved(fns, warmup=0, repeats=2, min_time_s=0.0)
    assert events == ["a", "b", "b", "a"]


def test_preempted_samples_are_retried_until_enough_are_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    pattern = iter([False, True] * 100)  # every other sample is preempted
    state = {"count": 0, "calls": 0}

    def preemptions() -> int:
        state["calls"] += 1
        if state["calls"] % 2 == 0 and next(pattern):  # reading after a sample: add a switch
            state["count"] += 1
        return state["count"]

    monkeypatch.setattr(timing, "_preemptions", preemptions)
    run = measure(lambda: None, warmup=0, repeats=5, min_time_s=0.0)
    assert run.preempted == (0, 1) * 4 + (0,)  # stops at the 5th clean sample
    capped = measure(lambda: None, warmup=0, repeats=5, min_time_s=0.0, max_rounds=6)
    assert capped.n == 6


def test_samples_extend_and_measurement_usage_errors() -> None:
    a = Samples((1e6, 2e6), preempted=(0, 0), threads=2)
    b = Samples((3e6,), preempted=(1,))
    assert a.extend(b).preempted == (0, 0, 1) and a.extend(b).threads == 2
    with pytest.raises(UsageError):
        measure(lambda: None, repeats=0)
    with pytest.raises(UsageError, match="no candidate samples"):
        compare("m", [], baseline())


def test_foreign_load_is_not_the_tick_rounding_of_a_short_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc/stat counts 10 ms ticks per CPU: over a ~60 ms measurement on a quiet machine, rounding alone
    read 11-24% "other processes" and made real slowdowns "inconclusive". A machine count within a tick per
    CPU at each end of our own (exact) time is nobody else's; a neighbour spinning for the window is."""
    import os
    import resource
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    if timing._cpu_jiffies() is None:
        pytest.skip("no /proc/stat on this platform: the load is not measured here")
    cpus, tick = os.cpu_count() or 1, 1 / timing._clock_ticks()
    clock = iter([100.0, 100.06])
    machine = iter([(50.0, 0.0), (50.0 + 0.10 + 2 * cpus * tick, 0.0)])   # ours + a tick per CPU each end
    rusage = iter([SimpleNamespace(ru_utime=1.0, ru_stime=0.0), SimpleNamespace(ru_utime=1.10, ru_stime=0.0)])
    with monkeypatch.context() as m:
        m.setattr(timing.time, "perf_counter", lambda: next(clock))
        m.setattr(timing, "_cpu_jiffies", lambda: next(machine))
        m.setattr(resource, "getrusage", lambda who: next(rusage))
        with timing.ForeignLoad() as meter:
            pass
    assert meter.fraction is not None and meter.fraction < 1e-9
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        with timing.ForeignLoad() as meter:
            time.sleep(0.5)
    finally:
        hog.kill()
        hog.wait()
    assert meter.fraction is not None and meter.fraction > 0.25, meter.fraction
