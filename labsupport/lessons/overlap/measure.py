"""Measuring overlap inside a rank: ``OverlapTimeline`` records every transfer (from the moment it is posted to the
moment the rank's ``wait()`` returns, or the blocking call returns) and every matrix product as spans of a
``labsupport.Timeline``; ``matmul_overlap`` runs an exercise (or the blocking baseline) under it on every rank.

The transfers come from ``labsupport.tap`` (the tap ``CommCounter`` reads), the products from a
``TorchFunctionMode`` that times ``@``, ``matmul``, ``mm``, ``bmm``, ``F.linear``, ``einsum`` and
``scaled_dot_product_attention``. A transfer counts as hidden for the time a product ran while it was in flight.
``ring_overlap_problem`` reads those spans in order (not their durations): which ring step's transfer had no
product running under it, and why.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from ...i18n import _
from ...timeline import Timeline

__all__ = ["OverlapTimeline", "matmul_overlap", "allgather_then_matmul", "matmul_then_reduce_scatter",
           "ring_overlap_problem"]

_PRODUCTS = {"matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm", "linear", "einsum",
             "scaled_dot_product_attention"}
_ASYNC = {"isend", "irecv", "batch_isend_irecv"}


class OverlapTimeline(TorchFunctionMode):
    """``with OverlapTimeline() as ot:`` inside a worker; then ``ot.timeline.events`` (products as ``"compute"``
    spans named ``matmul``, transfers as ``"comm"`` spans named ``send N B`` / ``recv N B`` / the collective's name)
    and ``ot.hidden()``, the share of transfer time during which a product ran."""

    nested = True

    def __init__(self, timeline: Timeline | None = None):
        super().__init__()
        self.timeline = timeline or Timeline()
        self._open = {}      # id(work) -> (name, start)

    def __enter__(self):
        from ... import tap

        tap.subscribe(self)
        return super().__enter__()

    def __exit__(self, *exc):
        from ... import tap

        tap.unsubscribe(self)
        now = self.timeline.now()
        for name, start in self._open.values():    # never waited for: in flight until the end
            self.timeline.add(name, start, now, "comm")
        self._open.clear()
        self.timeline.events.sort(key=lambda e: e.start)
        return super().__exit__(*exc)

    def hidden(self) -> float:
        return Timeline.hidden_fraction(self.timeline.events)

    # the tap
    def enter(self, call) -> None:
        if call.outer is None and call.level in ("api", "wait"):
            call.memo["overlap_t0"] = self.timeline.now()

    def exit(self, call) -> None:
        if call._memo is None or "overlap_t0" not in call.memo:
            return
        start, now = call.memo["overlap_t0"], self.timeline.now()
        if call.level == "wait":
            opened = self._open.pop(id(call.target), None)
            if opened is not None:
                self.timeline.add(opened[0], opened[1], now, "comm")
            return
        if call.name == "batch_isend_irecv" and isinstance(call.result, list):
            for work in call.result:
                self._open[id(work)] = ("p2p batch", start)
        elif call.name in _ASYNC and call.result is not None:
            nbytes = call.args[0].numel() * call.args[0].element_size() if call.args else 0
            self._open[id(call.result)] = (f"{call.name[1:]} {nbytes} B", start)
        elif call.name not in ("barrier", "get_rank", "get_world_size"):
            self.timeline.add(call.name, start, now, "comm")

    # the products
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name not in _PRODUCTS:
            return func(*args, **(kwargs or {}))
        start = self.timeline.now()
        out = func(*args, **(kwargs or {}))
        self.timeline.add("matmul", start, self.timeline.now())
        return out


def allgather_then_matmul(x_shard, weight, group=None):
    """The blocking baseline: the built-in all-gather, then one product of the whole input."""
    parts = [torch.empty_like(x_shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x_shard, group=group)
    return torch.cat(parts) @ weight.T


def matmul_then_reduce_scatter(x, weight_shard, group=None):
    """The blocking baseline: one product of the whole input, then the built-in reduce-scatter."""
    partial = x @ weight_shard.T
    chunks = list(partial.chunk(dist.get_world_size(group)))
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out


def matmul_overlap(fn, kind: str = "allgather", rows: int = 256, k: int = 512, out: int = 512,
                   repeats: int = 3, seed: int = 0) -> dict:
    """On every rank: run ``fn`` (``allgather_matmul`` or ``matmul_reduce_scatter``, yours or a baseline) once to
    warm up, then ``repeats`` times under an ``OverlapTimeline``; return the fastest run's ``events``,
    ``seconds`` and ``hidden`` share. ``kind="allgather"``: ``x_shard (rows, k)``, ``weight (out, k)``;
    ``kind="reduce_scatter"``: ``x (world·rows, k)``, ``weight_shard (out, k)``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(rows if kind == "allgather" else world * rows, k, generator=gen)
    w = torch.randn(out, k, generator=gen)
    fn(x, w)
    best = None
    for _ in range(repeats):
        dist.barrier()
        with OverlapTimeline() as ot:
            fn(x, w)
        seconds = ot.timeline.now()
        if best is None or seconds < best["seconds"]:
            best = {"events": ot.timeline.events, "seconds": seconds, "hidden": ot.hidden()}
    return best


def _direction(name: str) -> str | None:
    """``"send"`` or ``"recv"`` for a transfer span of ``OverlapTimeline`` (``send 96 B``, or ``send`` when it was
    the blocking call), else None."""
    word = name.split(" ", 1)[0]
    return word if word in ("send", "recv") else None


def ring_overlap_problem(events, steps: int, first: int = 0, rank: int | None = None,
                         any_product: bool = False) -> str | None:
    """What is wrong with the overlap of one rank's ring, in words, or None: ``events`` are the rank's
    ``OverlapTimeline`` spans around one call of a ring exercise (``ot.timeline.events``), ``steps`` its ring steps.

    For ring step k = 1 .. ``steps``, the k-th send and the k-th receive must each be posted with ``isend``/``irecv``
    before matrix product number k + ``first`` starts and waited for after it ends (``allgather_matmul``: first = 0,
    the chunk already here is multiplied while the next one travels; ``matmul_reduce_scatter``: first = 1, the
    next partial product runs while the accumulator travels). With ``any_product`` (zig-zag attention, several
    block products per step) it is enough that some product runs while each transfer is in flight. Only the order
    of the spans counts, never how long they took."""
    who = _("this rank") if rank is None else f"rank {rank}"
    spans = sorted(events, key=lambda e: e.start)
    products = [e for e in spans if e.kind == "compute"]
    for kind in ("send", "recv"):
        transfers = [e for e in spans if e.kind == "comm" and _direction(e.name) == kind]
        for k, t in enumerate(transfers[:steps], start=1):
            if t.name in ("send", "recv"):
                return _("{who} used the blocking dist.{kind} for ring step {step}: it returns only when the transfer "
                         "is over, so no product can run during it. Post it with dist.i{kind}, multiply, then wait() "
                         "on the request.").format(who=who, kind=kind, step=k)
            if any_product:
                if not any(t.start <= p.start and p.end <= t.end for p in products):
                    return _("{who}'s {kind} of ring step {step} had no block product running while it was in "
                             "flight: post the next step's isend/irecv, compute with the k/v already here, then "
                             "wait.").format(who=who, kind=kind, step=k)
                continue
            if k + first > len(products):
                return _("{who} ran {count} matrix product(s), so no product could run during the {kind} of "
                         "ring step {step}: compute one product per chunk, each while the next transfer travels."
                         ).format(who=who, count=len(products), kind=kind, step=k)
            p = products[k + first - 1]
            n = k + first
            if p.start < t.start:
                return _("{who} ran matrix product {product} before posting the {kind} of ring step {step}: post the "
                         "next isend/irecv first, then multiply, so that the transfer travels during the product."
                         ).format(who=who, product=n, kind=kind, step=k)
            if t.end < p.end:
                return _("{who} waited for the {kind} of ring step {step} before matrix product {product}: post the "
                         "next isend/irecv before the product and wait after it.").format(who=who, kind=kind, step=k,
                                                                                          product=n)
    return None
