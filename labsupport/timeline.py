"""Record what each rank does over time: ``Timeline``.

Inside a worker, wrap work in ``with tl.span("backward"):`` (compute) or ``tl.comm("all_reduce")`` (communication),
or record spans measured elsewhere with ``tl.add``; return ``tl.events`` from the worker and draw the list of
per-rank event lists with ``labsupport.plots.plot_timeline``. A span of kind ``"wait"`` (``tl.span("finish",
kind="wait")``) marks time spent blocked on communication: drawn, but not counted as compute.

Asynchronous communication runs in the background while the rank computes, so a ``with`` block cannot time it.
``tl.track(work)`` records an ``async_op=True`` call from now until it completes, and ``with tl.collectives():``
records every collective this rank issues inside the block (whoever issues it: your code, a library, a hook), each
from the moment it is issued to the moment it completes. ``Timeline.hidden_fraction(events)`` then says how much
of the communication time was hidden behind computation.
"""

from __future__ import annotations

import threading
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
        self._inflight: list = []  # (name, start, work) of tracked calls not yet complete
        self._no_future: set = set()  # ids of tracked works whose backend gives no future
        self._lock = threading.Lock()

    def __getstate__(self):  # picklable (a worker may return the Timeline itself): drop what cannot travel
        state = dict(self.__dict__)
        state["_inflight"] = []
        state["_no_future"] = set()
        state["_lock"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

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

    def track(self, work, name: str = "all_reduce"):
        """Record an asynchronous call from now until it completes, as a ``"comm"`` span; returns ``work``.

        ``work`` is what ``dist.all_reduce(t, async_op=True)`` (or any ``async_op=True`` call) returned. The end
        time is taken when the backend marks it complete (a callback on ``work.get_future()``), not when you wait.
        A backend without futures records the span up to the moment ``tl.finish()`` is called.

        Example::

            work = tl.track(dist.all_reduce(grad, async_op=True), "all_reduce grad")
            ...                        # compute while it runs
            work.wait()
            tl.finish()                # before reading tl.events
        """
        start = self.now()
        with self._lock:
            self._inflight.append((name, start, work))
        try:
            fut = work.get_future()
        except Exception:  # no future on this backend: closed by finish(), when its wait returns
            self._no_future.add(id(work))
            return work

        def done(_fut, name=name, start=start, work=work):
            end = self.now()
            with self._lock:
                self._close(name, start, work, end)

        fut.add_done_callback(done)
        return work

    def _close(self, name, start, work, end) -> None:
        for i, (n, s, w) in enumerate(self._inflight):
            if w is work and s == start and n == name:
                del self._inflight[i]
                self.add(name, start, end, "comm")
                return

    def finish(self) -> list:
        """Close the spans of tracked calls still open (waiting for each), and return ``events`` sorted by start."""
        for name, start, work in list(self._inflight):
            try:
                work.wait()
            except Exception:
                pass
            if id(work) in self._no_future:
                with self._lock:
                    self._close(name, start, work, self.now())
        # completion callbacks run on the backend's threads, a moment after wait() returns
        deadline = time.perf_counter() + 1.0
        while self._inflight and time.perf_counter() < deadline:
            time.sleep(0.0005)
        with self._lock:
            for name, start, work in list(self._inflight):
                self._close(name, start, work, self.now())
            self._no_future.clear()
        self.events.sort(key=lambda e: e.start)
        return self.events

    @contextmanager
    def collectives(self, kinds=("all_reduce",)):
        """Record every collective of the given kinds issued on this rank inside the block, issue to completion.

        ``kinds`` are ``torch.distributed`` names (``"all_reduce"``, ``"broadcast"``, ``"all_gather"``,
        ``"reduce_scatter"``, ...), matched as in ``CommCounter``; ``None`` records every kind. Spans are named
        ``"<kind> <bytes> B"``. Calls made by C++ code that bypasses Python (DistributedDataParallel's own reducer)
        are not seen. On leaving the block, calls still in flight are waited for and closed (``finish``).

        Example::

            with tl.collectives():
                with tl.span("backward"):
                    loss.backward()        # a DDP wrapper launches all-reduces from gradient hooks
                model.finish_gradient_synchronization()
            print(Timeline.hidden_fraction(tl.events))
        """
        from . import tap

        recorder = _CollectiveRecorder(self, kinds)
        tap.subscribe(recorder)
        try:
            yield self
        finally:
            tap.unsubscribe(recorder)
            self.finish()

    @staticmethod
    def chrome_trace(events_per_rank, path=None) -> dict:
        """The spans of every rank as one Chrome trace (the JSON ``torch.profiler`` writes, which ui.perfetto.dev and
        chrome://tracing open): one process per rank, named ``rank N``; compute and waits on thread 0, communication
        on thread 1; times in microseconds. ``events_per_rank``: per-rank lists of events (``Event`` or dicts), as
        returned from the workers. Writes the JSON to ``path`` if given; returns the dict.

        Example::

            trace = Timeline.chrome_trace(labsupport.run(work, world_size=4), "timeline.json")
        """
        import json

        out = []
        for rank, events in enumerate(events_per_rank):
            out.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
            for tid, label in ((0, "compute"), (1, "communication")):
                out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": label}})
            for e in events:
                get = e.get if isinstance(e, dict) else lambda k, e=e: getattr(e, k)
                out.append({"ph": "X", "name": get("name"), "cat": get("kind"), "pid": rank,
                            "tid": 1 if get("kind") == "comm" else 0, "ts": get("start") * 1e6,
                            "dur": (get("end") - get("start")) * 1e6})
        trace = {"traceEvents": out, "displayTimeUnit": "ms"}
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(trace, f)
        return trace

    @staticmethod
    def covered(events: list[Event], kind: str = "comm", names=None) -> float:
        """Seconds during which at least one span of ``kind`` (and, if given, with a name in ``names``) was running."""
        spans = sorted((e.start, e.end) for e in events if e.kind == kind and (names is None or e.name in names))
        return sum(e - s for s, e in _union(spans))

    @staticmethod
    def hidden_fraction(events: list[Event], kind_a: str = "comm", kind_b: str = "compute", names_b=None) -> float:
        """Fraction of the time some ``kind_a`` span ran during which some ``kind_b`` span also ran.

        With the defaults: the fraction of communication time hidden behind computation (1.0 = fully overlapped,
        0.0 = none). ``names_b`` restricts the computation to spans with those names, e.g. ``{"backward"}``.
        Returns 0.0 when there is no ``kind_a`` span.
        """
        a = _union(sorted((e.start, e.end) for e in events if e.kind == kind_a))
        b = _union(
            sorted((e.start, e.end) for e in events if e.kind == kind_b and (names_b is None or e.name in names_b))
        )
        total = sum(e - s for s, e in a)
        if total <= 0:
            return 0.0
        both = 0.0
        for s1, e1 in a:
            for s2, e2 in b:
                both += max(0.0, min(e1, e2) - max(s1, s2))
        return both / total

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


def _union(spans):
    """Merge sorted (start, end) pairs into disjoint ones."""
    out = []
    for s, e in spans:
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


# ---- recording collectives issued by anyone (Timeline.collectives) ------------------------------------------------
# A subscriber of labsupport.tap: every outermost collective on a process group (or backend) returns a Work, which
# is handed to Timeline.track. Subscribers come and go independently, so this composes with CommCounter whichever
# is entered or left first.


class _CollectiveRecorder:
    def __init__(self, timeline: Timeline, kinds):
        self.timeline = timeline
        self.kinds = None if kinds is None else frozenset(kinds)

    def enter(self, call) -> None:
        pass

    def exit(self, call) -> None:
        from ._kinds import POINT_TO_POINT, nbytes_of

        if call.level not in ("pg", "backend") or call.in_comm or call.result is None:
            return
        kind = call.kind
        if kind in POINT_TO_POINT or kind == "barrier" or (self.kinds is not None and kind not in self.kinds):
            return
        tensors = call.args[0] if call.args else call.kwargs.get("tensors")
        try:
            self.timeline.track(call.result, f"{kind} {nbytes_of(tensors)} B")
        except Exception:  # recording must never break the call
            pass
