"""The call board: the ``torch.distributed`` call a worker is inside right now, readable while it is blocked.

Part of a worker (``labsupport._worker``); the board's format is ``labsupport._board``, where the notebook reads
it when it writes a deadlock report.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.distributed as dist

from ._board import Board as _Board
from .i18n import _

try:
    from torch._C._distributed_c10d import Work as _Work
except ImportError:  # pragma: no cover - torch without distributed support
    _Work = type(None)

# ---------------------------------------------------------------------------------------------------------------
# The call board: the torch.distributed call this rank is inside, with its evaluated arguments
#
# A deadlock report built from the stack alone can only show the source line, ``dist.recv(t, src=1 - rank)``;
# the student needs the values, "recv(src=1)" on rank 0 and "recv(src=0)" on rank 1, to see the cycle. So the
# board subscribes to the tap (``labsupport.tap``) and keeps the outermost call of the main thread at hand (one
# assignment per call, nothing described). Only when the notebook asks (a "board" message, which the worker's
# reader thread handles while the main thread is blocked) is that call described and written into a small file
# shared with the notebook (mmap). A call that bypasses the torch.distributed functions (a name imported before
# the tap was installed, a process group's method, a functional collective) is described from the level where
# the tap saw it.

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

_board = None  # the Board of this worker, once main() has started; only the main thread's calls are posted (it
# is the thread a deadlock report shows), and only the outermost one (not the calls torch makes from there)
_current = None  # that call, while the main thread is inside it (a tap.Call)
_PENDING: dict = {}  # id(Work) -> (weak reference to the Work, what it waits for), for Work.wait()
_DTYPES: dict = {}


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
        return f"{len(obj)} x {_tensor_text(obj[0])}" if obj else _("0 tensors")
    return ""


def _describe_batch(ops) -> str:
    shown = []
    for op in list(ops)[:4]:
        name = getattr(op.op, "__name__", "?")
        shown.append((_("{op} to {peer}") if "send" in name else _("{op} from {peer}")).format(op=name, peer=op.peer))
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
            text = _("{call} of {data}").format(call=text, data=what)
    return text


def _remember(work, what: str) -> None:
    """Keep what an asynchronous call was, for the ``wait()`` on its Work (forgotten with the Work)."""
    key = id(work)
    try:
        ref = weakref.ref(work, lambda _, key=key: _PENDING.pop(key, None))
    except TypeError:
        return
    _PENDING[key] = (ref, what)


def _comm_text(call) -> str:
    """A call made below the torch.distributed functions (a process group's or backend's method, a functional
    collective): 'all_reduce of 4 float32 (functional)', 'send(dst=1) of 2 float32 (process group)'."""
    kind = call.kind
    text = kind
    if kind in ("send", "recv"):
        text += f"({'dst' if kind == 'send' else 'src'}={'any' if call.peer is None else call.peer})"
    data = call.args[0] if call.level == "functional" or kind in ("send", "recv") else None
    what = _tensor_text(data) if data is not None else ""
    if what:
        text = _("{call} of {data}").format(call=text, data=what)
    level = {"functional": _("{call} (functional)"), "pg": _("{call} (process group)"),
             "backend": _("{call} (backend)")}[call.level]
    return level.format(call=text)


def describe(call) -> str:
    """What the board shows for ``call``: 'recv(src=1) of 4 float32', 'wait() for isend(dst=1) of 2 float32'."""
    try:
        if call.level == "api":
            return _describe(call.name, call.args, call.kwargs)
        if call.level == "wait":
            entry = _PENDING.get(id(call.target))
            if entry is not None and entry[0]() is call.target:
                return _("wait() for {call}").format(call=entry[1])
            return "wait()"
        return _comm_text(call)
    except Exception:  # describing must never break anything
        return call.name


def post_current() -> None:
    """Write the main thread's current call on the board, or clear it (the notebook asked: a deadlock report)."""
    call = _current
    if _board is None:
        return
    if call is None:
        _board.clear()
    else:
        _board.post(describe(call))


class _CallBoard:
    """The tap's observer that keeps the main thread's outermost call at hand for ``post_current``."""

    nested = False  # calls made inside another one never reach the board

    def __init__(self, main_ident: int):
        self.main_ident = main_ident

    def enter(self, call) -> None:
        global _current
        if call.outer is None and threading.get_ident() == self.main_ident:
            _current = call

    def exit(self, call) -> None:
        global _current
        if call is not _current:
            return
        _current = None
        result = call.result
        if isinstance(result, _Work):  # async_op=True, isend, irecv: described now, for a wait() on it later
            _remember(result, describe(call))
        elif call.name == "batch_isend_irecv" and isinstance(result, list):
            what = describe(call)
            for work in result:
                if isinstance(work, _Work):
                    _remember(work, what)


def install(board_file: str) -> None:
    """Install the tap (once per worker) and keep this worker's call board from it."""
    global _board
    from . import tap

    _board = _Board(board_file)
    tap.subscribe(_CallBoard(threading.get_ident()))
