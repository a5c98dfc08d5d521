"""``clip_grad_norm_`` (09, exercise 2): a dense model of drawn tensors kept on the ranks as row shards, flat padded
shards or replicated, the probe that runs the student's function on it under ``CommCounter``, and the hint that
names the mistake behind a wrong norm."""

from __future__ import annotations

import math
import random

import torch

from .._common import call_student, draw_seed, run_on_workers, short
from .._common import stop_if_any as _stop_if_any


def _clip_model(seed: int, world: int):
    """A dense model of drawn tensors, each kept on the ranks as row shards (tensor parallel), flat padded shards
    (FSDP), or replicated; one frozen. Returns [(kind, dense tensor, dense grad or None)]."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    kinds = ["row", "flat", "replicated", "row", "flat", "replicated", "frozen"]
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


def _norm_hint(got, model, world, local):
    """Which mistake gives ``got`` (``local``: the norm of this rank's own gradients before the call)."""
    sq = {"shard": 0.0, "rep": 0.0}
    for kind, _, g in model:
        if g is not None:
            sq["rep" if kind == "replicated" else "shard"] += float(g.double().pow(2).sum())
    candidates = [
        (math.sqrt(sq["shard"] + world * sq["rep"]),
         f"the replicated parameters were counted {world} times (once per rank): add their squares on one rank "
         "only (or divide them by the group's size) before the all-reduce"),
        (math.sqrt(sq["shard"]), "the replicated parameters were left out: count them once"),
        (local, "this is the norm of this rank's own gradients: all-reduce the sum of squares over the group"),
    ]
    for value, hint in candidates:
        if math.isclose(got, value, rel_tol=1e-4):
            return hint
    return ("all-reduce the sum of the squares (not the norms: norms do not add), then take the square root; "
            "count each replicated parameter once")


def _clip_probe(clip, seed: int, trials: int):
    import torch.distributed as dist

    from labsupport import CommCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    # subgroups: on 4 ranks, two tensor-parallel groups of 2 with different models
    groups = [None]
    if world == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        groups.append(pairs[rank // 2])
    for trial in range(trials):
        for gi, group in enumerate(groups):
            g_rank = rank if group is None else rank % 2
            g_world = world if group is None else 2
            sub = "" if group is None else f", group = ranks {[2 * (rank // 2), 2 * (rank // 2) + 1]}"
            model_seed = seed + 101 * trial + 17 * gi + (0 if group is None else 1000 * (rank // 2))
            model = _clip_model(model_seed, g_world)
            dense = []
            for _, w, g in model:
                p = torch.nn.Parameter(w.clone())
                p.grad = None if g is None else g.clone()
                dense.append(p)
            total = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in dense if p.grad is not None)).item()
            rng = random.Random(model_seed)
            max_norm = total * rng.choice([0.1, 0.5, 2.0]) if trial % 2 == 0 else total * 0.3
            expected = torch.nn.utils.clip_grad_norm_(dense, max_norm)
            params, replicated = _local_params(model, g_rank, g_world)
            as_generator = trial == 1
            setup = (f"clip_grad_norm_(params, max_norm={max_norm:.4g}, group=..., replicated=[{len(replicated)} "
                     f"tensors]) on {world} ranks{sub}, {len(params)} parameters (row shards, flat padded shards, "
                     f"replicated, one without .grad){', params given as a generator' if as_generator else ''} "
                     f"(seed {seed})")
            local = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))
            with CommCounter() as cc:
                got = call_student(setup, clip, (p for p in params) if as_generator else params, max_norm,
                                   group=group, replicated=replicated)
            failure = None
            if not cc.calls:
                failure = (f"{setup}: rank {rank} made no communication call: a rank holds only its shards, so "
                           "the global norm needs one all-reduce of the local sum of squares.")
            elif not isinstance(got, torch.Tensor) or got.numel() != 1:
                failure = f"{setup} returned {short(got)}: return the total norm as a tensor (one number)."
            elif not math.isclose(float(got), float(expected), rel_tol=1e-4, abs_tol=1e-6):
                failure = (f"{setup}: rank {rank} returned the norm {float(got):.6g}, the dense model's is "
                           f"{float(expected):.6g}: {_norm_hint(float(got), model, g_world, local)}.")
            else:
                wanted = _expected_local_grads(model, [p.grad for p in dense], g_rank, g_world)
                for i, (p, w) in enumerate(zip(params, wanted)):
                    if w is None:
                        continue
                    if not torch.allclose(p.grad, w.to(p.grad.dtype), rtol=1e-4, atol=1e-6):
                        kind = model[i][0]
                        ratio = float(p.grad.norm() / w.norm()) if float(w.norm()) else float("nan")
                        failure = (f"{setup}: after the call, rank {rank}'s gradient of parameter {i} ({kind}) is "
                                   f"{short(p.grad)}, expected {short(w)} (yours / expected = {ratio:.4g}): scale "
                                   "every gradient, replicated ones included, in place by min(1, max_norm / (norm + "
                                   "1e-6)); never scale up."
                                   + (" The parameters came as a generator (as model.parameters() gives them), "
                                      "which runs only once: make a list of it first." if as_generator else ""))
                        break
            if failure is None:
                calls = list(cc.calls)
                reduces = [c for c in calls if c.kind == "all_reduce"]
                if len(calls) != 1 or len(reduces) != 1:
                    kinds = ", ".join(c.kind for c in calls[:6]) + (", ..." if len(calls) > 6 else "")
                    failure = (f"{setup}: rank {rank} made {len(calls)} communication calls ({kinds}): add the squares "
                               "of all local gradients into one number and all-reduce it once.")
                elif reduces[0].nbytes > 8:
                    failure = (f"{setup}: rank {rank} all-reduced {reduces[0].nbytes} bytes: one number (the local "
                               "sum of squares) is enough, whatever the number of parameters.")
                elif group is not None and tuple(reduces[0].group) != (2 * (rank // 2), 2 * (rank // 2) + 1):
                    failure = (f"{setup}: rank {rank}'s all-reduce went over ranks {list(reduces[0].group)}: pass "
                               "group=group to dist.all_reduce.")
            if _stop_if_any(failure):
                return None
    return None


def check_clip_grad_norm_(clip_grad_norm_):
    """Row shards, flat padded shards and replicated parameters on 2, 3, 4 (with two groups of 2) and 5 ranks: the
    dense model's norm and clipped gradients; one all-reduce of one number over the given group."""
    seed = draw_seed()
    for world in (2, 3, 4, 5):
        run_on_workers(_clip_probe, clip_grad_norm_, seed + world, 3, world_size=world,
                       what=f"clip_grad_norm_ (seed {seed})")
