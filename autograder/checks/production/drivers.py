"""What runs in the grading sandbox for notebook 09 (``in_sandbox(..., driver=...)``): the student's functions and
class called as each check needs them, on inputs the host drew.

This module travels by value to the sandbox, so it imports only the standard library and torch. What a driver
returns is the student's side's own report: the host compares its values with its own oracle and judges the
communication from its own record. A driver marks points of a scenario for the host with ``_mark``: a broadcast of
a few bytes on this rank's own one-rank group (it waits for no other rank), which the host's record shows among the
student's calls: ``PHASE`` between the calls of a scenario, ``STEPPED`` when the optimizer is stepped, and in a save
stopped at each of its steps, the step in words (the host copies the folder then, while this rank waits).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from labsupport._driving import call_answer as _called

PHASE, STEPPED = b"\x00", b"\x00\x01"


def _own_group():
    """This rank's one-rank group (every rank makes every rank's, in the same order)."""
    return [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]


_MADE: dict = {}  # the groups of two, made once per task (this module is unpickled afresh for each)


def _pairs():
    """On four ranks, the group of two this rank belongs to (ranks 0 and 1, or 2 and 3)."""
    if "pairs" not in _MADE:
        _MADE["pairs"] = [dist.new_group([0, 1]), dist.new_group([2, 3])][dist.get_rank() // 2]
    return _MADE["pairs"]


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


# ---------------------------------------------------------------------------------------------------------------
# save_sharded / load_resharded: what this process does on disk, below the student's Python (Python's audit events,
# raised just before each call)

#: The audit events of the calls that change what a crash leaves on disk (``open`` counts when it writes).
CHANGES = ("open", "os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.truncate")
# While a save is watched: ``writes``, the paths opened for writing or renamed onto; ``on_step``, called with
# (description, the path an open creates or empties, or None) before each change under ``root``.
_STATE = {"writes": None, "on_step": None, "root": "", "busy": False}
_HOOKED: list = []


def _writing(args) -> bool:
    mode, flags = args[1], args[2]
    if isinstance(mode, str):
        return any(ch in mode for ch in "wax+")
    return isinstance(flags, int) and bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))


def _full(path, dir_fd=-1) -> str | None:
    """The absolute path of ``path`` (relative to ``dir_fd`` when one is given), its last component not resolved
    (a symlink renamed onto is the link, not its target)."""
    if isinstance(path, int) or path is None:
        try:
            path = os.readlink(f"/proc/self/fd/{int(path)}")
        except (OSError, TypeError, ValueError):
            return None
    path = os.fsdecode(path)
    if not os.path.isabs(path) and isinstance(dir_fd, int) and dir_fd >= 0:
        try:
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        except OSError:
            return None
    path = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def _step(event, args, root: str):
    """(description, the path an open creates or empties, or None) of a change under ``root``, or None."""
    def inside(p):
        return p is not None and (p + os.sep).startswith(root + os.sep)

    def rel(p):
        return os.path.relpath(p, root)

    if event == "open":
        path = _full(args[0])
        if not _writing(args) or not inside(path):
            return None
        flags = args[2] if isinstance(args[2], int) else 0
        empties = (isinstance(args[1], str) and "w" in args[1]) or bool(flags & os.O_TRUNC) or (
            bool(flags & os.O_CREAT) and not os.path.lexists(path))
        return f"opened {rel(path)} for writing", path if empties else None
    if event in ("os.rename", "os.link"):
        src, dst = _full(args[0], args[2]), _full(args[1], args[3])
        if not (inside(src) or inside(dst)):
            return None
        return f"{'renamed' if event == 'os.rename' else 'hard-linked'} {rel(src)} to {rel(dst)}", None
    if event == "os.symlink":
        dst = _full(args[1], args[2])
        return (f"made {rel(dst)} a symlink to {os.fsdecode(args[0])}", None) if inside(dst) else None
    dir_fd = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 2}.get(event)
    path = _full(args[0], args[dir_fd]) if dir_fd is not None else _full(args[0])
    if not inside(path) or (event == "os.mkdir" and os.path.lexists(path)):  # makedirs(exist_ok=True): no change
        return None
    verb = {"os.remove": "deleted", "os.rmdir": "removed the folder", "os.mkdir": "made the folder",
            "os.truncate": "truncated"}[event]
    return f"{verb} {rel(path)}", None


def _audit(event, args):
    state = _STATE
    if state["busy"] or (state["writes"] is None and state["on_step"] is None):
        return
    state["busy"] = True  # what the callback does is not the save's
    try:
        if state["writes"] is not None:
            if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) and _writing(args):
                state["writes"].append(os.path.realpath(os.fsdecode(args[0])))
            elif event == "os.rename":
                state["writes"].append(os.path.realpath(os.fsdecode(args[1])))
        if state["on_step"] is not None and event in CHANGES:
            step = _step(event, args, state["root"])
            if step is not None:
                state["on_step"](*step)
    except Exception:  # an audit hook must never break the call it watches
        pass
    finally:
        state["busy"] = False


def _hook() -> None:
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED.append(True)


def save_watched(save, shard, numel, directory, die=False):
    """``save(shard, numel, directory)``; returns the paths it opened for writing or renamed onto. ``die``: this
    rank is killed (SIGKILL) a second after the call began, before it saved anything."""
    if die:
        time.sleep(1.0)  # the others have a second to write (and, without a barrier, to commit) first
        os.kill(os.getpid(), signal.SIGKILL)
    _hook()
    _STATE["writes"] = []
    try:
        save(shard, numel, directory)
    finally:
        written, _STATE["writes"] = _STATE["writes"], None
    return sorted(set(written))


def save_stopped(save, shard, numel, directory, root):
    """``save(shard, numel, directory)`` stopped before every step that changes what is under ``root``: a mark that
    names the step (and the file an open creates or empties), during which the host copies ``root``."""
    own = _own_group()
    _hook()
    _STATE.update(on_step=lambda what, emptied: _mark(own, json.dumps([what, emptied]).encode()),
                  root=os.path.realpath(root))
    try:
        save(shard, numel, directory)
    finally:
        _STATE["on_step"] = None


def _settle() -> None:
    """Free what is garbage and give the free heap back to the system (glibc: blocks of 64 KiB and more straight
    from the kernel and back to it once freed), so that the resident size follows what is alive."""
    gc.collect()
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        libc.malloc_trim(0)
    except Exception:  # not glibc: the reading keeps what the allocator holds
        pass


def load_measured(load, directory):
    """``load(directory)`` between two barriers, at which the host reads the sandbox's counters: its outcome, and
    the bytes of the storage the returned tensor is a view of."""
    _settle()
    dist.barrier()
    out = _outcome(load, directory)
    if out[0] == "ok" and isinstance(out[1], torch.Tensor):
        out += (out[1].untyped_storage().nbytes(),)
    dist.barrier()
    return out


def load_each(load, directories):
    """``load(d)`` for each directory: the outcome of each call."""
    return [_outcome(load, d) for d in directories]
