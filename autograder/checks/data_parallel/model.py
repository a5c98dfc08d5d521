"""The model every check builds on each rank (``ProbeNet``), its data and its loss."""

from __future__ import annotations

import torch
import torch.nn as nn

D, H = 8, 24  # ProbeNet sizes: d x d and d x h weights (256 B and 768 B in fp32)


class _Scale(nn.Module):
    """Multiplies by a fixed gain: a parameter created with ``requires_grad=False``."""

    def __init__(self, d: int):
        super().__init__()
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(d), requires_grad=False)

    def forward(self, x):
        return x * self.gain


class ProbeNet(nn.Module):
    """The model every check uses. Parameters in registration order (what ``parameters()`` yields):

    ``embed.weight`` (tied: ``readout.weight`` is the same Parameter), ``embed.bias``, ``frozen.weight``,
    ``frozen.bias`` (frozen with ``requires_grad_(False)``), ``scale.gain`` (created with ``requires_grad=False``),
    ``shared.weight``, ``shared.bias`` (a layer applied twice), ``spare.weight``, ``spare.bias`` (never used in
    forward), ``wide.weight``, ``wide.bias``, ``narrow.weight``, ``narrow.bias``, ``readout.bias``.
    Buffers: ``shift`` (float) and ``seen`` (int64).
    """

    def __init__(self, d: int = D, h: int = H):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.scale = _Scale(d)
        self.shared = nn.Linear(d, d)
        self.spare = nn.Linear(d, d)  # never used in forward
        self.wide = nn.Linear(d, h)
        self.narrow = nn.Linear(h, d)
        self.readout = nn.Linear(d, d)
        self.readout.weight = self.embed.weight  # tied: one Parameter, used by two layers
        self.register_buffer("shift", 0.1 * torch.randn(d))
        self.register_buffer("seen", torch.randint(0, 1000, (2,)))

    def forward(self, x):
        h = torch.tanh(self.embed(x + self.shift))  # (B, d)
        h = self.scale(self.frozen(h))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))  # the same layer again
        h = torch.tanh(self.narrow(torch.tanh(self.wide(h))))
        return self.readout(h)  # (B, d)


#: Parameters of ProbeNet that never get a gradient although they require one.
UNUSED = ("spare.weight", "spare.bias")


def _make_model(seed: int) -> ProbeNet:
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(seed)
        return ProbeNet()


def _data(seed: int, rows: int):
    gen = torch.Generator().manual_seed(seed + 7)
    return torch.randn(rows, D, generator=gen), torch.randn(rows, D, generator=gen)


def _loss(model, x, y, scale: float = 1.0):
    return ((model(x) - y) ** 2).mean() * scale


def _names(module) -> dict:
    """Parameter object -> name (tied parameters keep their first name, as ``named_parameters`` does)."""
    return {p: n for n, p in module.named_parameters()}
