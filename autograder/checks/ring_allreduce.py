"""Checks for 02_ring_allreduce, and the reference ring the benchmark measures.

Exercises checked here: ``ring_reduce_scatter(tensor)``, ``ring_all_gather(chunk)``, ``ring_all_reduce(tensor)``
and ``alpha_beta_cost(algorithm, world_size, nbytes, alpha, beta)``.

Each collective check runs the student's function on 1, 2, 3, 4 and 5 ranks with inputs drawn at grading time
(several numels, including fewer elements than ranks and numels not divisible by the world size; float32, float64,
int64; 0-d to 3-d shapes, every numel in two multi-dimensional shapes and one flat one), compares with the sum over
ranks computed in one process (what ``dist.all_reduce`` / ``dist.reduce_scatter`` return), and checks how the result
was obtained with ``CommCounter``: point-to-point calls only, only with the two ring neighbours, and no more bytes
than a ring needs.

The ``reference_*`` functions are this course's reference implementations (not shipped to students);
``benchmarks/ring.py`` measures ``reference_ring_all_reduce`` against ``dist.all_reduce``.
"""

from __future__ import annotations

import itertools
import math
import random

from ._common import close, draw_seed, expect_tensor, only_point_to_point, run_on_workers, short, tolerance

__all__ = [
    "check_ring_reduce_scatter",
    "check_ring_all_gather",
    "check_ring_all_reduce",
    "check_alpha_beta_cost",
    "reference_ring_reduce_scatter",
    "reference_ring_all_gather",
    "reference_ring_all_reduce",
    "reference_alpha_beta_cost",
    "WORLD_SIZES",
]

#: World sizes every collective check runs on, in this order (the first failing one stops the check).
WORLD_SIZES = (1, 2, 3, 4, 5)


# ----------------------------------------------------------------------------------------------------------------
# Reference implementations


def _ring_exchange(send, recv, right, left):
    """Send ``send`` to ``right`` while receiving ``recv`` from ``left``; both posted before either is awaited."""
    import torch.distributed as dist

    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)])
    for req in reqs:
        req.wait()


def reference_ring_reduce_scatter(tensor):
    """Chunk ``rank`` of ``tensor.flatten().tensor_split(world_size)``, summed over ranks (``tensor`` is scratch)."""
    import torch
    import torch.distributed as dist

    n, r = dist.get_world_size(), dist.get_rank()
    chunks = tensor.reshape(-1).tensor_split(n)
    right, left = (r + 1) % n, (r - 1) % n
    buf = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send, recv = chunks[(r - step - 1) % n], chunks[(r - step - 2) % n]
        incoming = buf[: recv.numel()]
        _ring_exchange(send, incoming, right, left)
        recv += incoming
    return chunks[r]


def reference_ring_all_gather(chunk):
    """Every rank's ``chunk`` (all the same shape), in rank order."""
    import torch
    import torch.distributed as dist

    n, r = dist.get_world_size(), dist.get_rank()
    out = [torch.empty_like(chunk) for _ in range(n)]
    out[r].copy_(chunk)
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        _ring_exchange(out[(r - step) % n], out[(r - step - 1) % n], right, left)
    return out


# Receive buffers kept between calls of reference_ring_all_reduce (allocating fresh memory each call costs page
# faults that are comparable to the copy itself at tens of MiB).
_BUFFERS: dict = {}


def _buffer(numel, dtype, device, slot):
    import torch

    key = (dtype, str(device), slot)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        buf = _BUFFERS[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def reference_ring_all_reduce(tensor, rs_segments: int | None = None, ag_segments: int | None = None):
    """Sum ``tensor`` over ranks in place with a ring: reduce-scatter then all-gather, neighbours only.

    Tuned for gloo on CPU (see ``benchmarks/ring.py``):

    * chunks are contiguous views of the tensor, so nothing is copied except by the transport;
    * every receive of a phase is posted up front, into receive buffers kept between calls (fresh memory for
      tens of MiB costs page faults comparable to the copy itself), so data keeps flowing round the ring while a
      rank adds;
    * both phases cut each chunk into pieces and handle a piece as soon as it has arrived: the reduce-scatter adds
      one piece while the next is still arriving (``rs_segments``, default 2 from 1 MiB chunks up), the all-gather
      forwards a piece while the next is arriving, so its hops overlap instead of following one another
      (``ag_segments``, default 2 from 3 ranks and 1 MiB chunks up, 4 from 4 ranks and 2 MiB chunks up). Smaller
      chunks stay whole: there, the cost of a message weighs more than the overlap gains;
    * messages go straight to the process group's ``send``/``recv`` (what ``dist.isend``/``dist.irecv`` call
      after their argument checks), which saves about 15 us of Python per message: with 4 ranks on 2 cores,
      every microsecond of CPU one rank spends is one the others wait for. ``CommCounter`` still sees them.
    """
    import torch.distributed as dist

    n, r = dist.get_world_size(), dist.get_rank()
    if n == 1:
        return tensor
    pg = dist.group.WORLD
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.flatten()
    chunks = flat.tensor_split(n)
    right, left = (r + 1) % n, (r - 1) % n
    biggest = chunks[0].numel()
    chunk_bytes = biggest * flat.element_size()
    if rs_segments is None:
        rs_segments = 2 if chunk_bytes >= 1 << 20 else 1
    if ag_segments is None:
        ag_segments = 1 if n == 2 or chunk_bytes < 1 << 20 else 4 if n >= 4 and chunk_bytes >= 2 << 20 else 2

    # reduce-scatter: in step s the piece that arrives is added into chunk (r - s - 2), then forwarded
    targets = [chunks[(r - s - 2) % n].tensor_split(rs_segments) for s in range(n - 1)]
    incoming = [
        _buffer(biggest, flat.dtype, flat.device, s)[: chunks[(r - s - 2) % n].numel()].tensor_split(rs_segments)
        for s in range(n - 1)
    ]
    recvs = [[pg.recv([piece], left, 0) for piece in step] for step in incoming]
    sends = [pg.send([piece], right, 0) for piece in chunks[(r - 1) % n].tensor_split(rs_segments)]
    for s in range(n - 1):
        for k in range(rs_segments):
            recvs[s][k].wait()
            targets[s][k].add_(incoming[s][k])
            if s < n - 2:
                sends.append(pg.send([targets[s][k]], right, 0))

    # all-gather: in step s chunk (r - s - 1) arrives straight into place, piece by piece, and is forwarded
    gathered = [chunks[(r - s - 1) % n].tensor_split(ag_segments) for s in range(n - 1)]
    recvs = [[pg.recv([piece], left, 0) for piece in step] for step in gathered]
    sends += [pg.send([piece], right, 0) for piece in chunks[r].tensor_split(ag_segments)]
    for s in range(n - 1):
        for k, piece in enumerate(gathered[s]):
            recvs[s][k].wait()
            if s < n - 2:
                sends.append(pg.send([piece], right, 0))
    for req in sends:
        req.wait()
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


def reference_alpha_beta_cost(algorithm, world_size, nbytes, alpha, beta):
    """Alpha-beta cost of an all-reduce (Thakur, Rabenseifner & Gropp 2005; reduction cost ignored)."""
    p, n = world_size, nbytes
    if algorithm == "naive":
        return 2 * (p - 1) * (alpha + n * beta)
    if algorithm == "ring":
        return 2 * (p - 1) * alpha + 2 * n * (p - 1) / p * beta
    if algorithm == "recursive_doubling":
        return math.ceil(math.log2(p)) * (alpha + n * beta)
    raise ValueError(f"unknown algorithm {algorithm!r}")


# ----------------------------------------------------------------------------------------------------------------
# Inputs drawn at grading time


_DTYPES = ("float32", "float64", "int64")


def _prime_factors(numel: int) -> list:
    factors, d = [], 2
    while d * d <= numel:
        while numel % d == 0:
            factors.append(d)
            numel //= d
        d += 1
    return factors + ([numel] if numel > 1 else [])


def _multi_dim_shape(numel: int, rng: random.Random) -> tuple:
    """A 2-d or 3-d shape of ``numel`` elements. A composite numel has its prime factors dealt at random over the
    dimensions, at least one each (1000 may give (8, 125), (10, 4, 25), ...; 4 gives (2, 2)); 1 and primes,
    which have no such factorisation, stand between ones ((1, p, 1), (p, 1), ...)."""
    factors = _prime_factors(numel)
    if len(factors) < 2:
        dims = [1] * rng.choice([2, 3])
        dims[rng.randrange(len(dims))] = numel
        return tuple(dims)
    rng.shuffle(factors)
    ndim = rng.choice([2, 3]) if len(factors) >= 3 else 2
    dims = factors[:ndim]
    for f in factors[ndim:]:
        dims[rng.randrange(ndim)] *= f
    return tuple(dims)


def _flat_shape(numel: int, rng: random.Random) -> tuple:
    """The shapes a flat tensor comes in: (numel,), (1, numel), and for one element also 0-d."""
    return rng.choice([(numel,), (1, numel)] + ([()] if numel == 1 else []))


def _cases(seed: int, world_size: int) -> list:
    """(shape, dtype name) pairs for one world size: every numel in {1, N-1, 1000, 2^16+3} with every dtype.

    Of a numel's three cases, two get a multi-dimensional shape (``_multi_dim_shape``, each drawn anew) and one a
    flat shape; which dtype gets which is drawn too.
    """
    rng = random.Random(seed * 31 + world_size)
    numels = [1, world_size - 1, 1000, 2**16 + 3]
    cases = []
    for m in numels:
        if m < 1:
            continue
        shapes = [_multi_dim_shape(m, rng), _multi_dim_shape(m, rng), _flat_shape(m, rng)]
        rng.shuffle(shapes)
        cases += list(zip(shapes, _DTYPES))
    rng.shuffle(cases)
    return cases


def _make(seed: int, case: int, rank: int, shape, dtype_name: str):
    import torch

    g = torch.Generator().manual_seed((seed * 1_000_003 + case * 101 + rank) % (2**63))
    dtype = getattr(torch, dtype_name)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    # Integers carry their rank in the low five bits (2**rank, up to five ranks): a sum over any set of ranks
    # then shows which ranks it holds, so a partial sum can never pass for another one by chance.
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype) * 32 + (1 << rank) % 32


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


# ----------------------------------------------------------------------------------------------------------------
# Probes (run on every rank)


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
    return True


# ----------------------------------------------------------------------------------------------------------------
# The checks


_DEADLOCK_HINT = (
    " In a ring every rank sends to its right neighbour at the same moment; a blocking dist.send waits until the "
    "receiver posts its recv, so if every rank sends first, all of them wait forever. Post the send and the "
    "receive together (dist.isend + dist.irecv, or dist.batch_isend_irecv) and then wait on both."
)


_SIZE_MISMATCH_HINT = (
    " With gloo this usually means a message arrived whose size differs from the buffer posted to receive it: "
    "at every step, the chunk a rank sends must have the same number of elements as the buffer its right "
    "neighbour receives into (check the chunk indices on both sides; with tensor_split, chunks can differ in "
    "size by one element)."
)


def _run_all(probe, fn, what, world_sizes, timeout):
    if not callable(fn):
        raise AssertionError(f"{what} should be a function, got {type(fn).__name__}.")
    seed = draw_seed()
    for n in world_sizes:
        cases = _cases(seed, n)
        try:
            run_on_workers(probe, fn, seed, cases, world_size=n, what=what, timeout=timeout, backend="gloo")
        except AssertionError as exc:
            msg = str(exc)
            if "deadlocked" in msg:
                msg += _DEADLOCK_HINT
            elif "SIGABRT" in msg:
                msg += _SIZE_MISMATCH_HINT
            raise AssertionError(msg) from None


def check_ring_reduce_scatter(ring_reduce_scatter, *, world_sizes=WORLD_SIZES, timeout=None):
    """``ring_reduce_scatter(tensor)`` returns chunk ``rank`` of ``tensor.flatten().tensor_split(world_size)``
    summed over ranks, using only sends/recvs with ring neighbours and at most (N-1) chunks of bytes per rank."""
    _run_all(_probe_reduce_scatter, ring_reduce_scatter, "ring_reduce_scatter", world_sizes, timeout)


def check_ring_all_gather(ring_all_gather, *, world_sizes=WORLD_SIZES, timeout=None):
    """``ring_all_gather(chunk)`` returns every rank's chunk in rank order, ring neighbours only."""
    _run_all(_probe_all_gather, ring_all_gather, "ring_all_gather", world_sizes, timeout)


def check_ring_all_reduce(ring_all_reduce, *, world_sizes=WORLD_SIZES, timeout=None):
    """``ring_all_reduce(tensor)`` sums in place over ranks, ring neighbours only, at most 2(N-1) chunks sent."""
    _run_all(_probe_all_reduce, ring_all_reduce, "ring_all_reduce", world_sizes, timeout)


_TERMS = {
    "ring": ("2(p-1)·alpha + 2n(p-1)/p·beta",
             "latency: reduce-scatter and all-gather take p-1 steps each, one alpha per step",
             "bandwidth: 2(p-1) steps, each moving one chunk of n/p bytes"),
    "naive": ("2(p-1)·(alpha + n·beta)",
              "latency: the root receives p-1 messages one after another, then sends p-1",
              "bandwidth: each of the 2(p-1) messages through the root carries all n bytes"),
    "recursive_doubling": ("ceil(log2 p)·(alpha + n·beta)",
                           "latency: ceil(log2 p) steps (round up, e.g. math.ceil(math.log2(p)))",
                           "bandwidth: every step exchanges the whole n bytes"),
}


def check_alpha_beta_cost(alpha_beta_cost, *, trials: int = 40):
    """``alpha_beta_cost`` matches the formulas on chosen and random inputs; unknown names raise ValueError."""
    if not callable(alpha_beta_cost):
        raise AssertionError(f"alpha_beta_cost should be a function, got {type(alpha_beta_cost).__name__}.")
    seed = draw_seed()
    rng = random.Random(seed)
    cases = []
    for alg in ("ring", "naive", "recursive_doubling"):
        cases += [(alg, 4, 1000, 1.0, 0.0, 1), (alg, 4, 1000, 0.0, 1.0, 2), (alg, 6, 3000, 1.0, 0.0, 1),
                  (alg, 6, 3000, 0.0, 1.0, 2), (alg, 1, 1000, 1.0, 1.0, 0)]
    for _ in range(trials):
        cases.append((rng.choice(list(_TERMS)), rng.randint(1, 1024), rng.randint(1, 2**30),
                      10 ** rng.uniform(-7, -3), 10 ** rng.uniform(-12, -8), None))
    for alg, p, n, a, b, term in cases:
        call = f"alpha_beta_cost({alg!r}, world_size={p}, nbytes={n}, alpha={a:.3g}, beta={b:.3g})"
        try:
            got = alpha_beta_cost(alg, p, n, a, b)
        except NotImplementedError:
            raise AssertionError("alpha_beta_cost is not implemented yet (it raised NotImplementedError).") from None
        except Exception as exc:
            raise AssertionError(f"{call} raised {type(exc).__name__}: {exc}") from None
        expected = reference_alpha_beta_cost(alg, p, n, a, b)
        try:
            value = float(got)
        except (TypeError, ValueError):
            raise AssertionError(f"{call} returned {short(got)}, expected a number ({expected:.6g}).") from None
        if not math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-15):
            formula, lat, bw = _TERMS[alg]
            if term == 0:
                why = "with one rank there is nothing to communicate, so the cost is 0."
            elif term == 1:
                why = f"with beta=0 only the latency term counts: {lat}."
            elif term == 2:
                why = f"with alpha=0 only the bandwidth term counts: {bw}."
            else:
                why = f"({lat}; {bw}.)"
            raise AssertionError(
                f"{call} returned {value:.6g}, expected {expected:.6g} = {formula}: {why} (seed {seed})"
            )
    for bad in ("bogus", "Ring", "tree"):
        try:
            got = alpha_beta_cost(bad, 4, 1000, 1e-5, 1e-9)
        except ValueError:
            continue
        except Exception as exc:
            raise AssertionError(
                f"alpha_beta_cost({bad!r}, ...) raised {type(exc).__name__}; raise ValueError for an unknown "
                "algorithm name."
            ) from None
        raise AssertionError(
            f"alpha_beta_cost({bad!r}, ...) returned {short(got)}; it should raise ValueError for an unknown "
            "algorithm name (known: 'naive', 'ring', 'recursive_doubling')."
        )
