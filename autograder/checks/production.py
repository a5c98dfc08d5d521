"""Checks for notebook 09_production: ``check_shard_indices``, ``check_clip_grad_norm_``, ``check_DynamicLossScaler``,
``check_save_sharded``.

Every oracle is PyTorch's own: ``DistributedSampler`` (after ``set_epoch``), ``torch.nn.utils.clip_grad_norm_`` on
the dense model in one process, ``torch.amp.GradScaler("cpu")`` on the dense model, and for checkpoints the values
the saving ranks held. Inputs and world sizes (odd ones too) are drawn at grading time; the seed is in every message.

How the answer was obtained is measured where the student's objects cannot reach:

* ``clip_grad_norm_``: ``CommCounter`` around the call: exactly one all-reduce, of one number (at most 8 bytes);
  a rank that does not communicate cannot know the global norm, and one that all-reduces per parameter moves more.
* ``DynamicLossScaler``: ``CommCounter`` around ``step()``: one all-reduce of a flag (at most 8 bytes), and a step
  pre-hook on the probe's optimizer notes, at the moment it is stepped, whether that all-reduce has been made; ``update()``
  communicates nothing. One rank's gradients get an inf or a NaN at drawn steps: every rank must skip together.
* ``save_sharded`` / ``load_resharded``: the kernel's own counters of the worker process. The bytes a loading rank
  read (``rchar`` of ``/proc/self/io``: everything passed through ``read``/``pread``, whichever Python or C code
  made the call) must be about the bytes of its shard, not the parameter's; the peak resident memory during the load
  (``VmHWM`` of ``/proc/self/status``, reset through ``/proc/self/clear_refs`` before the call; a memory-mapped file
  counts once its pages are touched) must stay well under the full parameter. The paths each saving rank opens for
  writing or renames onto (Python's audit events ``open`` and ``os.rename``) show whether several ranks wrote the
  same file (the metadata must be written once). A save during which one rank is killed (SIGKILL, after the others
  had a second to write) must leave the previous checkpoint loadable, with the previous values.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import sys
import tempfile

import torch

from ._common import call_student, draw_seed, run_on_workers, share, short
from ._common import stop_if_any as _stop_if_any

__all__ = ["check_shard_indices", "check_clip_grad_norm_", "check_DynamicLossScaler", "check_save_sharded",
           "reference_shard_indices"]

#: Seconds per probe: the checkpoint probes move tens of MB through the file system of a loaded machine.
PROBE_TIMEOUT_PRODUCTION = 60.0


# ---------------------------------------------------------------------------------------------------------------
# shard_indices


class _Range:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def reference_shard_indices(num_samples, num_replicas, rank, epoch=0, seed=0, shuffle=True, drop_last=False):
    """``DistributedSampler``'s indices, taken from ``DistributedSampler`` itself."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(_Range(num_samples), num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def _diagnose_indices(got, num_samples, num_replicas, rank, epoch, seed, shuffle, drop_last):
    """A hint for the likeliest mistake behind a wrong list of indices."""
    expected = reference_shard_indices(num_samples, num_replicas, rank, epoch, seed, shuffle, drop_last)
    if len(got) != len(expected):
        if drop_last and num_samples % num_replicas:
            return (f"with drop_last=True each rank gets floor({num_samples}/{num_replicas}) = {len(expected)} "
                    "indices: cut the (shuffled) list to num_replicas * that many, dropping the tail, no padding")
        if num_samples % num_replicas:
            return (f"with drop_last=False each rank gets ceil({num_samples}/{num_replicas}) = {len(expected)} "
                    "indices: pad the list by repeating it from its start until its length is a multiple of "
                    "num_replicas (more than once when num_samples < num_replicas)")
        return f"each rank gets num_samples / num_replicas = {len(expected)} indices"
    if shuffle:
        wrong_epoch = reference_shard_indices(num_samples, num_replicas, rank, 0, seed, shuffle, drop_last)
        if epoch and got == wrong_epoch:
            return ("these are epoch 0's indices: shuffle with a torch.Generator seeded with seed + epoch, so that "
                    "every epoch has its own order")
    full = (torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
            if shuffle else list(range(num_samples)))
    if sorted(got) != sorted(expected) and set(got) <= set(full):
        per = len(expected)
        padded = (full * (1 + (num_replicas * per) // max(num_samples, 1)))[:num_replicas * per]
        if got == padded[rank * per:(rank + 1) * per]:
            return ("this is a contiguous block: DistributedSampler deals the indices out in turn, rank r taking "
                    "positions r, r + num_replicas, r + 2*num_replicas, ... (indices[rank::num_replicas])")
    if sorted(got) == sorted(expected):
        return "the right indices in the wrong order: keep the permutation's order, then take indices[rank::num_replicas]"
    if shuffle:
        return ("shuffle with torch.randperm(num_samples, generator=g), g = torch.Generator() seeded with seed + "
                "epoch (the global random state must play no part)")
    return "without shuffling the list starts as 0, 1, ..., num_samples - 1"


def check_shard_indices(shard_indices):
    """Drawn sizes, ranks, epochs, seeds, shuffle and drop_last against DistributedSampler; ValueError for a bad rank."""
    seed0 = draw_seed()
    rng = random.Random(seed0)
    cases = [(10, 3, r, 0, 0, True, False) for r in range(3)] + [(2, 5, r, 1, 3, True, False) for r in range(5)]
    cases += [(11, 4, 3, 2, 7, True, True), (7, 7, 6, 0, 0, False, False), (1, 3, 2, 4, 1, True, False)]
    for _ in range(60):
        n = rng.choice([rng.randint(1, 12), rng.randint(13, 200)])
        world = rng.choice([1, 2, 3, 4, 5, 7, 8])
        cases.append((n, world, rng.randrange(world), rng.randint(0, 9), rng.randint(0, 1000), rng.random() < 0.8,
                      rng.random() < 0.4))
    for n, world, rank, epoch, seed, shuffle, drop_last in cases:
        if drop_last and n < world:
            drop_last = False  # DistributedSampler itself gives every rank nothing: legal, but not instructive
        call = (f"shard_indices({n}, {world}, {rank}, epoch={epoch}, seed={seed}, shuffle={shuffle}, "
                f"drop_last={drop_last})")
        torch.manual_seed(rng.randint(0, 10**6))  # the global state must not matter
        try:
            got = call_student(call, shard_indices, n, world, rank, epoch=epoch, seed=seed, shuffle=shuffle,
                               drop_last=drop_last)
        except NotImplementedError:
            raise AssertionError("shard_indices is not started: it still raises NotImplementedError.") from None
        if isinstance(got, torch.Tensor):
            raise AssertionError(f"{call} returned a tensor: return a list of ints (.tolist()).")
        if not isinstance(got, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in got):
            raise AssertionError(f"{call} returned {short(got)}: return a list of Python ints.")
        expected = reference_shard_indices(n, world, rank, epoch, seed, shuffle, drop_last)
        if list(got) != expected:
            hint = _diagnose_indices(list(got), n, world, rank, epoch, seed, shuffle, drop_last)
            raise AssertionError(f"{call} = {short(list(got))}, DistributedSampler gives {short(expected)}: {hint} "
                                 f"(seed {seed0}).")
    for bad in [(10, 3, 3), (10, 3, -1), (5, 2, 7)]:
        try:
            shard_indices(*bad)
        except ValueError:
            continue
        except NotImplementedError:
            raise AssertionError("shard_indices is not started: it still raises NotImplementedError.") from None
        except Exception as exc:
            raise AssertionError(f"shard_indices{bad} raised {type(exc).__name__}: raise ValueError when rank is not "
                                 "in [0, num_replicas), as DistributedSampler does.") from None
        raise AssertionError(f"shard_indices{bad} returned instead of raising ValueError: rank must be in "
                             "[0, num_replicas), as DistributedSampler requires.")


# ---------------------------------------------------------------------------------------------------------------
# clip_grad_norm_


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


# ---------------------------------------------------------------------------------------------------------------
# DynamicLossScaler


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
    dense_opt = torch.optim.SGD(dense, lr=0.05, momentum=0.9)
    oracle = torch.amp.GradScaler("cpu", **cfg)
    mine = [torch.nn.Parameter(w[rank * s:(rank + 1) * s].clone()) for w, s in zip(dense_w, sizes)]
    opt = torch.optim.SGD(mine, lr=0.05, momentum=0.9)
    # when the optimizer is stepped, note how many all-reduces the counter around step() has seen so far (a hook of
    # torch's own: a subclass's step would be wrapped by torch.optim at construction, which grading refuses), as the
    # warden recorded them while the student's code still runs
    watch = {"counter": None, "seen": []}

    def note(optimizer, args, kwargs):
        counter = watch["counter"]
        calls = [] if counter is None else recorded_calls(counter)
        watch["seen"].append(sum(kind == "all_reduce" for kind, *_ in calls))

    opt.register_step_pre_hook(note)
    setup = (f"DynamicLossScaler(**{cfg}) on {world} ranks{in_group}, each rank stepping its own shards "
             f"(seed {seed})")
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
        for r, what in bad.get(step, {}).items():
            value = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}[what]
            j = step % sizes[1]
            dense[1].grad[r * sizes[1] + j] = value
            if r == rank:
                mine[1].grad[j] = value
        watch["counter"] = cc = CommCounter()
        try:
            with cc:
                stepped = call_student(f"step(optimizer) at step {step}", scaler.step, opt)
        finally:
            watch["counter"] = None
        oracle_stepped = sum(1 for r in bad.get(step, {})) == 0
        oracle.step(dense_opt)
        oracle.update()
        with CommCounter() as cc_update:
            call_student(f"update() at step {step}", scaler.update)
        where = ", ".join(f"rank {r}: {v}" for r, v in sorted(bad.get(step, {}).items()))
        calls = list(cc.calls)
        reduces = [c for c in calls if c.kind == "all_reduce"]
        if not isinstance(stepped, bool):
            failure = (f"{setup}: step() returned {short(stepped)} at step {step}: return True if it stepped, else "
                       "False.")
        elif members is not None and reduces and tuple(reduces[0].group) != members:
            failure = (f"{setup}: step() on rank {rank} all-reduced over ranks {list(reduces[0].group)}: agree within "
                       "the scaler's group only (pass group=self.group to dist.all_reduce).")
        elif stepped != oracle_stepped:
            if stepped:
                own = bad.get(step, {}).get(rank)
                hint = (f"its own gradient held {own}: look for NaN too (torch.isfinite, not only torch.isinf)"
                        if own in ("nan",) else
                        "agree with the other ranks (all-reduce a found-inf flag with MAX over the group) before "
                        "deciding: one rank that steps while the others skip makes the replicas drift apart")
                failure = (f"{setup}: at step {step} rank {rank} stepped although a gradient was not finite "
                           f"({where}): {hint}.")
            else:
                failure = (f"{setup}: at step {step} rank {rank} skipped, though every gradient on every rank was "
                           "finite: skip only when some rank found an inf or a NaN.")
        elif not calls:
            failure = (f"{setup}: step() on rank {rank} made no communication call: the ranks must agree whether any "
                       "of them found an inf or a NaN (all-reduce one flag, MAX) before any of them steps.")
        elif len(calls) != 1 or len(reduces) != 1 or reduces[0].nbytes > 8:
            kinds = ", ".join(f"{c.kind} ({c.nbytes} B)" for c in calls[:5])
            failure = (f"{setup}: step() on rank {rank} made {kinds}: one all-reduce of one flag (a single number) "
                       "is all the agreement needs.")
        elif stepped and not watch['seen']:
            failure = (f"{setup}: at step {step} step() returned True on rank {rank} but never called "
                       "optimizer.step(): step the optimizer it is given.")
        elif stepped and watch['seen'][-1] < 1:
            failure = (f"{setup}: at step {step} rank {rank} called optimizer.step() before the all-reduce of the "
                       "flag: agree first, then step (or skip).")
        elif cc_update.calls:
            failure = (f"{setup}: update() on rank {rank} communicated ({cc_update.calls[0].kind}): the ranks already "
                       "agreed in step(), so update() needs no communication.")
        else:
            for i, (p, d, s) in enumerate(zip(mine, dense, sizes)):
                want = d.detach()[rank * s:(rank + 1) * s]
                if not torch.allclose(p.detach(), want, rtol=1e-5, atol=1e-6):
                    failure = (f"{setup}: after step {step}, rank {rank}'s weights {short(p)} differ from GradScaler's "
                               f"{short(want)}: unscale the gradients (divide by the scale) before optimizer.step().")
                    break
        _stop_with_best(failure, ("look for NaN",))
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
    """14 steps on 3 and 5 ranks and on 4 ranks as two groups of 2, inf and NaN on drawn ranks at drawn steps:
    step() results, weights and scales equal GradScaler's on the dense model; one all-reduce of a flag over the
    scaler's group in step(), made before the optimizer steps."""
    seed = draw_seed()
    for world, pairs in ((3, False), (4, True), (5, False)):
        run_on_workers(_scaler_probe, DynamicLossScaler, seed + world, 14, pairs, world_size=world,
                       what=f"DynamicLossScaler (seed {seed})")


# ---------------------------------------------------------------------------------------------------------------
# save_sharded / load_resharded

_WRITES: list | None = None  # while a save is watched: the paths this process opened for writing or renamed onto


def _audit(event, args):
    if _WRITES is None:
        return
    try:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(ch in mode for ch in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR))
            if writing and isinstance(path, (str, bytes, os.PathLike)):
                _WRITES.append(os.path.realpath(os.fsdecode(path)))
        elif event == "os.rename":
            _WRITES.append(os.path.realpath(os.fsdecode(args[1])))
    except Exception:  # an audit hook must never break the call it watches
        pass


_HOOKED = []


def _watch_writes():
    global _WRITES
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED.append(True)
    _WRITES = []


def _stop_watching() -> list:
    global _WRITES
    out, _WRITES = _WRITES or [], None
    return out


def _proc_io() -> dict:
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except OSError:
        return {}


def _values(numel: int, dtype, tag: int):
    """The whole parameter of checkpoint ``tag``: element i holds i + tag (exact in float32 up to 2^24)."""
    return torch.arange(numel, dtype=torch.float64).add_(tag).to(dtype)


def _padded_shard(full, rank: int, world: int):
    c = -(-full.numel() // world)
    out = torch.zeros(c, dtype=full.dtype)
    piece = full[rank * c:(rank + 1) * c]
    out[:piece.numel()] = piece
    return out


def _load_after_save(load_resharded, *args, world_size: int, what: str) -> None:
    """``_load_probe`` on workers right after a save returned on every rank: a missing file then means rank 0 made
    the checkpoint current before every rank had written (whether the loader sees it depends on timing)."""
    try:
        run_on_workers(_load_probe, load_resharded, *args, world_size=world_size, what=what,
                       timeout=PROBE_TIMEOUT_PRODUCTION)
    except AssertionError as exc:
        if "FileNotFoundError" not in str(exc) and "No such file" not in str(exc):
            raise
        raise AssertionError(f"{exc} A file of the checkpoint is missing after save_sharded returned on every rank: "
                             "rank 0 made the new checkpoint the current one before every rank had written its file. "
                             "Wait for every rank (dist.barrier()) before the rename.") from None


def _save_probe(save, numel, dtype_name, tag, directory, die_rank=None):
    import time

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    shard = _padded_shard(_values(numel, dtype, tag), rank, world)
    keep = shard.clone()
    if rank == die_rank:
        time.sleep(1.0)  # the others have a second to write (and, without a barrier, to commit) first
        os.kill(os.getpid(), 9)
    _watch_writes()
    try:
        call_student(f"save_sharded(shard, {numel}, directory) on {world} ranks", save, shard, numel, directory)
    finally:
        written = _stop_watching()
    failure = None
    if not torch.equal(shard, keep):
        failure = f"save_sharded changed rank {rank}'s shard: leave the tensor you are given untouched."
    reports = share((sorted(set(written)), failure))
    if any(f for _, f in reports):
        raise AssertionError(next(f for _, f in reports if f))
    by_path = {}
    for r, (paths, _) in enumerate(reports):
        for p in paths:
            by_path.setdefault(p, []).append(r)
    twice = sorted((p, rs) for p, rs in by_path.items() if len(rs) > 1)
    if twice and rank == 0:
        path, ranks = twice[0]
        raise AssertionError(f"save_sharded on {world} ranks: ranks {ranks} all wrote {os.path.basename(path)} "
                             f"({len(twice)} file(s) written by more than one rank): the metadata is the same for "
                             "every rank, write it once, on rank 0; every other file belongs to one rank.")
    return None


def _load_probe(load, numel, dtype_name, tag, directory, saved_world, check_memory, what_before):
    import torch.distributed as dist

    from labsupport.lessons.production import PeakMemory

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    expected = _padded_shard(_values(numel, dtype, tag), rank, world)
    needed = expected.numel() * expected.element_size()
    full_bytes = numel * expected.element_size()
    what = f"load_resharded(directory) on {world} ranks of a checkpoint saved on {saved_world}{what_before}"
    # a first call warms up what any loader needs once (imports read .py files, the allocator grows its arenas);
    # the second is measured
    first = call_student(what, load, directory)
    del first
    io0 = _proc_io()
    with PeakMemory() as peak:  # the kernel's peak resident memory, reset on entry
        got = call_student(what, load, directory)
    io1 = _proc_io()
    failure = None
    if not isinstance(got, torch.Tensor):
        failure = f"{what}: rank {rank} got {short(got)}: return this rank's shard as a 1-D tensor."
    elif got.dtype != dtype:
        failure = (f"{what}: rank {rank} got dtype {got.dtype}, the checkpoint holds {dtype}: keep the dtype in the "
                   "metadata.")
    elif got.dim() != 1 or got.numel() != expected.numel():
        failure = (f"{what}: rank {rank} got shape {tuple(got.shape)}, expected ({expected.numel()},): with M = "
                   f"{world} ranks each holds c = ceil({numel}/{world}) = {expected.numel()} elements, padding "
                   "included.")
    elif not torch.equal(got, expected):
        bad = (got != expected).nonzero()
        i = int(bad[0]) if len(bad) else 0
        g = rank * expected.numel() + i
        failure = (f"{what}: rank {rank}'s element {i} (element {g} of the padded parameter) is {got[i].item()!r}, "
                   f"expected {expected[i].item()!r}"
                   + (" (padding must be zero)" if g >= numel else
                      (f" (from checkpoint {'A' if tag == 1 else 'B'}, saved earlier)" if what_before else "")
                      + f": rank r of M needs elements [r*c, (r+1)*c) of the parameter; element e sits in the file "
                        f"of saving rank e // c_saved at position e % c_saved") + ".")
    elif got.untyped_storage().nbytes() > needed + 64:
        failure = (f"{what}: rank {rank}'s shard is a view of a buffer of {got.untyped_storage().nbytes()} bytes, its "
                   f"own {needed}: the rest stays in memory; read only your range (or .clone() the slice).")
    elif io0 and io1:
        read = io1["rchar"] - io0["rchar"]
        if read > needed * 1.25 + 128 * 1024:
            failure = (f"{what}: rank {rank} read {read} bytes from files (the kernel's count), its shard is "
                       f"{needed} bytes and the parameter {full_bytes}: seek to the byte ranges this rank needs and "
                       "read only those (f.seek(offset); f.read(nbytes), or np.fromfile(f, dtype, count, offset)).")
    grown = peak.grown
    if failure is None and check_memory and world >= 4 and grown == grown:  # nan: no peak to reset on this system
        if grown > 2.5 * needed + (2 << 20) and grown > 0.6 * full_bytes:
            failure = (f"{what}: rank {rank}'s memory grew by {grown / 2**20:.1f} MiB during the load (the peak the "
                       f"kernel saw), its shard is {needed / 2**20:.1f} MiB and the whole parameter "
                       f"{full_bytes / 2**20:.1f} MiB: never build the full parameter; read each needed range straight "
                       "into your shard.")
    _stop_if_any(failure)
    return None


def _checkpoint_plan(seed: int):
    rng = random.Random(seed)
    dtype = rng.choice(["float32", "float32", "float64"])
    elt = 4 if dtype == "float32" else 8
    numel = rng.randint(3 << 20, 4 << 20) // elt * 4 + rng.choice([1, 3, 5, 7])  # about 12-16 MB, never even
    first = rng.choice([2, 3])
    # the first load on 4 or 5 ranks: a shard is then at most a quarter of the parameter, so building the whole
    # parameter shows clearly in the peak memory
    loads = [rng.choice([4, 5]), rng.choice([w for w in (1, 2, 3, 4, 5) if w != first])]
    second = rng.choice([w for w in (2, 3, 4) if w != first])
    return dtype, numel, first, loads, second


def check_save_sharded(save_sharded, load_resharded):
    """A checkpoint saved on N ranks loaded on M != N (odd sizes, padding): exact shards, only the needed bytes read,
    no full parameter in memory, metadata written once; a save killed half-way leaves the previous checkpoint; a
    save over a checkpoint of another world size replaces it."""
    seed = draw_seed()
    dtype, numel, first, loads, second = _checkpoint_plan(seed)
    base = tempfile.mkdtemp(prefix="ckpt-check-")
    directory = os.path.join(base, "checkpoint")
    what = f"save_sharded / load_resharded (seed {seed}, Ψ = {numel} {dtype})"
    try:
        run_on_workers(_save_probe, save_sharded, numel, dtype, 1, directory, world_size=first, what=what,
                       timeout=PROBE_TIMEOUT_PRODUCTION)
        if not os.path.exists(directory):
            raise AssertionError(f"{what}: after save_sharded(shard, numel, directory) on {first} ranks, nothing is "
                                 "at directory: save the checkpoint there (a directory of files).")
        _load_after_save(load_resharded, numel, dtype, 1, directory, first, True, "", world_size=loads[0], what=what)
        # a save of checkpoint B during which one rank is killed: A must still load, with A's values
        die = first - 1
        try:
            run_on_workers(_save_probe, save_sharded, numel, dtype, 2, directory, die_rank=die, world_size=first,
                           what=what, timeout=PROBE_TIMEOUT_PRODUCTION)
        except AssertionError:
            pass  # expected: rank `die` was killed, and the others stopped (or failed) in their save
        else:
            raise AssertionError(f"{what}: save_sharded returned on every rank though rank {die} was killed before it "
                                 "saved anything: wait for every rank (dist.barrier()) before making the new "
                                 "checkpoint the current one.")
        try:
            run_on_workers(_load_probe, load_resharded, numel, dtype, 1, directory, first, False,
                           f", after a save of new values was interrupted (rank {die} was killed before it wrote)",
                           world_size=loads[1], what=what, timeout=PROBE_TIMEOUT_PRODUCTION)
        except AssertionError as exc:
            raise AssertionError(f"{exc} A save interrupted half-way must leave the previous checkpoint as it was: "
                                 "write every file under a temporary name (or directory) first and make it the "
                                 "checkpoint with os.replace / os.rename only after every rank has written "
                                 "(dist.barrier()), on rank 0.") from None
        # a complete save of B on another world size, over A: B loads
        run_on_workers(_save_probe, save_sharded, numel, dtype, 2, directory, world_size=second, what=what,
                       timeout=PROBE_TIMEOUT_PRODUCTION)
        _load_after_save(load_resharded, numel, dtype, 2, directory, second, True,
                         f", saved over an older checkpoint of {first} ranks", world_size=first, what=what)
    finally:
        shutil.rmtree(base, ignore_errors=True)
