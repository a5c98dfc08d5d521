"""What runs on the workers: each collective's *run*, and the probe that shares the reports and diagnoses them.

A run (on every rank) computes the built-in's answer on copies of the inputs, then calls the student's function
inside a ``CommCounter``, and returns a report; the probe shares every rank's report and every rank runs the same
diagnosis (``diagnose``): the first rank found wrong raises the message, the others stop quietly.
"""

from __future__ import annotations

import labsupport
from labsupport._sandbox import Unplain

from .._common import only_point_to_point, share, short
from .diagnose import (
    _diagnose_all_gather,
    _diagnose_all_reduce,
    _diagnose_all_to_all,
    _diagnose_broadcast,
    _diagnose_gather,
    _diagnose_reduce,
    _diagnose_reduce_scatter,
    _diagnose_scatter,
    _Problem,
)
from .trials import _chunks_of, _garbage, _tensor_of


class Opaque:
    """Stands for a returned value that is neither a tensor, a list/tuple nor None (it is shown, never compared)."""

    def __init__(self, obj):
        kind = obj.kind if isinstance(obj, Unplain) else type(obj).__name__  # what the sandbox returned
        self.text = f"{kind} {short(obj)}"

    def __repr__(self) -> str:
        return self.text


def _portable(obj):
    """A picklable copy of what the student's function returned, so that every rank can look at every answer."""
    import torch

    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, (list, tuple)):
        return [_portable(x) for x in obj]
    return Opaque(obj)


def _run_broadcast(fn, trial, rank, n):
    import torch.distributed as dist

    src = trial["root"]
    expected = _tensor_of(trial, rank)
    dist.broadcast(expected, src=src)
    x = _tensor_of(trial, rank)
    with labsupport.CommCounter() as cc:
        fn(x, src)
    return {"expected": expected, "after": x, "comm": cc.summary}


def _run_reduce(fn, trial, rank, n):
    import torch.distributed as dist

    dst = trial["root"]
    expected = _tensor_of(trial, rank)
    dist.reduce(expected, dst=dst)
    if rank != dst:
        expected = _tensor_of(trial, rank)  # our semantics: only dst's tensor changes
    x = _tensor_of(trial, rank)
    with labsupport.CommCounter() as cc:
        fn(x, dst)
    return {"expected": expected, "after": x, "comm": cc.summary}


def _run_all_reduce(fn, trial, rank, n):
    import torch.distributed as dist

    expected = _tensor_of(trial, rank)
    dist.all_reduce(expected)
    x = _tensor_of(trial, rank)
    with labsupport.CommCounter() as cc:
        fn(x)
    return {"expected": expected, "after": x, "comm": cc.summary}


def _run_gather(fn, trial, rank, n):
    import torch
    import torch.distributed as dist

    dst = trial["root"]
    mine = _tensor_of(trial, rank)
    bucket = [torch.empty_like(mine) for _ in range(n)] if rank == dst else None
    dist.gather(mine, bucket, dst=dst)
    x = _tensor_of(trial, rank)
    with labsupport.CommCounter() as cc:
        got = fn(x, dst)
    return {"expected": bucket, "after": x, "got": _portable(got), "comm": cc.summary}


def _run_all_gather(fn, trial, rank, n):
    import torch
    import torch.distributed as dist

    mine = _tensor_of(trial, rank)
    bucket = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(bucket, mine)
    x = _tensor_of(trial, rank)
    with labsupport.CommCounter() as cc:
        got = fn(x)
    return {"expected": bucket, "after": x, "got": _portable(got), "comm": cc.summary}


def _run_scatter(fn, trial, rank, n):
    import torch.distributed as dist

    src = trial["root"]
    expected = _garbage(trial, rank)
    dist.scatter(expected, _chunks_of(trial, rank, n) if rank == src else None, src=src)
    out = _garbage(trial, rank)
    chunks = _chunks_of(trial, rank, n) if rank == src else None
    with labsupport.CommCounter() as cc:
        fn(out, chunks, src)
    return {"expected": expected, "after": out, "chunks": chunks, "comm": cc.summary}


def _run_reduce_scatter(fn, trial, rank, n):
    import torch
    import torch.distributed as dist

    expected = torch.empty_like(_chunks_of(trial, rank, n)[0])
    dist.reduce_scatter(expected, _chunks_of(trial, rank, n))
    chunks = _chunks_of(trial, rank, n)
    with labsupport.CommCounter() as cc:
        got = fn(chunks)
    return {"expected": expected, "chunks": chunks, "got": _portable(got), "comm": cc.summary}


def _run_all_to_all(fn, trial, rank, n):
    import torch
    import torch.distributed as dist

    expected = [torch.empty_like(c) for c in _chunks_of(trial, rank, n)]
    dist.all_to_all(expected, _chunks_of(trial, rank, n))
    chunks = _chunks_of(trial, rank, n)
    with labsupport.CommCounter() as cc:
        got = fn(chunks)
    return {"expected": expected, "chunks": chunks, "got": _portable(got), "comm": cc.summary}


_RUN = {
    "broadcast": (_run_broadcast, _diagnose_broadcast),
    "reduce": (_run_reduce, _diagnose_reduce),
    "all_reduce": (_run_all_reduce, _diagnose_all_reduce),
    "gather": (_run_gather, _diagnose_gather),
    "all_gather": (_run_all_gather, _diagnose_all_gather),
    "scatter": (_run_scatter, _diagnose_scatter),
    "reduce_scatter": (_run_reduce_scatter, _diagnose_reduce_scatter),
    "all_to_all": (_run_all_to_all, _diagnose_all_to_all),
}


def _verdict(name: str, trial: dict, n: int, reports: list):
    """None if every rank's answer is right, else (rank to blame, message). The same on every rank."""
    for r in range(n):
        try:
            only_point_to_point(reports[r]["comm"], name)
        except AssertionError as exc:
            return r, str(exc)
    try:
        _RUN[name][1](trial, n, reports)
    except _Problem as p:
        return p.rank, p.message
    return _traffic_problem(name, trial, n, reports)


def _nbytes(x) -> int:
    if x is None:
        return 0
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return x.numel() * x.element_size()


#: What each rank must at least send and receive in point-to-point calls, whatever the algorithm (relaying and
#: partial sums included): its own data has to leave it, and what its answer depends on has to reach it.
#: name -> (rank, n, root, report) -> (bytes it must send, bytes it must receive, why)
_NEEDS = {
    "broadcast": lambda r, n, root, rep: (0, 0 if r == root else _nbytes(rep["expected"]),
                                          "every rank other than src must receive the whole tensor"),
    "reduce": lambda r, n, root, rep: (0 if r == root else _nbytes(rep["after"]),
                                       _nbytes(rep["after"]) if r == root else 0,
                                       "every rank's data must leave it and reach dst (alone or summed)"),
    "all_reduce": lambda r, n, root, rep: (_nbytes(rep["after"]) * (n - 1) // n, _nbytes(rep["after"]) * (n - 1) // n,
                                           "every rank's result depends on every other rank's tensor"),
    "gather": lambda r, n, root, rep: (0 if r == root else _nbytes(rep["after"]),
                                       _nbytes(rep["after"]) * (n - 1) if r == root else 0,
                                       "dst must receive every other rank's tensor"),
    "all_gather": lambda r, n, root, rep: (_nbytes(rep["after"]), _nbytes(rep["after"]) * (n - 1),
                                           "every rank must receive every other rank's tensor"),
    "scatter": lambda r, n, root, rep: (_nbytes(rep["expected"]) * (n - 1) if r == root else 0,
                                        0 if r == root else _nbytes(rep["expected"]),
                                        "every rank other than src must receive its chunk"),
    "reduce_scatter": lambda r, n, root, rep: (_nbytes(rep["expected"]) * (n - 1), _nbytes(rep["expected"]),
                                               "every other rank's result needs this rank's chunk for it"),
    "all_to_all": lambda r, n, root, rep: (sum(_nbytes(c) for j, c in enumerate(rep["chunks"]) if j != r),
                                           sum(_nbytes(c) for j, c in enumerate(rep["expected"]) if j != r),
                                           "every chunk meant for another rank must travel to it"),
}


def _traffic_problem(name: str, trial: dict, n: int, reports: list):
    """(rank, message) when a rank got a right answer with less point-to-point traffic than the collective needs
    (its data moved another way: the rendezvous store, a collective the recording did not see), else None."""
    if n < 2:
        return None
    for r in range(n):
        comm = reports[r]["comm"]
        must_send, must_receive, why = _NEEDS[name](r, n, trial.get("root"), reports[r])
        for did, need, verb in ((comm.bytes_sent, must_send, "sent"), (comm.bytes_received, must_receive,
                                                                         "received")):
            if did < need:
                return r, (f"rank {r} {verb} {did} bytes in send/recv calls in {_describe_short(name, trial)}, "
                           f"but {name} needs at least {need}: {why}. The answer is right, so the data travelled "
                           "some other way; the exercise is to move it with point-to-point messages.")
    return None


def _describe_short(name: str, trial: dict) -> str:
    root = trial.get("root")
    return f"{name}(..., {root})" if root is not None and name in ("broadcast", "reduce", "gather", "scatter") \
        else f"{name}(...)"


def _probe(name: str, fn, trials: list) -> bool:
    """Runs on every rank. Per trial: run, share every rank's report, diagnose; the blamed rank raises."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    for trial in trials:
        reports = share(_RUN[name][0](fn, trial, rank, n))
        verdict = _verdict(name, trial, n, reports)
        if verdict is not None:
            blamed, message = verdict
            if rank == blamed:
                raise AssertionError(message)
            return False
    return True
