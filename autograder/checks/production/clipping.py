"""``clip_grad_norm_`` (09, exercise 2): a dense model of drawn tensors kept on the ranks as row shards, flat padded
shards or replicated, the probe that runs the student's function on them in the sandbox (``drivers.clip_once``, one
call each) under the host's ``CommCounter``, and the hint that names the mistake behind a wrong norm."""

from __future__ import annotations

import math
import random

import torch

from .._common import BUILT_INS, call_student, draw_seed, in_sandbox, run_on_workers, short
from .._common import stop_if_any as _stop_if_any
from . import drivers


def _clip_model(seed: int, world: int, kinds=("row", "flat", "replicated", "row", "flat", "replicated", "frozen")):
    """A dense model of drawn tensors, each kept on the ranks as row shards (tensor parallel), flat padded shards
    (FSDP), or replicated; one frozen. Returns [(kind, dense tensor, dense grad or None)]."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    kinds = list(kinds)
    rng.shuffle(kinds)
    model = []
    for kind in kinds:
        if kind == "row":
            shape = (world * rng.randint(1, 4), rng.randint(1, 6))
        else:
            shape = (rng.randint(1, 5), rng.randint(1, 7)) if rng.random() < 0.6 else (rng.randint(1, 9),)
        w = torch.randn(shape, generator=gen)
        g = None if kind == "frozen" else torch.randn(shape, generator=gen) * rng.choice([0.3, 1.0, 3.0])
        if kind == "replicated" and g is not None:
            g = g * 2.0  # large enough that counting it N times, or never, shows in the norm
        model.append((kind, w, g))
    return model


def _local_params(model, rank: int, world: int):
    """This rank's parameters (with .grad set) and the replicated ones among them."""
    params, replicated = [], []
    for kind, w, g in model:
        if kind == "row":
            rows = w.shape[0] // world
            p = torch.nn.Parameter(w[rank * rows:(rank + 1) * rows].clone())
            p.grad = g[rank * rows:(rank + 1) * rows].clone()
        elif kind == "flat":
            c = -(-w.numel() // world)
            flat_w, flat_g = torch.zeros(c * world), torch.zeros(c * world)
            flat_w[:w.numel()], flat_g[:w.numel()] = w.reshape(-1), g.reshape(-1)
            p = torch.nn.Parameter(flat_w[rank * c:(rank + 1) * c].clone())
            p.grad = flat_g[rank * c:(rank + 1) * c].clone()
        else:
            p = torch.nn.Parameter(w.clone(), requires_grad=kind != "frozen")
            if g is not None:
                p.grad = g.clone()
            if kind == "replicated":
                replicated.append(p)
        params.append(p)
    return params, replicated


def _spans(tensors):
    """Each gradient's (start, end) in the flat buffer the driver makes of them (None without a gradient)."""
    spans, start = [], 0
    for _, g, _ in tensors:
        spans.append(None if g is None else (start, start + g.numel()))
        start += 0 if g is None else g.numel()
    return spans


def _pnorm(tensors, norm_type: float) -> float:
    """The ``norm_type``-norm of all the elements of ``tensors`` together, in float64."""
    flat = [t.detach().double().reshape(-1) for t in tensors if t is not None]
    if not flat:
        return 0.0
    return float(torch.linalg.vector_norm(torch.cat(flat), norm_type))


def _expected_local_grads(model, clipped, rank, world):
    out = []
    for (kind, w, _), g in zip(model, clipped):
        if g is None:
            out.append(None)
        elif kind == "row":
            rows = w.shape[0] // world
            out.append(g[rank * rows:(rank + 1) * rows])
        elif kind == "flat":
            c = -(-w.numel() // world)
            flat = torch.zeros(c * world)
            flat[:w.numel()] = g.reshape(-1)
            out.append(flat[rank * c:(rank + 1) * c])
        else:
            out.append(g)
    return out


def _norm_hint(got, model, world, norm_type, local, each_rank):
    """Which mistake gives ``got`` (``local``: the norm of this rank's own gradients before the call, ``each_rank``:
    every rank's)."""
    shards = [g for kind, _, g in model if g is not None and kind != "replicated"]
    reps = [g for kind, _, g in model if g is not None and kind == "replicated"]
    if norm_type == math.inf:
        candidates = [
            (sum(each_rank), "the ranks' largest |g| were added: all-reduce it with op=dist.ReduceOp.MAX"),
            (local, "this is the largest |g| of this rank's own gradients: all-reduce it over the group with "
                    "op=dist.ReduceOp.MAX"),
            (_pnorm(shards + reps, 2.0), "this is the 2-norm: with norm_type=inf the norm is the largest |g|"),
        ]
        fallback = "with norm_type=inf the norm is the largest |g| over the group: all-reduce it with MAX"
    else:
        p = norm_type
        s, r = _pnorm(shards, p) ** p, _pnorm(reps, p) ** p
        candidates = [
            ((s + world * r) ** (1 / p),
             f"the replicated parameters were counted {world} times (once per rank): add their |g|**{p:g} on one "
             "rank only (or divide them by the group's size) before the all-reduce"),
            (s ** (1 / p), "the replicated parameters were left out: count them once"),
            (local, "this is the norm of this rank's own gradients: all-reduce the sum over the group"),
        ]
        if p != 2.0:
            candidates.append((_pnorm(shards + reps, 2.0), f"this is the 2-norm: with norm_type={p:g} add up "
                               f"|g|**{p:g} and raise the total to the power 1/{p:g}"))
        fallback = (f"all-reduce the sum of |g|**{p:g} (not the norms: norms do not add), then raise it to the "
                    f"power 1/{p:g}; count each replicated parameter once")
    for value, hint in candidates:
        if math.isclose(got, value, rel_tol=1e-4):
            return hint
    return fallback


def _in_place_problem(grads, same, flat, spans, wanted):
    """Whether the clipped gradients are the tensors the parameters had (views of ``flat``), clipped in place."""
    for i, (g, kept, span, w) in enumerate(zip(grads, same, spans, wanted)):
        if w is None:
            continue
        if not torch.allclose(flat[span[0]:span[1]].view(w.shape), w.to(flat.dtype), rtol=1e-4, atol=1e-6):
            if not kept:
                return (f"parameter {i}'s .grad is a new tensor after the call: the gradient it had was a view of a "
                        "flat buffer (as DDP's buckets and FSDP's flat shards are), which still holds the unclipped "
                        "values. Clip in place: p.grad.mul_(coef)")
            return (f"parameter {i}'s gradient was a view of a flat buffer (as DDP's buckets and FSDP's flat shards "
                    "are), and that buffer still holds the unclipped values: was the gradient's .data replaced? Clip "
                    "in place: p.grad.mul_(coef)")
    return None


def _clip_probe(clip, seed: int, trials: int):
    """Per world and group: the default 2-norm, the inf norm (given positionally, as torch's third argument), a
    drawn p-norm (keyword), and one Tensor given alone; every gradient a view of one flat buffer."""
    import torch.distributed as dist

    from labsupport import CommCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    # on 4 ranks also two tensor-parallel groups of 2 (made by the driver), with different models
    for trial in range(trials):
        for gi, pairs in enumerate([False, True] if world == 4 else [False]):
            g_rank, g_world = (rank % 2, 2) if pairs else (rank, world)
            sub = f", group = ranks {[2 * (rank // 2), 2 * (rank // 2) + 1]}" if pairs else ""
            model_seed = seed + 101 * trial + 17 * gi + (1000 * (rank // 2) if pairs else 0)
            rng = random.Random(model_seed)
            norm_type = (2.0, math.inf, rng.choice([1.0, 3.0]), 2.0)[trial % 4]
            single = trial % 4 == 3
            model = _clip_model(model_seed, g_world, kinds=(rng.choice(["row", "flat"]),) if single else
                                ("row", "flat", "replicated", "row", "flat", "replicated", "frozen"))
            dense = []
            for _, w, g in model:
                p = torch.nn.Parameter(w.clone())
                p.grad = None if g is None else g.clone()
                dense.append(p)
            total = _pnorm([p.grad for p in dense], norm_type)
            max_norm = total * rng.choice([0.1, 0.5, 2.0]) if trial % 2 == 0 else total * 0.3
            expected = torch.nn.utils.clip_grad_norm_(dense[0] if single else dense, max_norm, norm_type)
            params, replicated = _local_params(model, g_rank, g_world)
            tensors = [(p.detach().clone(), None if p.grad is None else p.grad.clone(), p.requires_grad)
                       for p in params]
            spans = _spans(tensors)
            as_generator = trial % 4 == 1
            form = "single" if single else "generator" if as_generator else "list"
            norm_arg = {1: "positional", 2: "keyword"}.get(trial % 4)
            shared = [i for i, p in enumerate(params) if any(p is r for r in replicated)]
            shown = (", inf" if trial % 4 == 1 else f", norm_type={norm_type:g}" if trial % 4 == 2 else "")
            setup = (f"clip_grad_norm_(params, max_norm={max_norm:.4g}{shown}, group=..., replicated=["
                     f"{len(replicated)} tensors]) on {world} ranks{sub}, {len(params)} parameters (row shards, "
                     "flat padded shards, replicated, one without .grad)"
                     + (", params given as a generator" if as_generator else "") + f" (seed {seed})")
            if single:
                setup = (f"clip_grad_norm_(tensor, max_norm={max_norm:.4g}, group=...) on {world} ranks{sub}, one "
                         f"parameter ({model[0][0]} shards) given as a Tensor, not in a list (seed {seed})")
            each_rank = []
            for r in range(g_world):
                theirs = [p.grad for p in _local_params(model, r, g_world)[0]]
                each_rank.append(_pnorm(theirs, norm_type))
            local = each_rank[g_rank]
            with CommCounter() as cc:  # the host's record of what the sandbox asked it to carry
                out = call_student(setup, clip, tensors, shared, max_norm, norm_type, form, norm_arg, pairs)
            got, grads = out["norm"], out["grads"]
            failure = None
            if not cc.calls:
                failure = (f"{setup}: rank {rank} made no communication call: a rank holds only its shards, so "
                           "only an all-reduce over the group gives every rank the norm of the whole model.")
            elif not isinstance(got, torch.Tensor) or got.numel() != 1:
                failure = f"{setup} returned {short(got)}: return the total norm as a tensor (one number)."
            elif not math.isclose(float(got), float(expected), rel_tol=1e-4, abs_tol=1e-6):
                hint = ("a single Tensor is one parameter: put it in a list (iterating a tensor gives its rows, "
                        "which have no .grad)" if single and float(got) == 0.0 else
                        _norm_hint(float(got), model, g_world, norm_type, local, each_rank))
                failure = (f"{setup}: rank {rank} returned the norm {float(got):.6g}, the dense model's is "
                           f"{float(expected):.6g}: {hint}.")
            else:
                wanted = _expected_local_grads(model, [p.grad for p in dense], g_rank, g_world)
                for i, (g, w) in enumerate(zip(grads, wanted)):
                    if w is None:
                        continue
                    if not isinstance(g, torch.Tensor) or g.shape != w.shape or \
                            not torch.allclose(g, w.to(g.dtype), rtol=1e-4, atol=1e-6):
                        kind = model[i][0]
                        ratio = (float(g.norm() / w.norm()) if isinstance(g, torch.Tensor) and g.shape == w.shape
                                 and float(w.norm()) else float("nan"))
                        failure = (f"{setup}: after the call, rank {rank}'s gradient of parameter {i} ({kind}) is "
                                   f"{short(g)}, expected {short(w)} (yours / expected = {ratio:.4g}): scale "
                                   "every gradient, replicated ones included, in place by min(1, max_norm / (norm + "
                                   "1e-6)); never scale up."
                                   + (" The parameters came as a generator (as model.parameters() gives them), "
                                      "which runs only once: make a list of it first." if as_generator else "")
                                   + (" A single Tensor is one parameter: put it in a list (iterating a tensor "
                                      "gives its rows)." if single else ""))
                        break
                else:
                    problem = _in_place_problem(grads, out["same"], out["flat"], spans, wanted)
                    if problem:
                        failure = f"{setup}: on rank {rank}, {problem}."
            if failure is None:
                calls = list(cc.calls)
                reduces = [c for c in calls if c.kind == "all_reduce"]
                if len(calls) != 1 or len(reduces) != 1:
                    kinds = ", ".join(c.kind for c in calls[:6]) + (", ..." if len(calls) > 6 else "")
                    failure = (f"{setup}: rank {rank} made {len(calls)} communication calls ({kinds}): add up the "
                               "local gradients' share of the norm into one number and all-reduce it once.")
                elif reduces[0].nbytes > 8:
                    failure = (f"{setup}: rank {rank} all-reduced {reduces[0].nbytes} bytes: one number (the local "
                               "sum of |g|**norm_type, or the largest |g|) is enough, whatever the number of "
                               "parameters.")
                elif pairs and tuple(reduces[0].group) != (2 * (rank // 2), 2 * (rank // 2) + 1):
                    failure = (f"{setup}: rank {rank}'s all-reduce went over ranks {list(reduces[0].group)}: pass "
                               "group=group to dist.all_reduce.")
            if _stop_if_any(failure):
                return None
    return None


def check_clip_grad_norm_(clip_grad_norm_):
    """Row shards, flat padded shards and replicated parameters on 2, 3, 4 (with two groups of 2) and 5 ranks: the
    dense model's norm (2, inf and a drawn p) and clipped gradients, in place; one Tensor alone; one all-reduce of one
    number over the given group."""
    seed = draw_seed()
    fn = in_sandbox(clip_grad_norm_, "clip_grad_norm_", driver=drivers.clip_once, forbid=BUILT_INS["clip_grad_norm_"])
    for world in (2, 3, 4, 5):
        run_on_workers(_clip_probe, fn, seed + world, 4, world_size=world,
                       what=f"clip_grad_norm_ (seed {seed})")
