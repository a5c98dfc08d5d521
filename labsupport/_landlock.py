"""The grading sandbox's files (Linux's Landlock, kernel 5.13 or newer): read the system's and Python's, write one's own.

``restrict(folder, readable)`` makes the kernel refuse, in this process and everything it starts, any file access
but reading (and running) what lies under the ``readable`` folders and reading and writing under ``folder`` (the
sandbox's private folder). Other ranks' folders, the pool's files and the rest of ``/tmp`` are neither readable nor
writable: ranks have no file to pass data through. ``shared`` folders, which a check makes for one exercise (the
folder a checkpoint is saved in, which every rank writes), are read and written as the private one. A refused
access fails with ``EACCES`` (``PermissionError``). Returns the Landlock version used, 0 where the kernel has none
(the sandbox then runs without it; the README says what is not enforced). Written with ``ctypes``: the system
calls are the same numbers on x86-64 and arm64.
"""

from __future__ import annotations

import os
import sys

_CREATE, _ADD_RULE, _RESTRICT = 444, 445, 446
_VERSION = 1 << 0  # LANDLOCK_CREATE_RULESET_VERSION
_PATH_BENEATH = 1

# access rights to files (include/uapi/linux/landlock.h), by the version that brought them
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_V1_ALL = (1 << 13) - 1           # execute ... make_sym
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_READ = _EXECUTE | _READ_FILE | _READ_DIR


def _handled(version: int) -> int:
    rights = _V1_ALL
    if version >= 2:
        rights |= _REFER
    if version >= 3:
        rights |= _TRUNCATE
    if version >= 5:
        rights |= _IOCTL_DEV
    return rights


def readable_roots(extra=()) -> list:
    """The folders a sandbox reads: the system's, Python's and its packages' (``sys.path``), and ``extra``."""
    roots = ["/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/opt", "/proc", "/sys", "/dev",
             sys.prefix, sys.base_prefix, sys.exec_prefix, *[p for p in sys.path if p], *extra]
    return list(dict.fromkeys(os.path.realpath(p) for p in roots))


def restrict(folder: str, readable, keep_out=(), shared=()) -> int:
    """Confine this process's files (see the module docstring). A root in ``readable`` that contains one of
    ``keep_out`` (the pool's folder, where every rank's private folder lies) is left out; ``shared`` folders are
    read and written as ``folder`` is."""
    if not sys.platform.startswith("linux"):
        return 0
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    version = syscall(_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_VERSION))
    if version < 1:
        return 0
    handled = _handled(version)

    class _Ruleset(ctypes.Structure):
        _fields_ = [("handled_access_fs", ctypes.c_uint64)]

    class _Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    attr = _Ruleset(handled)
    ruleset = syscall(_CREATE, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        return 0
    keep_out = [os.path.join(os.path.realpath(p), "") for p in keep_out]
    try:
        def allow(path: str, rights: int) -> None:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                return
            try:
                if not os.path.isdir(path):
                    rights &= _EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE | _IOCTL_DEV
                rule = _Beneath(rights & handled, fd)
                syscall(_ADD_RULE, ruleset, _PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0))
            finally:
                os.close(fd)

        for root in readable:
            if any(k.startswith(os.path.join(root, "")) for k in keep_out):
                continue  # it holds the other ranks' folders
            allow(root, _READ)
        for device in ("/dev/null", "/dev/zero", "/dev/full", "/dev/tty"):
            allow(device, _READ | _WRITE_FILE | (_IOCTL_DEV if version >= 5 else 0))
        for root in (folder, *shared):
            allow(root, handled)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: what an unprivileged restriction needs
            return 0
        if syscall(_RESTRICT, ruleset, ctypes.c_uint32(0)) != 0:
            return 0
    finally:
        os.close(ruleset)
    return version
