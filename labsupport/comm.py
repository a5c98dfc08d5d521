"""Count the communication a rank makes: ``CommCounter``.

The counter subscribes to ``labsupport.tap`` while it is active and records every outermost communication call:
each ``torch.distributed`` call, whichever way it was written (``dist.send``, ``dist.isend``,
``dist.batch_isend_irecv``, any collective, sync or ``async_op=True``, a name imported with
``from torch.distributed import send``), ends in a method of the process group object; calls made on a backend
object directly, and the functional collectives that DTensor and ``parallelize_module`` use
(``torch.distributed._functional_collectives``), are seen too, as the collective they are.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ._kinds import PG_KINDS as _KINDS, POINT_TO_POINT, nbytes_of as _nbytes  # noqa: F401  (torch-free names)

__all__ = ["CommCounter", "CommCall", "POINT_TO_POINT"]


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
        from . import tap

        tap.subscribe(self)
        return self

    def __exit__(self, *exc) -> None:
        from . import tap

        tap.unsubscribe(self)

    # the tap's observer interface
    def enter(self, call) -> None:
        """Record the outermost communication call, before it goes out: a check may inspect it and stop a call
        that would block (by raising from the list's ``append``)."""
        if call.is_comm and not call.in_comm:
            self.summary.calls.append(_comm_call(call))

    def exit(self, call) -> None:
        pass

    def __repr__(self) -> str:
        s = self.summary
        return (
            f"CommCounter(rank={s.rank}, calls={len(s.calls)}, sent={s.messages_sent} msgs / {s.bytes_sent} B, "
            f"received={s.count('recv')} msgs / {s.bytes_received} B, collectives={[c.kind for c in s.collectives]})"
        )


def _comm_call(call) -> CommCall:
    """The CommCall of a tap call, made once and shared by every counter that records it (counters nest)."""
    made = call.memo.get("CommCall")
    if made is None:
        made = call.memo["CommCall"] = CommCall(kind=call.kind, peer=call.peer, group=call.group, nbytes=call.nbytes)
    return made
