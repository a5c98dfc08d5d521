"""Grading's boundary: a student's function runs in a sandbox, a child of its rank's worker (the *host*).

A check wraps the student's function with ``sandboxed(fn, what=..., allow=...)`` in the grader's process; what
travels to the workers is the function's pickled bytes, which a host never unpickles. When the check, on a worker,
calls it, the host forks a sandbox (once per task, before any student code exists in it) and sends it the call:

* **The sandbox** closes every file it inherited but its link to the host, forgets the host's process group and
  makes a ``labsupport._relay`` group its default one, cannot import the grader, works in a private folder, and
  (on Linux) installs a seccomp filter: no new sockets, processes or programs, no signal or memory access to
  another process. It unpickles the function, runs it, and its prints and warnings go to the host as the rank's
  output. Nothing of the grader lives there: whatever it patches, reads or fakes is its own.
* **The host** carries every message: each relayed request (kind, peer, tensors' bytes) is performed on the real
  gloo group by the host's own ``torch.distributed`` calls, which the tap records as usual, so a check's
  ``CommCounter`` in the host sees exactly what crossed to the other ranks. Requests an exercise forbids (``allow``)
  are refused with a message that names the rule. The host also logs when each request was posted and waited.
* **Results as plain data.** Right after the function returns the sandbox says so; the host then refuses any
  request (a result that communicates when it is read). Tensors, of any class, come back as dtype, shape and bytes;
  other objects as a description. The arguments come back too and are copied into the check's own tensors, so an
  in-place answer works as it does on a worker.

Where ``os.fork`` is missing (Windows) the function runs in the worker itself, as in a notebook.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time

_RESULT_MARK = "__tensor__"


class Unplain:
    """Stands, in the host, for a value the function returned that is not plain data (shown, never compared)."""

    def __init__(self, kind: str, text: str = ""):
        self.kind, self.text = kind, text  # the value's class name, and its repr

    def __repr__(self) -> str:
        return self.text or f"<{self.kind}>"


class SandboxRefused(AssertionError):
    """Raised in the host when the function did what its exercise forbids (the check fails with this message)."""


def _plain(obj, depth: int = 0):
    """In the sandbox: ``obj`` as plain data the host can unpickle without running anything of the student's."""
    import torch

    from ._relay import raw

    if depth > 20:
        return Unplain("value", "a value nested too deeply")
    if isinstance(obj, torch.Tensor):
        return (_RESULT_MARK, raw(obj), bool(obj.requires_grad))
    kind = type(obj)
    if obj is None or kind in (bool, int, float, complex, str, bytes):
        return obj
    if isinstance(obj, bool) or isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, str):
        return str(obj)
    if kind in (range, slice, torch.dtype, torch.device, torch.Size):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [_plain(x, depth + 1) for x in obj]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, dict):
        return {_plain(k, depth + 1): _plain(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return set(_plain(x, depth + 1) for x in obj)
    try:
        return Unplain(kind.__name__, repr(obj)[:200])
    except Exception:
        return Unplain(kind.__name__)


def _unplain(obj):
    """In the host: the plain data back as tensors and containers."""
    from ._relay import unraw

    if isinstance(obj, tuple) and len(obj) == 3 and obj[0] == _RESULT_MARK:
        t = unraw(obj[1])
        return t.requires_grad_(True) if obj[2] and t.is_floating_point() else t
    if isinstance(obj, list):
        return [_unplain(x) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_unplain(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _unplain(v) for k, v in obj.items()}
    if isinstance(obj, set):
        return {_unplain(x) for x in obj}
    return obj


def _copy_back(old, new) -> None:
    """The arguments as the function left them, applied to the host's own objects."""
    import torch

    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        with torch.no_grad():
            if old.shape == new.shape and old.dtype == new.dtype:
                old.copy_(new)
            else:  # the function gave its argument another shape or dtype (tensor.data = ...): so does the host
                old.data = new
    elif type(old) is list and type(new) is list:
        if len(old) == len(new):
            for i, (a, b) in enumerate(zip(old, new)):
                if isinstance(a, torch.Tensor) or type(a) in (list, dict):
                    _copy_back(a, b)
                else:
                    old[i] = b
        else:
            old[:] = new
    elif type(old) is dict and type(new) is dict:
        for key in list(old):
            if key in new:
                _copy_back(old[key], new[key])
        for key in new:
            old.setdefault(key, new[key])


class Sandboxed:
    """A student's function as the check on a worker sees it (see the module docstring)."""

    def __init__(self, blob: bytes, name: str, what: str, allow=None, forbid=None):
        self.blob, self.__name__, self.what = blob, name, what
        self.allow = None if allow is None else frozenset(allow)
        self.forbid = dict(forbid or {})  # "module:name" -> why, for the exercise's own built-in

    def __reduce__(self):
        return (Sandboxed, (self.blob, self.__name__, self.what, self.allow, self.forbid))

    def __repr__(self) -> str:
        return f"<{self.__name__}, run in a sandbox>"

    def __call__(self, *args, **kwargs):
        from ._worker import CURRENT

        if (not CURRENT or not hasattr(os, "fork") or os.environ.get("LABSUPPORT_SANDBOX") == "0"
                or CURRENT.get("backend") == "nccl"):
            # not on a worker, no fork (Windows), CUDA in the worker (a forked child cannot use it), or turned off
            # (benchmarks/warden.py --boundary sandbox): run it here
            from . import _pickling

            return _pickling.loads(self.blob)(*args, **kwargs)
        return _host().call(self, args, kwargs)


def sandboxed(fn, what: str = "", allow=None, forbid=None, driver=None) -> Sandboxed:
    """``fn`` wrapped for a check (called in the grader's process): ``what`` names the exercise in messages,
    ``allow`` is the set of ``torch.distributed`` calls it may make (``{"send", "recv"}``), None for any;
    ``forbid`` maps ``"module:name"`` of a built-in the exercise re-implements to the message it raises if the
    function uses it (``{"torch.utils.data:DistributedSampler": "shard_indices must not ..."}``).

    ``driver``, for an exercise that is a class or a set of functions, is a function of the grader's that exercises
    ``fn`` in the sandbox: the call is then ``driver(fn, *args, **kwargs)``. It travels by value with its module (so
    that module may import only the standard library, torch and labsupport); it runs beside the student's code, so
    what it returns is read as the student's own answer: plain data that the host checks."""
    import functools

    from . import _pickling

    if isinstance(fn, Sandboxed):
        return fn
    name = getattr(fn, "__name__", type(fn).__name__)
    modules = []
    if driver is not None:
        modules.append(sys.modules[driver.__module__])
        fn = functools.partial(driver, fn)
    module = sys.modules.get(getattr(fn if driver is None else fn.args[0], "__module__", None) or "")
    if module is not None and module.__name__ != "__main__" and _own_file(module):
        modules.append(module)  # a module of the course's users (a test, a script): by value, since the sandbox
    import cloudpickle          # may not import what that module imports

    modules = list({id(m): m for m in modules}.values())
    for mod in modules:
        cloudpickle.register_pickle_by_value(mod)
    try:
        return Sandboxed(_pickling.dumps(fn), name, what or name, allow, forbid)
    finally:
        for mod in modules:
            cloudpickle.unregister_pickle_by_value(mod)


def _own_file(module) -> bool:
    """Whether ``module`` is a file of the user's (not the standard library, an installed package or the course's
    own packages)."""
    import sysconfig

    path = os.path.realpath(getattr(module, "__file__", None) or "")
    if not path:
        return False
    here = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    libraries = {os.path.realpath(p) for p in sysconfig.get_paths().values()}
    ours = (os.path.join(here, "labsupport", ""), os.path.join(here, "autograder", ""))
    return not path.startswith(ours) and not any(path.startswith(os.path.join(p, "")) for p in libraries)


# ---------------------------------------------------------------------------------------------------------------
# the host


_HOST = []
_KIND = {"isend": "send", "irecv": "recv"}


def _host() -> "_Host":
    """This worker's sandbox: forked at its first use and kept, like the worker, from task to task (a fork costs
    tens of milliseconds of CPU); at each new task it starts afresh as a task does in a worker (its process group,
    random state, environment and rank are the task's)."""
    from ._worker import CURRENT

    if _HOST and not _HOST[0].alive():
        close()
    if not _HOST:
        _HOST.append(_Host())
    host = _HOST[0]
    if host.call_id != CURRENT.get("call_id"):
        host.new_task()
    return host


def close() -> None:
    """End this worker's sandbox and remove its folder."""
    while _HOST:
        _HOST.pop().stop()


def end_task() -> None:
    """At the end of each task: whatever the sandbox still holds of it (its process group) goes now."""
    if _HOST and _HOST[0].alive():
        _HOST[0].task_over()


def pid() -> int | None:
    """This worker's sandbox, while it lives (it is kept from task to task): its process id."""
    return _HOST[0].pid if _HOST and _HOST[0].alive() else None


def record() -> list:
    """This task's relayed requests so far, as the host saw them: ``(kind, peer, nbytes, posted, waited,
    cpu_posted, cpu_waited)`` each, times from ``time.perf_counter`` and the sandbox's CPU time in seconds (read from
    ``/proc``, outside the sandbox: work that really ran between a post and its wait shows there). Empty without a
    sandbox."""
    return [tuple(entry) for entry in _HOST[0].log] if _HOST else []


def cpu_seconds() -> float | None:
    """The CPU time this worker's sandbox has used so far (every thread), read from ``/proc``; None without one."""
    return _HOST[0].cpu() if _HOST and _HOST[0].alive() else None


def memory() -> dict | None:
    """This worker's sandbox's memory as the kernel counts it, read from ``/proc`` (bytes): ``rss`` now, ``peak``
    (the high-water mark since the last ``reset_peak``) and ``data`` (resident anonymous and shared memory: what
    tensors and objects hold, without the code pages loaded on first use); None without one."""
    return _HOST[0].memory() if _HOST and _HOST[0].alive() else None


def reset_peak() -> None:
    """Start the sandbox's high-water mark again from its present resident size."""
    if _HOST and _HOST[0].alive():
        try:
            with open(f"/proc/{_HOST[0].pid}/clear_refs", "w") as fh:
                fh.write("5")
        except OSError:
            pass


def refusals() -> list:
    """What this task's sandbox was refused so far (read by the host, for a check that wants the list)."""
    return list(_HOST[0].refused) if _HOST else []


class _Host:
    def __init__(self):
        import socket
        import tempfile
        import warnings

        import torch.distributed as dist

        from . import _worker

        self.call_id = None
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
            _child(child, self.rank, self.world_size, self.folder, _worker._STACK_FILE[0])
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
    def call(self, fn: Sandboxed, args, kwargs):
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
            self.groups[name] = (dist.new_group(args[0]), list(args[0]))
            return None
        if kind == "wait":
            work, outputs, entry = self.pending.pop(args[0])
            done = work.wait()
            if isinstance(work, _Then):
                outputs = [done]
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
                outputs = [done]
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
            return dist.all_reduce(ts[0], ops[args[1]], group=group, async_op=True), ts, None
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
    if isinstance(kind, type) and issubclass(kind, Exception):
        exc = kind(message)
    else:
        exc = RuntimeError(f"{name}: {message}")
    if text and hasattr(exc, "add_note"):
        exc.add_note(text.rstrip())
    return exc


# ---------------------------------------------------------------------------------------------------------------
# the sandbox (a child of the host, right after fork)


def _close_inherited(keep: set) -> None:
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


class _Link:
    """The sandbox's end of its link: requests and output to the host."""

    def __init__(self, conn):
        self.conn = conn

    def send(self, msg) -> None:
        self.conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self):
        return pickle.loads(self.conn.recv_bytes())

    def __call__(self, kind, name, *args):
        self.send(("req", kind, name) + args)
        status, value = self.recv()
        if status == "ok":
            return value
        raise RuntimeError(value)


class _Output:
    """``sys.stdout``/``sys.stderr`` of the sandbox: whole lines to the host."""

    def __init__(self, link: _Link, name: str):
        self.link, self.name, self.buf = link, name, ""

    def write(self, text) -> int:
        self.buf += str(text)
        if "\n" in self.buf:
            done, _, self.buf = self.buf.rpartition("\n")
            self.link.send(("out", self.name, done + "\n"))
        return len(text)

    def flush(self) -> None:
        if self.buf:
            text, self.buf = self.buf, ""
            self.link.send(("out", self.name, text))

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    encoding = "utf-8"


class _NoGrader:
    """An import hook of the sandbox: the grader's modules are not there."""

    def find_spec(self, name, path=None, target=None):
        if name == "autograder" or name.startswith("autograder."):
            raise ImportError("the grader's modules are not available where your function runs")
        return None


def _child(sock, rank: int, world_size: int, folder: str, stack_file: str) -> None:
    code = 0
    try:
        _become_sandbox(sock, rank, world_size, folder, stack_file)
    except BaseException:  # noqa: BLE001: the host reports the exit; native output (fd 2) keeps the reason
        code = 70
        try:
            import traceback

            os.write(2, traceback.format_exc().encode())
        except Exception:
            pass
    os._exit(code)


def _become_sandbox(sock, rank, world_size, folder, stack_file) -> None:
    import faulthandler
    import tempfile
    from multiprocessing.connection import Connection

    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: gone with its host
    except Exception:
        pass
    link_fd = sock.detach()
    _close_inherited({link_fd})
    link = _Link(Connection(link_fd))
    if stack_file:
        fh = open(stack_file, "a")
        faulthandler.register(signal.SIGUSR1, file=fh, all_threads=True, chain=False)
    sys.stdout, sys.stderr = _Output(link, "stdout"), _Output(link, "stderr")
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from . import _relay
    from . import tap as _tap

    import torch

    torch.set_num_threads(1)  # the host's OpenMP threads are not in this process: a parallel region would hang
    _KEPT.append(c10d._world)  # the host's group: never destroyed here (its threads live in the host only)
    c10d._world = c10d._World()
    try:
        from torch._C._distributed_c10d import _unregister_all_process_groups

        _unregister_all_process_groups()
    except ImportError:
        pass
    _tap._set(())  # the call board and the counters belong to the host
    _relay.register(link)
    if os.environ.get("LABSUPPORT_TEST_GRADER_IN_SANDBOX") != "1":  # the course's own tests' planted bugs only
        for name in [m for m in sys.modules if m == "autograder" or m.startswith("autograder.")]:
            del sys.modules[name]
        sys.meta_path.insert(0, _NoGrader())
    started_in = os.getcwd()  # the notebook's (or submission's) folder: its files are the answer's to read
    os.chdir(folder)
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None
    from . import _landlock, _seccomp

    _seccomp.drop_capabilities()
    _landlock.restrict(folder, _landlock.readable_roots([started_in]), keep_out=[os.path.dirname(folder)])
    _seccomp.install()
    _serve_calls(link)


_KEPT: list = []


def _forbid(rules: dict):
    """Replace each built-in an exercise re-implements by one that raises its message; returns the undo."""
    import importlib

    saved = []
    for where, why in rules.items():
        module_name, _, name = where.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        original = getattr(module, name, None)
        if original is None:
            continue

        def refuse(*args, _why=why, **kwargs):
            raise RuntimeError(_why)

        for mod in {module, sys.modules.get(getattr(original, "__module__", "") or "")} - {None}:
            if getattr(mod, name, None) is original:
                saved.append((mod, name, original))
                setattr(mod, name, refuse)

    def undo():
        for mod, name, original in saved:
            setattr(mod, name, original)

    return undo


def _serve_calls(link: _Link) -> None:
    import traceback

    from . import _pickling

    import torch.distributed as dist

    from . import _relay, _worker

    functions = {}
    while True:
        msg = link.recv()
        if msg[0] == "exit":
            return
        if msg[0] in ("task", "over"):
            if dist.is_initialized():
                dist.destroy_process_group()
            functions.clear()
            if msg[0] == "task":  # as a worker starts a task: its rank, environment, random state, group
                _, current, environ = msg
                _worker._fresh_process_state({"environ": dict(environ, TMPDIR=os.getcwd())})
                _worker.CURRENT.clear()
                _worker.CURRENT.update(current)
                dist.init_process_group(_relay.NAME, store=dist.HashStore(), rank=current["rank"],
                                        world_size=current["world_size"])
            continue
        _, key, blob, payload, forbid = msg
        text, args, kwargs = "", [], {}
        undo = _forbid(forbid)  # before unpickling: a reference to the built-in is taken as the stand-in
        try:
            if blob is not None:
                functions[key] = _pickling.loads(blob)
            args, kwargs = pickle.loads(payload)
            value, status = functions[key](*args, **kwargs), "ok"
        except BaseException as exc:  # noqa: BLE001: reported to the host, raised there
            status = "raise"
            value = (type(exc).__module__, type(exc).__name__, str(exc))
            frames = [f for f in traceback.extract_tb(exc.__traceback__)
                      if not f.filename.startswith(os.path.dirname(os.path.abspath(__file__)))]
            text = "".join(traceback.format_list(frames))
        finally:
            undo()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        link.send(("returned",))
        try:
            plain = (_plain(value) if status == "ok" else value, _plain(list(args)), _plain(kwargs))
        except BaseException as exc:  # noqa: BLE001
            status, plain = "raise", (("builtins", "TypeError", f"the result could not be read: {exc}"), [], {})
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        link.send(("result", status, plain[0], plain[1], plain[2], text))
        del value, plain, args, kwargs  # nothing of this call stays alive in the sandbox while it waits for the next
