"""``DynamicLossScaler`` (09, exercise 3): drawn settings and overflows, the probe that steps the student's scaler
and ``torch.amp.GradScaler("cpu")`` on the dense model side by side, and the hints."""

from __future__ import annotations

import math
import random

import torch

from .._common import call_student, draw_seed, run_on_workers, share, short
from .._common import stop_if_any as _stop_if_any

#: Seconds per probe before it counts as a deadlock: the first optimizer a fresh worker builds imports
#: torch._dynamo (about 800 modules) unless its fork server preloaded it, as a notebook kernel's does; on a loaded
#: machine that alone can pass the default 20 s.
PROBE_TIMEOUT_SCALER = 60.0


def _scaler_plan(seed: int, world: int, steps: int):
    """Drawn settings and, per step, {rank: 'inf' or 'nan'} for the ranks whose gradients overflow."""
    rng = random.Random(seed)
    cfg = {"init_scale": 2.0 ** rng.randint(4, 16), "growth_factor": rng.choice([2.0, 4.0]),
           "backoff_factor": rng.choice([0.5, 0.25]), "growth_interval": rng.randint(2, 4)}
    bad = {}
    for step in rng.sample(range(1, steps), 4):
        ranks = list(range(world)) if rng.random() < 0.2 else [rng.randrange(world)]
        bad[step] = {r: rng.choice(["inf", "nan", "-inf"]) for r in ranks}
    bad.setdefault(1, {world - 1: "nan"})  # at least one NaN on a rank other than 0, early
    return cfg, bad


def _groups(params, idle):
    """Three parameter groups with their own settings; the second holds a parameter that never gets a gradient."""
    return [{"params": [params[0]]}, {"params": [params[1], idle], "lr": 0.03, "momentum": 0.5},
            {"params": [params[2]], "lr": 0.08}]


def _bucketed(params):
    """Make the gradients views of one flat buffer (DDP's buckets, FSDP's flat shards); returns the buffer."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    start = 0
    for p in params:
        p.grad = flat[start:start + p.numel()].view(p.shape)
        start += p.numel()
    return flat


def _scaler_probe(Scaler, seed: int, steps: int, pairs: bool = False):
    import torch.distributed as dist

    from labsupport import CommCounter
    from labsupport.comm import recorded_calls

    rank, world = dist.get_rank(), dist.get_world_size()
    group, members, in_group = None, None, ""
    if pairs:  # two groups of 2, each its own model, scaler and overflows: a rank must agree within its group only
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        group, members = groups[rank // 2], (2 * (rank // 2), 2 * (rank // 2) + 1)
        seed += 1000 * (rank // 2)
        in_group = f" as two groups of 2 (global ranks {list(members)}: group ranks 0 and 1, group=their group)"
        rank, world = rank % 2, 2
    cfg, bad = _scaler_plan(seed, world, steps)
    gen = torch.Generator().manual_seed(seed)
    sizes = [random.Random(seed + i).randint(1, 5) for i in range(3)]
    dense_w = [torch.randn(world * s, generator=gen) for s in sizes]
    coeffs = [[torch.randn(world * s, generator=gen) for s in sizes] for _ in range(steps)]
    # the oracle: the dense model (every rank's shards side by side) and torch's GradScaler
    dense = [torch.nn.Parameter(w.clone()) for w in dense_w]
    dense_opt = torch.optim.SGD(_groups(dense, torch.nn.Parameter(torch.zeros(2))), lr=0.05, momentum=0.9)
    oracle = torch.amp.GradScaler("cpu", **cfg)
    mine = [torch.nn.Parameter(w[rank * s:(rank + 1) * s].clone()) for w, s in zip(dense_w, sizes)]
    opt = torch.optim.SGD(_groups(mine, torch.nn.Parameter(torch.zeros(2))), lr=0.05, momentum=0.9)
    # when the optimizer is stepped, note how many all-reduces the counter around step() has seen so far (a hook of
    # torch's own: a subclass's step would be wrapped by torch.optim at construction, which grading refuses), as the
    # warden recorded them while the student's code still runs
    watch = {"counter": None, "seen": []}

    def note(optimizer, args, kwargs):
        counter = watch["counter"]
        calls = [] if counter is None else recorded_calls(counter)
        watch["seen"].append(sum(kind == "all_reduce" for kind, *_ in calls))

    opt.register_step_pre_hook(note)
    setup = (f"DynamicLossScaler(**{cfg}) on {world} ranks{in_group}, each rank stepping its own shards with an "
             f"optimizer of 3 parameter groups (seed {seed})")
    scaler = call_student(f"DynamicLossScaler(**{cfg}, group=...)", Scaler, group=group, **cfg)

    def loss_of(ws, cs):
        return sum((w * c).sum() + 0.01 * (w * w).sum() for w, c in zip(ws, cs))

    for step in range(steps):
        before = call_student("get_scale()", scaler.get_scale)
        expected_scale = oracle.get_scale()
        failure = None
        if not isinstance(before, (int, float)) or isinstance(before, bool):
            failure = f"{setup}: get_scale() returned {short(before)}: return the scale as a Python float."
        elif not math.isclose(before, expected_scale, rel_tol=1e-6):
            failure = (f"{setup}: before step {step}, get_scale() = {before:g}, GradScaler's is {expected_scale:g}: "
                       f"{_scale_hint(bad, step, cfg)}.")
        if _stop_if_any(failure):
            return None
        opt.zero_grad()
        dense_opt.zero_grad()
        loss = loss_of(mine, [c[rank * s:(rank + 1) * s] for c, s in zip(coeffs[step], sizes)])
        scaled = call_student("scale(loss)", scaler.scale, loss)
        if not isinstance(scaled, torch.Tensor) or not scaled.requires_grad:
            failure = f"{setup}: scale(loss) returned {short(scaled)}: return loss * scale, a tensor backward can run on."
        if _stop_if_any(failure):
            return None
        scaled.backward()
        oracle.scale(loss_of(dense, coeffs[step])).backward()
        which = 1 + step % 2  # the overflow lands in the second or the third parameter group
        for r, what in bad.get(step, {}).items():
            value = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}[what]
            j = step % sizes[which]
            dense[which].grad[r * sizes[which] + j] = value
            if r == rank:
                mine[which].grad[j] = value
        flat = _bucketed(mine)
        grads = [p.grad for p in mine]
        # step(optimizer), step(optimizer, closure) and step(optimizer, closure=closure) in turn: the arguments go
        # on to optimizer.step, whose result (the closure's, for SGD) step() returns, or None when it skips
        token = f"optimizer.step's result at step {step}"
        args, kwargs = ((), {}) if step % 3 == 0 else ((lambda: token,), {}) if step % 3 == 1 else \
            ((), {"closure": lambda: token})
        call = ("step(optimizer)", "step(optimizer, closure)", "step(optimizer, closure=closure)")[step % 3]
        watch["counter"] = cc = CommCounter()
        try:
            with cc:
                returned = call_student(f"{call} at step {step}", scaler.step, opt, *args, **kwargs)
        finally:
            watch["counter"] = None
        stepped = bool(watch["seen"])
        oracle_stepped = oracle.step(dense_opt, lambda: token) is not None
        oracle.update()
        wanted = token if stepped and step % 3 else None
        with CommCounter() as cc_update:
            call_student(f"update() at step {step}", scaler.update)
        unscaled = torch.cat([d.grad[rank * s:(rank + 1) * s] for d, s in zip(dense, sizes)])
        where = ", ".join(f"rank {r}: {v}" for r, v in sorted(bad.get(step, {}).items()))
        calls = list(cc.calls)
        reduces = [c for c in calls if c.kind == "all_reduce"]
        if members is not None and reduces and tuple(reduces[0].group) != members:
            failure = (f"{setup}: step() on rank {rank} all-reduced over ranks {list(reduces[0].group)}: agree within "
                       "the scaler's group only (pass group=self.group to dist.all_reduce).")
        elif stepped != oracle_stepped:
            if stepped:
                own = bad.get(step, {}).get(rank)
                hint = (f"its own gradient held {own}, in parameter group {which}: look at every gradient of every "
                        "parameter group (optimizer.param_groups), for NaN too (torch.isfinite, not only "
                        "torch.isinf)" if own else
                        "agree with the other ranks (all-reduce a found-inf flag with MAX over the group) before "
                        "deciding: one rank that steps while the others skip makes the replicas drift apart")
                failure = (f"{setup}: at step {step} rank {rank} stepped although a gradient was not finite "
                           f"({where}): {hint}.")
            else:
                failure = (f"{setup}: at step {step} rank {rank} skipped, though every gradient on every rank was "
                           "finite: skip only when some rank found an inf or a NaN (and step the optimizer it is "
                           "given otherwise).")
        elif not calls:
            failure = (f"{setup}: step() on rank {rank} made no communication call: the ranks must agree whether any "
                       "of them found an inf or a NaN (all-reduce one flag, MAX) before any of them steps.")
        elif len(calls) != 1 or len(reduces) != 1 or reduces[0].nbytes > 8:
            kinds = ", ".join(f"{c.kind} ({c.nbytes} B)" for c in calls[:5])
            failure = (f"{setup}: step() on rank {rank} made {kinds}: one all-reduce of one flag (a single number) "
                       "is all the agreement needs.")
        elif stepped and watch['seen'][-1] < 1:
            failure = (f"{setup}: at step {step} rank {rank} called optimizer.step() before the all-reduce of the "
                       "flag: agree first, then step (or skip).")
        elif returned is not wanted:
            failure = (f"{setup}: {call} at step {step} returned {short(returned)} on rank {rank}, which "
                       + (f"stepped: return what optimizer.step(*args, **kwargs) returned ({wanted!r} here), "
                          "passing on the arguments step() was given, as GradScaler.step does."
                          if wanted is not None else
                          "stepped: return what optimizer.step(*args, **kwargs) returned (None here, with no "
                          "closure), as GradScaler.step does." if stepped else
                          "skipped: return None when the step is skipped, as GradScaler.step does."))
        elif cc_update.calls:
            failure = (f"{setup}: update() on rank {rank} communicated ({cc_update.calls[0].kind}): the ranks already "
                       "agreed in step(), so update() needs no communication.")
        elif any(p.grad is not g for p, g in zip(mine, grads)):
            failure = (f"{setup}: at step {step}, step() on rank {rank} replaced a parameter's .grad with a new "
                       "tensor: divide each gradient by the scale in place (p.grad.div_(scale)), as GradScaler's "
                       "unscale_ does; DDP's buckets and FSDP's flat shards hold gradients as views of one buffer.")
        elif stepped and not torch.allclose(flat, unscaled, rtol=1e-5, atol=1e-6):
            failure = (f"{setup}: after step {step}, the buffer rank {rank}'s gradients are views of holds "
                       f"{short(flat)}, GradScaler's unscaled gradients are {short(unscaled)}: divide every gradient "
                       "of every parameter group by the scale, in place.")
        else:
            for i, (p, d, s) in enumerate(zip(mine, dense, sizes)):
                want = d.detach()[rank * s:(rank + 1) * s]
                if not torch.allclose(p.detach(), want, rtol=1e-5, atol=1e-6):
                    failure = (f"{setup}: after step {step}, rank {rank}'s weights {short(p)} (parameter group {i}) "
                               f"differ from GradScaler's {short(want)}: unscale the gradients of every parameter "
                               "group (divide by the scale) before optimizer.step().")
                    break
        _stop_with_best(failure, ("every gradient of every parameter group",))
        watch['seen'].clear()
    after = scaler.get_scale()
    failure = None
    if not math.isclose(after, oracle.get_scale(), rel_tol=1e-6):
        failure = (f"{setup}: after the last update(), get_scale() = {after:g}, GradScaler's is {oracle.get_scale():g}: "
                   f"{_scale_hint(bad, steps, cfg)}.")
    _stop_if_any(failure)
    return None


def _stop_with_best(failure, prefer=()):
    """Every rank raises the same message when some rank found a problem: the first that holds a phrase of
    ``prefer`` (the rank that saw the cause explains best), else the lowest rank's."""
    found = [f for f in share(failure) if f]
    if not found:
        return
    for phrase in prefer:
        for f in found:
            if phrase in f:
                raise AssertionError(f)
    raise AssertionError(found[0])


def _scale_hint(bad, step, cfg):
    last = max((s for s in bad if s < step), default=None)
    return (f"after a skipped step multiply the scale by backoff_factor ({cfg['backoff_factor']}) and restart the "
            f"count; after growth_interval ({cfg['growth_interval']}) steps in a row without inf/NaN, multiply it "
            f"by growth_factor ({cfg['growth_factor']}) and restart the count"
            + (f" (the last skipped step was {last})" if last is not None else ""))


def check_DynamicLossScaler(DynamicLossScaler):
    """14 steps on 3 and 5 ranks and on 4 ranks as two groups of 2, an optimizer of 3 parameter groups, inf and NaN
    on drawn ranks at drawn steps in the second or third group: which steps are taken, step()'s results (the
    optimizer's, or None when it skips), the gradients unscaled in place, weights and scales equal GradScaler's on
    the dense model; one all-reduce of a flag over the scaler's group in step(), made before the optimizer steps."""
    seed = draw_seed()
    for world, pairs in ((3, False), (4, True), (5, False)):
        run_on_workers(_scaler_probe, DynamicLossScaler, seed + world, 14, pairs, world_size=world,
                       what=f"DynamicLossScaler (seed {seed})", timeout=PROBE_TIMEOUT_SCALER)
