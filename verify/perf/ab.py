"""`fuseguard gate --base REV`: the candidate's compiler against a base revision's, same machine, same run.

Why: a stored per-class baseline goes blind when CI lands on a new CPU class, and one recorded in a single
process carries that process's speed mode. An A/B run needs neither: REV's tree is materialised once per
commit (`git archive` into the cache directory), each model is compiled by REV's compiler and by the
candidate's in their own worker processes (that tree first on `sys.path`; the candidate's harness, inputs
and ONNX file for both, so only the compiler differs), and the two exported builds are timed interleaved
(A B B A ...) with ONNX Runtime as a third arm, in several fresh processes. Within each process both arms'
samples are divided by that process's base median, so a per-process speed mode shifts both and cancels;
the pooled ratios go through the same gate as a stored baseline (factor AND Mann-Whitney/KS, more fresh
processes while unclear). The outputs of the two builds are compared too: a change that alters numerics is
reported beside one that alters speed.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from fuseguard.compiler.errors import UsageError

from .gate import GatePolicy, GateResult, Measurement, Verdict, evaluate
from fuseguard.compiler.paths import PROJECT_ROOT

ARMS = ("base", "candidate")
#: Compile time and planned memory fail past this factor, the one PyTorch's Inductor dashboard gates compile
#: time at. Planned memory is deterministic (the static plan's bytes); compile time is not.
RESOURCE_FACTOR = 1.15
#: Builds shorter than this are not compile-time gated: process start-up and scheduling noise on a shared
#: 2-core machine moves a 1 s build by +-30% (measured: conv_bn_relu 0.8-1.2 s over ten builds).
COMPILE_FLOOR_S = 2.0
#: A compile-time excess seen in the first pair of builds is confirmed with up to this many interleaved pairs
#: (order alternating, CPU seconds of the compiling process). Why pairs and a test, not medians: one build's
#: CPU time drifts with the host (Zen4, 2 vCPUs: SqueezeNet 2.5-4.0 s over ten builds of identical
#: compilers, climbing through the run), so a median of three per arm read 1.15x in CI for a commit that
#: changed no behaviour; the pair ratio cancels the drift (0.80-1.10 over the same ten builds).
COMPILE_CONFIRM_PAIRS = 5
#: The one-sided Wilcoxon signed-rank test of log(pair ratio) - log(RESOURCE_FACTOR) must reach this: with
#: five pairs that needs every pair over the factor (exact p = 1/32), and a pair under it ends the
#: confirmation early.
COMPILE_ALPHA = 0.05


def compile_excess_p(pairs: Sequence[tuple[float, float]]) -> float:
    """p that the candidate's compile time exceeds RESOURCE_FACTOR x the base's, from (base, candidate) pairs."""
    from scipy.stats import wilcoxon

    d = [float(np.log(c / b) - np.log(RESOURCE_FACTOR)) for b, c in pairs if b > 0 and c > 0]
    d = [x for x in d if x != 0.0]
    if not d:
        return 1.0
    return float(wilcoxon(d, alternative="greater", method="exact").pvalue)


def compile_can_still_fail(pairs: Sequence[tuple[float, float]], total: int = COMPILE_CONFIRM_PAIRS) -> bool:
    """Whether more pairs (all far over the factor at best) could still make the excess significant."""
    more = [(1.0, 1e6)] * max(0, total - len(pairs))
    return compile_excess_p([*pairs, *more]) < COMPILE_ALPHA


def _git(repo: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise UsageError(f"git {' '.join(args)} in {repo}: {err}") from None
    if done.returncode != 0:
        raise UsageError(f"git {' '.join(args)} in {repo}: {done.stderr.strip().splitlines()[-1:] or ['failed']}"[:300])
    return done.stdout.strip()


def resolve_commit(rev: str, repo: Path = PROJECT_ROOT) -> str:
    """The full commit id of `rev` (a branch, tag, `HEAD~1`, a sha)."""
    try:
        return _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except UsageError:
        raise UsageError(f"--base {rev}: not a commit in {repo}") from None


def default_base(repo: Path = PROJECT_ROOT) -> str | None:
    """What a pull request is gated against: the merge-base with `origin/main` (or `main`), or, on main
    itself, the previous commit. None outside a git checkout or with no history."""
    try:
        head = resolve_commit("HEAD", repo)
    except UsageError:
        return None
    for branch in ("origin/main", "main"):
        try:
            base = _git(repo, "merge-base", "HEAD", branch)
        except UsageError:
            continue
        if base and base != head:
            return base
    try:
        return resolve_commit("HEAD~1", repo)
    except UsageError:
        return None


def materialize(rev: str, repo: Path = PROJECT_ROOT, cache: Path | None = None) -> Path:
    """REV's tree as a directory, cached per commit (written whole, then renamed into place)."""
    from filelock import FileLock

    sha = resolve_commit(rev, repo)
    from fuseguard.compiler.cache import home

    root = (cache or home()) / "revs"
    root.mkdir(parents=True, exist_ok=True)
    tree = root / sha
    with FileLock(str(root / f"{sha}.lock"), timeout=600):
        if (tree / ".fuseguard-complete").exists():
            return tree
        tmp = Path(tempfile.mkdtemp(prefix=f".{sha[:12]}-", dir=root))
        archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", sha], capture_output=True)
        if archive.returncode != 0:
            raise UsageError(f"git archive {sha[:12]}: {archive.stderr.decode(errors='replace').strip()[:200]}")
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
        if not (tmp / "compiler").is_dir():
            raise UsageError(f"--base {rev}: commit {sha[:12]} has no compiler/ package")
        (tmp / ".fuseguard-complete").write_text(sha + "\n")
        if tree.exists():
            import shutil

            shutil.rmtree(tree)
        tmp.rename(tree)
    return tree


# ----------------------------------------------------------------------------- worker tasks

def build_arm(tree: str, model_path: str, inputs_path: str, options: Mapping[str, Any], out_dir: str,
              label: str, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """In a worker whose `sys.path` starts with `tree`: compile with THAT tree's compiler, export the
    library, run it once on the inputs (for the output comparison). An option the tree's compiler lacks
    is dropped only at its default (`defaults`, the candidate's): `--precision bf16` against a base that
    predates it would otherwise time an fp32 base against a bf16 candidate."""
    import time
    import warnings

    # THAT tree's compiler by its folder name: a base revision's tree comes first on sys.path, so
    # `compiler` is its code (compiler/_aliases.py aliases the name only to this installation's own
    # folder, which is what the candidate's tree is).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import compiler
        from compiler.pipeline import CompileOptions, compile_model

    where = Path(compiler.__file__).resolve()
    if Path(tree).resolve() not in where.parents:
        raise RuntimeError(f"{label}: imported compiler from {where}, not from {tree}")

    known = {f.name for f in fields(CompileOptions)}
    def plain(k: str, v: Any) -> Any:
        if k == "disabled_patterns":
            return frozenset(v)
        if k == "dynamic":
            from compiler.dynamic import parse_dynamic    # the tree's, as above (compiler/dynamic.py in every layout)

            return parse_dynamic(v)
        return v

    lacking = sorted(k for k, v in options.items() if k not in known and (defaults is None or defaults.get(k) != v))
    if lacking:
        raise UsageError(f"{label} tree ({tree}): its compiler has no option {', '.join(lacking)} "
                         f"({', '.join(f'{k}={options[k]!r}' for k in lacking)} asked); gate against a later base")
    opts = CompileOptions(**{k: plain(k, v) for k, v in options.items() if k in known})
    with np.load(inputs_path) as z:
        inputs = {k: z[k] for k in z.files}
    start, start_cpu = time.perf_counter(), time.process_time()
    compiled = compile_model(model_path, {k: v.shape for k, v in inputs.items()}, options=opts)
    compile_s, compile_cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    out = Path(out_dir)
    compiled.executable.export_library(str(out / f"{label}.so"))
    outputs = compiled.run(inputs)
    np.savez(out / f"{label}-outputs.npz", **{f"output_{i}": o for i, o in enumerate(outputs)})
    report = getattr(compiled, "report", None)
    return {"input_names": list(compiled.input_names), "compile_s": compile_s, "compile_cpu_s": compile_cpu_s,
            "kernels": getattr(report, "kernels", None), "planned_bytes": getattr(report, "planned_bytes", None),
            "output_names": list(getattr(compiled, "output_names", []) or [])}


def time_arms(directory: str, *, threads: int, repeats: int = 7, warmup: int = 2,
              flip: bool = False) -> dict[str, list[float]]:
    """In a fresh process: base, candidate and ONNX Runtime timed interleaved; usable samples in ms.

    `flip` loads and starts with the candidate instead of the base: alternated across processes, since
    the first library loaded and the first arm timed can be systematically favoured (an A/A run of
    identical compilers read the second-loaded arm 1.03-1.05x slower on four of six models, Zen4)."""
    import json

    import onnx
    import tvm
    from tvm import relax

    from .bench import ort_session
    from .timing import measure_interleaved

    d = Path(directory)
    meta = json.loads((d / "meta.json").read_text())
    with np.load(d / "inputs.npz") as z:
        inputs = {k: z[k] for k in z.files}
    fns: dict[str, Callable[[], object]] = {}
    for label in (tuple(reversed(ARMS)) if flip else ARMS):
        vm = relax.VirtualMachine(tvm.runtime.load_module(str(d / f"{label}.so")), tvm.cpu())
        args = [tvm.runtime.tensor(np.ascontiguousarray(inputs[n])) for n in meta[label]["input_names"]]
        main = vm["main"]
        fns[label] = (lambda main=main, args=args: main(*args))
    session = ort_session(onnx.load(str(d / "model.onnx")), threads, True)
    feed = {i.name: inputs[i.name] for i in session.get_inputs()}
    fns["ort"] = lambda: session.run(None, feed)
    samples = measure_interleaved(fns, warmup=warmup, repeats=repeats, threads=threads)
    return {k: [float(v) for v in s.usable_ms] for k, s in samples.items()}


# ----------------------------------------------------------------------------- statistics and results

def pooled(runs: Sequence[Mapping[str, Sequence[float]]]) -> tuple[list[float], list[float]]:
    """Each process's base and candidate samples divided by that process's base median, pooled."""
    base: list[float] = []
    cand: list[float] = []
    for run in runs:
        scale = float(np.median(run["base"]))
        base.extend(float(v) / scale for v in run["base"])
        cand.extend(float(v) / scale for v in run["candidate"])
    return base, cand


def decide(name: str, runs: list[dict[str, list[float]]], policy: GatePolicy,
           more_run: Callable[[], dict[str, list[float]] | None] | None = None) -> GateResult:
    """The gate's verdict on pooled per-process ratios; while unclear, `more_run` adds a fresh process to
    BOTH arms (None when the budget is spent)."""
    from dataclasses import replace

    from .baselines import Entry, Metadata

    meta = Metadata(device="same run", tvm_version="", fuseguard_version="", date="")
    rounds = 0
    while True:
        base, cand = pooled(runs)
        entry = Entry.from_samples(base, meta)
        run = Measurement.of(cand)
        exhausted = more_run is None or len(cand) >= policy.max_samples
        result = evaluate(name, run, entry, policy, exhausted=exhausted, rounds=rounds)
        if result is None:
            extra = more_run() if more_run is not None else None
            if extra is None:
                more_run = None
                continue
            runs.append(extra)
            rounds += 1
            continue
        own = result.note.replace("improvement: update the baseline so later regressions are measured from here",
                                  "the candidate is faster")   # no stored baseline to update in an A/B run
        note = "; ".join(x for x in (own, f"{len(runs)} fresh process(es), base and candidate interleaved") if x)
        return replace(result, normalised=True, note=note)


@dataclass
class ABResult:
    """One model's A/B verdict; truthy unless the candidate is slower or the run failed."""

    model: str
    base_commit: str
    gate: GateResult | None = None
    base_ms: float | None = None
    candidate_ms: float | None = None
    ort_ms: float | None = None
    outputs_match: bool | None = None
    outputs_note: str = ""
    compile_s: dict[str, float] | None = None        # median build time per arm (CPU s when both report it)
    compile_pairs: list[tuple[float, float]] | None = None   # (base, candidate) s of each interleaved pair
    planned_bytes: dict[str, int | None] | None = None
    kernels: dict[str, Any] | None = None
    error: str | None = None

    def __bool__(self) -> bool:
        return self.error is None and self.gate is not None and not self.gate.regressed \
            and not self.resource_regressions()

    def compile_regressed(self) -> bool:
        """Past the factor in every sense the pairs allow: median over the floor, a confirmed signed-rank excess."""
        c, pairs = self.compile_s or {}, self.compile_pairs or []
        if not c.get("base") or c.get("candidate", 0) < COMPILE_FLOOR_S or not pairs:
            return False
        return len(pairs) >= COMPILE_CONFIRM_PAIRS and compile_excess_p(pairs) < COMPILE_ALPHA

    def resource_regressions(self) -> list[str]:
        """Compile time or planned memory past RESOURCE_FACTOR of the base's (empty when neither)."""
        out = []
        c = self.compile_s or {}
        if self.compile_regressed():
            pairs = self.compile_pairs or []
            ratio = float(np.median([b_c[1] / b_c[0] for b_c in pairs]))
            out.append(f"compile time {c['base']:.1f} s -> {c['candidate']:.1f} s ({ratio:.2f}x over "
                       f"{len(pairs)} interleaved pairs, p={compile_excess_p(pairs):.3f})")
        m = self.planned_bytes or {}
        if m.get("base") and m.get("candidate") and m["candidate"] > RESOURCE_FACTOR * m["base"]:
            out.append(f"planned memory {m['base'] / 2**20:.1f} MiB -> {m['candidate'] / 2**20:.1f} MiB "
                       f"({m['candidate'] / m['base']:.2f}x)")
        return out

    @property
    def regressed(self) -> bool:
        return self.gate is not None and self.gate.regressed

    @property
    def verdict(self) -> str:
        return "error" if self.error else (self.gate.verdict.value if self.gate else "-")

    def line(self) -> str:
        if self.error:
            return f"{self.model}: error: {self.error}"
        assert self.gate is not None
        text = f"{self.gate.line()} vs {self.base_commit[:12]}"
        if self.base_ms and self.candidate_ms and self.ort_ms:
            text += f"; base {self.base_ms:.3f} ms, candidate {self.candidate_ms:.3f} ms, ORT {self.ort_ms:.3f} ms"
        if self.outputs_match is False:
            text += f"; OUTPUTS CHANGED: {self.outputs_note}"
        for what in self.resource_regressions():
            text += f"; REGRESSED {what} (gate {RESOURCE_FACTOR}x)"
        return text

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = self.verdict
        d["resource_regressions"] = self.resource_regressions()
        if self.gate is not None:
            d["gate"] = {**asdict(self.gate), "verdict": self.gate.verdict.value, "line": self.gate.line()}
        return d


def compare_arm_outputs(directory: Path) -> tuple[bool, str]:
    """Base outputs against the candidate's, with the float32 tolerances of `fuseguard verify`."""
    from ..check.compare import compare_outputs

    with np.load(directory / "base-outputs.npz") as b, np.load(directory / "candidate-outputs.npz") as c:
        base = [b[k] for k in sorted(b.files, key=lambda s: int(s.rsplit("_", 1)[1]))]
        cand = [c[k] for k in sorted(c.files, key=lambda s: int(s.rsplit("_", 1)[1]))]
    if len(base) != len(cand):
        return False, f"{len(base)} output(s) in the base build, {len(cand)} in the candidate's"
    result = compare_outputs(cand, base, check_dtype=False)
    return bool(result), ("same within tolerance" if result else result.summary())


def ab_model(source: Any, base_tree: Path, candidate_tree: Path, *, base_commit: str, workdir: Path,
             options: Mapping[str, Any], threads: int, processes: int = 4, repeats: int = 7,
             policy: GatePolicy = GatePolicy(), seed: int = 0, timeout: float | None = 1800,
             env: Mapping[str, str] | None = None, shapes: Mapping[str, Sequence[int]] | None = None,
             max_processes: int = 8, progress: Callable[[str], None] | None = None) -> ABResult:
    """Compile `source` with both trees, time both builds in fresh processes, gate, compare outputs."""
    import json

    from fuseguard.compiler.errors import FuseguardError
    from fuseguard.compiler.frontend.loader import load
    from fuseguard.compiler.pipeline import CompileOptions

    from ..check.model import SuiteSpec
    from ..check.inputs import make_inputs
    from ..worker import Worker, WorkerFailure, WorkerTaskError

    say = progress or (lambda _m: None)
    name = source.label if isinstance(source, SuiteSpec) else str(source)
    result = ABResult(model=name, base_commit=base_commit)
    try:
        loaded = load(source.build() if isinstance(source, SuiteSpec) else source,
                      None if isinstance(source, SuiteSpec) else shapes, name=name)
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "model.onnx").write_bytes(loaded.model.SerializeToString())
        inputs = make_inputs(loaded.model, loaded.input_shapes, seed=seed)
        np.savez(workdir / "inputs.npz", **inputs)
        meta: dict[str, Any] = {"model": name}
        trees = {"base": base_tree, "candidate": candidate_tree}

        def build(label: str) -> dict[str, Any]:
            say(f"{name}: compiling with the {label} compiler ({trees[label]})")
            with Worker(sys_path=[str(trees[label])], env=dict(env or {}), forward_output=False) as worker:
                return worker.call("fuseguard.verify.perf.ab:build_arm", what=f"compiling {name} with the {label} tree",
                                   timeout=timeout, tree=str(trees[label]), model_path=str(workdir / "model.onnx"),
                                   inputs_path=str(workdir / "inputs.npz"), options=dict(options),
                                   defaults=CompileOptions().to_dict(),
                                   out_dir=str(workdir), label=label)

        for label in ARMS:
            meta[label] = build(label)
        (workdir / "meta.json").write_text(json.dumps(meta))
        def seconds(built: dict[str, Any]) -> float:      # CPU time: another process's work does not count
            return float(built.get("compile_cpu_s") or built["compile_s"])

        pairs = [(seconds(meta["base"]), seconds(meta["candidate"]))]
        if pairs[0][1] >= COMPILE_FLOOR_S and pairs[0][1] > RESOURCE_FACTOR * pairs[0][0]:
            while len(pairs) < COMPILE_CONFIRM_PAIRS and compile_can_still_fail(pairs):
                say(f"{name}: compile time {pairs[-1][1] / pairs[-1][0]:.2f}x the base's: "
                    f"confirming (pair {len(pairs) + 1} of up to {COMPILE_CONFIRM_PAIRS})")
                order = ARMS if len(pairs) % 2 == 0 else ARMS[::-1]   # alternate: the host's drift cancels
                got = {label: seconds(build(label)) for label in order}
                pairs.append((got["base"], got["candidate"]))
        result.compile_pairs = pairs
        result.compile_s = {k: float(np.median([p[i] for p in pairs])) for i, k in enumerate(ARMS)}
        result.planned_bytes = {k: meta[k].get("planned_bytes") for k in ARMS}
        result.kernels = {k: meta[k]["kernels"] for k in ARMS}
        result.outputs_match, result.outputs_note = compare_arm_outputs(workdir)

        def one_run() -> dict[str, list[float]]:
            n = len(runs) + 1
            say(f"{name}: timing base vs candidate vs ORT (fresh process {n})")
            with Worker(env=dict(env or {}), forward_output=False) as timer:
                return timer.call("fuseguard.verify.perf.ab:time_arms", what=f"timing {name} (process {n})", timeout=timeout,
                                  directory=str(workdir), threads=threads, repeats=repeats, flip=n % 2 == 0)

        runs: list[dict[str, list[float]]] = []
        for _ in range(processes):
            runs.append(one_run())
        extra = max(0, max_processes - processes)

        def more_run() -> dict[str, list[float]] | None:
            nonlocal extra
            if extra <= 0:
                return None
            extra -= 1
            return one_run()

        result.gate = decide(name, runs, policy, more_run)
        result.base_ms, result.candidate_ms, result.ort_ms = (
            float(np.median([np.median(r[k]) for r in runs])) for k in ("base", "candidate", "ort"))
    except FuseguardError as err:
        result.error = str(err)
    except (WorkerFailure, WorkerTaskError) as err:
        result.error = str(err).splitlines()[0]
    return result


def verdict_is_failure(result: ABResult) -> bool:
    return result.error is not None or (result.gate is not None and result.gate.verdict is Verdict.SLOWER) \
        or bool(result.resource_regressions())
