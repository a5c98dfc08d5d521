"""The workers ``labsupport.run`` keeps between calls, and how they are started and stopped.

Workers are forked from multiprocessing's fork server, which imports torch once before any thread pool exists;
each worker runs ``labsupport._worker.main``. The pool also owns the rendezvous store (one TCP port) and a
temporary folder for the stack dumps and call boards of the workers. ``shutdown`` gives all of it back; a kernel
killed before it could do so leaves its folder behind, and the next pool removes it.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

__all__ = ["shutdown"]

from ._board import new_board, read_board

_STARTUP_TIMEOUT = 180.0
_TMP_PREFIX = "labsupport-"
_MAX_SOCKET_PATH = 104  # bytes of a Unix socket's path, on Linux (108) and macOS (104)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _loopback_ifname() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_stale_dirs() -> None:
    """Remove the folders of pools whose kernel died without cleaning up (SIGKILL, the out-of-memory killer).

    A pool's folder is named ``labsupport-<pid of its kernel>-<random>``: once that process is gone, nobody uses
    the folder any more. Folders of other users, and of kernels still running, are left alone.
    """
    base = tempfile.gettempdir()
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        pid, sep, _ = name[len(_TMP_PREFIX) :].partition("-")
        if not name.startswith(_TMP_PREFIX) or not sep or not pid.isdigit() or int(pid) == os.getpid():
            continue
        path = os.path.join(base, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if not _owner_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _make_tmpdir() -> str:
    _remove_stale_dirs()
    return tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-")


def _mp_tempdir_inside(tmpdir: str) -> None:
    """Make multiprocessing keep its temporary files (the fork server's listener socket) inside the pool's folder.

    Left to itself, it makes a ``pymp-*`` folder in /tmp, which a kernel that is killed (or shut down by force)
    never removes. Inside the pool's folder, ``shutdown`` removes it, and so does the next pool once this kernel is
    gone. Files multiprocessing made before stay where they are. A folder whose path is too long for a Unix socket
    (a long TMPDIR) is not used for this.
    """
    from multiprocessing import process

    if len(os.fsencode(tmpdir)) + len("/listener-12345678") < _MAX_SOCKET_PATH:
        process.current_process()._config["tempdir"] = tmpdir


def _forget_mp_tempdir(tmpdir: str) -> None:
    """After the pool's folder is gone: multiprocessing makes a new temporary folder when it next needs one."""
    from multiprocessing import process

    config = process.current_process()._config
    if config.get("tempdir") == tmpdir:
        config["tempdir"] = None


def _preload() -> list:
    """What the fork server imports before it forks anyone: labsupport's worker (and torch with it) and, in a
    notebook kernel, ``torch._dynamo``. The first optimizer, DTensor or FSDP a worker builds imports the latter
    (about 800 modules, 3 s of CPU); imported once in the server, every worker inherits it. A notebook starts the
    server in the background when it imports labsupport, so nobody waits for it there; a script's first call does
    not pay for it. ``LABSUPPORT_PRELOAD_DYNAMO=0/1`` overrides."""
    setting = os.environ.get("LABSUPPORT_PRELOAD_DYNAMO", "")
    heavy = setting == "1" if setting in ("0", "1") else "ipykernel" in sys.modules
    return ["labsupport._worker"] + (["torch._dynamo"] if heavy else [])


#: ``"<pid>:<socket path>"`` of a running fork server to fork workers from instead of starting one (the grader
#: starts one per grading process and shares it between the kernel and the judge of each notebook).
SHARED_SERVER_ENV = "LABSUPPORT_FORK_SERVER"


def _shared_server() -> tuple[int, str] | None:
    pid, sep, path = os.environ.get(SHARED_SERVER_ENV, "").partition(":")
    if not sep or not pid.isdigit() or not os.path.exists(path) or not _owner_alive(int(pid)):
        return None
    try:  # a server that died but was not reaped yet still answers kill(pid, 0)
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                return None
    except (OSError, IndexError):
        pass
    return int(pid), path


def _adopt_shared_server() -> None:
    """Fork workers from the server named by ``LABSUPPORT_FORK_SERVER`` while it runs.

    multiprocessing only talks to a fork server it started itself: its ``ForkServer`` keeps the server's address,
    its pid (to notice that it died) and the write end of the pipe that keeps it alive, which every worker
    inherits. Adopting a server means setting the address, giving the workers a harmless descriptor instead of
    that pipe (the server's owner holds the real one), and checking before each start that the server still
    runs. Once it has gone, this process starts a server of its own, as without the variable. Nothing here
    runs in the server: a worker's task still comes from this process only.
    """
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    shared = _shared_server()
    if shared is None or server._forkserver_pid is not None or getattr(server, "_labsupport_shared", False):
        return
    own_ensure_running = type(server).ensure_running

    def ensure_running():
        if server._forkserver_address == shared[1] and _shared_server() == shared:
            resource_tracker.ensure_running()
            return
        with server._lock:  # the shared server is gone: back to a server of our own
            if server._forkserver_address == shared[1]:
                server._forkserver_address = None
                os.close(server._forkserver_alive_fd)
                server._forkserver_alive_fd = None
        server.ensure_running = lambda: own_ensure_running(server)
        own_ensure_running(server)

    with server._lock:
        server._forkserver_address = shared[1]
        server._forkserver_alive_fd = os.open(os.devnull, os.O_WRONLY)
        server.ensure_running = ensure_running
        server._labsupport_shared = True


def start_shared_server(folder: str) -> str:
    """Start a fork server in this process for others to share; returns the ``LABSUPPORT_FORK_SERVER`` value.

    It preloads torch._dynamo too (every kernel and judge that uses it may need it), keeps its listener socket in
    ``folder``, and stops when this process ends or calls ``shutdown``.
    """
    from multiprocessing import forkserver, process

    process.current_process()._config["tempdir"] = folder
    saved = os.environ.get("LABSUPPORT_PRELOAD_DYNAMO")
    os.environ["LABSUPPORT_PRELOAD_DYNAMO"] = "1"
    try:
        with _NoMainImport():
            _mp_context()
            server = forkserver._forkserver
            server.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("LABSUPPORT_PRELOAD_DYNAMO", None)
        else:
            os.environ["LABSUPPORT_PRELOAD_DYNAMO"] = saved
    return f"{server._forkserver_pid}:{server._forkserver_address}"


def _mp_context():
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_preload())
        if os.environ.get(SHARED_SERVER_ENV):
            _adopt_shared_server()
        return ctx
    return multiprocessing.get_context("spawn")  # pragma: no cover - Windows


class _NoMainImport:
    """While starting a worker, keep multiprocessing from re-importing the notebook's or script's main module.

    Functions travel by value, so workers never need ``__main__``; importing it again would run a script's
    top-level code (and its ``labsupport.run`` calls) once more inside every worker.
    """

    def __enter__(self):
        import multiprocessing.spawn as spawn

        self._spawn = spawn
        self._orig = spawn.get_preparation_data

        def prep(name, _orig=self._orig):
            data = _orig(name)
            for key in ("init_main_from_name", "init_main_from_path", "main_path"):
                data.pop(key, None)
            return data

        spawn.get_preparation_data = prep
        return self

    def __exit__(self, *exc):
        self._spawn.get_preparation_data = self._orig


@dataclass
class _Worker:
    index: int
    process: object
    conn: object
    stack_file: str
    board_file: str = ""
    pid: int = 0
    main_ident: int = 0
    ready: bool = False  # its "hello" was read
    dead: bool = False

    def alive(self) -> bool:
        return self.ready and not self.dead and self.process.is_alive()

    def current_call(self) -> str:
        return read_board(self.board_file) if self.board_file else ""

    def signal_kill(self) -> None:
        """Send SIGKILL, unless the process is already reaped (its pid may then belong to someone else)."""
        if self.dead:
            return
        try:
            if self.process.exitcode is None:
                os.kill(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, TypeError, ValueError):
            pass

    def reap(self) -> None:
        if self.dead:
            return
        self.process.join(timeout=5)
        self.dead = True
        try:
            self.conn.close()
        except OSError:
            pass
        try:
            self.process.close()
        except ValueError:
            pass

    def kill(self) -> None:
        self.signal_kill()
        self.reap()


@dataclass
class _Pool:
    workers: dict = field(default_factory=dict)  # index -> _Worker
    store: object = None
    tmpdir: str | None = None
    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def port(self) -> int:
        if self.store is None:
            import torch.distributed as dist

            self.store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
        return self.store.port

    def folder(self) -> str:
        """The pool's temporary folder (stack dumps, call boards, multiprocessing's files), made when first needed."""
        if self.tmpdir is None or not os.path.isdir(self.tmpdir):
            self.tmpdir = _make_tmpdir()
        _mp_tempdir_inside(self.tmpdir)
        return self.tmpdir

    def ensure(self, n: int) -> list[_Worker]:
        """Return workers 0..n-1, starting the missing ones (in parallel)."""
        self.folder()
        starting: list[_Worker] = []
        try:
            self._start(n, starting)
            self._await_hello(starting)
        except BaseException:
            # an interrupt (or a failed start) must not leave workers whose "hello" is still unread in their pipe
            self.kill([w for w in starting if not w.ready])
            raise
        return [self.workers[i] for i in range(n)]

    def _start(self, n: int, starting: list) -> None:
        from . import _worker

        ctx = _mp_context()
        with _NoMainImport():
            for i in range(n):
                w = self.workers.get(i)
                if w is not None and w.alive():
                    continue
                if w is not None:
                    self.kill([w])
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                stack_file = os.path.join(self.tmpdir, f"stack-{i}.txt")
                board_file = os.path.join(self.tmpdir, f"board-{i}.bin")
                open(stack_file, "wb").close()
                new_board(board_file)
                proc = ctx.Process(
                    target=_worker.main,
                    args=(child_conn, stack_file, board_file),
                    daemon=True,
                    name=f"labsupport-worker-{i}",
                )
                proc.start()
                child_conn.close()
                w = _Worker(i, proc, parent_conn, stack_file, board_file)
                self.workers[i] = w
                starting.append(w)

    def _await_hello(self, starting: list) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        for w in starting:
            while not w.ready:
                left = deadline - time.monotonic()
                if left <= 0 or not w.process.is_alive() and not w.conn.poll(0):
                    raise RuntimeError(
                        "labsupport could not start its worker processes "
                        f"(worker {w.index} {'did not answer' if left <= 0 else 'exited at start-up'}). "
                        "Check that `python -c 'import torch'` works in this environment, then run the cell again."
                    )
                if w.conn.poll(min(left, 0.5)):
                    msg = pickle.loads(w.conn.recv_bytes())
                    if msg[0] == "hello":
                        w.pid, w.main_ident, w.ready = msg[1], msg[2], True

    def kill(self, workers) -> None:
        """Kill these workers: SIGKILL to all of them first, then wait for each (killing 8 takes one wait)."""
        workers = list(workers)
        for w in workers:
            w.signal_kill()
        for w in workers:
            w.reap()
            if self.workers.get(w.index) is w:
                del self.workers[w.index]

    def shutdown(self) -> None:
        for w in list(self.workers.values()):
            try:
                w.conn.send_bytes(pickle.dumps(("exit",)))
            except OSError:
                pass
        for w in list(self.workers.values()):
            w.process.join(timeout=2)
        self.kill(list(self.workers.values()))
        self.store = None
        _stop_forkserver()
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            _forget_mp_tempdir(self.tmpdir)
            self.tmpdir = None


def _stop_forkserver() -> None:
    """Stop multiprocessing's fork server (it holds a copy of torch in memory) and its resource tracker.

    Both restart by themselves when needed.
    """
    try:
        from multiprocessing import forkserver, resource_tracker

        server = forkserver._forkserver
        if getattr(server, "_forkserver_pid", None) is not None and hasattr(server, "_stop"):
            server._stop()
        tracker = resource_tracker._resource_tracker
        if getattr(tracker, "_pid", None) is not None and hasattr(tracker, "_stop"):
            tracker._stop()
    except Exception:
        pass


_POOL = _Pool()


def shutdown() -> None:
    """Stop the idle worker processes that ``labsupport.run`` keeps between calls.

    Safe to call at any time; the next ``run`` starts new workers. Called automatically when Python exits.

    Example::

        labsupport.run(work, world_size=8)
        labsupport.shutdown()               # give the memory of the 8 idle workers back
    """
    with _POOL.lock:
        _POOL.shutdown()


atexit.register(shutdown)


def _inside_fork_server() -> bool:
    """True while multiprocessing's fork server imports labsupport (its preload): it must not start another one."""
    main = getattr(sys.modules.get("multiprocessing.forkserver"), "main", None)
    code = getattr(main, "__code__", None)
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _wants_early_start() -> bool:
    """``LABSUPPORT_EARLY_START``: "1" always, "0" never; unset: only in a notebook kernel that no launcher started
    (under torchrun every rank imports labsupport, and none of them needs a fork server). Never inside the fork
    server itself, which inherits the setting and imports labsupport to preload it."""
    if _inside_fork_server():
        return False
    setting = os.environ.get("LABSUPPORT_EARLY_START", "")
    if setting in ("0", "1"):
        return setting == "1"
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_PROCID" in os.environ or "RANK" in os.environ
    return "ipykernel" in sys.modules and not launched


def _start_fork_server() -> None:
    try:
        from multiprocessing import forkserver

        with _POOL.lock, _NoMainImport():
            if _mp_context().get_start_method() == "forkserver":
                _POOL.folder()  # the server's listener socket goes there
                forkserver._forkserver.ensure_running()  # (the instance's: it may use a shared server)
    except Exception:  # an early start is only a head start: run() starts the server itself if this failed
        pass


def start_early() -> None:
    """Start the fork server now, in the background, when ``_wants_early_start()``.

    The fork server imports torch once (a second or two) before it forks any worker. Started when a notebook imports
    labsupport, that import happens while the student reads and runs the next cells, so the first ``run`` finds the
    server ready and costs what a later call costs plus the forks.
    """
    if _wants_early_start():
        threading.Thread(target=_start_fork_server, daemon=True, name="labsupport-early-start").start()
