"""What the host measures for the checks of notebook 10: the transfers the student's function posted and the CPU
time its sandbox spent between each one's post and its wait, and the CPU time of one product, for comparison.

``Transfers`` lists, in order, every point-to-point transfer this rank's function posted (from ``labsupport.tap``,
the tap ``CommCounter`` also reads: in grading these are the host's own calls, which carry the sandbox's requests),
whether it was blocking, and the sandbox's CPU seconds when it was posted and when it was waited for
(``labsupport._sandbox.record()``, read from ``/proc`` outside the sandbox). A product computed between a transfer's
post and its wait shows as CPU time there; an empty one (on ``meta`` tensors, or one whose result is computed again
after the wait) does not. CPU time, not wall time: it does not stretch on a busy machine. Where no sandbox runs
(``LABSUPPORT_SANDBOX=0``), the worker's own CPU time stands in for the sandbox's.
"""

from __future__ import annotations

import math
import time

import torch

#: A transfer overlaps a product when the CPU time under it is at least this share of one product's (measured by the
#: host on the same shapes): far above what the relay's requests cost, far below what a real product costs.
SHARE = 0.4


class Transfers:
    """Inside a ``with`` block on one rank: ``posts``, dicts of what (send/recv), peer, nbytes, blocking, cpu_posted
    and cpu_waited (None when never waited for: then the end of the call)."""

    nested = True  # the tap's observer interface: look at calls inside others (a blocking send's own wait)

    def __init__(self):
        self.posts, self._works, self._last = [], {}, None

    def __enter__(self):
        from labsupport import _sandbox, tap

        self._start = len(_sandbox.record())
        tap.subscribe(self)
        return self

    def __exit__(self, *exc):
        from labsupport import _sandbox, tap

        tap.unsubscribe(self)
        end = time.process_time()
        mine = [e for e in _sandbox.record()[self._start:] if e[0] in ("send", "recv")]
        if mine and len(mine) == len(self.posts):  # the sandbox's CPU time, as the host read it from /proc
            end = _sandbox.cpu_seconds() or max(e[6] or e[5] for e in mine)
            for post, entry in zip(self.posts, mine):
                post["cpu_posted"], post["cpu_waited"] = entry[5], entry[6]
        for post in self.posts:
            if post["cpu_waited"] is None:
                post["cpu_waited"] = end
        return False

    def enter(self, call) -> None:
        if call.is_comm and not call.in_comm and call.kind in ("send", "recv"):
            blocking, outer = False, call.outer
            while outer is not None:  # dist.send is dist.isend(...).wait(): look at every enclosing call
                blocking = blocking or (outer.level == "api" and outer.name in ("send", "recv"))
                outer = outer.outer
            rec = {"what": call.kind, "peer": call.peer, "nbytes": call.nbytes, "blocking": blocking,
                   "cpu_posted": time.process_time(), "cpu_waited": None}
            call.memo["overlap_post"] = rec
            self.posts.append(rec)
            self._last = rec

    def exit(self, call) -> None:
        rec = call.memo.get("overlap_post") if call._memo is not None else None
        if rec is not None:
            if call.result is not None:
                self._works[id(call.result)] = rec
            if rec["blocking"]:
                rec["cpu_waited"] = rec["cpu_posted"]  # nothing of the caller's runs during a blocking call
        elif call.level == "api" and call.name in ("isend", "irecv") and call.result is not None and self._last:
            self._works[id(call.result)] = self._last
        elif call.level == "wait" and call.outer is None:
            rec = self._works.get(id(call.target))
            if rec is not None and rec["cpu_waited"] is None:
                rec["cpu_waited"] = time.process_time()


def under(post) -> float:
    """CPU seconds the function spent between posting ``post`` and waiting for it."""
    return post["cpu_waited"] - post["cpu_posted"]


def product_cpu(*pairs) -> float:
    """CPU seconds of the products ``a @ b`` for each ``(a, b)`` in ``pairs``, on one thread as in a sandbox (the
    least of three runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = math.inf
        for _ in range(3):
            start = time.thread_time()
            for a, b in pairs:
                a @ b
            best = min(best, time.thread_time() - start)
        return best
    finally:
        torch.set_num_threads(threads)


def rows_of(product, weight_shape) -> int | None:
    """The rows of the input a product ``(op, shapes, flops)`` with the weight (either orientation) computed; None if
    it did not use it. The shapes drawn make the weight's two sizes differ from every other size."""
    out, k = weight_shape
    op, shapes, _ = product
    if op.startswith(("add", "badd")):
        shapes = shapes[-2:]
    hits = [i for i, s in enumerate(shapes) if tuple(s[-2:]) in ((out, k), (k, out)) and math.prod(s) == out * k]
    if len(shapes) != 2 or len(hits) != 1:
        return None
    other = shapes[1 - hits[0]]
    if k not in other:
        return None
    return math.prod(other) // k
