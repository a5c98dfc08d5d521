"""A pipeline run's recorded spans: ``spans_of(events)`` and ``measured_bubble(events_per_rank)``."""

from __future__ import annotations

__all__ = ["spans_of", "measured_bubble"]


def spans_of(events) -> list:
    """A rank's ``"F mb"`` / ``"B mb"`` spans as ``(start, end, op, mb)``, sorted by start."""
    out = []
    for e in events:
        parts = e.name.split()
        if len(parts) == 2 and parts[0] in ("F", "B"):
            out.append((e.start, e.end, parts[0], int(parts[1])))
    return sorted(out)


def measured_bubble(events_per_rank) -> float:
    """1 - (time spent in F/B spans, summed over ranks) / (ranks x (last end - first start))."""
    spans = [spans_of(evs) for evs in events_per_rank]
    start = min(s[0][0] for s in spans if s)
    end = max(s[-1][1] for s in spans if s)
    work = sum(e - b for rank in spans for b, e, _, _ in rank)
    return 1.0 - work / (len(spans) * (end - start))
