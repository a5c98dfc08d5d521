"""What a grading host does with each request its sandbox relays (``labsupport._relay``): the real
``torch.distributed`` call on the host's own process group, logged with when it was posted and waited for.

``Carrier`` is the part of the host (``labsupport._sandbox_host._Host``) that performs requests: a request's tensors
are views of the arena the two share (``labsupport._arena``) or come in the message; its outputs are made in the
place of the arena the sandbox took for them, so that they cross back without a copy. Each request is made before
the sandbox hears back (so that a check's refusal of it raises at the student's call), with the time and, for a
transfer, the sandbox's CPU time read first, while the sandbox waits.
"""

from __future__ import annotations

import time

from ._plain import SandboxRefused

_KIND = {"isend": "send", "irecv": "recv"}


class Carrier:
    """The request side of a host: ``self`` has ``arena``, ``groups``, ``pending``, ``log``, ``rank``,
    ``world_size``, ``allow``, ``what``, ``returned`` and the ``_send``, ``cpu`` and ``trim`` of ``_Host``."""

    def _refuse(self, text: str):
        self.refused_now.append(text)
        self.refused.append(text)
        raise SandboxRefused(text)

    def _group(self, name):
        return self.groups.get(name, (None, list(range(self.world_size))))

    def _in(self, item):
        """A tensor the sandbox handed over: a view of the arena (no copy), or made from the message's bytes."""
        from ._relay import tensor

        return tensor(self.arena, item)

    def _items(self, outputs):
        """The answer's tensors as they cross back: their place when they lie in the arena, else their bytes."""
        from ._relay import raw

        if outputs is None:
            return None
        items = []
        for t in outputs:
            offset = self.arena.offset_of(t) if self.arena is not None else None
            items.append(raw(t) if offset is None else (str(t.dtype).replace("torch.", ""), tuple(t.shape), offset))
        return items

    def _request(self, kind: str, name, args):
        import torch.distributed as dist

        if kind == "new_group":
            # only the members make it (the sandbox of a rank outside the group tells its host nothing): named
            # from its ranks, not from a count every rank of the world must share
            self.groups[name] = (dist.new_group(args[0], use_local_synchronization=True), list(args[0]))
            return None
        if kind == "wait":
            work, outputs, entry, self.current = self.pending.pop(args[0])
            done = work.wait()
            if isinstance(work, _Then):
                outputs = done if isinstance(done, list) else [done]
            entry[4] = time.perf_counter()
            if entry[0] in ("send", "recv"):
                entry[6] = self.cpu()
            return self._items(outputs)
        blocking, out, args = args[0], _Outputs(self.arena, args[1]), args[2:]
        spans = self.current = _spans(args, args_region=out)
        if spans:
            self.arena_top = max(self.arena_top, max(hi for _, hi in spans))
        op = _KIND.get(kind, kind)
        if self.returned:
            self._refuse(f"grading refused: {self.what} called torch.distributed.{op} after it returned (a result "
                         "that communicates when it is read, such as a tensor subclass): return plain tensors")
        if self.allow is not None and op not in self.allow:
            allowed = ("send/recv (or isend/irecv)" if self.allow == {"send", "recv"} else
                       "/".join(sorted(self.allow)) or "no communication")
            self._refuse(f"{self.what} called torch.distributed.{op} on rank {self.rank}: build it from {allowed} "
                         "only; the built-in is what you are re-implementing, so it is not available inside this "
                         "exercise's call.")
        group, ranks = self._group(name)
        me = ranks.index(self.rank) if self.rank in ranks else None
        nbytes = 0
        posted = time.perf_counter()
        cpu_posted = self.cpu() if op in ("send", "recv") else None  # what 10's overlap reads: transfers only
        if kind in ("isend", "irecv"):
            if not (isinstance(args[0], int) and 0 <= args[0] < len(ranks)):
                raise ValueError(f"{op} to or from rank {args[0]!r}: the group has ranks 0 to {len(ranks) - 1}")
            peer = ranks[args[0]]
        # the post is made before the sandbox hears back: a check's observer that refuses it (a peer that is not a
        # neighbour) raises at the student's isend, as on a worker
        if kind == "isend":
            _, tag, item = args
            t = self._in(item)
            nbytes, outputs = t.numel() * t.element_size(), None
            if blocking:
                work = dist.send(t, peer, group=group, tag=tag)  # None
            else:
                work = dist.isend(t, peer, group=group, tag=tag)
        elif kind == "irecv":
            _, tag, dtype, shape = args
            t = out.empty(shape, dtype)
            outputs = [t]
            if blocking:
                dist.recv(t, peer, group=group, tag=tag)
                work = None
            else:
                work = dist.irecv(t, peer, group=group, tag=tag)
        else:
            work, outputs, peer = self._collective(kind, args, group, ranks, me, out)
            nbytes = _sent_bytes(kind, args)
        entry = [op, peer, nbytes, posted, None, cpu_posted, None]
        self.log.append(entry)
        if blocking:
            done = work.wait() if work is not None else None
            if isinstance(work, _Then):
                outputs = done if isinstance(done, list) else [done]
            entry[4], entry[6] = time.perf_counter(), cpu_posted
            return self._items(outputs)
        handle = self.next_handle
        self.next_handle += 1
        self.pending[handle] = (work, outputs, entry, spans)
        return handle

    def _collective(self, kind, args, group, ranks, me, out):
        import torch
        import torch.distributed as dist

        unraw = self._in

        ops = {"SUM": dist.ReduceOp.SUM, "PRODUCT": dist.ReduceOp.PRODUCT, "MIN": dist.ReduceOp.MIN,
               "MAX": dist.ReduceOp.MAX, "AVG": dist.ReduceOp.AVG, "BAND": dist.ReduceOp.BAND,
               "BOR": dist.ReduceOp.BOR, "BXOR": dist.ReduceOp.BXOR}
        if kind == "all_reduce":
            ts = [unraw(x) for x in args[0]]
            if len(ts) == 1:
                return dist.all_reduce(ts[0], ops[args[1]], group=group, async_op=True), ts, None
            # several tensors in one call (all_reduce_coalesced): one all-reduce of them flattened, as gloo does it
            flat = torch.cat([t.reshape(-1) for t in ts])
            work = dist.all_reduce(flat, ops[args[1]], group=group, async_op=True)
            return _Then(work, lambda: list(flat.split([t.numel() for t in ts]))), ts, None
        if kind == "broadcast":
            ts = [unraw(x) for x in args[0]]
            return dist.broadcast(ts[0], ranks[args[1]], group=group, async_op=True), ts, ranks[args[1]]
        if kind == "reduce":
            ts = [unraw(x) for x in args[0]]
            return dist.reduce(ts[0], ranks[args[1]], ops[args[2]], group=group, async_op=True), ts, ranks[args[1]]
        if kind == "all_gather":
            t = unraw(args[0])
            outs = [out.empty(t.shape, t.dtype) for _ in ranks]
            return dist.all_gather(outs, t, group=group, async_op=True), outs, None
        if kind == "gather":
            t = unraw(args[0])
            outs = [out.empty(t.shape, t.dtype) for _ in ranks] if me == args[1] else None
            return dist.gather(t, outs, ranks[args[1]], group=group, async_op=True), outs or [], ranks[args[1]]
        if kind == "scatter":
            chunks, root, dtype, shape = args
            mine = out.empty(shape, dtype)
            src = [unraw(x) for x in chunks] if me == root and chunks is not None else None
            return dist.scatter(mine, src, ranks[root], group=group, async_op=True), [mine], ranks[root]
        if kind == "reduce_scatter":
            chunks = [unraw(x) for x in args[0]]
            if len({(c.shape, c.dtype) for c in chunks}) == 1:  # gloo's own reduce-scatter: what a counter expects
                mine = out.empty(chunks[me].shape, chunks[me].dtype)
                return dist.reduce_scatter(mine, chunks, ops[args[1]], group=group, async_op=True), [mine], None
            flat = torch.cat([c.reshape(-1) for c in chunks])  # uneven chunks: through an all-reduce
            dist_work = dist.all_reduce(flat, ops[args[1]], group=group, async_op=True)
            mine = chunks[me]
            start = sum(c.numel() for c in chunks[:me])
            return _Then(dist_work, lambda: flat[start:start + mine.numel()].reshape(mine.shape)), [mine], None
        if kind == "all_to_all":
            ins, expected = [unraw(x) for x in args[0]], list(args[1])  # what this rank sends, what it expects
            flat_in = torch.cat([t.reshape(-1) for t in ins])
            sizes = [t.numel() for t in ins]
            whole = out.empty((sum(expected),), flat_in.dtype)
            work = dist.all_to_all_single(whole, flat_in, expected, sizes, group=group, async_op=True)
            return work, list(whole.split(expected)), None
        if kind == "barrier":
            return dist.barrier(group=group, async_op=True), None, None
        raise RuntimeError(f"torch.distributed call {kind} is not available in grading")


def _sent_bytes(kind: str, args) -> int:
    """The bytes of the tensors a collective request hands over (what this rank contributes)."""
    from ._relay import _nbytes

    first = args[0] if args else None
    items = first if isinstance(first, list) else [first]
    return sum(_nbytes(x) for x in items if isinstance(x, tuple) and len(x) == 3
               and isinstance(x[2], (bytes, int)))


def _spans(args, args_region) -> list:
    """The places of the arena a request uses: its tensors' (``put``) and its outputs' (``(start, end)``)."""
    from ._relay import _nbytes

    spans = []

    def visit(x):
        if isinstance(x, tuple) and len(x) == 3 and isinstance(x[2], int) and isinstance(x[0], str):
            spans.append((x[2], x[2] + _nbytes(x)))
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)

    visit(list(args))
    if args_region.at is not None:
        spans.append((args_region.at, args_region.end))
    return spans


class _Outputs:
    """Where the host creates a request's outputs: one after the other in the place of the arena the sandbox took
    for them (``region``), or, past its end or without one, as tensors of its own."""

    def __init__(self, arena, region):
        self.arena = arena
        placed = arena is not None and isinstance(region, tuple) and len(region) == 2
        self.at, self.end = region if placed else (None, 0)

    def empty(self, shape, dtype):
        import torch

        from ._arena import _ALIGN, _nbytes

        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        shape = tuple(shape)
        if self.at is not None:
            n = _nbytes(dtype, shape)
            start = -(-self.at // _ALIGN) * _ALIGN
            if start + n <= self.end:
                try:
                    t = self.arena.view(start, dtype, shape)
                except ValueError:
                    pass
                else:
                    self.at = start + n
                    return t
        return torch.empty(shape, dtype=dtype)


class _Then:
    """A request whose result needs one more step after the real one completes."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self):
        self.work.wait()
        return self.then()
