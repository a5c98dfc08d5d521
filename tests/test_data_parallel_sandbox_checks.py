"""autograder.checks.data_parallel with the student's wrapper in the grading sandbox (``labsupport._sandbox``): the
gradients and weights come back as plain data, and whether each all-reduce was launched during backward is read
from the order of the requests the host carried, among the marks the driver makes inside backward
(``drivers.watch_backward``), never from the student's side.

Cheats, each written as a student would, lose the points: gradients that run their all-reduce when they are read
(after finish_gradient_synchronization() returned, where a counter closed at finish saw nothing), with zeros
all-reduced from the hooks to show the right calls at the right moments; and a wrapper that launches every
all-reduce at the end of backward and tells the check's watcher, found through a parameter's hook's closure, that
they had been launched all along (the sandbox holds no watcher of the check's). Honest habits (a print to stderr, a
printed traceback, a cached helper, ``import sys``) keep the points. In the watcher's test the grader cannot be
imported in the sandbox, as in grading: the drivers travel on their own. The scenario's SGD is torch's, written out.
"""

import functools
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from autograder.checks.data_parallel import ProbeNet, check_BucketedDDP, check_OverlapDDP
from autograder.checks.data_parallel.drivers import SGD

pytestmark = pytest.mark.slow


def _broadcast(module):
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t, 0)


class SyncsWhenRead(torch.Tensor):
    """A gradient that all-reduces itself the first time anything reads it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for a in args:
            if isinstance(a, SyncsWhenRead) and getattr(a, "pending", False):
                a.pending = False
                plain = a.as_subclass(torch.Tensor)
                dist.all_reduce(plain)
                plain /= dist.get_world_size()
        return super().__torch_function__(func, types, args, kwargs or {})


class OverlapSyncsLate(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        _broadcast(module)
        self.shown = []

        def hook(p):  # the right bytes at the right moment, but zeros: the real average comes later
            self.shown.append(dist.all_reduce(torch.zeros_like(p), async_op=True))

        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(hook)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for work in self.shown:
            work.wait()
        self.shown.clear()
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad = p.grad.as_subclass(SyncsWhenRead)
                p.grad.pending = True


def test_gradients_that_sync_when_read_lose_the_points():
    with pytest.raises(AssertionError) as info:
        check_OverlapDDP(OverlapSyncsLate)
    text = str(info.value)
    assert "after finish_gradient_synchronization() returned" in text and "all_reduce" in text, text


class OverlapTellsTheWatcher(nn.Module):
    """Launches every all-reduce once backward is over (a callback the engine runs at its end), and tells any
    watcher found in the parameters' hooks that each gradient's all-reduce was already launched when it was ready."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        _broadcast(module)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.works, self.queued = [], False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.on_ready)

    def on_ready(self, p):
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.launch_all)

    def launch_all(self):
        for p in self.params:
            if p.grad is not None:
                self.works.append((p, dist.all_reduce(p.grad, async_op=True)))
        self.queued = False

    def forward(self, *args, **kwargs):
        for p in self.params:
            for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
                for cell in getattr(hook, "__closure__", None) or ():
                    watcher = cell.cell_contents
                    if hasattr(watcher, "events") and hasattr(watcher, "issued"):
                        watcher.issued = lambda: 10**6
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for p, work in self.works:
            work.wait()
            p.grad /= dist.get_world_size()
        self.works.clear()


def test_launching_at_the_end_and_telling_the_watcher_loses_the_points(grader_out_of_reach):
    with pytest.raises(AssertionError) as info:
        check_OverlapDDP(OverlapTellsTheWatcher)
    text = str(info.value)
    assert "all-reduce(s) were due" in text and "but only 0 had been issued" in text, text


@functools.lru_cache(maxsize=None)
def cap_in_bytes(bucket_size_mb):
    return float("inf") if bucket_size_mb is None else bucket_size_mb * 2**20


class BucketedWithHabits(nn.Module):
    def __init__(self, module, bucket_size_mb=25.0):
        super().__init__()
        print(f"rank {dist.get_rank()}: building buckets", file=sys.stderr)
        try:
            raise ValueError("a debugging leftover")
        except ValueError:
            traceback.print_exc()
        self.module = module
        _broadcast(module)
        cap = cap_in_bytes(bucket_size_mb)
        self.buckets, current, size = [], [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            n = p.numel() * p.element_size()
            if current and size + n > cap:
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += n
        if current:
            self.buckets.append(current)
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self.ready, self.flying, self.sync = [0] * len(self.buckets), {}, True
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self.on_ready)

    def on_ready(self, p):
        if self.sync:
            i = self.bucket_of[p]
            self.ready[i] += 1
            if self.ready[i] == len(self.buckets[i]):
                self.launch(i)

    def launch(self, i):
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.buckets[i]])
        self.flying[i] = (flat, dist.all_reduce(flat, async_op=True))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):
            if i not in self.flying:
                self.launch(i)
        for i, (flat, work) in self.flying.items():
            work.wait()
            flat /= dist.get_world_size()
            for p, piece in zip(self.buckets[i], flat.split([p.numel() for p in self.buckets[i]])):
                if p.grad is not None:
                    p.grad.copy_(piece.view_as(p))
        self.flying.clear()
        self.ready = [0] * len(self.buckets)

    def no_sync(self):
        import contextlib

        @contextlib.contextmanager
        def off():
            self.sync = False
            try:
                yield
            finally:
                self.sync = True

        return off()


def test_honest_habits_are_accepted():
    check_BucketedDDP(BucketedWithHabits)


def test_the_scenarios_sgd_is_torchs():
    """The checks step with their own SGD (torch's imports its compiler, seconds in every process): the same steps."""
    ours, torchs = ProbeNet(), ProbeNet()
    torchs.load_state_dict(ours.state_dict())
    opt_ours = SGD(list(ours.parameters()), 0.05, 0.9)
    opt_torch = torch.optim.SGD(torchs.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        for model, opt in ((ours, opt_ours), (torchs, opt_torch)):
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), torchs.parameters()):
        assert a.grad is None and b.grad is None
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=name)
