"""Figures of notebook 08 (matplotlib). Each function returns the figure."""

from __future__ import annotations

__all__ = ["plot_parallel_groups", "plot_loss_curves", "plot_all_to_all", "plot_memory_plan", "plot_ring_attention"]

_TP, _DP, _PP = "#4C72B0", "#DD8452", "#55A868"


def _plt():
    import matplotlib.pyplot as plt

    return plt


def _position(groups: dict, world_size: int) -> dict:
    """Each rank's (pp, dp, tp) coordinates, read off the groups it is given: its index inside its pipeline
    group, its data-parallel group and its tensor-parallel group."""
    where = {}
    for dim in ("pp", "dp", "tp"):
        for group in groups[dim]:
            for index, rank in enumerate(group):
                where.setdefault(rank, {})[dim] = index
    missing = [r for r in range(world_size) if len(where.get(r, {})) != 3]
    if missing:
        raise ValueError(f"ranks {missing} are missing from some group: every rank belongs to one group per dimension")
    return where


def plot_parallel_groups(groups: dict, world_size: int, title: str | None = None):
    """Draw ``world_size`` ranks as a grid: one panel per pipeline stage, data-parallel replicas as rows,
    tensor-parallel ranks as columns. Positions come from ``groups`` (``{"tp": [...], "dp": [...], "pp": [...]}``,
    e.g. what ``parallel_groups`` returns); tensor-parallel groups are outlined in blue, data-parallel groups joined
    by orange lines, pipeline groups by green arrows between the panels."""
    plt = _plt()
    where = _position(groups, world_size)
    pp = max(w["pp"] for w in where.values()) + 1
    dp = max(w["dp"] for w in where.values()) + 1
    tp = max(w["tp"] for w in where.values()) + 1
    gap = 1.2
    # A pipeline arrow rises from its rank, runs right above the row and drops onto the next stage's rank; each
    # tensor-parallel column runs at its own height, so the arrows neither cross a circle nor lie on each other.
    rise = [0.42 + 0.11 * t for t in range(tp)]
    row = max(1.0, rise[-1] + 0.5)          # distance between data-parallel rows: room for the highest arrow
    top = rise[-1] + 0.35
    xy = {r: (w["pp"] * (tp + gap) + w["tp"], -w["dp"] * row) for r, w in where.items()}
    height = (dp - 1) * row + top + 0.9
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * pp * (tp + gap), 0.6 + 1.0 * height))
    for s in range(pp):
        x0 = s * (tp + gap) - 0.55
        ax.add_patch(plt.Rectangle((x0, -(dp - 1) * row - 0.45), tp + 0.1, (dp - 1) * row + top + 0.25, fill=False,
                                   ls=":", ec="grey"))
        ax.text(x0 + (tp + 0.1) / 2, top + 0.05, f"pipeline stage {s}", ha="center", va="bottom", fontsize=9)
    for group in groups["tp"]:
        xs = [xy[r][0] for r in group]
        ax.add_patch(plt.Rectangle((min(xs) - 0.42, xy[group[0]][1] - 0.32), max(xs) - min(xs) + 0.84, 0.64,
                                   fill=False, ec=_TP, lw=2))
    for group in groups["dp"]:
        ax.plot([xy[r][0] for r in group], [xy[r][1] for r in group], color=_DP, lw=2, zorder=1)
    for group in groups["pp"]:
        for a, b in zip(group, group[1:]):
            (xa, ya), (xb, yb) = xy[a], xy[b]
            y = max(ya, yb) + rise[where[a]["tp"]]
            # off the circles' centre line, where a data-parallel line may run
            ax.plot([xa + 0.13, xa + 0.13, xb - 0.13], [ya + 0.22, y, y], color=_PP, lw=1.2, zorder=1)
            ax.annotate("", xy=(xb - 0.13, yb + 0.23), xytext=(xb - 0.13, y),
                        arrowprops=dict(arrowstyle="->", color=_PP, lw=1.2, shrinkA=0, shrinkB=0))
    for r, (x, y) in xy.items():
        ax.add_patch(plt.Circle((x, y), 0.26, color="white", ec="black", zorder=2))
        ax.text(x, y, str(r), ha="center", va="center", fontsize=10, zorder=3)
    ax.plot([], [], color=_TP, lw=2, label=f"tensor-parallel group ({tp} ranks)")
    ax.plot([], [], color=_DP, lw=2, label=f"data-parallel group ({dp} ranks)")
    ax.plot([], [], color=_PP, lw=1.2, label=f"pipeline group ({pp} ranks)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=3, fontsize=8, frameon=False)
    ax.set_xlim(-0.8, pp * (tp + gap) - gap + 0.3)
    ax.set_ylim(-(dp - 1) * row - 0.6, top + 0.45)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title or f"{world_size} ranks: tp={tp}, dp={dp}, pp={pp} (rows: data-parallel replicas)", fontsize=10)
    fig.tight_layout()
    return fig


def plot_loss_curves(curves: dict, title: str = "training loss"):
    """``curves``: label → list of losses per step. Later curves are drawn dashed on top of earlier ones, so
    curves that agree show as one line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    styles = ["-", "--", ":", "-."]
    for i, (label, losses) in enumerate(curves.items()):
        ax.plot(range(1, len(losses) + 1), losses, styles[i % len(styles)], lw=2.5 if i == 0 else 1.6,
                marker="o" if i == 0 else None, ms=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_all_to_all(matrix, title: str = "bytes sent by all-to-all", unit: str = "KiB"):
    """``matrix[i][j]``: bytes rank i sent to rank j in one all-to-all (a heat map with the numbers written in)."""
    plt = _plt()
    scale = {"B": 1, "KiB": 1024, "MiB": 2**20}[unit]
    n = len(matrix)
    fig, ax = plt.subplots(figsize=(1.2 + 0.8 * n, 1.0 + 0.7 * n))
    data = [[v / scale for v in row] for row in matrix]
    ax.imshow(data, cmap="Blues")
    top = max(max(row) for row in data) or 1
    for i in range(n):
        for j in range(n):
            dark = data[i][j] > 0.6 * top
            ax.text(j, i, f"{data[i][j]:.3g}", ha="center", va="center", fontsize=8,
                    color="white" if dark else "black", fontstyle="italic" if i == j else "normal")
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xlabel("to rank")
    ax.set_ylabel("from rank")
    ax.set_title(f"{title} ({unit}; the diagonal, in italics, stays on its rank)", fontsize=9)
    fig.tight_layout()
    return fig


def plot_memory_plan(rows, memory_bytes: float, title: str = "memory per GPU", xmax_gb: float | None = None):
    """``rows``: list of (label, {"model_state": bytes, "activations": bytes}); stacked horizontal bars in GB with
    the GPU's memory as a dashed line. Bars longer than ``xmax_gb`` (default: twice the memory) are cut, with their
    total written at the edge."""
    plt = _plt()
    xmax = xmax_gb or 2 * memory_bytes / 1e9
    height = max(1.8, 1.0 + 0.22 * len(rows))  # inches; a plan of one or two rows still needs room for the legend
    fig, ax = plt.subplots(figsize=(7.5, height))
    labels = [label for label, _ in rows]
    state = [r["model_state"] / 1e9 for _, r in rows]
    act = [r["activations"] / 1e9 for _, r in rows]
    ys = list(range(len(rows)))
    ax.barh(ys, state, color="#4C72B0", label="model state (ZeRO's 2Ψ + 2Ψ + KΨ, sharded)")
    ax.barh(ys, act, left=state, color="#DD8452", label="activations (Korthikanti et al. 2022)")
    for y, s_, a_ in zip(ys, state, act):
        if s_ + a_ > xmax:
            ax.text(xmax, y, f"{s_ + a_:.0f} GB ", ha="right", va="center", fontsize=7, color="white")
    ax.axvline(memory_bytes / 1e9, color="black", ls="--", lw=1)
    ax.text(memory_bytes / 1e9, len(rows) - 0.5, f" {memory_bytes / 1e9:.0f} GB", fontsize=8, va="top")
    ax.set_xlim(0, xmax)
    ax.set_yticks(ys)
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("GB per GPU")
    ax.set_title(title, fontsize=10)
    fig.legend(fontsize=7, loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.3 / height, 1, 1))  # the legend keeps 0.3 inches below the axes
    return fig


def plot_ring_attention(blocks, title: str | None = None):
    """``blocks[r]``: for rank r, one ``(block, used)`` per ring step, as ``ring_attention_on_ranks`` reports it.
    One row per rank, one column per step; each cell names the k/v block the rank held, coloured by that block,
    hatched and pale where it was all masked (causal attention: a later block) and skipped."""
    plt = _plt()
    ranks, steps = len(blocks), max(len(b) for b in blocks)
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(1.4 + 1.1 * steps, 0.9 + 0.55 * ranks))
    for r, row in enumerate(blocks):
        for s, (block, used) in enumerate(row):
            ax.add_patch(plt.Rectangle((s, r), 0.94, 0.86, color=colours(block % 10), alpha=0.85 if used else 0.2,
                                       hatch=None if used else "//", ec="grey" if not used else None))
            ax.text(s + 0.47, r + 0.43, f"k,v {block}" if used else f"k,v {block}\nmasked", ha="center",
                    va="center", fontsize=8, color="white" if used else "black")
    ax.set_xlim(-0.1, steps)
    ax.set_ylim(ranks, -0.1)
    ax.set_xticks([s + 0.47 for s in range(steps)])
    ax.set_xticklabels([f"step {s}" for s in range(steps)], fontsize=8)
    ax.set_yticks([r + 0.43 for r in range(ranks)])
    ax.set_yticklabels([f"rank {r} (queries {r})" for r in range(ranks)], fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    work = [sum(used for _, used in row) for row in blocks]
    ax.set_title(title or f"ring attention: whose k/v block each rank holds, step by step\n"
                 f"(blocks computed per rank: {work})", fontsize=9)
    fig.tight_layout()
    return fig
