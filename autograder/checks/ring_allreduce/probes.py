"""What runs on every rank: the student's collective on every case, inside a guarded ``CommCounter``, compared
with the sum over ranks computed in one process."""

from __future__ import annotations

import itertools
import math

from .._common import expect_tensor, short
from .diagnose import _check_needed, _check_bytes, _close, _describe, _guarded_counter, _why_wrong_sum
from .trials import _make


def _probe_reduce_scatter(fn, seed, cases):
    import torch
    import torch.distributed as dist

    n, r = dist.get_world_size(), dist.get_rank()
    for i, (shape, dt) in enumerate(cases):
        inputs = [_make(seed, i, q, shape, dt) for q in range(n)]
        numel = inputs[0].numel()
        parts = [x.flatten().tensor_split(n) for x in inputs]  # parts[q][j]: rank q's chunk j
        expected = [sum(parts[q][j] for q in range(n)) for j in range(n)]
        desc = _describe(shape, dt, seed)
        with _guarded_counter("ring_reduce_scatter") as cc:
            got = fn(inputs[r].clone())
        mine = [p[r] for p in parts]
        others = [(f"the summed chunk {j}, but rank {r} must return chunk {r} (chunk index = rank)", expected[j])
                  for j in range(n) if j != r and expected[j].shape == expected[r].shape]
        if not isinstance(got, torch.Tensor):
            raise AssertionError(
                f"ring_reduce_scatter returned {type(got).__name__} on rank {r} ({desc}): return the reduced "
                "chunk as a tensor."
            )
        if tuple(got.shape) != tuple(expected[r].shape):
            same = [j for j in range(n) if j != r and expected[j].shape == got.shape and got.dtype == expected[j].dtype
                    and _close(got, expected[j], dt)]
            hint = (f" It equals the summed chunk {same[0]}, but rank {r} must return chunk {r} (chunk index = rank)."
                    if same else "")
            raise AssertionError(
                f"ring_reduce_scatter returned shape {tuple(got.shape)} on rank {r} ({desc}), expected "
                f"{tuple(expected[r].shape)}: chunk {r} of tensor.flatten().tensor_split({n}) (with numel={numel}, "
                f"the first {numel % n} chunk(s) have {numel // n + 1} element(s) and the others {numel // n})."
                + hint
            )
        if got.dtype != expected[r].dtype:
            expect_tensor(got, expected[r], f"ring_reduce_scatter on rank {r} ({desc})",
                          "Return the chunk in the input's dtype (sums of int64 stay int64).")
        if not _close(got, expected[r], dt):
            hint = _why_wrong_sum(got, mine, dt, chunk_names=others)
            if "own data" in hint:
                hint += (
                    " If your ring completes a different chunk, shift the indices: in step s (0-based) send chunk "
                    "(rank - s - 1) % N and receive-and-add chunk (rank - s - 2) % N, so that the last chunk "
                    "completed is chunk rank."
                )
            expect_tensor(
                got, expected[r], f"ring_reduce_scatter on rank {r} ({desc})", hint
            )
        itemsize = inputs[0].element_size()
        bound = (n - 1) * math.ceil(numel / n) * itemsize
        _check_bytes(cc.summary, "ring_reduce_scatter", n, bound, "(world_size - 1) * ceil(numel / world_size) * itemsize",
                     desc)
        _check_needed(cc.summary, "ring_reduce_scatter", (n - 1) * (numel // n) * itemsize,
                      "its chunk is summed from every rank's, and a ring brings it the others' chunk once per step", desc)
    return True


def _probe_all_gather(fn, seed, cases):
    import torch
    import torch.distributed as dist

    n, r = dist.get_world_size(), dist.get_rank()
    for i, (shape, dt) in enumerate(cases):
        chunks = [_make(seed, i, q, shape, dt) for q in range(n)]
        desc = _describe(shape, dt, seed)
        with _guarded_counter("ring_all_gather") as cc:
            got = fn(chunks[r].clone())
        if not isinstance(got, (list, tuple)):
            raise AssertionError(
                f"ring_all_gather returned {type(got).__name__} on rank {r} ({desc}): return a list with one "
                "tensor per rank, in rank order."
            )
        if len(got) != n:
            raise AssertionError(
                f"ring_all_gather returned a list of {len(got)} items on rank {r} ({desc}), expected "
                f"world_size = {n} (one chunk per rank, its own included)."
            )
        for j, item in enumerate(got):
            if isinstance(item, torch.Tensor) and item.dtype != chunks[j].dtype:
                # say so before comparing values: a cast can round them into looking like nobody's chunk
                expect_tensor(item, chunks[j], f"ring_all_gather on rank {r}, item {j} ({desc})")
            if isinstance(item, torch.Tensor) and not _close(item.to(chunks[j].dtype), chunks[j], dt):
                match = [q for q in range(n) if _close(item.to(chunks[q].dtype), chunks[q], dt)]
                if match:
                    hint = (f"It holds rank {match[0]}'s chunk: item i of the list must be rank i's chunk. "
                            "Check which index each received chunk is stored at.")
                else:
                    hint = "It is nobody's chunk: was a buffer overwritten before it was sent on, or reused?"
                raise AssertionError(
                    f"ring_all_gather on rank {r} ({desc}): item {j} is wrong. {hint} "
                    f"Got {short(item)}, expected {short(chunks[j])}."
                )
            expect_tensor(item, chunks[j], f"ring_all_gather on rank {r}, item {j} ({desc})")
        bound = (n - 1) * chunks[0].numel() * chunks[0].element_size()
        _check_bytes(cc.summary, "ring_all_gather", n, bound, "(world_size - 1) * chunk.numel() * itemsize", desc)
        _check_needed(cc.summary, "ring_all_gather", bound, "every other rank's chunk has to reach it", desc)
    return True


def _probe_all_reduce(fn, seed, cases):
    import torch.distributed as dist

    n, r = dist.get_world_size(), dist.get_rank()
    for i, (shape, dt) in enumerate(cases):
        inputs = [_make(seed, i, q, shape, dt) for q in range(n)]
        numel = inputs[0].numel()
        expected = sum(inputs[1:], inputs[0].clone())
        desc = _describe(shape, dt, seed)
        x = inputs[r].clone()
        with _guarded_counter("ring_all_reduce") as cc:
            fn(x)
        if tuple(x.shape) != tuple(shape) or x.dtype != expected.dtype:
            raise AssertionError(
                f"ring_all_reduce changed the tensor's shape or dtype on rank {r} ({desc}): it must sum in place."
            )
        if not _close(x, expected, dt):
            flat, exp_flat = x.reshape(-1), expected.reshape(-1)
            bounds = [0] + list(itertools.accumulate(c.numel() for c in exp_flat.tensor_split(n)))
            for j in range(n):
                lo, hi = bounds[j], bounds[j + 1]
                if not _close(flat[lo:hi], exp_flat[lo:hi], dt):
                    break
            rows = [inp.reshape(-1)[lo:hi] for inp in inputs]
            hint = _why_wrong_sum(flat[lo:hi], rows, dt)
            tail = numel - numel % n  # elements before the remainder
            if numel % n and _close(flat[:tail], exp_flat[:tail], dt):
                hint = (
                    f"Only the last {numel % n} element(s) (numel % world_size) are wrong: when numel is not "
                    "divisible by world_size the remainder must be reduced too (tensor_split gives the first "
                    "numel % world_size chunks one extra element; or pad to a multiple of world_size). " + hint
                )
            raise AssertionError(
                f"ring_all_reduce gave a wrong sum on rank {r} ({desc}): elements {lo}..{hi - 1} (chunk {j} of "
                f"tensor.flatten().tensor_split({n})) are wrong. {hint} Got {short(flat[lo:hi])}, expected "
                f"{short(exp_flat[lo:hi])}."
            )
        bound = 2 * (n - 1) * math.ceil(numel / n) * inputs[0].element_size()
        _check_bytes(cc.summary, "ring_all_reduce", n, bound,
                     "2 * (world_size - 1) * ceil(numel / world_size) * itemsize", desc)
        _check_needed(cc.summary, "ring_all_reduce", 2 * (n - 1) * (numel // n) * inputs[0].element_size(),
                      "a ring brings it the others' partial sums and then the finished chunks, one per step", desc)
    return True
