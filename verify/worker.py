"""Crash- and hang-isolating worker subprocesses for compiling and running models.

TVM runs native code that can segfault or hang, and `import tvm` costs seconds. So each
task runs in a long-lived child process that is reused between tasks and replaced,
lazily on the next call, when it crashes or overruns its timeout. A crash or hang then
fails that one task with a `WorkerFailure`; the run goes on.

Protocol: the parent and child talk over a socketpair (`multiprocessing.Pipe`) with
pickled messages; both ends are this module, so unpickling is safe. The child's stdout
and stderr go to an unlinked temp file that the parent forwards to its own
`sys.stderr` after every call (so task output never corrupts the parent's stdout, and
pytest captures it per test) and tails into crash and timeout messages.

Importing tasks: `func` is a "package.module:function" path. The child's `sys.path` is
the constructor's `sys_path` entries, then the parent's `sys.path` at start-up, then
its own, so whatever the parent can import the child can import too; pass `sys_path`
for directories that are not packages (e.g. a tests/ folder without `__init__.py`).
"""

from __future__ import annotations

import atexit
import fcntl
import faulthandler
import importlib
import importlib.abc
import multiprocessing
import os
import pickle
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection, wait
from typing import Any
from fuseguard.compiler.paths import PROJECT_ROOT

__all__ = [
    "Worker",
    "WorkerCrashed",
    "WorkerFailure",
    "WorkerPool",
    "WorkerTaskError",
    "WorkerTimeout",
    "get_worker",
]

_PROJECT_ROOT = str(PROJECT_ROOT)
_BOOTSTRAP = ("import sys; sys.path.insert(0, sys.argv[1]); "
              "from fuseguard.verify.worker import _child_main; _child_main(int(sys.argv[2]))")
_TAIL_LINES = 40
#: set in a worker's environment: tvm starts there without torch (`_NoTorch`; compiler/settings.py)
NO_TORCH = "FUSEGUARD_WORKER_NO_TORCH"
_TAIL_BYTES = 16 * 1024
_LOG_TRUNCATE_BYTES = 4 * 1024 * 1024
_POLL_SLICE_S = 1.0      # re-check the child's exit status at least this often
_EXIT_GRACE_S = 5.0      # how long a child that closed its end may take to exit
_STACK_DUMP_WAIT_S = 0.5  # how long a timed-out child gets to print its Python stacks


# --------------------------------------------------------------------------- errors


class WorkerFailure(Exception):
    """The worker process died or hung: the task fails, the worker is replaced."""

    def __init__(self, message: str, what: str, output_tail: str = "", pid: int | None = None) -> None:
        full = f"{message}\n--- last lines of worker output ---\n{output_tail}" if output_tail else message
        super().__init__(full)
        self.message = message
        self.what = what
        self.output_tail = output_tail
        self.pid = pid

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.message, self.what, self.output_tail, self.pid)


class WorkerCrashed(WorkerFailure):
    """The worker died from a signal (SIGSEGV, SIGABRT, ...) or exited during a task."""

    def __init__(self, what: str, status: str | int, output_tail: str = "", pid: int | None = None) -> None:
        self.signal_name: str | None = status if isinstance(status, str) else None
        self.exit_code: int | None = status if isinstance(status, int) else None
        message = (f"crashed ({status}) while {what}" if self.signal_name is not None
                   else f"worker exited with code {status} while {what}")
        super().__init__(message, what, output_tail, pid)
        self._status = status

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.what, self._status, self.output_tail, self.pid)


class WorkerTimeout(WorkerFailure):
    """The task overran its timeout; the worker's whole process group was killed."""

    def __init__(self, what: str, seconds: float, output_tail: str = "", pid: int | None = None) -> None:
        self.seconds = seconds
        super().__init__(f"timed out after {format_seconds(seconds)} while {what}", what, output_tail, pid)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.what, self.seconds, self.output_tail, self.pid)


class WorkerTaskError(Exception):
    """The task raised an ordinary Python exception; the worker survives."""

    def __init__(self, type_name: str, message: str, remote_traceback: str, what: str) -> None:
        text = f"{type_name} while {what}: {message}" if message else f"{type_name} while {what}"
        super().__init__(text)
        self.type_name = type_name
        self.message = message
        self.remote_traceback = remote_traceback
        self.what = what

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.type_name, self.message, self.remote_traceback, self.what)


class _RemoteTraceback(Exception):
    """Chained as `__cause__` so the child's traceback shows in the parent's report."""

    def __str__(self) -> str:
        return f"\n\n--- traceback in the worker ---\n{self.args[0]}"


def format_seconds(seconds: float) -> str:
    """'300 s', '1 s', '0.5 s': whole seconds unless the timeout was fractional."""
    if seconds >= 10 or float(seconds).is_integer():
        return f"{seconds:.0f} s"
    return f"{seconds:.2f}".rstrip("0").rstrip(".") + " s"


# --------------------------------------------------------------------------- parent side


class _Process:
    """One live child: its Popen, connection, output log and kill-at-exit finalizer."""

    def __init__(self, env: Mapping[str, str | None], sys_path: Sequence[str], memory_limit: int | None) -> None:
        child_env = dict(os.environ)
        for key, value in env.items():
            if value is None:
                child_env.pop(key, None)
            else:
                child_env[key] = value
        self.log_fd = _open_log()
        parent_conn, child_conn = multiprocessing.Pipe(duplex=True)
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-u", "-c", _BOOTSTRAP, _PROJECT_ROOT, str(child_conn.fileno())],
                stdin=subprocess.DEVNULL, stdout=self.log_fd, stderr=self.log_fd,
                pass_fds=(child_conn.fileno(),), env=child_env, start_new_session=True,
            )
        except BaseException:
            parent_conn.close()
            os.close(self.log_fd)
            raise
        finally:
            child_conn.close()
        self.conn: Connection = parent_conn
        self.pid = self.popen.pid
        self.pidfd = _pidfd_open(self.pid)
        self.log_pos = 0
        self._finalizer = weakref.finalize(self, _dispose, os.getpid(), self.popen, self.conn, self.pidfd, self.log_fd)
        parent_path = [p for p in sys.path if p]
        try:
            self.conn.send_bytes(pickle.dumps({"sys_path": [*sys_path, *parent_path], "memory_limit": memory_limit}))
        except OSError:  # died at start-up: the first call reports it, with its stderr
            pass

    def kill(self) -> None:
        """Kill the child's process group (grandchildren too) and reap the child."""
        _kill_group(self.popen)

    def close(self, grace: float = 1.0) -> None:
        """Let an idle child exit on EOF, then kill whatever of its group is left."""
        self.conn.close()
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self._finalizer()

    def dispose(self) -> None:
        self._finalizer()

    def new_output(self) -> str:
        """Output written since the last call, advancing past it."""
        end = os.fstat(self.log_fd).st_size
        data = os.pread(self.log_fd, max(end - self.log_pos, 0), self.log_pos) if end > self.log_pos else b""
        self.log_pos = end
        if end > _LOG_TRUNCATE_BYTES:
            os.ftruncate(self.log_fd, 0)  # O_APPEND: the child keeps writing at the new end
            self.log_pos = 0
        return data.decode("utf-8", errors="replace")

    def output_size(self) -> int:
        return os.fstat(self.log_fd).st_size


def _open_log() -> int:
    """An unlinked temp file in append mode, so the parent may truncate it under the child."""
    fd, path = tempfile.mkstemp(prefix="fuseguard-worker-", suffix=".log")
    os.unlink(path)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
    return fd


def _pidfd_open(pid: int) -> int | None:
    """A descriptor that becomes readable when the child exits, where the OS has one."""
    try:
        return os.pidfd_open(pid)  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return None


def _kill_group(popen: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's session: its group plus descendants that started their own."""
    descendants = []
    if popen.poll() is None:
        try:
            import psutil
            descendants = psutil.Process(popen.pid).children(recursive=True)
        except Exception:  # psutil missing, or the child died meanwhile: the group kill suffices
            descendants = []
    try:
        os.killpg(popen.pid, signal.SIGKILL)  # the child leads its own group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass
    for proc in descendants:
        try:
            proc.kill()
        except Exception:  # noqa: BLE001 - it exited meanwhile (psutil.NoSuchProcess) or is not ours to kill
            pass
    try:
        popen.wait(timeout=10)
    except subprocess.TimeoutExpired:  # stuck in the kernel (D state): nothing more to do
        pass


def _dispose(owner_pid: int, popen: subprocess.Popen[bytes], conn: Connection, pidfd: int | None,
             log_fd: int) -> None:
    """Finalizer: never leave a worker behind, also at interpreter exit or after Ctrl-C."""
    if os.getpid() != owner_pid:  # a forked copy of the parent does not own this child
        return
    _kill_group(popen)
    conn.close()
    for fd in (pidfd, log_fd):
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


# faulthandler lists every thread; the child's own parent-watch thread is noise.
_WATCHER_STACK = re.compile(
    r"^Thread 0x[0-9a-f]+ \(most recent call first\):\n"
    r"  File [^\n]*, line \d+ in _parent_watch_loop\n(?:  File [^\n]*\n)*\n?",
    re.MULTILINE,
)


def _split_tail(text: str) -> tuple[str, str]:
    """(head, tail): the tail goes into the failure message, so only the head is forwarded."""
    lines = _WATCHER_STACK.sub("", text).rstrip().splitlines(keepends=True)
    head, tail = lines[:-_TAIL_LINES], lines[-_TAIL_LINES:]
    return "".join(head), "".join(tail)[-_TAIL_BYTES:].rstrip()


class Worker:
    """One reusable worker subprocess; replaced lazily after a crash or timeout.

    Thread-safe: concurrent calls on one Worker run one after another. Use `WorkerPool`
    to run tasks in parallel.
    """

    def __init__(self, *, env: Mapping[str, str | None] | None = None,
                 sys_path: Sequence[str | os.PathLike[str]] = (), memory_limit: int | None = None,
                 forward_output: bool = True) -> None:
        """`env` overrides os.environ in the child (None removes a variable); `memory_limit`
        (bytes) caps the child's address space (RLIMIT_AS) so a huge allocation fails the
        task with MemoryError rather than the machine. Leave it None for CUDA workers: the
        CUDA driver reserves far more address space than it uses."""
        self._env: dict[str, str | None] = dict(env or {})
        self._sys_path = [os.fspath(p) for p in sys_path]
        self._memory_limit = memory_limit
        self._forward_output = forward_output
        self._proc: _Process | None = None
        self._lock = threading.Lock()
        self._lost = False
        self.restarts = 0

    # -- lifecycle

    @property
    def pid(self) -> int | None:
        """The current child's pid, None before the first call or after a failure/close."""
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.popen.poll() is None

    def start(self) -> None:
        """Start the child now (calls start it lazily anyway)."""
        with self._lock:
            self._ensure_started()

    def close(self) -> None:
        """Stop the child; a later call starts a new one."""
        with self._lock:
            if self._proc is not None:
                self._forward(self._proc.new_output())
                self._proc.close()
                self._proc = None

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Worker pid={self.pid} alive={self.alive} restarts={self.restarts}>"

    def _ensure_started(self) -> _Process:
        if self._proc is not None and self._proc.popen.poll() is not None:
            self._discard()  # died between calls
        if self._proc is None:
            self._proc = _Process(self._env, self._sys_path, self._memory_limit)
            if self._lost:
                self.restarts += 1
                self._lost = False
        return self._proc

    def _discard(self) -> None:
        """Kill and forget the current child; the next call starts a fresh one."""
        if self._proc is not None:
            self._proc.dispose()
            self._proc = None
            self._lost = True

    # -- calls

    def call(self, func: str, /, *, what: str, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run `func(**kwargs)` in the child and return its result.

        Raises WorkerCrashed or WorkerTimeout when the child dies or hangs, the original
        class for a FuseguardError, and WorkerTaskError for any other exception.
        """
        module, sep, qualname = func.partition(":")
        if not sep or not module or not qualname:
            raise ValueError(f"worker task {func!r} is not of the form 'package.module:function'")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        request = pickle.dumps((module, qualname, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            proc = self._ensure_started()
            self._forward(proc.new_output())
            try:
                reply = self._exchange(proc, request, what, timeout)
            except BaseException:
                # Crash, timeout, Ctrl-C or a parent-side bug mid-task: the child's state
                # is unknown and a late reply would desynchronise the protocol.
                if self._proc is proc:
                    self._forward(proc.new_output())
                    self._discard()
                raise
            self._forward(proc.new_output())
        status, payload = pickle.loads(reply)
        if status == "ok":
            return payload
        raise _rebuild_error(payload, what)

    def _exchange(self, proc: _Process, request: bytes, what: str, timeout: float | None) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            proc.conn.send_bytes(request)
        except OSError:  # the child is gone (BrokenPipe, ConnectionReset)
            raise self._crashed(proc, what) from None
        waitables: list[Any] = [proc.conn] + ([proc.pidfd] if proc.pidfd is not None else [])
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise self._timed_out(proc, what, timeout or 0.0)
            wait(waitables, timeout=_POLL_SLICE_S if remaining is None else min(remaining, _POLL_SLICE_S))
            if proc.conn.poll():
                try:
                    return proc.conn.recv_bytes()
                except (EOFError, OSError):
                    raise self._crashed(proc, what) from None
            if proc.popen.poll() is not None:  # died while a grandchild still holds its socket end
                raise self._crashed(proc, what)

    def _crashed(self, proc: _Process, what: str) -> WorkerCrashed:
        try:
            code = proc.popen.wait(timeout=_EXIT_GRACE_S)
        except subprocess.TimeoutExpired:  # closed its end but lingers: treat as a crash
            proc.kill()
            code = proc.popen.returncode
        proc.kill()  # leftover grandchildren in its group
        status: str | int = _signal_name(-code) if code < 0 else code
        return WorkerCrashed(what, status, self._failure_output(proc), proc.pid)

    def _timed_out(self, proc: _Process, what: str, timeout: float) -> WorkerTimeout:
        self._dump_stacks(proc)
        proc.kill()
        return WorkerTimeout(what, timeout, self._failure_output(proc), proc.pid)

    def _failure_output(self, proc: _Process) -> str:
        """Forward the task's output but its last lines, and return those for the message."""
        head, tail = _split_tail(proc.new_output())
        self._forward(head)
        return tail

    @staticmethod
    def _dump_stacks(proc: _Process) -> None:
        """Ask the hung child (faulthandler on SIGUSR1) where it is stuck, for the message."""
        before = proc.output_size()
        try:
            os.kill(proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return
        stop = time.monotonic() + _STACK_DUMP_WAIT_S
        while time.monotonic() < stop:
            time.sleep(0.02)
            if proc.output_size() > before:
                time.sleep(0.05)  # let the dump finish
                return

    def _forward(self, text: str) -> None:
        if text and self._forward_output:
            sys.stderr.write(text)
            sys.stderr.flush()


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _rebuild_error(info: dict[str, Any], what: str) -> Exception:
    """Re-create FuseguardErrors as themselves (they are user-facing); wrap the rest."""
    cause = _RemoteTraceback(info["traceback"])
    error: Exception | None = None
    if info["fuseguard_class"] is not None:
        module, qualname = info["fuseguard_class"]
        try:
            from fuseguard.compiler.errors import FuseguardError

            cls: Any = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
            if isinstance(cls, type) and issubclass(cls, FuseguardError):
                error = cls(info["message"])
                error.remote_traceback = info["traceback"]  # type: ignore[attr-defined]
        except Exception:  # not importable here or another constructor: fall back to the wrapper
            error = None
    if error is None:
        error = WorkerTaskError(info["type_name"], info["message"], info["traceback"], what)
    error.__cause__ = cause
    return error


class WorkerPool:
    """N workers for running tasks in parallel (e.g. ORT and TVM side by side)."""

    def __init__(self, size: int, **worker_options: Any) -> None:
        if size < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {size}")
        self.workers = [Worker(**worker_options) for _ in range(size)]
        self._idle: queue.SimpleQueue[Worker] = queue.SimpleQueue()
        for worker in self.workers:
            self._idle.put(worker)
        self._executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="fuseguard-worker")

    def call(self, func: str, /, *, what: str, timeout: float | None = None, **kwargs: Any) -> Any:
        """Like Worker.call on the next idle worker; blocks while all are busy."""
        worker = self._idle.get()
        try:
            return worker.call(func, what=what, timeout=timeout, **kwargs)
        finally:
            self._idle.put(worker)

    def submit(self, func: str, /, *, what: str, timeout: float | None = None, **kwargs: Any) -> Future[Any]:
        return self._executor.submit(self.call, func, what=what, timeout=timeout, **kwargs)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        for worker in self.workers:
            worker.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_default: tuple[int, Worker] | None = None
_default_lock = threading.Lock()


def get_worker() -> Worker:
    """This process's shared worker (each pytest-xdist process, or fork, gets its own)."""
    global _default
    with _default_lock:
        if _default is None or _default[0] != os.getpid():
            _default = (os.getpid(), Worker())
        return _default[1]


@atexit.register
def _close_default() -> None:
    if _default is not None and _default[0] == os.getpid():
        _default[1].close()


# --------------------------------------------------------------------------- child side


class _NoTorch(importlib.abc.MetaPathFinder):
    """While tvm and tvm_ffi start, `import torch` fails as where torch is not installed: tvm_ffi imports it
    first thing when it is (and tvm.relax again), 2.1 s of a 3.4 s `import tvm` (SPR class), paid by every fresh
    timing process. Any other import of torch (a plugin's, before or after) goes through. A finder, not a None
    entry in sys.modules: scipy reads any "torch" it finds there as the module."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if (fullname == "torch" or fullname.startswith("torch.")) and (_initializing("tvm_ffi")
                                                                       or _initializing("tvm")):
            raise ModuleNotFoundError(f"No module named {fullname!r} while tvm starts ({NO_TORCH})", name=fullname)
        return None


def _initializing(module: str) -> bool:
    spec = getattr(sys.modules.get(module), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _child_main(fd: int) -> None:
    """Serve requests until the parent closes its end."""
    conn = Connection(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the parent, which kills us
    faulthandler.enable(all_threads=True)  # Python stacks into the log on SIGSEGV/SIGABRT
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # and on request, before a timeout kill
    config = pickle.loads(conn.recv_bytes())
    sys.path[:0] = [p for p in config["sys_path"] if p not in sys.path]
    from fuseguard.compiler import settings

    if settings.flag(NO_TORCH):
        sys.meta_path.insert(0, _NoTorch())
    if config["memory_limit"] is not None:
        _limit_memory(config["memory_limit"])
    _watch_parent(os.getppid())
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return
        conn.send_bytes(_serve(request))


def _serve(request: bytes) -> bytes:
    try:
        module, qualname, kwargs = pickle.loads(request)
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
        result = target(**kwargs)
    except BaseException as exc:  # SystemExit too: a task must not end the worker silently
        return pickle.dumps(("error", _describe(exc)), protocol=pickle.HIGHEST_PROTOCOL)
    try:
        return pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        info = _describe(exc)
        info["message"] = f"the task's result ({type(result).__name__}) cannot be sent back: {info['message']}"
        return pickle.dumps(("error", info), protocol=pickle.HIGHEST_PROTOCOL)


def _describe(exc: BaseException) -> dict[str, Any]:
    """Plain strings only: the exception object itself may not unpickle in the parent."""
    cls = type(exc)
    type_name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not lose the error it describes
        message = "<exception message could not be formatted>"
    is_fuseguard = any(c.__module__ in ("fuseguard.compiler.errors", "compiler.errors") and c.__qualname__ == "FuseguardError" for c in cls.__mro__)
    return {
        "type_name": type_name,
        "message": message,
        "traceback": "".join(traceback.format_exception(cls, exc, exc.__traceback__)),
        "fuseguard_class": (cls.__module__, cls.__qualname__) if is_fuseguard else None,
    }


def _limit_memory(limit: int) -> None:
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _watch_parent(parent_pid: int) -> None:
    """Best effort: if the parent is SIGKILLed mid-task, take our process group down too
    (an idle child just sees EOF; a hung one would otherwise run on forever)."""
    threading.Thread(target=_parent_watch_loop, args=(parent_pid,), name="fuseguard-parent-watch",
                     daemon=True).start()


def _parent_watch_loop(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os.killpg(0, signal.SIGKILL)
