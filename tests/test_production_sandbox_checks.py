"""autograder.checks.production with the student's functions and class in the grading sandbox
(``labsupport._sandbox``): each check's points are decided in the host, from its own oracle, its own record of what
the sandbox asked it to carry, and the kernel's counters of the sandbox read from ``/proc``.

Cheats, each written as a student would, lose the points with a message that says why: the built-in an exercise
rebuilds used instead (``DistributedSampler`` in ``shard_indices``, ``torch.nn.utils.clip_grad_norm_`` in
``clip_grad_norm_``, a ``torch.amp.GradScaler`` kept inside, or subclassed, by ``DynamicLossScaler``, a checkpoint
saved through ``torch.distributed.checkpoint``), the check's own reference imported from the grader, and ranks that
pass data through a file outside the folder the checkpoint lies in. Honest habits (a print to stderr, a printed
traceback, a cached helper, ``import sys``) keep the points.
"""

import functools
import hashlib
import json
import math
import os
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
from test_production_checks import ScalerOk, load_ok, read_my_ranges, save_ok, si_ok

from autograder.checks.production import (
    check_clip_grad_norm_,
    check_DynamicLossScaler,
    check_save_sharded,
    check_shard_indices,
)

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------------------------------------------
# the built-in an exercise rebuilds


def si_sampler(num_samples, num_replicas, rank, epoch=0, seed=0, shuffle=True, drop_last=False):
    """DistributedSampler's own indices: what the check compares with."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(num_samples), num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_shard_indices_through_distributed_sampler_fails():
    with pytest.raises(AssertionError) as info:
        check_shard_indices(si_sampler)
    assert "shard_indices must not call DistributedSampler: it is what you are building" in str(info.value)


def si_from_the_grader(num_samples, num_replicas, rank, epoch=0, seed=0, shuffle=True, drop_last=False):
    """The check's own reference, imported under a name built from character codes (which no screen reads)."""
    import importlib

    name = "".join(map(chr, [97, 117, 116, 111, 103, 114, 97, 100, 101, 114]))
    sampling = importlib.import_module(name + ".checks.production.sampling")
    return sampling.reference_shard_indices(num_samples, num_replicas, rank, epoch, seed, shuffle, drop_last)


def test_shard_indices_from_the_graders_reference_fails(grader_out_of_reach):
    with pytest.raises(AssertionError) as info:
        check_shard_indices(si_from_the_grader)
    assert "the grader's modules are not available where your function runs" in str(info.value), str(info.value)


def clip_through_torch(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    """The local norm from torch's clip_grad_norm_ (max_norm=inf: it clips nothing), then one all-reduce."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    params = [p for p in params if p.grad is not None]
    once = {id(p) for p in replicated}
    p_ = float(norm_type)
    shard = [p for p in params if id(p) not in once]
    rep = [p for p in params if id(p) in once]
    local = torch.zeros(1)
    for part, weight in ((shard, 1.0), (rep, 1.0 / dist.get_world_size(group))):
        if part:
            norm = torch.nn.utils.clip_grad_norm_(part, math.inf, p_)
            local = torch.maximum(local, norm) if p_ == math.inf else local + weight * norm ** p_
    dist.all_reduce(local, op=dist.ReduceOp.MAX if p_ == math.inf else dist.ReduceOp.SUM, group=group)
    total = local[0] if p_ == math.inf else local[0] ** (1.0 / p_)
    for p in params:
        p.grad.mul_((max_norm / (total + 1e-6)).clamp(max=1.0))
    return total


def test_clip_through_torch_fails():
    with pytest.raises(AssertionError) as info:
        check_clip_grad_norm_(clip_through_torch)
    assert "clip_grad_norm_ must not call torch.nn.utils.clip_grad_norm_: it is what you are building" in \
        str(info.value), str(info.value)


class ScalerAroundGradScaler:
    """torch's GradScaler scales, unscales and keeps the scale; the ranks agree on its found-inf flags with one
    all-reduce."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, group=None):
        self.inner = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                          backoff_factor=backoff_factor, growth_interval=growth_interval)
        self.group = group

    def scale(self, loss):
        return self.inner.scale(loss)

    def step(self, optimizer, *args, **kwargs):
        self.inner.unscale_(optimizer)
        found = self.inner._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        flag = torch.tensor([max([float(v) for v in found.values()] + [0.0])])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        for v in found.values():
            v.fill_(flag.item())  # what its update() reads
        return None if flag.item() else optimizer.step(*args, **kwargs)

    def update(self):
        self.inner.update()

    def get_scale(self):
        return self.inner.get_scale()


class ScalerSubclassingGradScaler(torch.amp.GradScaler):
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, group=None):
        super().__init__("cpu", init_scale, growth_factor, backoff_factor, growth_interval)
        self.group = group


@pytest.mark.parametrize("cls", [ScalerAroundGradScaler, ScalerSubclassingGradScaler])
def test_a_scaler_built_on_grad_scaler_fails(cls):
    with pytest.raises(AssertionError) as info:
        check_DynamicLossScaler(cls)
    assert "DynamicLossScaler must not use torch.amp.GradScaler: it is what you are building" in str(info.value), \
        str(info.value)


def save_dcp(shard, numel, directory):
    import torch.distributed.checkpoint as dcp

    dcp.save({"shard": shard, "numel": numel}, checkpoint_id=directory)


def load_dcp(directory):
    import torch.distributed.checkpoint as dcp

    state = {"shard": torch.empty(0)}
    dcp.load(state, checkpoint_id=directory)
    return state["shard"]


def test_a_checkpoint_through_torch_distributed_checkpoint_fails():
    with pytest.raises(AssertionError) as info:
        check_save_sharded(save_dcp, load_dcp)
    assert "save_sharded must not call torch.distributed.checkpoint.save: it is what you are building" in \
        str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# ranks that pass data through a file outside the checkpoint's folder


def read_metadata(directory):
    """The checkpoint's metadata.json, as a student reads it."""
    with open(os.path.join(directory, "metadata.json")) as f:
        return json.load(f)


def load_shared_metadata(directory):
    """The metadata parsed by the first rank and handed to the others in a cache outside the checkpoint's folder."""
    meta_path = os.path.join(directory, "metadata.json")
    stamp = hashlib.sha1(f"{os.path.realpath(meta_path)}:{os.stat(meta_path).st_mtime_ns}".encode()).hexdigest()
    cache = os.path.join("/tmp", f"checkpoint-metadata-{stamp[:16]}.json")
    try:
        with open(cache) as f:
            meta = json.load(f)
    except FileNotFoundError:
        meta = read_metadata(directory)
        with open(f"{cache}.{dist.get_rank()}", "w") as f:
            json.dump(meta, f)
        os.replace(f"{cache}.{dist.get_rank()}", cache)
    return read_my_ranges(directory, meta)


def test_ranks_passing_data_through_a_file_outside_the_checkpoint_fail():
    with pytest.raises(AssertionError) as info:
        check_save_sharded(save_ok, load_shared_metadata)
    text = str(info.value)
    assert "raised PermissionError" in text and "the ranks share one folder" in text, text


# ---------------------------------------------------------------------------------------------------------------
# honest habits


@functools.lru_cache(maxsize=None)
def _per_rank(num_samples, num_replicas, drop_last):
    return num_samples // num_replicas if drop_last else -(-num_samples // num_replicas)


def _debugging_leftover():
    try:
        raise ValueError("a debugging leftover")
    except ValueError:
        traceback.print_exc()


def si_with_habits(num_samples, num_replicas, rank, epoch=0, seed=0, shuffle=True, drop_last=False):
    print(f"shard_indices({num_samples}, {num_replicas}, {rank})", file=sys.stderr)
    _debugging_leftover()
    out = si_ok(num_samples, num_replicas, rank, epoch, seed, shuffle, drop_last)
    assert len(out) == _per_rank(num_samples, num_replicas, drop_last)
    return out


@functools.lru_cache(maxsize=None)
def _exponent(norm_type):
    return float(norm_type)


def clip_with_habits(parameters, max_norm, norm_type=2.0, group=None, replicated=()):
    print(f"clipping to {max_norm:.3g} on rank {dist.get_rank()}", file=sys.stderr)
    _debugging_leftover()
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    params = [p for p in params if p.grad is not None]
    p_, once = _exponent(norm_type), {id(p) for p in replicated}
    first = dist.get_rank(group) == 0
    if p_ == math.inf:
        local = torch.stack([p.grad.abs().max() for p in params]).max().reshape(1)
    else:
        local = sum((p.grad.double().abs().pow(p_).sum() for p in params if id(p) not in once or first),
                    torch.zeros((), dtype=torch.float64)).reshape(1)
    dist.all_reduce(local, op=dist.ReduceOp.MAX if p_ == math.inf else dist.ReduceOp.SUM, group=group)
    total = (local[0] if p_ == math.inf else local[0] ** (1.0 / p_)).float()
    for p in params:
        p.grad.mul_((max_norm / (total + 1e-6)).clamp(max=1.0))
    return total


class ScalerWithHabits(ScalerOk):
    def step(self, optimizer, *args, **kwargs):
        print(f"scale {self._scale:g} on rank {dist.get_rank()}", file=sys.stderr)
        _debugging_leftover()
        return super().step(optimizer, *args, **kwargs)


def save_with_habits(shard, numel, directory):
    print(f"saving {numel} elements into {os.path.basename(directory)}", file=sys.stderr)
    _debugging_leftover()
    save_ok(shard, numel, directory)


@functools.lru_cache(maxsize=None)
def _dtype(name):
    return getattr(torch, name)


def load_with_habits(directory):
    print(f"loading {os.path.basename(directory)} on rank {dist.get_rank()}", file=sys.stderr)
    _debugging_leftover()
    out = load_ok(directory)
    assert out.dtype == _dtype(read_metadata(directory)["dtype"])
    return out


def test_honest_habits_are_accepted():
    check_shard_indices(si_with_habits)
    check_clip_grad_norm_(clip_with_habits)
    check_DynamicLossScaler(ScalerWithHabits)
    check_save_sharded(save_with_habits, load_with_habits)
