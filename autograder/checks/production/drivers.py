"""What runs in the grading sandbox for notebook 09 (``in_sandbox(..., driver=...)``): the student's functions and
class called as each check needs them, on inputs the host drew.

This module travels by value to the sandbox, so it imports only the standard library and torch. What a driver
returns is the student's side's own report: the host compares its values with its own oracle and judges the
communication from its own record. A driver marks points of a scenario for the host with ``_mark``: a broadcast of
a few bytes on this rank's own one-rank group (it waits for no other rank), which the host's record shows among the
student's calls: ``PHASE`` between the calls of a scenario, ``STEPPED`` when the optimizer is stepped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

PHASE, STEPPED = b"\x00", b"\x00\x01"


def _own_group():
    """This rank's one-rank group (every rank makes every rank's, in the same order)."""
    return [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]


def _pairs():
    """On four ranks, the group of two this rank belongs to (ranks 0 and 1, or 2 and 3)."""
    return [dist.new_group([0, 1]), dist.new_group([2, 3])][dist.get_rank() // 2]


def _mark(group, payload: bytes = PHASE) -> None:
    dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=dist.get_rank(), group=group)


def _outcome(fn, *args, **kwargs) -> tuple:
    """("ok", what ``fn`` returned) or ("raised", the exception's name, its message)."""
    try:
        return ("ok", fn(*args, **kwargs))
    except NotImplementedError:
        raise
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc)[:500])


def _called(what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, AssertionError):
        raise
    except Exception as exc:
        raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}") from None


# ---------------------------------------------------------------------------------------------------------------
# shard_indices, clip_grad_norm_, DynamicLossScaler


def deal(shard_indices, cases, global_seeds, bad_ranks):
    """``shard_indices`` on every case, the global random state seeded afresh before each (it must play no part),
    then on every rank out of range: the outcome of each call."""
    out = []
    for (n, world, rank, epoch, seed, shuffle, drop_last), global_seed in zip(cases, global_seeds):
        torch.manual_seed(global_seed)
        out.append(_outcome(shard_indices, n, world, rank, epoch=epoch, seed=seed, shuffle=shuffle,
                            drop_last=drop_last))
    return out + [_outcome(shard_indices, *bad) for bad in bad_ranks]


def _bucket(params):
    """Make the gradients views of one flat buffer, as DDP's buckets and FSDP's flat shards hold them."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
    start = 0
    for p in params:
        if p.grad is not None:
            p.grad = flat[start:start + p.grad.numel()].view(p.shape)
            start += p.grad.numel()
    return flat


def clip_once(clip, tensors, replicated, max_norm, norm_type, form, norm_arg, pairs):
    """One call of ``clip_grad_norm_`` on this rank's parameters (``tensors``: weight, gradient or None, trainable),
    every gradient a view of one flat buffer; ``form`` "list", "generator" or "single" (the first parameter, alone);
    ``norm_arg`` "positional", "keyword" or None; ``pairs``: the group is this rank's group of two."""
    group = _pairs() if pairs else None
    params = []
    for w, g, trainable in tensors:
        p = torch.nn.Parameter(w, requires_grad=trainable)
        p.grad = g
        params.append(p)
    flat = _bucket(params)
    before = [p.grad for p in params]
    arg = params[0] if form == "single" else (p for p in params) if form == "generator" else params
    kwargs = {"group": group} if form == "single" else {"group": group,
                                                        "replicated": [params[i] for i in replicated]}
    args = (arg, max_norm) + ((norm_type,) if norm_arg == "positional" else ())
    if norm_arg == "keyword":
        kwargs["norm_type"] = norm_type
    norm = clip(*args, **kwargs)
    return {"norm": norm, "grads": [p.grad for p in params], "same": [p.grad is g for p, g in zip(params, before)],
            "flat": flat}


def _param_groups(params, idle):
    """Three parameter groups with their own settings; the second holds a parameter that never gets a gradient."""
    return [{"params": [params[0]]}, {"params": [params[1], idle], "lr": 0.03, "momentum": 0.5},
            {"params": [params[2]], "lr": 0.08}]


def scaler_steps(Scaler, cfg, pairs, weights, coeffs, bad, steps):
    """The student's scaler for ``steps`` steps of this rank's shards (``weights``; ``coeffs[step]`` the loss's) with
    an optimizer of three parameter groups; ``bad[step]``: (parameter, position, value) written into this rank's
    gradients after backward. Marks: ``PHASE`` after the constructor, after each step's get_scale, scale and
    backward, after step() and after update(); ``STEPPED`` when the optimizer is stepped."""
    group = _pairs() if pairs else None
    own = _own_group()
    mine = [torch.nn.Parameter(w) for w in weights]
    opt = torch.optim.SGD(_param_groups(mine, torch.nn.Parameter(torch.zeros(2))), lr=0.05, momentum=0.9)
    opt.register_step_pre_hook(lambda *args: _mark(own, STEPPED))
    scaler = _called(f"DynamicLossScaler(**{cfg}, group=...)", Scaler, group=group, **cfg)
    _mark(own)
    records = []
    for step in range(steps):
        record = {"scale": _called("get_scale()", scaler.get_scale)}
        records.append(record)
        opt.zero_grad()
        loss = sum((w * c).sum() + 0.01 * (w * w).sum() for w, c in zip(mine, coeffs[step]))
        scaled = record["scaled"] = _called("scale(loss)", scaler.scale, loss)
        if not isinstance(scaled, torch.Tensor) or not scaled.requires_grad:
            return {"steps": records}
        record["scaled"] = None
        scaled.backward()
        for i, j, value in bad.get(step, ()):
            mine[i].grad[j] = value
        flat = _bucket(mine)
        grads = [p.grad for p in mine]
        _mark(own)
        # step(optimizer), step(optimizer, closure), step(optimizer, closure=closure) in turn
        token = f"optimizer.step's result at step {step}"
        args, kwargs = (((), {}), ((lambda: token,), {}), ((), {"closure": lambda: token}))[step % 3]
        call = ("step(optimizer)", "step(optimizer, closure)", "step(optimizer, closure=closure)")[step % 3]
        record["returned"] = _called(f"{call} at step {step}", scaler.step, opt, *args, **kwargs)
        _mark(own)
        _called(f"update() at step {step}", scaler.update)
        _mark(own)
        record.update(same=all(p.grad is g for p, g in zip(mine, grads)), flat=flat.clone(),
                      weights=[p.detach().clone() for p in mine])
    return {"steps": records, "after": _called("get_scale()", scaler.get_scale)}
