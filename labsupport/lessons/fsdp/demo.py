"""The demo model of notebook 07 and two small measurements: unit sizes, and the bytes a rank sends on a ring."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

__all__ = ["DemoNet", "unit_bytes", "ring_bytes_sent"]


class DemoNet(nn.Module):
    """A stack of ``len(widths) - 1`` blocks of uneven sizes (each a Linear and a GELU: one FSDP unit each) and an
    output gain owned by the root. ``DemoNet([16, 64, 256, 64, 16])`` has units of 1 KiB to 64 KiB."""

    def __init__(self, widths=(16, 64, 256, 64, 16)):
        super().__init__()
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            self.add_module(f"block{i}", nn.Sequential(nn.Linear(a, b), nn.GELU()))
        self.gain = nn.Parameter(torch.ones(widths[-1]))

    def forward(self, x):  # (B, widths[0]) -> (B, widths[-1])
        for block in self.children():
            x = block(x)
        return x * self.gain


def unit_bytes(module: nn.Module, world_size: int = 1) -> dict:
    """``{unit name: bytes of its full flat parameter}``, padded to a multiple of ``world_size`` elements: each
    direct child with parameters, then ``"(root)"`` for the root's own parameters."""
    out = {}
    for name, child in module.named_children():
        params = list(child.parameters())
        if params:
            out[name] = params[0].element_size() * math.ceil(sum(p.numel() for p in params) / world_size) * world_size
    own = [p for p in module._parameters.values() if p is not None]
    if own:
        out["(root)"] = own[0].element_size() * math.ceil(sum(p.numel() for p in own) / world_size) * world_size
    return out


def ring_bytes_sent(calls, world_size: int) -> int:
    """Bytes this rank sends for the counted ``CommCall``s if every collective runs as a ring: an all-gather of a
    shard of b bytes sends (N-1)·b, a reduce-scatter of b bytes (N-1)/N·b, an all-reduce of b bytes 2(N-1)/N·b
    (notebook 02). Point-to-point calls count their own bytes."""
    n = world_size
    total = 0.0
    for c in calls:
        if c.kind in ("all_gather", "all_gather_into_tensor"):
            total += (n - 1) * c.nbytes
        elif c.kind in ("reduce_scatter", "reduce_scatter_tensor"):
            total += (n - 1) / n * c.nbytes
        elif c.kind == "all_reduce":
            total += 2 * (n - 1) / n * c.nbytes
        elif c.kind == "send":
            total += c.nbytes
    return int(round(total))
