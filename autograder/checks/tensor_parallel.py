"""Checks for notebook 04_tensor_parallel: ``check_copy_to_tp``, ``check_reduce_from_tp``,
``check_ColumnParallelLinear``, ``check_RowParallelLinear``, ``check_ParallelMLP``, ``check_ParallelAttention``.

The oracle is the dense layer in one process: every rank builds the same dense module (same seed) and runs it on
the same input, so it knows the whole output, the input's gradient and every weight's gradient. The student's
layer, built with ``from_dense`` on t ranks, must give the same output (or this rank's slice of it), the same
input gradient, and for each of its parameters the gradient of the dense weight's shard it holds.

Parameters are recognised by value, not by name: a parameter must equal one of the shards this rank may hold
(``w.chunk(t, 0)[r]`` of a column-parallel weight, ``w.chunk(t, 1)[r]`` of a row-parallel one, a bias chunk, the
full row-parallel bias, or for attention the q, k and v shards concatenated into one fused weight). So fused or
separate q/k/v and any attribute names are accepted; interleaved shards, a full weight, or a shard of the wrong
rank are named in the message.

How: ``CommCounter`` records forward and backward separately (kind, bytes and group of every call); the bytes of
every tensor the module keeps are measured by storage (``tensor_bytes``), so a shard that is a view of the full
weight counts as the full weight. World sizes 1 to 4, plus 4 ranks split into two tensor-parallel groups of 2
(``group=`` must be honoured); shapes are drawn at grading time (hidden sizes divisible by t, odd batch and
sequence). Probes keep ranks in step: after each phase all ranks agree on whether one failed.
"""

from __future__ import annotations

import random
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import call_student as _call, draw_seed, run_on_workers, short, tolerance

__all__ = [
    "check_copy_to_tp",
    "check_reduce_from_tp",
    "check_ColumnParallelLinear",
    "check_RowParallelLinear",
    "check_ParallelMLP",
    "check_ParallelAttention",
]

#: (world_size, tensor-parallel size): every rank in one group, 4 ranks as two groups of 2, and one rank (last:
#: a bug shows more clearly on several ranks).
CONFIGS = ((2, 2), (3, 3), (4, 4), (4, 2), (1, 1))
_GATHER = {"all_gather", "all_gather_into_tensor"}


# ---------------------------------------------------------------------------------------------------------------
# running probes


#: What a rank that found nothing wrong returns when another rank did (all stop at the same point).
ELSEWHERE = "(another rank failed)"


def _agree(failure) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([0 if failure is None else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _guarded(body, *args):
    """Run a probe body; an AssertionError becomes this rank's failure, agreed on with the other ranks."""
    try:
        failure = body(*args)
    except AssertionError as exc:
        failure = str(exc)
    _agree(failure)
    return failure


def _run(probe, *args, what: str, seed: int, configs=CONFIGS):
    for world_size, tp in configs:
        results = run_on_workers(_guarded, probe, tp, *args, world_size=world_size, what=what)
        for failure in results:
            if failure and failure != ELSEWHERE:
                layout = "" if tp == world_size else f", tensor-parallel groups of {tp}"
                raise AssertionError(f"{failure} (t={tp}{layout}, seed {seed})")


def _tp_group(tp: int):
    """(group to pass, its global ranks, t, this rank's index in it): the whole world, or contiguous groups."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if tp == world:
        return None, tuple(range(world)), tp, rank
    groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, world, tp)]
    first = rank - rank % tp
    return groups[rank // tp], tuple(range(first, first + tp)), tp, rank % tp


def _dense(seed: int, make):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return make()


def _randn(seed: int, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, **tolerance(b.dtype))


def _recorded(fn):
    import labsupport

    with labsupport.CommCounter() as cc:
        out = fn()
    return out, list(cc.calls)


def _describe(calls) -> str:
    if not calls:
        return "no communication"
    return ", ".join(f"{c.kind} of {c.nbytes} B" for c in calls)


def _comm_failure(calls, expected, ranks, t, where, hint=""):
    """``expected``: list of (set of accepted kinds, bytes) in order. None when the calls match."""
    if t == 1 and not calls:
        return None  # one rank: skipping the collective is fine (and so is a one-rank collective)
    got = [(c.kind, c.nbytes) for c in calls]
    ok = len(got) == len(expected) and all(k in kinds and n == nb for (k, n), (kinds, nb) in zip(got, expected))
    want = ", ".join(f"{'/'.join(sorted(kinds))} of {nb} B" for kinds, nb in expected) or "no communication"
    if not ok:
        return f"{where}: expected {want}; recorded {_describe(calls)}. {hint}".strip()
    for c in calls:
        if tuple(c.group) != tuple(ranks):
            return (f"{where}: the {c.kind} went over ranks {c.group}, but this rank's tensor-parallel group is "
                    f"{ranks}: pass group= to every collective (and use dist.get_rank(group), "
                    "dist.get_world_size(group)).")
    return None


def _build(label, from_dense, dense, t, **kwargs):
    """Call the student's from_dense; a ValueError on sizes that do divide by t gets a hint about the group."""
    try:
        return from_dense(dense, **kwargs)
    except ValueError as exc:
        raise AssertionError(
            f"{label} raised ValueError: {exc}, but every size here divides by t = {t}, the number of ranks in "
            "`group`: take t and r from the group (dist.get_world_size(group), dist.get_rank(group)), not from the "
            "whole world.") from None
    except (NotImplementedError, AssertionError):
        raise
    except Exception as exc:
        raise AssertionError(f"{label} raised {type(exc).__name__}: {exc}") from None


def _value_error(build, size_name: str, size: int, t: int, what: str):
    """``build()`` must raise ValueError whose message names the size and t."""
    try:
        build()
    except ValueError as exc:
        text = str(exc)
        if not (re.search(rf"(?<!\d){size}(?!\d)", text) and re.search(rf"(?<!\d){t}(?!\d)", text)):
            return (f"{what} with {size_name} = {size} on t = {t} ranks raised ValueError({text!r}); its message "
                    f"should name the size ({size}) and t ({t}).")
        return None
    except (NotImplementedError, AssertionError):
        raise
    except Exception as exc:
        return (f"{what} with {size_name} = {size} on t = {t} ranks raised {type(exc).__name__}: {exc}; raise "
                f"ValueError naming the size and t when {size_name} is not divisible by t.")
    return (f"{what} with {size_name} = {size} on t = {t} ranks did not raise: {size} is not divisible by {t}, "
            "raise ValueError naming the size and t.")


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


def _memory_failure(module, pairs, where):
    from labsupport.lessons.tensor_parallel import tensor_bytes

    expected = sum(p.numel() * p.element_size() for _, p, _ in pairs)
    found = tensor_bytes(module)
    if found.total > expected + 64:
        return (f"{where}: the module keeps {found.total} B of tensors, but its shards are {expected} B. Largest: "
                f"{found.largest()}. Keep only this rank's shard: .clone() the chunk (a chunk is a view that keeps "
                "the whole dense weight alive), and do not store the dense weight or module.")
    return None


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


# ---------------------------------------------------------------------------------------------------------------
# copy_to_tp and reduce_from_tp


def _probe_fg(tp, which, fn, seed, shape):
    group, ranks, t, r = _tp_group(tp)
    gi = ranks[0] // tp  # which group: groups get different data, so mixing groups shows
    xs = [_randn(seed + 10 * gi + k, *shape) for k in range(t)]   # every rank's input
    gs = [_randn(seed + 1000 + 10 * gi + k, *shape) for k in range(t)]  # every rank's upstream gradient
    nbytes = xs[0].numel() * 4
    label = f"{which}(x, group)"
    mine = xs[r] if which == "reduce_from_tp" else xs[0]
    x = mine.clone().requires_grad_()
    out, fwd = _recorded(lambda: _call(label, fn, x, group=group))
    if not isinstance(out, torch.Tensor):
        return f"{label} returned {type(out).__name__}, expected a tensor."
    if not torch.equal(x.detach(), mine):
        return f"{label} changed its input x in place: leave x untouched (all-reduce a copy)."
    if which == "copy_to_tp":
        failure = _comm_failure(fwd, [], ranks, t, f"{label}, forward, on rank {r}",
                                "f is the identity in forward; its all-reduce belongs in backward (did you swap f "
                                "and g?).")
        expected_out, expected_grad = mine, sum(gs)
    else:
        failure = _comm_failure(fwd, [({"all_reduce"}, nbytes)], ranks, t, f"{label}, forward, on rank {r}",
                                "g all-reduces (sums) x over the group in forward, once.")
        expected_out, expected_grad = sum(xs), gs[r]
    if failure is None and not _close(out, expected_out):
        failure = f"{label}, forward, on rank {r}: output {short(out)}, expected {short(expected_out)}."
    if failure is None and not out.requires_grad:
        failure = (f"{label}: the output does not require grad although x does: use a torch.autograd.Function so "
                   "that gradients flow through it.")
    if _agree(failure):
        return failure or ELSEWHERE
    _, bwd = _recorded(lambda: _call(f"backward through {label}", out.backward, gs[r]))
    if which == "copy_to_tp":
        failure = _comm_failure(bwd, [({"all_reduce"}, nbytes)], ranks, t, f"{label}, backward, on rank {r}",
                                "f's backward all-reduces (sums) the incoming gradient over the group, once.")
    else:
        failure = _comm_failure(bwd, [], ranks, t, f"{label}, backward, on rank {r}",
                                "g is the identity in backward (an all-reduce in both directions counts the "
                                "gradient t times; did you swap f and g?).")
    if failure is None and not _close(x.grad, expected_grad):
        failure = (f"{label}, backward, on rank {r}: x.grad is {short(x.grad)}, expected {short(expected_grad)} "
                   + ("(the sum of every rank's incoming gradient)." if which == "copy_to_tp"
                      else "(the incoming gradient, unchanged)."))
    return failure


def _fg_shape(rng):
    return (rng.choice((1, 3, 5)), rng.choice((1, 3, 5)), rng.randint(2, 9))


def check_copy_to_tp(copy_to_tp) -> None:
    """f: identity in forward with no communication; one all-reduce (sum) of the gradient in backward, over
    ``group``; input untouched."""
    seed = draw_seed()
    _run(_probe_fg, "copy_to_tp", copy_to_tp, seed, _fg_shape(random.Random(seed)), what="copy_to_tp", seed=seed)


def check_reduce_from_tp(reduce_from_tp) -> None:
    """g: one all-reduce (sum) over ``group`` in forward, input untouched; identity in backward, no communication."""
    seed = draw_seed()
    _run(_probe_fg, "reduce_from_tp", reduce_from_tp, seed, _fg_shape(random.Random(seed)), what="reduce_from_tp",
         seed=seed)


# ---------------------------------------------------------------------------------------------------------------
# one parallel module against its dense oracle


def _exercise(label, module, dense, before, x, G, want_out, want_xgrad, shards, fwd, bwd, ranks, t, r, *,
              pinned=None, out_cause=None, xgrad_cause=None, fwd_hint="", bwd_hint="", scaled_hint=""):
    """Everything one parallel module must get right, in order; a message for the first thing wrong, or None.

    ``before``: the dense module's state before ``from_dense`` (it must stay untouched). ``x``: the input (a leaf
    that requires grad; it must stay untouched too). ``G``: the upstream gradient for this rank's output. ``fwd``
    and ``bwd``: the expected collectives, as (accepted kinds, bytes). ``pinned``: attribute -> shard index the
    module must expose (``.weight``, ``.bias``)."""
    where = f"{label}, on rank {r}"
    if not isinstance(module, nn.Module):
        return f"{label} returned {type(module).__name__}, expected an nn.Module (an instance of the class)."
    for name, value in dense.state_dict().items():
        if not torch.equal(value, before[name]):
            return f"{label} changed the dense module's {name}: read it, never write to it."
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
    failure = failure or _memory_failure(module, pairs or [], where)
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
            failure = f"{where}: output {short(out)}, expected {short(want_out)}. {cause}".strip()
    if failure is None and not out.requires_grad:
        failure = (f"{where}: the output does not require grad: the autograd graph was cut (dist collectives are "
                   "not differentiable; wrap them in a torch.autograd.Function).")
    if _agree(failure):
        return failure or ELSEWHERE
    _, calls = _recorded(lambda: _call(f"{label}: backward", out.backward, G))
    failure = _comm_failure(calls, bwd, ranks, t, f"{where}, backward", bwd_hint)
    if failure is None and want_xgrad is not None and not _close(x.grad, want_xgrad):
        cause = (xgrad_cause(x.grad) if (xgrad_cause and x.grad is not None) else "") or ""
        failure = f"{where}: the input's gradient is {short(x.grad)}, expected {short(want_xgrad)}. {cause}".strip()
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


# ---------------------------------------------------------------------------------------------------------------
# ColumnParallelLinear and RowParallelLinear


def _dims(seed, tp):
    rng = random.Random(seed * 31 + tp)
    return rng.choice((1, 3, 5)), rng.choice((1, 3, 5)), rng


def _probe_column(tp, cls, seed):
    group, ranks, t, r = _tp_group(tp)
    b, s, rng = _dims(seed, tp)
    fin, fout, bias = rng.randint(3, 9), t * rng.randint(2, 4), tp != 3   # no bias on 3 ranks
    dense = _dense(seed, lambda: nn.Linear(fin, fout, bias=bias))
    X, G = _randn(seed + 1, b, s, fin), _randn(seed + 2, b, s, fout)
    Y, XG = _dense_run(dense, X, G)
    shards = _col_shards("linear", dense, t, r)
    pinned = {"weight": shards[0], "bias": shards[1] if bias else None}
    Wr = dense.weight.detach().chunk(t, 0)[r]
    for gather in (False, True):
        label = f"ColumnParallelLinear.from_dense(nn.Linear({fin}, {fout}, bias={bias}), group, gather_output={gather})"
        before = _snapshot(dense)
        module = _build(label, cls.from_dense, dense, t, group=group, gather_output=gather)
        x = X.clone().requires_grad_()
        want = Y if gather else Y.chunk(t, -1)[r]

        def out_cause(got, gather=gather):
            if not gather and got.shape == want.shape and t > 1 and _close(got, Y[..., r::t]):
                return "Those are output features r, r+t, ...: the shards must be contiguous (chunk(t, 0)[rank])."
            if gather and got.shape == Y.chunk(t, -1)[r].shape and t > 1:
                return "With gather_output=True, return the full output: this rank's slice is only part of it."
            if not gather and got.shape == Y.shape and t > 1:
                return "With gather_output=False, return only this rank's slice of the output features."
            return ""

        def xgrad_cause(got):
            if t > 1 and _close(got, G.chunk(t, -1)[r] @ Wr):
                return ("That is only this rank's part of it: pass the input through copy_to_tp (f), whose backward "
                        "sums the parts over the group.")
            return ""

        fwd = [(_GATHER, b * s * (fout // t) * 4)] if gather else []
        failure = _exercise(
            label, module, dense, before, x, G if gather else G.chunk(t, -1)[r], want, XG, shards,
            fwd, [({"all_reduce"}, b * s * fin * 4)], ranks, t, r, pinned=pinned, out_cause=out_cause,
            xgrad_cause=xgrad_cause,
            fwd_hint=("Forward: " + ("one all-gather of this rank's output slice (gather_output=True)."
                                     if gather else "no communication at all (f is the identity in forward).")),
            bwd_hint=("Backward: exactly one all-reduce, f's, of the input's gradient (b*s*in_features elements); "
                      "the gather's backward just takes this rank's slice of the gradient, with no communication."),
            scaled_hint="The gather's backward must only slice, and f's backward must run once.")
        if failure:
            return failure
    if t > 1:
        bad = t * rng.randint(1, 3) + 1
        failure = _value_error(lambda: cls.from_dense(nn.Linear(fin, bad), group=group), "out_features", bad, t,
                               "ColumnParallelLinear.from_dense")
        if _agree(failure):
            return failure or ELSEWHERE
    return None


def _probe_row(tp, cls, seed):
    group, ranks, t, r = _tp_group(tp)
    b, s, rng = _dims(seed, tp)
    fin, fout, bias = t * rng.randint(2, 4), rng.randint(3, 9), tp != 3   # no bias on 3 ranks
    dense = _dense(seed, lambda: nn.Linear(fin, fout, bias=bias))
    X, G = _randn(seed + 1, b, s, fin), _randn(seed + 2, b, s, fout)
    Y, XG = _dense_run(dense, X, G)
    shards = _row_shards("linear", dense, t, r)
    pinned = {"weight": shards[0], "bias": shards[1] if bias else None}
    Wr = dense.weight.detach().chunk(t, 1)[r]
    for parallel in (True, False):
        label = (f"RowParallelLinear.from_dense(nn.Linear({fin}, {fout}, bias={bias}), group, "
                 f"input_is_parallel={parallel})")
        before = _snapshot(dense)
        module = _build(label, cls.from_dense, dense, t, group=group, input_is_parallel=parallel)
        x = (X.chunk(t, -1)[r] if parallel else X).clone().requires_grad_()
        want_xgrad = XG.chunk(t, -1)[r] if parallel else XG

        def out_cause(got):
            if bias and t > 1 and _close(got, Y + (t - 1) * dense.bias.detach()):
                copies = f"{t - 1} extra cop{'y' if t == 2 else 'ies'}"
                return (f"It is the expected output plus {copies} of the bias: every rank added the bias before the "
                        "sum. Add it once, after the reduction.")
            if t > 1 and got.shape == Y.shape:
                partial = X.chunk(t, -1)[r] @ Wr.T + (dense.bias.detach() if bias else 0)
                if _close(got, partial):
                    return "That is this rank's partial sum: reduce it over the group (reduce_from_tp, g)."
                if _close(got, Y + (t - 1) * (Y - (dense.bias.detach() if bias else 0))):
                    return "The partial sums were reduced more than once."
            return ""

        def xgrad_cause(got):
            if not parallel and t > 1 and got.shape == XG.shape and _close(got.chunk(t, -1)[r], XG.chunk(t, -1)[r]):
                return ("This rank's slice is right, the others are not: the backward of taking the slice must "
                        "all-gather the slices' gradients, so every rank holds the whole input gradient.")
            return ""

        bwd = [] if parallel else [(_GATHER, b * s * (fin // t) * 4)]
        failure = _exercise(
            label, module, dense, before, x, G, Y, want_xgrad, shards, [({"all_reduce"}, b * s * fout * 4)], bwd,
            ranks, t, r, pinned=pinned, out_cause=out_cause, xgrad_cause=xgrad_cause,
            fwd_hint="Forward: exactly one all-reduce (g) of the partial output (b*s*out_features elements); "
                     "taking this rank's slice of a replicated input needs no communication.",
            bwd_hint=("Backward: g is the identity, no communication." if parallel else
                      "Backward: g is the identity; the slice's backward all-gathers the input gradient's slices "
                      "(one all-gather of this rank's slice)."),
            scaled_hint="g must be the identity in backward.")
        if failure:
            return failure
    if t > 1:
        bad = t * rng.randint(1, 3) + 1
        failure = _value_error(lambda: cls.from_dense(nn.Linear(bad, fout), group=group), "in_features", bad, t,
                               "RowParallelLinear.from_dense")
        if _agree(failure):
            return failure or ELSEWHERE
    return None


def check_ColumnParallelLinear(ColumnParallelLinear) -> None:
    """from_dense keeps rows chunk(t, 0)[r] of the weight and its bias chunk (nothing more); forward equals this
    rank's slice of the dense output (or all of it with gather_output=True); input and weight gradients equal the
    dense ones; no communication in forward (one all-gather when gathering), one all-reduce in backward."""
    seed = draw_seed()
    _run(_probe_column, ColumnParallelLinear, seed, what="ColumnParallelLinear", seed=seed)


def check_RowParallelLinear(RowParallelLinear) -> None:
    """from_dense keeps columns chunk(t, 1)[r] of the weight and the full bias; forward equals the dense output
    with the bias added once; gradients equal the dense ones; one all-reduce in forward, none in backward (one
    all-gather with input_is_parallel=False)."""
    seed = draw_seed()
    _run(_probe_row, RowParallelLinear, seed, what="RowParallelLinear", seed=seed)


# ---------------------------------------------------------------------------------------------------------------
# ParallelMLP and ParallelAttention


def _block_hints(name):
    return dict(
        fwd_hint=(f"Forward of the {name} block: exactly one all-reduce (g, after the row-parallel layer) of b*s*h "
                  "elements, nothing between the two layers."),
        bwd_hint=(f"Backward of the {name} block: exactly one all-reduce (f, before the column-parallel layer(s)) of "
                  "b*s*h elements: apply copy_to_tp once to the block's input, even when several projections read it."),
        scaled_hint="g must be the identity in backward.",
    )


def _bias_cause(Y, bias, t):
    def cause(got):
        if t > 1 and _close(got, Y + (t - 1) * bias):
            copies = f"{t - 1} extra cop{'y' if t == 2 else 'ies'}"
            return (f"It is the expected output plus {copies} of the output bias: add the row-parallel bias once, "
                    "after the reduction, not on every rank before it.")
        return ""
    return cause


def _probe_mlp(tp, cls, seed):
    from labsupport.lessons.tensor_parallel import MLP

    group, ranks, t, r = _tp_group(tp)
    b, s, rng = _dims(seed, tp)
    h = t * rng.randint(2, 4)
    dense = _dense(seed, lambda: MLP(h))
    X, G = _randn(seed + 1, b, s, h), _randn(seed + 2, b, s, h)
    Y, XG = _dense_run(dense, X, G)
    shards = _col_shards("fc1", dense.fc1, t, r) + _row_shards("fc2", dense.fc2, t, r)
    label = f"ParallelMLP.from_dense(MLP({h}), group)"
    before = _snapshot(dense)
    module = _build(label, cls.from_dense, dense, t, group=group)
    bias_cause = _bias_cause(Y, dense.fc2.bias.detach(), t)
    fc1, fc2 = dense.fc1, dense.fc2
    swapped = F.linear(F.gelu(F.linear(t * X, fc1.weight.chunk(t, 0)[r], fc1.bias.chunk(t)[r])),
                       fc2.weight.chunk(t, 1)[r], fc2.bias).detach()

    def out_cause(got):
        if t > 1 and _close(got, swapped):
            return ("It is what f and g swapped give: the input summed over ranks (t x the input) and the "
                    "partial outputs never reduced. f (copy_to_tp) goes before fc1, g (reduce_from_tp) after fc2.")
        return bias_cause(got)

    failure = _exercise(label, module, dense, before, X.clone().requires_grad_(), G, Y, XG, shards,
                        [({"all_reduce"}, b * s * h * 4)], [({"all_reduce"}, b * s * h * 4)], ranks, t, r,
                        out_cause=out_cause, **_block_hints("MLP"))
    if failure:
        return failure
    if t > 1:
        bad = t * rng.randint(2, 4) + 1
        failure = _value_error(lambda: cls.from_dense(MLP(h, ffn_hidden=bad), group=group), "ffn_hidden", bad, t,
                               "ParallelMLP.from_dense")
        if _agree(failure):
            return failure or ELSEWHERE
    return None


def _probe_attention(tp, cls, seed):
    from labsupport.lessons.tensor_parallel import SelfAttention

    group, ranks, t, r = _tp_group(tp)
    b, s, rng = _dims(seed, tp)
    heads, head_dim = t * rng.choice((2, 3)), rng.choice((2, 3, 4))   # >= 2 heads per rank: interleaving shows
    hidden = heads * head_dim
    dense = _dense(seed, lambda: SelfAttention(hidden, heads))
    X, G = _randn(seed + 1, b, s, hidden), _randn(seed + 2, b, s, hidden)
    Y, XG = _dense_run(dense, X, G)
    qkv = []
    for name in ("q_proj", "k_proj", "v_proj"):
        shard_w, *shard_b = _col_shards(name, getattr(dense, name), t, r)
        w = getattr(dense, name).weight.detach()
        shard_w.wrong.insert(0, (w.view(heads, head_dim, hidden)[r::t].reshape(-1, hidden),
                                 "heads r, r+t, ... (interleaved heads)"))
        qkv.append((shard_w, shard_b[0]))
    shards = [s for pair in qkv for s in pair]
    shards += [_fused([w for w, _ in qkv], "qkv weight"), _fused([bb for _, bb in qkv], "qkv bias")]
    shards += _row_shards("out_proj", dense.out_proj, t, r)
    label = f"ParallelAttention.from_dense(SelfAttention({hidden}, num_heads={heads}), group)"
    before = _snapshot(dense)
    module = _build(label, cls.from_dense, dense, t, group=group)
    failure = _exercise(label, module, dense, before, X.clone().requires_grad_(), G, Y, XG, shards,
                        [({"all_reduce"}, b * s * hidden * 4)], [({"all_reduce"}, b * s * hidden * 4)], ranks, t, r,
                        out_cause=_bias_cause(Y, dense.out_proj.bias.detach(), t), **_block_hints("attention"))
    if failure:
        return failure
    if t > 1:
        bad = t + 1
        failure = _value_error(lambda: cls.from_dense(SelfAttention(bad * t, bad), group=group), "num_heads", bad, t,
                               "ParallelAttention.from_dense")
        if _agree(failure):
            return failure or ELSEWHERE
    return None


def check_ParallelMLP(ParallelMLP) -> None:
    """fc1 column-parallel, fc2 row-parallel, only this rank's shards kept; output, input gradient and shard
    gradients equal the dense MLP's; exactly one all-reduce of b*s*h elements in forward and one in backward."""
    seed = draw_seed()
    _run(_probe_mlp, ParallelMLP, seed, what="ParallelMLP", seed=seed)


def check_ParallelAttention(ParallelAttention) -> None:
    """Heads split over ranks (q, k, v column-parallel, fused or separate; out_proj row-parallel), only this rank's
    shards kept; output, input gradient and shard gradients equal the dense attention's; exactly one all-reduce of
    b*s*h elements in forward and one in backward."""
    seed = draw_seed()
    _run(_probe_attention, ParallelAttention, seed, what="ParallelAttention", seed=seed,
         configs=((2, 2), (3, 3), (4, 4), (1, 1)))
