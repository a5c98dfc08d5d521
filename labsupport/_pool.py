"""The workers ``labsupport.run`` keeps between calls, and how they are started and stopped.

Workers are forked from multiprocessing's fork server, which imports torch once before any thread pool exists;
each worker runs ``labsupport._worker.main``. The pool also owns the rendezvous store (one TCP port) and a
temporary folder for the stack dumps and call boards of the workers. ``shutdown`` gives all of it back; a kernel
killed before it could do so leaves its folder behind, and the next pool removes it.
"""

from __future__ import annotations

import atexit
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

from ._board import board_answered, new_board, read_board
from ._forkserver import (
    _forget_mp_tempdir,
    _mp_context,
    _mp_tempdir_inside,
    _NoMainImport,
    _owner_alive,
    _stop_forkserver,
    _wants_early_start,
    start_quietly,
)
from .i18n import _

_STARTUP_TIMEOUT = 180.0
_TMP_PREFIX = "labsupport-"


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


def remove_stale_dirs(base: str | None = None) -> None:
    """Remove the folders of pools whose kernel died without cleaning up (SIGKILL, the out-of-memory killer),
    in ``base`` (default: this process's temporary folder). The grader calls it after each notebook.

    A pool's folder is named ``labsupport-<pid of its kernel>-<random>``: once that process is gone, nobody uses
    the folder any more. Folders of other users, and of kernels still running, are left alone.
    """
    base = base or tempfile.gettempdir()
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
    remove_stale_dirs()
    return tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-")


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

    def board_answered(self) -> bool:
        return board_answered(self.board_file) if self.board_file else True

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
        server = ctx.get_start_method() == "forkserver"
        with _NoMainImport():
            for i in range(n):
                w = self.workers.get(i)
                if w is not None and w.alive():
                    continue
                if w is not None:
                    self.kill([w])
                if server:  # before the first start: the server, where no interrupt reaches it while it starts
                    start_quietly()
                    server = False
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                stack_file = os.path.join(self.tmpdir, f"stack-{i}.txt")
                board_file = os.path.join(self.tmpdir, f"board-{i}.bin")
                open(stack_file, "wb").close()
                try:  # where a killed worker's sandbox wrote its pid (labsupport._sandbox): not this worker's
                    os.unlink(stack_file + ".sandbox")
                except FileNotFoundError:
                    pass
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
                    raise RuntimeError((_(
                        "labsupport could not start its worker processes (worker {index} did not answer). "
                        "Check that `python -c 'import torch'` works in this environment, then run the cell again."
                    ) if left <= 0 else _(
                        "labsupport could not start its worker processes (worker {index} exited at start-up). "
                        "Check that `python -c 'import torch'` works in this environment, then run the cell again."
                    )).format(index=w.index))
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

    def stop_workers(self) -> None:
        """Ask every worker to exit (each ends its sandbox), then kill those still there; the fork server stays."""
        for w in list(self.workers.values()):
            try:
                w.conn.send_bytes(pickle.dumps(("exit",)))
            except OSError:
                pass
        for w in list(self.workers.values()):
            w.process.join(timeout=2)
        self.kill(list(self.workers.values()))

    def shutdown(self) -> None:
        self.stop_workers()
        self.store = None
        _stop_forkserver()
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            _forget_mp_tempdir(self.tmpdir)
            self.tmpdir = None


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


def stop_workers() -> None:
    """Stop the idle workers (and their sandboxes) but keep the fork server: the next ``run`` forks new ones."""
    with _POOL.lock:
        _POOL.stop_workers()


def _start_fork_server() -> None:
    try:
        with _POOL.lock, _NoMainImport():
            if _mp_context().get_start_method() == "forkserver":
                _POOL.folder()  # the server's listener socket goes there
                start_quietly()  # a kernel shut down while the server starts interrupts it: it must not hear that
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


def stop_with_the_kernel() -> None:
    """In a notebook kernel: stop the workers, the fork server and multiprocessing's resource tracker as soon as
    the kernel is asked to shut down or restart, before ipykernel goes after its child processes.

    Left to ipykernel, a kernel's children get SIGTERM, then SIGKILL, with growing pauses as long as any is left
    (about 30 s in all), and the resource tracker ignores SIGTERM and stays unreaped after SIGKILL. jupyter_client
    does not wait that long: it terminates the kernel after 2.5 s and kills it after 5, before ``shutdown`` runs
    at exit. So every restart took seconds and ended in a kill. ``do_shutdown`` is where a kernel does what must
    happen when the front end shuts it down; this wraps the kernel's own. Outside a kernel it does nothing.
    """
    if "ipykernel" not in sys.modules:
        return
    try:
        from IPython import get_ipython

        kernel = getattr(get_ipython(), "kernel", None)
    except Exception:
        return
    if kernel is None or not callable(getattr(kernel, "do_shutdown", None)) or \
            getattr(kernel, "_labsupport_stops_first", False):
        return
    original = kernel.do_shutdown

    def do_shutdown(restart):
        # a cell still inside run() holds the lock: then ipykernel's own ending stops the workers
        if _POOL.lock.acquire(timeout=2.0):
            try:
                _POOL.shutdown()
            except Exception:
                pass
            finally:
                _POOL.lock.release()
        return original(restart)

    kernel.do_shutdown = do_shutdown
    kernel._labsupport_stops_first = True
