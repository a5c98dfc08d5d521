"""``DynamicLossScaler`` (09, exercise 3): drawn settings and overflows, the probe that runs the student's scaler in
the sandbox (``drivers.scaler_steps``) and ``torch.amp.GradScaler("cpu")`` on the dense model in the host, the
judgement of each step, and the hints."""

from __future__ import annotations

import math
import random

import torch

from .._common import BUILT_INS, call_student, draw_seed, in_sandbox, run_on_workers, share, short
from . import drivers

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


_VALUES = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


def _phases(calls, rank: int) -> list:
    """The host's record split at the driver's ``PHASE`` marks (broadcasts on this rank's own group): one list per
    phase, a ``STEPPED`` mark kept as the string "stepped" where the optimizer was stepped."""
    out = [[]]
    for c in calls:
        if c.kind == "broadcast" and tuple(c.group) == (rank,) and c.nbytes in (len(drivers.PHASE),
                                                                                 len(drivers.STEPPED)):
            if c.nbytes == len(drivers.PHASE):
                out.append([])
            else:
                out[-1].append("stepped")
        else:
            out[-1].append(c)
    return out


def _scaler_probe(Scaler, seed: int, steps: int, pairs: bool = False):
    """The student's scaler for ``steps`` steps in the sandbox (one call of ``drivers.scaler_steps``); the oracle,
    ``torch.amp.GradScaler`` on the dense model, steps in the host afterwards, and each step is judged from the
    values the driver returned and from the host's record, split at the driver's marks."""
    import torch.distributed as dist

    from labsupport import CommCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    me, members, in_group = rank, None, ""
    if pairs:  # two groups of 2, each its own model, scaler and overflows: a rank must agree within its group only
        members = (2 * (rank // 2), 2 * (rank // 2) + 1)
        seed += 1000 * (rank // 2)
        in_group = f" as two groups of 2 (global ranks {list(members)}: group ranks 0 and 1, group=their group)"
        rank, world = rank % 2, 2
    cfg, bad = _scaler_plan(seed, world, steps)
    gen = torch.Generator().manual_seed(seed)
    sizes = [random.Random(seed + i).randint(1, 5) for i in range(3)]
    dense_w = [torch.randn(world * s, generator=gen) for s in sizes]
    coeffs = [[torch.randn(world * s, generator=gen) for s in sizes] for _ in range(steps)]

    def mine(tensors):
        return [t[rank * s:(rank + 1) * s].clone() for t, s in zip(tensors, sizes)]

    overflows = {step: [(1 + step % 2, step % sizes[1 + step % 2], _VALUES[ranks[rank]])]
                 for step, ranks in bad.items() if rank in ranks}  # in the second or the third parameter group
    setup = (f"DynamicLossScaler(**{cfg}) on {world} ranks{in_group}, each rank stepping its own shards with an "
             f"optimizer of 3 parameter groups (seed {seed})")
    # the oracle: the dense model (every rank's shards side by side) and torch's GradScaler, made first (a sandbox
    # forked after it has what building an optimizer imports)
    dense = [torch.nn.Parameter(w.clone()) for w in dense_w]
    dense_opt = torch.optim.SGD(drivers._param_groups(dense, torch.nn.Parameter(torch.zeros(2))), lr=0.05,
                                momentum=0.9)
    oracle = torch.amp.GradScaler("cpu", **cfg)
    with CommCounter() as cc:  # the host's record of what the sandbox asked it to carry
        out = call_student(setup, Scaler, cfg, pairs, mine(dense_w), [mine(c) for c in coeffs], overflows, steps)
    phases = _phases(list(cc.calls), me)
    found, records = None, out["steps"]
    if len(phases) != 2 + 3 * (steps if "after" in out else len(records) - 1):
        found = (0, f"{setup}: rank {rank} made broadcasts on a group of its own that grading could not tell from "
                    "its own marks: communicate only in step(), with one all-reduce.")
    for step, record in enumerate(records if found is None else ()):
        failure = _judge_step(step, record, phases, oracle, dense, dense_opt, coeffs[step], sizes, bad, cfg, rank,
                              members, setup)
        if failure:
            found = (step, failure)
            break
    else:
        after = out.get("after")
        if found is None and (not isinstance(after, (int, float)) or isinstance(after, bool)
                              or not math.isclose(after, oracle.get_scale(), rel_tol=1e-6)):
            found = (steps, f"{setup}: after the last update(), get_scale() = {short(after)}, GradScaler's is "
                            f"{oracle.get_scale():g}: {_scale_hint(bad, steps, cfg)}.")
    _stop_with_best(share(found), ("every gradient of every parameter group",))
    return None


def _judge_step(step, record, phases, oracle, dense, dense_opt, coeffs, sizes, bad, cfg, rank, members, setup):
    """What is wrong with the student's step ``step`` (its record from the driver, the host's phases), or None;
    steps the oracle."""
    before, expected_scale = record["scale"], oracle.get_scale()
    if not isinstance(before, (int, float)) or isinstance(before, bool):
        return f"{setup}: get_scale() returned {short(before)}: return the scale as a Python float."
    if not math.isclose(before, expected_scale, rel_tol=1e-6):
        return (f"{setup}: before step {step}, get_scale() = {before:g}, GradScaler's is {expected_scale:g}: "
                f"{_scale_hint(bad, step, cfg)}.")
    if record["scaled"] is not None or "returned" not in record:
        return (f"{setup}: scale(loss) returned {short(record['scaled'])}: return loss * scale, a tensor backward can "
                "run on.")
    dense_opt.zero_grad()
    oracle.scale(sum((w * c).sum() + 0.01 * (w * w).sum() for w, c in zip(dense, coeffs))).backward()
    which = 1 + step % 2
    for r, what in bad.get(step, {}).items():
        dense[which].grad[r * sizes[which] + step % sizes[which]] = _VALUES[what]
    token = f"optimizer.step's result at step {step}"
    oracle_stepped = oracle.step(dense_opt, lambda: token) is not None
    oracle.update()
    unscaled = torch.cat([d.grad[rank * s:(rank + 1) * s] for d, s in zip(dense, sizes)])
    in_step, in_update = phases[2 + 3 * step], phases[3 + 3 * step]
    stepped = "stepped" in in_step
    calls = [c for c in in_step if c != "stepped"]
    reduces = [c for c in calls if c.kind == "all_reduce"]
    where = ", ".join(f"rank {r}: {v}" for r, v in sorted(bad.get(step, {}).items()))
    call = ("step(optimizer)", "step(optimizer, closure)", "step(optimizer, closure=closure)")[step % 3]
    wanted = token if stepped and step % 3 else None
    returned = record["returned"]
    if members is not None and reduces and tuple(reduces[0].group) != members:
        return (f"{setup}: step() on rank {rank} all-reduced over ranks {list(reduces[0].group)}: agree within the "
                "scaler's group only (pass group=self.group to dist.all_reduce).")
    if stepped != oracle_stepped:
        if not stepped:
            return (f"{setup}: at step {step} rank {rank} skipped, though every gradient on every rank was finite: "
                    "skip only when some rank found an inf or a NaN (and step the optimizer it is given otherwise).")
        own = bad.get(step, {}).get(rank)
        hint = (f"its own gradient held {own}, in parameter group {which}: look at every gradient of every parameter "
                "group (optimizer.param_groups), for NaN too (torch.isfinite, not only torch.isinf)" if own else
                "agree with the other ranks (all-reduce a found-inf flag with MAX over the group) before deciding: "
                "one rank that steps while the others skip makes the replicas drift apart")
        return f"{setup}: at step {step} rank {rank} stepped although a gradient was not finite ({where}): {hint}."
    if not calls:
        return (f"{setup}: step() on rank {rank} made no communication call: the ranks must agree whether any of them "
                "found an inf or a NaN (all-reduce one flag, MAX) before any of them steps.")
    if len(calls) != 1 or len(reduces) != 1 or reduces[0].nbytes > 8:
        kinds = ", ".join(f"{c.kind} ({c.nbytes} B)" for c in calls[:5])
        return (f"{setup}: step() on rank {rank} made {kinds}: one all-reduce of one flag (a single number) is all "
                "the agreement needs.")
    if stepped and in_step.index("stepped") < in_step.index(reduces[0]):
        return (f"{setup}: at step {step} rank {rank} called optimizer.step() before the all-reduce of the flag: "
                "agree first, then step (or skip).")
    if (returned is not None or wanted is not None) and not (type(returned) is str and returned == wanted):
        return (f"{setup}: {call} at step {step} returned {short(returned)} on rank {rank}, which "
                + (f"stepped: return what optimizer.step(*args, **kwargs) returned ({wanted!r} here), passing on the "
                   "arguments step() was given, as GradScaler.step does." if wanted is not None else
                   "stepped: return what optimizer.step(*args, **kwargs) returned (None here, with no closure), as "
                   "GradScaler.step does." if stepped else
                   "skipped: return None when the step is skipped, as GradScaler.step does."))
    if in_update:
        return (f"{setup}: update() on rank {rank} communicated ({in_update[0].kind}): the ranks already agreed in "
                "step(), so update() needs no communication.")
    if not record["same"]:
        return (f"{setup}: at step {step}, step() on rank {rank} replaced a parameter's .grad with a new tensor: "
                "divide each gradient by the scale in place (p.grad.div_(scale)), as GradScaler's unscale_ does; "
                "DDP's buckets and FSDP's flat shards hold gradients as views of one buffer.")
    if stepped and not torch.allclose(record["flat"], unscaled, rtol=1e-5, atol=1e-6):
        return (f"{setup}: after step {step}, the buffer rank {rank}'s gradients are views of holds "
                f"{short(record['flat'])}, GradScaler's unscaled gradients are {short(unscaled)}: divide every "
                "gradient of every parameter group by the scale, in place.")
    for i, (p, d, s) in enumerate(zip(record["weights"], dense, sizes)):
        want = d.detach()[rank * s:(rank + 1) * s]
        if not torch.allclose(p, want, rtol=1e-5, atol=1e-6):
            return (f"{setup}: after step {step}, rank {rank}'s weights {short(p)} (parameter group {i}) differ from "
                    f"GradScaler's {short(want)}: unscale the gradients of every parameter group (divide by the "
                    "scale) before optimizer.step().")
    return None


def _stop_with_best(found, prefer=()):
    """Every rank raises the same message when some rank found a problem (``found``: each rank's (step, message) or
    None): of the earliest step's, the first that holds a phrase of ``prefer`` (the rank that saw the cause explains
    best), else the lowest rank's."""
    found = [f for f in found if f]
    if not found:
        return
    first = min(step for step, _ in found)
    messages = [m for step, m in found if step == first]
    for phrase in prefer:
        for m in messages:
            if phrase in m:
                raise AssertionError(m)
    raise AssertionError(messages[0])


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
    fn = in_sandbox(DynamicLossScaler, "DynamicLossScaler", driver=drivers.scaler_steps,
                    forbid=BUILT_INS["DynamicLossScaler"])
    for world, pairs in ((3, False), (4, True), (5, False)):
        run_on_workers(_scaler_probe, fn, seed + world, 14, pairs, world_size=world,
                       what=f"DynamicLossScaler (seed {seed})", timeout=PROBE_TIMEOUT_SCALER)
