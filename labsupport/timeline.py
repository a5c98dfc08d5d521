"""Record what each rank does over time: ``Timeline``.

Inside a worker, wrap work in ``with tl.span("backward"):`` (compute) or ``tl.comm("all_reduce")`` (communication),
or record spans measured elsewhere with ``tl.add``; return ``tl.events`` from the worker and draw the list of
per-rank event lists with ``labsupport.plots.timeline``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["Timeline", "Event"]


@dataclass
class Event:
    """A span on one rank: ``kind`` is ``"compute"`` or ``"comm"``; times in seconds since the timeline began."""

    name: str
    kind: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


class Timeline:
    """Per-rank recorder of named spans.

    Example::

        def work():
            tl = labsupport.Timeline()
            with tl.span("forward"):
                y = model(x)
            with tl.comm("all_reduce"):
                dist.all_reduce(y)
            return tl.events
    """

    def __init__(self, origin: float | None = None):
        self.origin = time.perf_counter() if origin is None else origin
        self.events: list[Event] = []

    def now(self) -> float:
        """Seconds since the timeline began."""
        return time.perf_counter() - self.origin

    def add(self, name: str, start: float, end: float, kind: str = "compute") -> Event:
        """Record a span measured elsewhere (times from ``now()``)."""
        ev = Event(name, kind, start, end)
        self.events.append(ev)
        return ev

    @contextmanager
    def span(self, name: str, kind: str = "compute"):
        start = self.now()
        try:
            yield
        finally:
            self.add(name, start, self.now(), kind)

    def comm(self, name: str):
        return self.span(name, kind="comm")

    @staticmethod
    def overlap(events: list[Event], kind_a: str = "comm", kind_b: str = "compute") -> float:
        """Seconds during which a span of ``kind_a`` and a span of ``kind_b`` were both running."""
        a = [(e.start, e.end) for e in events if e.kind == kind_a]
        b = [(e.start, e.end) for e in events if e.kind == kind_b]
        total = 0.0
        for s1, e1 in a:
            for s2, e2 in b:
                total += max(0.0, min(e1, e2) - max(s1, s2))
        return total
