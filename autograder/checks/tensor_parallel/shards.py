"""The parameters of a student's parallel module, recognised by value against the dense layer's shards.

A parameter must equal one of the shards this rank may hold (``_col_shards``, ``_row_shards``, ``_fused``); the
wrong splits worth naming (interleaved, the full weight, another rank's) are recognised too. Then the memory the
module keeps alive, measured by a census of the worker process (``_memory_failure``), and each shard's gradient
(``_grad_failure``).
"""

from __future__ import annotations

import torch

from .._common import short
from .._memory import fmt_bytes
from .harness import _close

#: Bytes a module may keep beyond its shards (a scalar or two of bookkeeping). The layers are small (the smallest
#: dense weight drawn is 12 floats, 48 B), so a kept dense weight always shows above it.
SLACK = 16


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


def _match(module, shards, where):
    """Pair every parameter of ``module`` with the shard it equals; a message when one matches none, or a shard
    is missing. Returns (pairs, failure)."""
    pairs, covered = [], set()
    for name, p in module.named_parameters():
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
        pairs.append((name, p, hit))
    needed = set().union(*(s.covers for s in shards)) - covered
    if needed:
        return None, (f"{where}: no parameter holds {', '.join(sorted(needed))} (its shard must be an nn.Parameter "
                      "of the module, with requires_grad).")
    return pairs, None


def _memory_failure(module, pairs, where, kept):
    """Decided by ``kept``, the census of what the module keeps alive (see ``_built``); the module's attributes only
    name the likely culprit in the message."""
    from labsupport.lessons.tensor_parallel import tensor_bytes

    expected = sum(p.numel() * p.element_size() for _, p, _ in pairs)
    if kept.total <= expected + SLACK:
        return None
    found = tensor_bytes(module)
    if found.total > expected + SLACK:
        return (f"{where}: the module keeps {found.total} B of tensors, but its shards are {expected} B. Largest: "
                f"{found.largest()}. Keep only this rank's shard: .clone() the chunk (a chunk is a view that keeps "
                "the whole dense weight alive), and do not store the dense weight or module.")
    return (f"{where}: the module keeps {fmt_bytes(kept.total)} of tensors alive after from_dense, "
            f"{fmt_bytes(kept.total - expected)} beyond its shards ({fmt_bytes(SLACK)} allowed): the dense weight (or "
            "a copy of it, or the dense module) is still held somewhere (an attribute starting with '_', a list, a "
            f"closure) — keep only this rank's shard. Largest: {kept.largest()}.")


def _grad_failure(pairs, t, where, hint_scaled=""):
    for name, p, s in pairs:
        if p.grad is None:
            return (f"{where}: parameter '{name}' got no gradient. Either the autograd graph is cut between it "
                    "and the output (dist.all_gather / dist.all_reduce are not differentiable: wrap them in a "
                    "torch.autograd.Function), or it is not used on this rank (every rank adds the row-parallel "
                    "bias, after the reduction).")
        if _close(p.grad, s.grad):
            continue
        cause = ""
        if t > 1 and _close(p.grad, s.grad * t):
            cause = (f" It is {t} x the expected gradient: a gradient was all-reduced where it should not be. "
                     f"{hint_scaled}")
        return f"{where}: gradient of '{name}' ({s.label}) is {short(p.grad)}, expected {short(s.grad)}.{cause}"
    return None
