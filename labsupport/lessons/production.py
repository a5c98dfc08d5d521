"""Notebook 09_production's helpers: the restart demo (a training run that checkpoints with DCP, the script torchrun
starts, its log), the peak memory of a rank, the figures, and the demos of what a training loop adds around the
exercises: data loader workers and their seeds, resuming an epoch on another world size, evaluation under
``DistributedSampler``'s padding, gradient accumulation with clipping and loss scaling, ``dcp.async_save``, the
checkpoint interval (Young 1974, Daly 2006) and the random state a checkpoint must hold.

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

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn

__all__ = ["workdir", "RestartNet", "train_run", "write_restart_script", "torchrun", "read_log", "plot_restart",
           "PeakMemory", "tensor_bytes", "dir_bytes", "plot_sampling", "seconds_lost",
           "AugmentedSamples", "loader_draws", "resumed_reads", "evaluation_on_ranks",
           "ACCUMULATION_WAYS", "accumulation_step", "async_save_demo",
           "young_interval", "daly_interval", "simulate_checkpointing", "expected_time", "plot_checkpoint_interval",
           "rng_state", "set_rng_state"]

# ---------------------------------------------------------------------------------------------------------------
# the training run that is killed and resumed


class RestartNet(nn.Module):
    """A small classifier with dropout: resuming must restore the random state too, or the curve changes."""

    def __init__(self, d_in=16, hidden=32, classes=4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, classes))

    def forward(self, x):  # (B, d_in) -> (B, classes)
        return self.body(x)


def _dataset(n=256, d_in=16, classes=4):
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d_in, generator=gen)
    y = (x[:, :classes].argmax(dim=1) + (x[:, -1] > 1.5).long()) % classes
    return torch.utils.data.TensorDataset(x, y)


def train_run(workdir: str, steps: int = 12, every: int = 3, batch: int = 8, kill_at: int | None = None,
              kill_rank: int = 1):
    """Train ``RestartNet`` data-parallel for ``steps`` steps on the ranks of the current process group, with a DCP
    checkpoint of model, optimizer, data position and every rank's random state every ``every`` steps
    (``workdir/latest`` names the current one); resume from it when there is one. On the first attempt
    (``TORCHELASTIC_RESTART_COUNT`` 0 or unset) rank ``kill_rank`` kills itself with SIGKILL just before step
    ``kill_at``. Rank 0 appends one JSON line per step to ``workdir/log.jsonl``. Returns the losses of the steps this attempt ran, {step: loss}."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.utils.data import DistributedSampler

    torch.set_num_threads(1)  # the same arithmetic in every process, so curves can agree to the last bit
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    latest = os.path.join(workdir, "latest")  # names the current checkpoint's folder
    os.makedirs(workdir, exist_ok=True)
    torch.manual_seed(0)
    model = RestartNet()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = _dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    per_epoch = len(sampler) // batch
    torch.manual_seed(100 + rank)  # each rank its own dropout masks
    start = 0
    if os.path.exists(latest):
        with open(latest) as f:
            ckpt = os.path.join(workdir, f.read().strip())
        model_sd, optim_sd = get_state_dict(model, opt)  # the optimizer's state made, so DCP has places to load into
        state = {"model": model_sd, "optim": optim_sd, "step": 0, f"rng_{rank}": torch.get_rng_state()}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        torch.set_rng_state(state[f"rng_{rank}"])
        start = int(state["step"])
    losses = {}
    step = start
    while step < steps:
        epoch, position = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        order = list(sampler)  # this rank's samples in this epoch; the batches before `position` were consumed
        # (a DataLoader would do the same, but creating its iterator draws from the random state: one draw more
        # in a resumed run than in the uninterrupted one)
        for i in range(position, per_epoch):
            if step >= steps:
                break
            x, y = data[order[i * batch:(i + 1) * batch]]
            if attempt == 0 and kill_at is not None and step == kill_at and rank == kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses[step] = mean.item() / world
            if rank == 0:
                with open(os.path.join(workdir, "log.jsonl"), "a") as f:
                    f.write(json.dumps({"attempt": attempt, "step": step, "loss": losses[step],
                                        "time": time.time()}) + "\n")
            step += 1
            if step % every == 0 and step < steps:
                # every rank's random state under a key of its own: DCP keeps one copy of what ranks share
                model_sd, optim_sd = get_state_dict(model, opt)
                state = {"model": model_sd, "optim": optim_sd, "step": step, f"rng_{rank}": torch.get_rng_state()}
                dcp.save(state, checkpoint_id=os.path.join(workdir, f"ckpt-{step}"))
                dist.barrier()
                if rank == 0:  # the finished checkpoint becomes the current one: one atomic rename of a pointer
                    with open(latest + ".tmp", "w") as f:
                        f.write(f"ckpt-{step}")
                    os.replace(latest + ".tmp", latest)
                    shutil.rmtree(os.path.join(workdir, f"ckpt-{step - every}"), ignore_errors=True)
                dist.barrier()
    return losses


_SCRIPT = '''"""Written by labsupport.lessons.production: trains RestartNet with a DCP checkpoint every few steps.
Run it with torchrun: torchrun --nproc-per-node 2 --max-restarts 2 {name} WORKDIR --steps 12 --every 3 --kill-at 7"""
import argparse
import datetime
import os

import torch.distributed as dist

from labsupport.lessons.production import train_run

parser = argparse.ArgumentParser()
parser.add_argument("workdir")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--every", type=int, default=3)
parser.add_argument("--kill-at", type=int, default=None)
args = parser.parse_args()
# torchrun set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Its store outlives a restart, so the new processes
# meet under a prefix of their attempt: gloo's plain env:// set-up could read the dead processes' addresses there.
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                      is_master=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0,
                      timeout=datetime.timedelta(seconds=120))
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}/", store), rank=rank, world_size=world)
train_run(args.workdir, steps=args.steps, every=args.every, kill_at=args.kill_at)
dist.destroy_process_group()
'''


def write_restart_script(directory: str) -> str:
    """Write the training script torchrun runs into ``directory``; return its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "train_restart.py")
    with open(path, "w") as f:
        f.write(_SCRIPT.replace("{name}", os.path.basename(path)))
    return path


def workdir(prefix: str = "course09-") -> str:
    """A new temporary folder for this notebook's checkpoints and logs, removed when the kernel exits."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path


def torchrun(script: str, *args: str, nproc: int = 2, max_restarts: int = 2, timeout: float = 180.0):
    """Run ``torchrun --standalone --nproc-per-node NPROC --max-restarts R script args`` and wait for it; return
    the ``subprocess.CompletedProcess`` (its output in ``stdout``). The agent's own temporary files (its log
    folders) go to a folder removed afterwards."""
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.2", script, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:
        env["TMPDIR"] = tmp
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                              env=env)


def read_log(workdir: str) -> list[dict]:
    """The lines rank 0 logged: one dict per step run, {attempt, step, loss, time}, in the order they ran."""
    path = os.path.join(workdir, "log.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_restart(reference: dict, records: list[dict], kill_at: int, every: int, ax=None):
    """The uninterrupted run's loss per step and the interrupted run's, attempt by attempt; the steps redone after
    the restart shaded; the seconds lost in the title."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.2))
    steps = sorted(reference)
    ax.plot(steps, [reference[s] for s in steps], color="0.6", lw=6, alpha=0.5, label="uninterrupted")
    colors = ["tab:blue", "tab:orange", "tab:green"]
    for attempt in sorted({r["attempt"] for r in records}):
        mine = [r for r in records if r["attempt"] == attempt]
        ax.plot([r["step"] for r in mine], [r["loss"] for r in mine], "o-", ms=4, color=colors[attempt % 3],
                label=f"torchrun attempt {attempt}" + (" (rank 1 killed)" if attempt == 0 else " (resumed)"))
    last_ckpt = (kill_at // every) * every
    ax.axvspan(last_ckpt - 0.5, kill_at - 0.5, color="tab:red", alpha=0.1, label="redone after the restart")
    ax.axvline(kill_at - 0.5, color="tab:red", ls="--", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    lost = seconds_lost(records, kill_at)
    ax.set_title(f"SIGKILL before step {kill_at}, checkpoint every {every} steps: {lost:.1f} s lost")
    return ax.figure


def seconds_lost(records: list[dict], kill_at: int) -> float:
    """From the last step the first attempt logged to the moment a later attempt logged step ``kill_at - 1`` again
    (the restart, the reload and the redone steps)."""
    first = [r for r in records if r["attempt"] == 0]
    later = [r for r in records if r["attempt"] > 0 and r["step"] >= kill_at - 1]
    if not first or not later:
        return float("nan")
    return later[0]["time"] - first[-1]["time"]


# ---------------------------------------------------------------------------------------------------------------
# measuring


class PeakMemory:
    """The peak resident memory of this process inside the ``with`` block, above where it started, in bytes, as the
    kernel counts it (``VmHWM``, reset through ``/proc/self/clear_refs``; Linux only, else ``nan``).

    Example::

        with lesson.PeakMemory() as peak:
            sd = {k: v.clone() for k, v in model.state_dict().items()}
        peak.grown     # about the bytes of the copy
    """

    def __enter__(self):
        self._ok = _reset_peak()
        self._start = _kb("VmRSS")
        return self

    def __exit__(self, *exc):
        peak = _kb("VmHWM")
        self.grown = (peak - self._start) * 1024 if self._ok and peak is not None else float("nan")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _kb(key: str):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (nested dicts, lists and tuples; a DTensor counts its local shard), each
    storage once."""
    seen, total, stack = set(), 0, [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, torch.Tensor):
            local = item.to_local() if hasattr(item, "to_local") else item
            storage = local.untyped_storage()
            if storage.data_ptr() not in seen or not storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def dir_bytes(directory: str) -> dict:
    """{file name: bytes} of every file under ``directory``."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, directory)] = os.path.getsize(path)
    return out


# ---------------------------------------------------------------------------------------------------------------
# figures


def plot_sampling(rows: dict, num_samples: int, ax=None):
    """One row per label (e.g. "epoch 0", "epoch 1, no set_epoch"): which rank reads each sample.
    ``rows`` = {label: [indices of rank 0, indices of rank 1, ...]}."""
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1))
    grid = np.full((len(rows), num_samples), np.nan)
    for i, per_rank in enumerate(rows.values()):
        for rank, indices in enumerate(per_rank):
            for pos, idx in enumerate(indices):
                grid[i, idx] = rank
    ax.imshow(grid, aspect="auto", cmap="tab10", vmin=0, vmax=10, interpolation="nearest")
    ranks = max(len(per_rank) for per_rank in rows.values())
    cmap = plt.get_cmap("tab10")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=cmap(r / 10 + 0.05)) for r in range(ranks)],
              labels=[f"rank {r}" for r in range(ranks)], loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.set_yticks(range(len(rows)), list(rows))
    ax.set_xlabel("sample index (colour: the rank that reads it; white: read by no rank)")
    return ax.figure


# ---------------------------------------------------------------------------------------------------------------
# the data: loader workers and their seeds, an epoch resumed on another world size, evaluation and padding


class AugmentedSamples(torch.utils.data.Dataset):
    """Sample ``i`` of ``n`` is ``(i, draw)``, ``draw`` a random number drawn when the sample is read, as a random
    crop or flip draws its parameters. By default the draw comes from the reading process's torch random state (a
    ``DataLoader`` worker's, seeded by the loader); with ``per_sample_seed`` it comes from a generator seeded with
    (``per_sample_seed``, the epoch set by ``set_epoch``, ``i``), so a sample gets the same draw whichever worker,
    rank or world size reads it, and after a restart."""

    def __init__(self, n: int, per_sample_seed: int | None = None):
        self.n, self.seed, self.epoch = n, per_sample_seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.seed is None:
            draw = torch.rand(())
        else:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) * 1_000_003 + int(i))
            draw = torch.rand((), generator=gen)
        return int(i), round(float(draw), 4)


def _pairs(batch):
    return batch  # keep each batch a list of (index, draw) pairs: no collation into tensors


def loader_draws(indices: list, seed: int = 0, generator_seed: int | None = None, num_workers: int = 2,
                 batch_size: int = 2, per_sample_seed: int | None = None, epoch: int = 0) -> dict:
    """Read the samples ``indices`` of an ``AugmentedSamples`` dataset, in that order, through a ``DataLoader`` with
    ``num_workers`` worker processes, as a rank does right after ``torch.manual_seed(seed)`` (every rank seeds alike
    so that its model starts alike). The loader gets ``generator=torch.Generator().manual_seed(generator_seed)``
    when ``generator_seed`` is given, else none. Returns ``{"draws": [(index, draw), ...] in reading order,
    "global_rng_moved": whether creating the loader's iterator drew from the global random state}``. The caller's
    global random state is left as it was."""
    from torch.utils.data import DataLoader

    dataset = AugmentedSamples(max(indices) + 1, per_sample_seed)
    dataset.set_epoch(epoch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        before = torch.get_rng_state()
        gen = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=list(indices), num_workers=num_workers,
                            generator=gen, collate_fn=_pairs)
        batches = iter(loader)  # the workers start here, each seeded with base_seed + worker id
        moved = not torch.equal(before, torch.get_rng_state())
        draws = [pair for batch in batches for pair in batch]
    return {"draws": draws, "global_rng_moved": moved}


def resumed_reads(shard, num_samples: int, batch: int, steps_done: int, world_before: int, world_after: int,
                  epoch: int = 0) -> dict:
    """How many times each sample is read in an epoch that stopped after ``steps_done`` steps of ``batch`` samples
    per rank on ``world_before`` ranks and was finished on ``world_after`` ranks, three ways.

    ``shard(num_samples, num_replicas, rank, epoch=epoch)`` gives a rank's list of indices for the epoch, as
    ``DistributedSampler`` does (your ``shard_indices``). The ways:

    * ``"same N: each rank skips its own steps_done·batch"``: finished on ``world_before`` ranks, each rank reading
      ``indices[steps_done * batch:]`` of its own list (right);
    * ``"other N: each rank skips its own steps_done·batch"``: the same slice of the new ranks' lists (wrong);
    * ``"other N: skip the steps_done·batch·N global samples"``: the epoch's order (one replica's list) without the
      samples already consumed, dealt to the new ranks by torch's ``DistributedSampler`` (right).

    Returns ``{way: counts}``, ``counts[i]`` the number of times sample ``i`` was read in the epoch."""
    from torch.utils.data import DistributedSampler

    def lists(world):
        return [shard(num_samples, world, r, epoch=epoch) for r in range(world)]

    skip = steps_done * batch
    before = [i for mine in lists(world_before) for i in mine[:skip]]
    order = shard(num_samples, 1, 0, epoch=epoch)            # the epoch's order: one replica reads all of it
    rest = order[skip * world_before:]                         # global positions 0 .. skip·N - 1 were consumed
    dealt = [[rest[p] for p in DistributedSampler(range(len(rest)), num_replicas=world_after, rank=r,
                                                  shuffle=False)] for r in range(world_after)]
    after = {
        "same N: each rank skips its own steps_done·batch": [i for mine in lists(world_before) for i in mine[skip:]],
        "other N: each rank skips its own steps_done·batch": [i for mine in lists(world_after) for i in mine[skip:]],
        "other N: skip the steps_done·batch·N global samples": [i for mine in dealt for i in mine],
    }
    counts = {}
    for way, reads in after.items():
        c = [0] * num_samples
        for i in before + reads:
            c[i] += 1
        counts[way] = c
    return counts


def evaluation_on_ranks(correct: list) -> dict:
    """On every rank of the default group (N ranks): the accuracy over a validation set whose sample ``i`` is
    answered right when ``correct[i]``, three ways, each finished by one all-reduce of (right answers, reads):

    * ``"DistributedSampler, padded"``: each rank reads its ``DistributedSampler(shuffle=False)`` share, which
      repeats samples from the start until every rank has ``ceil(n / N)``;
    * ``"padded, repeats weighted 0"``: the same reads, the padding (positions ``n`` and beyond of the padded list,
      which ``DistributedSampler`` deals to rank ``position % N``) counted with weight 0;
    * ``"unequal shares, no padding"``: rank ``r`` reads samples ``r, r + N, ...`` below ``n``.

    Returns ``{way: (accuracy, reads)}``, the same on every rank."""
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    rank, world, n = dist.get_rank(), dist.get_world_size(), len(correct)
    right = torch.tensor([float(c) for c in correct])
    mine = list(DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False))
    position = torch.arange(len(mine)) * world + rank            # where each read sits in the padded list
    ways = {
        "DistributedSampler, padded": (right[mine], torch.ones(len(mine))),
        "padded, repeats weighted 0": (right[mine], (position < n).float()),
        "unequal shares, no padding": (right[rank::world], torch.ones(len(right[rank::world]))),
    }
    out = {}
    for way, (values, weight) in ways.items():
        sums = torch.stack([(values * weight).sum(), weight.sum()])
        dist.all_reduce(sums)                                   # right answers and reads, over every rank
        out[way] = (float(sums[0] / sums[1]), int(sums[1]))
    return out


# ---------------------------------------------------------------------------------------------------------------
# one optimizer step over several micro-batches: no_sync, clipping once, unscale_ before clipping

#: The ways ``accumulation_step`` takes the step, in the order it reports them.
ACCUMULATION_WAYS = (
    "no_sync, clip once after the last micro-batch",
    "all-reduce after every micro-batch, clip once",
    "clip after every micro-batch",
    "GradScaler: unscale_, then clip",
    "GradScaler: clip the scaled gradients",
)


def _accumulation_model() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _accumulation_batch(rows: int):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(rows, 16, generator=gen), 3 * torch.randn(rows, 4, generator=gen)


def accumulation_step(micro_batches: int = 4, batch: int = 4, max_norm: float = 0.5, init_scale: float = 2.0**12,
                      lr: float = 0.1) -> dict:
    """On every rank of the default group (N ranks): one SGD step of gradient accumulation over ``micro_batches``
    micro-batches of ``batch`` samples per rank, taken each way of ``ACCUMULATION_WAYS`` with torch's
    ``DistributedDataParallel``, ``clip_grad_norm_`` and ``GradScaler("cpu")``, against one process that takes the
    same step on the whole global batch (N · micro_batches · batch samples, the loss their mean) with its gradient
    clipped to ``max_norm``. Each micro-batch's loss is divided by ``micro_batches``, so the accumulated gradient is
    the mean's.

    Returns ``{way: {"allreduces": the gradient all-reduces DDP made (one per bucket per synchronised backward),
    "norm": the norm clip_grad_norm_ returned (its last call), "error": largest |update - one process's update| /
    largest |one process's update|}}``; ``"one process"`` holds the reference's norm."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    rank, world, k = dist.get_rank(), dist.get_world_size(), micro_batches
    x, y = _accumulation_batch(world * k * batch)
    start = [p.detach().clone() for p in _accumulation_model().parameters()]

    ref = _accumulation_model()                                  # one process, the whole global batch
    F.mse_loss(ref(x), y).backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    ref_update = [p.detach() - s for p, s in zip(ref.parameters(), start)]
    scale = max(u.abs().max() for u in ref_update)

    def counting_hook(state, bucket):                           # DDP's own all-reduce, counted
        state["allreduces"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    mine = slice(rank * k * batch, (rank + 1) * k * batch)      # this rank's samples, cut into micro-batches
    xs, ys = x[mine].chunk(k), y[mine].chunk(k)
    out = {"one process": {"allreduces": 0, "norm": ref_norm, "error": 0.0}}
    for way in ACCUMULATION_WAYS:
        model = _accumulation_model()
        ddp = DistributedDataParallel(model)
        state = {"allreduces": 0}
        ddp.register_comm_hook(state, counting_hook)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if way.startswith("GradScaler") else None
        norm = None
        for i in range(k):
            last = i == k - 1
            quiet = ddp.no_sync() if not last and not way.startswith("all-reduce") else contextlib.nullcontext()
            with quiet:
                loss = F.mse_loss(ddp(xs[i]), ys[i]) / k
                (scaler.scale(loss) if scaler else loss).backward()
            if way == "clip after every micro-batch":
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if scaler is not None and "unscale_" in way:
            scaler.unscale_(opt)                                 # now the gradients are the true ones
        if way != "clip after every micro-batch":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if scaler is not None:
            scaler.step(opt)                                     # unscales first unless unscale_ already did
            scaler.update()
        else:
            opt.step()
        update = [p.detach() - s for p, s in zip(model.parameters(), start)]
        error = max((u - r).abs().max() for u, r in zip(update, ref_update)) / scale
        out[way] = {"allreduces": state["allreduces"], "norm": float(norm), "error": float(error)}
    return out


# ---------------------------------------------------------------------------------------------------------------
# checkpoints: async_save, the interval, the random state


def async_save_demo(directory: str, numel: int = 1 << 21, steps: int = 3) -> dict:
    """On every rank: a state of ``numel`` float32 elements saved with ``dcp.save``, then with ``dcp.async_save``
    while training goes on (``steps`` updates of the state and a few matrix products). ``async_save`` gets a gloo
    process group of its own, so that the collectives of its background thread never interleave with the
    training's on the default group. Returns ``{"save": seconds dcp.save blocked, "async_returned": seconds until
    async_save returned (the state copied into memory of its own), "async_done": seconds until the checkpoint was
    written, "intact": whether the checkpoint holds the state as it was when async_save was called}``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    torch.manual_seed(rank)
    state = {f"w{rank}": torch.randn(numel)}
    start = time.perf_counter()
    dcp.save(state, checkpoint_id=os.path.join(directory, "sync"))
    saved = time.perf_counter() - start

    group = dist.new_group(backend="gloo")
    snapshot = state[f"w{rank}"].clone()
    start = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=os.path.join(directory, "async"), process_group=group)
    returned = time.perf_counter() - start
    a = torch.randn(256, 256)
    for _ in range(steps):                                       # the training goes on meanwhile
        state[f"w{rank}"].add_(1.0)
        a = torch.tanh(a @ a)
    future.result()
    done = time.perf_counter() - start
    dist.barrier()
    loaded = {f"w{rank}": torch.zeros(numel)}
    dcp.load(loaded, checkpoint_id=os.path.join(directory, "async"))
    dist.destroy_process_group(group)
    return {"save": saved, "async_returned": returned, "async_done": done,
            "intact": bool(torch.equal(loaded[f"w{rank}"], snapshot))}


def young_interval(cost: float, mtbf: float) -> float:
    """Young's first-order optimum checkpoint interval, ``sqrt(2 · cost · mtbf)``: the computing time between two
    checkpoints that minimises the expected time lost, for a checkpoint that takes ``cost`` and failures that come
    at random, ``mtbf`` apart on average (J. W. Young, "A first order approximation to the optimum checkpoint
    interval", Communications of the ACM 17(9), 1974)."""
    return math.sqrt(2 * cost * mtbf)


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum checkpoint interval: ``sqrt(2δM)·(1 + √(δ/2M)/3 + (δ/2M)/9) − δ`` for
    ``δ = cost < 2M``, else ``M`` (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for
    restart dumps", Future Generation Computer Systems 22(3), 2006). Close to Young's when the checkpoint is short
    next to the time between failures; shorter when it is not."""
    if cost >= 2 * mtbf:
        return mtbf
    ratio = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost


def simulate_checkpointing(work: float, interval: float, cost: float, mtbf: float, restart: float = 0.0,
                           runs: int = 40, seed: int = 0) -> float:
    """The mean wall-clock time to finish ``work`` units of computation that writes a checkpoint (taking ``cost``)
    after every ``interval`` units, on a machine that fails at random (exponentially distributed times, mean
    ``mtbf``, also during a checkpoint or a restart). A failure loses everything since the last finished checkpoint
    and costs ``restart`` to come back. Any time unit, the same for every argument; ``runs`` runs, averaged."""
    rng = random.Random(seed)
    total = 0.0
    for _ in range(runs):
        t, done = 0.0, 0.0
        fail = rng.expovariate(1 / mtbf)
        while done < work:
            segment = min(interval, work - done)
            need = segment + (cost if done + segment < work else 0.0)   # no checkpoint after the last segment
            if t + need <= fail:
                t, done = t + need, done + segment
                continue
            t = fail                                                      # lost: back to the last checkpoint
            fail = t + rng.expovariate(1 / mtbf)
            while t + restart > fail:                                     # failed again while restarting
                t = fail
                fail = t + rng.expovariate(1 / mtbf)
            t += restart
        total += t
    return total / runs


def expected_time(work: float, interval: float, cost: float, mtbf: float, restart: float = 0.0) -> float:
    """What ``simulate_checkpointing`` averages, in closed form: a stretch that needs ``L`` units without a failure
    takes ``M·e^(R/M)·(e^(L/M) − 1)`` on average (Daly 2006's complete model, with ``M`` = ``mtbf``, ``R`` =
    ``restart``); each interval of computation is such a stretch with ``L = interval + cost``, the last one without
    its checkpoint."""
    full, last = divmod(work, interval)
    if last == 0:
        full, last = full - 1, interval

    def stretch(length):
        return mtbf * math.exp(restart / mtbf) * math.expm1(length / mtbf)

    return full * stretch(interval + cost) + stretch(last)


def plot_checkpoint_interval(costs: dict, mtbf: float, restart: float = 0.0, work: float | None = None,
                             unit: str = "min", ax=None):
    """The share of time lost against the checkpoint interval, one curve per ``{label: cost}`` (the label names the
    cost too): the expected share (``expected_time``) as a line, ``simulate_checkpointing`` at five intervals as
    dots, Young's interval dashed and Daly's dotted. Times in ``unit``."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.4))
    work = work if work is not None else 20 * mtbf
    colors = iter(["tab:blue", "tab:orange", "tab:green", "tab:red"])
    for label, cost in costs.items():
        color = next(colors)
        young = young_interval(cost, mtbf)
        line = [young * 2 ** (e / 8) for e in range(-20, 21)]
        ax.plot(line, [expected_time(work, i, cost, mtbf, restart) / work - 1 for i in line], color=color,
                label=label)
        dots = [young * 2 ** e for e in range(-2, 3)]
        ax.plot(dots, [simulate_checkpointing(work, i, cost, mtbf, restart, runs=10) / work - 1 for i in dots],
                "o", ms=4, color=color)
        ax.axvline(young, color=color, ls="--", lw=1)
        ax.axvline(daly_interval(cost, mtbf), color=color, ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel(f"checkpoint interval ({unit}); dashed: Young's sqrt(2·δ·M), dotted: Daly's")
    ax.set_ylabel("share of time lost")
    ax.set_title(f"failures every {mtbf:g} {unit} on average, restart {restart:g} {unit}: expected (line), "
                 "simulated (dots)", fontsize=9)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


def rng_state() -> dict:
    """Every random state a training step of this process may draw from: torch's CPU generator, each CUDA device's
    generator (``torch.cuda.get_rng_state_all()``, an empty list without CUDA), Python's ``random`` and NumPy's
    global one (None without NumPy). Restore it with ``set_rng_state``."""
    try:
        import numpy as np
        numpy_state = np.random.get_state()
    except ImportError:
        numpy_state = None
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(), "numpy": numpy_state}


def set_rng_state(state: dict) -> None:
    """Put back what ``rng_state`` returned."""
    torch.set_rng_state(state["cpu"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    if state["numpy"] is not None:
        import numpy as np
        np.random.set_state(state["numpy"])
