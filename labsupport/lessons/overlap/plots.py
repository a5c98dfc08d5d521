"""Figures of notebook 10: schedules with W, the blocks of causal attention per rank, the ring's overlap."""

from __future__ import annotations

__all__ = ["plot_schedules_w", "plot_attention_blocks", "plot_ring_steps"]

_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def _plt():
    import matplotlib.pyplot as plt

    return plt


def plot_schedules_w(runs: dict, unit: str = "time (simulated units)"):
    """Gantt charts of ``title -> busy`` (per stage ``(start, end, op, mb)``, as a simulator returns, or
    ``Timeline`` events named ``"F 3"``), F blue, B orange, W green, each panel with its bubble."""
    plt = _plt()
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, sum(0.5 * len(r) + 0.9 for r in runs.values())),
                             squeeze=False)
    longest = 0.0
    for ax, (title, busy) in zip(axes[:, 0], runs.items()):
        spans = []
        for stage in busy:
            items = []
            for item in stage:
                if isinstance(item, (tuple, list)):
                    items.append(tuple(item))
                else:
                    op, mb = item.name.split()
                    items.append((item.start, item.end, op, int(mb)))
            spans.append(items)
        measured = any(not isinstance(i, (tuple, list)) for st in busy for i in st)
        t0 = min((s[0] for st in spans for s in st), default=0.0)
        scale = 1e3 if measured else 1.0
        end = max((s[1] for st in spans for s in st), default=1.0)
        work = 0.0
        for s, items in enumerate(spans):
            y = len(spans) - 1 - s
            for a, b, op, mb in items:
                work += b - a
                ax.broken_barh([((a - t0) * scale, (b - a) * scale)], (y + 0.1, 0.8), facecolor=_COLOURS[op],
                               edgecolor="white", linewidth=0.6)
                if (b - a) > 0.015 * (end - t0):
                    ax.text((a - t0 + (b - a) / 2) * scale, y + 0.5, str(mb), ha="center", va="center",
                            fontsize=7, color="white")
        bubble = 1 - work / (len(spans) * (end - t0)) if end > t0 else 0.0
        ax.set_yticks([len(spans) - 1 - s + 0.5 for s in range(len(spans))])
        ax.set_yticklabels([f"stage {s}" for s in range(len(spans))], fontsize=8)
        ax.set_title(f"{title}: bubble {100 * bubble:.0f}%", fontsize=9, loc="left")
        ax.set_xlabel("ms (measured)" if measured else unit, fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        longest = max(longest, (end - t0) * scale)
    for ax in axes[:, 0]:
        ax.set_xlim(0, longest * 1.01)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    axes[0, 0].legend(handles, ["F: forward", "B: input gradient", "W: weight gradient"], fontsize=7,
                      loc="upper right", ncol=3)
    fig.tight_layout()
    return fig


def plot_attention_blocks(world: int):
    """The causal block matrix (2N chunks of queries × 2N chunks of keys; the upper triangle is masked), each block
    coloured by the rank that computes it: contiguous split (rank r holds chunks 2r, 2r+1) and zig-zag split (rank
    r holds chunks r and 2N−1−r). The number per rank is written beside each row group."""
    import numpy as np

    plt = _plt()
    n = 2 * world
    owners = {"contiguous": [c // 2 for c in range(n)],
              "zig-zag": [min(c, n - 1 - c) for c in range(n)]}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.4))
    cmap = plt.get_cmap("tab10")
    for ax, (name, owner) in zip(axes, owners.items()):
        img = np.ones((n, n, 3))
        counts = [0] * world
        for i in range(n):
            for j in range(i + 1):
                img[i, j] = cmap(owner[i])[:3]
                counts[owner[i]] += 1
        ax.imshow(img, origin="upper")
        for i in range(n):
            for j in range(n):
                if j > i:
                    ax.text(j, i, "·", ha="center", va="center", color="0.7", fontsize=8)
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        ax.set_yticklabels([f"{i} (rank {owner[i]})" for i in range(n)], fontsize=7)
        ax.set_xlabel("key chunk", fontsize=8)
        ax.set_ylabel("query chunk (held by)", fontsize=8)
        ax.set_title(f"{name}: blocks per rank {counts}", fontsize=9)
    fig.tight_layout()
    return fig


def plot_ring_steps(world: int, step_time: float = 1.0, transfer_time: float = 0.6):
    """allgather_matmul on ``world`` ranks as a picture, blocking against overlapped: each rank's products
    (one per chunk) and the transfers of the ring, times in units of one product."""
    plt = _plt()
    fig, axes = plt.subplots(2, 1, figsize=(10, 1.0 + 0.9 * world), sharex=True)
    for ax, overlapped in zip(axes, (False, True)):
        for r in range(world):
            y = world - 1 - r
            t = 0.0
            for step in range(world):
                src = (r - step) % world
                if overlapped:            # the next chunk's transfer starts with this product
                    if step < world - 1:
                        ax.broken_barh([(t, transfer_time)], (y + 0.05, 0.3), facecolor="#C44E52", alpha=0.8)
                    start, t = t, t + max(step_time, transfer_time)
                else:                     # this chunk's transfer first, then its product
                    if step > 0:
                        ax.broken_barh([(t, transfer_time)], (y + 0.05, 0.3), facecolor="#C44E52", alpha=0.8)
                        t += transfer_time
                    start, t = t, t + step_time
                ax.broken_barh([(start, step_time)], (y + 0.45, 0.45), facecolor="#4C72B0")
                ax.text(start + step_time / 2, y + 0.67, f"x{src}·Wᵀ", ha="center", va="center", fontsize=7,
                        color="white")
        ax.set_yticks([world - 1 - r + 0.5 for r in range(world)])
        ax.set_yticklabels([f"rank {r}" for r in range(world)], fontsize=8)
        ax.set_title("each transfer posted before the product of the chunk already here: it runs underneath"
                     if overlapped else "receive, then multiply: every transfer waits in the open", fontsize=9,
                     loc="left")
    axes[1].set_xlabel("time (one product = 1)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#4C72B0", "#C44E52")]
    axes[0].legend(handles, ["matmul of one chunk", "transfer of one chunk"], fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig
