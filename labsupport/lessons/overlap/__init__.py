"""Helpers of notebook 10_overlap: hiding communication behind computation.

* ``measure``: ``OverlapTimeline`` (transfers and matrix products of a rank as ``Timeline`` spans),
  ``matmul_overlap`` (an exercise or a blocking baseline on every rank, timed), the blocking baselines
  ``allgather_then_matmul`` and ``matmul_then_reduce_scatter`` (built-in collectives), ``ring_overlap_problem``
  (which ring step's transfer no product ran under, read from those spans: the visible tests use it);
* ``pipeline``: the demo model, ``zero_bubble_run`` (a schedule with W on workers, the backward split by
  ``torch.autograd.grad``), ``one_process_grads``, ``torch_zero_bubble`` (PyTorch's zero-bubble schedules);
* ``attention``: ``zigzag_positions``, ``ProductCounter``, ``attention_on_ranks``, ``contiguous_ring_counts``;
* ``traces``: ``torch.profiler`` on every rank merged into one Chrome/Perfetto trace, ``hidden_share_from_trace``,
  ``ddp_step_traced``, ``plot_trace``;
* ``plots``: ``plot_schedules_w``, ``plot_attention_blocks``, ``plot_ring_steps``.

Nothing here computes an exercise's answer: the references live in ``autograder.checks.overlap``.
"""

from . import attention, measure, pipeline, plots, traces
from .attention import ProductCounter, attention_on_ranks, contiguous_ring_counts, zigzag_positions
from .measure import (OverlapTimeline, allgather_then_matmul, matmul_overlap, matmul_then_reduce_scatter,
                      ring_overlap_problem)
from .pipeline import demo_batch, make_model, one_process_grads, torch_zero_bubble, zero_bubble_run
from .plots import plot_attention_blocks, plot_ring_steps, plot_schedules_w
from .traces import (ddp_step_traced, hidden_share_from_trace, merge_traces, plot_trace, profiler_events,
                     trace_spans)

__all__ = [
    "OverlapTimeline", "matmul_overlap", "allgather_then_matmul", "matmul_then_reduce_scatter", "ring_overlap_problem",
    "make_model", "demo_batch", "one_process_grads", "zero_bubble_run", "torch_zero_bubble",
    "zigzag_positions", "ProductCounter", "attention_on_ranks", "contiguous_ring_counts",
    "profiler_events", "merge_traces", "trace_spans", "hidden_share_from_trace", "ddp_step_traced", "plot_trace",
    "plot_schedules_w", "plot_attention_blocks", "plot_ring_steps",
]
