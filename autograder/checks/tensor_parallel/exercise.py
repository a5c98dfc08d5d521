"""One parallel module against its dense oracle: ``_observe`` runs the driver's scenario in the sandbox (from_dense,
forward, backward) under the host's own record; ``_exercise`` checks, in order, everything the module must get right
(the dense module untouched, the shards it keeps, forward's output and collectives, backward's gradients and
collectives); ``_dense_run`` is the oracle; ``_memory_failure`` judges the memory scenario.
"""

from __future__ import annotations

import torch

from .._common import short
from .._host import Recorder, fmt_bytes
from .harness import ELSEWHERE, _agree, _close, _comm_failure, _group_hint
from .shards import _grad_failure, _match

#: What a module may keep beyond its shards in the memory scenario, as a share of the dense module's bytes (what a
#: process's own allocations move, once the heap is trimmed, is far below it; a full copy is 4 times more).
MEMORY_SLACK = 0.25


def _largest_difference(got, want) -> str:
    """``", largest |difference| 1.2e-04"`` when the shapes match (values that print alike may still differ)."""
    if isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype:
        return f", largest |difference| {(got.detach() - want).abs().max().item():.1e}"
    return ""


def _observe(fn, *args):
    """The driver's scenario in the sandbox, and the host's record of it: (what it returned, calls per phase)."""
    with Recorder() as rec:
        seen = fn(*args)
    if type(seen) is not dict:
        raise AssertionError("what the scenario returned is not what it returns (something in the sandbox changed "
                             "it); graded as a failure.")
    return seen, rec.phases(), rec.rss


def _phase(phases, i) -> list:
    return phases[i] if i < len(phases) else []


def _exercise(label, seen, phases, x, G, want_out, want_xgrad, shards, fwd, bwd, ranks, t, r, *, pinned=None,
              out_cause=None, xgrad_cause=None, fwd_hint="", bwd_hint="", scaled_hint=""):
    """Everything one parallel module must get right, in order; a message for the first thing wrong, or None.

    ``seen``: what the driver returned (``drivers._module``); ``phases``: the host's record of from_dense, forward
    and backward. ``x``: the input the driver was given (it must stay untouched). ``G``: the upstream gradient.
    ``fwd`` and ``bwd``: the expected collectives, as (accepted kinds, bytes). ``pinned``: attribute -> shard the
    module must expose (``.weight``, ``.bias``)."""
    where = f"{label}, on rank {r}"
    failure = _built_failure(label, seen, t)
    if failure is None and _phase(phases, 0):
        failure = (f"{where}: from_dense communicated ({', '.join(f'{c.kind} of {c.nbytes} B' for c in phases[0])}): "
                   "every rank has the whole dense module, so taking this rank's shard needs no communication.")
    pairs = None
    if failure is None:
        pairs, failure = _match(seen["params"], shards, where)
    if failure is None and pinned:
        for attr, shard in pinned.items():
            got = seen["pinned"].get(attr, "missing")
            if shard is None:
                if got is not None:
                    failure = f"{where}: .{attr} should be None (the dense layer has no bias), got {short(got)}."
            elif not isinstance(got, torch.Tensor) or got.shape != shard.value.shape or not torch.equal(
                    got, shard.value):
                failure = f"{where}: .{attr} is {short(got)}, expected {shard.label} = {short(shard.value)}."
    if _agree(failure):
        return failure or ELSEWHERE
    out = seen.get("out")
    failure = _raised(f"{label}: forward", seen.get("forward_error"))
    failure = failure or _comm_failure(_phase(phases, 1), fwd, ranks, t, f"{where}, forward", fwd_hint)
    if failure is None and not torch.equal(seen["x_after"], x):
        failure = f"{where}: the forward changed its input in place; leave the input untouched."
    if failure is None and not _close(out, want_out):
        if not seen["is_tensor"]:
            failure = f"{where}: the forward returned {seen['out_type']}, expected a tensor."
        else:
            cause = (out_cause(out) if out_cause else "") or ""
            failure = (f"{where}: {cause + ' ' if cause else ''}output {short(out, 4)}, expected {short(want_out, 4)}"
                       f"{_largest_difference(out, want_out)}.")
    if failure is None and not seen["requires_grad"]:
        failure = (f"{where}: the output does not require grad: the autograd graph was cut (dist collectives are "
                   "not differentiable; wrap them in a torch.autograd.Function).")
    if _agree(failure):
        return failure or ELSEWHERE
    failure = _raised(f"{label}: backward", seen.get("backward_error"))
    failure = failure or _comm_failure(_phase(phases, 2), bwd, ranks, t, f"{where}, backward", bwd_hint)
    x_grad = seen.get("x_grad")
    if failure is None and want_xgrad is not None and not _close(x_grad, want_xgrad):
        cause = (xgrad_cause(x_grad) if (xgrad_cause and isinstance(x_grad, torch.Tensor)) else "") or ""
        failure = (f"{where}: {cause + ' ' if cause else ''}the input's gradient is {short(x_grad, 4)}, expected "
                   f"{short(want_xgrad, 4)}{_largest_difference(x_grad, want_xgrad)}.")
    if failure is None:
        grads = seen.get("grads") or []
        failure = _grad_failure([(name, grads[i] if i < len(grads) else None, s) for i, (name, s) in enumerate(pairs)],
                                t, f"{where}, backward", scaled_hint)
    if _agree(failure):
        return failure or ELSEWHERE
    return None


def _raised(what, error):
    return None if error is None else f"{what} raised {error[0]}: {error[1]}"


def _built_failure(label, seen, t):
    """What from_dense got wrong before its module can be looked at: an error, not a module, the dense changed."""
    error = seen.get("error")
    if error is not None:
        return _group_hint(label, error, t)
    if not seen.get("is_module"):
        return f"{label} returned {seen.get('type')}, expected an nn.Module (an instance of the class)."
    if seen.get("changed"):
        return f"{label} changed the dense module's {seen['changed'][0]}: read it, never write to it."
    return None


def _memory_failure(label, seen, rss, shard_bytes, dense_bytes, want_out, r):
    """The memory scenario (``drivers._memory``): the sandbox's resident size, read by the host at the driver's
    marks, may grow from before the dense module existed to after from_dense returned (the dense module gone) by the
    shards' bytes, plus ``MEMORY_SLACK`` of the dense module's; the output must still be right. ``rss`` is empty
    without a sandbox: memory is then not judged."""
    where = f"{label}, on rank {r}"
    failure = _built_failure(label, seen, 0)
    if failure:
        return failure
    if seen.get("forward_error") is not None or not _close(seen.get("out"), want_out):
        return (f"{where}: the forward of a module built from a larger layer ({fmt_bytes(dense_bytes)}) gives "
                f"{short(seen.get('out'), 4)}, expected {short(want_out, 4)}.")
    if len(rss) < 3:
        return None
    grown = rss[2] - rss[0]
    if grown <= shard_bytes + MEMORY_SLACK * dense_bytes:
        return None
    kept = seen.get("kept")
    if isinstance(kept, int) and kept > shard_bytes + MEMORY_SLACK * dense_bytes:
        return (f"{where}: the module keeps {kept} B of tensors, but its shards are {shard_bytes} B. Largest: "
                f"{seen.get('largest')}. Keep only this rank's shard: .clone() the chunk (a chunk is a view that "
                "keeps the whole dense weight alive), and do not store the dense weight or module.")
    return (f"{where}: after from_dense returned and the dense module ({fmt_bytes(dense_bytes)}) was dropped, the "
            f"process held {fmt_bytes(grown)} more than before it existed (read by the system), "
            f"{fmt_bytes(grown - shard_bytes)} beyond its shards ({fmt_bytes(shard_bytes)}): the dense weight (or a "
            "copy of it, as a tensor, numpy array or bytes, or the dense module) is still held somewhere (an "
            "attribute starting with '_', a list, a closure, a global) — keep only this rank's shard.")


def _dense_run(dense, X, G):
    """The oracle: the dense module on the whole input; returns (output, input gradient)."""
    x = X.clone().requires_grad_()
    y = dense(x)
    y.backward(G)
    return y.detach(), x.grad
