"""The oracle's bucket layout: trainable parameters in reverse registration order, filled greedily up to the cap."""

from __future__ import annotations

import math

import torch.nn as nn

from .model import _names


def _layout(params, cap_bytes: float):
    """Greedy fill in the given order: a new bucket starts when the next parameter would push it past the cap."""
    buckets, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def expected_buckets(module: nn.Module, bucket_size_mb: float | None) -> list:
    """The bucket layout of notebook 03: trainable parameters in reverse registration order, filled greedily up to
    ``bucket_size_mb * 2**20`` bytes (a parameter larger than the cap gets a bucket of its own; ``None``: no cap,
    one bucket). Returns a list of buckets, each a list of ``(name, nbytes)``."""
    if bucket_size_mb is None:
        bucket_size_mb = math.inf
    names = _names(module)
    trainable = [p for p in module.parameters() if p.requires_grad]
    return [
        [(names[p], p.numel() * p.element_size()) for p in b]
        for b in _layout(list(reversed(trainable)), bucket_size_mb * 2**20)
    ]


def _bucket_bytes(buckets) -> list:
    return sorted(sum(p.numel() * p.element_size() for p in b) for b in buckets)
