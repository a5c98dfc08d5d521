"""Recognising a wrong answer and wording its message: which partial sum a result is, a call to a rank that is
not a ring neighbour (stopped as it happens), more bytes than a ring needs."""

from __future__ import annotations

import itertools

from .._common import close, only_point_to_point, tolerance


def _describe(shape, dtype_name, seed) -> str:
    return f"input shape {tuple(shape)}, dtype {dtype_name}, seed {seed}"


def _close(a, b, dtype_name) -> bool:
    """``close`` for tensors that must have the same dtype (``dtype_name`` is the case's, kept for the messages)."""
    return close(a, b)


def _why_wrong_sum(got, parts, dtype_name, chunk_names=None) -> str:
    """A likely cause when ``got`` is not the sum of ``parts`` (the per-rank inputs of one piece of data).

    ``chunk_names`` optionally lists (description, tensor) alternatives to recognise, e.g. another chunk's sum.
    """
    import torch

    total = sum(parts[1:], parts[0].clone())
    n = len(parts)
    for name, alt in chunk_names or []:
        if _close(got, alt, dtype_name):
            return f"It equals {name}."
    if n > 1 and got.dtype == total.dtype:
        if got.dtype.is_floating_point:
            averages = [total / n]
        else:
            averages = [torch.div(total, n, rounding_mode=m) for m in ("floor", "trunc")]
        if any(_close(got, avg, dtype_name) for avg in averages):
            return (
                "It equals the average over ranks: sum, do not divide by world_size (averaging is the caller's "
                "job, e.g. DDP divides the summed gradients)."
            )
    if n > 1:
        for size in range(1, n):
            for subset in itertools.combinations(range(n), size):
                partial = sum((parts[i] for i in subset[1:]), parts[subset[0]].clone())
                if _close(got, partial, dtype_name):
                    missing = sorted(set(range(n)) - set(subset))
                    if size == 1:
                        return (
                            f"It is just rank {subset[0]}'s own data: nothing received was added to it "
                            "(or it was overwritten by what arrived)."
                        )
                    return (
                        f"It is the sum over ranks {list(subset)} only: the contribution of rank(s) {missing} is "
                        "missing. The reduce-scatter needs world_size - 1 steps, each adding what arrived from "
                        "the left neighbour to the chunk that is passed on next."
                    )
    if got.shape == total.shape and got.numel() > 0:
        flat_got, flat_exp = got.reshape(-1), total.reshape(-1)
        if got.dtype.is_floating_point:
            bad = ~torch.isclose(flat_got, flat_exp, **tolerance(dtype_name))
        else:
            bad = flat_got != flat_exp
        idx = bad.nonzero().flatten().tolist()
        if idx:
            return (
                f"{len(idx)} of {got.numel()} elements are wrong, the first at flat index {idx[0]} "
                f"(got {flat_got[idx[0]].item():.6g}, expected {flat_exp[idx[0]].item():.6g})."
            )
    return ""


class _RingGuard(list):
    """A ``CommCounter`` call list that objects the moment a call is not a send/recv with a ring neighbour.

    Raising inside the counter's hook (before the call reaches the process group) stops a wrong call before it
    can hang or crash the rank, so the student sees which call was wrong.
    """

    def __init__(self, what: str, rank: int, world_size: int):
        super().__init__()
        self.what, self.rank = what, rank
        self.neighbours = {(rank - 1) % world_size, (rank + 1) % world_size}

    def append(self, call):
        super().append(call)
        if call.kind not in ("send", "recv"):
            from labsupport.comm import CommSummary

            only_point_to_point(CommSummary(rank=self.rank, calls=[call]), self.what)
        if call.peer is not None and call.peer not in self.neighbours:
            verb = "sent to" if call.kind == "send" else "received from"
            raise AssertionError(
                f"{self.what}: rank {self.rank} {verb} rank {call.peer}, but in a ring each rank only talks to its "
                f"two neighbours (rank - 1) % world_size and (rank + 1) % world_size, here {sorted(self.neighbours)}."
            )


def _guarded_counter(what: str):
    """A ``CommCounter`` whose calls are checked as they happen (see ``_RingGuard``)."""
    import torch.distributed as dist

    import labsupport

    cc = labsupport.CommCounter()
    cc.summary.calls = _RingGuard(what, dist.get_rank(), dist.get_world_size())
    return cc


def _check_bytes(summary, what: str, world_size: int, bound: int, formula: str, desc: str) -> None:
    if summary.bytes_sent > bound:
        raise AssertionError(
            f"{what}: rank {summary.rank} sent {summary.bytes_sent} bytes in {summary.messages_sent} messages "
            f"({desc}), but a ring needs at most {formula} = {bound} bytes. Each step should carry one chunk "
            "(about 1/world_size of the tensor), not the whole tensor."
        )


def _check_needed(summary, what: str, need: int, why: str, desc: str) -> None:
    """A right answer with fewer bytes received in send/recv than any algorithm needs moved its data some other way
    (the rendezvous store, a collective the recording did not see): the exercise is the messages."""
    if summary.bytes_received < need:
        raise AssertionError(
            f"{what}: rank {summary.rank} received {summary.bytes_received} bytes in send/recv calls ({desc}), but "
            f"it needs at least {need}: {why}. The answer is right, so the data travelled some other way; the "
            "exercise is to move it with point-to-point messages."
        )
