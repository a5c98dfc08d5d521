"""Grading's sandbox, its own side (``labsupport._sandbox``): right after the fork it closes what it inherited,
takes a relay group as its default, gives up capabilities, confines its files and installs its seccomp filter, then
serves the host's calls."""

from __future__ import annotations

import os
import pickle
import signal
import sys

from ._plain import _plain



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


def _child(sock, rank: int, world_size: int, folder: str, stack_file: str, shared=(), arena=None) -> None:
    code = 0
    try:
        _become_sandbox(sock, rank, world_size, folder, stack_file, shared, arena)
    except BaseException:  # noqa: BLE001: the host reports the exit; native output (fd 2) keeps the reason
        code = 70
        try:
            import traceback

            os.write(2, traceback.format_exc().encode())
        except Exception:
            pass
    os._exit(code)


def _become_sandbox(sock, rank, world_size, folder, stack_file, shared=(), arena=None) -> None:
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
        faulthandler.register(signal.SIGUSR1, file=fh, all_threads=False, chain=False)
    sys.stdout, sys.stderr = _Output(link, "stdout"), _Output(link, "stderr")
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
    _relay.register(link, arena)
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
    _landlock.restrict(folder, _landlock.readable_roots([started_in]), keep_out=[os.path.dirname(folder)],
                       shared=shared)
    _seccomp.install()
    _serve_calls(link)


_KEPT: list = []


def _forbid(rules: dict):
    """Replace each built-in an exercise re-implements (a function, or a class) by a stand-in that raises its
    message; in a module the call has not imported yet, once the call imports it (``torch.distributed.checkpoint``
    takes seconds to import: a call that never uses it does not pay for it). Returns the undo."""
    saved, later = [], {}
    for where, why in rules.items():
        module_name, _, name = where.partition(":")
        if module_name in sys.modules:
            _replace(sys.modules[module_name], name, why, saved)
        else:
            later.setdefault(module_name, []).append((name, why))
    finder = _WhenImported(later, saved) if later else None
    if finder is not None:
        sys.meta_path.insert(0, finder)

    def undo():
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for mod, name, original in reversed(saved):
            setattr(mod, name, original)

    return undo


class _Refused:
    """The base of a forbidden class's stand-in: neither made nor subclassed (a student's class with the built-in
    as its base fails as it is unpickled), with the rule's message."""

    _why = ""

    def __new__(cls, *args, **kwargs):
        raise RuntimeError(cls._why)

    def __init_subclass__(cls, **kwargs):
        if "_why" not in cls.__dict__:  # a class of the student's, not a stand-in
            raise RuntimeError(cls._why)


def _replace(module, name: str, why: str, saved: list) -> None:
    original = getattr(module, name, None)
    if original is None:
        return
    if isinstance(original, type):
        stand_in = type(original.__name__, (_Refused,), {"_why": why, "__qualname__": original.__qualname__})
    else:
        def stand_in(*args, _why=why, **kwargs):
            raise RuntimeError(_why)
    for mod in {module, sys.modules.get(getattr(original, "__module__", "") or "")} - {None}:
        if getattr(mod, name, None) is original:
            saved.append((mod, name, original))
            setattr(mod, name, stand_in)


class _WhenImported:
    """A finder ahead of the others for the modules in ``later``: loaded as usual, then their built-ins replaced."""

    def __init__(self, later: dict, saved: list):
        self.later, self.saved = later, saved

    def find_spec(self, name, path=None, target=None):
        rules = self.later.pop(name, None)
        if rules is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenReplace(spec.loader, rules, self.saved)
        return spec


class _ThenReplace:
    """A module's loader, which replaces the module's forbidden built-ins once it has run."""

    def __init__(self, loader, rules, saved):
        self._loader, self._rules, self._saved = loader, rules, saved

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        for name, why in self._rules:
            _replace(module, name, why, self._saved)


def _serve_calls(link: _Link) -> None:
    import traceback

    from . import _pickling

    import torch.distributed as dist

    from . import _relay, _worker

    functions, arena = {}, _relay._ARENA[0]
    while True:
        msg = link.recv()
        if msg[0] == "exit":
            return
        if msg[0] in ("task", "over"):
            if dist.is_initialized():
                dist.destroy_process_group()
            if arena is not None:  # requests never waited for: their places are free with the task
                arena.reset()
            functions.clear()
            if msg[0] == "task":  # as a worker starts a task: its rank, environment, random state, group
                _, current, environ = msg
                _worker._fresh_process_state({"environ": dict(environ, TMPDIR=os.getcwd())})
                _worker.CURRENT.clear()
                _worker.CURRENT.update(current)
                dist.init_process_group(_relay.NAME, store=dist.HashStore(), rank=current["rank"],
                                        world_size=current["world_size"])
            continue
        _, key, blob, payload, forbid, use_arena = msg
        _relay._ARENA[0] = arena if use_arena else None
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
