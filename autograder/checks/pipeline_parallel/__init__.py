"""Checks for notebook 05_pipeline_parallel: ``check_partition_layers``, ``check_gpipe_schedule``,
``check_one_f_one_b_schedule``, ``check_simulate_schedule``, ``check_max_in_flight``, ``check_run_pipeline``.

The references live here, not in ``labsupport`` (students receive that package): the layer partition, the two
schedules, an event simulator and the in-flight count. The reference simulator is written as a fixed-point sweep
over the stages (each pass starts every operation whose predecessors are done), so a student's simulator, however it
is written (a recursion over finish times, a priority queue of events, a sweep like this one), is compared with a
second, independent computation, and also with the closed forms (m + p - 1)(t_f + t_b) and (p - 1)/(m + p - 1).

Every check of a function of (p, m) or of a schedule takes a fixed list of sizes (``m < p``, ``m = p``, ``m > p``,
one stage, one micro-batch) and sizes drawn at grading time from a seed that its messages print (p up to 24, m up
to 96, ``partition_layers`` up to 5000 layers), so an answer cannot be a table of the cases. Simulators are also fed
schedules no notebook cell uses: naive model parallelism (F0 B0 F1 B1 ...), 1F1B with extra warm-up, and random
valid orders (recorded from a list scheduler with random durations, so that every order can run), with odd, unequal
forward and backward times drawn at grading time.

``run_pipeline`` runs on 2, 3 and 4 ranks with an odd number of layers of different kinds (the stages are unequal),
for GPipe and 1F1B, ``m < p``, ``m = p`` and ``m > p``, one micro-batch too. The student's function runs in each
rank's grading sandbox (``drivers.drive_pipeline`` builds the stage there from the parameters of this stage's layers
only, which the host drew); the host compares the loss and every gradient with the same model trained in one
process with the loss averaged over micro-batches, and reads from its own record (``CommCounter``, the sandbox's
requests) that only point-to-point messages to the neighbouring stages were used, that each micro-batch's activation
crossed to the next stage and its gradient to the previous one (their bytes, plus at most a little metadata), and
that every request was waited for. The stage also records the order of its forward and backward passes (compared
with ``schedule[rank]``: a message for a schedule run out of order). Every case ends with one small all-reduce
outside the counted region through which all ranks learn whether one found a problem, so a wrong answer never
becomes a deadlock; a real deadlock is stopped by the probe's time limit.

The package: ``reference`` (the references above), ``schedules`` (the checks that run in one process),
``workers`` (``check_run_pipeline`` and its probe), ``drivers`` (what runs in the sandbox).
"""

from __future__ import annotations

from .reference import (random_valid_schedule, reference_1f1b, reference_gpipe, reference_in_flight,
                        reference_partition, reference_simulate)
from .schedules import (check_gpipe_schedule, check_max_in_flight, check_one_f_one_b_schedule, check_partition_layers,
                        check_simulate_schedule)
from .workers import check_run_pipeline

__all__ = [
    "check_partition_layers",
    "check_gpipe_schedule",
    "check_one_f_one_b_schedule",
    "check_simulate_schedule",
    "check_max_in_flight",
    "check_run_pipeline",
    "reference_partition",
    "reference_gpipe",
    "reference_1f1b",
    "reference_simulate",
    "reference_in_flight",
    "random_valid_schedule",
]
