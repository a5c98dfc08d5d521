"""autograder.checks.overlap's ring exercises with the student's function in the grading sandbox
(``labsupport._sandbox``): whether a transfer overlapped a product is measured by the host, as the sandbox's CPU time
between the transfer's post and its wait (``labsupport._sandbox.record()``), never read from the student's side.

Cheats, each written as a student would, lose the points: products on empty ``meta`` tensors between each post and
its wait (they cost no CPU) while the real result is computed with multiply-and-sum after the waits, and a function
that imports the grader's reference under a name built from character codes (the grader is not there). Honest
habits (a print to stderr, a printed traceback, a cached helper, ``import sys``) keep the points. No test reads a
duration: the check compares CPU seconds of its own record with those of one product it times itself.
"""

import functools

import pytest
import torch
import torch.distributed as dist

from autograder.checks import _common
from autograder.checks.overlap import check_allgather_matmul, check_matmul_reduce_scatter

pytestmark = pytest.mark.slow


@functools.lru_cache(maxsize=None)
def ring_of(rank, world):
    return (rank + 1) % world, (rank - 1) % world


def _peers(group, rank, world):
    nxt, prv = ring_of(rank, world)
    return (nxt, prv) if group is None else (dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv))


def agm_meta_products(x_shard, weight, group=None):
    """Shows a product of each chunk between post and wait, on meta tensors (no data, no work), and computes the
    real result once everything has arrived, with multiply-and-sum (which is no matrix product)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = _peers(group, rank, world)
    chunks, cur = [None] * world, x_shard
    for step in range(world):
        src = (rank - step) % world
        if step < world - 1:
            buf = torch.empty_like(x_shard)
            reqs = [dist.isend(cur, nxt, group=group), dist.irecv(buf, prv, group=group)]
        cur.to("meta") @ weight.to("meta").T
        chunks[src] = cur
        if step < world - 1:
            for r in reqs:
                r.wait()
            cur = buf
    x = torch.cat(chunks)
    return torch.cat([(x[i:i + 8, None, :] * weight[None]).sum(-1) for i in range(0, len(x), 8)])


def test_meta_products_under_the_transfers_fail(monkeypatch):
    monkeypatch.setattr(_common, "PROBE_TIMEOUT", 180.0)   # the multiply-and-sum is slow, not a deadlock
    with pytest.raises(AssertionError) as info:
        check_allgather_matmul(agm_meta_products)
    text = str(info.value)
    assert "had no product underneath it" in text and "ms of CPU" in text, text


def mrs_from_the_grader(x, weight_shard, group=None):
    """Imports the grader (its name spelled in character codes, which no screen reads)."""
    import importlib

    name = "".join(map(chr, [97, 117, 116, 111, 103, 114, 97, 100, 101, 114]))
    importlib.import_module(name + ".checks.overlap.reference")
    return mrs_with_habits(x, weight_shard, group)


def test_importing_the_grader_fails(grader_out_of_reach):
    with pytest.raises(AssertionError) as info:
        check_matmul_reduce_scatter(mrs_from_the_grader)
    text = str(info.value)
    assert "the grader's modules are not available where your function runs" in text, text


def mrs_with_habits(x, weight_shard, group=None):
    import sys
    import traceback

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = _peers(group, rank, world)
    print(f"rank {rank} of {world}", file=sys.stderr)
    try:
        raise ValueError("a debugging leftover")
    except ValueError:
        traceback.print_exc()
    chunks = x.chunk(world)
    acc = chunks[(rank - 1) % world] @ weight_shard.T
    for step in range(1, world):
        buf = torch.empty_like(acc)
        reqs = [dist.isend(acc, nxt, group=group), dist.irecv(buf, prv, group=group)]
        part = chunks[(rank - 1 - step) % world] @ weight_shard.T
        for r in reqs:
            r.wait()
        acc = buf + part
    return acc


def test_honest_habits_are_accepted():
    check_matmul_reduce_scatter(mrs_with_habits)
