"""Checks for notebook 03_data_parallel: ``check_broadcast_parameters``, ``check_average_gradients``,
``check_OverlapDDP``, ``check_BucketedDDP``.

Every check builds the same awkward little model on each rank (``ProbeNet``): a frozen layer, a parameter created
with ``requires_grad=False``, a layer applied twice, two layers that share one weight (tied), a parameter the
forward never uses, a float buffer and an integer buffer. Each rank starts from a different seed, so a wrapper that
forgets the initial broadcast is seen at once.

The oracle is the same model trained in one process on the whole batch: N ranks, each on 1/N of the batch, must end
with the same gradients and the same weights (fp32, tight tolerance).

How the result was obtained is checked with ``CommCounter`` and with gradient hooks the checker registers on the
parameters after the student's wrapper is built (they fire right after the student's own post-accumulate hooks, or
right before ``AccumulateGrad`` node hooks): for each gradient that becomes ready, the checker notes how many
all-reduces had been issued so far. That is enough to tell "launched from the hook, during backward" from
"launched after backward" or "launched late", whichever hook style the student used.

"One all-reduce per bucket" means one call whose tensor(s) cover the whole bucket: a flat buffer (``torch.cat``, or
a preallocated buffer the gradients are views of), or the deprecated ``all_reduce_coalesced`` on the bucket's list
of gradients. All-reducing the views of a bucket one by one is one call per parameter, and is counted as such.

Probes keep all ranks in step: after each phase every rank reports whether it found a problem (one small
all-reduce, outside the counted region) and all stop together, so a wrong answer never turns into a deadlock.

``model`` holds ``ProbeNet`` and its data, ``reference`` the oracle's bucket layout, ``probes`` what runs on the
workers, ``diagnose`` recognises a wrong answer and words its message.
"""

from __future__ import annotations

import math

from .._common import draw_seed, run_on_workers
from .model import ProbeNet
from .probes import _guarded, _probe_average, _probe_broadcast, _probe_ddp
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
    for world_size, src in ((2, None), (4, 3)):
        _run(_probe_broadcast, broadcast_parameters, seed, src, world_size=world_size,
             what="broadcast_parameters", seed=seed)


def _run(probe, *args, world_size: int, what: str, seed: int):
    results = run_on_workers(_guarded, probe, *args, world_size=world_size, what=what)
    for rank, failure in enumerate(results):
        if failure:
            raise AssertionError(f"{failure} (world_size={world_size}, seed {seed})")


def check_average_gradients(average_gradients) -> None:
    """Gradients equal the full-batch gradient of one process (the average over ranks); parameters without a
    gradient are skipped."""
    seed = draw_seed()
    for world_size in (2, 4):
        _run(_probe_average, average_gradients, seed, 3, world_size=world_size, what="average_gradients", seed=seed)


_CONFIGS_OVERLAP = ((2, 3), (4, 2))  # (world_size, steps)


# (world_size, cap in bytes, steps, accumulation cycles): a cap between the sizes (forward order differs), one
# smaller than the largest parameters (they get a bucket of their own), one smaller than every parameter, and
# bucket_size_mb=None (no cap: one bucket, as for torch DDP).
_CONFIGS_BUCKETED = ((2, 1000, 2, 2), (4, 700, 2, 1), (2, 16, 1, 1), (4, None, 1, 1))


def check_OverlapDDP(OverlapDDP) -> None:
    """Broadcast at construction; one async all-reduce per trainable parameter, issued from its gradient hook during
    backward; gradients and weights equal one-process training on the whole batch."""
    seed = draw_seed()
    for world_size, steps in _CONFIGS_OVERLAP:
        _run(_probe_ddp, OverlapDDP, "OverlapDDP", seed, 2, None, steps, 0, 0, world_size=world_size,
             what="OverlapDDP", seed=seed)


def check_BucketedDDP(BucketedDDP) -> None:
    """Broadcast at construction; buckets in reverse registration order up to the cap, one all-reduce per bucket
    launched during backward as soon as the bucket is complete; no_sync accumulates without communicating; gradients
    and weights equal one-process training on the whole batch."""
    seed = draw_seed()
    for world_size, cap, steps, cycles in _CONFIGS_BUCKETED:
        cap_mb = math.inf if cap is None else cap / 2**20  # None: bucket_size_mb=None, one bucket
        _run(_probe_ddp, BucketedDDP, "BucketedDDP", seed, 2, cap_mb, steps, 2, cycles, world_size=world_size,
             what="BucketedDDP", seed=seed)
