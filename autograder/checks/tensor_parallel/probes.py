"""What runs on the workers (the hosts) for each exercise: the probes draw the shapes from the seed, build the dense
oracle, run the student's code in the sandbox through ``drivers.drive`` (``fn``), and describe the wrong answers each
exercise is known for (f and g swapped, the bias added on every rank, interleaved shards, a partial sum never
reduced). ``_probe_memory`` is the memory scenario, on a layer of several MiB.
"""

from __future__ import annotations

import random

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._common import short
from .drivers import make_dense
from .exercise import _dense_run, _exercise, _memory_failure, _observe, _phase
from .harness import ELSEWHERE, _agree, _close, _comm_failure, _dense, _randn, _tp_group, _value_error
from .shards import _col_shards, _fused, _row_shards

_GATHER = {"all_gather", "all_gather_into_tensor"}


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
    seen, phases, _ = _observe(fn, "fg", tp, mine, gs[r].clone())
    if seen.get("error") is not None:
        return f"{label} raised {seen['error'][0]}: {seen['error'][1]}"
    out, fwd = seen.get("out"), _phase(phases, 0)
    if not seen.get("is_tensor"):
        return f"{label} returned {seen.get('type')}, expected a tensor."
    if not torch.equal(seen["x_after"], mine):
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
        third = " It is 1/t of the sum: g sums over the group (ReduceOp.SUM), do not divide by t." if (
            which == "reduce_from_tp" and t > 1 and _close(out * t, expected_out)) else ""
        failure = f"{label}, forward, on rank {r}:{third} output {short(out, 4)}, expected {short(expected_out, 4)}."
    if failure is None and not seen["requires_grad"]:
        failure = (f"{label}: the output does not require grad although x does: use a torch.autograd.Function so "
                   "that gradients flow through it.")
    if _agree(failure):
        return failure or ELSEWHERE
    if seen.get("backward_error") is not None:
        return f"backward through {label} raised {seen['backward_error'][0]}: {seen['backward_error'][1]}"
    bwd, x_grad = _phase(phases, 1), seen.get("x_grad")
    if which == "copy_to_tp":
        failure = _comm_failure(bwd, [({"all_reduce"}, nbytes)], ranks, t, f"{label}, backward, on rank {r}",
                                "f's backward all-reduces (sums) the incoming gradient over the group, once.")
    else:
        failure = _comm_failure(bwd, [], ranks, t, f"{label}, backward, on rank {r}",
                                "g is the identity in backward (an all-reduce in both directions counts the "
                                "gradient t times; did you swap f and g?).")
    if failure is None and not torch.equal(seen.get("incoming_after"), gs[r]):
        failure = (f"{label}, backward, on rank {r}: the incoming gradient (the tensor the caller passed to "
                   "backward) was changed in place: all-reduce a copy (grad.clone()).")
    if failure is None and not _close(x_grad, expected_grad):
        third = " It is 1/t of the sum: f's backward sums over the group (ReduceOp.SUM), do not divide by t." if (
            which == "copy_to_tp" and t > 1 and isinstance(x_grad, torch.Tensor) and _close(x_grad * t,
                                                                                           expected_grad)) else ""
        wanted = ("(the sum of every rank's incoming gradient)." if which == "copy_to_tp" else
                  "(the incoming gradient, unchanged).")
        failure = (f"{label}, backward, on rank {r}:{third} x.grad is {short(x_grad, 4)}, expected "
                   f"{short(expected_grad, 4)} {wanted}")
    return failure


def _fg_shape(rng):
    return (rng.choice((1, 3, 5)), rng.choice((1, 3, 5)), rng.randint(2, 9))


# ---------------------------------------------------------------------------------------------------------------
# ColumnParallelLinear and RowParallelLinear


def _dims(seed, tp):
    rng = random.Random(seed * 31 + tp)
    return rng.choice((1, 3, 5)), rng.choice((1, 3, 5)), rng


def _probe_column(tp, fn, seed):
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
        seen, phases, _ = _observe(fn, "module", tp, dense, {"gather_output": gather}, X,
                                   G if gather else G.chunk(t, -1)[r], list(pinned))
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
            label, seen, phases, X, G if gather else G.chunk(t, -1)[r], want, XG, shards,
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
        failure = _value_error(fn("bad", tp, ("linear", fin, bad, True, seed)), "out_features", bad, t,
                               "ColumnParallelLinear.from_dense")
        if _agree(failure):
            return failure or ELSEWHERE
    return None


def _probe_row(tp, fn, seed):
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
        x = (X.chunk(t, -1)[r] if parallel else X).clone()
        seen, phases, _ = _observe(fn, "module", tp, dense, {"input_is_parallel": parallel}, x, G, list(pinned))
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
            label, seen, phases, x, G, Y, want_xgrad, shards, [({"all_reduce"}, b * s * fout * 4)], bwd,
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
        failure = _value_error(fn("bad", tp, ("linear", bad, fout, True, seed)), "in_features", bad, t,
                               "RowParallelLinear.from_dense")
        if _agree(failure):
            return failure or ELSEWHERE
    return None


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


def _probe_mlp(tp, fn, seed):
    from labsupport.lessons.tensor_parallel import MLP

    group, ranks, t, r = _tp_group(tp)
    b, s, rng = _dims(seed, tp)
    h = t * rng.randint(2, 4)
    dense = _dense(seed, lambda: MLP(h))
    X, G = _randn(seed + 1, b, s, h), _randn(seed + 2, b, s, h)
    Y, XG = _dense_run(dense, X, G)
    shards = _col_shards("fc1", dense.fc1, t, r) + _row_shards("fc2", dense.fc2, t, r)
    label = f"ParallelMLP.from_dense(MLP({h}), group)"
    seen, phases, _ = _observe(fn, "module", tp, dense, {}, X, G, [])
    bias_cause = _bias_cause(Y, dense.fc2.bias.detach(), t)
    fc1, fc2 = dense.fc1, dense.fc2
    swapped = F.linear(F.gelu(F.linear(t * X, fc1.weight.chunk(t, 0)[r], fc1.bias.chunk(t)[r])),
                       fc2.weight.chunk(t, 1)[r], fc2.bias).detach()

    def out_cause(got):
        if t > 1 and _close(got, swapped):
            return ("It is what f and g swapped give: the input summed over ranks (t x the input) and the "
                    "partial outputs never reduced. f (copy_to_tp) goes before fc1, g (reduce_from_tp) after fc2.")
        return bias_cause(got)

    reduce = [({"all_reduce"}, b * s * h * 4)]
    failure = _exercise(label, seen, phases, X, G, Y, XG, shards, reduce, reduce, ranks, t, r,
                        out_cause=out_cause, **_block_hints("MLP"))
    if failure:
        return failure
    if t > 1:
        bad = t * rng.randint(2, 4) + 1
        failure = _value_error(fn("bad", tp, ("mlp", h, bad, seed)), "ffn_hidden", bad, t,
                               "ParallelMLP.from_dense")
        if _agree(failure):
            return failure or ELSEWHERE
    return None


def _probe_attention(tp, fn, seed):
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
    seen, phases, _ = _observe(fn, "module", tp, dense, {}, X, G, [])
    failure = _exercise(label, seen, phases, X, G, Y, XG, shards,
                        [({"all_reduce"}, b * s * hidden * 4)], [({"all_reduce"}, b * s * hidden * 4)], ranks, t, r,
                        out_cause=_bias_cause(Y, dense.out_proj.bias.detach(), t), **_block_hints("attention"))
    if failure:
        return failure
    if t > 1:
        bad = t + 1
        failure = _value_error(fn("bad", tp, ("attention", bad * t, bad, seed)), "num_heads", bad, t,
                               "ParallelAttention.from_dense")
        if _agree(failure):
            return failure or ELSEWHERE
    return None


# ---------------------------------------------------------------------------------------------------------------
# the memory scenario

#: Each exercise's dense module for the memory scenario (16 to 18 MiB of weights) and its keyword arguments.
MEMORY_SPECS = {
    "ColumnParallelLinear": (("linear", 2048, 2048, True), {"gather_output": False}),
    "RowParallelLinear": (("linear", 2048, 2048, True), {"input_is_parallel": True}),
    "ParallelMLP": (("mlp", 768, 3072), {}),
    "ParallelAttention": (("attention", 1024, 8), {}),
}


def _shard_bytes(which, dense, t):
    """The bytes of this rank's shards of ``dense``: what its module may keep."""
    def col(lin):
        return (lin.weight.numel() + (0 if lin.bias is None else lin.bias.numel())) // t * 4

    def row(lin):
        return (lin.weight.numel() // t + (0 if lin.bias is None else lin.bias.numel())) * 4

    if which == "ColumnParallelLinear":
        return col(dense)
    if which == "RowParallelLinear":
        return row(dense)
    if which == "ParallelMLP":
        return col(dense.fc1) + row(dense.fc2)
    return sum(col(getattr(dense, n)) for n in ("q_proj", "k_proj", "v_proj")) + row(dense.out_proj)


def _probe_memory(tp, which, fn, seed):
    _, _, t, r = _tp_group(tp)
    spec, kwargs = MEMORY_SPECS[which]
    spec = spec + (seed,)
    dense = make_dense(spec)
    dense_bytes = sum(p.numel() * 4 for p in dense.parameters())
    hidden = dense.in_features if which.endswith("Linear") else spec[1]
    X = _randn(seed + 3, 1, 3, hidden)
    with torch.no_grad():
        Y = dense(X)
    if which == "RowParallelLinear":
        X = X.chunk(t, -1)[r].clone()
    want = Y.chunk(t, -1)[r] if which == "ColumnParallelLinear" else Y
    label = f"{which}.from_dense({spec[0]} of {dense_bytes} B, group)"
    seen, phases, rss = _observe(fn, "memory", tp, spec, kwargs, X)
    failure = _memory_failure(label, seen, rss, _shard_bytes(which, dense, t), dense_bytes, want, r)
    if _agree(failure):
        return failure or ELSEWHERE
    return None
