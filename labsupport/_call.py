"""One call of ``labsupport.run``, from sending the task to the last result or failure: ``_Call``.

It sends each worker its task, relays the ranks' prints as they come (``_output``), and waits for a result or a
failure from every rank. The first failure gives the others ``_FAILURE_GRACE`` seconds to report theirs (a rank
that dies makes its peers fail too), then every worker of the call is killed. At the time-out it reads where each
running rank is blocked (its call board and a faulthandler dump of its stacks) for the deadlock report. The
wording of every report is in ``errors``.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys
import time

from ._frames import dump_complete, format_frames, parse_faulthandler
from ._native import native_error
from ._output import RankOutput
from ._pool import _cores, _loopback_ifname, _Pool, _Worker
from .errors import Failure, WorkerError, WorkerTimeout, deadlock_report
from .i18n import _

_FAILURE_GRACE = 0.4  # seconds to collect the other ranks' errors after the first failure
_STACK_WAIT = 2.0  # at most this long for the stack dumps of deadlocked ranks
_UNCHANGED = 25  # polls (of 20 ms) of a dump that stopped growing short of its outermost frame: taken as it is
_RESEND = 0.5  # a rank whose stack file is still empty this long after its signal is sent it again


class _Call:
    """One call of ``run``: send the task, relay output, collect results or failures."""

    def __init__(self, pool: _Pool, world_size: int, backend: str, timeout: float):
        self.pool = pool
        self.n = world_size
        self.backend = backend
        self.timeout = float(timeout)
        self.results: dict[int, object] = {}
        self.failures: dict[int, Failure] = {}
        self.output = RankOutput(world_size)
        self.stopped = False  # this call's workers were killed (a failure, a time-out, an interrupt)

    # output ---------------------------------------------------------------------------------------------------
    def _emit(self, rank: int, stream: str, text: str) -> None:
        self.output.emit(rank, stream, text)

    def _flush_output(self) -> None:
        self.output.flush()

    # messages -------------------------------------------------------------------------------------------------
    def _handle(self, rank: int, msg) -> None:
        kind = msg[0]
        if len(msg) > 1 and msg[1] != self.call_id:
            return
        if kind == "out":
            self._emit(rank, msg[2], msg[3])
        elif kind == "result":
            try:
                self.results[rank] = pickle.loads(msg[2])
            except Exception as exc:
                self.failures[rank] = Failure.unreadable_result(rank, exc)
        elif kind == "error":
            self.failures[rank] = Failure.raised(rank, msg[2])

    def _drain(self, w: _Worker) -> None:
        try:
            while w.conn.poll(0):
                self._handle(w.index, pickle.loads(w.conn.recv_bytes()))
        except (EOFError, OSError):
            pass

    # the call -------------------------------------------------------------------------------------------------
    def _spec(self) -> dict:
        extra_env = {}
        ifname = _loopback_ifname()
        if ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
            extra_env["GLOO_SOCKET_IFNAME"] = ifname
        return {
            "world_size": self.n,
            "backend": self.backend,
            "master_addr": "127.0.0.1",
            "master_port": self.pool.port(),
            "pg_timeout": self.timeout + 60.0,
            "threads": max(1, _cores() // self.n),
            "call_id": self.call_id,
            "cwd": os.getcwd(),
            "sys_path": list(sys.path),
            "environ": dict(os.environ),  # as a freshly started process would see it now
            "extra_env": extra_env,
        }

    def run(self, payload: bytes):
        __tracebackhide__ = True
        pool = self.pool
        workers = pool.ensure(self.n)
        pool.calls += 1
        self.call_id = pool.calls
        spec = self._spec()
        done = False
        try:
            for w in workers:
                w.conn.send_bytes(
                    pickle.dumps(("task", self.call_id, dict(spec, rank=w.index), payload), protocol=5)
                )
            self._wait(workers)
            self._send_finish(workers)
            done = True
        finally:
            # not done: an interrupt, a failure or a time-out; these workers cannot be trusted any more. Once done,
            # every worker has its "finish", so an interrupt from here on leaves nothing behind.
            if not done:
                self._kill(workers)
                self.stopped = True
            self._flush_output()
        return [self.results[r] for r in range(self.n)]

    def _send_finish(self, workers) -> None:
        """Tell every worker to destroy this call's process group (it then waits for the next task)."""
        for w in workers:
            try:
                w.conn.send_bytes(pickle.dumps(("finish", self.call_id)))
            except OSError:  # it died after sending its result: the next call starts a new one
                self.pool.kill([w])

    def _kill(self, workers) -> None:
        """Kill this call's workers, even when a second Ctrl-C arrives while they are being killed."""
        try:
            self.pool.kill(workers)
        except KeyboardInterrupt:
            self.pool.kill(workers)
            raise

    def _wait(self, workers) -> None:
        __tracebackhide__ = True
        start = time.monotonic()
        deadline = start + self.timeout
        first_failure = None
        by_conn = {w.conn: w for w in workers}
        by_sentinel = {w.process.sentinel: w for w in workers}
        while True:
            running = [w for w in workers if w.index not in self.results and w.index not in self.failures]
            if not running:
                break
            now = time.monotonic()
            if first_failure is not None and now - first_failure > _FAILURE_GRACE:
                break
            if now >= deadline:
                self._timeout(running, workers)
            wait_until = deadline if first_failure is None else min(deadline, first_failure + _FAILURE_GRACE)
            waitables = [w.conn for w in running] + [w.process.sentinel for w in running]
            ready = mpc.wait(waitables, timeout=min(0.1, max(0.0, wait_until - now)))
            for obj in ready:
                if obj in by_conn:
                    self._drain(by_conn[obj])
            for obj in ready:
                w = by_sentinel.get(obj)
                if w is not None and w.index not in self.results and w.index not in self.failures:
                    self._drain(w)
                    if w.index not in self.results and w.index not in self.failures:
                        w.process.join(timeout=1)
                        self.failures[w.index] = Failure.died(w.index, w.process.exitcode,
                                                              native_error(w.stack_file))
            if self.failures and first_failure is None:
                first_failure = time.monotonic()
        if self.failures:
            self._raise_failures()

    def _raise_failures(self):
        __tracebackhide__ = True
        others = sorted(set(range(self.n)) - set(self.failures) - set(self.results))
        err = WorkerError.from_failures(list(self.failures.values()), others)
        # no chained header: the rank's exception has no traceback here, its text and frames are in the message
        raise err from None

    def _dump_stacks(self, running) -> dict[int, str]:
        """Every running rank's stack: SIGUSR1 makes faulthandler write its main thread's to the rank's stack file.

        Waits until each dump is complete (it reaches the outermost frame, or the file stopped growing), at most
        ``_STACK_WAIT`` seconds: eight ranks on a loaded machine can take longer than any fixed pause, and a
        half-written dump would lose the frames that matter most (the outer ones, the student's). A rank whose file
        is still empty after ``_RESEND`` seconds is sent the signal again (it may have come while the rank was
        between a sandbox and its own stack).
        """
        def signal_(w) -> None:
            try:
                os.kill(_sandbox_of(w) or w.process.pid, signal.SIGUSR1)
            except (OSError, TypeError, ValueError):
                pass

        for w in running:
            try:
                open(w.stack_file, "w").close()
            except OSError:
                pass
            signal_(w)
        texts = {w.index: "" for w in running}
        unchanged = {w.index: 0 for w in running}
        pending = list(running)
        start = time.monotonic()
        deadline, resend = start + _STACK_WAIT, start + _RESEND
        while pending and time.monotonic() < deadline:
            time.sleep(0.02)
            for w in list(pending):
                try:
                    with open(w.stack_file) as fh:
                        text = fh.read()
                except OSError:
                    text = ""
                unchanged[w.index] = unchanged[w.index] + 1 if text and text == texts[w.index] else 0
                texts[w.index] = text
                if text and (dump_complete(text, w.main_ident) or unchanged[w.index] >= _UNCHANGED):
                    pending.remove(w)
            if time.monotonic() >= resend:
                for w in pending:
                    if not texts[w.index]:
                        signal_(w)
                resend = time.monotonic() + _RESEND
        return texts

    def _timeout(self, running, workers) -> None:
        __tracebackhide__ = True
        for w in running:  # each worker writes the call it is inside on its board (its reader thread does)
            try:
                w.conn.send_bytes(pickle.dumps(("board",)))
            except OSError:
                pass
        texts = self._dump_stacks(running)
        calls = _boards(running)
        stacks: dict[int, str] = {}
        summaries: dict[int, str] = {}
        for w in running:
            call = calls[w.index]
            frames = parse_faulthandler(texts[w.index], w.main_ident)
            if frames:
                stacks[w.index], summaries[w.index] = format_frames(frames, call)
            else:
                stacks[w.index] = ""
                summaries[w.index] = _("blocked in {call} (its stack could not be read)").format(call=call) if call \
                    else _("(its stack could not be read)")
        # the output that arrived meanwhile still belongs in the cell
        for w in workers:
            self._drain(w)
        ranks = [w.index for w in running]
        message = deadlock_report(self.n, self.timeout, ranks, summaries, stacks, sorted(self.results))
        self._kill(workers)
        self.stopped = True
        raise WorkerTimeout(message, ranks, stacks, self.timeout) from None


def _sandbox_of(w) -> int | None:
    """The process running the student's function for a grading check on worker ``w`` (``labsupport._sandbox``),
    if one is running it now: its stack, not the worker's, shows where the student's code is blocked."""
    try:
        with open(w.stack_file + ".sandbox") as fh:
            return int(fh.read().strip() or 0) or None
    except (OSError, ValueError):
        return None


def _boards(running, wait: float = 1.0) -> dict[int, str]:
    """The call each running worker wrote on its board when asked (see ``_Call._timeout``). Its reader thread has
    normally answered while the stacks were dumped; on a busy machine, give it a moment more."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not all(w.board_answered() for w in running):
        time.sleep(0.02)
    return {w.index: w.current_call() for w in running}
