"""Helpers of the multi-GPU demo notebooks in ``demos/``: where they run, a timing harness, small models, bytes of
model state held per rank, and their plots.

The demos are made for a runtime with GPUs (Kaggle's two T4s, a workstation): there the workers use NCCL, one rank
per GPU. Anywhere else they run the same code with gloo on the CPU, on smaller sizes, and say so.

``runtime()`` counts GPUs the way ``labsupport.run`` does, without initialising CUDA in the notebook's kernel.
``timed()`` runs inside a worker: CUDA events on a GPU (the GPU's own clock, no host synchronisation inside the
measured span), ``time.perf_counter`` on the CPU.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from ._env import _gpu_count

__all__ = [
    "Runtime", "runtime", "describe", "timed", "bus_bandwidth", "make_mlp", "state_bytes", "model_state_formula",
    "plot_busbw", "plot_step_times", "plot_memory", "GB", "MB",
]

MB = 1 << 20
GB = 1 << 30


# ----------------------------------------------------------------------------------------------------------------
# where the demo runs


@dataclass(frozen=True)
class Runtime:
    gpus: int          # GPUs this machine has (counted without initialising CUDA here)
    world_size: int    # ranks the demo starts
    backend: str       # "nccl" (one rank per GPU) or "gloo" (CPU processes)

    @property
    def on_gpu(self) -> bool:
        return self.backend == "nccl"


def runtime(max_ranks: int | None = None, cpu_ranks: int = 2, verbose: bool = True) -> Runtime:
    """What this demo runs where: NCCL with one rank per GPU when there are at least two GPUs, else gloo on the CPU.

    ``max_ranks`` caps the number of ranks on a GPU machine (``2`` for a demo made for two GPUs). Prints a short
    statement of the plan unless ``verbose`` is false.
    """
    gpus = _gpu_count()
    if gpus >= 2:
        world = gpus if max_ranks is None else min(gpus, max_ranks)
        rt = Runtime(gpus, world, "nccl")
    else:
        rt = Runtime(gpus, cpu_ranks, "gloo")
    if verbose:
        print(describe(rt))
    return rt


def describe(rt: Runtime) -> str:
    if rt.on_gpu:
        return (f"{rt.gpus} GPUs found (counted without initialising CUDA in this kernel): the workers run NCCL, "
                f"{rt.world_size} ranks, one per GPU (rank r on cuda:r). Sizes are the full ones.")
    why = "no GPU" if rt.gpus == 0 else "only one GPU (NCCL needs one GPU per rank)"
    return (f"{why} here: the workers run gloo on the CPU, {rt.world_size} ranks, with shrunk sizes. "
            f"The code is the same as on GPUs; the numbers it prints are CPU numbers, not GPU ones.")


# ----------------------------------------------------------------------------------------------------------------
# timing, inside a worker


def timed(fn, *, warmup: int = 2, iters: int = 5, device=None) -> float:
    """Median seconds of one ``fn()`` on this rank, after ``warmup`` untimed calls.

    On a GPU, a pair of CUDA events brackets each call on the current stream and the time is read after the end
    event completes: it is GPU time, including the kernels ``fn`` queued. On the CPU, ``time.perf_counter``.
    Every rank must call it the same way (``fn`` usually holds a collective).
    """
    import torch

    import labsupport

    device = torch.device(device) if device is not None else labsupport.device()
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s of an all-reduce of ``nbytes`` per rank that took ``seconds``, as nccl-tests
    reports them: algbw = nbytes / time; busbw = algbw * 2(n-1)/n, the rate each link carries in a ring."""
    algbw = nbytes / seconds
    return algbw, algbw * 2 * (world_size - 1) / world_size


# ----------------------------------------------------------------------------------------------------------------
# models and the bytes they hold


def make_mlp(width: int, depth: int, seed: int = 0):
    """``depth`` Linear(width, width) layers with ReLU between them, the same weights on every rank (``seed``)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _local(t):
    """The part of ``t`` this rank stores: the local shard of a DTensor (FSDP2), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def state_bytes(model, optimizer) -> dict:
    """Bytes this rank holds of parameters, gradients and optimizer state, measured from the tensors themselves
    (local shards for FSDP2's DTensors). Scalars in the optimizer state (Adam's step count per parameter tensor,
    not per element) are left out, as the formula leaves them out."""
    import torch

    params = [p for p in model.parameters()]
    out = {"parameters": 0, "gradients": 0, "optimizer state": 0}
    for p in params:
        local = _local(p)
        out["parameters"] += local.numel() * local.element_size()
        if p.grad is not None:
            g = _local(p.grad)
            out["gradients"] += g.numel() * g.element_size()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:  # not Adam's one-number step counters
                v = _local(value)
                out["optimizer state"] += v.numel() * v.element_size()
    return out


def model_state_formula(n_params: int, world_size: int, stage: int, k: int = 8, bytes_param: int = 4,
                        bytes_grad: int = 4) -> dict:
    """Bytes of model state per rank by the ZeRO paper's formula, restated: parameters, gradients, optimizer state
    (``k`` bytes per parameter: Adam's two fp32 moments are 8), each divided by N once the stage shards it.
    Stage 0 is DDP, 3 is FSDP / ZeRO-3."""
    n = world_size
    return {
        "parameters": n_params * bytes_param / (n if stage >= 3 else 1),
        "gradients": n_params * bytes_grad / (n if stage >= 2 else 1),
        "optimizer state": n_params * k / (n if stage >= 1 else 1),
    }


# ----------------------------------------------------------------------------------------------------------------
# plots


def plot_busbw(lines: dict, title: str = "all-reduce bus bandwidth (nccl-tests convention)"):
    """``lines``: {label: [(bytes, busbw in bytes/s), ...]}: one curve per backend, sizes on a log axis."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in lines.items():
        sizes, bw = zip(*points)
        ax.plot(sizes, [b / 1e9 for b in bw], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size per rank (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_step_times(times: dict, title: str = "time per training step"):
    """``times``: {label: seconds}: one bar per way of running the step."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    labels = list(times)
    ax.barh(labels, [times[k] * 1e3 for k in labels], color=["#999999", "#d95f02", "#1b9e77", "#7570b3"][:len(labels)])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds per step (median, slowest rank)")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_memory(measured: dict, formula: dict, unit: int = MB, unit_name: str = "MB",
                title: str = "model state per rank"):
    """Stacked bars of measured bytes per rank (``measured``: {setup: {part: bytes}}) with the formula's total for
    each setup as a black tick (``formula``: {setup: bytes})."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    setups = list(measured)
    parts = list(next(iter(measured.values())))
    left = [0.0] * len(setups)
    for part in parts:
        vals = [measured[s][part] / unit for s in setups]
        ax.barh(setups, vals, left=left, label=part)
        left = [a + b for a, b in zip(left, vals)]
    for i, s in enumerate(setups):
        if s in formula:
            ax.plot([formula[s] / unit] * 2, [i - 0.4, i + 0.4], color="black", lw=2,
                    label="formula" if i == 0 else None)
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.set_xlabel(unit_name + " per rank")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig
