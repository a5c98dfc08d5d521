"""Plots for notebook 05 (pipeline parallelism). Every function returns the matplotlib ``Figure`` it drew.

* ``plot_partition(ranges)``: the model's layers coloured by stage, activations flowing forward, gradients back.
* ``plot_schedules(runs)``: Gantt charts, one panel per run, one lane per stage; forwards blue, backwards orange,
  each labelled with its micro-batch (and, for an interleaved run, shaded by model chunk); idle time is blank.
  A run is a simulator's ``busy`` (per stage, ``(start, end, op, mb)`` or ``(start, end, op, mb, chunk)``) or the
  ``Timeline`` events each rank recorded (spans named ``"F 3"``, ``"B 3"``).
* ``plot_bubble(ms, measured, formula)``: bubble fraction against the number of micro-batches.
* ``plot_memory(peaks, predicted)``: peak activation bytes per stage for several schedules, next to what the number
  of micro-batches in flight predicts.
* ``plot_checkpointing(rows)``: memory kept and peak, and time, against the checkpoint segment length.
"""

from __future__ import annotations

__all__ = ["plot_partition", "plot_schedules", "plot_bubble", "plot_memory", "plot_checkpointing",
           "plot_interleaved"]

_F, _B = "#4C72B0", "#DD8452"
_STAGE = ("#8172B3", "#64B5CD", "#55A868", "#CCB974", "#C44E52", "#8C8C8C", "#DA8BC3", "#937860")


def _plt():
    import matplotlib.pyplot as plt

    return plt


def plot_partition(ranges, title: str = "layers cut into stages"):
    """Each layer a box coloured by its stage; arrows for the activation sent forward and the gradient sent back."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    plt = _plt()
    n = sum(len(r) for r in ranges)
    fig, ax = plt.subplots(figsize=(min(12, 1.1 * n + 2), 2.6))
    ax.set_xlim(-0.5, n + 0.5)
    ax.set_ylim(-1.3, 1.6)
    ax.axis("off")
    for s, r in enumerate(ranges):
        colour = _STAGE[s % len(_STAGE)]
        for i in r:
            ax.add_patch(FancyBboxPatch((i + 0.08, 0), 0.84, 0.8, boxstyle="round,pad=0.02", fc=colour, ec="black"))
            ax.text(i + 0.5, 0.4, f"layer {i}", ha="center", va="center", fontsize=8, color="white")
        if len(r):
            ax.text((r.start + r.stop) / 2, 1.1, f"stage {s} (rank {s})", ha="center", fontsize=9, color=colour,
                    weight="bold")
        if s < len(ranges) - 1 and len(r):
            x = r.stop
            ax.add_patch(FancyArrowPatch((x - 0.3, -0.3), (x + 0.3, -0.3), arrowstyle="-|>", mutation_scale=12,
                                         color=_F))
            ax.add_patch(FancyArrowPatch((x + 0.3, -0.75), (x - 0.3, -0.75), arrowstyle="-|>", mutation_scale=12,
                                         color=_B))
    ax.text(0, -0.3, "activation (send)", fontsize=8, color=_F, va="center")
    ax.text(0, -0.75, "gradient (send back)", fontsize=8, color=_B, va="center")
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    return fig


def _as_spans(run):
    """Per stage: list of (start, end, op, mb, chunk) from a simulator's busy or from Timeline events."""
    from .spans import spans_of

    out = []
    for stage in run:
        items = list(stage)
        if items and not isinstance(items[0], (tuple, list)):  # Timeline events
            items = spans_of(items)
        out.append([(float(i[0]), float(i[1]), i[2], i[3], i[4] if len(i) > 4 else 0) for i in items])
    return out


def _shade(colour: str, chunk: int) -> str:
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(colour)
    f = 1.0 - 0.35 * chunk  # later chunks lighter
    return (1 - (1 - r) * f, 1 - (1 - g) * f, 1 - (1 - b) * f)


def plot_schedules(runs: dict, units=None, title: str | None = None, same_axis: bool = True):
    """Gantt charts, one panel per ``title -> run`` (see the module docstring). ``units``: a dict ``title -> label
    of the time axis`` (default: "time" for simulated runs, "ms" for measured ones, which are shifted to start at 0
    and drawn in milliseconds). Each panel's title gets its bubble fraction. ``same_axis``: one time range for
    every panel, so that their lengths compare."""
    plt = _plt()
    units = units or {}
    panels = list(runs.items())
    heights = [len(r) * 0.55 + 0.9 for _, r in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, sum(heights) + 0.4), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    longest = 0.0
    for ax, (name, run) in zip(axes[:, 0], panels):
        measured = any(run_stage and not isinstance(list(run_stage)[0], (tuple, list)) for run_stage in run)
        spans = _as_spans(run)
        t0 = min((s[0][0] for s in spans if s), default=0.0)
        scale = 1e3 if measured else 1.0
        end = max((s[-1][1] for s in spans if s), default=1.0)
        width = (end - t0) * scale or 1.0
        work = 0.0
        for stage, items in enumerate(spans):
            y = len(spans) - 1 - stage
            for start, stop, op, mb, chunk in items:
                x, w = (start - t0) * scale, (stop - start) * scale
                work += stop - start
                ax.broken_barh([(x, w)], (y + 0.1, 0.8), facecolor=_shade(_F if op == "F" else _B, chunk),
                               edgecolor="white", linewidth=0.6)
                if w > 0.018 * width:
                    ax.text(x + w / 2, y + 0.5, str(mb), ha="center", va="center", fontsize=7, color="black"
                            if chunk else "white")
        bubble = 1 - work / (len(spans) * (end - t0)) if end > t0 else 0.0
        ax.set_yticks([len(spans) - 1 - s + 0.5 for s in range(len(spans))])
        ax.set_yticklabels([f"stage {s}" for s in range(len(spans))], fontsize=8)
        ax.set_xlim(0, width * 1.01)
        longest = max(longest, width)
        ax.set_xlabel(units.get(name, "ms (measured)" if measured else "time (simulated units)"), fontsize=8)
        ax.set_title(f"{name}: bubble {100 * bubble:.0f}% of stage time", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    if same_axis:
        for ax in axes[:, 0]:
            ax.set_xlim(0, longest * 1.01)
    from matplotlib.patches import Patch

    fig.legend([Patch(color=_F), Patch(color=_B)], ["forward (micro-batch)", "backward (micro-batch)"],
               loc="upper right", fontsize=8, ncol=2, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


plot_interleaved = plot_schedules  # an interleaved run is drawn the same way, chunks shaded


def plot_bubble(ms, measured: dict, formula, title: str = "bubble fraction against the number of micro-batches"):
    """``measured``: label -> bubble fraction for each m in ``ms``; ``formula``: the closed form for each m."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(ms, formula, "k--", lw=1.5, label="(p - 1) / (m + p - 1)")
    for (label, values), marker in zip(measured.items(), "os^vD"):
        ax.plot(ms, values, marker=marker, lw=1, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms)
    ax.set_xticklabels([str(m) for m in ms])
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("idle share of all stages' time")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    return fig


def plot_memory(peaks: dict, predicted: dict | None = None, title: str = "peak activation memory per stage"):
    """``peaks``: schedule -> peak bytes per stage (measured). ``predicted``: schedule -> bytes per stage from a
    model (e.g. micro-batches in flight x bytes per micro-batch), drawn as black bars across the measured ones."""
    import numpy as np

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    names = list(peaks)
    p = len(next(iter(peaks.values())))
    x = np.arange(p)
    w = 0.8 / len(names)
    for i, (name, colour) in enumerate(zip(names, (_F, _B, "#55A868", "#8172B3"))):
        pos = x + (i - (len(names) - 1) / 2) * w
        ax.bar(pos, np.array(peaks[name], dtype=float) / 1024, w, color=colour, label=f"{name}: measured")
        if predicted and name in predicted:
            ax.plot(pos, np.array(predicted[name], dtype=float) / 1024, "k_", markersize=18, mew=2)
    if predicted:
        ax.plot([], [], "k_", markersize=12, mew=2, label="predicted from the micro-batches in flight")
    ax.set_xticks(x)
    ax.set_xticklabels([f"stage {s}" for s in range(p)])
    ax.set_ylabel("KiB alive at the peak")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    return fig


def plot_checkpointing(rows, num_layers: int, title: str = "activation checkpointing every k layers"):
    """``rows`` from ``checkpoint_sweep``: memory (in activations of one layer) and time against ``k``."""
    import math

    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    labels = ["none" if r["k"] == 0 else str(r["k"]) for r in rows]
    xs = range(len(rows))
    unit = rows[0]["unit"]
    left.plot(xs, [r["kept"] / unit for r in rows], "o-", label="kept after forward")
    left.plot(xs, [r["peak"] / unit for r in rows], "s-", label="peak (backward included)")
    model = [num_layers + 1 if r["k"] == 0 else math.ceil(num_layers / r["k"]) + r["k"] for r in rows]
    left.plot(xs, model, "k:", label="n/k + k (segment inputs + one segment)")
    left.set_ylabel(f"activations of one layer ({unit / 1024:.0f} KiB)")
    base = rows[0]["seconds"]
    right.bar(xs, [1e3 * r["seconds"] for r in rows], color=[_B if r["k"] else _F for r in rows])
    for i, r in enumerate(rows):
        right.text(i, 1e3 * r["seconds"], f"{r['seconds'] / base:.2f}x", ha="center", va="bottom", fontsize=8)
    right.set_ylabel("forward + backward (ms)")
    for ax in (left, right):
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels)
        ax.set_xlabel(f"checkpoint every k layers (n = {num_layers}, sqrt(n) = {math.sqrt(num_layers):.0f})")
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    return fig
