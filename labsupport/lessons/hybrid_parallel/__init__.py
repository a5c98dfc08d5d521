"""Notebook 08 (hybrid parallelism): the demo transformer, the published configurations, and the drawings.

* ``TinyGPT``, ``make_data``: a two-block causal transformer small enough to train on 8 CPU ranks, and a
  learnable token stream for it (``model.py``).
* ``Model``, ``Cluster``, ``GPT3_175B``, ``NARAYANAN_TABLE1``, ``DGX_A100``: what a planner is given, and the
  configurations the papers trained (``configs.py``).
* ``full_attention``, ``online_softmax_update``, ``ring_attention``, ``ring_attention_on_ranks``,
  ``attention_comm_bytes``: context parallelism, ring attention on real ranks and what it sends compared with
  Ulysses and an all-gather of k/v (``context_parallel.py``).
* ``plot_parallel_groups``, ``plot_loss_curves``, ``plot_all_to_all``, ``plot_memory_plan``,
  ``plot_ring_attention``: the figures (``plots.py``). ``plot_parallel_groups`` draws the groups it is given; it
  does not compute them.

Example::

    from labsupport.lessons import hybrid_parallel as lesson
    lesson.plot_parallel_groups(groups, world_size=8)
"""

from .configs import DGX_A100, GPT3_175B, NARAYANAN_TABLE1, Cluster, Model
from .model import TinyGPT, make_data
from .plots import plot_all_to_all, plot_loss_curves, plot_memory_plan, plot_parallel_groups, plot_ring_attention
from .context_parallel import (attention_comm_bytes, full_attention, online_softmax_update, ring_attention,
                             ring_attention_on_ranks)

__all__ = [
    "TinyGPT",
    "make_data",
    "Model",
    "Cluster",
    "GPT3_175B",
    "NARAYANAN_TABLE1",
    "DGX_A100",
    "plot_parallel_groups",
    "plot_loss_curves",
    "plot_all_to_all",
    "plot_memory_plan",
    "plot_ring_attention",
    "full_attention",
    "online_softmax_update",
    "ring_attention",
    "ring_attention_on_ranks",
    "attention_comm_bytes",
]
