"""Context parallelism for notebook 08: ring attention on real ranks, and what it sends next to Ulysses.

Every rank holds one block of ``S/P`` consecutive positions of q, k and v, ``(B, S/P, H, D)``. Its queries stay
put; the k/v blocks travel round the ring (rank r sends to r + 1 and receives from r − 1, the transfer of the next
block running while the current one is computed), so after ``P`` steps every query block has met every k/v block.
The partial results are folded together with an online softmax: a running maximum ``m``, a running sum ``l`` of
``exp(score − m)`` and a running ``exp(score − m) @ v``, rescaled by ``exp(m_old − m_new)`` whenever the maximum
grows. No rank ever holds the whole sequence's k/v, nor more than a ``(S/P) × (S/P)`` block of scores per head.
The idea is Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context"
(arXiv 2310.01889); the online softmax is Milakov & Gimelshein 2018 (arXiv 1805.02867), as in FlashAttention.

Run ``ring_attention_on_ranks`` with ``labsupport.run``; ``full_attention`` is the one-process oracle::

    ranks = labsupport.run(lesson.ring_attention_on_ranks, q, k, v, True, world_size=4)
    out = torch.cat([r["out"] for r in ranks], dim=1)          # compare with lesson.full_attention(q, k, v, True)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["full_attention", "online_softmax_update", "ring_attention", "ring_attention_on_ranks",
           "attention_comm_bytes"]


def full_attention(q, k, v, causal: bool = False):
    """(B, S, H, D) each → (B, S, H, D): attention over the whole sequence in one process (PyTorch's
    ``scaled_dot_product_attention``), the oracle the ring is compared with."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def online_softmax_update(state, scores, v):
    """Fold one block into the running softmax. ``state`` is ``(m, l, acc)``: the running maximum of each query's
    scores ``(B, H, Lq, 1)``, the running sum of ``exp(score − m)`` (same shape) and the running
    ``exp(score − m) @ v`` ``(B, H, Lq, D)``; ``scores`` ``(B, H, Lq, Lk)`` (−inf where masked), ``v``
    ``(B, H, Lk, D)``. Returns the new state; the attention output is ``acc / l`` once every block is in."""
    m, l, acc = state
    m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
    shrink = torch.exp(m - m_new)            # the old terms were exponentiated against a smaller maximum
    p = torch.exp(scores - m_new)            # (B, H, Lq, Lk); exactly 0 where masked
    return m_new, l * shrink + p.sum(-1, keepdim=True), acc * shrink + p @ v


def ring_attention(q, k, v, causal: bool = False, update=online_softmax_update, log: list | None = None):
    """On every rank of the default group: this rank's block ``(B, S/P, H, D)`` of q, k, v (positions
    ``rank·S/P`` to ``(rank+1)·S/P − 1``) → its block of the attention output, the same shape.

    The k/v blocks go round the ring with ``isend``/``irecv``, one message of k and v together per step,
    ``P − 1`` steps. ``causal=True``: query i sees keys ≤ i, so a block from a later rank is skipped (it is all
    masked) and the rank's own block is masked to its lower triangle. ``update`` folds a block of scores into the
    state (the planted-bug tests pass wrong ones). ``log``, if given, gets one ``(block, used)`` per step: whose
    k/v block this rank held and whether it computed with it.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))              # (B, H, L, D): heads are independent
    L = q.shape[2]
    q = q * (1.0 / math.sqrt(q.shape[-1]))
    m = torch.full((*q.shape[:-1], 1), -math.inf, dtype=q.dtype)  # (B, H, L, 1)
    state = (m, torch.zeros_like(m), torch.zeros_like(q))
    kv = torch.stack([k, v]).contiguous()                         # (2, B, H, L, D): one message per step
    send_to, recv_from = (rank + 1) % world, (rank - 1) % world
    for step in range(world):
        block = (rank - step) % world                             # the rank whose k/v this is
        if step < world - 1:                                      # start moving it on before computing with it
            incoming = torch.empty_like(kv)
            pending = [dist.isend(kv, send_to), dist.irecv(incoming, recv_from)]
        used = not (causal and block > rank)                      # a later block is entirely in the future
        if used:
            scores = q @ kv[0].transpose(-2, -1)                  # (B, H, L, L)
            if causal and block == rank:
                future = torch.ones(L, L, dtype=torch.bool).triu(1)
                scores = scores.masked_fill(future, -math.inf)    # the diagonal survives: every row has a finite max
            state = update(state, scores, kv[1])
        if log is not None:
            log.append((block, used))
        if step < world - 1:
            for request in pending:
                request.wait()
            kv = incoming
    m, l, acc = state
    return (acc / l).transpose(1, 2)                              # (B, L, H, D)


def ring_attention_on_ranks(q, k, v, causal: bool = False, update=online_softmax_update) -> dict:
    """Call with ``labsupport.run``. ``q``, ``k``, ``v``: the whole ``(B, S, H, D)`` tensors, the same on every
    rank; each rank keeps its block of positions and runs ``ring_attention`` under a ``CommCounter``. Returns
    ``{"out": this rank's output block, "bytes_sent": ..., "bytes_received": ..., "kinds": [...],
    "blocks": [(block, used) per step]}``."""
    from labsupport import CommCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    if q.shape[1] % world:
        raise ValueError(f"the sequence length {q.shape[1]} must be a multiple of the {world} ranks")
    mine = [t.chunk(world, dim=1)[rank].contiguous() for t in (q, k, v)]
    log = []
    with CommCounter() as cc:
        out = ring_attention(*mine, causal=causal, update=update, log=log)
    return {"out": out, "bytes_sent": cc.bytes_sent, "bytes_received": cc.bytes_received,
            "kinds": sorted(cc.kinds), "blocks": log}


def attention_comm_bytes(batch: int, seq_len: int, heads: int, head_dim: int, world: int,
                         itemsize: int = 4) -> dict:
    """Bytes one rank sends for one attention layer's forward, sequence split over ``world`` ranks, and the k/v
    bytes it holds at once. ``shard`` = one of q, k, v or the output on one rank: ``B·(S/P)·H·D·itemsize``.

    * ``"ring"``: k and v shards, ``P − 1`` steps: ``2(P−1)·shard``; holds the block in use and the one
      arriving, ``4·shard``.
    * ``"ulysses"``: all-to-alls of q, k, v and the output, each keeping ``1/P`` at home: ``4(P−1)/P·shard``;
      holds k and v for all positions of ``H/P`` heads, ``2·shard``. ``None`` when ``P`` does not divide ``H``:
      Ulysses cannot split the heads.
    * ``"all_gather_kv"``: every rank's k and v reach every other rank (a ring all-gather): ``2(P−1)·shard``, the
      same as the ring; holds the whole sequence's k and v, ``2P·shard``.
    """
    if seq_len % world:
        raise ValueError(f"seq_len={seq_len} must be a multiple of world={world}")
    shard = batch * (seq_len // world) * heads * head_dim * itemsize
    P = world
    return {"shard": shard,
            "ring": {"sent": 2 * (P - 1) * shard, "kv_held": 4 * shard},
            "ulysses": None if heads % P else {"sent": 4 * (P - 1) * shard // P, "kv_held": 2 * shard},
            "all_gather_kv": {"sent": 2 * (P - 1) * shard, "kv_held": 2 * P * shard}}
