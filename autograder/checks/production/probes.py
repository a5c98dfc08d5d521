"""What a worker's file system calls show, below the student's Python (Python's audit events, which the interpreter
raises just before each call): the paths a process opens for writing or renames onto, each step of a save that
changes what is on disk (``open`` for writing, ``os.rename``, ``os.remove``, ``os.rmdir``, ``os.mkdir``,
``os.symlink``, ``os.link``, ``os.truncate``), handed to a callback before the step is made, and the bytes a
process read (``/proc/self/io``)."""

from __future__ import annotations

import os
import sys

#: The audit events of the calls that change what a crash leaves on disk (``open`` counts when it writes).
CHANGES = ("open", "os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.truncate")

# While a save is watched: ``writes``, the paths opened for writing or renamed onto; ``on_step``, called with
# (description, the path an open creates or empties, or None) before each change under ``root``.
_STATE = {"writes": None, "on_step": None, "root": "", "busy": False}
_HOOKED = []


def _writing(args) -> bool:
    mode, flags = args[1], args[2]
    if isinstance(mode, str):
        return any(ch in mode for ch in "wax+")
    return isinstance(flags, int) and bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))


def _full(path, dir_fd=-1) -> str | None:
    """The absolute path of ``path`` (relative to ``dir_fd`` when one is given), its last component not resolved
    (a symlink renamed onto is the link, not its target)."""
    if isinstance(path, int) or path is None:
        try:
            path = os.readlink(f"/proc/self/fd/{int(path)}")
        except (OSError, TypeError, ValueError):
            return None
    path = os.fsdecode(path)
    if not os.path.isabs(path) and isinstance(dir_fd, int) and dir_fd >= 0:
        try:
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        except OSError:
            return None
    path = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def _step(event, args, root: str):
    """(description, the path an open creates or empties, or None) of a change under ``root``, or None."""
    def inside(p):
        return p is not None and (p + os.sep).startswith(root + os.sep)

    def rel(p):
        return os.path.relpath(p, root)

    if event == "open":
        path = _full(args[0])
        if not _writing(args) or not inside(path):
            return None
        flags = args[2] if isinstance(args[2], int) else 0
        empties = (isinstance(args[1], str) and "w" in args[1]) or bool(flags & os.O_TRUNC) or (
            bool(flags & os.O_CREAT) and not os.path.lexists(path))
        return f"opened {rel(path)} for writing", path if empties else None
    if event in ("os.rename", "os.link"):
        src, dst = _full(args[0], args[2]), _full(args[1], args[3])
        if not (inside(src) or inside(dst)):
            return None
        return f"{'renamed' if event == 'os.rename' else 'hard-linked'} {rel(src)} to {rel(dst)}", None
    if event == "os.symlink":
        dst = _full(args[1], args[2])
        return (f"made {rel(dst)} a symlink to {os.fsdecode(args[0])}", None) if inside(dst) else None
    dir_fd = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 2}.get(event)
    path = _full(args[0], args[dir_fd]) if dir_fd is not None else _full(args[0])
    if not inside(path) or (event == "os.mkdir" and os.path.lexists(path)):  # makedirs(exist_ok=True): no change
        return None
    verb = {"os.remove": "deleted", "os.rmdir": "removed the folder", "os.mkdir": "made the folder",
            "os.truncate": "truncated"}[event]
    return f"{verb} {rel(path)}", None


def _audit(event, args):
    state = _STATE
    if state["busy"] or (state["writes"] is None and state["on_step"] is None):
        return
    state["busy"] = True  # what the callback does on disk is not the save's
    try:
        if state["writes"] is not None:
            if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) and _writing(args):
                state["writes"].append(os.path.realpath(os.fsdecode(args[0])))
            elif event == "os.rename":
                state["writes"].append(os.path.realpath(os.fsdecode(args[1])))
        if state["on_step"] is not None and event in CHANGES:
            step = _step(event, args, state["root"])
            if step is not None:
                state["on_step"](*step)
    except Exception:  # an audit hook must never break the call it watches
        pass
    finally:
        state["busy"] = False


def _hook() -> None:
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED.append(True)


def _watch_writes():
    _hook()
    _STATE["writes"] = []


def _stop_watching() -> list:
    out, _STATE["writes"] = _STATE["writes"] or [], None
    return out


def _watch_steps(root: str, on_step) -> None:
    """Call ``on_step(description, emptied path or None)`` before every change under ``root`` from now on."""
    _hook()
    _STATE.update(on_step=on_step, root=os.path.realpath(root))


def _stop_steps() -> None:
    _STATE["on_step"] = None


def _proc_io() -> dict:
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except OSError:
        return {}
