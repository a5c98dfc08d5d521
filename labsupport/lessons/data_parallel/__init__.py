"""Notebook 03 (data parallelism): the one-process DataParallel step, the measurement harness and the plots.

* ``dp``: ``torch.nn.DataParallel``'s step on CPU replicas with threads (``dp_step``, ``TinyLM``, ``MemoryReport``)
  and ``ddp_rank_report``, the same memory categories on one DDP rank.
* ``harness``: the timing code of the notebook's measurements: threads vs processes under the GIL
  (``gil_comparison``), training steps recorded as timelines (``record_steps``), their summary
  (``summarise_steps``) and the time of one step (``time_per_step``). The functions that decide how a model is
  wrapped (your ``OverlapDDP``, ``BucketedDDP`` ...) are passed in by the notebook. ``record_ready`` and
  ``launched_late``: when each all-reduce was launched, against when its gradients were ready (the visible tests).
* ``plots``: ``plot_dp_vs_ddp``, ``plot_dp_memory``, ``plot_bucket_layout``, ``plot_step_sweep``,
  ``plot_loss_curves``, ``plot_async_training``.

Example::

    from labsupport.lessons import data_parallel as lesson
    report = lesson.dp_step(lesson.TinyLM(), optimizer, tokens, targets, num_replicas=4)
    lesson.plot_dp_memory(report)
"""

from .dp import (CATEGORIES, MemoryReport, TinyLM, ddp_rank_report, dp_step, gather, parallel_apply,
                 reduce_gradients, replicate, scatter)
from .harness import (gil_comparison, launched_late, make_mlp, record_ready, record_steps, summarise_steps,
                      time_per_step)
from .plots import (plot_async_training, plot_bucket_layout, plot_dp_memory, plot_dp_vs_ddp, plot_loss_curves,
                    plot_step_sweep)

__all__ = [
    "CATEGORIES", "MemoryReport", "TinyLM", "ddp_rank_report", "dp_step", "gather", "parallel_apply",
    "reduce_gradients", "replicate", "scatter",
    "gil_comparison", "make_mlp", "record_steps", "summarise_steps", "time_per_step", "record_ready", "launched_late",
    "plot_async_training", "plot_bucket_layout", "plot_dp_memory", "plot_dp_vs_ddp", "plot_loss_curves",
    "plot_step_sweep",
]
