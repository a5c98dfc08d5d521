"""What ``labsupport.run`` raises, and how a worker's failure is put into words.

Frames come from the worker as (filename, line number, function, source line); the notebook fills in the
source of its own cells (which only it has, in ``linecache``) and names them ``Cell In[N]`` as IPython does.
"""

from __future__ import annotations

import builtins
import linecache
import os
import re
import signal

__all__ = ["WorkerError", "WorkerTimeout"]


def _call_site(tb) -> str:
    """Where the student called ``labsupport.run``: the innermost frame of the traceback that is theirs (not the
    launcher's, not IPython's), as "Cell In[5], line 3: labsupport.run(work)"; "" for a ``%%distributed`` cell."""
    site = ""
    while tb is not None:
        code = tb.tb_frame.f_code
        filename = code.co_filename
        if not _is_internal(filename) and f"{os.sep}IPython{os.sep}" not in filename:
            line = linecache.getline(filename, tb.tb_lineno).strip()
            site = "" if "run_cell_magic(" in line else f"{_display_name(filename)}, line {tb.tb_lineno}: {line}"
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
            lines += ["", f"(labsupport.run was called at {site})"]
        return lines


class KeyboardInterrupt(builtins.KeyboardInterrupt):  # noqa: A001 - the name a student expects to see
    """Ctrl-C (or the notebook's interrupt) during ``labsupport.run``: every rank of the call was stopped.

    A ``KeyboardInterrupt`` like any other, shown in a notebook as its one line ("interrupted: all 4 ranks
    stopped") rather than a traceback through multiprocessing.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


class WorkerError(_Rendered, RuntimeError):
    """One or more ranks failed: raised an exception, or died.

    Attributes:
        rank: the first rank that failed.
        ranks: every rank that failed, in rank order.
        exc_type: name of the original exception type on ``rank`` (``None`` if the rank died without one).
        exc_message: its message.
        worker_traceback: its traceback as text, with source lines from the notebook.
        exitcode: the exit code of a rank that died (negative: killed by that signal), else ``None``.
        failures: a dict per failed rank with the same fields.
        exception: the exception ``rank`` raised, rebuilt in the notebook (``None`` when it could not be).

    Example::

        try:
            labsupport.run(work, world_size=4)
        except labsupport.WorkerError as err:
            print(err.rank, err.exc_type, err.exc_message)
            print(err.worker_traceback)     # points at the line of your cell that raised
    """

    def __init__(self, message: str, failures: list[dict]):
        super().__init__(message)
        self.failures = failures
        first = failures[0]
        self.rank = first["rank"]
        self.ranks = [f["rank"] for f in failures]
        self.exc_type = first.get("type")
        self.exc_message = first.get("message")
        self.worker_traceback = first.get("traceback", "")
        self.exitcode = first.get("exitcode")
        self.exception = None

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


def _display_name(filename: str) -> str:
    """'Cell In[5]' for a notebook cell, the path otherwise."""
    try:
        from IPython import get_ipython

        ip = get_ipython()
        count = getattr(getattr(ip, "compile", None), "_filename_map", {}).get(filename)
        if count is not None:
            return f"Cell In[{count}]"
    except Exception:
        pass
    return filename


#: The launcher's own modules: their frames are never shown to a student.
_CORE_FILES = frozenset(
    f"{name}.py"
    for name in ("_worker", "_callboard", "_board", "_pool", "_output", "_call", "_env", "launch", "magics", "tap",
                 "comm", "timeline", "errors")
)


def _is_internal(filename: str) -> bool:
    here = os.path.dirname(os.path.abspath(__file__))
    return f"{os.sep}multiprocessing{os.sep}" in filename or (
        os.path.dirname(filename) == here and os.path.basename(filename) in _CORE_FILES
    )


def _is_torch(filename: str) -> bool:
    return f"{os.sep}torch{os.sep}" in filename


def _format_frames(frames, call: str = "") -> tuple[str, str]:
    """Return (traceback text, one-line summary) for frames [(filename, lineno, name, line)], outermost first.

    ``call`` is the torch.distributed call the rank is inside, with its evaluated arguments, when known ("recv(src=1)
    of 4 float32", from the worker's call board): the summary then says that rather than the innermost torch
    function, so that a deadlock report shows which peer each rank waits for.
    """
    frames = [f for f in frames if not _is_internal(f[0]) and f[0] != "<string>"]
    lines = []
    torch_run: list = []
    last_user = None

    def flush_torch():
        if torch_run:
            lines.append(f"  ... inside torch: {' -> '.join(fr[2] for fr in torch_run[-2:])}")
            torch_run.clear()

    for filename, lineno, name, line in frames:
        if _is_torch(filename):
            torch_run.append((filename, lineno, name))
            continue
        flush_torch()
        src = (line or linecache.getline(filename, lineno)).strip()
        lines.append(f'  File "{_display_name(filename)}", line {lineno}, in {name}')
        if src:
            lines.append(f"    {src}")
        last_user = (filename, lineno, name, src)
    innermost_torch = torch_run[-1][2] if torch_run else None
    flush_torch()
    blocked_in = call or innermost_torch
    if last_user is None:
        summary = f"blocked in {blocked_in}" if blocked_in else "(no Python frame)"
    else:
        filename, lineno, name, src = last_user
        where = f"{_display_name(filename)}, line {lineno}"
        summary = (f"blocked in {blocked_in} at " if blocked_in else "at ") + f"{where}: {src}"
    return "\n".join(lines), summary


_THREAD_RE = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME_RE = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def _parse_faulthandler(text: str, main_ident: int):
    """Frames of the main thread from a faulthandler dump, outermost first."""
    sections: dict[int, list] = {}
    current = None
    for line in text.splitlines():
        m = _THREAD_RE.match(line)
        if m:
            current = int(m.group(1), 16)
            sections[current] = []
            continue
        m = _FRAME_RE.match(line)
        if m and current is not None:
            sections[current].append((m.group(1), int(m.group(2)), m.group(3), None))
    frames = sections.get(main_ident)
    if frames is None and sections:
        frames = next(iter(sections.values()))
    return list(reversed(frames or []))


def _dump_complete(text: str, main_ident: int) -> bool:
    """Whether a faulthandler dump holds the whole stack of the main thread, down to its outermost frame.

    faulthandler writes innermost frames first, line by line, so a dump read too early lacks the outer frames:
    the student's. The main thread of a worker starts at a module's top level (``<module>``).
    """
    section = None
    last = None
    for line in text.splitlines():
        m = _THREAD_RE.match(line)
        if m:
            if section == main_ident and last is not None:
                break
            section, last = int(m.group(1), 16), None
            continue
        m = _FRAME_RE.match(line)
        if m and section == main_ident:
            last = m.group(3)
    return section == main_ident and last == "<module>"


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _death_message(code) -> str:
    if code is None:
        return "stopped without a result"
    if code < 0:
        name = _signal_name(code)
        hint = {
            "SIGKILL": "killed from outside, often by the out-of-memory killer",
            "SIGSEGV": "a segmentation fault in native code",
            "SIGABRT": "aborted by native code (a failed C++ check)",
            "SIGBUS": "a bus error in native code",
        }.get(name, "killed by a signal")
        return f"died from {name} ({hint})"
    return f"exited with code {code} without raising an exception (os._exit or a C extension calling exit)"


_CONNECTION_ERRORS = ("Connection closed by peer", "Read error", "Connection reset", "Broken pipe", "Socket closed")


def _is_consequence(failure: dict) -> bool:
    """A gloo connection error: what a rank sees when a peer died or was stopped, not a cause."""
    msg = failure.get("message") or ""
    return failure.get("type") == "RuntimeError" and any(e in msg for e in _CONNECTION_ERRORS)
