"""Helpers of the multi-GPU demo notebooks in ``demos/``: where they run, a timing harness, small models, bytes of
model state held per rank, and their plots.

The demos are made for a runtime with GPUs (Kaggle's two T4s, a workstation): there the workers use NCCL, one rank
per GPU. Anywhere else they run the same code with gloo on the CPU, on smaller sizes, and say so.

``runtime()`` counts GPUs the way ``labsupport.run`` does, without initialising CUDA in the notebook's kernel.
``timed()`` runs inside a worker: CUDA events on a GPU (the GPU's own clock, no host synchronisation inside the
measured span), ``time.perf_counter`` on the CPU.

With one GPU (Colab's free tier) there is no second GPU to talk to. ``one_device_step`` then measures what one GPU
can measure honestly: the time of forward, backward and the optimizer step on it, and the α and β of the link it
hangs on (host to GPU copies, fitted like notebook 02's ping-pong); ``ddp_model`` puts these next to the ring
all-reduce of the gradient that 2 to 8 such GPUs would need, simulated by notebook 02's ``netsim``: measured
compute against modelled communication, each labelled as what it is. ``overlap_verdict`` says what measured DDP
numbers mean, on GPUs and on the CPU fallback, where overlap has nothing to hide behind.
"""

from __future__ import annotations

import statistics
import textwrap
import time
from dataclasses import dataclass

from ._env import _gpu_count

__all__ = [
    "Runtime", "runtime", "describe", "timed", "bus_bandwidth", "make_mlp", "state_bytes", "model_state_formula",
    "plot_busbw", "plot_step_times", "plot_memory", "GB", "MB", "one_device_step", "ddp_model", "show_ddp_model",
    "overlap_verdict", "plot_ddp_model",
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
    one_gpu: str = ""  # what the demo does instead when there is exactly one GPU ("": the gloo fallback)

    @property
    def on_gpu(self) -> bool:
        return self.backend == "nccl"

    @property
    def single_gpu(self) -> bool:
        """One GPU, and a demo with something of its own to show on it (``one_gpu``)."""
        return self.gpus == 1 and bool(self.one_gpu)


def runtime(max_ranks: int | None = None, cpu_ranks: int = 2, verbose: bool = True, one_gpu: str = "") -> Runtime:
    """What this demo runs where: NCCL with one rank per GPU when there are at least two GPUs, else gloo on the CPU.

    ``max_ranks`` caps the number of ranks on a GPU machine (``2`` for a demo made for two GPUs). ``one_gpu`` says
    what the demo shows on a single GPU instead of the gloo fallback (empty: it falls back). Prints a short
    statement of the plan unless ``verbose`` is false.
    """
    gpus = _gpu_count()
    if gpus >= 2:
        world = gpus if max_ranks is None else min(gpus, max_ranks)
        rt = Runtime(gpus, world, "nccl", one_gpu)
    elif gpus == 1 and one_gpu:
        rt = Runtime(gpus, 1, "nccl", one_gpu)
    else:
        rt = Runtime(gpus, cpu_ranks, "gloo", one_gpu)
    if verbose:
        print(describe(rt))
    return rt


def describe(rt: Runtime) -> str:
    if rt.single_gpu:
        return (f"one GPU found (counted without initialising CUDA in this kernel): no second GPU to talk to, so "
                f"{rt.one_gpu}. Sizes are the full ones.")
    if rt.on_gpu:
        return (f"{rt.gpus} GPUs found (counted without initialising CUDA in this kernel): the workers run NCCL, "
                f"{rt.world_size} ranks, one per GPU (rank r on cuda:r). Sizes are the full ones.")
    why = "no GPU" if rt.gpus == 0 else "only one GPU (NCCL needs one GPU per rank)"
    return (f"{why} here: the workers run gloo on the CPU, {rt.world_size} ranks, with shrunk sizes. "
            f"The code is the same as on GPUs; the numbers it prints are CPU numbers, not GPU ones.")


# ----------------------------------------------------------------------------------------------------------------
# timing, inside a worker


def timed(fn, *, warmup: int = 2, iters: int = 5, device=None, setup=None) -> float:
    """Median seconds of one ``fn()`` on this rank, after ``warmup`` untimed calls; ``setup()``, if given, runs
    before each call, untimed (e.g. the forward pass whose backward is timed).

    On a GPU, a pair of CUDA events brackets each call on the current stream and the time is read after the end
    event completes: it is GPU time, including the kernels ``fn`` queued. On the CPU, ``time.perf_counter``.
    Every rank must call it the same way (``fn`` usually holds a collective).
    """
    import torch

    import labsupport

    device = torch.device(device) if device is not None else labsupport.device()
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            if setup is not None:
                setup()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
    else:
        for _ in range(iters):
            if setup is not None:
                setup()
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
# one GPU: measured compute, modelled communication


def one_device_step(width: int, depth: int, batch: int, warmup: int = 2, iters: int = 5, device=None,
                    link_sizes=None) -> dict:
    """What one device measures of a training step of ``make_mlp(width, depth)`` on ``batch`` samples: seconds of
    forward, backward and the SGD step (each with ``timed``: CUDA events on a GPU, ``perf_counter`` on the CPU), the
    gradient's bytes, and ``alpha``/``beta`` of copies from host memory to the device (pinned on a GPU: its PCIe
    link), fitted by least squares over ``link_sizes``. Runs in a worker (``labsupport.run(..., world_size=1)``,
    which gives it the GPU) or anywhere with ``device``."""
    import torch

    import labsupport
    from labsupport.lessons.ring_allreduce import netsim

    dev = torch.device(device) if device is not None else labsupport.device()
    model = make_mlp(width, depth).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, device=dev)

    loss = []

    def forward():
        loss[:] = [model(x).square().mean()]

    t_forward = timed(forward, warmup=warmup, iters=iters, device=dev)
    t_backward = timed(lambda: loss.pop().backward(), setup=forward, warmup=warmup, iters=iters, device=dev)
    t_optimizer = timed(opt.step, warmup=warmup, iters=iters, device=dev)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    pinned = dev.type == "cuda"
    sizes = list(link_sizes or [1 << k for k in range(12, 27, 2)])     # 4 KiB .. 64 MiB
    times = []
    for n in sizes:
        src = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
        dst = torch.empty(n, dtype=torch.uint8, device=dev)
        times.append(timed(lambda: dst.copy_(src, non_blocking=pinned), warmup=1, iters=iters, device=dev))
    alpha, beta = netsim.fit_alpha_beta(sizes, times)
    return {"forward": t_forward, "backward": t_backward, "optimizer": t_optimizer,
            "gradient bytes": grad_bytes, "parameters": grad_bytes // 4, "alpha": alpha, "beta": beta,
            "device": str(dev)}


def ddp_model(step: dict, ranks=(2, 4, 8)) -> list[dict]:
    """For each N in ``ranks``: a DDP step on N devices like the one ``step`` measured (``one_device_step``), joined
    in a ring by links with its ``alpha`` and ``beta``. ``comm`` is the ring all-reduce of the whole gradient as
    notebook 02's ``netsim`` simulates it; ``no overlap`` is compute then that all-reduce; ``overlap, at best`` lets
    the all-reduce run entirely beside backward, so only what outlasts backward shows (the lower bound: DDP's last
    bucket is only ready when backward ends); ``hidden, at most`` is the share of the all-reduce behind backward."""
    from labsupport.lessons.ring_allreduce import netsim

    compute = step["forward"] + step["backward"] + step["optimizer"]
    rows = []
    for n in ranks:
        comm = netsim.simulate(netsim.ring_allreduce(n, step["gradient bytes"]), netsim.Uniform(step["alpha"],
                                                                                               step["beta"]))
        best = step["forward"] + max(step["backward"], comm) + step["optimizer"]
        rows.append({"ranks": n, "compute": compute, "comm": comm, "no overlap": compute + comm,
                     "overlap, at best": best, "hidden, at most": min(step["backward"], comm) / comm if comm else 1.0})
    return rows


def show_ddp_model(step: dict, rows: list[dict]) -> None:
    """Print what ``one_device_step`` measured and ``ddp_model`` predicts, each number labelled as one or the other."""
    from .display import show_table

    ms = lambda t: f"{t * 1e3:.2f}"  # noqa: E731
    print(f"measured on {step['device']} alone ({step['parameters'] / 1e6:.1f} M parameters, "
          f"{step['gradient bytes'] / 2**20:.0f} MiB of gradients): forward {ms(step['forward'])} ms, backward "
          f"{ms(step['backward'])} ms, optimizer step {ms(step['optimizer'])} ms")
    print(f"measured link, host memory to {step['device']}: alpha = {step['alpha'] * 1e6:.1f} us per message, "
          f"1/beta = {1 / step['beta'] / 1e9:.2f} GB/s" if step["beta"] > 0 else
          f"measured link, host memory to {step['device']}: alpha = {step['alpha'] * 1e6:.1f} us, beta = 0")
    show_table(["GPUs (model)", "compute ms (measured)", "all-reduce ms (model)", "no overlap ms",
                "overlap ms, at best", "hidden, at most"],
               [(r["ranks"], ms(r["compute"]), ms(r["comm"]), ms(r["no overlap"]), ms(r["overlap, at best"]),
                 f"{r['hidden, at most']:.0%}") for r in rows])
    print("Compute is measured on this device. The all-reduce is not measured (there is no second GPU here): it is\n"
          "the ring all-reduce of the gradient over links as fast as the one measured above, simulated with\n"
          "notebook 02's netsim. Two GPUs without NVLink talk over PCIe links like it; NVLink is several times\n"
          "faster.")


def plot_ddp_model(rows: list[dict], title: str = "a DDP step on N GPUs: measured compute, modelled all-reduce"):
    """Bars per N: compute (measured) and the all-reduce (modelled), serial against overlapped at best."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = []
    for i, r in enumerate(rows):
        for j, kind in enumerate(("no overlap", "overlap, at best")):
            total = r[kind]
            y = 2.5 * i + j
            labels.append((y, f"N={r['ranks']}, {kind}"))
            ax.barh(y, r["compute"] * 1e3, color="#1b9e77", label="compute (measured)" if y == 0 else None)
            ax.barh(y, (total - r["compute"]) * 1e3, left=r["compute"] * 1e3, color="#d95f02",
                    label="all-reduce left exposed (model)" if y == 0 else None)
    ax.set_yticks([y for y, _ in labels], [t for _, t in labels], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds per step")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def overlap_verdict(times: dict, rt: Runtime, parameters: int) -> str:
    """What measured DDP step times (``compute only``, ``all-reduce only``, ``no overlap``, ``DDP (overlap)``, in
    seconds, slowest rank) mean, in words: the share of the all-reduce hidden, and, when overlap bought nothing or
    the numbers come from CPU processes, why, so that no number reads as the opposite of the lesson unexplained."""
    compute, comm = times["compute only"], times["all-reduce only"]
    serial, ddp = times["no overlap"], times["DDP (overlap)"]
    hidden = min(1.0, max(0.0, 1 - (ddp - compute) / comm)) if comm > 0 else 0.0
    ms = lambda t: f"{t * 1e3:.2f} ms"  # noqa: E731
    grad = f"{4 * parameters / 2**20:.1f} MiB"
    lines = [f"communication hidden behind backward by DDP: {hidden:.0%} (1 - (DDP {ms(ddp)} - compute only "
             f"{ms(compute)}) / all-reduce only {ms(comm)})"]
    noise = min(ddp, serial) < 0.9 * compute   # a step with communication faster than one without: noise
    if noise:
        lines[0] += ": not a measurement, see below"
        lines.append(
            f"These numbers contradict each other: a step that communicates ({ms(min(ddp, serial))}) took less time "
            f"than 'compute only' ({ms(compute)}), which communicates nothing. Something else used this machine "
            "while it measured, and that noise is larger than what is measured. Run the cell again; the share hidden "
            "means nothing until the steps with communication take longer than the one without.")
    if rt.on_gpu:
        if not noise and ddp >= serial:
            lines.append(f"DDP was not faster than no overlap here ({ms(ddp)} against {ms(serial)}): the all-reduce of "
                         f"{grad} ({ms(comm)}) ran beside a backward that left it little to hide behind, or the link "
                         "between these GPUs is shared with other traffic. Run the cell again; if it stays so, the "
                         "step is bound by the link, and overlap cannot shorten what the link takes.")
        return "\n".join(textwrap.fill(line, 116) for line in lines)
    lines.append(
        f"CPU only: these are {rt.world_size} CPU processes on this machine, not GPUs. 'compute only' ({ms(compute)}) "
        f"is each process's forward, backward and step; 'all-reduce only' ({ms(comm)}) is gloo copying {grad} "
        "between the processes through this machine's memory, not over a network.")
    if noise:
        pass
    elif ddp >= serial or hidden < 0.1:
        lines.append(
            f"Here DDP (overlap) took {ms(ddp)} against {ms(serial)} without overlap: it hid "
            f"{'nothing' if hidden == 0 else 'next to nothing'}, the opposite of what overlap does on GPUs, and "
            "this is why: backward's compute and gloo's communication threads run on the same few CPU cores, so "
            "they take turns instead of running side by side, and DDP's hooks and bucket copies cost a little on "
            "top. Overlap hides communication only when something else (a GPU's copy engines and NCCL's stream, a "
            "network card) moves the bytes while the cores compute.")
    else:
        lines.append(
            f"DDP hid {hidden:.0%} of the all-reduce even here, where compute and communication share the same "
            "few CPU cores: expect the share to vary from run to run.")
    lines.append(
        "On GPUs, NCCL's kernels run on their own CUDA stream next to the backward kernels: with the full-size model "
        "'DDP (overlap)' sits clearly below 'no overlap', bounded by how long backward lasts after the first bucket "
        "is ready. With one GPU, this demo shows that bound from the GPU's measured compute and a modelled "
        "all-reduce.")
    return "\n".join(textwrap.fill(line, 116) for line in lines)


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
