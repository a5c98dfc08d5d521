"""Count the communication a rank makes: ``CommCounter``.

Every ``torch.distributed`` call, whichever way it was written (``dist.send``, ``dist.isend``,
``dist.batch_isend_irecv``, any collective, sync or ``async_op=True``, or a name imported with
``from torch.distributed import send``), ends in a method of the process group object. The counter wraps those
methods while it is active, so nothing slips past it.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field

__all__ = ["CommCounter", "CommCall", "POINT_TO_POINT"]

# process-group method -> the torch.distributed name a student knows
_KINDS = {
    "send": "send",
    "recv": "recv",
    "recv_anysource": "recv",
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "allgather": "all_gather",
    "_allgather_base": "all_gather_into_tensor",
    "all_gather_single": "all_gather_into_tensor",
    "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor",
    "gather": "gather",
    "scatter": "scatter",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "all_to_all_single": "all_to_all_single",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
}

#: The kinds a from-scratch collective may use.
POINT_TO_POINT = frozenset({"send", "recv"})

# Methods whose first argument is the rank's data; every other one is called as (output, input, ...).
_DATA_FIRST = frozenset({"send", "recv", "recv_anysource", "allreduce", "allreduce_coalesced", "broadcast", "reduce",
                         "barrier", "monitored_barrier"})


@dataclass
class CommCall:
    """One communication call seen on this rank.

    ``kind`` is the torch.distributed name (``"send"``, ``"recv"``, ``"all_reduce"``, ...); ``peer`` the global rank
    on the other end of a send or recv (``None`` for collectives and for recv from any source); ``group`` the
    global ranks of the process group; ``nbytes`` the bytes of this rank's data in the call: the tensor sent,
    received, reduced or broadcast, and for the collectives that take an output and an input (all-gather, gather,
    scatter, reduce-scatter, all-to-all) the input (for scatter, the chunks on the source rank and 0 elsewhere).

    Example (on 2 ranks)::

        with labsupport.CommCounter() as cc:
            if dist.get_rank() == 0:
                dist.send(torch.ones(1000), dst=1)
            else:
                dist.recv(torch.empty(1000), src=0)
        cc.calls    # rank 0: [CommCall(kind='send', peer=1, group=(0, 1), nbytes=4000)]
                    # rank 1: [CommCall(kind='recv', peer=0, group=(0, 1), nbytes=4000)]
    """

    kind: str
    peer: int | None
    group: tuple
    nbytes: int


def _nbytes(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(x) for x in obj)
    return 0


@dataclass
class CommSummary:
    """What one rank did, in numbers. Picklable, so a worker can return it to the notebook."""

    rank: int
    calls: list = field(default_factory=list)

    @property
    def kinds(self) -> set:
        return {c.kind for c in self.calls}

    def count(self, kind: str) -> int:
        return sum(1 for c in self.calls if c.kind == kind)

    @property
    def messages_sent(self) -> int:
        return self.count("send")

    @property
    def bytes_sent(self) -> int:
        return sum(c.nbytes for c in self.calls if c.kind == "send")

    @property
    def bytes_received(self) -> int:
        return sum(c.nbytes for c in self.calls if c.kind == "recv")

    @property
    def peers(self) -> set:
        return {c.peer for c in self.calls if c.peer is not None}

    @property
    def collectives(self) -> list:
        return [c for c in self.calls if c.kind not in POINT_TO_POINT]

    def as_dict(self) -> dict:
        return {
            "rank": self.rank,
            "messages_sent": self.messages_sent,
            "bytes_sent": self.bytes_sent,
            "messages_received": self.count("recv"),
            "bytes_received": self.bytes_received,
            "collectives": [c.kind for c in self.collectives],
            "calls": [asdict(c) for c in self.calls],
        }


class CommCounter:
    """Record every ``torch.distributed`` call this rank makes inside the ``with`` block.

    Use it inside a worker. The counter is a ``CommSummary``: ``calls`` (a list of ``CommCall``), ``bytes_sent``,
    ``bytes_received``, ``messages_sent``, ``peers``, ``collectives``, ``count(kind)``; return ``counter.summary``
    (or ``counter.as_dict()``) from the worker to see it in the notebook.

    Example::

        def work():
            x = torch.ones(1000)
            with labsupport.CommCounter() as cc:
                my_all_reduce(x)
            assert cc.kinds <= {"send", "recv"}, "use point-to-point calls only"
            return cc.bytes_sent

        labsupport.run(work, world_size=4)

    Counters nest: an inner counter and every enclosing one all see the calls made inside the inner one.
    """

    _active: list = []
    _lock = threading.Lock()
    _originals: dict = {}

    def __init__(self):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.summary = CommSummary(rank=rank)

    # the summary's fields, directly on the counter
    def __getattr__(self, name):
        if name == "summary":
            raise AttributeError(name)
        return getattr(self.summary, name)

    def __enter__(self) -> "CommCounter":
        with CommCounter._lock:
            if not CommCounter._active:
                _install()
            CommCounter._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with CommCounter._lock:
            CommCounter._active.remove(self)
            if not CommCounter._active:
                _uninstall()

    def __repr__(self) -> str:
        s = self.summary
        return (
            f"CommCounter(rank={s.rank}, calls={len(s.calls)}, sent={s.messages_sent} msgs / {s.bytes_sent} B, "
            f"received={s.count('recv')} msgs / {s.bytes_received} B, collectives={[c.kind for c in s.collectives]})"
        )


_state = threading.local()


def _group_ranks(pg) -> tuple:
    import torch.distributed as dist

    try:
        return tuple(dist.get_process_group_ranks(pg))
    except Exception:
        try:
            return tuple(range(pg.size()))
        except Exception:
            return ()


def _data_argument(method: str, args: tuple, kwargs: dict):
    """The tensor(s) that are this rank's data in a process-group call (see ``CommCall.nbytes``)."""
    if method in _DATA_FIRST:
        return args[0] if args else kwargs.get("tensors")
    if len(args) >= 2:
        return args[1]
    return next((v for k, v in kwargs.items() if k.startswith("input")), None)


def _make_wrapper(method: str, original):
    kind = _KINDS[method]

    def wrapper(pg, *args, **kwargs):
        # nested process-group calls (a collective built from others) count once, as the outer call
        if getattr(_state, "depth", 0) == 0 and CommCounter._active:
            tensors = _data_argument(method, args, kwargs)
            peer = None
            if kind in POINT_TO_POINT and method != "recv_anysource" and len(args) >= 2:
                import torch.distributed as dist

                try:
                    peer = dist.get_global_rank(pg, int(args[1]))
                except Exception:
                    peer = int(args[1])
            call = CommCall(kind=kind, peer=peer, group=_group_ranks(pg), nbytes=_nbytes(tensors))
            # recorded before the call goes out: a check may inspect it and stop a call that would block
            for counter in list(CommCounter._active):
                counter.summary.calls.append(call)
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            return original(pg, *args, **kwargs)
        finally:
            _state.depth -= 1

    wrapper.__name__ = method
    wrapper.__wrapped__ = original
    return wrapper


def _install() -> None:
    from torch._C._distributed_c10d import ProcessGroup

    for method in _KINDS:
        original = ProcessGroup.__dict__.get(method)
        if original is None:
            continue
        CommCounter._originals[method] = original
        setattr(ProcessGroup, method, _make_wrapper(method, original))


def _uninstall() -> None:
    from torch._C._distributed_c10d import ProcessGroup

    for method, original in CommCounter._originals.items():
        setattr(ProcessGroup, method, original)
    CommCounter._originals.clear()
