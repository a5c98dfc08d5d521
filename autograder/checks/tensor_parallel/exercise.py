"""One parallel module against its dense oracle: ``_built`` makes it from a copy of the dense module and measures
what it keeps; ``_exercise`` checks, in order, everything the module must get right (the dense module untouched, the
shards it keeps, forward's output and collectives, backward's gradients and collectives); ``_dense_run`` is the
oracle.
"""

from __future__ import annotations

import copy
import gc
import weakref

import torch
import torch.nn as nn

from .._common import call_student as _call, short
from .._memory import MemoryWatch
from .harness import ELSEWHERE, _agree, _build, _close, _comm_failure, _recorded
from .shards import _grad_failure, _match, _memory_failure


def _largest_difference(got, want) -> str:
    """``", largest |difference| 1.2e-04"`` when the shapes match (values that print alike may still differ)."""
    if isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype:
        return f", largest |difference| {(got.detach() - want).abs().max().item():.1e}"
    return ""


def _built(label, from_dense, dense, t, **kwargs):
    """``from_dense`` called on a copy of ``dense`` that the check drops afterwards, so that whatever of it is still
    alive is kept by the student's module. Returns (module, names of the dense entries it changed, ``Kept``: every
    storage created since, measured by a census of the worker process, not from the module's attributes)."""
    before = _snapshot(dense)
    watch = MemoryWatch()
    given = copy.deepcopy(dense)
    given.zero_grad(set_to_none=True)
    module = _build(label, from_dense, given, t, **kwargs)
    changed = [name for name, value in given.state_dict().items() if not torch.equal(value, before[name])]
    alive = weakref.ref(given)
    del given
    if alive() is not None:
        gc.collect()  # a reference cycle through the copy: only the collector frees it
    kept = watch.kept()
    watch.close()
    return module, changed, kept


def _exercise(label, module, changed, kept, x, G, want_out, want_xgrad, shards, fwd, bwd, ranks, t, r, *,
              pinned=None, out_cause=None, xgrad_cause=None, fwd_hint="", bwd_hint="", scaled_hint=""):
    """Everything one parallel module must get right, in order; a message for the first thing wrong, or None.

    ``changed``: the dense module's entries ``from_dense`` changed (none may be); ``kept``: what the module keeps
    alive (``_built``). ``x``: the input (a leaf that requires grad; it must stay untouched). ``G``: the upstream gradient for this rank's output. ``fwd``
    and ``bwd``: the expected collectives, as (accepted kinds, bytes). ``pinned``: attribute -> shard index the
    module must expose (``.weight``, ``.bias``)."""
    where = f"{label}, on rank {r}"
    if not isinstance(module, nn.Module):
        return f"{label} returned {type(module).__name__}, expected an nn.Module (an instance of the class)."
    if changed:
        return f"{label} changed the dense module's {changed[0]}: read it, never write to it."
    pairs, failure = _match(module, shards, where)
    if failure is None and pinned:
        for attr, shard in pinned.items():
            got = getattr(module, attr, "missing")
            if shard is None:
                if got is not None:
                    failure = f"{where}: .{attr} should be None (the dense layer has no bias), got {short(got)}."
            elif not isinstance(got, torch.Tensor) or got.shape != shard.value.shape or not torch.equal(
                    got.detach(), shard.value):
                failure = f"{where}: .{attr} is {short(got)}, expected {shard.label} = {short(shard.value)}."
    failure = failure or _memory_failure(module, pairs or [], where, kept)
    if _agree(failure):
        return failure or ELSEWHERE
    x_before = x.detach().clone()
    out, calls = _recorded(lambda: _call(f"{label}: forward", module, x))
    failure = _comm_failure(calls, fwd, ranks, t, f"{where}, forward", fwd_hint)
    if failure is None and not torch.equal(x.detach(), x_before):
        failure = f"{where}: the forward changed its input in place; leave the input untouched."
    if failure is None and not _close(out, want_out):
        if not isinstance(out, torch.Tensor):
            failure = f"{where}: the forward returned {type(out).__name__}, expected a tensor."
        else:
            cause = (out_cause(out) if out_cause else "") or ""
            failure = (f"{where}: {cause + ' ' if cause else ''}output {short(out, 4)}, expected {short(want_out, 4)}"
                       f"{_largest_difference(out, want_out)}.")
    if failure is None and not out.requires_grad:
        failure = (f"{where}: the output does not require grad: the autograd graph was cut (dist collectives are "
                   "not differentiable; wrap them in a torch.autograd.Function).")
    if _agree(failure):
        return failure or ELSEWHERE
    _, calls = _recorded(lambda: _call(f"{label}: backward", out.backward, G))
    failure = _comm_failure(calls, bwd, ranks, t, f"{where}, backward", bwd_hint)
    if failure is None and want_xgrad is not None and not _close(x.grad, want_xgrad):
        cause = (xgrad_cause(x.grad) if (xgrad_cause and x.grad is not None) else "") or ""
        failure = (f"{where}: {cause + ' ' if cause else ''}the input's gradient is {short(x.grad, 4)}, expected "
                   f"{short(want_xgrad, 4)}{_largest_difference(x.grad, want_xgrad)}.")
    failure = failure or _grad_failure(pairs, t, f"{where}, backward", scaled_hint)
    if _agree(failure):
        return failure or ELSEWHERE
    return None


def _snapshot(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def _dense_run(dense, X, G):
    """The oracle: the dense module on the whole input; returns (output, input gradient)."""
    x = X.clone().requires_grad_()
    y = dense(x)
    y.backward(G)
    return y.detach(), x.grad
