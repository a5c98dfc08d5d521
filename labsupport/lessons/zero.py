"""Notebook 06 (ZeRO): where model-state memory goes, drawn and measured.

* ``plot_sharding(world_size=4, k=12)``: which slice of the parameters, gradients and optimizer state every GPU
  holds in plain data parallelism and in ZeRO's three stages (after Figure 1 of Rajbhandari et al. 2020).
* ``plot_memory_vs_gpus(gpus, per_stage)``: bytes per device against the number of GPUs, one line per stage.
* ``PAPER_TABLE1``, ``PAPER_FIGURE1``: the numbers printed in the paper, to compare a calculator with.
* ``held_bytes(params, optimizer)``: the bytes one rank holds, counted from its tensors (parameters, gradients,
  optimizer state, the optimizer's own copies of parameters).
* ``traffic_bytes(calls, world_size)``: the communication volume of a list of ``CommCall`` in the paper's units.
* ``MeasureNet``, ``activation_bytes``, ``plot_measured``: the measurements of sections 2 and 5.

Example::

    from labsupport.lessons import zero as lesson
    lesson.plot_sharding(world_size=4)
"""

from __future__ import annotations

__all__ = [
    "PAPER_TABLE1",
    "PAPER_FIGURE1",
    "STAGES",
    "plot_sharding",
    "plot_memory_vs_gpus",
    "find_optimizers",
    "held_bytes",
    "traffic_bytes",
    "MeasureNet",
    "activation_bytes",
    "plot_measured",
]

#: The four configurations, in the paper's notation.
STAGES = ("stage 0: DP", "stage 1: P_os", "stage 2: P_os+g", "stage 3: P_os+g+p")

#: Table 1 of Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
#: SC 2020 (arXiv 1910.02054): model-state memory per device in GB (10^9 bytes), mixed-precision Adam (K = 12),
#: for P_os, P_os+g and P_os+g+p, as printed (some entries are truncated rather than rounded, e.g. 4187 for
#: 4187.5). Keys: (number of parameters, DP degree N).
PAPER_TABLE1 = {
    (7.5e9, 4): (52.5, 41.3, 30.0), (7.5e9, 16): (35.6, 21.6, 7.5), (7.5e9, 64): (31.4, 16.6, 1.88),
    (7.5e9, 256): (30.4, 15.4, 0.47), (7.5e9, 1024): (30.1, 15.1, 0.12),
    (128e9, 4): (896, 704, 512), (128e9, 16): (608, 368, 128), (128e9, 64): (536, 284, 32),
    (128e9, 256): (518, 263, 8), (128e9, 1024): (513, 257, 2),
    (1e12, 4): (7000, 5500, 4000), (1e12, 16): (4750, 2875, 1000), (1e12, 64): (4187, 2218, 250),
    (1e12, 256): (4046, 2054, 62.5), (1e12, 1024): (4011, 2013, 15.6),
}

#: The example of the paper's Figure 1: 7.5B parameters, N = 64, K = 12: GB per device for stages 0 to 3.
PAPER_FIGURE1 = {"num_params": 7.5e9, "dp_degree": 64, "k": 12, "gb": (120.0, 31.4, 16.6, 1.9)}

_COLOURS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer state": "#55A868"}


def plot_sharding(world_size: int = 4, k: float = 12):
    """Draw, for stages 0 to 3, what each of ``world_size`` GPUs holds: three bars per GPU (16-bit parameters
    2 bytes per parameter, 16-bit gradients 2, optimizer state K), filled where the GPU holds that slice."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    widths = {"parameters": 2.0, "gradients": 2.0, "optimizer state": float(k)}
    total = sum(widths.values())
    fig, axes = plt.subplots(4, 1, figsize=(10, 1.1 + 0.42 * world_size * 4 / 2), sharex=True)
    for stage, ax in enumerate(axes):
        sharded = {"parameters": stage >= 3, "gradients": stage >= 2, "optimizer state": stage >= 1}
        for gpu in range(world_size):
            y = world_size - 1 - gpu
            x = 0.0
            for name, w in widths.items():
                ax.add_patch(Rectangle((x, y + 0.1), w, 0.8, fill=False, edgecolor="0.6", lw=0.8))
                if sharded[name]:
                    piece = w / world_size
                    ax.add_patch(Rectangle((x + gpu * piece, y + 0.1), piece, 0.8, color=_COLOURS[name]))
                    for j in range(1, world_size):
                        ax.plot([x + j * piece] * 2, [y + 0.1, y + 0.9], color="0.8", lw=0.5)
                else:
                    ax.add_patch(Rectangle((x, y + 0.1), w, 0.8, color=_COLOURS[name]))
                x += w + 0.3
            ax.text(-0.3, y + 0.5, f"GPU {gpu}", ha="right", va="center", fontsize=8)
        ax.set_xlim(-2.2, total + 0.9)
        ax.set_ylim(0, world_size)
        ax.set_yticks([])
        ax.set_xticks([])
        for side in ("top", "right", "left", "bottom"):
            ax.spines[side].set_visible(False)
        ax.set_title(STAGES[stage], loc="left", fontsize=9)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    labels = [f"{n} ({w:g} bytes/parameter)" for n, w in widths.items()]
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"What each of {world_size} GPUs holds (filled) of the model state; grey outline: the whole",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    return fig


def plot_memory_vs_gpus(gpus, per_stage: dict, title: str = "", limits_gb=(32, 80)):
    """Log-log plot of bytes per device (``per_stage``: label -> one value per entry of ``gpus``), with
    horizontal lines at the given device memories in GB."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in per_stage.items():
        ax.plot(gpus, [v / 1e9 for v in values], marker="o", label=label)
    for limit in limits_gb:
        ax.axhline(limit, color="0.5", ls=":", lw=1)
        ax.text(gpus[-1], limit * 1.08, f"{limit} GB device", ha="right", fontsize=8, color="0.4")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("data-parallel degree N (GPUs)")
    ax.set_ylabel("model state per device (GB)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    return fig


def find_optimizers(obj, depth: int = 4) -> list:
    """Every ``torch.optim.Optimizer`` reachable from ``obj`` (itself, its attributes, lists, tuples and dicts,
    ``depth`` levels down), each once."""
    import torch

    found, seen = [], set()

    def walk(x, level):
        if id(x) in seen or level > depth:
            return
        seen.add(id(x))
        if isinstance(x, torch.optim.Optimizer):
            found.append(x)
        if isinstance(x, torch.Tensor):
            return
        if isinstance(x, dict):
            children = list(x.values())
        elif isinstance(x, (list, tuple, set)):
            children = list(x)
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            children = list(vars(x).values())
        else:
            return
        for child in children:
            walk(child, level + 1)

    walk(obj, 0)
    return found


def _storage_key(t):
    return (t.device.type, t.untyped_storage().data_ptr())


def held_bytes(params, optimizer) -> dict:
    """Bytes this rank holds for the model state, from the tensors themselves (each storage counted once):

    * ``parameters``: the model's parameters (``params``);
    * ``gradients``: their ``.grad``, and the ``.grad`` of every tensor the optimizer(s) found in ``optimizer``
      update;
    * ``optimizer state``: every tensor in those optimizers' ``state`` (step counters included);
    * ``optimizer copies``: tensors those optimizers update that are not model parameters (a flat shard, a
      32-bit master copy).
    """
    params = list(params)
    optimizers = find_optimizers(optimizer)
    counted = {name: {} for name in ("parameters", "gradients", "optimizer state", "optimizer copies")}
    own = {id(p) for p in params}

    def add(kind, t):
        if t is not None:
            counted[kind].setdefault(_storage_key(t), t.untyped_storage().nbytes())

    for p in params:
        add("parameters", p)
        add("gradients", p.grad)
    for opt in optimizers:
        for group in opt.param_groups:
            for t in group["params"]:
                if id(t) not in own:
                    add("optimizer copies", t)
                add("gradients", t.grad)
        for state in opt.state.values():
            for value in state.values():
                if hasattr(value, "untyped_storage"):
                    add("optimizer state", value)
    return {kind: sum(d.values()) for kind, d in counted.items()}


#: How much data one call moves through each rank, in the accounting of the ZeRO paper (section 7): an all-reduce
#: of n bytes is a reduce-scatter (n) and an all-gather (n), 2n; a reduce or a broadcast of n bytes, done the
#: bandwidth-optimal way, n; a reduce-scatter of an n-byte input, n; an all-gather of n-byte pieces from N ranks,
#: N n. (The exact per-rank figures carry a factor (N-1)/N, which the paper drops.)
_VOLUME = {"all_reduce": 2, "reduce": 1, "broadcast": 1, "reduce_scatter": 1, "reduce_scatter_tensor": 1,
           "send": 1, "gather": 1, "scatter": 1, "all_to_all": 1, "all_to_all_single": 1}
_TIMES_N = ("all_gather", "all_gather_into_tensor")


def traffic_bytes(calls, world_size: int) -> float:
    """The communication volume of ``calls`` (``CommCall`` records of one rank) in the paper's accounting."""
    total = 0.0
    for c in calls:
        if c.kind in _TIMES_N:
            total += world_size * c.nbytes
        else:
            total += _VOLUME.get(c.kind, 0) * c.nbytes
    return total


def _make_measure_net(widths):
    import torch.nn as nn

    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


class MeasureNet:
    """Factory for the measurement model (``MeasureNet.make(seed)``): an MLP of nine layers, seven of them the same
    size, like the repeated blocks of a transformer: Ψ = 72394 parameters, the largest 9216, so that whole
    parameters can be dealt out to 2 or 4 ranks evenly enough to see the 1/N."""

    WIDTHS = (64, 96, 96, 96, 96, 96, 96, 96, 96, 10)

    @classmethod
    def make(cls, seed: int = 0):
        import torch

        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return _make_measure_net(cls.WIDTHS)


def activation_bytes(model, x, autocast_dtype=None) -> dict:
    """What autograd saves for backward in one forward of ``model`` on ``x`` (inside
    ``torch.autocast("cpu", dtype=autocast_dtype)`` when given), in bytes, each storage once:
    ``{"activations", "weight copies", "parameters"}``. The parameters themselves cost nothing extra (the model holds
    them anyway); a "weight copy" is a tensor of a parameter's shape in another dtype, the 16-bit cast autocast keeps
    until backward."""
    import contextlib

    import torch

    params = {_storage_key(p) for p in model.parameters()}
    shapes = {(tuple(p.shape), p.dtype) for p in model.parameters()}
    seen = {}

    def pack(t):
        key = _storage_key(t)
        if key in params:
            kind = "parameters"
        elif any(tuple(t.shape) in (shape, shape[::-1]) and t.dtype != dtype for shape, dtype in shapes):
            kind = "weight copies"
        else:
            kind = "activations"
        seen.setdefault(key, (kind, t.untyped_storage().nbytes()))
        return t

    ctx = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        out = model(x)
    out.float().sum().backward()
    totals = dict.fromkeys(("activations", "weight copies", "parameters"), 0)
    for kind, nbytes in seen.values():
        totals[kind] += nbytes
    return totals


def plot_measured(rows, title: str = "bytes per rank: measured (bars) and calculated (black ticks)"):
    """Grouped bars of measured bytes per rank. ``rows``: dicts with ``label``, ``measured`` (kind -> bytes),
    ``calculated`` (total bytes)."""
    import matplotlib.pyplot as plt

    kinds = ("parameters", "gradients", "optimizer state", "optimizer copies")
    colours = list(_COLOURS.values()) + ["#8172B2"]
    fig, ax = plt.subplots(figsize=(max(6, 0.75 * len(rows) + 2), 3.8))
    for i, row in enumerate(rows):
        bottom = 0.0
        for kind, colour in zip(kinds, colours):
            value = row["measured"].get(kind, 0) / 1024
            ax.bar(i, value, bottom=bottom, color=colour, label=kind if i == 0 else None, width=0.7)
            bottom += value
        ax.plot([i - 0.38, i + 0.38], [row["calculated"] / 1024] * 2, color="black", lw=2,
                label="calculated" if i == 0 else None)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([row["label"] for row in rows], fontsize=8)
    ax.set_ylabel("KiB per rank")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    return fig
