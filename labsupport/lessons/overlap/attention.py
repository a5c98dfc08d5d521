"""Zig-zag ring attention on real ranks: the layout helper, a counter of block products, and the harness that runs
an attention function on every rank and reassembles the sequence.

A *block product* is one chunk of ``c`` queries against one chunk of ``c`` keys: its scores ``q @ kᵀ`` and its
weighted sum ``p @ v``, ``4·B·H·c²·D`` flops. ``ProductCounter`` adds up the flops of every matrix product a rank
runs (a ``TorchFunctionMode``: ``@``, ``matmul``, ``bmm``, ``einsum``, ``scaled_dot_product_attention``) and
divides.
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = ["zigzag_positions", "ProductCounter", "attention_on_ranks", "contiguous_ring_counts"]


def zigzag_positions(world: int, rank: int, chunk: int) -> list:
    """The sequence positions rank ``rank`` holds when ``2·world`` chunks of ``chunk`` positions are dealt zig-zag:
    chunk ``rank``, then chunk ``2·world − 1 − rank``."""
    a, b = rank, 2 * world - 1 - rank
    return list(range(a * chunk, (a + 1) * chunk)) + list(range(b * chunk, (b + 1) * chunk))


class ProductCounter(TorchFunctionMode):
    """``with ProductCounter() as pc:`` then ``pc.flops``: the flops of every matrix product inside."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        try:
            if name in ("matmul", "__matmul__", "bmm", "mm"):
                a, b = args[0].shape, args[1].shape
                batch = math.prod(torch.broadcast_shapes(a[:-2], b[:-2])) if len(a) > 2 or len(b) > 2 else 1
                self.flops += 2 * batch * a[-2] * a[-1] * b[-1]
            elif name == "einsum":
                ops = args[1:]
                ops = list(ops[0]) if len(ops) == 1 and isinstance(ops[0], (list, tuple)) else list(ops)
                size = {}
                for spec, t in zip(re.sub(r"[^a-zA-Z,]", "", args[0].split("->")[0]).split(","), ops):
                    size.update(zip(spec, t.shape))
                self.flops += 2 * math.prod(size.values())
            elif name == "scaled_dot_product_attention":
                q, k = args[0].shape, args[1].shape
                self.flops += 4 * math.prod(q[:-1]) * k[-2] * q[-1]
        except Exception:  # noqa: BLE001 - counting never breaks the computation
            pass
        return func(*args, **(kwargs or {}))


def attention_on_ranks(fn, q, k, v, layout: str = "zigzag") -> dict:
    """Call with ``labsupport.run``. ``q, k, v``: the whole ``(B, S, H, D)`` tensors, the same on every rank; each
    rank keeps its positions (``"zigzag"``: chunks r and 2N−1−r of 2N; ``"contiguous"``: block r of N) and runs
    ``fn(q, k, v)`` on them. Returns ``{"out", "positions", "block_products", "bytes_sent", "events"}``, the last
    the ``OverlapTimeline`` spans of the call (for ``ring_overlap_problem``)."""
    from ... import CommCounter
    from .measure import OverlapTimeline

    rank, world = dist.get_rank(), dist.get_world_size()
    S = q.shape[1]
    if layout == "zigzag":
        chunk = S // (2 * world)
        pos = zigzag_positions(world, rank, chunk)
    else:
        chunk = S // (2 * world)
        pos = list(range(rank * S // world, (rank + 1) * S // world))
    idx = torch.tensor(pos)
    mine = [t[:, idx].contiguous() for t in (q, k, v)]
    with CommCounter() as cc, OverlapTimeline() as ot, ProductCounter() as pc:
        out = fn(*mine)
    B, _, H, D = q.shape
    return {"out": out, "positions": pos, "block_products": pc.flops / (4 * B * H * chunk * chunk * D),
            "bytes_sent": cc.bytes_sent, "events": ot.timeline.events}


def contiguous_ring_counts(q, k, v) -> dict:
    """08's ring attention (contiguous blocks, causal) under the same counter, in units of the zig-zag chunk (half
    a contiguous block), so the two splits compare: call with ``labsupport.run``."""
    from ..hybrid_parallel.context_parallel import ring_attention

    return attention_on_ranks(lambda a, b, c: ring_attention(a, b, c, causal=True), q, k, v, layout="contiguous")
