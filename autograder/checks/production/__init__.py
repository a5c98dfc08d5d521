"""Checks for notebook 09_production: ``check_shard_indices``, ``check_clip_grad_norm_``, ``check_DynamicLossScaler``,
``check_save_sharded``.

Every oracle is PyTorch's own: ``DistributedSampler`` (after ``set_epoch``), ``torch.nn.utils.clip_grad_norm_`` on
the dense model in one process, ``torch.amp.GradScaler("cpu")`` on the dense model, and for checkpoints the values
the saving ranks held. Inputs and world sizes (odd ones too) are drawn at grading time; the seed is in every message.

The student's functions and class run in grading's sandbox (``labsupport._sandbox``), called by a driver of the
grader's (``drivers``); the built-in each exercise rebuilds raises there with a message that names it
(``DistributedSampler``; ``clip_grad_norm_``, ``clip_grad_norm`` and ``get_total_norm``; ``GradScaler``, made or
subclassed; ``torch.distributed.checkpoint``'s save and load). What decides the points is measured in the host, the
rank's worker, where the student's code never runs:

* ``shard_indices``: its lists against ``DistributedSampler``'s, and for a rank out of range the ``ValueError``
  ``DistributedSampler`` raises, message included (every case in one call, on one rank).
* ``clip_grad_norm_``: the 2-norm, the inf norm (positional, as torch's third argument) and a drawn p, a generator
  and a single Tensor; every gradient a view of one flat buffer, as DDP's buckets and FSDP's flat shards hold them,
  whose values after the call must be the clipped ones (only a clip in place clips the buffer). The host's record of
  what it carried for the call: exactly one all-reduce, of one number (at most 8 bytes), over the given group; a
  rank that does not communicate cannot know the global norm, and one that all-reduces per parameter moves more.
* ``DynamicLossScaler``: 14 steps in one call, an optimizer of three parameter groups, the overflows in the second
  or third; what ``step(optimizer, ...)`` returns (the optimizer's result, with and without a closure for it, or
  None when it skips, as ``GradScaler.step``); the buffer the gradients are views of, unscaled in place; weights
  and scales against the oracle's. The driver marks the phases of each step on the rank's own group (and, from a
  step pre-hook, the moment the optimizer is stepped); the host's record split at the marks: one all-reduce of a
  flag (at most 8 bytes) in ``step()``, before the optimizer is stepped, over the scaler's group; nothing in
  ``update()``. One rank's gradients get an inf or a NaN at drawn steps: every rank must skip together.
* ``save_sharded`` / ``load_resharded``: two dtypes (float32 or float64, then another, 16-bit ones too); the
  sandboxes may read and write the folder the checkpoint lies in (and their own), nothing else, so ranks pass no
  data through other files. At the barriers around a load the host reads the sandbox's counters in ``/proc``: the
  bytes it read (``rchar``) must be about the bytes of its shard, not the parameter's, and its peak resident memory
  (``VmHWM``, reset first; a memory-mapped file counts once its pages are touched) must stay well under the full
  parameter. A save during which one rank's sandbox is killed (SIGKILL, after the others had a second to write)
  must leave the previous checkpoint loadable, with the previous values; a save stopped at each of its file-system
  steps (``crashes``: the host copies the folder at each) must leave the previous checkpoint or the new one,
  complete. What a driver says beside the student's code only words an honest mistake: the files several ranks
  wrote (metadata written by every rank), a shard that is a view of a bigger buffer.

One module per exercise: ``sampling`` (``shard_indices``), ``clipping`` (``clip_grad_norm_``), ``scaling``
(``DynamicLossScaler``), ``checkpoint`` (``save_sharded`` / ``load_resharded``) with ``crashes`` (a crash at every
step of a save) and ``reference`` (the values a checkpoint check saves); ``drivers`` is what runs in the sandbox.
"""

from __future__ import annotations

from .checkpoint import PROBE_TIMEOUT_PRODUCTION, check_save_sharded
from .clipping import check_clip_grad_norm_
from .sampling import check_shard_indices, reference_shard_indices
from .scaling import check_DynamicLossScaler

__all__ = ["check_shard_indices", "check_clip_grad_norm_", "check_DynamicLossScaler", "check_save_sharded",
           "reference_shard_indices", "PROBE_TIMEOUT_PRODUCTION"]
