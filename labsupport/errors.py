"""What ``labsupport.run`` raises, the record of a rank's failure (``Failure``), and every report's wording.

In a notebook, ``WorkerError`` and ``WorkerTimeout`` show their message first (the rank, its exception, its
traceback down to the student's own line) and no launcher frame; an interrupt shows one line.
"""

from __future__ import annotations

import builtins
import linecache
import os
import pickle
import signal
from dataclasses import dataclass

from ._frames import display_name, format_frames, is_internal
from .i18n import _

__all__ = ["WorkerError", "WorkerTimeout"]


def _call_site(tb) -> str:
    """Where the student called ``labsupport.run``: the innermost frame of the traceback that is theirs (not the
    launcher's, not IPython's), as "Cell In[5], line 3: labsupport.run(work)"; "" for a ``%%distributed`` cell."""
    site = ""
    while tb is not None:
        code = tb.tb_frame.f_code
        filename = code.co_filename
        if not is_internal(filename) and f"{os.sep}IPython{os.sep}" not in filename:
            line = linecache.getline(filename, tb.tb_lineno).strip()
            site = "" if "run_cell_magic(" in line else f"{display_name(filename)}, line {tb.tb_lineno}: {line}"
        tb = tb.tb_next
    return site


class _Rendered:
    """How IPython shows the error in a notebook (``_render_traceback_``): the message first, which starts with the
    rank and its exception and holds the rank's traceback down to the student's own line; then where the student
    called ``run``. The launcher's frames, which nobody can act on, are left out."""

    def _render_traceback_(self) -> list[str]:
        lines = f"{type(self).__name__}: {self}".splitlines()
        site = _call_site(self.__traceback__)
        if site:
            lines += ["", _("(labsupport.run was called at {site})").format(site=site)]
        return lines


class KeyboardInterrupt(builtins.KeyboardInterrupt):  # noqa: A001 - the name a student expects to see
    """Ctrl-C (or the notebook's interrupt) during ``labsupport.run``: every rank of the call was stopped.

    A ``KeyboardInterrupt`` like any other, shown in a notebook as its one line ("interrupted: all 4 ranks
    stopped") rather than a traceback through multiprocessing.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


@dataclass
class Failure:
    """What went wrong on one rank. Read like the dict it replaces (``failure["rank"]``, ``failure.get("where")``).

    ``type`` is the name of the exception the rank raised, ``None`` when it died without one (then ``exitcode``
    says how); ``traceback`` its frames as text, down to the student's line; ``where`` what the worker was doing
    ("initialising the process group"); ``exception`` the exception pickled, when the notebook can rebuild it.
    """

    rank: int
    type: str | None
    message: str
    traceback: str = ""
    summary: str = ""
    where: str | None = None
    exitcode: int | None = None
    exception: bytes | None = None
    native: str | None = None

    @classmethod
    def raised(cls, rank: int, error: dict) -> "Failure":
        """From the error a worker sent (``_worker._error_dict``)."""
        text, summary = format_frames(error["frames"])
        message = error["message"] if error["message"].strip() else _empty_message(error["type"], error["frames"])
        return cls(rank, error["type"], message, text, summary, error["where"], exception=error.get("exception"))

    @classmethod
    def died(cls, rank: int, exitcode: int | None, native: str | None = None) -> "Failure":
        """``native``: the last error native code wrote to the rank's stderr, quoted when the rank died of it."""
        native = None if exitcode == -signal.SIGKILL else native   # killed from outside: not what it wrote
        return cls(rank, None, _death_message(exitcode, native), exitcode=exitcode, native=native)

    @classmethod
    def unreadable_result(cls, rank: int, exc: Exception) -> "Failure":
        return cls(rank, type(exc).__name__,
                   _("the result could not be rebuilt in the notebook: {error}").format(error=exc))

    def __getitem__(self, key: str):
        return getattr(self, key)

    def get(self, key: str, default=None):
        return getattr(self, key, default)

    @property
    def consequence(self) -> bool:
        return _is_consequence(self)


class WorkerError(_Rendered, RuntimeError):
    """One or more ranks failed: raised an exception, or died.

    Attributes:
        rank: the first rank that failed.
        ranks: every rank that failed, in rank order.
        exc_type: name of the original exception type on ``rank`` (``None`` if the rank died without one).
        exc_message: its message.
        worker_traceback: its traceback as text, with source lines from the notebook.
        exitcode: the exit code of a rank that died (negative: killed by that signal), else ``None``.
        native: the last error native code wrote before that rank died (gloo's ``what()``), else ``None``.
        failures: a ``Failure`` per failed rank with the same fields (read like a dict: ``f["rank"]``).
        exception: the exception ``rank`` raised, rebuilt in the notebook (``None`` when it could not be).

    Example::

        try:
            labsupport.run(work, world_size=4)
        except labsupport.WorkerError as err:
            print(err.rank, err.exc_type, err.exc_message)
            print(err.worker_traceback)     # points at the line of your cell that raised
    """

    def __init__(self, message: str, failures: list):
        super().__init__(message)
        self.failures = failures
        first = failures[0]
        self.rank = first["rank"]
        self.ranks = [f["rank"] for f in failures]
        self.exc_type = first.get("type")
        self.exc_message = first.get("message")
        self.worker_traceback = first.get("traceback", "")
        self.exitcode = first.get("exitcode")
        self.native = first.get("native")
        self.exception = None

    @classmethod
    def from_failures(cls, failures: list, others: list[int]) -> "WorkerError":
        """The error for these failures, the first (real) one first; ``others`` are the ranks that were stopped."""
        # A rank that dies makes its peers' gloo calls fail with connection errors: those are consequences.
        failures = sorted(failures, key=lambda f: (f.consequence, f.rank))
        first = failures[0]
        heads = []
        for f in failures:
            if f.type is None:
                heads.append(_("rank {rank} {what_happened}").format(rank=f.rank, what_happened=f.message))
            elif f.consequence and not first.consequence:
                heads.append(_("rank {rank} then lost its connection to the failed rank").format(rank=f.rank))
                f.traceback = ""
            elif f.where not in (None, "running your function"):   # what the worker was doing (_worker's N_())
                heads.append(_("rank {rank} raised {type}: {message} while {doing}").format(
                    rank=f.rank, type=f.type, message=f.message, doing=_(f.where)))
            else:
                heads.append(_("rank {rank} raised {type}: {message}").format(rank=f.rank, type=f.type,
                                                                              message=f.message))
        parts = ["; ".join(heads)]
        for f in failures:
            if f.traceback:
                head = _("Traceback on rank {rank} (most recent call last):").format(rank=f.rank)
                parts.append(f"\n{head}\n{f.traceback}")
                parts.append(f"{f.type}: {f.message}")
        if others:
            parts.append("\n" + _("Ranks {ranks} were stopped.").format(ranks=others))
        err = cls("\n".join(parts), failures)
        if first.exception:
            try:
                err.exception = pickle.loads(first.exception)
            except Exception:
                pass
        return err

    def __reduce__(self):
        # the default rebuilds an exception from its message alone, and this one needs its failures too: without
        # this, copying the error to another process (a thread pool, the autograder's workers) would fail
        return type(self), (str(self), self.failures)


class WorkerTimeout(_Rendered, TimeoutError):
    """Ranks were still running after ``timeout`` seconds, usually a deadlock.

    Attributes:
        ranks: the ranks that were still running.
        stacks: ``{rank: stack text}``, where each of them was blocked.
        timeout: the time limit in seconds.

    Example::

        try:
            labsupport.run(work, world_size=2, timeout=5)
        except labsupport.WorkerTimeout as err:
            print(err.ranks)                # the ranks that never finished
            print(err.stacks[0])            # where rank 0 was waiting
    """

    def __init__(self, message: str, ranks: list[int], stacks: dict[int, str], timeout: float):
        super().__init__(message)
        self.ranks = ranks
        self.stacks = stacks
        self.timeout = timeout

    def __reduce__(self):
        return type(self), (str(self), self.ranks, self.stacks, self.timeout)


def _qualified_name(filename: str, lineno: int, name: str) -> str:
    """``MiniFSDP.forward`` for the method whose body holds line ``lineno`` of ``filename`` (a notebook cell's
    source is in ``linecache``); the frame's bare ``name`` when the source cannot be read."""
    import ast

    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return name
    found: list[str] = []

    def visit(node, outer):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                    child.lineno <= lineno <= (child.end_lineno or child.lineno):
                path = outer + [child.name]
                if not isinstance(child, ast.ClassDef):
                    found[:] = path
                visit(child, path)

    visit(tree, [])
    return ".".join(found) if found and found[-1] == name else name


def _empty_message(exc_type: str, frames) -> str:
    """What to say for an exception raised with no message (``raise NotImplementedError()``): the function or
    method whose body raised it, from the innermost frame of the student's (or a library's) code."""
    frames = [f for f in frames if not is_internal(f[0]) and f[0] != "<string>"]
    if not frames:
        return _("(raised with no message)")
    filename, lineno, name, line = frames[-1]
    where = _qualified_name(filename, lineno, name)
    if exc_type == "NotImplementedError":
        return _("{function} is not implemented yet").format(function=where) if name != "<module>" else \
            _("not implemented yet")
    src = (line or linecache.getline(filename, lineno)).strip()
    if src:
        return _("(no message) in {function}, {file}, line {line}: {source}").format(
            function=where, file=display_name(filename), line=lineno, source=src)
    return _("(no message) in {function}, {file}, line {line}").format(function=where, file=display_name(filename),
                                                                       line=lineno)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return _("signal {number}").format(number=-code)


def _death_message(code, native: str | None = None) -> str:
    if code is None:
        return _("stopped without a result")
    said = f": {native}" if native else ""
    if code < 0:
        name = _signal_name(code)
        hint = {
            "SIGKILL": _("killed from outside, often by the out-of-memory killer"),
            "SIGSEGV": _("a segmentation fault in native code"),
            "SIGABRT": _("aborted by native code (a failed C++ check)"),
            "SIGBUS": _("a bus error in native code"),
        }.get(name) or _("killed by a signal")
        return _("died from {signal} ({hint})").format(signal=name, hint=hint) + said
    return _("exited with code {code} without raising an exception (os._exit or a C extension calling exit)").format(
        code=code) + said


_CONNECTION_ERRORS = ("Connection closed by peer", "Read error", "Connection reset", "Broken pipe", "Socket closed")


def _is_consequence(failure) -> bool:
    """A gloo connection error: what a rank sees when a peer died or was stopped, not a cause."""
    msg = failure.get("message") or ""
    return failure.get("type") == "RuntimeError" and any(e in msg for e in _CONNECTION_ERRORS)


def deadlock_report(world_size: int, timeout: float, ranks: list, summaries: dict, stacks: dict, done: list) -> str:
    """The message of a ``WorkerTimeout``: where each rank still running was blocked, then its stack."""
    lines = [
        _("{running} of {world_size} ranks were still running after {timeout} s: probably a deadlock "
          "(a rank waiting for a message that never comes). Where each one was:").format(
            running=len(ranks), world_size=world_size, timeout=f"{timeout:g}")
    ]
    for r in ranks:
        lines.append(f"  rank {r}: {summaries[r]}")
    if done:
        lines.append("  " + _("ranks {ranks} had finished.").format(ranks=done))
    for r in ranks:
        if stacks[r]:
            head = _("Stack of rank {rank} (most recent call last):").format(rank=r)
            lines.append(f"\n{head}\n{stacks[r]}")
    lines.append("\n" + _(
        "Every send needs a matching recv on the peer (same size, same order), and every rank must call the "
        "same collectives in the same order. All ranks were stopped; the next call starts fresh workers."
    ))
    return "\n".join(lines)


def interrupted_message(world_size: int, stopped: bool) -> str:
    if stopped:
        return _("interrupted: all {world_size} ranks stopped").format(world_size=world_size) if world_size > 1 \
            else _("interrupted: the rank was stopped")
    return _("interrupted after the ranks had finished")


def unpicklable_message(fn, exc: Exception) -> str:
    return _(
        "labsupport.run could not send {function} and its arguments to the workers: {error}. "
        "Arguments must be picklable (tensors, numbers, lists, modules, functions); open files, locks and "
        "generators are not."
    ).format(function=repr(getattr(fn, "__name__", fn)), error=exc)


def torchrun_failed_message(timeout: float, exc: Exception) -> str:
    env = os.environ
    found = ", ".join(f"{k}={env[k]}" for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k in env)
    return _(
        "labsupport.run found {found} in the environment, so it took this process for rank {rank} "
        "of a job started by torchrun (or srun), but the other ranks did not join within {timeout} s "
        "({error}). If you did not start this script with torchrun, remove these variables "
        "from the environment (for example `del os.environ['RANK']`) and run it again: labsupport.run then starts "
        "its own workers."
    ).format(found=found, rank=env.get("RANK", "?"), timeout=f"{timeout:g}", error=f"{type(exc).__name__}: {exc}")

