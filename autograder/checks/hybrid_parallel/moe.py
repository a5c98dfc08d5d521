"""``check_dispatch_tokens`` and ``check_combine_tokens``: the mixture-of-experts cases drawn for every rank, the
reference dispatch, and the probe that runs on the workers (results against the single-process layer, the bytes
that cross ranks in all-to-all calls, the rows returned against those the all-to-all delivered: ``_InTransit``).
The student's function runs in each rank's grading sandbox; the probe, its counter and ``_InTransit`` in the host.
"""

from __future__ import annotations

import random

import torch

from .._common import draw_seed, in_sandbox, run_on_workers, short


# ---------------------------------------------------------------------------------------------------------------
# mixture of experts: dispatch and combine


def moe_cases(seed: int, world_size: int) -> list:
    """Inputs for every rank: a list of cases, each ``{"num_experts", "tokens": [per rank], "experts": [per rank]}``.
    Every case has an expert that receives no token; some have a rank with no tokens, or every token on one expert."""
    rng = random.Random(seed * 31 + world_size)
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for index in range(4):
        k = rng.choice([1, 2]) if index else 2
        num_experts = world_size * k
        d = rng.randint(16, 24)
        dtype = rng.choice([torch.float32, torch.float64])
        empty = rng.randrange(num_experts)
        allowed = [e for e in range(num_experts) if e != empty]
        if index == 3:
            allowed = [rng.choice(allowed)]  # every token to one expert
        tokens, experts = [], []
        idle = rng.randrange(world_size) if index in (1, 3) else None
        for r in range(world_size):
            n = 0 if r == idle else rng.randint(3, 14)
            tokens.append(torch.randn(n, d, generator=gen, dtype=torch.float64).to(dtype))
            choice = torch.randint(0, len(allowed), (n,), generator=gen)
            experts.append(torch.tensor(allowed, dtype=torch.long)[choice])
        cases.append({"num_experts": num_experts, "tokens": tokens, "experts": experts, "empty": empty})
    return cases


def reference_dispatch(tokens_per_rank, experts_per_rank, num_experts, rank):
    """What ``dispatch_tokens`` returns on ``rank``: per local expert, the rows routed to it, by source rank then
    position."""
    world = len(tokens_per_rank)
    k = num_experts // world
    return [torch.cat([t[e == rank * k + j] for t, e in zip(tokens_per_rank, experts_per_rank)])
            for j in range(k)]


def _expert_fn(e: int, x):
    """What expert ``e`` does in the checks: a narrower output that carries the expert's number."""
    width = x.shape[1] // 2 + 3
    return x[:, :width] * (e + 1) + 0.25 * e


def _agree(failure):
    """Every rank learns the first problem any rank found (rank order), or None: all stop at the same point, and
    whichever rank reports it, the message is the one that explains it."""
    import torch.distributed as dist

    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, failure)
    return next((f for f in found if f is not None), None)


_METADATA = 64  # bytes of counts a rank may exchange per peer and per expert, beyond the rows themselves


def _volume(calls, rows_bytes, remote_bytes, num_experts, world, what):
    kinds = {c.kind for c in calls}
    if kinds & {"send", "recv"}:
        return (f"{what} used send/recv: exchange the rows with dist.all_to_all_single and its input/output "
                "split sizes, the collective this exercise is about.")
    moved = sum(c.nbytes for c in calls if c.kind in ("all_to_all", "all_to_all_single"))
    total = sum(c.nbytes for c in calls)
    if moved < remote_bytes:
        return (f"{what} passed {moved} B through all-to-all calls, but {remote_bytes} B of rows are bound for "
                "other ranks: the rows themselves must travel in the all-to-all.")
    allowed = rows_bytes + _METADATA * (num_experts + world)
    if total > allowed:
        return (f"{what} communicated {total} B ({sorted(kinds)}); sending every row once takes {rows_bytes} B, "
                "plus a few counts: send each row only to the rank that needs it.")
    return None


def _copy(ts):
    return [t.clone() for t in ts]


# ---------------------------------------------------------------------------------------------------------------
# rows changed in transit: what a rank returns must be what its all-to-all delivered


def _bytes(row) -> bytes:
    return row.detach().contiguous().numpy().tobytes()


def _stand_ins(rows) -> dict:
    """For each of ``rows`` (the rows other ranks send this one), a row of the same width and dtype drawn now from
    the operating system's randomness, which no rank holds and nothing the function is given can tell:
    ``{bytes of the row: bytes of its stand-in}``."""
    gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**63))
    taken = {_bytes(r) for r in rows}
    out = {}
    for row in rows:
        new = _bytes(torch.randn(row.shape, generator=gen, dtype=torch.float64).to(row.dtype))
        while new in taken:  # pragma: no cover (never, with random floats)
            new = _bytes(torch.randn(row.shape, generator=gen, dtype=torch.float64).to(row.dtype))
        taken.add(new)
        out[_bytes(row)] = new
    return out


def _swapped(rows, swap: dict):
    """``rows`` with every row that ``swap`` names replaced by its stand-in (what arrives instead of it)."""
    out = rows.clone()
    for i in range(len(rows)):
        new = swap.get(_bytes(rows[i]))
        if new is not None:
            out[i] = torch.frombuffer(bytearray(new), dtype=rows.dtype)
    return out


class _InTransit:
    """While open, every all-to-all this rank makes delivers, in place of each row that ``swap`` names (a row another
    rank sends this one), that row's stand-in: found by its bytes in the call's output buffers once the call has
    completed (when its ``Work.wait()`` returns, the one ``dist.all_to_all_single`` makes or the student's own after
    ``async_op=True``), and overwritten there before the function can read them. A right answer returns the
    stand-ins where the rows belong, and the check expects them there; rows obtained another way (read from a file
    beside a decoy all-to-all of the right size) are the originals, and are found out. Rows a rank keeps for itself
    are not changed. A functional all-to-all is waited for as it is posted."""

    nested = True  # the process-group call, and its wait, are made inside dist.all_to_all_single

    def __init__(self, swap: dict):
        self.swap = swap
        self._pending = []  # (work, its output tensors) of the all-to-alls posted and not yet waited for
        self._busy = False

    def __enter__(self):
        from labsupport import tap

        tap.subscribe(self)
        return self

    def __exit__(self, *exc) -> None:
        from labsupport import tap

        tap.unsubscribe(self)

    def enter(self, call) -> None:
        pass

    def exit(self, call) -> None:
        if self._busy or not self.swap or call.result is None:
            return
        if call.level == "wait":  # the work of an all-to-all completed: its outputs hold what arrived
            for index, (work, outputs) in enumerate(self._pending):
                if work is call.target:
                    del self._pending[index]
                    for t in outputs:
                        self._replace(t)
                    return
            return
        if not call.is_comm or call.in_comm:
            return
        try:
            kind = call.kind
        except Exception:  # arguments the tap cannot read: the call has failed the student already
            return
        if kind not in ("all_to_all", "all_to_all_single"):
            return
        if call.level == "functional":  # the op returns its output, to be waited for with wait_tensor
            self._busy = True
            try:
                torch.ops._c10d_functional.wait_tensor(call.result)
                self._replace(call.result)
            finally:
                self._busy = False
            return
        outputs = call.args[0] if isinstance(call.args[0], (list, tuple)) else [call.args[0]]
        self._pending.append((call.result, list(outputs)))

    def _replace(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.numel():
            return
        target = t.detach()
        flat = target.reshape(-1) if target.is_contiguous() else target.contiguous().reshape(-1)
        raw = flat.view(torch.uint8)
        data = raw.numpy().tobytes()
        found = False
        for old, new in self.swap.items():
            at = data.find(old)
            while at >= 0:
                raw[at:at + len(old)] = torch.frombuffer(bytearray(new), dtype=torch.uint8)
                found = True
                at = data.find(old, at + len(old))
        if found and not target.is_contiguous():
            target.copy_(flat.view(target.dtype).reshape(target.shape))


def _not_delivered(where: str, what: str, row: str, which: str) -> str:
    return (f"{where}: {what} holds {row} as it was sent, not as your all-to-all delivered it: the check changes each "
            f"row in transit, so {which}_tokens must return the rows its all-to-all received.")


def _describe(value) -> str:
    """A value in a few words (no dump of its numbers: messages must stay short enough to be read whole)."""
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} {str(value.dtype).replace('torch.', '')} tensor"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} items"
    return short(value)


def _find_row(row, tokens, experts):
    """Which token of which rank ``row`` is, as words ("rank 1's token 4 (expert 3)"), or None."""
    for source, (t, e) in enumerate(zip(tokens, experts)):
        if row.dtype == t.dtype and row.shape == t.shape[1:]:
            hits = (t == row).all(dim=1).nonzero()
            if len(hits):
                i = int(hits[0])
                return f"rank {source}'s token {i} (expert {int(e[i])})"
    return None


def _moe_probe(fn, seed, which):
    import torch.distributed as dist

    from labsupport import CommCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    for index, case in enumerate(moe_cases(seed, world)):
        E, tokens, experts = case["num_experts"], case["tokens"], case["experts"]
        k = E // world
        mine, route = tokens[rank].clone(), experts[rank].clone()
        owner = route // k
        failure = None
        where = (f"rank {rank}, case {index + 1} of 4 (seed {seed}: {E} experts on {world} ranks, {len(mine)} tokens "
                 f"here, width {mine.shape[1]}, {str(mine.dtype).replace('torch.', '')}; expert {case['empty']} gets "
                 "no token)")
        transit = False  # the failure is a row that did not come out of the all-to-all
        try:
            if which == "dispatch":
                incoming = [row for s in range(world) if s != rank for row in tokens[s][experts[s] // k == rank]]
                swap = _stand_ins(incoming)
                with CommCounter() as cc, _InTransit(swap):
                    got = fn(mine, route, E)
                delivered = [t if s == rank else _swapped(t, swap) for s, t in enumerate(tokens)]
                expected = reference_dispatch(delivered, experts, E, rank)
                if not isinstance(got, (list, tuple)) or len(got) != k:
                    failure = (f"{where}: dispatch_tokens should return a list of {k} tensors (one per local expert, "
                               f"empty ones included), got {_describe(got)}.")
                else:
                    for j, (g, x) in enumerate(zip(got, expected)):
                        e = rank * k + j
                        if not isinstance(g, torch.Tensor) or g.shape != x.shape or g.dtype != x.dtype:
                            failure = (f"{where}: item {j} (expert {e}) should be a {tuple(x.shape)} "
                                       f"{str(x.dtype).replace('torch.', '')} tensor, got {_describe(g)}; an expert "
                                       "with no tokens gets a (0, d) tensor.")
                        elif not torch.equal(g, x):
                            i = int((g != x).any(dim=1).nonzero()[0])
                            want = _find_row(x[i], delivered, experts)
                            if _bytes(g[i]) in swap:
                                transit = True
                                failure = _not_delivered(where, f"item {j} (expert {e}), row {i}",
                                                         _find_row(g[i], tokens, experts), which)
                            else:
                                have = (_find_row(g[i], delivered, experts) or _find_row(g[i], tokens, experts)
                                        or "no token's row (its values changed)")
                                failure = (f"{where}: item {j} (expert {e}), row {i} is {have}; expected {want}. Rows "
                                           "go by source rank, then by position in that rank's tokens.")
                        if failure:
                            break
                rows = mine.numel() * mine.element_size()
                remote = int((owner != rank).sum()) * mine.shape[1] * mine.element_size()
                volume = _volume(cc.calls, rows, remote, E, world, "dispatch_tokens")
                failure = volume if volume and (transit or not failure) else failure
            else:
                inputs = reference_dispatch(tokens, experts, E, rank)
                outputs = [_expert_fn(rank * k + j, x) for j, x in enumerate(inputs)]
                given = _copy(outputs)
                width = mine.shape[1] // 2 + 3
                expected = torch.zeros(len(mine), width, dtype=mine.dtype)
                for i in range(len(mine)):
                    expected[i] = _expert_fn(int(route[i]), mine[i:i + 1])[0]
                swap = _stand_ins([expected[i] for i in range(len(mine)) if int(owner[i]) != rank])
                with CommCounter() as cc, _InTransit(swap):
                    got = fn(given, route, E)
                sent = expected
                expected = _swapped(expected, swap)
                if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
                    failure = (f"{where}: combine_tokens should return a ({len(mine)}, {width}) "
                               f"{str(expected.dtype).replace('torch.', '')} tensor (one row per token of this rank, "
                               f"the experts' width), got {_describe(got)}.")
                elif not torch.equal(got, expected) and _bytes(got[(got != expected).any(dim=1)][0]) in swap:
                    bad = int((got != expected).any(dim=1).nonzero()[0])
                    transit = True
                    same = int((sent == got[bad]).all(dim=1).nonzero()[0])
                    failure = _not_delivered(where, f"row {bad} (token {bad}, expert {int(route[bad])})",
                                             f"the output for token {same} (expert {int(route[same])})", which)
                elif not torch.equal(got, expected):
                    bad = int((got != expected).any(dim=1).nonzero()[0])
                    hint = ""
                    order = torch.argsort(route, stable=True)
                    if torch.equal(got, expected[order]):
                        hint = (" Your rows are sorted by expert: put each row back at the position of its token "
                                "(the inverse of the permutation that grouped them by expert).")
                    same = (expected == got[bad]).all(dim=1).nonzero()
                    have = (f"the output for token {int(same[0])} (expert {int(route[int(same[0])])})" if len(same)
                            else "no output of any expert for this rank's tokens")
                    failure = (f"{where}: row {bad} (token {bad}, routed to expert {int(route[bad])}) holds "
                               f"{have}.{hint}")
                rows = sum(o.numel() * o.element_size() for o in outputs)
                own_rows = sum(int(((experts[s] // k) == rank).sum()) for s in range(world) if s != rank)
                remote = own_rows * width * mine.element_size()
                volume = _volume(cc.calls, rows, remote, E, world, "combine_tokens")
                failure = volume if volume and (transit or not failure) else failure
                if failure is None and any(not torch.equal(a, b) for a, b in zip(given, outputs)):
                    failure = f"{where}: combine_tokens changed expert_outputs in place: leave its inputs untouched."
            if failure is None and (not torch.equal(mine, tokens[rank]) or not torch.equal(route, experts[rank])):
                failure = (f"{where}: {which}_tokens changed its inputs in place: leave tokens and expert_of_token "
                           "untouched.")
        except (NotImplementedError, AssertionError):
            raise
        except Exception as exc:
            # raise at once: the other ranks may be blocked in a collective this rank never reached, and the
            # launcher stops them when one rank fails
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            if any(sign in text for sign in ("Connection reset", "Connection closed", "Received data size")):
                raise AssertionError(
                    f"{where}: {which}_tokens lost its connection inside an all-to-all ({text[:100]}): another rank "
                    "crashed there. The sizes each rank expects (output_split_sizes) must equal what its peers send "
                    "it: exchange the counts with an all-to-all first.") from None
            notes = " ".join(getattr(exc, "__notes__", None) or ())
            if "invalid for input of size" in text and "all_to_all" in notes.rsplit("File ", 1)[-1]:
                raise AssertionError(  # the all-to-all delivered another number of rows than its output holds
                    f"{where}: {which}_tokens received other sizes than its output_split_sizes said ({text[:80]}): "
                    "the sizes each rank expects must equal what its peers send it: exchange the counts with an "
                    "all-to-all first.") from None
            raise AssertionError(f"{where}: {which}_tokens raised {type(exc).__name__}: {text[:200]}") from None
        first = _agree(failure)
        if first is not None:
            raise AssertionError(first)
    return True


SIGNATURES = {"dispatch": "dispatch_tokens(tokens, expert_of_token, num_experts)",
              "combine": "combine_tokens(expert_outputs, expert_of_token, num_experts)"}


def _check_moe(fn, which, timeout):
    seed = draw_seed()
    fn = in_sandbox(fn, SIGNATURES[which])
    for world in (2, 3, 4):
        run_on_workers(_moe_probe, fn, seed, which, world_size=world, what=f"{which}_tokens", timeout=timeout)


def check_dispatch_tokens(dispatch_tokens, timeout=30):
    """On 2, 3, 4 ranks: each expert's rows, in source-rank order, sent once through all-to-all."""
    _check_moe(dispatch_tokens, "dispatch", timeout)


def check_combine_tokens(combine_tokens, timeout=30):
    """On 2, 3, 4 ranks: every token's expert output back at the token's position, through all-to-all."""
    _check_moe(combine_tokens, "combine", timeout)
