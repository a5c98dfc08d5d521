"""Checks for notebook 10_overlap: ``check_allgather_matmul``, ``check_matmul_reduce_scatter``,
``check_simulate_schedule``, ``check_zero_bubble_schedule``, ``check_zigzag_ring_attention``.

How they judge *how* an answer was computed: the student's function runs in each rank's grading sandbox
(``drivers.on_ring``), and what decides is measured in the host, where it never runs.

* ``allgather_matmul``, ``matmul_reduce_scatter`` and ``zigzag_ring_attention`` run on an odd ring (3 ranks), an
  even one, and a ring of a group of global ranks 1, 2, 3 of 4 workers (group rank r is global rank r + 1, so a
  ring that takes one for the other fails), with drawn shapes and dtypes, large enough that one product takes
  milliseconds of CPU. For the first two, ``CommCounter`` must show point-to-point messages only (the sandbox
  refuses ``all_gather`` or ``reduce_scatter``), with the ring neighbours, exactly N − 1 messages of one chunk each.
  The transfer of each ring step must be posted with isend/irecv, and between its post and its wait the sandbox
  must have spent CPU time of at least ``probes.SHARE`` of one chunk's product as the host times it itself
  (``probes.Transfers``, from the host's record: a real product running under the transfer shows there; products
  on ``meta`` tensors, or a result computed again after the waits, do not). The products the function lists
  (``drivers.Products``, the student's side's own report) word the message of an honest mistake: N products of one
  chunk each, not one product of the gathered input.
* ``zigzag_ring_attention``: the output against dense causal attention (float64 oracle), k and v passed on N − 1
  times to ring neighbours only, every transfer with at least ``SHARE`` of two blocks' CPU time under it (a block:
  one chunk of queries against one chunk of keys), and the block products each rank listed (its matrix-product
  flops in units of one block): the same on every rank and no more than 2N + 2.
* ``zero_bubble_schedule``: every F, B, W once per stage in micro-batch order, F < B < W per micro-batch, a schedule
  that can run, a makespan no longer than ZB-H1's with t_F = t_B = t_W (below 1F1B's), and at most 1F1B's peak of
  micro-batches in flight (F to W) on any stage.
* ``simulate_schedule``: spans, makespan and bubble against a reference sweep, on ZB-H1, 1F1B and GPipe without W,
  random valid orders with W, and a ZB-H1 whose middle stage ends last (a makespan read off one stage, or off the
  operation simulated last, is not the last end).
"""

from __future__ import annotations

from .reference import (dense_causal, random_valid_schedule_w, reference_in_flight_w, reference_simulate_w,
                        reference_zero_bubble, zigzag_positions)
from .schedules import check_simulate_schedule, check_zero_bubble_schedule
from .workers import block_products, check_allgather_matmul, check_matmul_reduce_scatter, check_zigzag_ring_attention

__all__ = [
    "check_allgather_matmul",
    "check_matmul_reduce_scatter",
    "check_simulate_schedule",
    "check_zero_bubble_schedule",
    "check_zigzag_ring_attention",
    "reference_zero_bubble",
    "reference_simulate_w",
    "reference_in_flight_w",
    "random_valid_schedule_w",
    "zigzag_positions",
    "dense_causal",
    "block_products",
]
