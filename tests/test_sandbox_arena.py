"""labsupport._arena: large tensors cross between a grading host and its sandbox through memory the two share.

The arena's own rules first (places checked against its bounds, pages given back but those in flight), then on real
gloo workers: every kind of call with tensors large enough to take the arena gives what the small ones give, the
link carries only a fraction of their bytes, a request in flight keeps its place across a driver's barrier, and the
sandbox's memory as the host reads it holds no transfer that is over.
"""

from __future__ import annotations

import mmap

import pytest
import torch
import torch.distributed as dist

import labsupport
from labsupport._arena import SMALL, Arena
from labsupport._sandbox import sandboxed

BIG = 1 << 16  # float32 elements: 256 KiB, far above what travels in a message


def test_a_place_outside_the_arena_is_refused():
    arena = Arena(1 << 20)
    assert arena.view(64, torch.float32, (4,)).shape == (4,)
    for offset in (-64, (1 << 20) - 8, 3, "0"):
        with pytest.raises(ValueError, match="shared arena"):
            arena.view(offset, torch.float32, (4,))


def test_small_tensors_stay_in_the_message_and_large_ones_take_room():
    arena = Arena(1 << 20)
    assert arena.take(SMALL - 1) is None
    first, second = arena.take(SMALL), arena.take(SMALL + 1)
    assert first == 0 and second >= SMALL and second % 64 == 0
    assert arena.take(1 << 20) is None  # no room left: the message carries it
    arena.begin()
    arena.end()
    assert arena.take(SMALL) == 0  # nothing in flight: all of it is free again


@pytest.mark.skipif(not hasattr(mmap, "MADV_REMOVE"), reason="pages are given back with MADV_REMOVE (Linux)")
def test_trim_gives_back_every_page_but_those_in_flight():
    page = mmap.PAGESIZE
    arena = Arena(16 * page)
    arena.base[: 8 * page].fill_(7)
    arena.trim(8 * page, keep=[(2 * page + 10, 3 * page + 10)])  # in flight: parts of pages 2 and 3
    pages = arena.base[: 8 * page].view(8, page)
    assert pages[2:4].eq(7).all()
    assert pages[:2].eq(0).all() and pages[4:].eq(0).all()


def every_kind(tensor):
    """Each call with a large tensor: their results, as plain tensors."""
    n, r = dist.get_world_size(), dist.get_rank()
    x = torch.arange(BIG, dtype=torch.float32) + r
    summed = x.clone()
    dist.all_reduce(summed)
    root = x.clone()
    dist.broadcast(root, src=1)
    listed = [torch.empty(BIG) for _ in range(n)]
    dist.all_gather(listed, x)
    flat = torch.empty(BIG * n)
    dist.all_gather_into_tensor(flat, x)
    mine = torch.empty(BIG // n)
    dist.reduce_scatter_tensor(mine, x)
    swapped = torch.empty(BIG)
    dist.all_to_all_single(swapped, x)
    came = torch.empty(BIG)
    sent = dist.isend(x, (r + 1) % n)
    dist.recv(came, (r - 1) % n)
    sent.wait()
    return summed, root, torch.stack(listed), flat, mine, swapped, came


def measured(fn):
    from labsupport import _sandbox

    fn(None)  # the sandbox starts at its first call
    before = _sandbox.io()
    out = fn(None)
    after = _sandbox.io()
    return out, None if before is None else after["rchar"] - before["rchar"]


@pytest.mark.slow
@pytest.mark.parametrize("arena", [True, False])
def test_large_tensors_cross_through_the_arena_with_the_same_results(arena):
    """With ``arena=False`` (a check that reads the sandbox's memory inside its requests) they cross in the link's
    messages: the same results, and the sandbox reads them all from its link."""
    n = 2
    x = [torch.arange(BIG, dtype=torch.float32) + r for r in range(n)]
    fn = sandboxed(every_kind, "every_kind", arena=arena)
    for r, (out, read) in enumerate(labsupport.run(measured, fn, world_size=n)):
        summed, root, listed, flat, mine, swapped, came = out
        torch.testing.assert_close(summed, x[0] + x[1])
        torch.testing.assert_close(root, x[1])
        torch.testing.assert_close(listed, torch.stack(x))
        torch.testing.assert_close(flat, torch.cat(x))
        torch.testing.assert_close(mine, (x[0] + x[1]).chunk(n)[r])
        torch.testing.assert_close(swapped, torch.cat([x[0].chunk(n)[r], x[1].chunk(n)[r]]))
        torch.testing.assert_close(came, x[(r - 1) % n])
        # what the sandbox read from its link: the answers' places and its results, not the transfers' bytes
        # (about 4 MiB came back to it over the seven calls)
        crossing = 4 * BIG * (1 + 1 + n + n + 1 / n + 1 + 1)
        if read is not None:
            assert (read < crossing / 2) if arena else (read > crossing), (read, crossing)


def in_flight_across_a_barrier(tensor):
    n, r = dist.get_world_size(), dist.get_rank()
    x = torch.full((BIG,), float(r + 1))
    work = dist.all_reduce(x, async_op=True)
    came = torch.empty(BIG)
    posted = [dist.isend(torch.full((BIG,), float(10 * r)), (r + 1) % n), dist.irecv(came, (r - 1) % n)]
    dist.barrier()  # a driver's mark: the host gives back the arena's pages there, but those in flight
    work.wait()
    for p in posted:
        p.wait()
    return x, came


def call(fn):
    return fn(None)


@pytest.mark.slow
def test_a_request_in_flight_keeps_its_place_across_a_barrier():
    fn = sandboxed(in_flight_across_a_barrier, "in_flight")
    for r, (x, came) in enumerate(labsupport.run(call, fn, world_size=2)):
        assert x.eq(3.0).all(), x[:4]
        assert came.eq(10.0 * ((r - 1) % 2)).all(), came[:4]


def moves_a_large_tensor(mib):
    t = torch.ones(mib * 2**18)
    for _ in range(3):
        dist.all_reduce(t)
    return float(t[0])


def memory_after(fn, mib):
    from labsupport import _sandbox

    fn(1)  # the sandbox starts at its first call
    before = _sandbox.memory()
    value = fn(mib)
    return value, before, _sandbox.memory()


@pytest.mark.slow
def test_a_transfer_that_is_over_is_not_counted_as_the_sandboxs_memory():
    for value, before, after in labsupport.run(memory_after, sandboxed(moves_a_large_tensor, "moves"), 64,
                                               world_size=2):
        assert value == 8.0
        assert after["data"] - before["data"] < 16 * 2**20, (before, after)
