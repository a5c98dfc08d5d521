"""The restart demo of notebook 09_production: ``RestartNet`` trained data-parallel with a DCP checkpoint
every few steps (``train_run``), the script torchrun starts (``write_restart_script``, ``torchrun``), rank 0's log
(``read_log``), the figure (``plot_restart``) and the seconds a restart cost (``seconds_lost``).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn


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
