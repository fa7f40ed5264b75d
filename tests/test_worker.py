"""Worker subprocesses: reuse, and that crashes, hangs and exceptions fail only the task.

Every test runs real child processes; the tasks live in tests/worker_tasks.py.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from fuseguard.compiler.errors import ModelError
from fuseguard.verify.worker import (
    Worker,
    WorkerCrashed,
    WorkerFailure,
    WorkerPool,
    WorkerTaskError,
    WorkerTimeout,
    format_seconds,
    get_worker,
)

TESTS_DIR = Path(__file__).resolve().parent


def _gone(pid: int) -> bool:
    """Dead, or a zombie waiting for an init that does not reap (as in some containers)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def worker() -> Iterator[Worker]:
    with Worker(sys_path=[TESTS_DIR]) as w:
        yield w


def test_reuses_one_child_and_round_trips_values(worker: Worker) -> None:
    assert worker.call("worker_tasks:add", what="adding", a=2, b=3) == 5
    first = worker.call("worker_tasks:getpid", what="asking the pid")
    assert worker.call("worker_tasks:getpid", what="asking the pid") == first == worker.pid
    assert first != os.getpid()
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = worker.call("worker_tasks:add", what="adding arrays", a=x, b=x)
    np.testing.assert_array_equal(out, 2 * x)
    assert out.dtype == np.float32
    assert worker.alive and worker.restarts == 0


def test_segfault_fails_the_task_and_the_next_call_gets_a_fresh_child(worker: Worker) -> None:
    old_pid = worker.call("worker_tasks:getpid", what="asking the pid")
    with pytest.raises(WorkerCrashed) as info:
        worker.call("worker_tasks:native_segfault", what="compiling ResNet-50 for sm_80")
    err = info.value
    assert str(err).startswith("crashed (SIGSEGV) while compiling ResNet-50 for sm_80")
    assert err.signal_name == "SIGSEGV" and err.exit_code is None and err.pid == old_pid
    assert "Segmentation fault" in err.output_tail  # faulthandler's report, from the child's stderr
    assert "native_segfault" in err.output_tail
    assert isinstance(err, WorkerFailure)
    assert worker.pid is None and not worker.alive
    new_pid = worker.call("worker_tasks:getpid", what="asking the pid")
    assert new_pid != old_pid and worker.restarts == 1
    assert _gone(old_pid)


def test_abort_is_reported_as_sigabrt(worker: Worker) -> None:
    with pytest.raises(WorkerCrashed, match=r"^crashed \(SIGABRT\) while running abort"):
        worker.call("worker_tasks:abort", what="running abort")
    assert worker.call("worker_tasks:add", what="adding", a=1, b=1) == 2


def test_plain_exit_is_reported_with_its_code(worker: Worker) -> None:
    with pytest.raises(WorkerCrashed) as info:
        worker.call("worker_tasks:exit_code", what="running a model", code=3)
    assert str(info.value) == "worker exited with code 3 while running a model"
    assert info.value.exit_code == 3 and info.value.signal_name is None


def test_hang_times_out_kills_the_child_and_reports_where_it_hung(worker: Worker) -> None:
    old_pid = worker.call("worker_tasks:getpid", what="asking the pid")
    start = time.monotonic()
    with pytest.raises(WorkerTimeout) as info:
        worker.call("worker_tasks:hang", what="running MobileNet", timeout=1, seconds=100)
    assert time.monotonic() - start < 5
    assert str(info.value).startswith("timed out after 1 s while running MobileNet")
    assert "in hang" in info.value.output_tail  # the child's Python stack, dumped before the kill
    assert not psutil.pid_exists(old_pid)  # killed and reaped
    assert worker.call("worker_tasks:getpid", what="asking the pid") not in (None, old_pid)
    assert worker.restarts == 1


def test_timeout_kills_the_childs_own_children(worker: Worker, tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    with pytest.raises(WorkerTimeout):
        worker.call("worker_tasks:spawn_and_hang", what="running a spawner", timeout=1, pid_file=str(pid_file))
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 3  # reparenting to init and its reaping are asynchronous
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild)


def test_python_exception_comes_back_with_its_traceback_and_the_child_survives(worker: Worker) -> None:
    pid = worker.call("worker_tasks:getpid", what="asking the pid")
    with pytest.raises(WorkerTaskError) as info:
        worker.call("worker_tasks:raise_value_error", what="importing model.onnx")
    err = info.value
    assert str(err) == "ValueError while importing model.onnx: bad value 42"
    assert err.type_name == "ValueError" and err.message == "bad value 42"
    assert "raise_value_error" in err.remote_traceback and "worker_tasks.py" in err.remote_traceback
    assert "raise_value_error" in str(err.__cause__)  # shows up in the parent's traceback
    with pytest.raises(WorkerTaskError) as info:
        worker.call("worker_tasks:raise_custom_error", what="importing model.onnx")
    assert info.value.type_name == "worker_tasks.CustomError"
    assert worker.call("worker_tasks:getpid", what="asking the pid") == pid and worker.restarts == 0


def test_fuseguard_errors_are_reraised_as_their_own_class(worker: Worker) -> None:
    with pytest.raises(ModelError) as info:
        worker.call("worker_tasks:raise_model_error", what="importing model.onnx")
    assert str(info.value) == "model.onnx: graph is truncated"
    assert "raise_model_error" in info.value.remote_traceback  # type: ignore[attr-defined]


def test_unknown_task_fails_only_that_task(worker: Worker) -> None:
    with pytest.raises(ValueError, match="package.module:function"):
        worker.call("worker_tasks.add", what="adding")
    with pytest.raises(WorkerTaskError) as info:
        worker.call("no_such_module_xyz:f", what="running nothing")
    assert info.value.type_name == "ModuleNotFoundError"
    with pytest.raises(WorkerTaskError) as info:
        worker.call("worker_tasks:no_such_function", what="running nothing")
    assert info.value.type_name == "AttributeError"
    pid = worker.pid
    with pytest.raises(WorkerTaskError, match="result \\(lock\\) cannot be sent back"):
        worker.call("threading:Lock", what="making a lock")
    assert worker.call("worker_tasks:add", what="adding", a="a", b="b") == "ab"
    assert worker.pid == pid


def test_a_child_that_died_while_idle_is_replaced_quietly(worker: Worker) -> None:
    pid = worker.call("worker_tasks:getpid", what="asking the pid")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 3
    while worker.alive and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not worker.alive
    assert worker.call("worker_tasks:getpid", what="asking the pid") != pid
    assert worker.restarts == 1


def test_child_output_goes_to_parent_stderr_not_stdout(worker: Worker, capfd: pytest.CaptureFixture[str]) -> None:
    assert worker.call("worker_tasks:print_both", what="printing", text="hello") == "hello"
    out, err = capfd.readouterr()
    assert "hello" not in out
    assert "stdout: hello" in err and "stderr: hello" in err


def test_env_overrides_and_removals_reach_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEGUARD_TEST_INHERITED", "yes")
    monkeypatch.setenv("FUSEGUARD_TEST_REMOVED", "yes")
    with Worker(sys_path=[TESTS_DIR], env={"TVM_NUM_THREADS": "1", "FUSEGUARD_TEST_REMOVED": None}) as w:
        assert w.call("worker_tasks:getenv", what="reading env", name="TVM_NUM_THREADS") == "1"
        assert w.call("worker_tasks:getenv", what="reading env", name="FUSEGUARD_TEST_INHERITED") == "yes"
        assert w.call("worker_tasks:getenv", what="reading env", name="FUSEGUARD_TEST_REMOVED") is None


def test_memory_limit_fails_the_allocation_not_the_worker() -> None:
    with Worker(sys_path=[TESTS_DIR], memory_limit=1 << 30) as w:
        pid = w.call("worker_tasks:getpid", what="asking the pid")
        with pytest.raises(WorkerTaskError) as info:
            w.call("worker_tasks:allocate", what="allocating 8 GiB", nbytes=8 << 30)
        assert info.value.type_name == "MemoryError"
        assert w.call("worker_tasks:allocate", what="allocating 1 MiB", nbytes=1 << 20) == 1 << 20
        assert w.pid == pid


def test_close_stops_the_child_and_a_later_call_restarts_it() -> None:
    w = Worker(sys_path=[TESTS_DIR])
    assert w.pid is None and not w.alive
    w.start()
    pid = w.pid
    assert pid is not None and w.alive
    w.close()
    assert not psutil.pid_exists(pid) and w.pid is None
    assert w.call("worker_tasks:getpid", what="asking the pid") != pid
    assert w.restarts == 0  # closing is not a failure
    w.close()


def test_interrupt_in_the_parent_kills_the_busy_child(worker: Worker) -> None:
    # Ctrl-C as a terminal delivers it: a pytest started in the background by a non-interactive shell
    # inherits SIGINT ignored, and Python then never installs its KeyboardInterrupt handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    pid = worker.call("worker_tasks:getpid", what="asking the pid")
    timer = threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.call("worker_tasks:hang", what="hanging", seconds=100)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert not psutil.pid_exists(pid)
    assert worker.call("worker_tasks:add", what="adding", a=1, b=2) == 3


def test_pool_runs_tasks_on_separate_children_in_parallel() -> None:
    with WorkerPool(2, sys_path=[TESTS_DIR]) as pool:
        futures = [pool.submit("worker_tasks:sleep_then_getpid", what="sleeping", seconds=0.5) for _ in range(2)]
        pids = {f.result(timeout=30) for f in futures}
        assert pids == {w.pid for w in pool.workers} and len(pids) == 2
    assert all(not w.alive for w in pool.workers)


def test_default_worker_is_shared_in_this_process() -> None:
    assert get_worker() is get_worker()


def test_errors_pickle_and_format_seconds() -> None:
    for err in (WorkerCrashed("compiling X", "SIGSEGV", "tail", 7), WorkerCrashed("compiling X", 3),
                WorkerTimeout("running X", 300.0), WorkerTaskError("ValueError", "bad", "tb", "running X")):
        copy = pickle.loads(pickle.dumps(err))
        assert type(copy) is type(err) and str(copy) == str(err)
    assert str(WorkerTimeout("running X", 300.0)) == "timed out after 300 s while running X"
    assert [format_seconds(s) for s in (1, 1.0, 0.5, 2.25, 12.7)] == ["1 s", "1 s", "0.5 s", "2.25 s", "13 s"]


def test_a_timing_worker_keeps_torch_out_of_its_start() -> None:
    """tvm_ffi imports torch whenever it is installed (2.1 s of a fresh process's 3.4 s `import tvm`, SPR
    class): a timing worker starts tvm without it, and a later `import torch` (a plugin's) still works; other
    workers are left alone. Where torch is not installed there is nothing to tell apart."""
    from fuseguard.verify.perf.timing import timing_env

    with Worker(sys_path=[TESTS_DIR], env=timing_env(2)) as w:
        timing = w.call("worker_tasks:torch_after_importing_tvm", what="importing tvm")
    with Worker(sys_path=[TESTS_DIR]) as w:
        plain = w.call("worker_tasks:torch_after_importing_tvm", what="importing tvm")
    if plain == "absent":
        assert timing == "absent"
    else:
        assert (timing, plain) == ("hidden", "imported")
