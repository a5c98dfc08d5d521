"""Notebook 04 (tensor parallelism): the dense modules the exercises split, and how to measure the split.

* ``MLP(hidden, ffn_hidden=None)``: Linear h -> 4h, GELU, Linear 4h -> h (names ``fc1``, ``fc2``).
* ``SelfAttention(hidden, num_heads)``: multi-head causal self-attention with separate ``q_proj``, ``k_proj``,
  ``v_proj`` and an ``out_proj``; the number of heads is read from the projections' output width, so the same
  forward runs on a rank that holds only some of the heads.
* ``TransformerLayer(hidden, num_heads)``: pre-LayerNorm block, ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``;
  its ``attn`` and ``mlp`` can be replaced by parallel versions.
* ``tensor_bytes(module)``: the bytes of every tensor a module keeps (parameters, buffers, plain attributes),
  counted by storage, so a shard that is a view of a full weight counts as the full weight.
* ``per_device_bytes(calls, t)``: what a list of recorded collectives sends per rank with ring algorithms.
* ``narayanan_layer_bytes(b, s, h, t)``: the per-layer tensor-parallel volume of Narayanan et al. 2021, §3.2.
* plots (``labsupport.lessons.tensor_parallel.plots``): ``plot_blocking``, ``plot_memory``, ``plot_volume``.

Example::

    from labsupport.lessons import tensor_parallel as lesson
    mlp = lesson.MLP(16)                          # fc1: 16 -> 64, fc2: 64 -> 16
    lesson.tensor_bytes(mlp).total                # 4 * (16*64 + 64 + 64*16 + 16) bytes
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .plots import plot_blocking, plot_memory, plot_volume

__all__ = [
    "MLP",
    "SelfAttention",
    "TransformerLayer",
    "tensor_bytes",
    "TensorBytes",
    "per_device_bytes",
    "narayanan_layer_bytes",
    "plot_blocking",
    "plot_memory",
    "plot_volume",
]


class MLP(nn.Module):
    """The transformer's feed-forward block: ``fc2(gelu(fc1(x)))``, hidden -> ffn_hidden (4 x hidden) -> hidden."""

    def __init__(self, hidden: int, ffn_hidden: int | None = None, bias: bool = True):
        super().__init__()
        ffn_hidden = 4 * hidden if ffn_hidden is None else ffn_hidden
        self.fc1 = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.fc2 = nn.Linear(ffn_hidden, hidden, bias=bias)

    def forward(self, x):                       # x: (b, s, h)
        return self.fc2(F.gelu(self.fc1(x)))    # (b, s, 4h) in between


class SelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v projections (h -> h each) and ``out_proj`` (h -> h).

    Attributes ``num_heads`` and ``head_dim`` (``hidden = num_heads * head_dim``). The forward reshapes the
    projections' outputs into heads of ``head_dim`` and takes as many heads as there are, so it also runs on a rank
    whose q/k/v projections produce only its own heads (that is how ``parallelize_module`` uses it)."""

    def __init__(self, hidden: int, num_heads: int, bias: bool = True):
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"hidden = {hidden} is not divisible by num_heads = {num_heads}")
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, hidden, bias=bias)
        self.v_proj = nn.Linear(hidden, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def attend(self, q, k, v):
        """Causal attention of (b, s, n*d) queries, keys and values, any number n of heads: -> (b, s, n*d)."""
        b, s, _ = q.shape
        q, k, v = (z.reshape(b, s, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))  # (b, n, s, d)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)                      # (b, n, s, d)
        return out.transpose(1, 2).reshape(b, s, -1)                                       # (b, s, n*d)

    def forward(self, x):                       # x: (b, s, h)
        return self.out_proj(self.attend(self.q_proj(x), self.k_proj(x), self.v_proj(x)))


class TransformerLayer(nn.Module):
    """A pre-LayerNorm transformer layer: ``x = x + attn(ln1(x))``, then ``x = x + mlp(ln2(x))``."""

    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, num_heads)
        self.mlp = MLP(hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


@dataclass
class TensorBytes:
    """What ``tensor_bytes`` found: ``total`` bytes, and ``items``: (where, shape, bytes of its storage)."""

    total: int
    items: list = field(default_factory=list)

    def largest(self, n: int = 3) -> str:
        top = sorted(self.items, key=lambda item: -item[2])[:n]
        return ", ".join(f"{where} {tuple(shape)} (storage {nbytes} B)" for where, shape, nbytes in top)


def _tensors_in(value, where: str, depth: int = 0):
    """Tensors held by an attribute value: a tensor, or tensors inside lists, tuples, sets and dicts."""
    if isinstance(value, torch.Tensor):
        yield where, value
    elif depth < 3 and isinstance(value, (list, tuple, set)):
        for i, item in enumerate(value):
            yield from _tensors_in(item, f"{where}[{i}]", depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors_in(item, f"{where}[{key!r}]", depth + 1)


def tensor_bytes(module: nn.Module) -> TensorBytes:
    """Bytes of every tensor ``module`` keeps alive: parameters, buffers and tensor attributes of it and its
    submodules (also inside lists and dicts). Each storage counts once, at its full size: a parameter that is a
    view of a full weight (``nn.Parameter(w.chunk(t)[r])`` without ``.clone()``) keeps all of ``w`` in memory."""
    seen, items = set(), []
    for prefix, sub in module.named_modules():
        found = [(f"{prefix}.{n}" if prefix else n, p) for n, p in sub._parameters.items() if p is not None]
        found += [(f"{prefix}.{n}" if prefix else n, b) for n, b in sub._buffers.items() if b is not None]
        for name, value in vars(sub).items():
            if not name.startswith("_"):
                found += list(_tensors_in(value, f"{prefix}.{name}" if prefix else name))
        for where, tensor in found:
            if tensor.__class__.__name__ == "DTensor":
                tensor = tensor.to_local()
            storage = tensor.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            items.append((where, tuple(tensor.shape), storage.nbytes()))
    return TensorBytes(sum(nbytes for _, _, nbytes in items), items)


#: Bytes a rank sends, with the ring algorithms of notebook 02, per byte of its data as CommCounter records it
#: (all-reduce and reduce-scatter: the whole input; all-gather: this rank's piece).
_RING_FACTOR = {
    "all_reduce": lambda t: 2 * (t - 1) / t,
    "reduce_scatter": lambda t: (t - 1) / t,
    "reduce_scatter_tensor": lambda t: (t - 1) / t,
    "all_gather": lambda t: t - 1,
    "all_gather_into_tensor": lambda t: t - 1,
}


def per_device_bytes(calls, t: int) -> float:
    """Bytes one rank sends for the recorded collectives ``calls`` (``CommCall`` items) in a group of ``t`` ranks,
    assuming ring algorithms: all-reduce 2(t-1)/t of its tensor, reduce-scatter (t-1)/t of its input, all-gather
    (t-1) times its piece. Calls of other kinds are not counted."""
    return sum(_RING_FACTOR[c.kind](t) * c.nbytes for c in calls if c.kind in _RING_FACTOR)


def narayanan_layer_bytes(b: int, s: int, h: int, t: int, element_size: int = 4) -> float:
    """Per transformer layer, per rank, per micro-batch: the bytes tensor parallelism sends, ``8 b s h (t-1)/t``
    elements (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM", §3.2): two all-reduces of b·s·h elements in forward and two in backward, each costing a ring
    2(t-1)/t of its size."""
    return 8 * b * s * h * (t - 1) / t * element_size
