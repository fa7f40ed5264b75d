"""`fuseguard baseline history`: entries per commit of a baseline file, read from git."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fuseguard.compiler.errors import UsageError
from fuseguard.verify.perf.history import baseline_history, plot, render_table

KEY = "resnet50|data=1x3x224x224|fused"


def _commit(repo: Path, median: float, normalised: float, message: str, other: float = 1.0) -> None:
    doc = {"arch": "cpu-x-2c", "schema_version": 1, "entries": {
        KEY: {"median_ms": median, "normalised": normalised, "metadata": {"git_commit": "a" * 40}},
        "mlp_gelu|x=1x64x768|fused": {"median_ms": other, "normalised": 0.8}}}
    (repo / "baselines").mkdir(exist_ok=True)
    (repo / "baselines" / "cpu-x-2c.json").write_text(json.dumps(doc))
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", message], cwd=repo, check=True)


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    _commit(tmp_path, 50.0, 1.30, "first")
    _commit(tmp_path, 55.0, 1.43, "slower", other=1.0)
    return tmp_path


def test_history_reads_every_committed_version(repo: Path, tmp_path: Path) -> None:
    points = baseline_history(repo / "baselines" / "cpu-x-2c.json", ["resnet50"])
    assert [(p.subject, p.median_ms, p.normalised) for p in points] == [("first", 50.0, 1.30), ("slower", 55.0, 1.43)]
    everything = baseline_history(repo / "baselines" / "cpu-x-2c.json")
    assert len(everything) == 4
    table = render_table(everything)
    assert table.row_count == 3          # mlp_gelu's unchanged second version is not repeated
    png = plot(points, tmp_path / "trend.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = plot(points, tmp_path / "trend.html").read_text()
    assert "data:image/png;base64," in page


def test_history_of_an_uncommitted_file_says_so(repo: Path) -> None:
    (repo / "baselines" / "new.json").write_text("{}")
    with pytest.raises(UsageError, match="no committed versions"):
        baseline_history(repo / "baselines" / "new.json")
