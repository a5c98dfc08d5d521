"""autograder.checks.production: correct implementations pass; planted bugs lose the points with the right message.

Each exercise has the notebook's way and a correct alternative written differently (a sampler built from
arithmetic instead of padding a list; replicated parameters divided by N instead of counted on one rank, in
float64, clipped with ``*=``; a scaler agreeing with a SUM of counts; a checkpoint whose current version is a
symlink swapped atomically, loaded with np.fromfile). The bugs are the ones people make: contiguous blocks, the epoch
forgotten, padding once or from the wrong end, drop_last ignored, a message of its own for a bad rank; replicated
parameters counted N times, no all-reduce, one all-reduce per parameter, norms added, a single Tensor iterated row by
row, norm_type ignored, the inf norm all-reduced with SUM, gradients replaced instead of clipped in place; ranks
that decide alone, NaN not looked for, a flag agreed after stepping, a growth count not restarted, only the first
parameter group unscaled, gradients replaced instead of unscaled in place, True/False returned instead of the
optimizer's result, the step's arguments dropped; a loader that reads whole files, builds the whole parameter or
ignores the saved dtype, metadata written by every rank, files overwritten in place, a commit without waiting for
the other ranks, the previous checkpoint deleted before the commit, the metadata rewritten in place.
"""

import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist

from autograder.checks.production import (
    check_clip_grad_norm_,
    check_DynamicLossScaler,
    check_save_sharded,
    check_shard_indices,
)

# ---------------------------------------------------------------------------------------------------------------
# shard_indices


def si_ok(num_samples, num_replicas, rank, epoch=0, seed=0, shuffle=True, drop_last=False):
    if not 0 <= rank < num_replicas:
        raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        indices = torch.randperm(num_samples, generator=g).tolist()
    else:
        indices = list(range(num_samples))
    if drop_last:
        indices = indices[:num_samples // num_replicas * num_replicas]
    else:
        total = math.ceil(num_samples / num_replicas) * num_replicas
        while len(indices) < total:
            indices += indices[:total - len(indices)]
    return indices[rank::num_replicas]


def si_arithmetic(num_samples, num_replicas, rank, epoch=0, seed=0, shuffle=True, drop_last=False):
    """Correct alternative: position p of rank r is element (r + p·N) mod num_samples of the permutation."""
    if rank < 0 or rank >= num_replicas:
        raise ValueError("Invalid rank %d, rank should be in the interval [0, %d]" % (rank, num_replicas - 1))
    perm = (torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch)) if shuffle
            else torch.arange(num_samples))
    per = num_samples // num_replicas if drop_last else -(-num_samples // num_replicas)
    return [int(perm[(rank + p * num_replicas) % num_samples]) for p in range(per)]


def si_contiguous(num_samples, num_replicas, rank, epoch=0, seed=0, shuffle=True, drop_last=False):
    full = si_ok(num_samples, 1, 0, epoch, seed, shuffle, False)
    per = -(-num_samples // num_replicas)
    full = (full * (num_replicas + 1))[:per * num_replicas]
    if not 0 <= rank < num_replicas:
        raise ValueError
    return full[rank * per:(rank + 1) * per]


def si_no_epoch(num_samples, num_replicas, rank, epoch=0, seed=0, shuffle=True, drop_last=False):
    return si_ok(num_samples, num_replicas, rank, 0, seed, shuffle, drop_last)


def si_pad_once(num_samples, num_replicas, rank, epoch=0, seed=0, shuffle=True, drop_last=False):
    indices = si_ok(num_samples, 1, 0, epoch, seed, shuffle, False)
    if not 0 <= rank < num_replicas:
        raise ValueError
    total = -(-num_samples // num_replicas) * num_replicas
    indices += indices[:total - len(indices)]          # short when num_samples < num_replicas
    return indices[rank::num_replicas]


def si_pad_from_end(num_samples, num_replicas, rank, epoch=0, seed=0, shuffle=True, drop_last=False):
    """Pads with the last indices of the permutation instead of its first ones."""
    if drop_last:
        return si_ok(num_samples, num_replicas, rank, epoch, seed, shuffle, drop_last)
    indices = si_ok(num_samples, 1, 0, epoch, seed, shuffle, False)
    if not 0 <= rank < num_replicas:
        raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
    total = -(-num_samples // num_replicas) * num_replicas
    while len(indices) < total:
        indices += indices[len(indices) - min(total - len(indices), num_samples):]
    return indices[rank::num_replicas]


def si_own_message(num_samples, num_replicas, rank, epoch=0, seed=0, shuffle=True, drop_last=False):
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
    return si_ok(num_samples, num_replicas, rank, epoch, seed, shuffle, drop_last)


def si_drop_last_ignored(num_samples, num_replicas, rank, epoch=0, seed=0, shuffle=True, drop_last=False):
    return si_ok(num_samples, num_replicas, rank, epoch, seed, shuffle, False)


def si_global_rng(num_samples, num_replicas, rank, epoch=0, seed=0, shuffle=True, drop_last=False):
    if not shuffle:
        return si_ok(num_samples, num_replicas, rank, epoch, seed, shuffle, drop_last)
    perm = torch.randperm(num_samples).tolist()
    return perm[rank::num_replicas]


def si_todo(*args, **kwargs):
    raise NotImplementedError()


def test_shard_indices_correct_passes():
    check_shard_indices(si_ok)
    check_shard_indices(si_arithmetic)


@pytest.mark.parametrize("impl, expected", [
    (si_contiguous, "contiguous block"),
    (si_no_epoch, "seed + epoch"),
    (si_pad_once, "more than once"),
    (si_pad_from_end, "the padding is not"),
    (si_own_message, "say what DistributedSampler says"),
    (si_drop_last_ignored, "drop_last=True"),
    (si_global_rng, "generator"),
    (si_todo, "not started: it still raises NotImplementedError"),
])
def test_shard_indices_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_shard_indices(impl)
    assert expected in str(info.value), str(info.value)


def test_shard_indices_without_value_error_fails():
    def no_check(num_samples, num_replicas, rank, **kwargs):
        if rank >= num_replicas or rank < 0:
            return []
        return si_ok(num_samples, num_replicas, rank, **kwargs)

    with pytest.raises(AssertionError, match="ValueError"):
        check_shard_indices(no_check)


# ---------------------------------------------------------------------------------------------------------------
# clip_grad_norm_


def _as_list(parameters):
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _norm_of(params, norm_type, group, once=(), divide=False):
    """One all-reduce of one number: the largest |g| (MAX) for inf, else the sum of |g|**p, replicated counted once
    (on the group's rank 0, or divided by the group's size on every rank)."""
    if norm_type == math.inf:
        local = torch.zeros(1)
        for p in params:
            local = torch.maximum(local, p.grad.detach().abs().max().float().reshape(1))
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local[0]
    n, first = dist.get_world_size(group), dist.get_rank(group) == 0
    local = torch.zeros(1)
    for p in params:
        share = p.grad.detach().float().abs().pow(norm_type).sum()
        if id(p) in once:
            share = share / n if divide else share * first
        local += share
    dist.all_reduce(local, group=group)
    return local[0] ** (1.0 / norm_type)


def clip_ok(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    params = [p for p in _as_list(parameters) if p.grad is not None]
    total = _norm_of(params, float(norm_type), group, {id(p) for p in replicated})
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.detach().mul_(coef)
    return total


def clip_divided(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    """Correct alternative: replicated |g|**p divided by the group's size on every rank; float64; per-parameter norms
    stacked (torch's own way); clipped with *= only when the norm is too large."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    rep = {id(p) for p in replicated}
    n, p_ = dist.get_world_size(group), float(norm_type)
    norms = torch.stack([torch.linalg.vector_norm(p.grad.double(), p_) for p in params])
    if p_ == math.inf:
        local = norms.max()
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        norm = local.float()
    else:
        weights = torch.tensor([1.0 / n if id(p) in rep else 1.0 for p in params], dtype=torch.float64)
        local = (norms.pow(p_) * weights).sum()
        dist.all_reduce(local, group=group)
        norm = local.pow(1.0 / p_).float()
    if norm > max_norm:
        for p in params:
            p.grad *= max_norm / (norm + 1e-6)
    return norm


def clip_double_count(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    return clip_ok(parameters, max_norm, norm_type, group=group, replicated=())


def clip_local(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    """Clips by this rank's own norm (torch.nn.utils.clip_grad_norm_'s arithmetic, no all-reduce)."""
    params = [p for p in _as_list(parameters) if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad, norm_type) for p in params]),
                                     norm_type)
    for p in params:
        p.grad.mul_((max_norm / (total + 1e-6)).clamp(max=1.0))
    return total


def clip_per_param(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    params = [p for p in parameters if p.grad is not None]
    once = {id(p) for p in replicated}
    sq = torch.zeros(())
    for p in params:
        s = p.grad.pow(2).sum()
        if id(p) in once:
            s = s / dist.get_world_size(group)
        dist.all_reduce(s, group=group)
        sq += s
    total = sq.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(coef)
    return total


def clip_vector(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    """All-reduces one square per parameter in one call: right norm, more than one number."""
    params = [p for p in parameters if p.grad is not None]
    once = {id(p) for p in replicated}
    n = dist.get_world_size(group)
    sq = torch.stack([p.grad.pow(2).sum() / (n if id(p) in once else 1) for p in params])
    dist.all_reduce(sq, group=group)
    total = sq.sum().sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(coef)
    return total


def clip_add_norms(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    params = [p for p in parameters if p.grad is not None]
    once = {id(p) for p in replicated}
    first = dist.get_rank(group) == 0
    sq = sum((p.grad.pow(2).sum() for p in params if id(p) not in once or first), torch.zeros(()))
    norm = sq.sqrt()
    dist.all_reduce(norm, group=group)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(coef)
    return norm


def clip_world_group(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    return clip_ok(parameters, max_norm, norm_type, group=None, replicated=replicated)


def clip_no_clamp(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    params = _as_list(parameters)
    total = clip_ok(params, float("inf"), norm_type, group=group, replicated=replicated)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(max_norm / (total + 1e-6))
    return total


def clip_skips_replicated(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    params = [p for p in _as_list(parameters) if p.grad is not None]
    rep = {id(p) for p in replicated}
    saved = {id(p): p.grad.clone() for p in params if id(p) in rep}
    total = clip_ok(params, max_norm, norm_type, group=group, replicated=replicated)
    for p in params:
        if id(p) in rep:
            p.grad.copy_(saved[id(p)])
    return total


def clip_twice_over_generator(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    """Iterates its argument twice: a generator (model.parameters()) is empty the second time."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    total = _norm_of([p for p in parameters if p.grad is not None], float(norm_type), group,
                     {id(p) for p in replicated})
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in parameters:
        if p.grad is not None:
            p.grad.mul_(coef)
    return total


def clip_new_tensors(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    """The right values, in new tensors: p.grad = p.grad * coef."""
    params = [p for p in _as_list(parameters) if p.grad is not None]
    total = _norm_of(params, float(norm_type), group, {id(p) for p in replicated})
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad = p.grad * coef
    return total


def clip_data_swap(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    """The same tensor object, its storage swapped: p.grad.data = p.grad * coef."""
    params = [p for p in _as_list(parameters) if p.grad is not None]
    total = _norm_of(params, float(norm_type), group, {id(p) for p in replicated})
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.data = p.grad.data * coef
    return total


def clip_rows(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    """list(parameters): a single Tensor becomes its rows, which have no .grad: nothing is clipped."""
    params = [p for p in list(parameters) if p.grad is not None]
    total = _norm_of(params, float(norm_type), group, {id(p) for p in replicated})
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.detach().mul_(coef)
    return total


def clip_two_norm_only(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    return clip_ok(parameters, max_norm, 2.0, group=group, replicated=replicated)


def clip_inf_summed(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    """The inf norm all-reduced with SUM: the ranks' largest |g| added."""
    params = [p for p in _as_list(parameters) if p.grad is not None]
    if float(norm_type) != math.inf:
        return clip_ok(params, max_norm, norm_type, group=group, replicated=replicated)
    local = torch.stack([p.grad.abs().max() for p in params]).max().reshape(1)
    dist.all_reduce(local, group=group)
    coef = (max_norm / (local + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(coef)
    return local[0]


def test_clip_correct_passes():
    check_clip_grad_norm_(clip_ok)
    check_clip_grad_norm_(clip_divided)


@pytest.mark.parametrize("impl, expected", [
    (clip_double_count, "counted"),
    (clip_local, "made no communication call"),
    (clip_per_param, "communication calls"),
    (clip_vector, "one number"),
    (clip_add_norms, "norms do not add"),
    (clip_world_group, "group"),
    (clip_no_clamp, "never scale up"),
    (clip_skips_replicated, "replicated ones included"),
    (clip_twice_over_generator, "generator"),
    (clip_new_tensors, "Clip in place"),
    (clip_data_swap, "Clip in place"),
    (clip_rows, "a single Tensor is one parameter"),
    (clip_two_norm_only, "with norm_type=inf the norm is the largest |g|"),
    (clip_inf_summed, "largest |g| were added"),
])
def test_clip_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_clip_grad_norm_(impl)
    assert expected in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# DynamicLossScaler


class ScalerOk:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, group=None):
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.group = group
        self._good = 0
        self._found_inf = False

    def scale(self, loss):
        return loss * self._scale

    def _local_found(self, optimizer):
        found = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(1.0 / self._scale)
                    found = found or not bool(torch.isfinite(p.grad).all())
        return found

    def step(self, optimizer, *args, **kwargs):
        flag = torch.tensor([1.0 if self._local_found(optimizer) else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self._found_inf = bool(flag.item())
        if self._found_inf:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self):
        if self._found_inf:
            self._scale *= self.backoff_factor
            self._good = 0
        else:
            self._good += 1
            if self._good == self.growth_interval:
                self._scale *= self.growth_factor
                self._good = 0

    def get_scale(self):
        return self._scale


class ScalerSumCount(ScalerOk):
    """Correct alternative: count the non-finite gradients and all-reduce the count (SUM, an int64); unscale with
    torch's foreach division; the result passed on through a variable that starts as None."""

    def step(self, optimizer, *args, **kwargs):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch._foreach_div_(grads, self._scale)
        count = torch.tensor([sum(int((~torch.isfinite(g)).sum()) for g in grads)])
        dist.all_reduce(count, group=self.group)
        self._found_inf = count.item() > 0
        result = None
        if not self._found_inf:
            result = optimizer.step(*args, **kwargs)
        return result


class ScalerAlone(ScalerOk):
    def step(self, optimizer, *args, **kwargs):
        self._found_inf = self._local_found(optimizer)
        if self._found_inf:
            return None
        return optimizer.step(*args, **kwargs)


class ScalerInfOnly(ScalerOk):
    def _local_found(self, optimizer):
        found = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(self._scale)
                    found = found or bool(torch.isinf(p.grad).any())
        return found


class ScalerAgreeAfter(ScalerOk):
    """Steps on its own decision, then agrees (too late: a rank already stepped)."""

    def step(self, optimizer, *args, **kwargs):
        local = self._local_found(optimizer)
        result = None if local else optimizer.step(*args, **kwargs)
        flag = torch.tensor([float(local)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self._found_inf = bool(flag.item())
        return result


class ScalerNoReset(ScalerOk):
    def update(self):
        if self._found_inf:
            self._scale *= self.backoff_factor
        else:
            self._good += 1
            if self._good % self.growth_interval == 0:
                self._scale *= self.growth_factor


class ScalerOffByOne(ScalerOk):
    def update(self):
        if self._found_inf:
            self._scale *= self.backoff_factor
            self._good = 0
        else:
            self._good += 1
            if self._good > self.growth_interval:
                self._scale *= self.growth_factor
                self._good = 0


class ScalerNoUnscale(ScalerOk):
    def _local_found(self, optimizer):
        return any(not bool(torch.isfinite(p.grad).all()) for g in optimizer.param_groups for p in g["params"]
                   if p.grad is not None)


class ScalerPerParam(ScalerOk):
    def step(self, optimizer, *args, **kwargs):
        self._local_found(optimizer)
        found = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                flag = torch.tensor([0.0 if bool(torch.isfinite(p.grad).all()) else 1.0])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
                found = found or bool(flag.item())
        self._found_inf = found
        return None if found else optimizer.step(*args, **kwargs)


class ScalerWorldGroup(ScalerOk):
    """Agrees over every rank instead of the scaler's group."""

    def step(self, optimizer, *args, **kwargs):
        flag = torch.tensor([1.0 if self._local_found(optimizer) else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._found_inf = bool(flag.item())
        return None if self._found_inf else optimizer.step(*args, **kwargs)


class ScalerUpdateTalks(ScalerOk):
    def update(self):
        dist.barrier(group=self.group)
        super().update()


class ScalerFirstGroup(ScalerOk):
    """Unscales and looks at optimizer.param_groups[0] only."""

    def _local_found(self, optimizer):
        found = False
        for p in optimizer.param_groups[0]["params"]:
            if p.grad is not None:
                p.grad.mul_(1.0 / self._scale)
                found = found or not bool(torch.isfinite(p.grad).all())
        return found


class ScalerNewGrads(ScalerOk):
    """Unscales into new tensors: p.grad = p.grad / scale (the optimizer still sees the right values)."""

    def _local_found(self, optimizer):
        found = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad = p.grad / self._scale
                    found = found or not bool(torch.isfinite(p.grad).all())
        return found


class ScalerReturnsBool(ScalerOk):
    """The notebook's earlier contract: True when it stepped, False when it skipped."""

    def step(self, optimizer, *args, **kwargs):
        super().step(optimizer, *args, **kwargs)
        return not self._found_inf


class ScalerDropsArguments(ScalerOk):
    def step(self, optimizer, *args, **kwargs):
        return super().step(optimizer)


def test_scaler_correct_passes():
    check_DynamicLossScaler(ScalerOk)
    check_DynamicLossScaler(ScalerSumCount)


@pytest.mark.parametrize("impl, expected", [
    (ScalerAlone, "made no communication call"),
    (ScalerInfOnly, "NaN"),
    (ScalerAgreeAfter, "before the all-reduce of the flag"),
    (ScalerNoReset, "restart the count"),
    (ScalerOffByOne, "growth_interval"),
    (ScalerNoUnscale, "unscale"),
    (ScalerPerParam, "one flag"),
    (ScalerUpdateTalks, "update() needs no communication"),
    (ScalerWorldGroup, "group=self.group"),
    (ScalerFirstGroup, "every parameter group"),
    (ScalerNewGrads, "in place"),
    (ScalerReturnsBool, "as GradScaler.step does"),
    (ScalerDropsArguments, "passing on the arguments"),
])
def test_scaler_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_DynamicLossScaler(impl)
    assert expected in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# save_sharded / load_resharded


def _meta(directory):
    with open(os.path.join(directory, "metadata.json")) as f:
        return json.load(f)


def save_ok(shard, numel, directory):
    """The metadata file is the commit: data goes to a new folder, then metadata.json is replaced atomically."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(directory, exist_ok=True)
    meta_path = os.path.join(directory, "metadata.json")
    generation = _meta(directory)["generation"] + 1 if os.path.exists(meta_path) else 0
    data = os.path.join(directory, f"data-{generation}")
    if rank == 0:
        shutil.rmtree(data, ignore_errors=True)       # left over by an interrupted save
        os.makedirs(data)
    dist.barrier()
    with open(os.path.join(data, f"shard_{rank}.bin"), "wb") as f:
        f.write(shard.detach().contiguous().view(torch.uint8).numpy())
    dist.barrier()                                      # every shard is on disk
    if rank == 0:
        meta = {"numel": numel, "world_size": world, "shard_numel": shard.numel(),
                "dtype": str(shard.dtype).replace("torch.", ""), "generation": generation, "data": f"data-{generation}"}
        with open(meta_path + ".tmp", "w") as f:
            json.dump(meta, f)
        os.replace(meta_path + ".tmp", meta_path)       # the commit
        shutil.rmtree(os.path.join(directory, f"data-{generation - 1}"), ignore_errors=True)
    dist.barrier()


def _ranges(meta, rank, world):
    """(saving rank, element offset in its file, offset in my shard, count) for this rank's elements."""
    numel, c_saved = meta["numel"], meta["shard_numel"]
    c = -(-numel // world)
    start, stop = rank * c, min((rank + 1) * c, numel)
    e, out = start, []
    while e < stop:
        src, off = divmod(e, c_saved)
        n = min(stop - e, c_saved - off)
        out.append((src, off, e - start, n))
        e += n
    return c, out


def load_ok(directory):
    return read_my_ranges(directory, _meta(directory))


def read_my_ranges(directory, meta):
    """This rank's shard under ``meta``, each overlapping range read from its saved shard file."""
    rank, world = dist.get_rank(), dist.get_world_size()
    c, ranges = _ranges(meta, rank, world)
    out = torch.zeros(c, dtype=getattr(torch, meta["dtype"]))
    elt = out.element_size()
    for src, off, at, n in ranges:
        with open(os.path.join(directory, meta["data"], f"shard_{src}.bin"), "rb") as f:
            f.seek(off * elt)
            f.readinto(out[at:at + n].view(torch.uint8).numpy())
    return out


def save_symlink(shard, numel, directory):
    """Correct alternative: each save in a folder of its own; `directory` is a symlink, swapped atomically."""
    rank, world = dist.get_rank(), dist.get_world_size()
    current = os.path.realpath(directory) if os.path.islink(directory) else None
    target = directory + (".b" if current and current.endswith(".a") else ".a")
    if rank == 0:
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(target)
    dist.barrier()
    shard.contiguous().view(torch.uint8).numpy().tofile(os.path.join(target, f"{rank}.raw"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(target, "meta.json"), "w") as f:
            json.dump([numel, world, shard.numel(), str(shard.dtype)[6:]], f)
        os.symlink(os.path.basename(target), directory + ".new")
        os.replace(directory + ".new", directory)
    dist.barrier()


def load_fromfile(directory):
    """Each needed range read as bytes with np.fromfile(count=, offset=) and viewed as the saved dtype (numpy has no
    bfloat16)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(directory, "meta.json")) as f:
        numel, _, c_saved, dtype = json.load(f)
    c, ranges = _ranges({"numel": numel, "shard_numel": c_saved}, rank, world)
    out = torch.zeros(c, dtype=getattr(torch, dtype))
    elt = out.element_size()
    for src, off, at, n in ranges:
        piece = np.fromfile(os.path.join(directory, f"{src}.raw"), dtype=np.uint8, count=n * elt, offset=off * elt)
        out[at:at + n] = torch.from_numpy(piece).view(out.dtype)
    return out


def load_whole_files(directory):
    """Reads every file it needs whole, then slices: the right values, more bytes read than needed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = _meta(directory)
    dtype = getattr(torch, meta["dtype"])
    c, ranges = _ranges(meta, rank, world)
    out = torch.zeros(c, dtype=dtype)
    for src, off, at, n in ranges:
        with open(os.path.join(directory, meta["data"], f"shard_{src}.bin"), "rb") as f:
            whole = torch.frombuffer(bytearray(f.read()), dtype=dtype)
        out[at:at + n] = whole[off:off + n]
    return out


def load_full(directory):
    """Builds the whole parameter from memory-mapped files, then cuts its shard out (no bytes read with read())."""
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = _meta(directory)
    dtype = getattr(torch, meta["dtype"])
    parts = [torch.from_file(os.path.join(directory, meta["data"], f"shard_{r}.bin"), size=meta["shard_numel"],
                             dtype=dtype) for r in range(meta["world_size"])]
    full = torch.cat(parts)[:meta["numel"]]
    c = -(-meta["numel"] // world)
    out = torch.zeros(c, dtype=dtype)
    piece = full[rank * c:(rank + 1) * c]
    out[:piece.numel()] = piece
    return out


def load_view(directory):
    """Reads only the needed files' ranges, but keeps its shard as a view of a bigger buffer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = _meta(directory)
    dtype = getattr(torch, meta["dtype"])
    c = -(-meta["numel"] // world)
    big = torch.zeros(c * world, dtype=dtype)
    mine = big[rank * c:(rank + 1) * c]
    mine.copy_(load_ok(directory))
    return mine


def save_meta_everywhere(shard, numel, directory):
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(directory, exist_ok=True)
    meta_path = os.path.join(directory, "metadata.json")
    generation = _meta(directory)["generation"] + 1 if os.path.exists(meta_path) else 0
    data = os.path.join(directory, f"data-{generation}")
    os.makedirs(data, exist_ok=True)
    with open(os.path.join(data, f"shard_{rank}.bin"), "wb") as f:
        f.write(shard.contiguous().view(torch.uint8).numpy())
    dist.barrier()
    meta = {"numel": numel, "world_size": world, "shard_numel": shard.numel(),
            "dtype": str(shard.dtype).replace("torch.", ""), "generation": generation, "data": f"data-{generation}"}
    with open(meta_path + f".tmp{rank}", "w") as f:
        json.dump(meta, f)
    os.replace(meta_path + f".tmp{rank}", meta_path)
    dist.barrier()


def save_in_place(shard, numel, directory):
    """Overwrites the current checkpoint's files: a save cut short mixes old and new shards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(os.path.join(directory, "data"), exist_ok=True)
    with open(os.path.join(directory, "data", f"shard_{rank}.bin"), "wb") as f:
        f.write(shard.contiguous().view(torch.uint8).numpy())
    dist.barrier()
    if rank == 0:
        with open(os.path.join(directory, "metadata.json"), "w") as f:
            json.dump({"numel": numel, "world_size": world, "shard_numel": shard.numel(),
                       "dtype": str(shard.dtype)[6:], "data": "data"}, f)
    dist.barrier()


def save_no_barrier(shard, numel, directory):
    """Commits as soon as rank 0 has written its own shard, without waiting for the others."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(directory, exist_ok=True)
    meta_path = os.path.join(directory, "metadata.json")
    generation = _meta(directory)["generation"] + 1 if os.path.exists(meta_path) else 0
    data = os.path.join(directory, f"data-{generation}")
    os.makedirs(data, exist_ok=True)
    with open(os.path.join(data, f"shard_{rank}.bin"), "wb") as f:
        f.write(shard.contiguous().view(torch.uint8).numpy())
    if rank == 0:
        meta = {"numel": numel, "world_size": world, "shard_numel": shard.numel(),
                "dtype": str(shard.dtype).replace("torch.", ""), "generation": generation, "data": f"data-{generation}"}
        with open(meta_path + ".tmp", "w") as f:
            json.dump(meta, f)
        os.replace(meta_path + ".tmp", meta_path)


def load_floor(directory):
    """Cuts the parameter into numel // world elements per rank: no padding, wrong ranges when N does not divide."""
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = _meta(directory)
    c = -(-meta["numel"] // world)
    floor = meta["numel"] // world
    out = torch.zeros(c, dtype=getattr(torch, meta["dtype"]))
    elt = out.element_size()
    e, at = rank * floor, 0
    while at < min(c, meta["numel"] - rank * floor):
        src, off = divmod(e, meta["shard_numel"])
        n = min(c - at, meta["shard_numel"] - off, meta["numel"] - e)
        with open(os.path.join(directory, meta["data"], f"shard_{src}.bin"), "rb") as f:
            f.seek(off * elt)
            f.readinto(out[at:at + n].view(torch.uint8).numpy())
        e, at = e + n, at + n
    return out


def load_float32(directory):
    """Ignores the saved dtype: every checkpoint read as float32."""
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = _meta(directory)
    c, ranges = _ranges(meta, rank, world)
    out = torch.zeros(c)
    for src, off, at, n in ranges:
        with open(os.path.join(directory, meta["data"], f"shard_{src}.bin"), "rb") as f:
            f.seek(off * 4)
            f.readinto(out[at:at + n].view(torch.uint8).numpy())
    return out


def _save_then(shard, numel, directory, before_commit=None, meta_in_place=False):
    """save_ok's steps, with a change: ``before_commit`` runs on rank 0 just before the commit; ``meta_in_place``
    writes metadata.json itself instead of a temporary file renamed onto it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(directory, exist_ok=True)
    meta_path = os.path.join(directory, "metadata.json")
    generation = _meta(directory)["generation"] + 1 if os.path.exists(meta_path) else 0
    data = os.path.join(directory, f"data-{generation}")
    if rank == 0:
        shutil.rmtree(data, ignore_errors=True)
        os.makedirs(data)
    dist.barrier()
    with open(os.path.join(data, f"shard_{rank}.bin"), "wb") as f:
        f.write(shard.detach().contiguous().view(torch.uint8).numpy())
    dist.barrier()
    if rank == 0:
        old = os.path.join(directory, f"data-{generation - 1}")
        if before_commit:
            before_commit(old)
        meta = {"numel": numel, "world_size": world, "shard_numel": shard.numel(),
                "dtype": str(shard.dtype).replace("torch.", ""), "generation": generation, "data": f"data-{generation}"}
        with open(meta_path if meta_in_place else meta_path + ".tmp", "w") as f:
            json.dump(meta, f)
        if not meta_in_place:
            os.replace(meta_path + ".tmp", meta_path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def save_deletes_first(shard, numel, directory):
    """Deletes the previous checkpoint's data after every rank has written, but before the commit."""
    _save_then(shard, numel, directory, before_commit=lambda old: shutil.rmtree(old, ignore_errors=True))


def save_meta_in_place(shard, numel, directory):
    """Rewrites metadata.json in place (open(..., "w")): a crash while it is written leaves no metadata."""
    _save_then(shard, numel, directory, meta_in_place=True)


def test_checkpoint_correct_passes():
    check_save_sharded(save_ok, load_ok)
    check_save_sharded(save_symlink, load_fromfile)


@pytest.mark.parametrize("save, load, expected", [
    (save_ok, load_whole_files, "read only those"),
    (save_ok, load_full, "never build the full parameter"),
    (save_ok, load_view, "view of a buffer"),
    (save_meta_everywhere, load_ok, "write it once, on rank 0"),
    (save_in_place, load_ok, "interrupted"),
    (save_no_barrier, load_ok, "barrier"),
    (save_ok, load_floor, "rank r of M needs elements"),
    (save_ok, load_float32, "dtype"),
    (save_deletes_first, load_ok, "a crash just before rank 0 deleted"),
    (save_meta_in_place, load_ok, "while rank 0 was writing checkpoint/metadata.json"),
])
def test_checkpoint_bugs_fail(save, load, expected):
    with pytest.raises(AssertionError) as info:
        check_save_sharded(save, load)
    assert expected in str(info.value), str(info.value)
