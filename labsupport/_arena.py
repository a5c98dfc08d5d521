"""Shared memory between a grading host and its sandbox (``labsupport._sandbox``): where large tensors cross.

The host maps the arena (anonymous shared memory) before it forks the sandbox, so both see the same pages and nobody
else does. A tensor the sandbox hands over is copied into the arena once, and its request names the place (an
offset) instead of carrying the bytes; the host runs the real ``torch.distributed`` call on a view of those bytes and
creates its outputs there too, so an answer crosses back without a copy on the host's side. Through the link alone a
tensor was copied a dozen times on its way (pickled, written, read, unpickled, each way), which on a machine with
slow memory made a 4 MiB all-reduce ten times slower than gloo itself.

The sandbox owns the arena's space: it takes what a request needs from the free end and gives everything back when
no request is in flight. The pages stay for the next request (making them afresh each time cost as much as the copies
saved); the host returns them to the kernel (``MADV_REMOVE``) before it reads the sandbox's memory from ``/proc``, so
that transfers that are over do not count as what the sandbox holds. Small tensors, and any that no longer fit,
travel in the message itself as before (``labsupport._relay.raw``).

Nothing here decides points: the sandbox can write the arena at any time, but what it holds is the sandbox's own
data, which it could have sent anyway; the host checks each place it is given against the arena's bounds.
"""

from __future__ import annotations

import math
import mmap

import torch

#: The arena's size: address space only, pages exist while a transfer uses them.
SIZE = 1 << 29
#: Tensors smaller than this travel in the message: cheaper than the arena's pages for them.
SMALL = 1 << 13
_ALIGN = 64


def _nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class Arena:
    """The shared memory itself (``map``), its views (``base``), and the sandbox's account of its space."""

    def __init__(self, size: int = SIZE):
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_NORESERVE", 0)
        self.map = mmap.mmap(-1, size, flags=flags)
        self.size = size
        self.base = torch.frombuffer(self.map, dtype=torch.uint8)
        self._ptr = self.base.data_ptr()
        self.top = 0    # the sandbox's: the end of the space in use
        self.live = 0   # the sandbox's: requests in flight

    # -- both sides
    def view(self, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
        """The tensor at ``offset`` (checked against the arena's bounds)."""
        n = _nbytes(dtype, shape)
        if not isinstance(offset, int) or offset < 0 or offset + n > self.size or offset % _ALIGN:
            raise ValueError(f"no tensor of {n} bytes at {offset!r} in the shared arena")
        return self.base[offset:offset + n].view(dtype).reshape(shape)

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where ``t`` lies in the arena, if it is a whole contiguous view of it."""
        if not t.is_contiguous() or t.device.type != "cpu":
            return None
        try:
            if t.untyped_storage().data_ptr() != self._ptr:
                return None
        except RuntimeError:
            return None
        offset = t.data_ptr() - self._ptr
        return offset if offset % _ALIGN == 0 else None

    # -- the sandbox's side
    def take(self, nbytes: int) -> int | None:
        """Room for ``nbytes``, or None (small, or no room left)."""
        if nbytes < SMALL:
            return None
        start = -(-self.top // _ALIGN) * _ALIGN
        if start + nbytes > self.size:
            return None
        self.top = start + nbytes
        return start

    def begin(self) -> None:
        self.live += 1

    def end(self) -> None:
        self.live -= 1
        if self.live <= 0:
            self.reset()

    def reset(self) -> None:
        """Nothing in flight: all the space is free again (its pages stay, for the next request; the host gives
        them back to the kernel before it reads the sandbox's memory: ``trim``)."""
        self.live = 0
        self.top = 0

    # -- the host's side
    def trim(self, top: int, keep=()) -> None:
        """Give the pages below ``top`` back to the kernel, but those of the spans ``keep`` (``(start, end)``: the
        places of requests still in flight). Called by the host only while the sandbox waits for it, before the
        sandbox's memory is read from ``/proc``: transfers that are over do not count as what the sandbox holds."""
        advice = getattr(mmap, "MADV_REMOVE", None)
        if advice is None or top <= 0:
            return
        page, start = mmap.PAGESIZE, 0
        for lo, hi in sorted(keep) + [(min(-(-top // page) * page, self.size), self.size)]:
            a, b = -(-start // page) * page, (lo // page) * page
            if b > a:
                try:
                    self.map.madvise(advice, a, b - a)
                except OSError:
                    return
            start = max(start, hi)
