"""Grading's sandbox, the host's side (``labsupport._sandbox``): it forks the sandbox, sends it each call, and
performs every request it relays on the real process group with its own ``torch.distributed`` calls, logging them."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time

from ._plain import SandboxRefused, _copy_back, _unplain
from ._sandbox_child import _child

_KIND = {"isend": "send", "irecv": "recv"}


class _Host:
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
        parent, child = socket.socketpair()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        from . import _seccomp

        _seccomp.guard_host()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Python 3.12 warns on fork in a process with threads
            pid = os.fork()
        if pid == 0:  # the sandbox: never returns
            parent.close()
            _child(child, self.rank, self.world_size, self.folder, _worker._STACK_FILE[0], self.shared)
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
        self._send(("task", dict(CURRENT), dict(os.environ)))

    def task_over(self) -> None:
        self.call_id = None
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

    def memory(self) -> dict | None:
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
        self._send(("call", key, blob, pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL), fn.forbid))
        if self._side:
            with open(self._side, "w") as fh:  # a deadlock report reads the sandbox's stack meanwhile
                fh.write(str(self.pid))
        try:
            status, value, new_args, new_kwargs, text = self._serve()
        finally:
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

    def _refuse(self, text: str):
        self.refused_now.append(text)
        self.refused.append(text)
        raise SandboxRefused(text)

    def _group(self, name):
        return self.groups.get(name, (None, list(range(self.world_size))))

    def _request(self, kind: str, name, args):
        import torch
        import torch.distributed as dist

        from ._relay import raw, unraw

        if kind == "new_group":
            # only the members make it (the sandbox of a rank outside the group tells its host nothing): named
            # from its ranks, not from a count every rank of the world must share
            self.groups[name] = (dist.new_group(args[0], use_local_synchronization=True), list(args[0]))
            return None
        if kind == "wait":
            work, outputs, entry = self.pending.pop(args[0])
            done = work.wait()
            if isinstance(work, _Then):
                outputs = done if isinstance(done, list) else [done]
            entry[4], entry[6] = time.perf_counter(), self.cpu()
            return [raw(t) for t in outputs] if outputs is not None else None
        blocking, args = args[0], args[1:]
        op = _KIND.get(kind, kind)
        if self.returned:
            self._refuse(f"grading refused: {self.what} called torch.distributed.{op} after it returned (a result "
                         "that communicates when it is read, such as a tensor subclass): return plain tensors")
        if self.allow is not None and op not in self.allow:
            allowed = ("send/recv (or isend/irecv)" if self.allow == {"send", "recv"} else
                       "/".join(sorted(self.allow)) or "no communication")
            self._refuse(f"{self.what} called torch.distributed.{op} on rank {self.rank}: build it from {allowed} "
                         "only; the built-in is what you are re-implementing, so it is not available inside this "
                         "exercise's call.")
        group, ranks = self._group(name)
        me = ranks.index(self.rank) if self.rank in ranks else None
        nbytes = 0
        posted, cpu_posted = time.perf_counter(), self.cpu()
        if kind == "isend":
            dst, tag, item = args
            t = unraw(item)
            nbytes, outputs, peer = t.numel() * t.element_size(), None, ranks[dst]
            if blocking:
                work = dist.send(t, peer, group=group, tag=tag)  # None
            else:
                work = dist.isend(t, peer, group=group, tag=tag)
        elif kind == "irecv":
            src, tag, dtype, shape = args
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            outputs, peer = [t], ranks[src]
            if blocking:
                dist.recv(t, peer, group=group, tag=tag)
                work = None
            else:
                work = dist.irecv(t, peer, group=group, tag=tag)
        else:
            work, outputs, peer = self._collective(kind, args, group, ranks, me)
            nbytes = _sent_bytes(kind, args)
        entry = [op, peer, nbytes, posted, None, cpu_posted, None]
        self.log.append(entry)
        if blocking:
            done = work.wait() if work is not None else None
            if isinstance(work, _Then):
                outputs = done if isinstance(done, list) else [done]
            entry[4], entry[6] = time.perf_counter(), cpu_posted
            return [raw(t) for t in outputs] if outputs is not None else None
        handle = self.next_handle
        self.next_handle += 1
        self.pending[handle] = (work, outputs, entry)
        return handle

    def _collective(self, kind, args, group, ranks, me):
        import torch
        import torch.distributed as dist

        from ._relay import unraw

        ops = {"SUM": dist.ReduceOp.SUM, "PRODUCT": dist.ReduceOp.PRODUCT, "MIN": dist.ReduceOp.MIN,
               "MAX": dist.ReduceOp.MAX, "AVG": dist.ReduceOp.AVG, "BAND": dist.ReduceOp.BAND,
               "BOR": dist.ReduceOp.BOR, "BXOR": dist.ReduceOp.BXOR}
        if kind == "all_reduce":
            ts = [unraw(x) for x in args[0]]
            if len(ts) == 1:
                return dist.all_reduce(ts[0], ops[args[1]], group=group, async_op=True), ts, None
            # several tensors in one call (all_reduce_coalesced): one all-reduce of them flattened, as gloo does it
            flat = torch.cat([t.reshape(-1) for t in ts])
            work = dist.all_reduce(flat, ops[args[1]], group=group, async_op=True)
            return _Then(work, lambda: list(flat.split([t.numel() for t in ts]))), ts, None
        if kind == "broadcast":
            ts = [unraw(x) for x in args[0]]
            return dist.broadcast(ts[0], ranks[args[1]], group=group, async_op=True), ts, ranks[args[1]]
        if kind == "reduce":
            ts = [unraw(x) for x in args[0]]
            return dist.reduce(ts[0], ranks[args[1]], ops[args[2]], group=group, async_op=True), ts, ranks[args[1]]
        if kind == "all_gather":
            t = unraw(args[0])
            outs = [torch.empty_like(t) for _ in ranks]
            return dist.all_gather(outs, t, group=group, async_op=True), outs, None
        if kind == "gather":
            t = unraw(args[0])
            outs = [torch.empty_like(t) for _ in ranks] if me == args[1] else None
            return dist.gather(t, outs, ranks[args[1]], group=group, async_op=True), outs or [], ranks[args[1]]
        if kind == "scatter":
            chunks, root, dtype, shape = args
            out = torch.empty(shape, dtype=getattr(torch, dtype))
            src = [unraw(x) for x in chunks] if me == root and chunks is not None else None
            return dist.scatter(out, src, ranks[root], group=group, async_op=True), [out], ranks[root]
        if kind == "reduce_scatter":
            chunks = [unraw(x) for x in args[0]]
            if len({(c.shape, c.dtype) for c in chunks}) == 1:  # gloo's own reduce-scatter: what a counter expects
                out = torch.empty_like(chunks[me])
                return dist.reduce_scatter(out, chunks, ops[args[1]], group=group, async_op=True), [out], None
            flat = torch.cat([c.reshape(-1) for c in chunks])  # uneven chunks: through an all-reduce
            dist_work = dist.all_reduce(flat, ops[args[1]], group=group, async_op=True)
            mine = chunks[me]
            start = sum(c.numel() for c in chunks[:me])
            return _Then(dist_work, lambda: flat[start:start + mine.numel()].reshape(mine.shape)), [mine], None
        if kind == "all_to_all":
            ins, expected = [unraw(x) for x in args[0]], list(args[1])  # what this rank sends, what it expects
            flat_in = torch.cat([t.reshape(-1) for t in ins])
            sizes = [t.numel() for t in ins]
            out = torch.empty(sum(expected), dtype=flat_in.dtype)
            work = dist.all_to_all_single(out, flat_in, expected, sizes, group=group, async_op=True)
            return work, list(out.split(expected)), None
        if kind == "barrier":
            return dist.barrier(group=group, async_op=True), None, None
        raise RuntimeError(f"torch.distributed call {kind} is not available in grading")


def _sent_bytes(kind: str, args) -> int:
    """The bytes of the tensors a collective request hands over (what this rank contributes)."""
    first = args[0] if args else None
    items = first if isinstance(first, list) else [first]
    return sum(len(x[2]) for x in items if isinstance(x, tuple) and len(x) == 3 and isinstance(x[2], bytes))


class _Then:
    """A request whose result needs one more step after the real one completes."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self):
        self.work.wait()
        return self.then()


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
