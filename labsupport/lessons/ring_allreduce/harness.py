"""Timing on workers for notebook 02. Call these inside ``labsupport.run``; the all-reduce to time is passed in.

Every time is the fastest of ``reps`` runs (other programs on the machine only ever add time), and a collective is
timed by its slowest rank (it is over when the last rank is done).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

__all__ = ["timed", "ping_pong_times", "p2p_bandwidth", "bandwidth_sweep", "scaling_point"]


def timed(fn, x, reps: int) -> float:
    """On every rank: the fastest of ``reps`` calls of ``fn(x)``, each timed by its slowest rank (seconds).
    ``x`` is restored before every call, so an in-place all-reduce sums the same values each time."""
    original, samples = x.clone(), []
    for _ in range(reps):
        x.copy_(original)
        dist.barrier()
        start = time.perf_counter()
        fn(x)
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        samples.append(elapsed.item())
    return min(samples)


def ping_pong_times(sizes, reps: int) -> list:
    """On 2 ranks: the one-way time of a message of each size in bytes (half the fastest round trip)."""
    out = []
    for nbytes in sizes:
        x, samples = torch.empty(max(1, nbytes // 4)), []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            if dist.get_rank() == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
            samples.append((time.perf_counter() - start) / 2)
        out.append(min(samples))
    return out


def p2p_bandwidth(nbytes: int, reps: int) -> float:
    """On 2 ranks: bytes per second of a blocking send from rank 0 to rank 1 (a tiny reply marks its end)."""
    x, samples = torch.ones(nbytes // 4), []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(x, 1)
            dist.recv(x[:1], 1)
        else:
            dist.recv(x, 0)
            dist.send(x[:1], 0)
        samples.append(time.perf_counter() - start)
    return nbytes / min(samples)


def bandwidth_sweep(sizes, reps: int, ring=None) -> dict:
    """On every rank: ``{name: [seconds per size]}`` for ``dist.all_reduce`` and, if given, your ``ring``."""
    out = {"your ring": [], "dist.all_reduce": []} if ring is not None else {"dist.all_reduce": []}
    for nbytes in sizes:
        x = torch.randn(nbytes // 4)
        if ring is not None:
            out["your ring"].append(timed(ring, x, reps))
        out["dist.all_reduce"].append(timed(dist.all_reduce, x, reps))
    return out


def scaling_point(numel: int, reps: int, ring=None) -> tuple:
    """On every rank: the time of your ``ring`` (None if not given) and of ``dist.all_reduce`` on ``numel``
    floats."""
    x = torch.randn(numel)
    return (timed(ring, x, reps) if ring is not None else None), timed(dist.all_reduce, x, reps)
