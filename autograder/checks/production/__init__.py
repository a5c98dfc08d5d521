"""Checks for notebook 09_production: ``check_shard_indices``, ``check_clip_grad_norm_``, ``check_DynamicLossScaler``,
``check_save_sharded``.

Every oracle is PyTorch's own: ``DistributedSampler`` (after ``set_epoch``), ``torch.nn.utils.clip_grad_norm_`` on
the dense model in one process, ``torch.amp.GradScaler("cpu")`` on the dense model, and for checkpoints the values
the saving ranks held. Inputs and world sizes (odd ones too) are drawn at grading time; the seed is in every message.

How the answer was obtained is measured where the student's objects cannot reach:

* ``shard_indices``: its lists against ``DistributedSampler``'s, and for a rank out of range the ``ValueError``
  ``DistributedSampler`` raises, message included.
* ``clip_grad_norm_``: the 2-norm, the inf norm (positional, as torch's third argument) and a drawn p, a generator
  and a single Tensor; every gradient a view of one flat buffer, as DDP's buckets and FSDP's flat shards hold them,
  so that only a clip in place clips the buffer. ``CommCounter`` around the call: exactly one all-reduce, of one
  number (at most 8 bytes); a rank that does not communicate cannot know the global norm, and one that all-reduces
  per parameter moves more.
* ``DynamicLossScaler``: an optimizer of three parameter groups, the overflows in the second or third; what
  ``step(optimizer, ...)`` returns (the optimizer's result, with and without a closure for it, or None when it
  skips, as ``GradScaler.step``); each gradient unscaled in place (the same tensor, a view of one buffer).
  ``CommCounter`` around ``step()``: one all-reduce of a flag (at most 8 bytes), and a step pre-hook on the probe's
  optimizer notes, at the moment it is stepped, whether that all-reduce has been made; ``update()`` communicates
  nothing. One rank's gradients get an inf or a NaN at drawn steps: every rank must skip together.
* ``save_sharded`` / ``load_resharded``: two dtypes (float32 or float64, then another, 16-bit ones too), and the
  kernel's own counters of the worker process. The bytes a loading rank read (``rchar`` of ``/proc/self/io``:
  everything passed through ``read``/``pread``, whichever Python or C code made the call) must be about the bytes of
  its shard, not the parameter's; the peak resident memory during the load (``VmHWM`` of ``/proc/self/status``,
  reset through ``/proc/self/clear_refs`` before the call; a memory-mapped file counts once its pages are touched)
  must stay well under the full parameter. The paths each saving rank opens for writing or renames onto (Python's
  audit events ``open`` and ``os.rename``) show whether several ranks wrote the same file (the metadata must be
  written once). A save during which one rank is killed (SIGKILL, after the others had a second to write) must
  leave the previous checkpoint loadable, with the previous values; a save stopped at each of its file-system steps
  (``crashes``) must leave the previous checkpoint or the new one, complete.

One module per exercise: ``sampling`` (``shard_indices``), ``clipping`` (``clip_grad_norm_``), ``scaling``
(``DynamicLossScaler``), ``checkpoint`` (``save_sharded`` / ``load_resharded``) with ``crashes`` (a crash at every
step of a save) and ``reference`` (the values a checkpoint check saves); ``probes`` is what a worker's file system
calls show (the files a save writes, each step it makes on disk, the bytes a load reads).
"""

from __future__ import annotations

from .checkpoint import PROBE_TIMEOUT_PRODUCTION, check_save_sharded
from .clipping import check_clip_grad_norm_
from .sampling import check_shard_indices, reference_shard_indices
from .scaling import check_DynamicLossScaler

__all__ = ["check_shard_indices", "check_clip_grad_norm_", "check_DynamicLossScaler", "check_save_sharded",
           "reference_shard_indices", "PROBE_TIMEOUT_PRODUCTION"]
