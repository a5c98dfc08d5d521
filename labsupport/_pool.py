"""The workers ``labsupport.run`` keeps between calls, and how they are started and stopped.

Workers are forked from multiprocessing's fork server, which imports torch once before any thread pool exists;
each worker runs ``labsupport._worker.main``. The pool also owns the rendezvous store (one TCP port) and a
temporary folder for the stack dumps of blocked workers. ``shutdown`` gives all of it back.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

__all__ = ["shutdown"]

_STARTUP_TIMEOUT = 180.0


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


def _mp_context():
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["labsupport._worker"])
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
    pid: int = 0
    main_ident: int = 0
    dead: bool = False

    def alive(self) -> bool:
        return not self.dead and self.process.is_alive()

    def kill(self) -> None:
        if self.dead:
            return
        self.dead = True
        try:
            os.kill(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass
        self.process.join(timeout=5)
        try:
            self.conn.close()
        except OSError:
            pass
        try:
            self.process.close()
        except ValueError:
            pass


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

    def ensure(self, n: int) -> list[_Worker]:
        """Return workers 0..n-1, starting the missing ones (in parallel)."""
        if self.tmpdir is None:
            self.tmpdir = tempfile.mkdtemp(prefix="labsupport-")
        ctx = _mp_context()
        starting = []
        with _NoMainImport():
            for i in range(n):
                w = self.workers.get(i)
                if w is not None and w.alive():
                    continue
                if w is not None:
                    w.kill()
                from . import _worker

                parent_conn, child_conn = ctx.Pipe(duplex=True)
                stack_file = os.path.join(self.tmpdir, f"stack-{i}.txt")
                open(stack_file, "w").close()
                proc = ctx.Process(
                    target=_worker.main, args=(child_conn, stack_file), daemon=True, name=f"labsupport-worker-{i}"
                )
                proc.start()
                child_conn.close()
                w = _Worker(i, proc, parent_conn, stack_file)
                self.workers[i] = w
                starting.append(w)
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        for w in starting:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not w.alive() and not w.conn.poll(0):
                    self.kill(starting)
                    raise RuntimeError(
                        "labsupport could not start its worker processes "
                        f"(worker {w.index} {'did not answer' if left <= 0 else 'exited at start-up'}). "
                        "Check that `python -c 'import torch'` works in this environment, then run the cell again."
                    )
                if w.conn.poll(min(left, 0.5)):
                    msg = pickle.loads(w.conn.recv_bytes())
                    if msg[0] == "hello":
                        w.pid, w.main_ident = msg[1], msg[2]
                        break
        return [self.workers[i] for i in range(n)]

    def kill(self, workers) -> None:
        for w in workers:
            w.kill()
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
