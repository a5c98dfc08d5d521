"""A zero-bubble step on worker processes: the demo model's stages run a schedule of F, B and W, with the backward
split in two by ``torch.autograd.grad`` (B: the gradient of the stage's input, sent back at once; W: the gradients
of its weights, later), and PyTorch's own zero-bubble schedules on the same model.

``zero_bubble_run`` takes a schedule with W (yours) and runs the lesson's demo model, not any model: it is the
harness of this notebook's demo, recorded in a ``Timeline`` (spans ``F mb``, ``B mb``, ``W mb``) and, with
``profile=True``, in a ``torch.profiler`` trace. Each operation is padded with ``time.sleep`` to ``t_f``, ``t_b``,
``t_w`` as in notebook 05, so that 4 ranks on 2 cores show the schedule and not the machine.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from ...timeline import Timeline

__all__ = ["make_model", "demo_batch", "one_process_grads", "zero_bubble_run", "torch_zero_bubble"]


def make_model(num_layers: int = 8, width: int = 32, seed: int = 0) -> nn.Sequential:
    """``num_layers`` blocks of ``Linear(width, width)`` + ``Tanh``."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(num_layers)])


def demo_batch(m: int, rows: int, width: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return ([torch.randn(rows, width, generator=gen) for _ in range(m)],
            [torch.randn(rows, width, generator=gen) for _ in range(m)])


def _mse(y, t):
    return ((y - t) ** 2).mean()


def one_process_grads(m: int, num_layers: int = 8, width: int = 32, rows: int = 16) -> list:
    """Every parameter's gradient of the mean loss over ``m`` micro-batches, in one process."""
    model = make_model(num_layers, width)
    xs, ys = demo_batch(m, rows, width)
    (sum(_mse(model(x), y) for x, y in zip(xs, ys)) / m).backward()
    return [p.grad for p in model.parameters()]


def _pad(start: float, seconds: float) -> None:
    left = seconds - (time.perf_counter() - start)
    if left > 0:
        time.sleep(left)


def zero_bubble_run(schedule, t_f: float = 0.0, t_b: float = 0.0, t_w: float = 0.0, num_layers: int = 8,
                    width: int = 32, rows: int = 16, profile: bool = False) -> dict:
    """On every rank (rank s runs stage s of ``schedule``, a list per stage of ("F"|"B"|"W", mb), every stage with
    its W's). Returns ``{"grads": this stage's parameter gradients, "events": Timeline events, "trace": the
    profiler's trace events or None}``."""
    from contextlib import nullcontext

    rank, p = dist.get_rank(), dist.get_world_size()
    ops = [tuple(o) for o in schedule[rank]]
    if not any(op == "W" for op, _ in ops):
        raise ValueError("zero_bubble_run runs schedules that split the backward: every stage needs its ('W', mb)")
    m = sum(1 for op, _ in ops if op == "F")
    model = make_model(num_layers, width)
    per = num_layers // p
    stage = model[rank * per:(rank + 1) * per] if rank < p - 1 else model[rank * per:]
    params = list(stage.parameters())
    xs, ys = demo_batch(m, rows, width)
    probe = torch.randn(rows, width, requires_grad=True)    # warm-up: the first autograd.grad given grad_outputs
    out = stage(probe)                                      # in a fresh process takes seconds (it imports)
    torch.autograd.grad(out, [probe], torch.ones_like(out), retain_graph=True)
    torch.autograd.grad(out, params, torch.ones_like(out))
    warm = []                                               # and the first message each way between neighbours
    for peer in (rank - 1, rank + 1):
        if 0 <= peer < p:
            warm += [dist.isend(torch.zeros(rows, width), peer), dist.irecv(torch.empty(rows, width), peer)]
    for w in warm:
        w.wait()
    from torch.profiler import record_function

    with record_function("warm-up"):                       # its first use costs a tenth of a second
        pass
    tl = Timeline()
    kept, grads_out, sends = {}, {}, []
    prof = None
    if profile:
        from torch.profiler import ProfilerActivity, profile as _profile

        prof = _profile(activities=[ProfilerActivity.CPU])
    with (prof if prof is not None else nullcontext()):
        dist.barrier()                 # after the profiler started: starting it takes the ranks unequal times
        tl = Timeline()
        for op, mb in ops:
            # a message this operation needs is received before its span starts: waiting is idle time, not work
            if op == "F" and rank > 0:
                x = torch.empty(rows, width)
                dist.recv(x, rank - 1)
                x.requires_grad_()
            if op == "B" and rank < p - 1:
                gy = torch.empty(rows, width)
                dist.recv(gy, rank + 1)
            start = time.perf_counter()
            with tl.span(f"{op} {mb}"), record_function(f"{op}{mb}"):
                if op == "F":
                    if rank == 0:
                        x = xs[mb]
                    y = stage(x)
                    if rank == p - 1:
                        y = _mse(y, ys[mb]) / m
                    kept[mb] = (x, y)
                    _pad(start, t_f)          # the padded computation ends before its result leaves
                    if rank < p - 1:
                        sends.append(dist.isend(y.detach(), rank + 1))
                elif op == "B":               # the gradient of the input only: what the stage before waits for
                    x, y = kept[mb]
                    grads_out[mb] = gy if rank < p - 1 else None
                    gx = torch.autograd.grad(y, [x], grads_out[mb], retain_graph=True)[0] if rank > 0 else None
                    _pad(start, t_b)
                    if rank > 0:
                        sends.append(dist.isend(gx, rank - 1))
                else:                          # "W": the weights' gradients, when the stage has time
                    x, y = kept.pop(mb)
                    gw = torch.autograd.grad(y, params, grads_out.pop(mb))
                    for prm, g in zip(params, gw):
                        prm.grad = g if prm.grad is None else prm.grad + g
                    _pad(start, t_w)
        for s in sends:
            s.wait()
    trace = None
    if prof is not None:
        from .traces import profiler_events

        trace = profiler_events(prof)
    return {"grads": [prm.grad for prm in params], "events": tl.finish(), "trace": trace}


def torch_zero_bubble(kind: str, m: int, num_layers: int = 8, width: int = 32, rows: int = 16) -> dict:
    """PyTorch's ``ScheduleZBVZeroBubble`` (``kind="ZBV"``: rank r holds stages r and 2p−1−r, a V) or
    ``ScheduleInterleavedZeroBubble`` (``"interleaved"``: stages r and r + p) on the demo model, 2p stages.
    Returns ``{stage index: its parameter gradients}``."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

    rank, p = dist.get_rank(), dist.get_world_size()
    n = 2 * p
    model = make_model(num_layers, width)
    per = num_layers // n
    ids = [rank, n - 1 - rank] if kind == "ZBV" else [rank, rank + p]
    stages = [PipelineStage(model[i * per:(i + 1) * per], i, n, torch.device("cpu")) for i in ids]
    cls = ScheduleZBVZeroBubble if kind == "ZBV" else ScheduleInterleavedZeroBubble
    schedule = cls(stages, n_microbatches=m, loss_fn=_mse)
    xs, ys = demo_batch(m, rows, width)
    x, y = torch.cat(xs), torch.cat(ys)
    first, last = 0 in ids, n - 1 in ids
    if first and last:
        schedule.step(x, target=y, losses=[])
    elif first:
        schedule.step(x)
    elif last:
        schedule.step(target=y, losses=[])
    else:
        schedule.step()
    return {i: [prm.grad.clone() for prm in st.submod.parameters()] for i, st in zip(ids, stages)}
