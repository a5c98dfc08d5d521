"""autograder.checks.data_parallel: correct implementations pass; planted bugs lose the points with the right message.

Every implementation here is written the way a student might write it; the bugs are the usual ones
(blocking all-reduce after backward, sum without dividing, no initial broadcast, forward-order buckets, one
all-reduce per parameter, no_sync that still communicates or drops the accumulated gradient, reducing frozen
parameters) plus the ones each message of the checker is there for.
"""

import itertools
import math
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from autograder.checks.data_parallel import (
    ProbeNet,
    check_average_gradients,
    check_broadcast_parameters,
    check_BucketedDDP,
    check_OverlapDDP,
    expected_buckets,
)
from autograder.checks.data_parallel.reference import _bucket_bytes, _layout

# ---------------------------------------------------------------------------------------------------------------
# broadcast_parameters


def broadcast_ok(module, src=0):
    with torch.no_grad():
        for t in itertools.chain(module.parameters(), module.buffers()):
            dist.broadcast(t, src)


def broadcast_flat(module, src=0):
    """Correct alternative: one broadcast for all floating-point tensors (flattened), one per other tensor."""
    tensors = list(module.parameters()) + list(module.buffers())
    floats = [t for t in tensors if t.dtype == torch.float32]
    flat = torch.cat([t.detach().reshape(-1) for t in floats])
    dist.broadcast(flat, src)
    with torch.no_grad():
        offset = 0
        for t in floats:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        for t in tensors:
            if t.dtype != torch.float32:
                dist.broadcast(t, src)


def broadcast_no_buffers(module, src=0):
    for p in module.parameters():
        dist.broadcast(p.data, src)


def broadcast_always_rank0(module, src=0):
    broadcast_ok(module, 0)


def broadcast_trainable_only(module, src=0):
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                dist.broadcast(p, src)
        for b in module.buffers():
            dist.broadcast(b, src)


def broadcast_replaces_parameters(module, src=0):
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            value = p.detach().clone()
            dist.broadcast(value, src)
            m._parameters[name] = nn.Parameter(value, requires_grad=p.requires_grad)
    for b in module.buffers():
        dist.broadcast(b, src)


def broadcast_todo(module, src=0):
    raise NotImplementedError()


def test_broadcast_correct_passes():
    check_broadcast_parameters(broadcast_ok)
    check_broadcast_parameters(broadcast_flat)


@pytest.mark.parametrize(
    "impl, expected",
    [
        (broadcast_no_buffers, "buffer 'shift'"),
        (broadcast_always_rank0, "src=3"),
        (broadcast_trainable_only, "parameter 'frozen.weight'"),
        (broadcast_replaces_parameters, "Parameter objects were replaced"),
        (broadcast_todo, "not started: it still raises NotImplementedError"),
    ],
)
def test_broadcast_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_broadcast_parameters(impl)
    assert expected in str(info.value), str(info.value)
    assert "seed" in str(info.value) or "not started" in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# average_gradients


def average_ok(module):
    world = dist.get_world_size()
    for p in module.parameters():
        if p.requires_grad and p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def average_flat(module):
    """Correct alternative: pre-divide, one all-reduce of all gradients flattened, copy back."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads]) / dist.get_world_size()
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def average_sum_only(module):
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def average_crashes_on_none(module):
    for p in module.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def average_on_a_copy(module):
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad.clone())
            p.grad /= dist.get_world_size()


def average_nothing(module):
    pass


def average_and_step(module):
    average_ok(module)
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad


def average_zero_fills_everything(module):
    for p in module.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def average_fills_missing_with_ones(module):
    average_ok(module)
    for p in module.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.ones_like(p)


def average_moves_result_away(module):
    for p in module.parameters():
        if p.grad is not None:
            g = p.grad.clone()
            dist.all_reduce(g)
            p.averaged = g / dist.get_world_size()
            p.grad = None


def test_average_correct_passes():
    check_average_gradients(average_ok)
    check_average_gradients(average_flat)


@pytest.mark.parametrize(
    "impl, expected",
    [
        (average_sum_only, "summed over ranks but not divided by the world size"),
        (average_crashes_on_none, "skip them"),
        (average_on_a_copy, "the all-reduce result was lost"),
        (average_nothing, "this rank's own local gradient"),
        (average_and_step, "parameter 'embed.weight' changed"),
        (average_zero_fills_everything, "does not require grad, yet has a gradient"),
        (average_fills_missing_with_ones, "never used in forward"),
        (average_moves_result_away, "has no gradient after synchronisation"),
    ],
)
def test_average_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_average_gradients(impl)
    assert expected in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# OverlapDDP


class OverlapOK(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        broadcast_ok(module)
        self.pending = []

        def hook(p):
            self.pending.append((p, dist.all_reduce(p.grad, async_op=True)))

        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(hook)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for p, work in self.pending:
            work.wait()
            p.grad /= dist.get_world_size()
        self.pending.clear()


class OverlapAccumulateGradHooks(nn.Module):
    """Correct alternative: hooks on the AccumulateGrad nodes, gradients divided before they are reduced."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        broadcast_flat(module)
        self.works = []
        self._keep = []
        for p in module.parameters():
            if not p.requires_grad:
                continue
            acc = p.expand_as(p).grad_fn.next_functions[0][0]

            def hook(*_, p=p):
                p.grad.div_(dist.get_world_size())
                self.works.append(dist.all_reduce(p.grad, async_op=True))

            acc.register_hook(hook)
            self._keep.append(acc)  # the node must outlive this loop

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        while self.works:
            self.works.pop().wait()


class OverlapBlocking(OverlapOK):
    """Bug: the textbook blocking version (all-reduce every gradient after backward)."""

    def __init__(self, module):
        nn.Module.__init__(self)
        self.module = module
        broadcast_ok(module)

    def finish_gradient_synchronization(self):
        average_ok(self.module)


class OverlapNoDivide(OverlapOK):
    def finish_gradient_synchronization(self):
        for p, work in self.pending:
            work.wait()
        self.pending.clear()


class OverlapNoBroadcast(OverlapOK):
    def __init__(self, module):
        nn.Module.__init__(self)
        self.module = module
        self.pending = []
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda p: self.pending.append((p, dist.all_reduce(p.grad, async_op=True))))


class OverlapReducesFrozen(OverlapOK):
    """Bug: parameters without a gradient (frozen ones included) are all-reduced as zeros in finish."""

    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            if p.grad is None:
                dist.all_reduce(torch.zeros_like(p))
        super().finish_gradient_synchronization()


class OverlapHooksFrozen(OverlapOK):
    """Bug: hooks registered on every parameter, frozen ones included (PyTorch refuses)."""

    def __init__(self, module):
        nn.Module.__init__(self)
        self.module = module
        broadcast_ok(module)
        self.pending = []
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(
                lambda p: self.pending.append((p, dist.all_reduce(p.grad, async_op=True))))


class OverlapTiedTwice(OverlapOK):
    """Bug: walks every module's own parameters, so the tied weight gets two hooks and is reduced twice."""

    def __init__(self, module):
        nn.Module.__init__(self)
        self.module = module
        broadcast_ok(module)
        self.pending = []
        for m in module.modules():
            for p in m.parameters(recurse=False):
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(
                        lambda p: self.pending.append((p, dist.all_reduce(p.grad, async_op=True))))

    def finish_gradient_synchronization(self):
        done = set()
        for p, work in self.pending:
            work.wait()
            if p not in done:
                p.grad /= dist.get_world_size()
                done.add(p)
        self.pending.clear()


class OverlapWeightsOnly(OverlapOK):
    """Bug: only parameters named '*weight' are hooked (biases are never averaged)."""

    def __init__(self, module):
        nn.Module.__init__(self)
        self.module = module
        broadcast_ok(module)
        self.pending = []
        for name, p in module.named_parameters():
            if p.requires_grad and name.endswith("weight"):
                p.register_post_accumulate_grad_hook(
                    lambda p: self.pending.append((p, dist.all_reduce(p.grad, async_op=True))))


class OverlapOneLate(OverlapOK):
    """Bug: each hook launches the PREVIOUS gradient's all-reduce; the last one waits for finish."""

    def __init__(self, module):
        nn.Module.__init__(self)
        self.module = module
        broadcast_ok(module)
        self.pending, self.waiting = [], None

        def hook(p):
            if self.waiting is not None:
                q = self.waiting
                self.pending.append((q, dist.all_reduce(q.grad, async_op=True)))
            self.waiting = p

        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(hook)

    def finish_gradient_synchronization(self):
        if self.waiting is not None:
            self.pending.append((self.waiting, dist.all_reduce(self.waiting.grad, async_op=True)))
            self.waiting = None
        super().finish_gradient_synchronization()


class OverlapNeverClears(OverlapOK):
    """Bug: the list of pending all-reduces is never cleared, so old gradients are divided again."""

    def finish_gradient_synchronization(self):
        for p, work in self.pending:
            work.wait()
            p.grad /= dist.get_world_size()


class OverlapNotAModule:
    def __init__(self, module):
        self.module = module
        broadcast_ok(module)

    def __call__(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        average_ok(self.module)


class OverlapNoFinish(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        broadcast_ok(module)

    def forward(self, x):
        return self.module(x)


class OverlapTodo(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        raise NotImplementedError()


def test_overlap_correct_passes():
    check_OverlapDDP(OverlapOK)
    check_OverlapDDP(OverlapAccumulateGradHooks)


@pytest.mark.parametrize(
    "impl, expected",
    [
        (OverlapBlocking, "no all-reduce was issued while backward ran"),
        (OverlapNoDivide, "not divided by the world size"),
        (OverlapNoBroadcast, "must broadcast rank 0's parameters and buffers"),
        (OverlapReducesFrozen, "requires_grad=False (frozen)"),
        (OverlapHooksFrozen, "raised RuntimeError"),
        (OverlapTiedTwice, "reduced more than once"),
        (OverlapWeightsOnly, "never reduced"),
        (OverlapOneLate, "1 all-reduce(s) were due (their gradients were all ready earlier, e.g. [readout.bias])"),
        (OverlapNeverClears, "step 2"),
        (OverlapNotAModule, "should be an nn.Module"),
        (OverlapNoFinish, "no finish_gradient_synchronization() method"),
        (OverlapTodo, "not started: it still raises NotImplementedError"),
    ],
)
def test_overlap_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_OverlapDDP(impl)
    assert expected in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# BucketedDDP


def layout(params, cap):
    buckets, current, size = [], [], 0
    for p in params:
        n = p.numel() * p.element_size()
        if current and size + n > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += n
    if current:
        buckets.append(current)
    return buckets


class BucketedOK(nn.Module):
    """The straightforward version: torch.cat each bucket when its last gradient arrives."""

    order = staticmethod(lambda params: list(reversed(params)))
    include_frozen = False
    broadcast = staticmethod(broadcast_ok)

    def __init__(self, module, bucket_size_mb):
        super().__init__()
        self.module = module
        self.broadcast(module)
        params = [p for p in module.parameters() if self.include_frozen or p.requires_grad]
        self.buckets = self.make_buckets(params, math.inf if bucket_size_mb is None else bucket_size_mb * 2**20)
        self.index = {p: i for i, b in enumerate(self.buckets) for p in b}
        self.ready = [0] * len(self.buckets)
        self.works = {}
        self.sync = True
        for p in self.index:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.on_ready)

    def make_buckets(self, params, cap):
        return layout(self.order(params), cap)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def on_ready(self, p):
        if not self.sync:
            return
        i = self.index[p]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):
            self.launch(i)

    def flat(self, i):
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.buckets[i]])

    def launch(self, i):
        flat = self.flat(i)
        self.works[i] = (flat, dist.all_reduce(flat, async_op=True))

    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):
            if i not in self.works:
                self.launch(i)
        for i, (flat, work) in self.works.items():
            work.wait()
            flat /= dist.get_world_size()
            offset = 0
            for p in self.buckets[i]:
                if p.grad is not None:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.works.clear()
        self.ready = [0] * len(self.buckets)

    @contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


class BucketedViews(nn.Module):
    """Correct alternative: one preallocated flat buffer per bucket, gradients copied into it as they arrive
    (AccumulateGrad hooks), all-reduced with the deprecated all_reduce_coalesced on the list of views."""

    def __init__(self, module, bucket_size_mb):
        super().__init__()
        self.module = module
        broadcast_flat(module)
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        self.buckets = layout(params, math.inf if bucket_size_mb is None else bucket_size_mb * 2**20)
        self.buffers_ = [torch.zeros(sum(p.numel() for p in b)) for b in self.buckets]
        self.views = []
        for b, buf in zip(self.buckets, self.buffers_):
            self.views.append(list(buf.split([p.numel() for p in b])))
        self.where = {}
        for i, b in enumerate(self.buckets):
            for j, p in enumerate(b):
                self.where[p] = (i, j)
        self.missing = [set(range(len(b))) for b in self.buckets]
        self.works = [None] * len(self.buckets)
        self.enabled = True
        self._keep = []
        for p in params:
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(lambda *_, p=p: self.ready(p))
            self._keep.append(acc)

    def forward(self, x):
        return self.module(x)

    def ready(self, p):
        if not self.enabled:
            return
        i, j = self.where[p]
        self.views[i][j].copy_(p.grad.reshape(-1))
        self.missing[i].discard(j)
        if not self.missing[i]:
            self.go(i)

    def go(self, i):
        for j in self.missing[i]:
            self.views[i][j].zero_()
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.works[i] = dist.all_reduce_coalesced(self.views[i], async_op=True)

    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):
            if self.works[i] is None:
                self.go(i)
        for i, b in enumerate(self.buckets):
            self.works[i].wait()
            for p, v in zip(b, self.views[i]):
                if p.grad is not None:
                    p.grad.copy_(v.view_as(p) / dist.get_world_size())
            self.works[i] = None
            self.missing[i] = set(range(len(b)))

    @contextmanager
    def no_sync(self):
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True


class BucketedForwardOrder(BucketedOK):
    order = staticmethod(lambda params: list(params))


class BucketedPerParameter(BucketedOK):
    def make_buckets(self, params, cap):
        return [[p] for p in reversed(params)]


class BucketedViewByView(BucketedOK):
    """Bug: the right buckets, but each gradient of a bucket is all-reduced on its own."""

    def launch(self, i):
        works = []
        for p in self.buckets[i]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            works.append(dist.all_reduce(p.grad, async_op=True))
        self.works[i] = (None, works)

    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):
            if i not in self.works:
                self.launch(i)
        for i, (_, works) in self.works.items():
            for w in works:
                w.wait()
            for p in self.buckets[i]:
                p.grad /= dist.get_world_size()
        self.works.clear()
        self.ready = [0] * len(self.buckets)


class BucketedBlocking(BucketedOK):
    def on_ready(self, p):
        pass


class BucketedNoDivide(BucketedOK):
    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):
            if i not in self.works:
                self.launch(i)
        for i, (flat, work) in self.works.items():
            work.wait()
            offset = 0
            for p in self.buckets[i]:
                if p.grad is not None:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.works.clear()
        self.ready = [0] * len(self.buckets)


class BucketedNoBroadcast(BucketedOK):
    broadcast = staticmethod(lambda module: None)


class BucketedIncludesFrozen(BucketedOK):
    include_frozen = True


class BucketedSkipsUnused(BucketedOK):
    def flat(self, i):
        return torch.cat([p.grad.reshape(-1) for p in self.buckets[i] if p.grad is not None])

    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):
            if i not in self.works:
                self.launch(i)
        for i, (flat, work) in self.works.items():
            work.wait()
            flat /= dist.get_world_size()
            offset = 0
            for p in self.buckets[i]:
                if p.grad is not None:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
        self.works.clear()
        self.ready = [0] * len(self.buckets)


class BucketedReachesCap(BucketedOK):
    def make_buckets(self, params, cap):
        buckets, current, size = [], [], 0
        for p in reversed(params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
        return buckets


class BucketedCapInElements(BucketedOK):
    def make_buckets(self, params, cap):
        buckets, current, size = [], [], 0
        for p in reversed(params):
            if current and size + p.numel() > cap:
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel()
        if current:
            buckets.append(current)
        return buckets


class BucketedTwice(BucketedOK):
    """Bug: finish launches every bucket again, even those already in flight."""

    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):
            if i in self.works:
                self.works[i][1].wait()
            self.launch(i)
        super().finish_gradient_synchronization()


class BucketedNoSyncCommunicates(BucketedOK):
    @contextmanager
    def no_sync(self):
        yield


class BucketedNoSyncDrops(BucketedOK):
    """Bug: buckets are filled with the gradient of the current backward only (a tensor hook sees that), so what
    accumulated under no_sync is overwritten."""

    def __init__(self, module, bucket_size_mb):
        super().__init__(module, bucket_size_mb)
        self.current = {}
        for p in self.index:
            p.register_hook(lambda g, p=p: self.current.__setitem__(p, g.detach().clone()))

    def flat(self, i):
        return torch.cat([self.current.get(p, torch.zeros_like(p)).reshape(-1) for p in self.buckets[i]])

    def finish_gradient_synchronization(self):
        super().finish_gradient_synchronization()
        self.current.clear()


class BucketedNoSyncStillCounts(BucketedOK):
    """Bug: under no_sync the hook does not launch, but still counts the gradient as ready."""

    def on_ready(self, p):
        i = self.index[p]
        self.ready[i] += 1
        if self.sync and self.ready[i] == len(self.buckets[i]):
            self.launch(i)


class BucketedNoNoSync(BucketedOK):
    no_sync = None


class BucketedNoneCrashes(BucketedOK):
    """Bug: bucket_size_mb=None (no cap: one bucket, as torch's DDP takes it) is multiplied like a number."""

    def __init__(self, module, bucket_size_mb):
        super().__init__(module, bucket_size_mb * 2**20 / 2**20)


def test_bucketed_correct_passes():
    check_BucketedDDP(BucketedOK)
    check_BucketedDDP(BucketedViews)


@pytest.mark.parametrize(
    "impl, expected",
    [
        (BucketedForwardOrder, "forward (registration) order"),
        (BucketedPerParameter, "one all-reduce per parameter"),
        (BucketedViewByView, "one all-reduce per parameter"),
        (BucketedBlocking, "no all-reduce was issued while backward ran"),
        (BucketedNoDivide, "not divided by the world size"),
        (BucketedNoBroadcast, "must broadcast rank 0's parameters and buffers"),
        (BucketedIncludesFrozen, "include parameters with requires_grad=False"),
        (BucketedSkipsUnused, "are missing from their buckets"),
        (BucketedReachesCap, "PAST bucket_size_mb"),
        (BucketedCapInElements, "one per bucket (reverse registration order"),
        (BucketedTwice, "all-reduced twice in one step"),
        (BucketedNoSyncCommunicates, "must not communicate at all"),
        (BucketedNoSyncDrops, "ACCUMULATED"),
        (BucketedNoSyncStillCounts, "carries over into this step"),
        (BucketedNoNoSync, "no no_sync() method"),
        (BucketedNoneCrashes, "BucketedDDP(model, bucket_size_mb=None) raised TypeError"),
    ],
)
def test_bucketed_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_BucketedDDP(impl)
    assert expected in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# the layouts the checks rely on


def test_expected_buckets_follow_the_rule():
    model = ProbeNet()
    cap_mb = 1000 / 2**20
    buckets = expected_buckets(model, cap_mb)
    names = [[n for n, _ in b] for b in buckets]
    assert names[0][0] == "readout.bias"  # reverse registration order
    assert all(sum(s for _, s in b) <= 1000 or len(b) == 1 for b in buckets)
    flat = [n for b in names for n in b]
    assert "frozen.weight" not in flat and "scale.gain" not in flat and "spare.weight" in flat
    assert flat.count("embed.weight") == 1  # the tied weight once
    # a cap smaller than every parameter: one bucket per trainable parameter
    assert all(len(b) == 1 for b in expected_buckets(model, 16 / 2**20))
    # the configurations are chosen so that forward-order buckets are visibly different
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert _bucket_bytes(_layout(trainable, 1000)) != _bucket_bytes(
        _layout(trainable[::-1], 1000))
    # a cap below the largest parameters gives each of them a bucket of its own
    assert [768] in [[s for _, s in b] for b in expected_buckets(model, 700 / 2**20)]

