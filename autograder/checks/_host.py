"""What a check reads in the host about a student's code that ran in the sandbox: its calls and its memory.

A check whose exercise is a class runs it in the sandbox through a driver (``in_sandbox(..., driver=...)``); the
driver marks the points of its scenario with ``dist.barrier()`` (after the constructor, between forward and
backward, after a step). ``Recorder``, a ``CommCounter`` opened in the host around the call, records every call the
host made for the sandbox and, at each one, the sandbox's resident memory read from ``/proc`` (the sandbox waits
for the host's answer meanwhile, so what it holds cannot change under the reading). ``phases()`` splits the calls at
the driver's barriers; ``rss`` gives the memory read at each barrier.

Nothing here comes from the sandbox's own words: the calls are the host's, and the memory is the kernel's. Without a
sandbox (``LABSUPPORT_SANDBOX=0``, nccl, no fork) the driver runs in the worker: the calls are still recorded, and
``rss`` is empty, so that memory is not judged.
"""

from __future__ import annotations

import time

from labsupport import CommCounter

MARK = "barrier"


def fmt_bytes(n: float) -> str:
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    if abs(n) < 1024 ** 2:
        return f"{n / 1024:.1f} KiB"
    if abs(n) < 1024 ** 3:
        return f"{n / 1024 ** 2:.1f} MiB"
    return f"{n / 1024 ** 3:.2f} GiB"


class Recorder(CommCounter):
    """A ``CommCounter`` that also reads the sandbox's memory at every call (``marks``: the readings at the
    driver's barriers, in bytes, or empty without a sandbox)."""

    def __init__(self):
        super().__init__()
        self.marks: list = []
        self._opened = 0.0

    def __enter__(self) -> "Recorder":
        self._opened = time.perf_counter()  # the host's log of requests starts afresh with each task: read by time
        return super().__enter__()

    def enter(self, call) -> None:
        super().enter(call)
        if call.is_comm and not call.in_comm and self.summary.calls and self.summary.calls[-1].kind == MARK:
            from labsupport import _sandbox

            memory = _sandbox.memory()
            if memory is not None:
                self.marks.append(memory["rss"])

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._relabel()

    def _relabel(self) -> None:
        """The host carries a reduce-scatter as an all-reduce of every chunk (``labsupport._sandbox``): its own log
        of the requests (``record()``) names what the sandbox asked for, so the call is named by that."""
        from labsupport import _sandbox

        asked = [entry[0] for entry in _sandbox.record() if entry[3] >= self._opened]
        calls = self.summary.calls
        if not asked:
            return
        i = 0
        for op in asked:
            if op == "all_to_all":
                i += 2  # the sizes first, then the data
                continue
            if i >= len(calls):
                return
            if op == "reduce_scatter" and calls[i].kind == "all_reduce":
                calls[i].kind = "reduce_scatter"
            i += 1

    def phases(self) -> list:
        """The calls between the driver's barriers: one list per phase (the barriers left out)."""
        out = [[]]
        for c in self.summary.calls:
            if c.kind == MARK:
                out.append([])
            else:
                out[-1].append(c)
        return out

    @property
    def rss(self) -> list:
        """The sandbox's resident bytes at each of the driver's barriers (empty without a sandbox)."""
        return list(self.marks)

