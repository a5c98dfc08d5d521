"""Checkpoints, for notebook 09_production: ``dcp.async_save`` against ``dcp.save`` (``async_save_demo``), the
checkpoint interval (Young 1974, Daly 2006: ``young_interval``, ``daly_interval``, ``simulate_checkpointing``,
``expected_time``, ``plot_checkpoint_interval``) and the random state a checkpoint must hold (``rng_state``,
``set_rng_state``).
"""

from __future__ import annotations

import math
import os
import random
import time

import torch


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
