"""Grading's sandbox, the host's side (``labsupport._sandbox``): it forks the sandbox, sends it each call, and
performs every request it relays on the real process group with its own ``torch.distributed`` calls, logging them
(``labsupport._carry``); it reads the sandbox's CPU time, memory and input/output from ``/proc``."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time

from ._carry import Carrier
from ._plain import SandboxRefused, _copy_back, _unplain
from ._sandbox_child import _child


class _Host(Carrier):
    def __init__(self, shared=()):
        import socket
        import tempfile
        import warnings

        import torch.distributed as dist

        from . import _worker

        self.call_id, self.shared = None, tuple(shared)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        base = os.path.dirname(_worker._STACK_FILE[0]) if _worker._STACK_FILE[0] else None  # the pool's folder
        self.folder = tempfile.mkdtemp(prefix=f"sandbox-{self.rank}-", dir=base)
        self.known: set = set()
        self.groups = {}
        self.pending = {}
        self.refused = []
        self.log = []           # every relayed request of this task (see record())
        self.next_handle = 1
        self.arena_top = 0      # how far into the arena the sandbox's requests have reached since the last trim
        self.serving = False
        self.current = []       # the arena's places of the request being served
        parent, child = socket.socketpair()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        from . import _seccomp
        from ._arena import Arena

        try:
            self.arena = Arena()  # before the fork: the sandbox maps the same pages
        except (OSError, ValueError, OverflowError):  # no room for it (a strict overcommit policy): messages only
            self.arena = None
        _seccomp.guard_host()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Python 3.12 warns on fork in a process with threads
            pid = os.fork()
        if pid == 0:  # the sandbox: never returns
            parent.close()
            _child(child, self.rank, self.world_size, self.folder, _worker._STACK_FILE[0], self.shared,
                   self.arena)
        child.close()
        from multiprocessing.connection import Connection

        self.pid = pid
        self.conn = Connection(parent.detach())
        self._side = (_worker._STACK_FILE[0] + ".sandbox") if _worker._STACK_FILE[0] else ""

    def new_task(self) -> None:
        import torch.distributed as dist

        from ._worker import CURRENT

        self.call_id = CURRENT.get("call_id")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.groups, self.pending, self.known, self.log = {}, {}, set(), []
        self.trim()
        self._send(("task", dict(CURRENT), dict(os.environ)))

    def task_over(self) -> None:
        self.call_id = None
        self.pending = {}
        self.trim()
        try:
            self._send(("over",))
        except OSError:
            pass

    def alive(self) -> bool:
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

    def stop(self) -> None:
        import shutil

        try:
            self.conn.send_bytes(pickle.dumps(("exit",)))
        except OSError:
            pass
        try:
            self.conn.close()
        except OSError:
            pass
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            try:
                if os.waitpid(self.pid, os.WNOHANG) != (0, 0):
                    break
            except ChildProcessError:
                break
            time.sleep(0.005)
        else:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        shutil.rmtree(self.folder, ignore_errors=True)

    def cpu(self) -> float | None:
        total = 0
        try:
            for task in os.listdir(f"/proc/{self.pid}/task"):
                try:
                    with open(f"/proc/{self.pid}/task/{task}/schedstat") as fh:
                        total += int(fh.read().split()[0])
                except (OSError, ValueError, IndexError):
                    pass
        except OSError:
            return None
        return total / 1e9

    def trim(self) -> None:
        """The arena's pages back to the kernel, but those of requests in flight and of the one being served
        (``Arena.trim``): before the sandbox's memory is read, so that transfers that are over do not count. Only
        while the sandbox waits for the host (between calls, or inside a request not yet answered)."""
        if self.arena_top and self.arena is not None:
            keep = [span for *_, spans in self.pending.values() for span in spans] + list(self.current)
            self.arena.trim(self.arena_top, keep)
            self.arena_top = max((hi for _, hi in keep), default=0)

    def memory(self) -> dict | None:
        self.trim()
        try:
            with open(f"/proc/{self.pid}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
            kib = {k: int(v.split()[0]) for k, v in fields.items() if k.startswith(("Vm", "Rss"))}
            return {"rss": kib["VmRSS"] * 1024, "peak": kib["VmHWM"] * 1024,
                    "data": (kib.get("RssAnon", kib["VmRSS"]) + kib.get("RssShmem", 0)) * 1024}
        except (OSError, KeyError, ValueError):
            return None

    # -- one call of the student's function
    def call(self, fn, args, kwargs):  # fn: a Sandboxed
        import hashlib

        key = hashlib.sha256(fn.blob).hexdigest()
        blob = None if key in self.known else fn.blob
        self.known.add(key)
        self.refused_now = []
        self.allow, self.what, self.returned = fn.allow, fn.what, False
        self._send(("call", key, blob, pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL), fn.forbid,
                    fn.arena))
        if self._side:
            with open(self._side, "w") as fh:  # a deadlock report reads the sandbox's stack meanwhile
                fh.write(str(self.pid))
        self.serving = True
        try:
            status, value, new_args, new_kwargs, text = self._serve()
        finally:
            self.serving = False
            if self._side:
                try:
                    os.unlink(self._side)
                except OSError:
                    pass
        _copy_back(list(args), _unplain(new_args))
        _copy_back(kwargs, _unplain(new_kwargs))
        if self.refused_now:
            raise SandboxRefused(self.refused_now[0])
        if status == "raise":
            raise _rebuilt(value, text, self.what)
        return _unplain(value)

    def _send(self, msg) -> None:
        self.conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def _serve(self):
        while True:
            try:
                msg = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                raise RuntimeError(self._death()) from None
            kind = msg[0]
            if kind == "out":
                (sys.stdout if msg[1] == "stdout" else sys.stderr).write(msg[2])
            elif kind == "req":
                try:
                    reply = ("ok", self._request(msg[1], msg[2], msg[3:]))
                except SandboxRefused as exc:
                    reply = ("refused", str(exc))
                except Exception as exc:  # a bad request: the student's call raises it
                    reply = ("error", f"{type(exc).__name__}: {exc}")
                self.current = []
                self._send(reply)
            elif kind == "returned":
                self.returned = True
            elif kind == "result":
                return msg[1:]

    def _death(self) -> str:
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:
            status = 0
        if os.WIFSIGNALED(status):
            how = f"was killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
        else:
            how = f"exited with code {os.WEXITSTATUS(status)}"
        return f"the function's process {how} while running {self.what}"

def _rebuilt(value, text: str, what: str) -> BaseException:
    import builtins

    module, name, message = value
    if name == "NotImplementedError" and not message.strip():
        message = f"{what} is not started: it still raises NotImplementedError"
    kind = getattr(builtins, name, None) if module == "builtins" else None
    if kind is KeyError:  # its message is the key's repr: rebuilt from the key, or it would be quoted twice
        import ast

        try:
            exc = KeyError(ast.literal_eval(message))
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            exc = KeyError(message)
    elif isinstance(kind, type) and issubclass(kind, Exception):
        exc = kind(message)
    else:
        exc = RuntimeError(f"{name}: {message}")
    if text and hasattr(exc, "add_note"):
        exc.add_note(text.rstrip())
    return exc
