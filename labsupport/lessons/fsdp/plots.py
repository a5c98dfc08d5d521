"""Figures of notebook 07: how units are flattened and sharded (``plot_shards``), the order of gathers, frees and
reduce-scatters in one step (``plot_fsdp_schedule``), and the measured parameter memory (``plot_param_memory``)."""

from __future__ import annotations

import math

__all__ = ["plot_shards", "plot_fsdp_schedule", "plot_param_memory"]

RANK_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")


def _plt():
    import matplotlib.pyplot as plt

    return plt


def plot_shards(unit_numels: dict, world_size: int, ax=None):
    """Each unit's flat parameter as a bar cut into ``world_size`` equal shards (colour = the rank that keeps it),
    the zero padding hatched. ``unit_numels``: ``{unit name: number of elements}``."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.55 * len(unit_numels) + 1.2))
    longest = max(math.ceil(n / world_size) * world_size for n in unit_numels.values())
    for row, (name, numel) in enumerate(unit_numels.items()):
        chunk = math.ceil(numel / world_size)
        y = len(unit_numels) - 1 - row
        for r in range(world_size):
            start, stop = r * chunk, (r + 1) * chunk
            real = max(0, min(stop, numel) - start)
            ax.barh(y, real, left=start, height=0.6, color=RANK_COLOURS[r % len(RANK_COLOURS)], edgecolor="white")
            if real < chunk:
                ax.barh(y, chunk - real, left=start + real, height=0.6, color="white",
                        edgecolor=RANK_COLOURS[r % len(RANK_COLOURS)], hatch="///")
        ax.text(chunk * world_size + longest * 0.01, y, f"{numel} = {world_size}×{chunk}"
                + (f" − {chunk * world_size - numel} pad" if chunk * world_size != numel else ""),
                va="center", fontsize=8)
    ax.set_yticks(range(len(unit_numels)), list(reversed(list(unit_numels))))
    ax.set_xlim(0, longest * 1.3)
    ax.set_xlabel("position in the unit's flat parameter (elements)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=RANK_COLOURS[r % len(RANK_COLOURS)]) for r in range(world_size)]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="grey", hatch="///"))
    ax.legend(handles, [f"rank {r} keeps" for r in range(world_size)] + ["padding (zeros)"], fontsize=8,
              loc="lower right", ncol=2)
    ax.set_title(f"flat parameters sharded over {world_size} ranks")
    return ax


def plot_fsdp_schedule(num_units: int = 3, ax=None):
    """One training step of FSDP on one rank, unit by unit: all-gather, compute, free in forward; all-gather,
    compute, reduce-scatter, free in backward; then the optimizer on the shards. A staircase, to read with the
    memory plot."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.6 * num_units + 1.6))
    colours = {"all-gather": "#C44E52", "forward": "#4C72B0", "backward": "#DD8452", "reduce-scatter": "#8172B3",
               "optimizer on shards": "#55A868"}
    t = 0.0
    lanes = [f"unit {u}" for u in range(num_units)]

    def box(lane, kind, width, label=None):
        nonlocal t
        y = num_units - 1 - lane if lane is not None else -1
        ax.barh(y, width, left=t, height=0.6, color=colours[kind], edgecolor="white")
        if label:
            ax.text(t + width / 2, y, label, ha="center", va="center", fontsize=7, color="white")
        t += width

    for u in range(num_units):
        box(u, "all-gather", 0.6, "AG")
        box(u, "forward", 1.0, "fwd")
        ax.text(t + 0.02, num_units - 1 - u + 0.33, "free", fontsize=7, color="grey")
    for u in reversed(range(num_units)):
        box(u, "all-gather", 0.6, "AG")
        box(u, "backward", 2.0, "bwd")
        box(u, "reduce-scatter", 0.6, "RS")
        ax.text(t + 0.02, num_units - 1 - u + 0.33, "free", fontsize=7, color="grey")
    box(None, "optimizer on shards", 1.0, "step")
    ax.set_yticks(list(range(-1, num_units)), ["all shards"] + list(reversed(lanes)))
    ax.set_xlabel("time (schematic)")
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()], list(colours), fontsize=8,
              loc="upper right", ncol=3)
    ax.set_ylim(-1.6, num_units + 0.6)
    ax.set_title("FSDP, one step on one rank: every unit is gathered twice and reduce-scattered once")
    return ax


def plot_param_memory(records: dict, bound: float | None = None, shards: float | None = None, ax=None,
                      unit: str = "KiB"):
    """The sawtooth: bytes of parameters materialised after every operation of a step, one line per record.

    ``records``: ``{label: ParamMemory.samples}`` (a list of ``(phase, op, bytes)``). ``bound`` (largest unit plus
    all shards) and ``shards`` (what a rank keeps) are drawn as horizontal lines. Forward phases are shaded."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 3.8))
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20}[unit]
    first = None
    for i, (label, samples) in enumerate(records.items()):
        ys = [b / scale for *_, b in samples]
        ax.step(range(len(ys)), ys, where="post", label=label, color=RANK_COLOURS[i % len(RANK_COLOURS)],
                lw=1.5 if i == 0 else 1.0, ls="-" if i == 0 else "--")
        first = first or samples
    top = max((b for samples in records.values() for *_, b in samples), default=1) / scale
    if bound is not None:
        top = max(top, bound / scale)
    if first:
        spans, start, phase = [], 0, first[0][0]
        for j, (ph, *_rest) in enumerate(list(first) + [("end", "", 0)]):
            if ph != phase:
                spans.append((start, j, phase))
                start, phase = j, ph
        for start, stop, phase in spans:
            words = phase.split()
            if len(words) == 2 and words[0] in ("forward", "backward"):
                ax.axvspan(start - 0.5, stop - 0.5, color="#4C72B0" if words[0] == "forward" else "#DD8452",
                           alpha=0.12, lw=0)
                ax.text((start + stop) / 2 - 0.5, top * 1.04, words[1], ha="center", va="bottom", fontsize=7,
                        color="#555555")
    if bound is not None:
        ax.axhline(bound / scale, color="#C44E52", ls="--", lw=1, label="bound: all shards + largest unit")
    if shards is not None:
        ax.axhline(shards / scale, color="grey", ls=":", lw=1, label="all shards (kept between steps)")
    ax.set_xlabel("sampling point in the step (unit forwards shaded blue, unit backwards orange)")
    ax.set_ylabel(f"parameters held ({unit})")
    ax.set_ylim(0, top * 1.2)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=4, frameon=False)
    ax.set_title("parameter memory per rank, measured through one training step", pad=14)
    return ax
