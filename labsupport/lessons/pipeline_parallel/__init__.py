"""Notebook 05 (pipeline parallelism): the demo model, what a pipeline run records, and how it is measured.

* ``make_model(num_layers, width, seed)``: ``num_layers`` blocks (Linear, Tanh) of the same width, so every stage's
  input and output have the micro-batch's shape; ``build_stage(model, layers)`` keeps the blocks of one stage.
* ``mse(output, target)``: the loss the demos use; ``demo_batch(m, rows, width, seed)``: the micro-batches and
  targets ``pipeline_run`` uses; ``one_process_step(...)``: the oracle, the whole model in one process, loss averaged
  over the micro-batches (returns the loss and every gradient, in ``model.parameters()`` order).
* ``TimedStage(stage, timeline, ...)``: wraps a stage so that each forward and each backward is recorded as a span
  ``"F 3"`` / ``"B 3"`` in a ``labsupport.Timeline``; optionally pads each to a fixed duration with ``time.sleep``.
* ``pipeline_run(run_pipeline, schedule, layers, ...)``: inside a worker, build this rank's stage of the demo model,
  run a pipeline function on it and return what was measured: the spans, the loss, the peak bytes of tensors alive.
* ``measured_bubble(events_per_rank)``: the idle share of all ranks' time between the first and the last span.
* ``spans_of(events)``: a rank's recorded spans as ``(start, end, op, mb)``, the format of a simulator's ``busy``.
* ``LiveBytes``: a context that tracks every tensor created inside it and reports the bytes still alive (peak too).
* ``checkpoint_sweep(...)``: activation checkpointing with ``torch.utils.checkpoint``, every ``k`` layers.
* ``interleaved``: Megatron-LM's interleaved 1F1B (``v`` model chunks per rank) for the sizes the notebook draws,
  simulated; data only, no schedule and no simulator (``interleaved.simulated(p, m, v)``).
* ``traffic``: the bytes a stage boundary carries per step, ``2 m b s h`` (``pp_boundary_bytes``, ``pp_stage_bytes``),
  counted on real workers (``gpipe_traffic``, ``traffic_report``) and set against data and tensor parallelism
  (``dp_bytes_per_rank``, ``tp_bytes_per_rank``, ``gpt_params``, ``volume_table``).
* plots (``labsupport.lessons.pipeline_parallel.plots``): ``plot_partition``, ``plot_schedules``, ``plot_bubble``,
  ``plot_memory``, ``plot_checkpointing``, ``plot_interleaved``.

Nothing here computes an exercise's answer: the schedules, the simulator and ``run_pipeline`` are yours, and the
harness takes the layer ranges as an argument.

Example::

    from labsupport.lessons import pipeline_parallel as lesson
    results = labsupport.run(lesson.pipeline_run, run_pipeline, schedule, partition_layers(7, 2), world_size=2)
    lesson.plot_schedules({"measured": [r["events"] for r in results]})
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn as nn

from .memory import LiveBytes, checkpoint_sweep, CheckpointedStage
from .spans import measured_bubble, spans_of
from .plots import plot_bubble, plot_checkpointing, plot_interleaved, plot_memory, plot_partition, plot_schedules
from .traffic import (activation_numel, dp_bytes_per_rank, gpipe_traffic, gpt_params, pp_boundary_bytes,
                      pp_stage_bytes, tp_bytes_per_rank, traffic_report, volume_table)
from . import interleaved

__all__ = [
    "make_model",
    "build_stage",
    "mse",
    "demo_batch",
    "one_process_step",
    "TimedStage",
    "pipeline_run",
    "measured_bubble",
    "spans_of",
    "LiveBytes",
    "CheckpointedStage",
    "checkpoint_sweep",
    "interleaved",
    "activation_numel",
    "pp_boundary_bytes",
    "pp_stage_bytes",
    "dp_bytes_per_rank",
    "tp_bytes_per_rank",
    "gpt_params",
    "volume_table",
    "gpipe_traffic",
    "traffic_report",
    "plot_partition",
    "plot_schedules",
    "plot_bubble",
    "plot_memory",
    "plot_checkpointing",
    "plot_interleaved",
]


def make_model(num_layers: int = 8, width: int = 64, seed: int = 0) -> nn.Sequential:
    """``num_layers`` blocks ``Sequential(Linear(width, width), Tanh())``: every layer keeps the shape."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(num_layers)])


def build_stage(model: nn.Sequential, layers) -> nn.Sequential:
    """The blocks ``model[i]`` for ``i`` in ``layers`` (a ``range``), as one module (they are shared, not copied)."""
    return nn.Sequential(*[model[i] for i in layers])


def mse(output, target):
    return ((output - target) ** 2).mean()


def demo_batch(m: int, rows: int = 32, width: int = 64, seed: int = 0):
    """``m`` micro-batches and ``m`` targets, each ``(rows, width)``, the same on every rank for the same seed."""
    gen = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(rows, width, generator=gen) for _ in range(m)]
    ys = [torch.randn(rows, width, generator=gen) for _ in range(m)]
    return xs, ys


def one_process_step(m: int, num_layers: int = 8, width: int = 64, rows: int = 32, seed: int = 0):
    """The oracle: the whole demo model in this process on the same micro-batches, loss = mean over micro-batches of
    ``mse``; returns ``(loss, [grad of every parameter])``."""
    model = make_model(num_layers, width, seed)
    xs, ys = demo_batch(m, rows, width, seed)
    loss = sum(mse(model(x), y) for x, y in zip(xs, ys)) / m
    loss.backward()
    return loss.item(), [p.grad for p in model.parameters()]


class _Mark(torch.autograd.Function):
    """Identity whose backward calls ``hook()``: tells when a backward reaches this point of the graph."""

    @staticmethod
    def forward(ctx, x, hook):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return grad, None


class TimedStage(nn.Module):
    """A stage that records its work in ``timeline``: span ``"F mb"`` for each forward, ``"B mb"`` for each backward.

    ``forward_order``: the micro-batch of each forward call in turn (this stage's F entries of the schedule), used to
    name the spans. A backward span starts when the gradient reaches the stage's output and ends when it reaches the
    stage's input (the first stage's input is made to require a gradient, so that moment exists there too).

    ``t_fwd``, ``t_bwd`` (seconds, optional): pad each forward / backward with ``time.sleep`` to last at least that
    long. Sleeping uses no CPU, so four ranks on two cores can each "compute" for a known time without slowing the
    others down: the timeline then shows the schedule, not the machine's core count. ``compute`` keeps the real,
    unpadded seconds of every span.
    """

    def __init__(self, stage: nn.Module, timeline, forward_order, t_fwd: float = 0.0, t_bwd: float = 0.0):
        super().__init__()
        self.stage = stage
        self.timeline = timeline
        self.forward_order = list(forward_order)
        self.t_fwd, self.t_bwd = t_fwd, t_bwd
        self.compute = []
        self._calls = 0

    def forward(self, x):
        mb = self.forward_order[self._calls] if self._calls < len(self.forward_order) else self._calls
        self._calls += 1
        tl = self.timeline
        start = tl.now()
        if not x.requires_grad:  # the first stage: give the backward an end point
            x = x.detach().requires_grad_()
        span = {}

        def backward_starts():
            span["start"] = tl.now()

        def backward_ends():
            worked = tl.now() - span["start"]
            _pad(span["start"], self.t_bwd, tl)
            tl.add(f"B {mb}", span["start"], tl.now())
            self.compute.append(("B", mb, worked))

        y = self.stage(_Mark.apply(x, backward_ends))
        worked = tl.now() - start
        _pad(start, self.t_fwd, tl)
        tl.add(f"F {mb}", start, tl.now())
        self.compute.append(("F", mb, worked))
        return _Mark.apply(y, backward_starts)


def _pad(start: float, duration: float, tl) -> None:
    left = start + duration - tl.now()
    if left > 0:
        time.sleep(left)


def pipeline_run(run_pipeline, schedule, layers, num_layers: int = 8, width: int = 64, rows: int = 32,
                 t_fwd: float = 0.0, t_bwd: float = 0.0, seed: int = 0, measure_memory: bool = False,
                 stage_wrapper=None, count_comm: bool = False):
    """Inside a worker (rank = stage): one pipelined step of the demo model with ``run_pipeline``.

    ``layers``: one ``range`` of layer indices per stage (your ``partition_layers``). ``stage_wrapper``: optional
    function applied to this rank's stage before timing (e.g. ``CheckpointedStage``). Micro-batches: as many as the
    schedule has forwards on a stage, ``rows`` rows each, the same on every rank. Returns a dict: ``events`` (the
    Timeline spans, on the clock every process on this machine shares), ``loss`` (what ``run_pipeline`` returned),
    ``compute`` (real seconds of each span), ``peak_bytes`` / ``after_bytes`` (with ``measure_memory``: the most
    bytes of tensors created during the step alive at once, and those still alive at its end), ``grads``, ``comm``
    (with ``count_comm``: the ``CommSummary`` of every message ``run_pipeline`` made, for ``traffic_report``).
    """
    import torch.distributed as dist

    from labsupport import CommCounter, Timeline

    rank = dist.get_rank()
    model = make_model(num_layers, width, seed)
    stage = build_stage(model, layers[rank])
    inner = stage if stage_wrapper is None else stage_wrapper(stage)
    xs, ys = demo_batch(sum(1 for op, _ in schedule[rank] if op == "F"), rows, width, seed)
    for p in stage.parameters():  # gradients exist beforehand: LiveBytes then counts activations, not them
        p.grad = torch.zeros_like(p)
    tl = Timeline(origin=0.0)  # time.perf_counter() is one clock for every process on the machine
    timed = TimedStage(inner, tl, [mb for op, mb in schedule[rank] if op == "F"], t_fwd, t_bwd)
    dist.barrier()
    meter = LiveBytes() if measure_memory else None
    counter = CommCounter() if count_comm else None
    with (meter if meter is not None else contextlib.nullcontext(),
          counter if counter is not None else contextlib.nullcontext()):
        loss = run_pipeline(timed, schedule, xs, ys, mse)
    dist.barrier()
    return {"events": tl.events, "loss": loss, "compute": timed.compute,
            "peak_bytes": meter.peak if meter else None, "after_bytes": meter.live if meter else None,
            "grads": [p.grad.clone() for p in stage.parameters()],
            "comm": counter.summary if counter is not None else None}
