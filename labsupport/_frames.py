"""A rank's Python frames as a student reads them: the launcher's frames left out, torch's folded into one line,
notebook cells named ``Cell In[N]`` as IPython names them (with their source, which only the notebook has, in
``linecache``). Frames come from a worker's exception as (filename, line number, function, source line), or from
the faulthandler dump of a blocked rank.
"""

from __future__ import annotations

import linecache
import os
import re

from .i18n import _

def display_name(filename: str) -> str:
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
    for name in ("_worker", "_callboard", "_board", "_pool", "_output", "_call", "_env", "_frames", "launch", "magics",
                 "tap", "comm", "timeline", "errors", "_sandbox", "_sandbox_host", "_sandbox_child", "_plain",
                 "_relay", "_driving")
)


def is_internal(filename: str) -> bool:
    here = os.path.dirname(os.path.abspath(__file__))
    return f"{os.sep}multiprocessing{os.sep}" in filename or (
        os.path.dirname(filename) == here and os.path.basename(filename) in _CORE_FILES
    )


def _is_torch(filename: str) -> bool:
    return f"{os.sep}torch{os.sep}" in filename


def format_frames(frames, call: str = "") -> tuple[str, str]:
    """Return (traceback text, one-line summary) for frames [(filename, lineno, name, line)], outermost first.

    ``call`` is the torch.distributed call the rank is inside, with its evaluated arguments, when known ("recv(src=1)
    of 4 float32", from the worker's call board): the summary then says that rather than the innermost torch
    function, so that a deadlock report shows which peer each rank waits for.
    """
    frames = [f for f in frames if not is_internal(f[0]) and f[0] != "<string>"]
    lines = []
    torch_run: list = []
    last_user = None

    def flush_torch():
        if torch_run:
            inside = " -> ".join(fr[2] for fr in torch_run[-2:])
            lines.append("  " + _("... inside torch: {functions}").format(functions=inside))
            torch_run.clear()

    for filename, lineno, name, line in frames:
        if _is_torch(filename):
            torch_run.append((filename, lineno, name))
            continue
        flush_torch()
        src = (line or linecache.getline(filename, lineno)).strip()
        lines.append(f'  File "{display_name(filename)}", line {lineno}, in {name}')
        if src:
            lines.append(f"    {src}")
        last_user = (filename, lineno, name, src)
    innermost_torch = torch_run[-1][2] if torch_run else None
    flush_torch()
    blocked_in = call or innermost_torch
    if last_user is None:
        summary = _("blocked in {call}").format(call=blocked_in) if blocked_in else _("(no Python frame)")
    else:
        filename, lineno, name, src = last_user
        where = _("{file}, line {line}").format(file=display_name(filename), line=lineno)
        if blocked_in:
            summary = _("blocked in {call} at {place}: {source}").format(call=blocked_in, place=where, source=src)
        else:
            summary = _("at {place}: {source}").format(place=where, source=src)
    return "\n".join(lines), summary


_THREAD_RE = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
#: the header of a dump of the one thread that took the signal (``all_threads=False``): a worker's main thread,
#: since its other threads block the signal (``labsupport._worker``), or a sandbox's only thread
_STACK_RE = re.compile(r"^Stack \(most recent call first\):")
_FRAME_RE = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def _sections(text: str, main_ident: int) -> dict[int, list]:
    """{thread id: its frames as written, innermost first}; a one-thread dump is filed under ``main_ident``."""
    sections: dict[int, list] = {}
    current = None
    for line in text.splitlines():
        m = _THREAD_RE.match(line)
        if m or _STACK_RE.match(line):
            current = int(m.group(1), 16) if m else main_ident
            if current in sections:  # a second dump appended (the signal sent again): the first one counts
                current = None
            else:
                sections[current] = []
            continue
        m = _FRAME_RE.match(line)
        if m and current is not None:
            sections[current].append((m.group(1), int(m.group(2)), m.group(3), None))
    return sections


def _started_as_a_thread(frames) -> bool:
    """Whether a section's outermost frame is where ``threading`` starts a thread: not a main thread's stack."""
    return bool(frames) and frames[-1][2] in ("_bootstrap", "_bootstrap_inner") and \
        os.path.basename(frames[-1][0]) == "threading.py"


def parse_faulthandler(text: str, main_ident: int):
    """Frames of the main thread from a faulthandler dump, outermost first: none when the dump lacks them (another
    thread's frames are never taken for the rank's)."""
    sections = _sections(text, main_ident)
    frames = sections.get(main_ident)
    if frames is None and sections and not main_ident:  # the main thread unknown: the thread the dump begins with
        frames = next(iter(sections.values()))
    if _started_as_a_thread(frames):
        frames = None
    return list(reversed(frames or []))


def dump_complete(text: str, main_ident: int) -> bool:
    """Whether a faulthandler dump holds the whole stack of the main thread, down to its outermost frame.

    faulthandler writes innermost frames first, line by line, so a dump read too early lacks the outer frames:
    the student's. The main thread of a worker starts at a module's top level (``<module>``); a stack deeper than
    faulthandler writes ends in ``...``, and a thread with no Python frame says so.
    """
    frames = _sections(text, main_ident).get(main_ident)
    if frames and frames[-1][2] == "<module>":
        return True
    if frames is None or not text.endswith("\n"):
        return False
    last = text.rstrip("\n").rsplit("\n", 1)[-1].strip()
    return last in ("...", "<no Python frame>")
