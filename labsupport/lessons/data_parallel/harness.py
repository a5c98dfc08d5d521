"""The timing code behind notebook 03's measurements, and the recorder its visible tests use to see when each
all-reduce is launched.

The notebook decides how a model is wrapped for each variant (``wrap(model) -> (model_to_call, finish)``, where
``finish()`` completes gradient synchronisation after backward) and passes that function in; everything here only
runs steps and times them. ``record_ready`` notes, as each gradient becomes ready during backward, how many
all-reduces had been issued by then; ``launched_late`` reads that record against the buckets.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from ...i18n import _
from ...timeline import Timeline

__all__ = ["gil_comparison", "make_mlp", "record_steps", "summarise_steps", "time_per_step", "record_ready",
           "launched_late"]


# ----------------------------------------------------------------------------------------------------------------
# When the all-reduces are launched


def record_ready(module: nn.Module, counter) -> list:
    """Hook every trainable parameter of ``module`` (after the wrapper has hooked them: call it on the wrapped
    model's ``module``) so that when its gradient is ready, ``(name, all-reduces issued so far)`` is appended to the
    returned list; ``counter`` is the ``CommCounter`` around backward."""
    ready = []
    for name, p in module.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(
                lambda p, name=name: ready.append((name, counter.summary.count("all_reduce"))))
    return ready


def launched_late(ready: list, buckets: list) -> str | None:
    """Whether an all-reduce was launched late, in words, or None: ``ready`` is ``record_ready``'s list, ``buckets``
    the expected buckets (lists of parameter names; one parameter each for one all-reduce per gradient). When a
    gradient is ready, every bucket whose gradients were all ready *before* it must have been issued already (the
    one it completes may follow a moment later, whichever kind of hook launches it)."""
    for k, (name, issued) in enumerate(ready):
        before = {n for n, _ in ready[:k]}
        due = [b for b in buckets if all(n in before for n in b)]
        if issued < len(due):
            return _("when the gradient of '{name}' was ready, {issued} all-reduce(s) had been issued, but "
                     "{due} bucket(s) were complete before it (e.g. {example}): launch each all-reduce from a "
                     "hook as soon as its last gradient is ready, not later in backward or in "
                     "finish_gradient_synchronization.").format(name=name, issued=issued, due=len(due),
                                                                example=due[-1])
    return None


# ----------------------------------------------------------------------------------------------------------------
# Threads vs processes


def _python_work(n):
    """Pure Python: holds the GIL the whole time."""
    return sum(i * i for i in range(n))


def _torch_work(n):
    """Matrix products: PyTorch releases the GIL inside each one."""
    a = torch.randn(256, 256)
    for _ in range(n):
        a = torch.tanh(a @ a)
    return a


def _in_threads(fn, arg, count):
    threads = [threading.Thread(target=fn, args=(arg,)) for _ in range(count)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def _rank_span(fn, arg):
    dist.barrier()
    start = time.perf_counter()
    fn(arg)
    return start, time.perf_counter()


def _in_processes(fn, arg, count):
    from ...launch import run

    spans = run(_rank_span, fn, arg, world_size=count)
    return max(e for _, e in spans) - min(s for s, _ in spans)


def _one_by_one(fn, arg, count):
    start = time.perf_counter()
    for _ in range(count):
        fn(arg)
    return time.perf_counter() - start


def gil_comparison(python_n: int = 1_000_000, torch_n: int = 100, repeats: int = 3, count: int = 2) -> None:
    """Print how long two replicas' worth of work takes one by one, in ``count`` threads and in ``count``
    processes: pure Python (``python_n`` squares) and torch matmuls (``torch_n`` products of 256 x 256).

    Each time is the best of ``repeats`` (other programs on the machine only ever make things slower), with one
    thread per replica, as in the worker processes.
    """
    work = {"pure Python": (_python_work, python_n), "torch matmuls": (_torch_work, torch_n)}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        print(f"{'work for %d replicas' % count:<20} {'one by one':>10} {'%d threads' % count:>10} "
              f"{'%d processes' % count:>12}")
        for label, (fn, arg) in work.items():
            best = [min(how(fn, arg, count) for _ in range(repeats)) for how in (_one_by_one, _in_threads,
                                                                                 _in_processes)]
            print(f"{label:<20} {best[0]:9.3f}s {best[1]:9.3f}s {best[2]:11.3f}s")
    finally:
        torch.set_num_threads(threads_before)
    load, cores = os.getloadavg()[0], os.cpu_count()
    if load > cores:
        print(f"(the machine is busy: load {load:.1f} on {cores} cores, so these timings are unreliable)")


# ----------------------------------------------------------------------------------------------------------------
# Training steps on workers


def make_mlp(width: int = 512, depth: int = 8, seed: int = 0) -> nn.Sequential:
    """``depth`` layers of Linear(width, width) + ReLU: equal-sized layers, so backward's timing is regular."""
    torch.manual_seed(seed)
    return nn.Sequential(*[layer for _ in range(depth) for layer in (nn.Linear(width, width), nn.ReLU())])


def record_steps(wrap, steps: int, batch: int = 64, width: int = 512, depth: int = 8) -> list:
    """On every rank: ``steps`` training steps of ``make_mlp(width, depth)`` wrapped by ``wrap(model)``; per step a
    dict with the ``Timeline`` events, the step's seconds and the fraction of communication hidden behind compute."""
    rank = dist.get_rank()
    model = make_mlp(width, depth, seed=rank)
    wrapped, finish = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, width, generator=gen)
        dist.barrier()                                    # all ranks start the step together
        tl = Timeline()
        with tl.collectives():                            # every all-reduce, issue -> completion
            with tl.span("forward"):
                loss = wrapped(x).pow(2).mean()
            with tl.span("backward"):
                loss.backward()
            with tl.span("sync", kind="wait"):
                finish()
            with tl.span("step"):
                opt.step()
                opt.zero_grad()
        out.append({"events": tl.events, "seconds": tl.now(), "hidden": Timeline.hidden_fraction(tl.events)})
    return out


def summarise_steps(runs) -> tuple[float, float]:
    """Median over steps (the first skipped: it warms up) of the seconds per step (slowest rank) and of the
    fraction of communication hidden (mean of the ranks), from what ``record_steps`` returned on every rank."""
    steps = range(1, len(runs[0])) if len(runs[0]) > 1 else range(len(runs[0]))
    seconds = statistics.median(max(r[s]["seconds"] for r in runs) for s in steps)
    hidden = statistics.median(statistics.mean(r[s]["hidden"] for r in runs) for s in steps)
    return seconds, hidden


def time_per_step(wrap, steps: int, batch: int = 64, width: int = 512) -> float:
    """On every rank: the fastest of ``steps`` training steps after a warm-up step (other programs only ever add
    time). ``wrap=None`` trains without any communication: the lower bound."""
    rank = dist.get_rank()
    model = make_mlp(width, seed=rank)
    wrapped, finish = (model, lambda: None) if wrap is None else wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width)
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        wrapped(x).pow(2).mean().backward()
        finish()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return min(times[1:])
