"""Diagrams and measurement plots of notebook 02 (ring all-reduce).

* ``plot_ring_steps(world_size=4)``: the ring all-reduce step by step: which chunk every rank sends, and what
  every rank holds, after each reduce-scatter and all-gather step.
* ``plot_traffic(per_rank, nbytes)``: bytes each rank sent and received, per scheme (parameter server, ring...).
* ``plot_bus_bandwidth(results, p2p=None)``: time and bus bandwidth against message size, per implementation.
* ``plot_measured_vs_predicted(measured, predicted, nbytes)``: all-reduce time against the number of ranks,
  measured points and simulated curves on one log-log plot.

Notation as in notebook 01: rank r's tensor is a letter (``a`` for rank 0, ``b`` for rank 1, ...), a cell's colour
is the rank its data came from, and a striped cell is a sum of the ranks whose colours it shows. In the ring
diagram, cell j of a rank is chunk j of ``tensor.flatten().tensor_split(world_size)``.

Example::

    from labsupport.lessons import ring_allreduce as lesson
    lesson.plot_ring_steps(4)
"""

from __future__ import annotations

import math

__all__ = ["plot_ring_steps", "plot_traffic", "plot_bus_bandwidth", "plot_measured_vs_predicted"]

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _colour(rank: int):
    import matplotlib

    return matplotlib.colormaps["tab10"](rank % 10)


# ----------------------------------------------------------------------------------------------------------------
# The ring, step by step


def ring_states(world_size: int):
    """The ring all-reduce as data: a list of ``(title, holdings, sends)``, one per state.

    ``holdings[r][j]`` is the sorted tuple of ranks whose chunk j is summed in rank r's chunk j; ``sends`` maps each
    rank to the chunk it sent in the step that led to this state (empty for the start).
    """
    n = world_size
    hold = [[(r,) for _ in range(n)] for r in range(n)]
    states = [("start\nevery rank has its own tensor", [row[:] for row in hold], {})]
    for k in range(2 * (n - 1)):
        new = [row[:] for row in hold]
        sends = {}
        for r in range(n):
            # reduce-scatter step k: chunk (r - k - 1) % n; all-gather step s = k - (n - 1): chunk (r - s) % n
            send = (r - k - 1) % n if k < n - 1 else (r - (k - n + 1)) % n
            sends[r] = send
            dst = (r + 1) % n
            if k < n - 1:
                new[dst][send] = tuple(sorted(set(hold[dst][send]) | set(hold[r][send])))
            else:
                new[dst][send] = hold[r][send]
        hold = new
        if k < n - 1:
            title = f"reduce-scatter step {k + 1} of {n - 1}\nsend chunk (r-{k + 1}) % {n}, add the one received"
        else:
            s = k - n + 1
            title = f"all-gather step {s + 1} of {n - 1}\nsend chunk (r{'-' + str(s) if s else ''}) % {n}, store the one received"
        states.append((title, [row[:] for row in hold], sends))
    return states


def _cell_label(ranks: tuple, n: int) -> str:
    if len(ranks) == n and n > 1:
        return "\u03a3"  # the complete sum
    if n > 4:
        return str(len(ranks))  # too many letters for the cell: how many ranks are summed in it
    return "".join(_LETTERS[r] for r in ranks)


def _draw_ring_state(ax, holdings, sends, n: int, fresh: set, radius: float) -> None:
    from matplotlib.patches import FancyArrowPatch, Rectangle

    bar_w, bar_h = 1.2, 0.32
    cell = bar_w / n
    centres = []
    for r in range(n):
        theta = math.pi / 2 - 2 * math.pi * r / n  # rank 0 at the top, clockwise
        cx, cy = radius * math.cos(theta), radius * math.sin(theta)
        centres.append((cx, cy, theta))
        x0, y0 = cx - bar_w / 2, cy - bar_h / 2
        for j in range(n):
            ranks = holdings[r][j]
            stripe = cell / len(ranks)
            for k, src in enumerate(ranks):
                ax.add_patch(Rectangle((x0 + j * cell + k * stripe, y0), stripe, bar_h,
                                       facecolor=_colour(src), alpha=0.6, lw=0))
            done = len(ranks) == n and n > 1
            ax.add_patch(Rectangle((x0 + j * cell, y0), cell, bar_h, fill=False,
                                   edgecolor="black" if (r, j) in fresh else "0.35",
                                   lw=2.2 if (r, j) in fresh else 0.6))
            ax.text(x0 + (j + 0.5) * cell, cy, _cell_label(ranks, n), ha="center", va="center",
                    fontsize=9 if done else (7.5 if n <= 4 else 6), fontweight="bold" if done else "normal")
            ax.text(x0 + (j + 0.5) * cell, y0 + bar_h + 0.02, str(j), ha="center", va="bottom", fontsize=5.5,
                    color="0.45")
        below = cy < -0.01
        ax.text(cx, y0 - 0.04 if below else y0 + bar_h + 0.16, f"rank {r}", ha="center",
                va="top" if below else "bottom", fontsize=8, color=_colour(r), fontweight="bold")
    if sends:
        # arrows run along the ring, between the bars, clockwise from each rank to the next
        delta = math.atan(0.5 * bar_w / radius) + math.radians(6)
        for r, chunk in sends.items():
            t0 = centres[r][2] - delta
            t1 = centres[(r + 1) % n][2] + delta
            if t1 > t0:
                t1 -= 2 * math.pi
            start = (radius * math.cos(t0), radius * math.sin(t0))
            end = (radius * math.cos(t1), radius * math.sin(t1))
            ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=11, lw=1.3,
                                         color=_colour(r), connectionstyle="arc3,rad=-0.35"))
            mid = (t0 + t1) / 2
            lr = radius + 0.3
            ax.text(lr * math.cos(mid), lr * math.sin(mid), f"chunk {chunk}", ha="center", va="center",
                    fontsize=6.5, bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor=_colour(r),
                                            lw=0.8))
    lim = radius + 0.75
    ax.set_xlim(-lim, lim)
    ax.set_ylim(-lim, lim)
    ax.set_aspect("equal")
    ax.axis("off")


def plot_ring_steps(world_size: int = 4):
    """Draw the ring all-reduce on ``world_size`` ranks (2 to 6), one panel per step.

    Each panel shows the ranks on a ring; each rank's tensor is a bar of ``world_size`` chunks (chunk index above
    the cell), coloured by the ranks whose data it holds ("a+b" = rank 0's plus rank 1's values of that chunk,
    "Σ" = the complete sum). Arrows are the messages of that step, labelled with the chunk they carry; cells with
    a thick outline changed in that step. The first panel is the start, then the world_size - 1 reduce-scatter
    steps (after which rank r holds the complete chunk r), then the world_size - 1 all-gather steps.
    Returns the Figure (one axes per panel, plus one for the legend).
    """
    import matplotlib.pyplot as plt

    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 2 <= world_size <= 6:
        raise ValueError(f"world_size must be an int from 2 to 6 for a readable diagram, got {world_size!r}")
    n = world_size
    states = ring_states(n)
    panels = len(states) + 1  # + legend
    cols = 4
    rows = math.ceil(panels / cols)
    radius = 1.45 if n <= 4 else 0.36 * n
    size = 3.4 if n <= 4 else 3.4 + 0.4 * (n - 4)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * size, rows * (size + 0.25)))
    axes = list(axes.flat)
    prev = None
    for ax, (title, holdings, sends) in zip(axes, states):
        fresh = set()
        if prev is not None:
            fresh = {(r, j) for r in range(n) for j in range(n) if holdings[r][j] != prev[r][j]}
            # an all-gather overwrite can leave the label unchanged only if it was already complete
            fresh |= {((r + 1) % n, c) for r, c in sends.items()}
        _draw_ring_state(ax, holdings, sends, n, fresh, radius)
        ax.set_title(title, fontsize=9)
        prev = holdings
    legend = axes[len(states)]
    legend.axis("off")
    lines = [
        "How to read it",
        "",
        "bar = one rank's tensor, cut into",
        f"{n} chunks (index above each cell)",
        "letters/stripes = whose data a cell holds",
        f"({', '.join(f'{_LETTERS[r]} = rank {r}' for r in range(n))};",
        f"\"a{_LETTERS[n - 1]}\" = rank 0's chunk + rank {n - 1}'s chunk)"
        if n <= 4 else "(stripes only; the number = how many ranks' data)",
        "\u03a3 = the complete sum of that chunk",
        "arrow = one message, carrying one chunk",
        "thick outline = changed in this step",
        "",
        f"each rank sends 2({n}-1) = {2 * (n - 1)} chunks of",
        f"1/{n} of the tensor: 2(N-1)/N of its size",
    ]
    legend.text(0.02, 0.98, "\n".join(lines), va="top", ha="left", fontsize=8.5, family="sans-serif",
                transform=legend.transAxes)
    for ax in axes[len(states) + 1:]:
        ax.axis("off")
    steps = f"{n - 1} step{'s' if n > 2 else ''}"
    fig.suptitle(f"Ring all-reduce on {n} ranks = reduce-scatter ({steps}) + all-gather ({steps})", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    return fig


# ----------------------------------------------------------------------------------------------------------------
# Measurements


def plot_traffic(per_rank: dict, nbytes: int):
    """Bytes each rank sent and received, one panel per scheme, in units of the tensor size ``nbytes`` (S).

    Args:
        per_rank: ``{scheme name: [(bytes sent, bytes received) for rank 0, 1, ...]}``, e.g. from ``CommCounter``
            summaries (``s.bytes_sent``, ``s.bytes_received``).
        nbytes: the size S of the tensor being all-reduced.

    A dashed line marks 2(N-1)/N·S, the least any all-reduce can make each rank send. Returns the Figure.
    """
    import matplotlib.pyplot as plt

    names = list(per_rank)
    fig, axes = plt.subplots(1, len(names), figsize=(3.4 * len(names) + 0.6, 3.3), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, name in zip(axes, names):
        rows = per_rank[name]
        n = len(rows)
        xs = range(n)
        sent = [s / nbytes for s, _ in rows]
        recv = [r / nbytes for _, r in rows]
        ax.bar([x - 0.2 for x in xs], sent, width=0.38, color="tab:blue", alpha=0.8, label="sent")
        ax.bar([x + 0.2 for x in xs], recv, width=0.38, color="tab:orange", alpha=0.8, label="received")
        if n > 1:
            ax.axhline(2 * (n - 1) / n, color="black", ls="--", lw=1, label=f"2(N-1)/N = {2 * (n - 1) / n:.2f}")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"rank {r}" for r in xs], fontsize=8)
        ax.set_title(f"{name} (N={n})", fontsize=10)
        ax.spines[["top", "right"]].set_visible(False)
        ax.legend(fontsize=7, loc="upper right")
    axes[0].set_ylabel("bytes / tensor size S")
    fig.tight_layout()
    return fig


def plot_bus_bandwidth(results: dict, p2p: float | None = None):
    """Time and bus bandwidth against message size, one line per implementation and world size.

    Args:
        results: ``{label: (world_size, sizes in bytes, times in seconds)}``.
        p2p: a point-to-point bandwidth in bytes/s to draw as the physical limit (optional).

    busbw = size / time * 2(N-1)/N (nccl-tests' definition), comparable across world sizes and with ``p2p``.
    Returns the Figure (two axes: time, bus bandwidth).
    """
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(10.5, 3.8))
    styles = ["-", "--", ":", "-."]
    for k, (label, (n, sizes, times)) in enumerate(results.items()):
        colour = _colour(k)
        ls = styles[(k // 10) % len(styles)]
        ax_t.plot(sizes, [t * 1e3 for t in times], marker="o", ms=4, ls=ls, color=colour, label=label)
        bus = [s / t * 2 * (n - 1) / n / 1e9 if t > 0 else float("nan") for s, t in zip(sizes, times)]
        ax_b.plot(sizes, bus, marker="o", ms=4, ls=ls, color=colour, label=label)
    if p2p:
        ax_b.axhline(p2p / 1e9, color="black", lw=1, ls="--", label=f"point-to-point {p2p / 1e9:.2f} GB/s")
    for ax in (ax_t, ax_b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tensor size (bytes)")
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time (ms)")
    ax_t.set_title("all-reduce time", fontsize=10)
    ax_b.set_ylabel("bus bandwidth (GB/s)")
    ax_b.set_title("busbw = size / time x 2(N-1)/N", fontsize=10)
    ax_b.legend(fontsize=7.5, loc="upper left")
    fig.tight_layout()
    return fig


def plot_measured_vs_predicted(measured: dict, predicted: dict, nbytes: int | None = None):
    """All-reduce time against the number of ranks: measured points and predicted (simulated) curves.

    Args:
        measured: ``{label: (world sizes, times in s)}`` drawn as markers (black, grey); may be empty.
        predicted: ``{label: (world sizes, times in s)}`` drawn as lines.
        nbytes: the tensor size, for the title.

    Both axes are logarithmic (base 2 for ranks). Returns the Figure (one axes).
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for k, (label, (ns, ts)) in enumerate(predicted.items()):
        ax.plot(ns, [t * 1e3 for t in ts], color=_colour(k), lw=1.6, label=label)
    markers, greys = "os^Dv", ["black", "0.5", "0.75"]
    for k, (label, (ns, ts)) in enumerate(measured.items()):
        ax.plot(ns, [t * 1e3 for t in ts], ls="none", marker=markers[k % len(markers)], ms=6, mfc="white",
                mew=1.5, color=greys[k % len(greys)], label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("number of ranks N")
    ax.set_ylabel("all-reduce time (ms)")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    if nbytes:
        size = f"{nbytes / 2**30:g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:g} MiB"
        what = "measured (markers) vs simulated (lines)" if measured else "simulated"
        ax.set_title(f"all-reduce of {size}: {what}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig
