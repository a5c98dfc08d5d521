"""Checks for notebook 03_data_parallel: ``check_broadcast_parameters``, ``check_average_gradients``,
``check_OverlapDDP``, ``check_BucketedDDP``.

Every check builds the same awkward little model on each rank (``ProbeNet``): a frozen layer, a parameter created
with ``requires_grad=False``, a layer applied twice, two layers that share one weight (tied), a parameter the
forward never uses, a float buffer and an integer buffer. Each rank starts from different weights, so a wrapper that
forgets the initial broadcast is seen at once.

The oracle is the same model trained in one process on the whole batch: N ranks, each on 1/N of the batch, must end
with the same gradients and the same weights (fp32, tight tolerance).

How: the student's function or class runs in the grading sandbox of each rank, exercised there by a driver
(``drivers``: it builds ProbeNet from the weights the host gives that rank, wraps it, and runs forward, backward,
``finish_gradient_synchronization()``, the optimizer step, and for BucketedDDP backward passes under ``no_sync()``),
which sees only its own rank's weights and data shards. What decides the points is the host's: the gradients and
weights that come back against its own oracle, and its own record of the requests it carried for the sandbox, split
at the driver's marks. In that record: rank 0's parameters and buffers broadcast at construction; per synchronised
step one all-reduce per trainable parameter (OverlapDDP) or per bucket, with its bytes (BucketedDDP), none under
``no_sync()`` and none once ``finish_gradient_synchronization()`` has returned (a gradient that communicates when it
is read); and "launched during backward" from the order of the requests: the driver makes a mark inside backward each
time the gradient of a layer's output is about to be computed, the host knows from its own model which gradients
are ready by each mark (``reference.backward_events``: the graph's order, the same in the sandbox), and every bucket
complete by then must have been posted before it, in the order the buckets became complete.

"One all-reduce per bucket" means one call whose tensor(s) cover the whole bucket: a flat buffer (``torch.cat``, or
a preallocated buffer the gradients are views of), or the deprecated ``all_reduce_coalesced`` on the bucket's list
of gradients. All-reducing the views of a bucket one by one is one call per parameter, and is counted as such.

The driver's marks (one-element all-gathers) also tell every rank whether one of them raised, so all stop at the same
point; after the scenario the hosts agree on a verdict (one small all-reduce of theirs, outside the record).

``drivers`` holds ProbeNet and what runs in the sandbox, ``reference`` the oracle's bucket layout and backward's
order, ``probes`` what runs on the hosts, ``diagnose`` recognises a wrong answer and words its message.
"""

from __future__ import annotations

import math

from .._common import draw_seed, in_sandbox, run_on_workers
from . import drivers
from .drivers import ProbeNet
from .probes import STOPPED, _guarded, _probe_average, _probe_broadcast, _probe_ddp
from .reference import expected_buckets

__all__ = [
    "check_broadcast_parameters",
    "check_average_gradients",
    "check_OverlapDDP",
    "check_BucketedDDP",
    "ProbeNet",
    "expected_buckets",
]


def check_broadcast_parameters(broadcast_parameters) -> None:
    """Every rank ends with rank ``src``'s parameters and buffers (frozen ones, integer buffers included)."""
    seed = draw_seed()
    fn = in_sandbox(broadcast_parameters, "broadcast_parameters", driver=drivers.broadcast)
    for world_size, src in ((2, None), (4, 3)):
        _run(_probe_broadcast, fn, seed, src, world_size=world_size, what="broadcast_parameters", seed=seed)


def _run(probe, *args, world_size: int, what: str, seed: int):
    """The probe on every rank; the first rank's failure is raised, a rank that only stopped because another failed
    giving way to that one."""
    results = run_on_workers(_guarded, probe, *args, world_size=world_size, what=what)
    failures = [f for f in results if f]
    for failure in sorted(failures, key=lambda f: f == STOPPED):
        raise AssertionError(f"{failure} (world_size={world_size}, seed {seed})")


def check_average_gradients(average_gradients) -> None:
    """Gradients equal the full-batch gradient of one process (the average over ranks); parameters without a
    gradient are skipped."""
    seed = draw_seed()
    fn = in_sandbox(average_gradients, "average_gradients", driver=drivers.average)
    for world_size in (2, 4):
        _run(_probe_average, fn, seed, 3, world_size=world_size, what="average_gradients", seed=seed)


_CONFIGS_OVERLAP = ((2, 3), (4, 2))  # (world_size, steps)


# (world_size, cap in bytes, steps, accumulation cycles): a cap between the sizes (forward order differs), one
# smaller than the largest parameters (they get a bucket of their own), one smaller than every parameter, and
# bucket_size_mb=None (no cap: one bucket, as for torch DDP).
_CONFIGS_BUCKETED = ((2, 1000, 2, 2), (4, 700, 2, 1), (2, 16, 1, 1), (4, None, 1, 1))


def check_OverlapDDP(OverlapDDP) -> None:
    """Broadcast at construction; one async all-reduce per trainable parameter, issued from its gradient hook during
    backward; gradients and weights equal one-process training on the whole batch."""
    seed = draw_seed()
    fn = in_sandbox(OverlapDDP, "OverlapDDP", driver=drivers.ddp)
    for world_size, steps in _CONFIGS_OVERLAP:
        _run(_probe_ddp, fn, "OverlapDDP", seed, 2, None, steps, 0, 0, world_size=world_size,
             what="OverlapDDP", seed=seed)


def check_BucketedDDP(BucketedDDP) -> None:
    """Broadcast at construction; buckets in reverse registration order up to the cap, one all-reduce per bucket
    launched during backward as soon as the bucket is complete; no_sync accumulates without communicating; gradients
    and weights equal one-process training on the whole batch."""
    seed = draw_seed()
    fn = in_sandbox(BucketedDDP, "BucketedDDP", driver=drivers.ddp)
    for world_size, cap, steps, cycles in _CONFIGS_BUCKETED:
        cap_mb = math.inf if cap is None else cap / 2**20  # None: bucket_size_mb=None, one bucket
        _run(_probe_ddp, fn, "BucketedDDP", seed, 2, cap_mb, steps, 2, cycles, world_size=world_size,
             what="BucketedDDP", seed=seed)
