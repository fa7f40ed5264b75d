"""Progress: stages announced in a worker subprocess reach the parent; a log never goes silent."""

from __future__ import annotations

import io
import time

from rich.console import Console

from fuseguard.compiler import progress as announce
from fuseguard.verify.progress import Progress
from fuseguard.verify.worker import Worker


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=False, soft_wrap=True), buf


def test_worker_stages_reach_the_parent() -> None:
    console, buf = _console()
    with Progress(2, console, live=False) as p, Worker(env=p.env, forward_output=False) as worker:
        p.start(1, "m")
        worker.call("fuseguard.compiler.progress:stage", what="announcing", text="compile fused: schedule")
        assert p.last_stage() == "compile fused: schedule"
        p.done("m", "PASS")
    assert "[1/2] m: PASS" in buf.getvalue()


def test_scope_prefixes_and_no_env_is_a_no_op(monkeypatch, tmp_path) -> None:
    log = tmp_path / "p.log"
    monkeypatch.setenv(announce.ENV, str(log))
    with announce.scope("compile unfused"):
        announce.stage("codegen")
    assert log.read_text().splitlines()[-1].endswith("\tcompile unfused: codegen")
    monkeypatch.delenv(announce.ENV)
    announce.stage("nowhere")   # no file, no error
    assert "nowhere" not in log.read_text()


def test_heartbeat_when_a_stage_runs_long() -> None:
    console, buf = _console()
    with Progress(1, console, live=False, heartbeat_s=0.3) as p:
        p.start(1, "slow_model")
        p.stage("timing, fresh process 1 of 3")
        time.sleep(1.0)
    assert "[1/1] slow_model: still working, timing, fresh process 1 of 3" in buf.getvalue()
