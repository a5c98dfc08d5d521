"""This course's reference implementations for 02_ring_allreduce (not shipped to students).

``benchmarks/ring.py`` measures ``reference_ring_all_reduce`` against ``dist.all_reduce``;
``check_alpha_beta_cost`` compares with ``reference_alpha_beta_cost``.
"""

from __future__ import annotations

import math


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
    """Alpha-beta cost of an all-reduce, reduction cost ignored. Recursive doubling for a power of two is quoted from
    Thakur, Rabenseifner & Gropp (2005); the other formulas are derived (see notebook 02, section 5)."""
    p, n = world_size, nbytes
    if algorithm == "naive":
        return 2 * (p - 1) * (alpha + n * beta)
    if algorithm == "ring":
        return 2 * (p - 1) * alpha + 2 * n * (p - 1) / p * beta
    if algorithm == "recursive_doubling":
        # log2 p exchanges when p is a power of two (Thakur et al.); otherwise MPICH folds the ranks beyond the
        # largest power of two into partners first and sends them the result at the end: floor(log2 p) + 2 steps
        q = int(p)
        exchanges = q.bit_length() - 1
        steps = exchanges if q & (q - 1) == 0 else exchanges + 2
        return steps * (alpha + n * beta)
    raise ValueError(f"unknown algorithm {algorithm!r}")
