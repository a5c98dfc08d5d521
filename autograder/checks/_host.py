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

    def enter(self, call) -> None:
        super().enter(call)
        if call.is_comm and not call.in_comm and self.summary.calls and self.summary.calls[-1].kind == MARK:
            from labsupport import _sandbox

            memory = _sandbox.memory()
            if memory is not None:
                self.marks.append(memory["rss"])

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

