"""autograder.checks.fsdp: correct implementations pass; planted bugs lose the points with the right message.

The implementations are written the way a student might write them. Correct alternatives: the notebook's (an
autograd Function that all-gathers forward and reduce-scatters backward, storage freed with ``resize_(0)``, regathered
from a hook on the unit's output), the list forms of the collectives, a ``register_full_backward_pre_hook``
for the regather, the gathered flat parameter as a leaf with a post-accumulate-grad hook (no custom Function), saved-tensor hooks that save a handle instead of the gathered weight (nothing to free), and a
prefetching one (the stretch), and one with a student's habits (prints, a printed traceback, a cached helper). Bugs:
gathered parameters never freed, references dropped but the storage kept alive by autograd (so no re-gather in
backward), an all-reduce instead of a reduce-scatter, shards without padding, gradients summed instead of averaged, a
frozen parameter trained, plain replicated DDP, and a replicated DDP dressed up with the right shards (which only the
memory measurement catches), with its replicas kept where no walk from the wrapper leads (a class attribute), or the
original parameters kept in a global. Cheats, each written as a student would: units in a class carrying the flag
the lesson's memory meter skips, full parameters kept in numpy with a one-element all-gather as the re-gather, a
reduce and a broadcast instead of the reduce-scatter, an all-reduce in 8-byte pieces. The class runs in grading's
sandbox: memory is read by the host from /proc, traffic from the host's own record.
"""

from __future__ import annotations

import functools
import math
import sys
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from autograder.checks import fsdp as checks
from autograder.checks.fsdp import check_MiniFSDP, check_traffic_per_step, expected_traffic

# ---------------------------------------------------------------------------------------------------------------
# MiniFSDP: a correct base whose pieces the variants override


class FSDPOk(nn.Module):
    detach_frozen = True

    def __init__(self, module, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.units = []
        for owner in list(module.children()) + [module]:
            subs = owner.modules() if owner is not module else [module]
            params = [(m, n, p) for m in subs for n, p in m._parameters.items() if p is not None]
            if params:
                unit = self.make_unit(params)
                self.units.append(unit)
                self.install(owner, unit)
        self.shards = nn.ParameterList([u["shard"] for u in self.units])

    def padded(self, numel):
        return math.ceil(numel / self.world)

    def make_unit(self, params):
        numel = sum(p.numel() for *_, p in params)
        chunk = self.padded(numel)
        flat = torch.zeros(chunk * self.world)
        flat[:numel] = torch.cat([p.detach().reshape(-1) for *_, p in params])
        shard = nn.Parameter(flat[self.rank * chunk:(self.rank + 1) * chunk].clone())
        for m, name, _ in params:
            del m._parameters[name]
        return {"shard": shard, "layout": [(m, n, p.shape, p.requires_grad) for m, n, p in params], "full": None}

    def install(self, owner, unit):
        owner.register_forward_pre_hook(lambda mod, args: self.before_forward(unit))
        owner.register_forward_hook(lambda mod, args, out: self.after_forward(unit, out))

    # collectives
    def all_gather(self, out, shard):
        dist.all_gather_into_tensor(out, shard, group=self.group)

    def reduce_scatter(self, out, full_grad):
        dist.reduce_scatter_tensor(out, full_grad, group=self.group)

    # steps
    def set_views(self, unit, full):
        offset = 0
        for m, name, shape, trainable in unit["layout"]:
            view = full[offset:offset + shape.numel()].view(shape)
            setattr(m, name, view.detach() if (self.detach_frozen and not trainable) else view)
            offset += shape.numel()

    def before_forward(self, unit):
        self.set_views(unit, Gather.apply(unit["shard"], self, unit))

    def after_forward(self, unit, out):
        self.free(unit)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: self.regather(unit))

    def free(self, unit):
        unit["full"].untyped_storage().resize_(0)

    def regather(self, unit):
        storage = unit["full"].untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(unit["full"].numel() * 4)
            self.all_gather(torch.empty(0).set_(storage), unit["shard"].detach())

    def grad_shard(self, unit, grad_full):
        out = torch.empty_like(unit["shard"])
        self.reduce_scatter(out, grad_full.contiguous())
        return out / self.world

    def parameters(self, recurse=True):
        return iter(self.shards)

    def forward(self, *args):
        return self.module(*args)


class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, fsdp, unit):
        ctx.fsdp, ctx.unit = fsdp, unit
        full = torch.empty(shard.numel() * fsdp.world)
        fsdp.all_gather(full, shard.detach())
        unit["full"] = full
        return full

    @staticmethod
    def backward(ctx, grad_full):
        grad = ctx.fsdp.grad_shard(ctx.unit, grad_full)
        ctx.fsdp.free(ctx.unit)
        return grad, None, None


class FSDPListCollectives(FSDPOk):
    """Correct: the list forms, all_gather into N pieces and reduce_scatter from N pieces."""

    def all_gather(self, out, shard):
        parts = [torch.empty_like(shard) for _ in range(self.world)]
        dist.all_gather(parts, shard, group=self.group)
        torch.cat(parts, out=out)

    def reduce_scatter(self, out, full_grad):
        dist.reduce_scatter(out, list(full_grad.chunk(self.world)), group=self.group)


class FSDPBackwardPreHook(FSDPOk):
    """Correct: the regather from a module's full backward pre-hook instead of a hook on the output tensor."""

    def install(self, owner, unit):
        owner.register_forward_pre_hook(lambda mod, args: self.before_forward(unit))
        owner.register_forward_hook(lambda mod, args, out: self.free(unit))
        owner.register_full_backward_pre_hook(lambda mod, grad_out: self.regather(unit))


class FSDPLeafWithGradHook(FSDPOk):
    """Correct: the gathered flat parameter is a leaf of the graph; a post-accumulate-grad hook on it reduce-scatters
    its gradient into shard.grad (accumulating) and frees it. No custom autograd Function."""

    def before_forward(self, unit):
        full = torch.empty(unit["shard"].numel() * self.world)
        self.all_gather(full, unit["shard"].detach())
        full.requires_grad_()
        full.register_post_accumulate_grad_hook(lambda leaf: self.after_backward(unit, leaf))
        unit["full"] = full
        self.set_views(unit, full)

    def after_backward(self, unit, leaf):
        grad = self.grad_shard(unit, leaf.grad)
        leaf.grad = None
        shard = unit["shard"]
        shard.grad = grad if shard.grad is None else shard.grad + grad
        self.free(unit)


class FSDPSavedTensorHooks(FSDPOk):
    """Correct: inside a unit's forward, autograd saves a handle instead of a view of the gathered flat parameter;
    unpacking the handle in backward gathers the unit again (once). Freeing is dropping the references."""

    def install(self, owner, unit):
        owner.register_forward_pre_hook(lambda mod, args: self.enter(unit))
        owner.register_forward_hook(lambda mod, args, out: self.leave(unit))

    def enter(self, unit):
        self.before_forward(unit)
        ptr = unit["full"].untyped_storage().data_ptr()

        def pack(t):
            if t.untyped_storage().data_ptr() == ptr:
                return ("param", t.storage_offset(), t.shape, t.stride())
            return t

        def unpack(x):
            if isinstance(x, tuple) and x and x[0] == "param":
                if unit.get("again") is None:
                    unit["again"] = torch.empty(unit["full_numel"])
                    self.all_gather(unit["again"], unit["shard"].detach())
                return unit["again"].as_strided(x[2], x[3], x[1])
            return x

        unit["full_numel"] = unit["full"].numel()
        unit["ctx"] = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        unit["ctx"].__enter__()

    def leave(self, unit):
        unit.pop("ctx").__exit__(None, None, None)
        unit["full"] = None
        for m, name, shape, _ in unit["layout"]:
            setattr(m, name, None)

    def free(self, unit):
        unit["again"] = None


class FSDPPrefetch(FSDPOk):
    """Correct, the stretch: the next unit's all-gather is issued (async) before the current unit computes."""

    def __init__(self, module, group=None, prefetch=False):
        self.prefetch = prefetch
        self.pending = {}
        super().__init__(module, group)
        self.order = {id(u): i for i, u in enumerate(self.units)}

    def before_forward(self, unit):
        super().before_forward(unit)
        i = self.order[id(unit)]
        nxt = self.units[i + 1] if self.prefetch and i + 1 < len(self.units) - 1 else None  # not the root
        if nxt is not None:
            buf = torch.empty(nxt["shard"].numel() * self.world)
            work = dist.all_gather_into_tensor(buf, nxt["shard"].detach(), group=self.group, async_op=True)
            self.pending[id(nxt)] = (buf, work)

    def all_gather(self, out, shard):
        for key, (buf, work) in list(self.pending.items()):
            unit = next(u for u in self.units if id(u) == key)
            if unit["shard"].data_ptr() == shard.data_ptr() and buf.numel() == out.numel():
                work.wait()
                out.copy_(buf)
                del self.pending[key]
                return
        super().all_gather(out, shard)


# --- bugs ---------------------------------------------------------------------------------------------------------


class NeverFreed(FSDPOk):
    """Gathers before forward and before backward, but never frees the gathered parameters."""

    def free(self, unit):
        pass

    def regather(self, unit):
        self.all_gather(torch.empty(0).set_(unit["full"].untyped_storage()), unit["shard"].detach())


class DropsReferencesOnly(FSDPOk):
    """'Frees' by forgetting the gathered tensor; autograd still holds views of it, so backward needs no regather."""

    def free(self, unit):
        unit["full"] = None

    def after_forward(self, unit, out):
        self.free(unit)


class AllReduceGradients(FSDPOk):
    def grad_shard(self, unit, grad_full):
        grad_full = grad_full.clone()
        dist.all_reduce(grad_full, group=self.group)
        chunk = unit["shard"].numel()
        return grad_full[self.rank * chunk:(self.rank + 1) * chunk] / self.world


class NoPadding(FSDPListCollectives):
    """Shards from tensor_split: uneven when the unit does not divide by N."""

    def make_unit(self, params):
        flat = torch.cat([p.detach().reshape(-1) for *_, p in params])
        shard = nn.Parameter(flat.tensor_split(self.world)[self.rank].clone())
        for m, name, _ in params:
            del m._parameters[name]
        return {"shard": shard, "layout": [(m, n, p.shape, p.requires_grad) for m, n, p in params], "full": None}


class NotAveraged(FSDPOk):
    def grad_shard(self, unit, grad_full):
        out = torch.empty_like(unit["shard"])
        self.reduce_scatter(out, grad_full.contiguous())
        return out


class TrainsFrozen(FSDPOk):
    detach_frozen = False


class ReplicatedDDP(nn.Module):
    """Plain DDP: every rank keeps the whole model and all-reduces the gradients (right weights, no sharding)."""

    def __init__(self, module, group=None):
        super().__init__()
        self.module = module
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._sync)

    @staticmethod
    def _sync(p):
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()

    def forward(self, *args):
        return self.module(*args)


class ReplicatedWithShards(FSDPOk):
    """DDP in disguise: parameters() yields correct shards, but every rank keeps a full replica of each unit all
    the time (so it never needs to gather anything): only the memory measurement tells."""

    def make_unit(self, params):
        unit = super().make_unit(params)
        unit["replica"] = torch.empty(unit["shard"].numel() * self.world)
        self.all_gather(unit["replica"], unit["shard"].detach())
        return unit


class ReplicaOnTheClass(FSDPOk):
    """As ReplicatedWithShards, but the replicas are kept in a list on the class, where no walk from the wrapper
    leads: only the sandbox's memory, read by the host from /proc, tells."""

    replicas = []

    def make_unit(self, params):
        unit = super().make_unit(params)
        replica = torch.empty(unit["shard"].numel() * self.world)
        self.all_gather(replica, unit["shard"].detach())
        type(self).replicas.append(replica)
        return unit


class OriginalsInAGlobal(FSDPOk):
    """The original full parameters kept alive in a module-level list (a global of the answer's)."""

    def make_unit(self, params):
        _KEPT.extend(p for *_, p in params)
        return super().make_unit(params)


_KEPT = []


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl", [FSDPOk, FSDPListCollectives, FSDPBackwardPreHook, FSDPLeafWithGradHook,
                                  FSDPSavedTensorHooks, FSDPPrefetch])
def test_correct_implementations_pass(impl):
    check_MiniFSDP(impl)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl, expected", [
    (NeverFreed, "during forward"),
    (DropsReferencesOnly, "all-gather call(s)"),
    (AllReduceGradients, "torch.distributed.all_reduce"),
    (NoPadding, "pad the flat parameter"),
    (NotAveraged, "divide it by the world size"),
    (TrainsFrozen, "This parameter is frozen"),
    (ReplicatedDDP, "one flat shard per unit"),
    (ReplicatedWithShards, "expected its shards only"),
    (ReplicaOnTheClass, "beyond its shards"),
    (OriginalsInAGlobal, "beyond its shards"),
])
def test_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as err:
        check_MiniFSDP(impl)
    assert expected in str(err.value), str(err.value)


# --- a student's habits: they cost nothing -------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _chunk_of(numel, world):
    return -(-numel // world)


class FSDPWithHabits(FSDPOk):
    """Correct, with a student's habits: progress printed to stderr, a traceback printed in an except, a cached
    helper, a warning."""

    def padded(self, numel):
        return _chunk_of(numel, self.world)

    def make_unit(self, params):
        try:
            dtype = {p.dtype for *_, p in params}.pop()
            if dtype != torch.float32:
                raise TypeError(f"unexpected {dtype}")
        except TypeError:
            traceback.print_exc()
        print(f"rank {self.rank}: a unit of {sum(p.numel() for *_, p in params)} values", file=sys.stderr)
        warnings.warn("make_unit: a reminder to myself (a warning on stderr)")
        return super().make_unit(params)


def test_a_students_habits_pass():
    check_MiniFSDP(FSDPWithHabits)


# --- cheats: each loses the points ---------------------------------------------------------------------------------


class HiddenUnit(dict):
    _fsdp_probe = True  # the lesson's ParamMemory walks past objects with this flag


class KeepsUnitsBehindTheMeter(FSDPOk):
    """Frees a unit after its forward, as the meter watches; after backward keeps it gathered in a unit the meter
    skips, so between steps the rank holds the whole model."""

    def make_unit(self, params):
        return HiddenUnit(super().make_unit(params))

    def after_forward(self, unit, out):
        unit["full"].untyped_storage().resize_(0)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: self.regather(unit))

    def free(self, unit):
        pass


class FullCopyInNumpy(FSDPOk):
    """Keeps each unit's full parameters in numpy from its forward gather; the 're-gather' before backward is a
    one-element all-gather (the call count looks right), the values come from numpy."""

    def before_forward(self, unit):
        self.current = unit
        super().before_forward(unit)

    def all_gather(self, out, shard):
        super().all_gather(out, shard)
        self.current["numpy"] = out.clone().numpy()

    def regather(self, unit):
        storage = unit["full"].untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(unit["full"].numel() * 4)
            token = torch.empty(self.world)
            dist.all_gather_into_tensor(token, unit["shard"].detach()[:1], group=self.group)
            torch.empty(0).set_(storage).copy_(torch.from_numpy(unit["numpy"]))


class ReduceThenBroadcast(FSDPOk):
    """The gradient reduced to rank 0 and broadcast back, each rank keeping its slice."""

    def reduce_scatter(self, out, full_grad):
        total = full_grad.clone()
        dist.reduce(total, dst=0, group=self.group)
        dist.broadcast(total, src=0, group=self.group)
        out.copy_(total.chunk(self.world)[self.rank])


class AllReduceInPieces(FSDPOk):
    """The gradient all-reduced 8 bytes at a time (no call large enough to look like an all-reduce of it)."""

    def reduce_scatter(self, out, full_grad):
        total = full_grad.clone()
        for piece in total.split(2):
            dist.all_reduce(piece, group=self.group)
        out.copy_(total.chunk(self.world)[self.rank])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl, expected", [
    (KeepsUnitsBehindTheMeter, "after step 0 rank"),
    (FullCopyInNumpy, "the all-gathers carried"),
    (ReduceThenBroadcast, "torch.distributed.reduce on rank"),
    (AllReduceInPieces, "torch.distributed.all_reduce on rank"),
])
def test_cheats_lose_the_points(impl, expected):
    with pytest.raises(AssertionError) as err:
        check_MiniFSDP(impl)
    assert expected in str(err.value), str(err.value)


# ---------------------------------------------------------------------------------------------------------------
# traffic_per_step


def traffic_ok(strategy, num_params, world_size, shard_size=None):
    return expected_traffic(strategy, num_params, world_size, shard_size) if strategy != "hsdp" or (
        shard_size and world_size % shard_size == 0) else (_ for _ in ()).throw(ValueError("bad shard size"))


def traffic_in_two_terms(strategy, num_params, world_size, shard_size=None):
    """Correct alternative: HSDP as FSDP within the group plus DDP on the shard across groups."""
    per_rank = {"ddp": lambda n, p: 2 * (n - 1) / n * p, "fsdp": lambda n, p: 3 * (n - 1) / n * p}
    if strategy == "zero2":
        strategy = "ddp"
    if strategy in per_rank:
        return float(per_rank[strategy](world_size, num_params))
    if strategy != "hsdp":
        raise ValueError(strategy)
    if not shard_size or world_size % shard_size:
        raise ValueError(shard_size)
    return per_rank["fsdp"](shard_size, num_params) + per_rank["ddp"](world_size // shard_size,
                                                                      num_params / shard_size)


def traffic_hsdp_full_across(strategy, num_params, world_size, shard_size=None):
    if strategy == "hsdp" and shard_size and world_size % shard_size == 0:
        s, r = shard_size, world_size // shard_size
        return 3 * (s - 1) / s * num_params + 2 * (r - 1) / r * num_params
    return traffic_ok(strategy, num_params, world_size, shard_size)


def traffic_no_errors(strategy, num_params, world_size, shard_size=None):
    try:
        return traffic_ok(strategy, num_params, world_size, shard_size)
    except ValueError:
        return 0.0


def traffic_fsdp_as_ddp(strategy, num_params, world_size, shard_size=None):
    if strategy == "fsdp":
        return 2 * (world_size - 1) / world_size * num_params
    return traffic_ok(strategy, num_params, world_size, shard_size)


def traffic_zero2_three(strategy, num_params, world_size, shard_size=None):
    if strategy == "zero2":                  # counted like FSDP
        return 3 * (world_size - 1) / world_size * num_params
    return traffic_ok(strategy, num_params, world_size, shard_size)


def traffic_hsdp_default_shard(strategy, num_params, world_size, shard_size=None):
    return traffic_ok(strategy, num_params, world_size, shard_size or (world_size if strategy == "hsdp" else None))


@pytest.mark.parametrize("impl", [traffic_ok, traffic_in_two_terms])
def test_traffic_correct_passes(impl):
    check_traffic_per_step(impl)


@pytest.mark.parametrize("impl, expected", [
    (traffic_hsdp_full_across, "across the R"),
    (traffic_no_errors, "ValueError"),
    (traffic_fsdp_as_ddp, "an all-gather of the parameters in forward and again in backward"),
    (traffic_zero2_three, "like DDP"),
    (traffic_hsdp_default_shard, "hsdp needs a shard_size"),
])
def test_traffic_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as err:
        check_traffic_per_step(impl)
    assert expected in str(err.value), str(err.value)


def test_probe_model_pads_for_every_world_size():
    for seed in range(20):
        units = checks.unit_layout(checks._make_model(seed))
        assert [name for name, _, _ in units] == ["embed", "body", "norm", "head", ""]
        for world in (2, 3, 4):
            assert sum(n % world != 0 for _, n, _ in units) >= 2
        assert not checks._make_model(seed).norm.bias.requires_grad

