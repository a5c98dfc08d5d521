"""A seccomp filter for the grading sandbox (Linux on x86-64 and arm64): no new sockets, no other processes.

``install()`` makes the kernel refuse, in this process and everything it starts, the system calls an answer has no
honest use for and that would leave the sandbox: creating sockets (its only way out is the link it inherited),
starting programs or processes (threads stay allowed), signalling another process, reading or writing another
process's memory (``ptrace``, ``process_vm_*``, pidfd), new namespaces, mounts, BPF and io_uring. A refused call
fails with ``EPERM`` (``PermissionError`` in Python). Returns False where the kernel or the machine has no seccomp
(macOS, other architectures): the sandbox then runs without it, and the README says what is not enforced.
"""

from __future__ import annotations

import os
import platform
import struct
import sys

_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS = 1, 38
_CLONE_THREAD = 0x00010000

_X86_64 = dict(arch=0xC000003E, deny=(41, 42, 43, 49, 50, 53, 288,   # socket, connect, accept, bind, listen, ...
                                      57, 58, 59, 322,               # fork, vfork, execve, execveat
                                      101, 310, 311, 312, 434, 438, 424,  # ptrace, process_vm_*, kcmp, pidfd_*
                                      272, 308, 165, 321, 298, 323, 425, 248, 250),
               clone=56, clone3=435, kills=(62, 200, 234), x32=True)
_ARM64 = dict(arch=0xC00000B7, deny=(198, 199, 200, 201, 202, 203, 242,
                                     221, 281,
                                     117, 270, 271, 272, 434, 438, 424,
                                     97, 268, 40, 280, 241, 282, 425, 217, 219),
              clone=220, clone3=435, kills=(129, 130, 131), x32=False)


def _program(table: dict, pid: int) -> list:
    prog = []

    def stmt(code, k):
        prog.append((code, 0, 0, k))

    def jump(code, k, jt, jf):
        prog.append((code, jt, jf, k))

    stmt(_LD_ABS, 4)                          # the architecture the call was made with
    jump(_JEQ, table["arch"], 1, 0)
    stmt(_RET, _ERRNO | _EPERM)               # another ABI: refused
    stmt(_LD_ABS, 0)                          # the call's number
    if table["x32"]:
        jump(_JGE, 0x40000000, 0, 1)
        stmt(_RET, _ERRNO | _EPERM)
    for nr in table["deny"]:
        jump(_JEQ, nr, 0, 1)
        stmt(_RET, _ERRNO | _EPERM)
    jump(_JEQ, table["clone3"], 0, 1)
    stmt(_RET, _ERRNO | _ENOSYS)              # its flags are behind a pointer: the C library falls back to clone
    jump(_JEQ, table["clone"], 0, 4)
    stmt(_LD_ABS, 16)                         # clone's flags (low word of its first argument)
    jump(_JSET, _CLONE_THREAD, 0, 1)
    stmt(_RET, _ALLOW)                        # a thread
    stmt(_RET, _ERRNO | _EPERM)               # a process
    for nr in table["kills"]:
        jump(_JEQ, nr, 0, 4)
        stmt(_LD_ABS, 16)                     # the process (or thread group) signalled
        jump(_JEQ, pid, 0, 1)
        stmt(_RET, _ALLOW)
        stmt(_RET, _ERRNO | _EPERM)
    stmt(_RET, _ALLOW)
    return prog


def _libc():
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def guard_host() -> None:
    """In the host, before it forks a sandbox: not dumpable, so that reading its memory through ``/proc`` needs a
    capability the sandbox gives up (``drop_capabilities``)."""
    libc = _libc() if sys.platform.startswith("linux") else None
    if libc is not None:
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE


def drop_capabilities() -> None:
    """In the sandbox: dumpable again (its host reads its ``/proc``), and no capability at all, even as root."""
    import ctypes

    libc = _libc() if sys.platform.startswith("linux") else None
    if libc is None:
        return
    libc.prctl(4, 1, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()                  # effective, permitted, inheritable: none, twice (64 bits)
    libc.capset(header, data)


def install() -> bool:
    """Install the filter in this process (irreversible); False where seccomp is not available."""
    if not sys.platform.startswith("linux"):
        return False
    table = {"x86_64": _X86_64, "amd64": _X86_64, "aarch64": _ARM64, "arm64": _ARM64}.get(platform.machine())
    if table is None:
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    prog = _program(table, os.getpid())
    buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *ins) for ins in prog))

    class _Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = _Fprog(len(prog), ctypes.addressof(buf))
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if prctl(38, 1, None, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return False
    return prctl(22, 2, ctypes.addressof(fprog), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
