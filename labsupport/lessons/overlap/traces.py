"""Real traces: ``torch.profiler`` on every rank, merged into one Chrome/Perfetto trace (one process row per rank),
the share of communication hidden read from it, and a drawing of it in the notebook.

``profiler_events(prof)`` keeps what a reader looks for: the spans named with ``record_function`` (``forward``,
``backward``, ``F3``, ...), gloo's work (``gloo:all_reduce``, ``gloo:send``, ...) on its own threads, and the
autograd and matrix-product operators, each with its thread. ``merge_traces`` gives rank r the process id r and
the name ``rank r``; ``ui.perfetto.dev`` opens the file as it is.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from ...timeline import Event, Timeline

__all__ = ["profiler_events", "merge_traces", "trace_spans", "hidden_share_from_trace", "ddp_step_traced",
           "plot_trace"]

_KEEP_OPS = ("aten::mm", "aten::addmm", "aten::linear", "autograd::engine", "DistributedDataParallel.forward")


def profiler_events(prof) -> list:
    """The complete-span ("X") events of a finished ``torch.profiler.profile``, the ones worth drawing."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    keep = []
    for e in events:
        if e.get("ph") != "X":
            continue
        name, cat = e.get("name", ""), e.get("cat", "")
        if cat == "user_annotation" or name.startswith("gloo:") or name.startswith(_KEEP_OPS):
            keep.append({k: e[k] for k in ("name", "cat", "ts", "dur", "tid") if k in e})
    return keep


def merge_traces(per_rank, path=None) -> dict:
    """One Chrome trace from every rank's ``profiler_events``: rank r is process r, named ``rank r``; the threads
    keep their ids (the main thread, gloo's threads). Writes the JSON to ``path`` if given."""
    out = []
    for rank, events in enumerate(per_rank):
        out.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        for e in events:
            out.append({**e, "ph": "X", "pid": rank})
    trace = {"traceEvents": out, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(trace, f)
    return trace


def trace_spans(trace: dict, rank: int, compute=("backward",), comm_prefix: str = "gloo:all_reduce") -> list:
    """Rank ``rank``'s spans of a merged trace as ``Timeline`` events: the spans named in ``compute`` as
    ``"compute"``, gloo's spans whose name starts with ``comm_prefix`` (its all-reduces, the calls
    ``Timeline.collectives`` records by default) as ``"comm"``; seconds."""
    out = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("pid") != rank:
            continue
        kind = "comm" if e["name"].startswith(comm_prefix) else "compute" if e["name"] in compute else None
        if kind:
            out.append(Event(e["name"], kind, e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
    return out


def hidden_share_from_trace(trace: dict, rank: int, compute=("backward",),
                            comm_prefix: str = "gloo:all_reduce") -> float:
    """The share of rank ``rank``'s communication time (gloo's all-reduce spans) during which a ``compute`` span
    ran."""
    return Timeline.hidden_fraction(trace_spans(trace, rank, compute, comm_prefix))


def _mlp(width: int, depth: int) -> nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(*[layer for _ in range(depth) for layer in (nn.Linear(width, width), nn.ReLU())])


def ddp_step_traced(width: int = 256, depth: int = 8, batch: int = 64, bucket_mb: float = 0.25) -> dict:
    """On every rank: one training step of an MLP in torch's ``DistributedDataParallel``, recorded twice at once,
    by ``torch.profiler`` and by a ``labsupport.Timeline``. DDP uses torch's own Python all-reduce hook
    (``ddp_comm_hooks.default_hooks.allreduce_hook``: the same all-reduce as the built-in one), so that
    ``Timeline.collectives`` sees each bucket's all-reduce from issue to completion, while the profiler sees gloo
    run it. Returns ``{"trace": profiler events, "events": Timeline events, "hidden_timeline": share}``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.profiler import ProfilerActivity, profile, record_function

    model = _mlp(width, depth)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    ddp.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, width, generator=gen)
    ddp(x).pow(2).mean().backward()                    # warm-up: buckets built, first-call costs paid
    model.zero_grad()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.barrier()                                 # after the profiler started: it takes ranks unequal times
        tl = Timeline()
        with tl.collectives():
            with tl.span("forward"), record_function("forward"):
                loss = ddp(x).pow(2).mean()
            with tl.span("backward"), record_function("backward"):
                loss.backward()
        # backward returns once each bucket's all-reduce has its result, while gloo's thread may still be closing
        # that all-reduce's profiler record; gloo starts a barrier only after every earlier collective has ended
        # whole, so the profiler never stops in the middle of a record
        dist.barrier()
    return {"trace": profiler_events(prof), "events": tl.events,
            "hidden_timeline": Timeline.hidden_fraction(tl.events, names_b={"backward"})}


def _plt():
    import matplotlib.pyplot as plt

    return plt


def plot_trace(trace: dict, title: str = "", rows=("user_annotation", "gloo"), unit: str = "ms"):
    """Draw a merged trace: per rank, one lane for the spans named with ``record_function`` (drawn nested spans
    shorter) and one per gloo thread, on the same time axis (the ranks share this machine's clock)."""
    plt = _plt()
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ranks = sorted({e["pid"] for e in spans})
    t0 = min(e["ts"] for e in spans)
    scale = {"ms": 1e-3, "us": 1.0, "s": 1e-6}[unit]
    lanes = []
    for r in ranks:
        mine = [e for e in spans if e["pid"] == r]
        lanes.append((f"rank {r}", [e for e in mine if e.get("cat") == "user_annotation"
                                    and not e["name"].startswith("gloo:")]))
        for tid in sorted({e["tid"] for e in mine if e["name"].startswith("gloo:")}, key=str):
            lanes.append((f"rank {r} gloo", [e for e in mine if e["name"].startswith("gloo:") and e["tid"] == tid]))
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(lanes) + 1.2))
    colours = {}
    palette = plt.get_cmap("tab20").colors
    for y, (label, items) in enumerate(reversed(lanes)):
        for e in sorted(items, key=lambda e: -e["dur"]):
            name = e["name"]
            key = name.rstrip("0123456789") if not name.startswith("gloo:") else name
            colour = colours.setdefault(key, palette[(2 * len(colours)) % len(palette)])
            nested = sum(1 for o in items if o is not e and o["ts"] <= e["ts"] and
                         o["ts"] + o["dur"] >= e["ts"] + e["dur"] and o["dur"] > e["dur"])
            h = 0.8 * (0.75 ** nested)
            x, w = (e["ts"] - t0) * scale, max(e["dur"] * scale, 1e-6)
            ax.broken_barh([(x, w)], (y + 0.5 - h / 2, h), facecolor=colour, edgecolor="white", linewidth=0.3)
            if w > 0.06 * ((max(s["ts"] + s["dur"] for s in spans) - t0) * scale) and nested == 0 \
                    and not name.startswith("gloo:"):
                ax.text(x + w / 2, y + 0.5, name, ha="center", va="center", fontsize=7)
    ax.set_yticks([i + 0.5 for i in range(len(lanes))])
    ax.set_yticklabels([label for label, _ in reversed(lanes)], fontsize=8)
    ax.set_xlabel(unit)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig
