"""The parameters of a student's parallel module, recognised by value against the dense layer's shards.

A parameter must equal one of the shards this rank may hold (``_col_shards``, ``_row_shards``, ``_fused``); the
wrong splits worth naming (interleaved, the full weight, another rank's) are recognised too. Then each shard's
gradient (``_grad_failure``). The parameters and gradients are those the driver read in the sandbox, compared here
with the host's own shards of the dense layer.
"""

from __future__ import annotations

import torch

from .._common import short
from .harness import _close


# ---------------------------------------------------------------------------------------------------------------
# parameters, recognised by value


class _Shard:
    """A tensor this rank may hold: its value, the gradient it must get, what it covers (e.g. {"q_proj.weight"}),
    and (value, description) pairs of the wrong splits worth naming in a message."""

    def __init__(self, label, value, grad, covers, wrong=()):
        self.label, self.value, self.covers, self.wrong = label, value.detach(), set(covers), list(wrong)
        self.grad = None if grad is None else grad.detach()


def _col_shards(name, linear, t, r):
    """Shards of a column-parallel layer (after the dense backward: gradients are read from ``.grad``)."""
    w, b = linear.weight, linear.bias
    wrong = [(w[r::t], "rows r, r+t, r+2t, ... (interleaved)"), (w, "the full weight")]
    if t > 1:
        wrong.append((w.chunk(t, 0)[(r + 1) % t], f"rank {(r + 1) % t}'s rows"))
    shards = [_Shard(f"{name}.weight.chunk({t}, 0)[{r}]", w.chunk(t, 0)[r], w.grad.chunk(t, 0)[r],
                     {f"{name}.weight"}, wrong)]
    if b is not None:
        shards.append(_Shard(f"{name}.bias.chunk({t})[{r}]", b.chunk(t)[r], b.grad.chunk(t)[r], {f"{name}.bias"},
                             [(b[r::t], "entries r, r+t, ... (interleaved)"), (b, "the full bias")]))
    return shards


def _row_shards(name, linear, t, r):
    w, b = linear.weight, linear.bias
    wrong = [(w[:, r::t], "columns r, r+t, r+2t, ... (interleaved)"), (w, "the full weight")]
    if t > 1:
        wrong.append((w.chunk(t, 1)[(r + 1) % t], f"rank {(r + 1) % t}'s columns"))
    shards = [_Shard(f"{name}.weight.chunk({t}, 1)[{r}]", w.chunk(t, 1)[r], w.grad.chunk(t, 1)[r],
                     {f"{name}.weight"}, wrong)]
    if b is not None:
        shards.append(_Shard(f"{name}.bias (full)", b, b.grad, {f"{name}.bias"}))
    return shards


def _fused(shards, name):
    """One shard standing for several concatenated along dim 0 (fused q/k/v)."""
    return _Shard(" + ".join(s.label for s in shards) + f" (fused {name})", torch.cat([s.value for s in shards]),
                  torch.cat([s.grad for s in shards]), set().union(*(s.covers for s in shards)))


def _match(params, shards, where):
    """Pair every parameter (``params``: (name, value) of the module's parameters) with the shard it equals; a message
    when one matches none, or a shard is missing. Returns (pairs of (name, shard), failure)."""
    pairs, covered = [], set()
    if not isinstance(params, list):
        return None, f"{where}: the module's parameters could not be read."
    for name, p in params:
        if not isinstance(p, torch.Tensor):
            return None, f"{where}: parameter '{name}' could not be read."
        hit = next((s for s in shards if s.value.shape == p.shape and torch.equal(s.value, p.detach())), None)
        if hit is None:
            for s in shards:
                for value, text in s.wrong:
                    if value.shape == p.shape and torch.equal(value, p.detach()):
                        dense_name = s.label.split(".chunk")[0]
                        return None, (f"{where}: parameter '{name}' holds {text} of the dense {dense_name}, expected "
                                      f"{s.label} (a contiguous block: use .chunk(t, dim)[rank]).")
            expected = "; ".join(f"{s.label} {tuple(s.value.shape)}" for s in shards)
            return None, (f"{where}: parameter '{name}' {tuple(p.shape)} is not a shard of the dense layer this rank "
                          f"should hold. Expected parameters equal to: {expected}.")
        if hit.covers & covered:
            return None, f"{where}: parameter '{name}' duplicates {hit.label}, which another parameter already holds."
        covered |= hit.covers
        pairs.append((name, hit))
    needed = set().union(*(s.covers for s in shards)) - covered
    if needed:
        return None, (f"{where}: no parameter holds {', '.join(sorted(needed))} (its shard must be an nn.Parameter "
                      "of the module, with requires_grad).")
    return pairs, None


def _grad_failure(pairs, t, where, hint_scaled=""):
    """``pairs``: (name, gradient the driver read, shard) of every parameter."""
    for name, grad, s in pairs:
        if grad is None:
            return (f"{where}: parameter '{name}' got no gradient. Either the autograd graph is cut between it "
                    "and the output (dist.all_gather / dist.all_reduce are not differentiable: wrap them in a "
                    "torch.autograd.Function), or it is not used on this rank (every rank adds the row-parallel "
                    "bias, after the reduction).")
        if _close(grad, s.grad):
            continue
        cause = ""
        if t > 1 and _close(grad, s.grad * t):
            cause = (f" It is {t} x the expected gradient: a gradient was all-reduced where it should not be. "
                     f"{hint_scaled}")
        return f"{where}: gradient of '{name}' ({s.label}) is {short(grad)}, expected {short(s.grad)}.{cause}"
    return None
