"""What runs inside one rank.

A worker is a long-lived process forked from the launcher's fork server (which imported torch once, before any
thread pool existed). It waits for tasks from the notebook, runs each one inside a freshly initialised process
group, and sends back its prints, its result or its error. Nothing here is public: see ``labsupport.run``.

Messages are pickled tuples sent over one ``multiprocessing`` connection:

    notebook -> worker   ("task", call_id, spec_dict, payload_bytes)  ("finish", call_id)  ("ping",)  ("exit",)
    worker -> notebook   ("hello", pid, main_thread_ident)  ("out", call_id, stream, text)
                         ("result", call_id, bytes)  ("error", call_id, error_dict)
                         ("pong", process_group_initialised, sandbox_pid_or_None)

Besides the connection, each worker shares two small files with the notebook: the stack file, where
faulthandler writes every thread's stack on SIGUSR1, and the *call board*, where the worker keeps the
``torch.distributed`` call it is inside right now, with its evaluated arguments ("recv(src=1) of 4 float32"). Both
can be read while the worker is blocked inside gloo, which is when the notebook needs them (a deadlock report).
"""

from __future__ import annotations

import copyreg
import faulthandler
import gc
import io
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
from collections import ChainMap
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _pickling  # rebuilds functions and classes defined in a notebook
from . import tap as _tap
from ._callboard import install as _install_call_board
from ._callboard import post_current as _post_current_call
from ._native import native_log
from .i18n import N_

# Set per task; read by labsupport.device() and labsupport.in_worker().
CURRENT: dict = {}

_send_lock = threading.Lock()

# What a freshly started Python process would have: torch seeds its default generator with this constant.
_FRESH_SEED = torch.Generator().initial_seed()


def _send(conn, msg) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    with _send_lock:
        conn.send_bytes(data)


class _RankStream(io.TextIOBase):
    """A text stream that forwards whole lines to the notebook, so lines of different ranks never mix."""

    def __init__(self, conn, name: str, original):
        self._conn = conn
        self._name = name
        self._buf = ""
        self._original = original
        self.call_id = None

    def writable(self) -> bool:
        return True

    def write(self, text) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if self.call_id is None:  # between tasks: nobody is listening
            return self._original.write(text) if self._original else len(text)
        self._buf += text
        if "\n" in self._buf:
            complete, _, self._buf = self._buf.rpartition("\n")
            _send(self._conn, ("out", self.call_id, self._name, complete + "\n"))
        elif len(self._buf) > 65536:  # a very long line without a newline
            self.flush()
        return len(text)

    def flush(self) -> None:
        if self._buf and self.call_id is not None:
            text, self._buf = self._buf, ""
            _send(self._conn, ("out", self.call_id, self._name, text))

    @property
    def encoding(self):  # some libraries look at it
        return "utf-8"

    def isatty(self) -> bool:
        return False


def _cpu_tensor_reduce(t):
    """How a result's tensor is pickled: as a CPU tensor, wherever it sits (a list, a ``state_dict``, a module's
    parameter, ``torch.max``'s named tuple, an object of the notebook's own class), so that the notebook never has to
    initialise CUDA to read a result."""
    if t.device.type != "cpu":
        t = t.detach().cpu()
    return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


# exact type: subclasses (Parameter) pickle their plain tensor data through this entry too
_ON_THE_CPU = {torch.Tensor: _cpu_tensor_reduce}


class _ResultPickler(pickle.Pickler):
    dispatch_table = ChainMap(_ON_THE_CPU, copyreg.dispatch_table)


class _ResultCloudPickler(_pickling._Pickler):  # classes and functions defined in the notebook
    dispatch_table = ChainMap(_ON_THE_CPU, _pickling._Pickler.dispatch_table)


def _dump_result(result, pickler=_ResultPickler) -> bytes:
    with io.BytesIO() as file:
        pickler(file, protocol=pickle.HIGHEST_PROTOCOL).dump(result)
        return file.getvalue()


def _error_dict(exc: BaseException, where: str) -> dict:
    frames = [(f.filename, f.lineno, f.name, f.line) for f in traceback.extract_tb(exc.__traceback__)]
    try:
        pickled = _pickling.dumps(exc)
        pickle.loads(pickled)  # only keep it if the notebook will be able to rebuild it
    except Exception:
        pickled = None
    return {
        "type": type(exc).__name__,
        "module": type(exc).__module__,
        "message": str(exc),
        "frames": frames,
        "text": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "where": where,
        "exception": pickled,
    }


def _reader(conn, inbox: "queue.Queue") -> None:
    """Own the receiving end of the connection. The notebook going away means this worker must go too."""
    if hasattr(signal, "pthread_sigmask"):  # a stack dump is the main thread's (see main)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)
        msg = pickle.loads(data)
        if msg[0] == "exit":
            os._exit(0)
        if msg[0] == "board":  # answered here: the main thread may be blocked in the very call to show
            try:
                _post_current_call()
            except Exception:
                pass
            continue
        inbox.put(msg)


def _fresh_process_state(spec: dict) -> None:
    """Start each call as a freshly started process would, as far as that is cheap.

    A worker lives on between calls, so without this a call would see what earlier calls left behind: the
    notebook's environment as it was when the worker started (not as it is now), the random numbers an earlier
    call drew, a default dtype it changed, gradients it switched off.
    """
    if "environ" in spec:
        os.environ.clear()
        os.environ.update(spec["environ"])
    torch.default_generator.manual_seed(_FRESH_SEED)
    if torch.cuda.is_initialized():  # pragma: no cover - NCCL workers
        torch.cuda.manual_seed_all(_FRESH_SEED)
    if "numpy" in sys.modules:  # a fresh process seeds numpy from the OS; forked workers would all share one state
        try:
            sys.modules["numpy"].random.seed()
        except Exception:  # pragma: no cover - a broken numpy is the function's problem, not the launcher's
            pass
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


def _setup_task(spec: dict) -> None:
    rank, world_size = spec["rank"], spec["world_size"]
    _fresh_process_state(spec)
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "NODE_RANK": "0",
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": spec["master_addr"],
        "MASTER_PORT": str(spec["master_port"]),
    }
    os.environ.update(env)
    os.environ.update(spec.get("extra_env", {}))
    if spec.get("cwd") and os.path.isdir(spec["cwd"]):
        os.chdir(spec["cwd"])
    if spec.get("sys_path"):
        sys.path[:] = list(spec["sys_path"])
    torch.set_num_threads(spec["threads"])
    backend = spec["backend"]
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    CURRENT.clear()
    CURRENT.update(rank=rank, world_size=world_size, backend=backend, device=device, call_id=spec["call_id"])


_CLIENT_STORE = {}


def _store(addr: str, port: int, timeout: float):
    key = (addr, port)
    if key not in _CLIENT_STORE:
        _CLIENT_STORE.clear()
        _CLIENT_STORE[key] = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout))
    return _CLIENT_STORE[key]


#: This worker's stack file (a sandbox's lies next to it); set by ``main``.
_STACK_FILE = [""]


def _run_task(conn, call_id: int, spec: dict, payload: bytes, streams) -> None:
    where = N_("starting the worker")  # what it was doing: the notebook translates it
    try:
        _setup_task(spec)
        where = N_("unpickling the function")
        fn, args, kwargs = _pickling.loads(payload)
        where = N_("initialising the process group")
        store = dist.PrefixStore(f"labsupport/{call_id}", _store(spec["master_addr"], spec["master_port"], 30.0))
        dist.init_process_group(
            spec["backend"],
            store=store,
            rank=spec["rank"],
            world_size=spec["world_size"],
            timeout=timedelta(seconds=spec["pg_timeout"]),
        )
        where = N_("running your function")
        result = fn(*args, **kwargs)
        for s in streams:
            s.flush()
        where = N_("sending the result back")
        try:
            data = _dump_result(result)
        except Exception as exc:
            try:  # classes defined in the notebook need cloudpickle
                data = _dump_result(result, _ResultCloudPickler)
            except Exception:
                raise TypeError(
                    f"the function returned a {type(result).__name__}, which cannot be sent back to the notebook "
                    f"({exc}). Return tensors, numbers, strings, or lists/dicts of them."
                ) from None
        with _send_lock:
            conn.send_bytes(pickle.dumps(("result", call_id, data), protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException as exc:  # SystemExit and KeyboardInterrupt from user code are errors too
        for s in streams:
            try:
                s.flush()
            except Exception:
                pass
        _send(conn, ("error", call_id, _error_dict(exc, where)))


def _finish() -> None:
    if "labsupport._sandbox" in sys.modules:  # a check's sandbox: what it holds of this task goes with it
        sys.modules["labsupport._sandbox"].end_task()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    CURRENT.clear()


#: Tasks that found the process group of an earlier call still initialised (its "finish" never came).
LEFTOVER_GROUPS = 0


def _drop_leftover_group() -> None:
    """Destroy a process group an earlier call left behind, before this task initialises its own.

    "finish" can be lost: the notebook may be interrupted between collecting the results and sending it. A fresh
    process has no group, and ``init_process_group`` refuses to run twice, so the task must not inherit it.
    """
    global LEFTOVER_GROUPS
    if dist.is_initialized():
        LEFTOVER_GROUPS += 1
        _finish()


def main(conn, stack_file: str, board_file: str | None = None) -> None:
    """Entry point of a worker process."""
    # What the fork server imported (torch, maybe torch._dynamo: a million objects) lives as long as the worker:
    # out of the garbage collector's sight, a full collection takes a millisecond instead of 150, and does not
    # write to (and so copy) every page this process shares with the server.
    gc.freeze()
    _STACK_FILE[0] = stack_file
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the notebook decides when workers stop
    if hasattr(signal, "pthread_sigmask"):  # the server started with SIGINT blocked (_forkserver.start_quietly)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # On request (SIGUSR1), write the main thread's Python stack: works even while blocked inside gloo. Only the
    # thread that takes the signal is written, whole, and it is the main thread: the kernel gives a signal sent to
    # the process to its main thread first, and the reader thread blocks it. (A dump of every thread would write
    # the reader's first, and one paused there on a busy machine would show no stack of the rank's.)
    stack_fh = open(stack_file, "a")  # append: the notebook truncates it before each dump
    faulthandler.register(signal.SIGUSR1, file=stack_fh, all_threads=False, chain=False)
    # What native code writes to stderr (gloo's "terminate called ... what(): ...") goes to a file of this rank,
    # not to the terminal of the Jupyter server or of the grader: a death report quotes it (``native_error``).
    fd = os.open(native_log(stack_file), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    _tap.install()  # once per worker: every observer (call board, CommCounter, Timeline) subscribes to it
    if board_file:
        _install_call_board(board_file)
    out = _RankStream(conn, "stdout", sys.__stdout__)
    err = _RankStream(conn, "stderr", sys.__stderr__)
    sys.stdout, sys.stderr = out, err
    inbox: "queue.Queue" = queue.Queue()
    threading.Thread(target=_reader, args=(conn, inbox), daemon=True, name="labsupport-reader").start()
    _send(conn, ("hello", os.getpid(), threading.get_ident()))
    while True:
        msg = inbox.get()
        if msg[0] == "task":
            _, call_id, spec, payload = msg
            _drop_leftover_group()
            out.call_id = err.call_id = call_id
            os.ftruncate(2, 0)  # what a death report quotes is this call's
            try:
                _run_task(conn, call_id, spec, payload, (out, err))
            finally:
                out.call_id = err.call_id = None
        elif msg[0] == "finish":
            _finish()
        elif msg[0] == "ping":  # answered in order, after any "finish" sent before it
            sandbox = sys.modules.get(f"{__package__}._sandbox")  # loaded once a check used one (no import here)
            _send(conn, ("pong", dist.is_initialized(), sandbox.pid() if sandbox else None))
