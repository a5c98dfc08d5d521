"""What a worker's file system calls show, below the student's Python: the paths a process opens for writing or
renames onto (Python's audit events ``open`` and ``os.rename``) and the bytes it read (``/proc/self/io``)."""

from __future__ import annotations

import os
import sys

_WRITES: list | None = None  # while a save is watched: the paths this process opened for writing or renamed onto


def _audit(event, args):
    if _WRITES is None:
        return
    try:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(ch in mode for ch in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR))
            if writing and isinstance(path, (str, bytes, os.PathLike)):
                _WRITES.append(os.path.realpath(os.fsdecode(path)))
        elif event == "os.rename":
            _WRITES.append(os.path.realpath(os.fsdecode(args[1])))
    except Exception:  # an audit hook must never break the call it watches
        pass


_HOOKED = []


def _watch_writes():
    global _WRITES
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED.append(True)
    _WRITES = []


def _stop_watching() -> list:
    global _WRITES
    out, _WRITES = _WRITES or [], None
    return out


def _proc_io() -> dict:
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except OSError:
        return {}
