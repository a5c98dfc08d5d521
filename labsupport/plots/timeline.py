"""Timelines drawn as Gantt charts: ``plot_timeline(runs)``, one lane of compute per rank and lanes of
communication below it (from issue to completion; several calls may be in flight at once).

``runs`` is the list of per-rank ``Timeline.events`` that ``labsupport.run`` returned, or a dict
``title -> such a list`` for several runs on one time axis. Any named spans work: data parallelism names its spans
``forward``/``backward``/``finish``, a pipeline schedule ``F0``, ``B1``, ...

Example::

    results = labsupport.run(train_and_record, world_size=2)     # each rank returns tl.events
    labsupport.plots.plot_timeline({"bucketed": results})
"""

from __future__ import annotations

__all__ = ["plot_timeline", "PALETTE"]

# Compute spans get these colours by name (the first word of the name); anything else cycles through a palette.
_COMPUTE_COLOURS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "sync": "#937860",
    "finish": "#937860",
    "wait": "#937860",
    "average": "#937860",
    "step": "#55A868",
    "optimizer": "#55A868",
}
_COMM_COLOUR = "#C44E52"
PALETTE = ("#8172B3", "#64B5CD", "#CCB974", "#8C8C8C", "#DA8BC3", "#4C72B0", "#DD8452", "#55A868")


def _plt():
    import matplotlib.pyplot as plt

    return plt


def _colour_for(name: str, cache: dict) -> str:
    key = name.split()[0].lower() if name else ""
    if key in _COMPUTE_COLOURS:
        return _COMPUTE_COLOURS[key]
    if key not in cache:
        cache[key] = PALETTE[len(cache) % len(PALETTE)]
    return cache[key]


def _lanes(spans):
    """Assign overlapping spans to lanes (first lane that is free), so none hides another."""
    ends, lanes = [], []
    for s, e in spans:
        for i, end in enumerate(ends):
            if s >= end:
                ends[i] = e
                lanes.append(i)
                break
        else:
            ends.append(e)
            lanes.append(len(ends) - 1)
    return lanes, max(1, len(ends))


def _field(ev, name):
    return ev[name] if isinstance(ev, dict) else getattr(ev, name)


def _band(n_lanes: int) -> float:
    """Height of a rank's communication band: a lane per call in flight at once, at most 1.8 units in all."""
    return min(0.45 * n_lanes, 1.8)


def plot_timeline(runs, title: str | None = None, unit: str = "ms", show_hidden: bool = True):
    """Gantt chart of compute and communication per rank.

    ``runs``: per-rank lists of events (``Timeline.events``: objects or dicts with ``name``, ``kind``, ``start``,
    ``end``), or a dict ``run title -> per-rank lists``. Each rank gets one compute lane and as many communication
    lanes as it had calls in flight at once. Spans of kind ``"wait"`` (blocked on communication, e.g.
    ``tl.span("finish", kind="wait")``) are drawn hatched on the compute lane and do not count as compute. With
    ``show_hidden``, each rank's label says which fraction of its communication time overlapped a compute span.
    Times are shifted so each run starts at 0.
    """
    from matplotlib.patches import Patch

    from ..timeline import Event, Timeline

    plt = _plt()
    if not isinstance(runs, dict):
        runs = {title or "": runs}
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    layout = []  # per run: per rank (compute spans, comm spans with lanes, n comm lanes)
    for events_per_rank in runs.values():
        t0 = min((_field(e, "start") for evs in events_per_rank for e in evs), default=0.0)
        ranks = []
        for evs in events_per_rank:
            comp = [(_field(e, "name"), (_field(e, "start") - t0) * scale, (_field(e, "end") - t0) * scale,
                     _field(e, "kind")) for e in evs if _field(e, "kind") != "comm"]
            comm = sorted(((_field(e, "start") - t0) * scale, (_field(e, "end") - t0) * scale, _field(e, "name"))
                          for e in evs if _field(e, "kind") == "comm")
            lanes, n_lanes = _lanes([(s, e) for s, e, _ in comm])
            hidden = None
            if comm:
                hidden = Timeline.hidden_fraction(
                    [Event(_field(e, "name"), _field(e, "kind"), _field(e, "start"), _field(e, "end")) for e in evs])
            ranks.append((comp, list(zip(comm, lanes)), n_lanes if comm else 0, hidden))
        layout.append(ranks)

    heights = [sum(1.0 + _band(r[2]) + 0.4 for r in ranks) for ranks in layout]
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 0.9 + 0.55 * sum(heights)), sharex=True,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    cache, seen = {}, {}
    x_max = 0.0
    for ax, run_title, ranks in zip(axes[:, 0], runs, layout):
        y, ticks, labels = 0.0, [], []
        for rank in reversed(range(len(ranks))):
            comp, comm, n_lanes, hidden = ranks[rank]
            for i, ((s, e, name), lane) in enumerate(comm):
                lane_h = _band(n_lanes) / n_lanes
                ax.broken_barh([(s, max(e - s, 1e-9))], (y + lane_h * lane + 0.05, 0.8 * lane_h),
                               color=_COMM_COLOUR, alpha=0.8, edgecolor="white", linewidth=0.4)
                x_max = max(x_max, e)
            if comm:
                seen.setdefault("communication in flight", Patch(color=_COMM_COLOUR, alpha=0.8))
            base = y + _band(n_lanes) + 0.05
            for name, s, e, kind in comp:
                if kind == "wait":  # blocked until communication completes: not useful compute
                    ax.broken_barh([(s, max(e - s, 1e-9))], (base, 0.8), facecolor="#DDDDDD", edgecolor="#888888",
                                   hatch="///", linewidth=0.5)
                    text_colour = "black"
                    seen.setdefault("waiting (" + name.split()[0] + ")" if name else "waiting",
                                    Patch(facecolor="#DDDDDD", edgecolor="#888888", hatch="///"))
                else:
                    colour = _colour_for(name, cache)
                    ax.broken_barh([(s, max(e - s, 1e-9))], (base, 0.8), color=colour, edgecolor="white",
                                   linewidth=0.5)
                    text_colour = "white"
                    seen.setdefault(name.split()[0] if name else name, Patch(color=colour))
                if (e - s) > 0.06 * max(x_max, e, 1e-9):
                    ax.text((s + e) / 2, base + 0.4, name, ha="center", va="center", fontsize=7, color=text_colour)
                x_max = max(x_max, e)
            ticks.append(y + (_band(n_lanes) + 0.85) / 2)
            label = f"rank {rank}"
            if show_hidden and hidden is not None:
                label += f"\n{100 * hidden:.0f}% of comm hidden"
            labels.append(label)
            y = base + 0.8 + 0.4
        ax.set_yticks(ticks)
        ax.set_yticklabels(labels, fontsize=8)
        ax.set_ylim(-0.2, y)
        if run_title:
            ax.set_title(run_title, fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    axes[-1, 0].set_xlim(0, x_max * 1.02 if x_max > 0 else 1)
    fig.legend(list(seen.values()), list(seen.keys()), loc="upper right", fontsize=8, ncol=min(6, len(seen)),
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig
