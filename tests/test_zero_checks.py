"""autograder.checks.zero: correct implementations pass; planted bugs lose the points with the right message.

The implementations are written the way a student might: ZeRO-1 sharded by parameter (reduce to the owner, then
broadcast from it) and flat (reduce-scatter, all-gather); ZeRO-2 with flat padded buffers, synchronised with an
all-gather or with a broadcast from each shard's owner. The bugs: a plain optimizer on every rank (full state),
shards never synchronised, every rank updating every parameter, owners that disagree, gradients all-reduced in
ZeRO-2, the average forgotten, the full gradient kept after step(), a frozen parameter put in the shards; and the
full optimizer state kept out of the attributes' reach (in a closure, as numpy copies) behind a decoy optimizer.
"""

import functools
import sys
import traceback

import pytest
import torch
import torch.distributed as dist

from autograder.checks.zero import (
    check_model_state_bytes,
    check_ShardedOptimizer,
    check_Zero2Optimizer,
    reference_model_state_bytes,
)

# ---------------------------------------------------------------------------------------------------------------
# model_state_bytes


def msb_ok(num_params, dp_degree, stage, k=12):
    if stage not in (0, 1, 2, 3):
        raise ValueError("stage must be 0, 1, 2 or 3")
    if num_params <= 0 or dp_degree <= 0:
        raise ValueError("sizes must be positive")
    return reference_model_state_bytes(num_params, dp_degree, stage, k)


def msb_int(num_params, dp_degree, stage, k=12):
    """Correct alternative: a table of (replicated, sharded) bytes per parameter."""
    if stage not in range(4) or num_params <= 0 or dp_degree <= 0:
        raise ValueError(stage)
    replicated, sharded = [(4 + k, 0), (4, k), (2, 2 + k), (0, 4 + k)][stage]
    return replicated * num_params + sharded * num_params / dp_degree


def msb_stage2_wrong(num_params, dp_degree, stage, k=12):
    if stage == 2:
        return 2 * num_params + k * num_params / dp_degree
    return msb_ok(num_params, dp_degree, stage, k)


def msb_k_ignored(num_params, dp_degree, stage, k=12):
    return msb_ok(num_params, dp_degree, stage, 12)


def msb_no_error(num_params, dp_degree, stage, k=12):
    if stage == 4:
        return 0.0
    return msb_ok(num_params, dp_degree, stage, k)


def msb_todo(num_params, dp_degree, stage, k=12):
    raise NotImplementedError()


def test_model_state_bytes_correct_passes():
    check_model_state_bytes(msb_ok)
    check_model_state_bytes(msb_int)


@pytest.mark.parametrize("impl, expected", [
    (msb_stage2_wrong, "stage 2 shards gradients"),
    (msb_k_ignored, "k="),
    (msb_no_error, "ValueError"),
    (msb_todo, "not started: it still raises NotImplementedError"),
])
def test_model_state_bytes_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_model_state_bytes(impl)
    assert expected in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# ZeRO-1


def _greedy_owner(params, world):
    owner, loads = {}, [0] * world
    for p in sorted(params, key=lambda p: p.numel(), reverse=True):
        r = loads.index(min(loads))
        owner[p] = r
        loads[r] += p.numel()
    return owner


class Zero1ByParam:
    """Correct: whole parameters to ranks (largest first, least-loaded rank); reduce to owner; broadcast."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.params = [p for p in params if p.requires_grad]
        self.owner = _greedy_owner(self.params, self.world)
        mine = [p for p in self.params if self.owner[p] == self.rank]
        self.optim = optimizer_cls(mine, **kwargs) if mine else None

    @torch.no_grad()
    def step(self):
        for p in self.params:
            dist.reduce(p.grad, dst=self.owner[p])
            if self.owner[p] == self.rank:
                p.grad /= self.world
        if self.optim is not None:
            self.optim.step()
        for p in self.params:
            dist.broadcast(p, src=self.owner[p])

    def zero_grad(self):
        for p in self.params:
            p.grad = None


class Zero1Flat:
    """Correct alternative: flat padded shard; reduce-scatter the gradient; all-gather the parameters; the full
    local gradients stay (ZeRO-1 does not shard them)."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.params = [p for p in params if p.requires_grad]
        self.total = sum(p.numel() for p in self.params)
        self.size = -(-self.total // self.world)
        flat = torch.zeros(self.size * self.world)
        flat[:self.total] = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.shard = flat[self.rank * self.size:(self.rank + 1) * self.size].clone()
        self.optim = optimizer_cls([self.shard], **kwargs)

    @torch.no_grad()
    def step(self):
        flat = torch.zeros(self.size * self.world)
        flat[:self.total] = torch.cat([p.grad.reshape(-1) for p in self.params])
        grad = torch.empty(self.size)
        dist.reduce_scatter(grad, list(flat.chunk(self.world)))
        self.shard.grad = grad / self.world
        self.optim.step()
        self.shard.grad = None
        full = torch.empty(self.size * self.world)
        dist.all_gather(list(full.chunk(self.world)), self.shard)
        offset = 0
        for p in self.params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def zero_grad(self):
        for p in self.params:
            p.grad = None


class Zero1PlainOptimizer:
    """Bug: a plain optimizer on every rank after an all-reduce (right weights, full state)."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.optim = optimizer_cls(self.params, **kwargs)

    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        self.optim.step()

    def zero_grad(self):
        self.optim.zero_grad()


class Zero1RoundRobin(Zero1ByParam):
    """Owners dealt out in turn, whatever their sizes: one rank may hold far more than its share."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.params = [p for p in params if p.requires_grad]
        self.owner = {p: i % self.world for i, p in enumerate(self.params)}
        mine = [p for p in self.params if self.owner[p] == self.rank]
        self.optim = optimizer_cls(mine, **kwargs) if mine else None


class Zero1NoSync(Zero1ByParam):
    """Bug: the updated shards are never sent to the other ranks."""

    @torch.no_grad()
    def step(self):
        for p in self.params:
            dist.reduce(p.grad, dst=self.owner[p])
            if self.owner[p] == self.rank:
                p.grad /= self.world
        if self.optim is not None:
            self.optim.step()


class Zero1EveryoneUpdates(Zero1ByParam):
    """Bug: every rank updates every parameter (full state), then broadcasts anyway."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        self.optim = optimizer_cls(self.params, **kwargs)

    @torch.no_grad()
    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= self.world
        self.optim.step()


class Zero1WrongOwner(Zero1ByParam):
    """Bug: the rank that updates a parameter is not the one that broadcasts it."""

    @torch.no_grad()
    def step(self):
        for p in self.params:
            dist.reduce(p.grad, dst=self.owner[p])
            if self.owner[p] == self.rank:
                p.grad /= self.world
        if self.optim is not None:
            self.optim.step()
        for i, p in enumerate(self.params):
            dist.broadcast(p, src=(self.owner[p] + 1) % self.world)


class Zero1NoAverage(Zero1ByParam):
    """Bug: gradients summed onto the owner, never divided by N."""

    @torch.no_grad()
    def step(self):
        for p in self.params:
            dist.reduce(p.grad, dst=self.owner[p])
        if self.optim is not None:
            self.optim.step()
        for p in self.params:
            dist.broadcast(p, src=self.owner[p])


class Zero1AllReduce(Zero1ByParam):
    """Bug (communication): all-reduce every gradient, then broadcast: 3Ψ per step instead of 2Ψ."""

    @torch.no_grad()
    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= self.world
        if self.optim is not None:
            self.optim.step()
        for p in self.params:
            dist.broadcast(p, src=self.owner[p])


class Zero1Todo:
    def __init__(self, params, optimizer_cls, **kwargs):
        raise NotImplementedError()


class Zero1OnlyOwnerCalls(Zero1ByParam):
    """Only the owner calls reduce and broadcast: the ranks' collectives no longer match."""

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if self.owner[p] == self.rank:
                dist.reduce(p.grad, dst=self.rank)
                p.grad /= self.world
        if self.optim is not None:
            self.optim.step()
        for p in self.params:
            if self.owner[p] == self.rank:
                dist.broadcast(p, src=self.rank)


# Answers that keep the full optimizer state where the object's attributes do not lead (a decoy optimizer with no
# state in the attribute): right weights, 2Ψ moved, nothing wrong in the attributes. The sandbox's memory, read
# by the host from /proc, finds the state.

def _decoy(optimizer_cls, kwargs):
    return optimizer_cls([torch.zeros(1, requires_grad=True)], **kwargs)


class Zero1ClosureCheat:
    """Cheat: the full optimizer lives in a closure; the attribute holds a decoy optimizer with no state."""

    def __init__(self, params, optimizer_cls, **kwargs):
        params = [p for p in params if p.requires_grad]
        full, world = optimizer_cls(params, **kwargs), dist.get_world_size()

        @torch.no_grad()
        def step():
            for p in params:
                dist.all_reduce(p.grad)
                p.grad /= world
            full.step()

        def zero_grad():
            for p in params:
                p.grad = None

        self.step, self.zero_grad = step, zero_grad
        self.optim = _decoy(optimizer_cls, kwargs)


class Zero1NumpyCheat:
    """Cheat: a full optimizer whose state is kept between steps only as numpy copies, in a closure."""

    def __init__(self, params, optimizer_cls, **kwargs):
        params = [p for p in params if p.requires_grad]
        full, world, stash = optimizer_cls(params, **kwargs), dist.get_world_size(), []

        @torch.no_grad()
        def step():
            for p in params:
                dist.all_reduce(p.grad)
                p.grad /= world
            for p, st in stash:
                full.state[p] = {k: torch.from_numpy(v.copy()) for k, v in st.items()}
            full.step()
            stash[:] = [(p, {k: v.numpy().copy() for k, v in full.state[p].items()}) for p in params]
            full.state.clear()

        def zero_grad():
            for p in params:
                p.grad = None

        self.step, self.zero_grad = step, zero_grad
        self.optim = _decoy(optimizer_cls, kwargs)


class Zero2ClosureCheat:
    """Cheat for ZeRO-2: reduce-scatter, then all-gather the averaged gradient and step a full optimizer kept in a
    closure (no all-reduce, no .grad left, 2Ψ moved); a decoy optimizer in the attribute."""

    def __init__(self, params, optimizer_cls, **kwargs):
        params = [p for p in params if p.requires_grad]
        full, world = optimizer_cls(params, **kwargs), dist.get_world_size()
        total = sum(p.numel() for p in params)
        size = -(-total // world)

        @torch.no_grad()
        def step():
            flat = torch.zeros(size * world)
            flat[:total] = torch.cat([p.grad.reshape(-1) for p in params])
            mine = torch.empty(size)
            dist.reduce_scatter(mine, list(flat.chunk(world)))
            mine /= world
            dist.all_gather(list(flat.chunk(world)), mine)
            offset = 0
            for p in params:
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            full.step()
            for p in params:
                p.grad = None

        def zero_grad():
            for p in params:
                p.grad = None

        self.step, self.zero_grad = step, zero_grad
        self.optim = _decoy(optimizer_cls, kwargs)


def test_collectives_called_by_the_owner_only_are_explained():
    with pytest.raises(AssertionError) as info:
        check_ShardedOptimizer(Zero1OnlyOwnerCalls)
    text = str(info.value)
    assert "every rank must make the same collective calls" in text or "deadlocked" in text, text


def test_round_robin_owners_are_named_unbalanced():
    with pytest.raises(AssertionError, match="the shares are unbalanced"):
        check_ShardedOptimizer(Zero1RoundRobin)


def test_sharded_optimizer_correct_passes():
    check_ShardedOptimizer(Zero1ByParam)
    check_ShardedOptimizer(Zero1Flat)


@pytest.mark.parametrize("impl, expected", [
    (Zero1PlainOptimizer, "should hold about 1/"),
    (Zero1NoSync, "bring it the owner's updated values"),
    (Zero1EveryoneUpdates, "should hold about 1/"),
    (Zero1WrongOwner, "differs from the unsharded"),
    (Zero1NoAverage, "differs from the unsharded"),
    (Zero1AllReduce, "moved 3.00Ψ"),
    (Zero1Todo, "not started: it still raises NotImplementedError"),
    (Zero1ClosureCheat, "beyond its shard"),
    (Zero1NumpyCheat, "beyond its shard"),
])
def test_sharded_optimizer_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_ShardedOptimizer(impl)
    assert expected in str(info.value), str(info.value)
    assert "seed" in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# ZeRO-2


class Zero2Flat:
    """Correct: one flat padded buffer; reduce-scatter; each rank keeps its averaged shard; all-gather."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.params = [p for p in params if p.requires_grad]
        self.total = sum(p.numel() for p in self.params)
        self.size = -(-self.total // self.world)
        flat = torch.zeros(self.size * self.world)
        flat[:self.total] = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.shard = flat[self.rank * self.size:(self.rank + 1) * self.size].clone()
        self.optim = optimizer_cls([self.shard], **kwargs)

    def _flat_grad(self):
        flat = torch.zeros(self.size * self.world)
        flat[:self.total] = torch.cat([p.grad.reshape(-1) for p in self.params])
        for p in self.params:
            p.grad = None
        return flat

    @torch.no_grad()
    def step(self):
        flat = self._flat_grad()
        self.shard.grad = torch.empty(self.size)
        dist.reduce_scatter(self.shard.grad, list(flat.chunk(self.world)))
        self.shard.grad /= self.world
        self.optim.step()
        self._sync()

    def _sync(self):
        full = torch.empty(self.size * self.world)
        dist.all_gather(list(full.chunk(self.world)), self.shard)
        self._unflatten(full)

    def _unflatten(self, full):
        offset = 0
        for p in self.params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        self.shard.grad = None


class Zero2Broadcast(Zero2Flat):
    """Correct alternative: every shard broadcast from its owner instead of one all-gather."""

    def _sync(self):
        full = torch.empty(self.size * self.world)
        for r, piece in enumerate(full.chunk(self.world)):
            if r == self.rank:
                piece.copy_(self.shard)
            dist.broadcast(piece, src=r)
        self._unflatten(full)


class Zero2AllReduce(Zero2Flat):
    """Bug: the flat gradient is all-reduced, then sliced."""

    @torch.no_grad()
    def step(self):
        flat = self._flat_grad()
        dist.all_reduce(flat)
        self.shard.grad = flat.chunk(self.world)[self.rank].clone() / self.world
        self.optim.step()
        self._sync()


class Zero2KeepsGrad(Zero2Flat):
    """Bug: the model's full gradients are kept after step()."""

    @torch.no_grad()
    def step(self):
        flat = torch.zeros(self.size * self.world)
        flat[:self.total] = torch.cat([p.grad.reshape(-1) for p in self.params])
        self.shard.grad = torch.empty(self.size)
        dist.reduce_scatter(self.shard.grad, list(flat.chunk(self.world)))
        self.shard.grad /= self.world
        self.optim.step()
        self._sync()


class Zero2NoAverage(Zero2Flat):
    @torch.no_grad()
    def step(self):
        flat = self._flat_grad()
        self.shard.grad = torch.empty(self.size)
        dist.reduce_scatter(self.shard.grad, list(flat.chunk(self.world)))
        self.optim.step()
        self._sync()


class Zero2WithFrozen(Zero2Flat):
    """Bug: the frozen parameter is put in the flat buffer too (its zero gradient still gets weight decay)."""

    def __init__(self, params, optimizer_cls, **kwargs):
        params = list(params)
        for p in params:
            p.requires_grad_(True)
        super().__init__(params, optimizer_cls, **kwargs)

    def _flat_grad(self):
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return super()._flat_grad()


class Zero2NoSync(Zero2Flat):
    def _sync(self):
        pass


class Zero2ShardView(Zero2Flat):
    """The shard is a slice of the whole flat buffer, not a copy: every rank keeps all Ψ elements alive."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        flat = torch.zeros(self.size * self.world)
        flat[:self.total] = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.shard = flat[self.rank * self.size:(self.rank + 1) * self.size]
        self.optim = optimizer_cls([self.shard], **kwargs)


class Zero2NoPadding(Zero2Flat):
    """S = Ψ // N and no padding: right when N divides Ψ, a size mismatch in the collectives otherwise."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        self.size = self.total // self.world
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.shard = flat[self.rank * self.size:(self.rank + 1) * self.size].clone()
        self.optim = optimizer_cls([self.shard], **kwargs)

    def _flat_grad(self):
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        for p in self.params:
            p.grad = None
        return flat

    def _sync(self):
        full = torch.empty(self.total)
        dist.all_gather(list(full.chunk(self.world)), self.shard)
        self._unflatten(full)


def test_zero2_correct_passes():
    check_Zero2Optimizer(Zero2Flat)
    check_Zero2Optimizer(Zero2Broadcast)


@pytest.mark.parametrize("impl, expected", [
    (Zero2AllReduce, "reduce-scatter the flat gradient"),
    (Zero2KeepsGrad, "still holds the gradient of"),
    (Zero2NoAverage, "differs from the unsharded"),
    (Zero2WithFrozen, "frozen"),
    (Zero2NoSync, "bring it the owner's updated values"),
    (Zero2ShardView, ".clone() your shard"),
    (Zero2NoPadding, "padded with zeros"),
    (Zero1PlainOptimizer, "all-reduced"),
    (Zero1ByParam, "still holds the gradient of"),
    (Zero2ClosureCheat, "beyond its shard"),
])
def test_zero2_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_Zero2Optimizer(impl)
    assert expected in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# what the host measures: memory read by the system, communication in its own record

#: A module-level object of the student's: it exists before any check starts.
_SAVED = {}


class Zero1BytesCheat(Zero1ByParam):
    """Cheat: the full optimizer state lives between steps only as bytes in a module-level dict; the attribute holds
    a decoy optimizer with no state. Right weights, 2Ψ moved per step."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        self.full = optimizer_cls(self.params, **kwargs)
        self.optim = _decoy(optimizer_cls, kwargs)
        _SAVED.clear()

    @torch.no_grad()
    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= self.world
        for i, p in enumerate(self.params):
            if i in _SAVED:
                self.full.state[p] = {k: torch.frombuffer(bytearray(v), dtype=torch.float32).view(p.shape)
                                      if k != "step" else torch.tensor(float(v)) for k, v in _SAVED[i].items()}
        self.full.step()
        for i, p in enumerate(self.params):
            _SAVED[i] = {k: (v.numpy().tobytes() if k != "step" else v.item()) for k, v in self.full.state[p].items()}
        self.full.state.clear()


class Zero2BytesCheat(Zero2Flat):
    """Cheat for ZeRO-2: reduce-scatter and all-gather as it should (2Ψ, no all-reduce, no .grad left), but every
    rank also steps a full optimizer whose state is kept as bytes in a module-level dict between steps."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        self.kwargs, self.cls = kwargs, optimizer_cls

    @torch.no_grad()
    def step(self):
        super().step()
        full = torch.cat([p.detach().reshape(-1) for p in self.params])
        _SAVED["copy"] = full.numpy().tobytes() * 2  # what a full Adam state weighs


class Zero2QuietAllReduce(Zero2Flat):
    """Right weights, reduce-scatter in step(); but zero_grad() quietly all-reduces every parameter first."""

    def zero_grad(self):
        for p in self.params:
            dist.all_reduce(p.detach().clone())
        super().zero_grad()


class Zero1HonestHabits(Zero1ByParam):
    """Correct, with habits honest code has: a print to stderr, a printed traceback, a cached helper, sys."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        print(f"rank {self.rank}: {_owned(len(self.params), self.world)} parameters each", file=sys.stderr)

    def step(self):
        try:
            raise ValueError("shown, then carried on")
        except ValueError:
            traceback.print_exc()
        super().step()


@functools.lru_cache(maxsize=None)
def _owned(n, world):
    return -(-n // world)


def test_state_kept_as_bytes_in_a_module_object_is_measured():
    with pytest.raises(AssertionError, match="beyond its shard"):
        check_ShardedOptimizer(Zero1BytesCheat)
    with pytest.raises(AssertionError, match="beyond its shard"):
        check_Zero2Optimizer(Zero2BytesCheat)


def test_a_quiet_all_reduce_outside_step_is_in_the_hosts_record():
    with pytest.raises(AssertionError, match=r"called all_reduce of \d+ B.* in zero_grad\(\)"):
        check_Zero2Optimizer(Zero2QuietAllReduce)


def test_honest_habits_pass():
    check_ShardedOptimizer(Zero1HonestHabits)
