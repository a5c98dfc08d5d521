"""Notebook 09_production's helpers: what a training loop adds around the exercises.

* ``restart``: the restart demo (a training run that checkpoints with DCP, the script torchrun starts, its log and
  figure, the seconds a restart cost);
* ``memory``: the peak memory of a rank, the bytes of a state and of a checkpoint's files;
* ``data``: which rank reads which sample, data loader workers and their seeds, resuming an epoch on another world
  size, evaluation under ``DistributedSampler``'s padding;
* ``accumulation``: gradient accumulation with clipping and loss scaling;
* ``checkpoints``: ``dcp.async_save``, the checkpoint interval (Young 1974, Daly 2006) and the random state a
  checkpoint must hold.

Example::

    from labsupport.lessons import production as lesson
    script = lesson.write_restart_script(workdir)              # a small training script, for torchrun
    proc = lesson.torchrun(script, rundir, "--steps", "12", "--kill-at", "7", nproc=2, max_restarts=2)
    records = lesson.read_log(rundir)                          # (attempt, step, loss, time) of every step
    lesson.plot_restart(reference_losses, records, kill_at=7, every=3)

Nothing here computes an exercise's answer: the training run reads its samples through PyTorch's own
``DistributedSampler`` and checkpoints with ``torch.distributed.checkpoint``; the demos use torch's
``DistributedSampler``, ``DataLoader``, ``DistributedDataParallel``, ``clip_grad_norm_`` and ``GradScaler``, or take
the student's function as an argument.
"""

from . import accumulation, checkpoints, data, memory, restart
from .accumulation import ACCUMULATION_WAYS, accumulation_step
from .checkpoints import (async_save_demo, daly_interval, expected_time, plot_checkpoint_interval, rng_state,
                          set_rng_state, simulate_checkpointing, young_interval)
from .data import AugmentedSamples, evaluation_on_ranks, loader_draws, plot_sampling, resumed_reads
from .memory import PeakMemory, dir_bytes, tensor_bytes
from .restart import RestartNet, plot_restart, read_log, seconds_lost, torchrun, train_run, workdir, write_restart_script

__all__ = ["workdir", "RestartNet", "train_run", "write_restart_script", "torchrun", "read_log", "plot_restart",
           "PeakMemory", "tensor_bytes", "dir_bytes", "plot_sampling", "seconds_lost",
           "AugmentedSamples", "loader_draws", "resumed_reads", "evaluation_on_ranks",
           "ACCUMULATION_WAYS", "accumulation_step", "async_save_demo",
           "young_interval", "daly_interval", "simulate_checkpointing", "expected_time", "plot_checkpoint_interval",
           "rng_state", "set_rng_state"]
