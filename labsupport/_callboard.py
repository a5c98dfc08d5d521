"""The call board: the ``torch.distributed`` call a worker is inside right now, readable while it is blocked.

Part of a worker (``labsupport._worker``); the board's format is ``labsupport._board``, where the notebook reads
it when it writes a deadlock report.
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch
import torch.distributed as dist

from ._board import Board as _Board

try:
    from torch._C._distributed_c10d import Work as _Work
except ImportError:  # pragma: no cover - torch without distributed support
    _Work = type(None)

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


def install(board_file: str) -> None:
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
