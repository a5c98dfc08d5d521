"""The values of a checkpoint the checks of ``save_sharded`` / ``load_resharded`` save, and a rank's shard of them in
notebook 07's layout (flat, padded with zeros to N·c, c = ceil(Ψ/N))."""

from __future__ import annotations

import torch


def _values(numel: int, dtype, tag: int):
    """The whole parameter of checkpoint ``tag``: element i holds i + tag (exact in float32 up to 2^24), or in a
    16-bit dtype (i mod 200) + tag, which float16 and bfloat16 hold exactly."""
    values = torch.arange(numel, dtype=torch.float64)
    if torch.empty((), dtype=dtype).element_size() == 2:
        values.remainder_(200)
    return values.add_(tag).to(dtype)


def _padded_shard(full, rank: int, world: int):
    c = -(-full.numel() // world)
    out = torch.zeros(c, dtype=full.dtype)
    piece = full[rank * c:(rank + 1) * c]
    out[:piece.numel()] = piece
    return out
