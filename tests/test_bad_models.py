"""Bad inputs through the real CLI (`python -m verify.cli verify ...`): each ends with exit code 2 and
one `fuseguard: error:` line that names the file, node or input and says what is wrong, with no
traceback unless --debug. The corpus and its expectations live in tests/badmodels.py.

Each CLI start costs seconds (Python, ONNX, TVM in the parent and in the worker), so the file-only
cases share one invocation, as a user verifying several files would; every case still has to produce
its own single error line, and the JSON report must list it as ERROR. Cases that need their own
flags (--shape, --inputs) run alone. All invocations run two at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from badmodels import CASES, ROOT, BadCase, CliResult, build_corpus, run_cli  # noqa: E402

BATCHED = [case.name for case, _ in CASES if not case.args]
ALONE = [case.name for case, _ in CASES if case.args]
DEBUG_CASE = "truncated"


def _batch(corpus: dict[str, tuple[BadCase, Path]], root: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    report = root / "batch.json"
    paths = [str(folder / case.model) for case, folder in (corpus[n] for n in BATCHED)]
    argv = [sys.executable, "-m", "fuseguard.verify.cli", "verify", *paths, "--no-schedule", "--json", str(report)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "200"})
    results = json.loads(report.read_text())["models"] if report.exists() else []
    return proc, {r["model"]: r for r in results}


def _debug(corpus: dict[str, tuple[BadCase, Path]]) -> subprocess.CompletedProcess[str]:
    case, folder = corpus[DEBUG_CASE]
    argv = [sys.executable, "-m", "fuseguard.verify.cli", "verify", str(folder / case.model), "--no-schedule", "--debug"]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """Build the corpus, then run the batch, each flagged case and one --debug run, two at a time."""
    root = tmp_path_factory.mktemp("badmodels")
    corpus = {case.name: (case, folder) for case, folder in build_corpus(root)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        batch = pool.submit(_batch, corpus, root)
        debug = pool.submit(_debug, corpus)
        alone = {name: pool.submit(run_cli, *corpus[name]) for name in ALONE}
        return {"corpus": corpus, "batch": batch.result(), "debug": debug.result(),
                "alone": {name: f.result() for name, f in alone.items()}}


def _check_line(line: str, case: BadCase) -> None:
    prefix = "fuseguard: warning: " if case.warning else "fuseguard: error: "
    assert line.startswith(prefix), line
    for fragment in case.expect:
        assert fragment.lower() in line.lower(), f"{fragment!r} not in {line!r}"
    # WorkerTaskError (an unexpected exception) reads "<Type> while verifying ..."; a clear error never does.
    assert " while verifying " not in line, line


@pytest.mark.parametrize("name", BATCHED)
def test_bad_file(runs, name: str) -> None:
    case, folder = runs["corpus"][name]
    proc, results = runs["batch"]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    path = str(folder / case.model)
    mine = [line for line in proc.stderr.splitlines() if path in line]
    kind = "warning" if case.warning else "error"
    assert [line for line in mine if line.startswith(f"fuseguard: {kind}:")], proc.stderr[-3000:]
    _check_line(next(line for line in mine if line.startswith(f"fuseguard: {kind}:")), case)
    entry = results.get(path) or results[Path(path).stem]  # a verdict is keyed by model name, an error by path
    status = entry["status"]
    if case.warning:  # weights with NaN still get verified: built, run and compared
        assert status in ("PASS", "FAIL"), entry
        assert not [line for line in mine if line.startswith("fuseguard: error:")]
    else:
        assert len(mine) == 1, mine
        assert status == "ERROR" and entry["error"] in mine[0]


@pytest.mark.parametrize("name", ALONE)
def test_bad_flags(runs, name: str) -> None:
    result: CliResult = runs["alone"][name]
    case = result.case
    assert result.returncode in case.exit_codes, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    if case.exit_codes == (0,):
        assert not [line for line in result.lines if line.startswith("fuseguard: error")], result.stderr
        return
    assert len(result.lines) == 1, result.lines
    _check_line(result.lines[0], case)


def test_every_case_is_exercised() -> None:
    assert sorted(BATCHED + ALONE) == sorted(case.name for case, _ in CASES)
    assert len({case.name for case, _ in CASES}) == len(CASES)


def test_debug_shows_the_traceback(runs) -> None:
    proc = runs["debug"]
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and "ModelError" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("fuseguard: error: ")
