"""The demo model of notebook 08: a causal transformer written so that PyTorch's ``parallelize_module`` can split
it by heads (attention) and by hidden units (MLP) without any change.

The only concession to tensor parallelism is in ``Attention.forward``: it reshapes the projections with ``-1``
heads, so the same code runs on a rank that holds all heads or only ``heads / t`` of them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Attention", "MLP", "Block", "TinyGPT", "make_data"]


class Attention(nn.Module):
    """Causal multi-head self-attention with four separate projections ``q``, ``k``, ``v``, ``o`` (d → d)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} is not a multiple of heads={heads}")
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):  # (B, S, d)
        B, S, _ = x.shape
        # -1 heads: under tensor parallelism q(x) holds only this rank's heads, (B, S, d / t)
        q, k, v = (proj(x).view(B, S, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, S, head_dim)
        return self.o(y.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    """``down(gelu(up(x)))`` with a hidden width of ``hidden``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2, self.mlp = nn.LayerNorm(dim), MLP(dim, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and a linear head over the vocabulary.

    The parts are public so that a pipeline stage can run a slice of it: ``embed_tokens(idx)`` (B, S) → (B, S, d),
    ``blocks[i]``, ``logits(x)`` (B, S, d) → (B, S, vocab). ``forward(idx)`` is all three.
    """

    def __init__(self, vocab: int = 32, dim: int = 32, heads: int = 4, layers: int = 2, seq_len: int = 16):
        super().__init__()
        self.dim = dim
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(seq_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, 2 * dim) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def embed_tokens(self, idx):
        return self.embed(idx) + self.pos[: idx.shape[1]]

    def logits(self, x):
        return self.head(self.ln(x))

    def forward(self, idx):
        x = self.embed_tokens(idx)
        for block in self.blocks:
            x = block(x)
        return self.logits(x)


def make_data(steps: int, batch: int, seq_len: int = 16, vocab: int = 32, seed: int = 0):
    """``steps`` batches of ``(inputs, targets)``, each ``(batch, seq_len)`` int64, as two tensors
    ``(steps, batch, seq_len)``. Every sequence follows a fixed hidden rule (the next token is a fixed function of
    the previous one, with 10% random tokens), so a model can learn it and the loss goes down."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(vocab, generator=gen)
    seqs = torch.empty(steps * batch, seq_len + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(0, vocab, (steps * batch,), generator=gen)
    for i in range(1, seq_len + 1):
        seqs[:, i] = table[seqs[:, i - 1]]
        noise = torch.rand(steps * batch, generator=gen) < 0.1
        seqs[noise, i] = torch.randint(0, vocab, (int(noise.sum()),), generator=gen)
    seqs = seqs.view(steps, batch, seq_len + 1)
    return seqs[..., :-1].contiguous(), seqs[..., 1:].contiguous()
