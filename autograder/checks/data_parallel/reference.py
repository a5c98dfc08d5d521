"""The oracle's bucket layout (trainable parameters in reverse registration order, filled greedily up to the cap), and
the order of backward: when each gradient becomes ready among the marks the driver passes inside backward."""

from __future__ import annotations

import functools
import math

import torch.nn as nn

from .drivers import _data, _loss, _make_model, _names, watch_backward


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


@functools.lru_cache(maxsize=1)
def backward_events() -> tuple:
    """ProbeNet's backward as a sequence of ``("ready", parameter name)`` (its gradient is accumulated: where a
    post-accumulate hook runs) and ``("mark", layer)`` (the driver's mark inside backward, ``drivers.watch_backward``),
    from a backward of the host's own model. The order is the autograd graph's, the same in the sandbox whatever the
    weights, the data and the hooks an answer adds."""
    model = _make_model(0)
    events = []
    watch_backward(model, lambda layer: events.append(("mark", layer)))
    for p, name in _names(model).items():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _p, name=name: events.append(("ready", name)))
    x, y = _data(0, 2)
    _loss(model, x, y).backward()
    return tuple(events)
