"""What runs inside one rank.

A worker is a long-lived process forked from the launcher's fork server (which imported torch once, before any
thread pool existed). It waits for tasks from the notebook, runs each one inside a freshly initialised process
group, and sends back its prints, its result or its error. Nothing here is public: see ``labsupport.run``.

Messages are pickled tuples sent over one ``multiprocessing`` connection:

    notebook -> worker   ("task", call_id, spec_dict, payload_bytes)  ("finish", call_id)  ("ping",)  ("exit",)
    worker -> notebook   ("hello", pid, main_thread_ident)  ("out", call_id, stream, text)
                         ("result", call_id, bytes)  ("error", call_id, error_dict)
                         ("pong", process_group_initialised)

Besides the connection, each worker shares two small files with the notebook: the stack file, where
faulthandler writes every thread's stack on SIGUSR1, and the *call board*, where the worker keeps the
``torch.distributed`` call it is inside right now, with its evaluated arguments ("recv(src=1) of 4 float32"). Both
can be read while the worker is blocked inside gloo, which is when the notebook needs them (a deadlock report).
"""

from __future__ import annotations

import faulthandler
import functools
import io
import mmap
import os
import pickle
import queue
import signal
import struct
import sys
import threading
import traceback
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

try:  # cloudpickle rebuilds functions and classes defined in a notebook
    import cloudpickle
except ImportError:  # pragma: no cover - cloudpickle is a dependency
    cloudpickle = pickle

from ._pool import BOARD_SIZE

try:
    from torch._C._distributed_c10d import Work as _Work
except ImportError:  # pragma: no cover - torch without distributed support
    _Work = type(None)

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


def _to_cpu(obj):
    """Move tensors in (nested) results to the CPU, so the notebook never has to initialise CUDA to read them."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if obj.device.type != "cpu" else obj
    if isinstance(obj, list):
        return [_to_cpu(x) for x in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(_to_cpu(x) for x in obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


# ---------------------------------------------------------------------------------------------------------------
# The call board: the torch.distributed call this rank is inside, with its evaluated arguments
#
# A deadlock report built from the stack alone can only show the source line, ``dist.recv(t, src=1 - rank)``;
# the student needs the values, "recv(src=1)" on rank 0 and "recv(src=0)" on rank 1, to see the cycle. So the
# functions students call are wrapped: just before the call, the wrapper writes a short description into a small
# file shared with the notebook (mmap), and clears it when the call returns. Writing costs a microsecond or two.
# Names imported before the wrapping (``from torch.distributed import send`` in a module loaded earlier) call
# the original function: the report then falls back to the stack. CommCounter works at the process-group level,
# below these functions, so it sees every call either way.

# name -> (peer argument and its position, described tensor argument and its position, position of ``op``)
_CALLS = {
    "send": ("dst", 1, "tensor", 0, None),
    "recv": ("src", 1, "tensor", 0, None),
    "isend": ("dst", 1, "tensor", 0, None),
    "irecv": ("src", 1, "tensor", 0, None),
    "broadcast": ("src", 1, "tensor", 0, None),
    "reduce": ("dst", 1, "tensor", 0, 2),
    "gather": ("dst", 2, "tensor", 0, None),
    "scatter": ("src", 2, "tensor", 0, None),
    "all_reduce": (None, None, "tensor", 0, 1),
    "all_gather": (None, None, "tensor", 1, None),
    "all_gather_into_tensor": (None, None, "input_tensor", 1, None),
    "reduce_scatter": (None, None, "input_list", 1, 2),
    "reduce_scatter_tensor": (None, None, "input", 1, 2),
    "all_to_all": (None, None, "input_tensor_list", 1, None),
    "all_to_all_single": (None, None, "input", 1, None),
    "barrier": (None, None, None, None, None),
    "batch_isend_irecv": (None, None, None, None, None),  # described operation by operation
}

_board = None  # the _Board of this worker, once main() has started
_MAIN_IDENT = 0  # only calls made by the main thread are posted (it is the thread a deadlock report shows)
_inside = False  # the main thread is inside a posted call: the calls torch makes from there are not posted
_PENDING: dict = {}  # id(Work) -> (weak reference to the Work, what it waits for), for Work.wait()
_DTYPES: dict = {}


class _Board:
    """A fixed-size file mapped into memory: a 4-byte length, then the description in UTF-8 (0: no call).

    The notebook reads it with an ordinary ``read`` while this worker is blocked; mapping the file means posting
    is a memory copy, not a system call.
    """

    def __init__(self, path: str):
        with open(path, "r+b") as fh:
            self._mm = mmap.mmap(fh.fileno(), BOARD_SIZE)

    def post(self, text: str) -> None:
        data = text.encode("utf-8", "replace")[: BOARD_SIZE - 4]
        self._mm[4 : 4 + len(data)] = data
        self._mm[0:4] = struct.pack("<I", len(data))

    def clear(self) -> None:
        self._mm[0:4] = b"\0\0\0\0"


def _arg(args, kwargs, pos, name):
    if pos is not None and len(args) > pos:
        return args[pos]
    return kwargs.get(name)


def _tensor_text(obj) -> str:
    if isinstance(obj, torch.Tensor):
        dtype = _DTYPES.get(obj.dtype)
        if dtype is None:
            dtype = _DTYPES[obj.dtype] = str(obj.dtype).replace("torch.", "")
        return f"{obj.numel()} {dtype}"
    if isinstance(obj, (list, tuple)):
        return f"{len(obj)} x {_tensor_text(obj[0])}" if obj else "0 tensors"
    return ""


def _describe_batch(ops) -> str:
    shown = []
    for op in list(ops)[:4]:
        name = getattr(op.op, "__name__", "?")
        shown.append(f"{name} {'to' if 'send' in name else 'from'} {op.peer}")
    return f"batch_isend_irecv({', '.join(shown)}{', ...' if len(ops) > 4 else ''})"


def _describe(name: str, args, kwargs) -> str:
    """'recv(src=1) of 4 float32', 'all_reduce(op=MAX) of 64 float32', 'barrier': the call with its values."""
    if name == "batch_isend_irecv":
        return _describe_batch(_arg(args, kwargs, 0, "p2p_op_list") or [])
    peer_name, peer_pos, tensor_name, tensor_pos, op_pos = _CALLS[name]
    parts = []
    if peer_name:
        peer = _arg(args, kwargs, peer_pos, peer_name)
        group_peer = kwargs.get(f"group_{peer_name}")
        if peer is None and group_peer is not None:
            parts.append(f"group_{peer_name}={group_peer}")
        else:
            parts.append(f"{peer_name}={'any' if peer is None else peer}")
    if op_pos is not None:
        op = _arg(args, kwargs, op_pos, "op")
        if op is not None and op != dist.ReduceOp.SUM:
            parts.append(f"op={getattr(op, 'name', op)}")
    text = f"{name}({', '.join(parts)})" if parts else name
    if tensor_name:
        what = _tensor_text(_arg(args, kwargs, tensor_pos, tensor_name))
        if what:
            text += f" of {what}"
    return text


def _posted(what: str, fn, args, kwargs):
    """Call ``fn`` with ``what`` on the board for the duration of the call."""
    global _inside
    _inside = True
    _board.post(what)
    try:
        return fn(*args, **kwargs)
    finally:
        _inside = False
        _board.clear()


def _remember(work, what: str) -> None:
    """Keep what an asynchronous call was, for the ``wait()`` on its Work (forgotten with the Work)."""
    key = id(work)
    try:
        ref = weakref.ref(work, lambda _, key=key: _PENDING.pop(key, None))
    except TypeError:
        return
    _PENDING[key] = (ref, what)


def _wrap(name: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if _inside or _board is None or threading.get_ident() != _MAIN_IDENT:
            return fn(*args, **kwargs)
        try:
            what = _describe(name, args, kwargs)
        except Exception:  # describing must never break the call
            what = name
        result = _posted(what, fn, args, kwargs)
        if isinstance(result, _Work):  # async_op=True, isend, irecv
            _remember(result, what)
        elif name == "batch_isend_irecv" and isinstance(result, list):
            for work in result:
                if isinstance(work, _Work):
                    _remember(work, what)
        return result

    call._labsupport_board = True
    return call


def _wrap_wait(fn):
    @functools.wraps(fn)
    def wait(self, *args, **kwargs):
        if _inside or _board is None or threading.get_ident() != _MAIN_IDENT:
            return fn(self, *args, **kwargs)
        entry = _PENDING.get(id(self))
        what = f"wait() for {entry[1]}" if entry is not None and entry[0]() is self else "wait()"
        return _posted(what, fn, (self, *args), kwargs)

    wait._labsupport_board = True
    return wait


def _install_call_board(board_file: str) -> None:
    """Wrap the torch.distributed functions students call, in both modules that hold them.

    ``distributed_c10d`` must get the same wrappers as ``torch.distributed``: ``P2POp`` checks that its ``op`` is
    that module's ``isend`` or ``irecv``, and pickle finds functions there.
    """
    global _board, _MAIN_IDENT
    from torch.distributed import distributed_c10d as c10d

    _board = _Board(board_file)
    _MAIN_IDENT = threading.get_ident()
    for name in _CALLS:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "_labsupport_board", False):
            continue
        wrapper = _wrap(name, original)
        for module in (c10d, dist):
            if getattr(module, name, None) is original:
                setattr(module, name, wrapper)
    wait = getattr(_Work, "wait", None)
    if wait is not None and not getattr(wait, "_labsupport_board", False):
        try:
            _Work.wait = _wrap_wait(wait)
        except (AttributeError, TypeError):  # pragma: no cover - a torch whose Work cannot be patched
            pass


def _error_dict(exc: BaseException, where: str) -> dict:
    frames = [(f.filename, f.lineno, f.name, f.line) for f in traceback.extract_tb(exc.__traceback__)]
    try:
        pickled = cloudpickle.dumps(exc)
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
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)
        msg = pickle.loads(data)
        if msg[0] == "exit":
            os._exit(0)
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


def _run_task(conn, call_id: int, spec: dict, payload: bytes, streams) -> None:
    where = "starting the worker"
    try:
        _setup_task(spec)
        where = "unpickling the function"
        fn, args, kwargs = cloudpickle.loads(payload)
        where = "initialising the process group"
        store = dist.PrefixStore(f"labsupport/{call_id}", _store(spec["master_addr"], spec["master_port"], 30.0))
        dist.init_process_group(
            spec["backend"],
            store=store,
            rank=spec["rank"],
            world_size=spec["world_size"],
            timeout=timedelta(seconds=spec["pg_timeout"]),
        )
        where = "running your function"
        result = fn(*args, **kwargs)
        for s in streams:
            s.flush()
        where = "sending the result back"
        try:
            data = pickle.dumps(_to_cpu(result), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            try:  # classes defined in the notebook need cloudpickle
                data = cloudpickle.dumps(_to_cpu(result), protocol=pickle.HIGHEST_PROTOCOL)
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
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the notebook decides when workers stop
    # On request (SIGUSR1), write every thread's Python stack: works even while blocked inside gloo.
    stack_fh = open(stack_file, "a")  # append: the notebook truncates it before each dump
    faulthandler.register(signal.SIGUSR1, file=stack_fh, all_threads=True, chain=False)
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
            try:
                _run_task(conn, call_id, spec, payload, (out, err))
            finally:
                out.call_id = err.call_id = None
        elif msg[0] == "finish":
            _finish()
        elif msg[0] == "ping":  # answered in order, after any "finish" sent before it
            _send(conn, ("pong", dist.is_initialized()))
