"""Plots of notebook 03 (data parallelism).

* ``plot_dp_vs_ddp()``: who sends what to whom in DataParallel (a master) and DistributedDataParallel (peers).
* ``plot_dp_memory(dp_report, ddp_reports)``: what each device holds, stacked by category, DP next to DDP; and how
  long each was busy.
* ``plot_bucket_layout(buckets, cap_bytes, measured=None)``: parameters in reverse registration order, grouped into
  gradient buckets, with the cap; optionally the all-reduce sizes actually measured.
* ``plot_step_sweep(sizes_mb, series)``: time per step against bucket size.
* ``plot_loss_curves(curves)``: training loss per step for several runs (synchronous vs stale updates).
* ``plot_async_training(staleness, curves)``: how stale each worker's gradients were when a parameter server
  applied them, next to the loss against the number of gradients computed.

Timelines (``plot_timeline``) are drawn by ``labsupport.plots``.
"""

from __future__ import annotations

from ...plots.timeline import PALETTE as _PALETTE

__all__ = [
    "plot_dp_vs_ddp",
    "plot_dp_memory",
    "plot_bucket_layout",
    "plot_step_sweep",
    "plot_loss_curves",
    "plot_async_training",
]


def _plt():
    import matplotlib.pyplot as plt

    return plt


def plot_dp_vs_ddp(num_devices: int = 4):
    """Diagram: DataParallel (one process, a master device that scatters, gathers and reduces) next to
    DistributedDataParallel (one process per device, gradients averaged by an all-reduce among peers)."""
    import math

    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax in (left, right):
        ax.set_xlim(0, 10)
        ax.set_ylim(0, 8)
        ax.axis("off")

    def box(ax, x, y, text, colour, w=1.9, h=1.0, weight="normal"):
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.05", fc=colour, ec="black",
                                    lw=1))
        ax.text(x, y, text, ha="center", va="center", fontsize=8.5, weight=weight)

    def arrow(ax, a, b, text="", colour="black", rad=0.0, offset=(0, 0)):
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=12, color=colour, lw=1.3,
                                     connectionstyle=f"arc3,rad={rad}"))
        if text:
            ax.text((a[0] + b[0]) / 2 + offset[0], (a[1] + b[1]) / 2 + offset[1], text, fontsize=7.5, color=colour,
                    ha="center", va="center")

    # DataParallel
    left.set_title("DataParallel: one process, threads, a master device", fontsize=10)
    left.add_patch(FancyBboxPatch((0.2, 0.3), 9.6, 7.2, boxstyle="round,pad=0.1", fc="#F7F7F7", ec="#999999",
                                  ls="--"))
    left.text(0.5, 7.2, "one Python process (one GIL), one thread per device", fontsize=8, color="#555555")
    box(left, 5, 5.6, "device 0 (master)\nwhole batch, loss,\nsum of gradients,\noptimizer", "#F6C85F", w=3.0,
        h=1.7, weight="bold")
    others = num_devices - 1
    xs = [1.7 + i * (6.6 / max(1, others - 1)) for i in range(others)] if others > 1 else [5.0]
    for i, x in enumerate(xs):
        box(left, x, 1.6, f"device {i + 1}\nreplica", "#9DD9D2")
        arrow(left, (5 - 0.6 + 0.4 * i, 4.75), (x - 0.25, 2.15), "weights,\ninput chunk" if i == 0 else "",
              "#1F77B4", offset=(-0.9, 0.1))
        arrow(left, (x + 0.25, 2.15), (5 - 0.4 + 0.4 * i + 0.2, 4.75), "outputs,\ngradients" if i == others - 1 else "",
              "#D62728", offset=(0.9, 0.1))
    left.text(5, 0.55, "every step: copy weights out, scatter inputs, gather outputs,\nreduce gradients, update: "
              "all through device 0", ha="center", fontsize=8)

    # DistributedDataParallel
    right.set_title("DistributedDataParallel: one process per device, peers", fontsize=10)
    cx, cy, r = 5, 4.1, 2.5
    pos = []
    for i in range(num_devices):
        a = math.pi / 2 - 2 * math.pi * i / num_devices
        pos.append((cx + r * math.cos(a), cy + r * math.sin(a)))
    for i, (x, y) in enumerate(pos):
        right.add_patch(FancyBboxPatch((x - 1.15, y - 0.62), 2.3, 1.24, boxstyle="round,pad=0.05", fc="#F7F7F7",
                                       ec="#999999", ls="--"))
        box(right, x, y, f"process {i}\ndevice {i}: replica,\nits own data shard", "#9DD9D2", w=2.1, h=1.05)
    for i in range(num_devices):
        a, b = pos[i], pos[(i + 1) % num_devices]
        da = ((b[0] - a[0]), (b[1] - a[1]))
        norm = math.hypot(*da)
        u = (da[0] / norm, da[1] / norm)
        arrow(right, (a[0] + 0.95 * u[0], a[1] + 0.75 * u[1]), (b[0] - 0.95 * u[0], b[1] - 0.75 * u[1]), "",
              "#D62728", rad=-0.15)
    right.text(cx, cy, "all-reduce of\ngradient buckets\n(ring, notebook 02)\nduring backward", ha="center",
               va="center", fontsize=8, color="#D62728")
    right.text(5, 0.3, "each rank: own data loader, own loss, own optimizer step;\nonly averaged gradients travel",
               ha="center", fontsize=8)
    fig.tight_layout()
    return fig


_CATEGORY_COLOURS = {
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "activations": "#55A868",
    "outputs": "#C44E52",
    "input batch": "#8172B3",
    "communication buffers": "#937860",
    "optimizer state": "#DA8BC3",
}


def plot_dp_memory(dp_report, ddp_reports=None, unit: str = "MiB"):
    """Stacked bars of what each device holds (and, below, how long each was busy), DP next to DDP.

    ``dp_report``: a ``MemoryReport`` (``dp.py``); ``ddp_reports``: the per-rank dicts that
    ``ddp_rank_report`` returned (optional).
    """
    plt = _plt()
    div = {"MiB": 2**20, "KiB": 2**10, "B": 1}[unit]
    panels = [("DataParallel (one process)", dp_report.bytes, dp_report.seconds, "device")]
    if ddp_reports:
        panels.append(("DistributedDataParallel (one process per device)", [r["bytes"] for r in ddp_reports],
                       [r["seconds"] for r in ddp_reports], "rank"))
    fig, axes = plt.subplots(2, len(panels), figsize=(5.6 * len(panels), 6.4), squeeze=False,
                             gridspec_kw={"height_ratios": [2.2, 1]})
    top = max(sum(b.values()) for _, bs, _, _ in panels for b in bs) / div
    slow = max(sum(s.values()) for _, _, ss, _ in panels for s in ss)
    categories = list(_CATEGORY_COLOURS)
    for col, (title, per_device, seconds, who) in enumerate(panels):
        ax = axes[0, col]
        bottom = [0.0] * len(per_device)
        for cat in categories:
            vals = [b.get(cat, 0) / div for b in per_device]
            if any(vals):
                ax.bar(range(len(per_device)), vals, bottom=bottom, color=_CATEGORY_COLOURS[cat], label=cat,
                       edgecolor="white", linewidth=0.5)
                bottom = [a + b for a, b in zip(bottom, vals)]
        for i, total in enumerate(bottom):
            ax.text(i, total + top * 0.01, f"{total:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(per_device)))
        ax.set_xticklabels([f"{who} {i}" for i in range(len(per_device))])
        ax.set_ylim(0, top * 1.12)
        ax.set_ylabel(f"held during a step ({unit})")
        ax.set_title(title, fontsize=10)
        ax = axes[1, col]
        phases = []
        for s in seconds:
            for k in s:
                if k not in phases:
                    phases.append(k)
        bottom = [0.0] * len(seconds)
        phase_colours = {"forward": "#4C72B0", "backward": "#DD8452", "master only": "#C44E52",
                         "optimizer": "#55A868"}
        for k in phases:
            vals = [1e3 * s.get(k, 0.0) for s in seconds]
            if any(vals):
                ax.bar(range(len(seconds)), vals, bottom=bottom, label=k, color=phase_colours.get(k, "#8C8C8C"),
                       edgecolor="white", linewidth=0.5)
                bottom = [a + b for a, b in zip(bottom, vals)]
        ax.set_xticks(range(len(seconds)))
        ax.set_xticklabels([f"{who} {i}" for i in range(len(seconds))])
        ax.set_ylim(0, 1e3 * slow * 1.1)
        ax.set_ylabel("busy (ms)")
        ax.legend(fontsize=7, loc="upper right", frameon=False)
    axes[0, -1].legend(fontsize=7, loc="upper right", frameon=False)
    fig.tight_layout()
    return fig


def plot_bucket_layout(buckets, cap_bytes: float, measured=None, title: str | None = None):
    """Parameters in the order their gradients are expected (reverse registration), grouped into buckets.

    ``buckets``: a list of buckets, each a list of ``(name, nbytes)`` (as ``autograder.checks.data_parallel.expected_buckets``
    or your own wrapper gives them). ``measured``: optional list of all-reduce sizes in bytes seen in one step (one
    per call, in the order issued), drawn as a second row so the two can be compared.
    """
    plt = _plt()
    rows = 2 if measured is not None else 1
    fig, ax = plt.subplots(figsize=(11, 1.2 + 1.0 * rows))
    x = 0
    colours = ("#4C72B0", "#DD8452")
    y = rows - 1
    for i, bucket in enumerate(buckets):
        size = sum(n for _, n in bucket)
        ax.add_patch(plt.Rectangle((x, y + 0.05), size, 0.9, fc="none", ec="black", lw=1.5))
        inner = x
        for name, n in bucket:
            ax.add_patch(plt.Rectangle((inner, y + 0.15), n, 0.7, fc=colours[i % 2], ec="white", lw=0.8, alpha=0.85))
            inner += n
        ax.text(x + size / 2, y + 0.5, f"bucket {i}\n{size} B" if size > 0.05 * _total(buckets) else str(i),
                ha="center", va="center", fontsize=7, color="white", weight="bold")
        ax.text(x, y + 1.0, ", ".join(name for name, _ in bucket), fontsize=6, rotation=20, va="bottom", ha="left")
        x += size
    total = x
    # a ruler as long as the cap, so "this bucket is full" can be seen
    ax.annotate("", xy=(0, -0.3), xytext=(min(cap_bytes, total), -0.3),
                arrowprops={"arrowstyle": "|-|", "color": "#555555", "lw": 1})
    ax.text(min(cap_bytes, total) / 2, -0.25, f"cap {cap_bytes:.0f} B", ha="center", va="bottom", fontsize=7,
            color="#555555")
    if measured is not None:
        x = 0
        for j, n in enumerate(measured):
            ax.add_patch(plt.Rectangle((x, 0.1), n, 0.8, fc="#C44E52", ec="white", lw=1, alpha=0.85))
            if n > 0.04 * max(total, 1):
                ax.text(x + n / 2, 0.5, f"call {j}\n{n} B", ha="center", va="center", fontsize=7, color="white")
            x += n
        ax.text(-0.01 * total, 0.5, "all-reduces\nmeasured", ha="right", va="center", fontsize=8)
        ax.text(-0.01 * total, rows - 0.5, "buckets\nexpected", ha="right", va="center", fontsize=8)
    ax.set_xlim(0, max(total, x) * 1.01 or 1)
    ax.set_ylim(-0.45, rows + 0.9)
    ax.set_yticks([])
    ax.set_xlabel(f"bytes, in the order gradients become ready (reverse registration); cap = {cap_bytes:.0f} B "
                  "per bucket")
    for spine in ("top", "right", "left"):
        ax.spines[spine].set_visible(False)
    ax.set_title(title or f"{len(buckets)} buckets", fontsize=10, loc="left")
    fig.tight_layout()
    return fig


def _total(buckets) -> int:
    return sum(n for b in buckets for _, n in b)


def plot_step_sweep(sizes_mb, series: dict, title: str = "time per training step vs bucket size"):
    """Lines of seconds per step against bucket cap (MB, log scale); ``series``: label -> list of seconds (one per
    size; ``None`` for a missing point) or a single number drawn as a horizontal reference line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, values) in enumerate(series.items()):
        colour = _PALETTE[i % len(_PALETTE)]
        if isinstance(values, (int, float)):
            ax.axhline(1e3 * values, ls="--", color=colour, label=label)
            continue
        pts = [(s, 1e3 * v) for s, v in zip(sizes_mb, values) if v is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colour, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("bucket cap (MB)")
    ax.set_ylabel("ms per step")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_loss_curves(curves: dict, title: str = "training loss", log: bool = True):
    """One line per run: ``curves`` maps a label to a list of losses (one per update)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, losses) in enumerate(curves.items()):
        ax.plot(range(len(losses)), losses, color=_PALETTE[i % len(_PALETTE)] if i else "black", label=label,
                lw=1.6 if i == 0 else 1.2)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("update")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_async_training(staleness: dict, curves: dict, title: str | None = None, clip: float = 100.0):
    """Two panels. Left: for each worker (``staleness`` maps a label to the staleness of each of its gradients that
    was applied), how many gradients were 0, 1, 2, ... updates old. Right: the loss against gradients computed,
    one line per run (``curves`` maps a label to one loss per gradient); the y axis stops at ``clip`` times the
    starting loss, and a run that goes past it is marked as diverging."""
    plt = _plt()
    fig, (ax_s, ax_l) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1, 1.3]})
    top = max((max(v) for v in staleness.values() if v), default=0)
    width = 0.8 / max(len(staleness), 1)
    for i, (label, values) in enumerate(staleness.items()):
        counts = [values.count(k) for k in range(top + 1)]
        ax_s.bar([k - 0.4 + width * (i + 0.5) for k in range(top + 1)], counts, width=width,
                 color=_PALETTE[i % len(_PALETTE)], label=f"{label} ({len(values)} applied)")
    ax_s.set_xticks(range(top + 1))
    ax_s.set_xlabel("staleness (updates applied while the gradient was computed)")
    ax_s.set_ylabel("gradients")
    ax_s.legend(fontsize=8, frameon=False)
    ax_s.set_title("how old each applied gradient was", fontsize=10)
    start = min((c[0] for c in curves.values() if c), default=1.0)
    limit = clip * start
    for i, (label, losses) in enumerate(curves.items()):
        diverges = any(not v <= limit for v in losses)   # NaN counts as diverging
        shown = [v if v <= limit else float("nan") for v in losses]
        ax_l.plot(range(len(losses)), shown, color=_PALETTE[i % len(_PALETTE)] if i else "black", lw=1.6 if i == 0
                  else 1.2, label=label + (" (diverges)" if diverges else ""))
    ax_l.set_yscale("log")
    ax_l.set_ylim(top=limit)
    ax_l.set_xlabel("gradients computed")
    ax_l.set_ylabel("loss")
    ax_l.set_title("loss for the same number of gradients", fontsize=10)
    ax_l.grid(alpha=0.3)
    ax_l.legend(fontsize=8)
    for ax in (ax_s, ax_l):
        ax.spines[["top", "right"]].set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
