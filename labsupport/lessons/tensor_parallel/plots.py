"""Plots for notebook 04: the two ways to split Y = XA, memory per rank against t, measured vs formula volume."""

from __future__ import annotations

__all__ = ["plot_blocking", "plot_memory", "plot_volume"]


def _colour(rank: int):
    import matplotlib

    return matplotlib.colormaps["tab10"](rank % 10)


def _matrix(ax, x, y, w, h, label, blocks=1, axis=None, colours=None, shape_labels=None, alpha=0.75):
    """A matrix drawn as a w x h rectangle at (x, y) (top-left), optionally cut into ``blocks`` along ``axis``
    ("cols" or "rows"), each block in its rank's colour and labelled with its shape."""
    from matplotlib.patches import Rectangle

    for i in range(blocks):
        if axis == "cols":
            bx, by, bw, bh = x + i * w / blocks, y, w / blocks, h
        elif axis == "rows":
            bx, by, bw, bh = x, y + i * h / blocks, w, h / blocks
        else:
            bx, by, bw, bh = x, y, w, h
        colour = "#dddddd" if colours is None else colours[i]
        ax.add_patch(Rectangle((bx, -by - bh), bw, bh, facecolor=colour, edgecolor="black", alpha=alpha))
        if shape_labels:
            ax.text(bx + bw / 2, -by - bh / 2, shape_labels[i], ha="center", va="center", fontsize=8)
    ax.text(x + w / 2, -y + 0.25, label, ha="center", va="bottom", fontsize=10, fontweight="bold")


def plot_blocking(t: int = 2, rows: str = "bs", h: str = "h", n: str = "n"):
    """Y = XA split over ``t`` ranks two ways, each block coloured by the rank that holds it.

    Top, A split by columns: every rank has all of X (rows x h) and A_r (h x n/t); Y_r = X A_r is a slice of Y's
    columns; the slices are concatenated (or stay sharded). Bottom, A split by rows: rank r has X_r, the r-th
    column block of X (rows x h/t), and A_r (h/t x n); Y_r = X_r A_r is a full-sized partial result; Y is their sum.
    """
    import matplotlib.pyplot as plt

    colours = [_colour(r) for r in range(t)]
    fig, axes = plt.subplots(2, 1, figsize=(10, 6.2))
    W, H, GAP = 2.2, 2.2, 0.9
    cases = (
        ("A split by columns: each rank computes a slice of Y's columns; Y = [Y_0 | Y_1 | ...] (all-gather, or keep "
         "it sharded)", "cols"),
        ("A split by rows: X split by columns too; each rank computes a full-sized partial sum; Y = Y_0 + Y_1 + ... "
         "(all-reduce)", "rows"),
    )
    narrow = t > 2   # blocks too narrow for their shapes: name them, and give the shapes underneath

    def lab(name, shape):
        return name if narrow else f"{name}\n{shape}"

    def under(ax, x, text):
        if narrow:
            ax.text(x + W / 2, -H - 0.15, text, ha="center", va="top", fontsize=8)

    for ax, (title, split) in zip(axes, cases):
        x = 0.0
        if split == "cols":
            _matrix(ax, x, 0, W, H, "X (every rank)", shape_labels=[f"{rows} x {h}"])
        else:
            _matrix(ax, x, 0, W, H, "X (split by columns)", t, "cols", colours,
                    [lab(f"X_{r}", f"{rows} x {h}/{t}") for r in range(t)])
            under(ax, x, f"each X_r: {rows} x {h}/{t}")
        x += W + GAP
        ax.text(x - GAP / 2, -H / 2, "@", ha="center", va="center", fontsize=16)
        if split == "cols":
            _matrix(ax, x, 0, W, H, "A (split by columns)", t, "cols", colours,
                    [lab(f"A_{r}", f"{h} x {n}/{t}") for r in range(t)])
            under(ax, x, f"each A_r: {h} x {n}/{t}")
        else:
            _matrix(ax, x, 0, W, H, "A (split by rows)", t, "rows", colours,
                    [f"A_{r}: {h}/{t} x {n}" for r in range(t)])
        x += W + GAP
        ax.text(x - GAP / 2, -H / 2, "=", ha="center", va="center", fontsize=16)
        if split == "cols":
            _matrix(ax, x, 0, W, H, "Y = [Y_0 | ...]", t, "cols", colours,
                    [f"Y_{r}" if narrow else f"Y_{r}=XA_{r}\n{rows} x {n}/{t}" for r in range(t)])
            under(ax, x, f"each Y_r = X A_r: {rows} x {n}/{t}")
        else:
            step = 0.35
            for r in reversed(range(t)):
                _matrix(ax, x + r * step, r * step, W, H, "", colours=[colours[r]], alpha=1.0,
                        shape_labels=[f"Y_{r}=X_{r}A_{r}\n{rows} x {n}" if r == 0 else ""])
            ax.text(x + W + (t - 1) * step + 0.15, -H / 2 - (t - 1) * step / 2,
                    "\n".join(f"rank {r}: Y_{r} = X_{r} A_{r}" for r in range(t)) + f"\neach {rows} x {n}",
                    ha="left", va="center", fontsize=8)
            ax.text(x + W / 2 + (t - 1) * step / 2, 0.25, "Y = sum of partials", ha="center", va="bottom",
                    fontsize=10, fontweight="bold")
            x += (t - 1) * step
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_xlim(-0.2, x + W + 2.2)
        ax.set_ylim(-H - 0.3 - (t - 1) * 0.35, 0.8)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.suptitle(f"Y = XA on t = {t} ranks (colour = the rank holding the block)", fontsize=11)
    fig.tight_layout()
    return fig


def plot_memory(ts, measured, dense_bytes: float, weights_only=None):
    """Bytes of parameters per rank (``measured[i]`` for ``ts[i]`` ranks) against the ideal dense_bytes / t."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ts = list(ts)
    ax.plot(ts, [m / 1024 for m in measured], "o-", label="measured per rank (all tensors the modules keep)")
    if weights_only is not None:
        ax.plot(ts, [m / 1024 for m in weights_only], "s--", label="weight matrices only")
    ax.plot(ts, [dense_bytes / t / 1024 for t in ts], "k:", label="dense / t")
    ax.set_xlabel("tensor-parallel size t")
    ax.set_ylabel("KiB per rank")
    ax.set_xticks(ts)
    ax.set_ylim(bottom=0)
    ax.set_title("parameter memory per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_volume(ts, measured, formula, labels=("measured (recorded collectives, ring cost)",
                                               "Narayanan et al. 2021: 8bsh(t-1)/t elements × 4 B")):
    """Bytes sent per rank per layer: what was recorded (converted with ring costs) against the formula."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ts = list(ts)
    width = 0.35
    ax.bar([t - width / 2 for t in ts], [m / 1024 for m in measured], width, label=labels[0])
    ax.bar([t + width / 2 for t in ts], [f / 1024 for f in formula], width, label=labels[1], hatch="//",
           alpha=0.7)
    ax.set_xlabel("tensor-parallel size t")
    ax.set_ylabel("KiB sent per rank, one layer")
    ax.set_xticks(ts)
    ax.set_title("tensor-parallel communication per transformer layer")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
