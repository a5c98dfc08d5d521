"""Notebook 01 (collectives): what each collective does, drawn, and the timing of a collective against the built-in.

* ``plot_collective(name, world_size=4, root=0)``: what every rank holds before and after one collective.
* ``plot_all_collectives(world_size=4)``: the eight collectives on one page.
* ``plot_comm_counts(measured, expected=None)``: messages (or bytes) each rank sent, per collective, against the
  count the simple algorithm predicts.

Notation in the collective diagrams: rank ``r``'s tensor is a letter (``a`` for rank 0, ``b`` for rank 1, ...);
when a rank holds ``world_size`` chunks, chunk ``j`` of rank 0 is ``a0``, ``a1``, ... A cell's colour is the rank
the data came from; a striped cell is a sum of the ranks whose colours it shows.

Example::

    from labsupport.lessons import collectives as lesson
    lesson.plot_collective("reduce_scatter", world_size=4)
"""

from __future__ import annotations

__all__ = ["plot_collective", "plot_all_collectives", "plot_comm_counts", "time_all_reduce", "COLLECTIVE_NAMES"]

#: The eight collectives, in the order notebook 01 teaches them.
COLLECTIVE_NAMES = (
    "broadcast",
    "reduce",
    "all_reduce",
    "gather",
    "all_gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
)

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _colour(rank: int):
    import matplotlib

    return matplotlib.colormaps["tab10"](rank % 10)


# ----------------------------------------------------------------------------------------------------------------
# What each rank holds: a list of cells per rank, or None (the call returns None on that rank).
# A cell is (label, contributing ranks, style) with style "data", "old" (about to be overwritten) or "empty".


def _sum_label(parts: list[str]) -> str:
    return "+".join(parts) if len(parts) <= 4 else f"{parts[0]}+...+{parts[-1]}"


def _states(name: str, n: int, root: int):
    """(call text, what it means, before, after) for collective ``name`` on ``n`` ranks."""
    x = [_LETTERS[r] for r in range(n)]
    everyone = tuple(range(n))
    own = [[(x[r], (r,), "data")] for r in range(n)]
    chunks = [[(f"{x[r]}{j}", (r,), "data") for j in range(n)] for r in range(n)]
    total = _sum_label(x)
    if name == "broadcast":
        before = [[(x[r], (r,), "data" if r == root else "old")] for r in range(n)]
        after = [[(x[root], (root,), "data")] for r in range(n)]
        return f"broadcast(x, src={root})", f"rank {root}'s tensor is copied into every rank's tensor", before, after
    if name == "reduce":
        after = [[(total, everyone, "data")] if r == root else own[r] for r in range(n)]
        return f"reduce(x, dst={root})", f"the sum lands in rank {root}'s tensor; the others keep theirs", own, after
    if name == "all_reduce":
        after = [[(total, everyone, "data")] for r in range(n)]
        return "all_reduce(x)", "every rank's tensor becomes the sum", own, after
    if name == "gather":
        after = [[(x[i], (i,), "data") for i in range(n)] if r == root else None for r in range(n)]
        return f"gather(x, dst={root})", f"rank {root} gets the list of all tensors, the others None", own, after
    if name == "all_gather":
        after = [[(x[i], (i,), "data") for i in range(n)] for r in range(n)]
        return "all_gather(x)", "every rank gets the list of all tensors", own, after
    if name == "scatter":
        before = [chunks[root] if r == root else [("out", (), "empty")] for r in range(n)]
        after = [[(f"{x[root]}{r}", (root,), "data")] for r in range(n)]
        return (
            f"scatter(out, chunks, src={root})",
            f"chunk r of rank {root} goes to rank r",
            before,
            after,
        )
    if name == "reduce_scatter":
        after = [[(_sum_label([f"{x[i]}{r}" for i in range(n)]), everyone, "data")] for r in range(n)]
        return "reduce_scatter(chunks)", "rank r gets the sum of everyone's chunk r", chunks, after
    if name == "all_to_all":
        after = [[(f"{x[i]}{r}", (i,), "data") for i in range(n)] for r in range(n)]
        return "all_to_all(chunks)", "chunk j of rank i goes to rank j, as item i (a transpose)", chunks, after
    raise ValueError(f"unknown collective {name!r}; choose one of {', '.join(COLLECTIVE_NAMES)}")


def _cell_width(label: str) -> float:
    return max(1.0, 0.2 * len(label) + 0.4)


_LABEL_UNITS = 1.5  # room left of the cells for "rank N"


def _draw_ranks(ax, state, n: int, width: float, fontsize: float = 9) -> None:
    from matplotlib.patches import Rectangle

    for r in range(n):
        y = n - 1 - r
        ax.text(-0.25, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=fontsize)
        cells = state[r]
        if cells is None:
            ax.text(0.05, y + 0.4, "None", ha="left", va="center", fontsize=fontsize, style="italic", color="0.4")
            continue
        xpos = 0.0
        for label, ranks, style in cells:
            w = _cell_width(label)
            if style == "empty":
                ax.add_patch(Rectangle((xpos, y), w, 0.8, fill=False, linestyle="--", edgecolor="0.5"))
                ax.text(xpos + w / 2, y + 0.4, label, ha="center", va="center", fontsize=fontsize, color="0.5")
            else:
                alpha = 0.15 if style == "old" else 0.55
                stripe = w / max(1, len(ranks))
                for k, src in enumerate(ranks):
                    ax.add_patch(
                        Rectangle((xpos + k * stripe, y), stripe, 0.8, facecolor=_colour(src), alpha=alpha, lw=0)
                    )
                ax.add_patch(Rectangle((xpos, y), w, 0.8, fill=False, edgecolor="0.25", lw=0.8))
                ax.text(
                    xpos + w / 2,
                    y + 0.4,
                    label,
                    ha="center",
                    va="center",
                    fontsize=fontsize,
                    color="0.55" if style == "old" else "black",
                )
            xpos += w + 0.08
    ax.set_xlim(-_LABEL_UNITS, width)
    ax.set_ylim(-0.1, n)
    ax.axis("off")


def _row_width(state) -> float:
    return max((sum(_cell_width(c[0]) + 0.08 for c in cells) for cells in state if cells), default=1.0)


def _max_width(names, n: int, root: int) -> float:
    return max(max(_row_width(st[2]), _row_width(st[3])) for st in (_states(nm, n, root) for nm in names))


class _Inches:
    """Place axes by inches, so one data unit has the same size in every panel (labels then fit their cells)."""

    def __init__(self, fig, width: float, height: float):
        self.fig, self.w, self.h = fig, width, height

    def axes(self, left: float, top: float, width: float, height: float):
        return self.fig.add_axes([left / self.w, 1 - (top + height) / self.h, width / self.w, height / self.h])


def _check_world_size(world_size, root=0) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= 8:
        raise ValueError(f"world_size must be an int from 1 to 8 for a readable diagram, got {world_size!r}")
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < world_size:
        raise ValueError(f"root must be a rank from 0 to {world_size - 1}, got {root!r}")


def plot_collective(name: str, world_size: int = 4, root: int = 0):
    """Draw what every rank holds before and after collective ``name`` (e.g. ``"all_to_all"``).

    Args:
        name: one of ``broadcast``, ``reduce``, ``all_reduce``, ``gather``, ``all_gather``, ``scatter``,
            ``reduce_scatter``, ``all_to_all``.
        world_size: number of ranks drawn (1 to 8).
        root: the ``src``/``dst`` rank for the rooted collectives.

    Returns the Figure (two axes: before, after).
    """
    import matplotlib.pyplot as plt

    _check_world_size(world_size, root)
    call, meaning, before, after = _states(name, world_size, root)
    unit = 0.42  # inches per data unit
    width = max(_row_width(before), _row_width(after), 2.5)
    panel_w, panel_h = unit * (width + _LABEL_UNITS), unit * world_size
    arrow_w, top = 0.7, 0.85
    fig_w, fig_h = 2 * panel_w + arrow_w + 0.2, panel_h + top + 0.15
    fig = plt.figure(figsize=(fig_w, fig_h))
    place = _Inches(fig, fig_w, fig_h)
    for k, (state, title) in enumerate(((before, "before"), (after, "after"))):
        ax = place.axes(0.1 + k * (panel_w + arrow_w), top, panel_w, panel_h)
        _draw_ranks(ax, state, world_size, width + 0.1)
        ax.set_title(title, fontsize=10)
    fig.text(
        (0.1 + panel_w + arrow_w / 2) / fig_w, 1 - (top + panel_h / 2) / fig_h, "\u2192",
        ha="center", va="center", fontsize=24, color="0.3",
    )
    fig.suptitle(f"{call}\n{meaning}", fontsize=11, y=1 - 0.08 / fig_h, va="top")
    return fig


def plot_all_collectives(world_size: int = 4):
    """The eight collectives on one figure, each as a before / after pair (16 axes). Returns the Figure."""
    import matplotlib.pyplot as plt

    _check_world_size(world_size)
    unit = 0.36
    width = _max_width(COLLECTIVE_NAMES, world_size, 0)  # one scale for all panels: same data, same size
    panel_w, panel_h = unit * (width + _LABEL_UNITS), unit * world_size
    head, gap_x, gap_y = 0.45, 0.35, 0.3
    fig_w = 4 * panel_w + 3 * gap_x + 0.3
    fig_h = 0.6 + 4 * (head + panel_h + gap_y)
    fig = plt.figure(figsize=(fig_w, fig_h))
    place = _Inches(fig, fig_w, fig_h)
    for k, name in enumerate(COLLECTIVE_NAMES):
        row, col = divmod(k, 2)
        call, _, before, after = _states(name, world_size, 0)
        y = 0.6 + row * (head + panel_h + gap_y) + head
        for j, (state, label) in enumerate(((before, f"{call}: before"), (after, "after"))):
            x = 0.15 + (2 * col + j) * (panel_w + gap_x)
            ax = place.axes(x, y, panel_w, panel_h)
            _draw_ranks(ax, state, world_size, width + 0.1, fontsize=7.5)
            ax.set_title(label, fontsize=9, loc="left")
    fig.suptitle(
        f"The eight collectives on {world_size} ranks (colour = the rank the data came from; stripes = a sum)",
        fontsize=12,
        y=1 - 0.15 / fig_h,
        va="top",
    )
    return fig


# ----------------------------------------------------------------------------------------------------------------
# Measurements


def plot_comm_counts(measured: dict, expected: dict | None = None, what: str = "messages sent"):
    """Bars: ``measured[collective][rank]`` per collective and rank; black ticks: ``expected`` (same layout).

    Args:
        measured: ``{collective name: [value for rank 0, rank 1, ...]}`` (e.g. from ``CommCounter``).
        expected: the same layout, the count a simple algorithm predicts; drawn as a black tick on each bar.
        what: the y-axis label.

    Returns the Figure (one axes).
    """
    import matplotlib.pyplot as plt

    names = list(measured)
    world = max((len(v) for v in measured.values()), default=0)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(names) + 1), 3.6))
    width = 0.8 / max(1, world)
    for r in range(world):
        xs = [k - 0.4 + width * (r + 0.5) for k in range(len(names))]
        ys = [measured[nm][r] if r < len(measured[nm]) else 0 for nm in names]
        ax.bar(xs, ys, width=width * 0.95, color=_colour(r), alpha=0.75, label=f"rank {r}")
        if expected is not None:
            es = [expected[nm][r] if nm in expected and r < len(expected[nm]) else None for nm in names]
            pts = [(x, e) for x, e in zip(xs, es) if e is not None]
            if pts:
                ax.scatter(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="_",
                    s=180,
                    color="black",
                    linewidths=2,
                    zorder=3,
                    label="expected (simple algorithm)" if r == 0 else None,
                )
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, fontsize=9)
    ax.set_ylabel(what)
    ax.legend(fontsize=8, ncol=2 if world > 4 else 1, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------------
# Timing


def time_all_reduce(all_reduce, numel: int, reps: int):
    """On every rank: the median seconds of ``all_reduce`` (yours) and of ``dist.all_reduce`` on ``numel`` floats,
    and whether both gave the same result. Values are small integers, so every order of addition is exact."""
    import time

    import torch
    import torch.distributed as dist

    base = torch.randint(-100, 100, (numel,)).float()
    results, times = {}, {}
    for name, fn in (("yours", all_reduce), ("built-in", dist.all_reduce)):
        samples = []
        for _ in range(reps):
            x = base.clone()
            dist.barrier()
            start = time.perf_counter()
            fn(x)
            samples.append(time.perf_counter() - start)
        results[name], times[name] = x, sorted(samples)[len(samples) // 2]
    return times, torch.equal(results["yours"], results["built-in"])
