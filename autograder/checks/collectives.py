"""Checks for notebook 01_collectives: the eight collectives built from point-to-point calls.

Each ``check_<name>(fn)`` runs ``fn`` on real workers for world sizes 2, 3, 4, 5 and 1, with a few trials per world
size (float and int dtypes, several shapes, a random ``src``/``dst``), all drawn from a seed chosen at grading
time. On every trial:

1. each rank computes the expected answer with ``torch.distributed``'s own collective, on copies of its inputs;
2. each rank calls the student's function inside a ``CommCounter``;
3. the ranks share what they got (outside the counter) and every rank runs the same diagnosis: only
   ``send``/``recv`` (or ``isend``/``irecv``) called, then the answer (type, length, shape, dtype, values), then
   the inputs the semantics leave alone. The first rank found wrong raises the message; the others stop quietly.

Every rank can rebuild every rank's inputs from the seed, so a wrong answer is described by what it holds
("item 1 holds rank 0's tensor, expected rank 1's"), not only by what it does not. The first failing trial stops
the check. Values are multiples of 1/4 in a small range, so sums are exact in any order and dtype.
A deadlocking answer is stopped after ``timeout`` seconds (default ``_common.PROBE_TIMEOUT``).
"""

from __future__ import annotations

import random

import labsupport

from ._common import close, draw_seed, expect_tensor, only_point_to_point, run_on_workers, short

__all__ = [
    "check_broadcast",
    "check_reduce",
    "check_all_reduce",
    "check_gather",
    "check_all_gather",
    "check_scatter",
    "check_reduce_scatter",
    "check_all_to_all",
]

WORLD_SIZES = (2, 3, 4, 5, 1)
SHAPES = ((5,), (2, 3), (3, 1, 2), (1,), (4, 4))
DTYPES = ("float32", "int64", "float64", "int32")
TRIALS_PER_WORLD_SIZE = 3

SIGNATURES = {
    "broadcast": "broadcast(tensor, src)",
    "reduce": "reduce(tensor, dst)",
    "all_reduce": "all_reduce(tensor)",
    "gather": "gather(tensor, dst)",
    "all_gather": "all_gather(tensor)",
    "scatter": "scatter(out, chunks, src)",
    "reduce_scatter": "reduce_scatter(chunks)",
    "all_to_all": "all_to_all(chunks)",
}

IN_PLACE_HINT = (
    "The result must be written into the tensor you were given (tensor.copy_(...), tensor += ..., or "
    "dist.recv(tensor, ...)): assigning a new tensor to the parameter name does not change the caller's tensor."
)


# ----------------------------------------------------------------------------------------------------------------
# Inputs: every rank can rebuild every rank's inputs


def _draw_trials(seed: int, world_size: int) -> list[dict]:
    rng = random.Random(f"{seed}-{world_size}")
    dtypes = list(DTYPES)
    rng.shuffle(dtypes)
    trials = []
    for i in range(TRIALS_PER_WORLD_SIZE):
        trial = {
            "seed": seed,
            "data_seed": rng.randrange(2**30),
            "dtype": dtypes[i % len(dtypes)],
            "shape": rng.choice(SHAPES),
            "root": rng.randrange(world_size),
        }
        while not _telling(trial, world_size):
            trial["data_seed"] = rng.randrange(2**30)
        trials.append(trial)
    return trials


def _telling(trial: dict, n: int) -> bool:
    """Whether no two of the answers the diagnoses tell apart happen to be equal for this trial's inputs.

    With a one-element shape, two ranks can draw the same value; "your own chunk" and "the others' sum" are then
    the same number, and a diagnosis would name the wrong mistake. Such draws are replaced by new ones.
    """
    if n == 1:
        return True
    tensors = [_tensor_of(trial, r) for r in range(n)]
    total = sum(tensors)
    chunks = [_chunks_of(trial, r, n) for r in range(n)]
    sums = [sum(chunks[r][j] for r in range(n)) for j in range(n)]
    families = [
        tensors + [total],  # whose tensor a rank holds; the total where only dst's may be
        [c for row in chunks for c in row],  # whose chunk an item is (all_to_all)
        chunks[trial["root"]] + [_garbage(trial, r) for r in range(n)],  # scatter: which chunk, or still untouched
    ]
    for r in range(n):
        mean = [total / n] if total.dtype.is_floating_point else []
        families.append([tensors[r], total - tensors[r], total] + mean)  # reduce, all_reduce
        families.append([chunks[r][r], sums[r] - chunks[r][r], sum(chunks[r])] + sums)  # reduce_scatter
    return all(_distinct(family) for family in families)


def _distinct(tensors: list) -> bool:
    keys = {tuple(t.reshape(-1).tolist()) for t in tensors}
    return len(keys) == len(tensors)


def _values(trial: dict, rank: int, shape, salt: int):
    import torch

    g = torch.Generator().manual_seed(trial["data_seed"] * 1009 + rank * 31 + salt)
    ints = torch.randint(-200, 201, tuple(shape), generator=g)
    dtype = getattr(torch, trial["dtype"])
    return (ints.to(dtype) / 4) if dtype.is_floating_point else ints.to(dtype)


def _tensor_of(trial: dict, rank: int):
    """The tensor rank ``rank`` contributes (broadcast, reduce, all_reduce, gather, all_gather)."""
    return _values(trial, rank, trial["shape"], 0)


def _chunks_of(trial: dict, rank: int, world_size: int) -> list:
    """The ``world_size`` chunks rank ``rank`` holds (scatter on src, reduce_scatter, all_to_all)."""
    return list(_values(trial, rank, (world_size, *trial["shape"]), 1).unbind(0))


def _garbage(trial: dict, rank: int):
    """What ``out`` holds before scatter fills it."""
    return _values(trial, rank, trial["shape"], 2) + 1000


def _describe(trial: dict, call: str) -> str:
    return f"{call} with {trial['dtype']} tensors of shape {tuple(trial['shape'])} (seed {trial['seed']})"


def _show(obj) -> str:
    """Like ``short``, but a list of tensors stays readable: its length and its first items."""
    if isinstance(obj, list):
        head = ", ".join(short(x, limit=4) for x in obj[:2])
        more = ", ..." if len(obj) > 2 else ""
        return f"a list of {len(obj)} item(s) [{head}{more}]"
    return short(obj)


class Opaque:
    """Stands for a returned value that is neither a tensor, a list/tuple nor None (it is shown, never compared)."""

    def __init__(self, obj):
        self.text = f"{type(obj).__name__} {short(obj)}"

    def __repr__(self) -> str:
        return self.text


def _portable(obj):
    """A picklable copy of what the student's function returned, so that every rank can look at every answer."""
    import torch

    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, (list, tuple)):
        return [_portable(x) for x in obj]
    return Opaque(obj)


def _same(a, b) -> bool:
    return close(a, b)


def _which(t, candidates: dict):
    """The key of the first candidate equal to ``t``, or None."""
    for key, c in candidates.items():
        if _same(t, c):
            return key
    return None


class _Problem(Exception):
    """A wrong answer, blamed on one rank (that rank raises the message; the others stop quietly)."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank
        self.message = message


def _expect(rank: int, got, expected, what: str, hint: str) -> None:
    try:
        expect_tensor(got, expected, what, hint)
    except AssertionError as exc:
        raise _Problem(rank, str(exc)) from None


def _expect_list(rank: int, got, what: str, n: int, extra: str = "") -> list:
    if not isinstance(got, list):
        raise _Problem(rank, f"{what} should return a list of {n} tensors, got {short(got)}.{extra}")
    if len(got) != n:
        raise _Problem(rank, f"{what} returned a list of {len(got)} items, expected {n} (one per rank).")
    return got


def _expect_unchanged(rank: int, after, before, what: str, hint: str) -> None:
    if not _same(after, before):
        raise _Problem(rank, f"{what} was modified: it was {short(before)}, now {short(after)}. {hint}")


# ----------------------------------------------------------------------------------------------------------------
# Each collective has a *run* (on every rank: the built-in's answer on copies, then the student's call inside a
# CommCounter; returns a report) and a *diagnosis* (given every rank's report, the same on every rank: raises
# _Problem naming the first rank whose answer is wrong and what it holds instead).


def _run_broadcast(fn, trial, rank, n):
    import torch.distributed as dist

    src = trial["root"]
    expected = _tensor_of(trial, rank)
    dist.broadcast(expected, src=src)
    x = _tensor_of(trial, rank)
    with labsupport.CommCounter() as cc:
        fn(x, src)
    return {"expected": expected, "after": x, "comm": cc.summary}


def _diagnose_broadcast(trial, n, reports):
    src = trial["root"]
    inputs = {r: _tensor_of(trial, r) for r in range(n)}
    desc = _describe(trial, f"broadcast(tensor, src={src})")
    x = reports[src]["after"]
    if not _same(x, inputs[src]):
        k = _which(x, inputs)
        why = f" (it now holds rank {k}'s tensor: did you use src as the root, and not rank {k}?)" if k is not None else ""
        raise _Problem(
            src, f"{desc}: the source's tensor (rank {src}) changed from {short(inputs[src])} to {short(x)}{why}; "
            "the source's tensor must stay as it is."
        )
    for r in range(n):
        x, exp = reports[r]["after"], reports[r]["expected"]
        if _same(x, exp):
            continue
        where = f"{desc}: rank {r}'s tensor"
        k = _which(x, inputs)
        if k == r:
            raise _Problem(r, f"{where} still holds its own values {short(x)}, expected rank {src}'s. {IN_PLACE_HINT}")
        if k is not None:
            raise _Problem(r, f"{where} holds rank {k}'s tensor, expected rank {src}'s: did you use src as the root?")
        _expect(r, x, exp, where, "It should hold an exact copy of the source's tensor.")


def _run_reduce(fn, trial, rank, n):
    import torch.distributed as dist

    dst = trial["root"]
    expected = _tensor_of(trial, rank)
    dist.reduce(expected, dst=dst)
    if rank != dst:
        expected = _tensor_of(trial, rank)  # our semantics: only dst's tensor changes
    x = _tensor_of(trial, rank)
    with labsupport.CommCounter() as cc:
        fn(x, dst)
    return {"expected": expected, "after": x, "comm": cc.summary}


def _diagnose_reduce(trial, n, reports):
    dst = trial["root"]
    inputs = {r: _tensor_of(trial, r) for r in range(n)}
    total = sum(inputs.values())
    desc = _describe(trial, f"reduce(tensor, dst={dst})")
    for r in range(n):
        x = reports[r]["after"]
        if r == dst or _same(x, inputs[r]):
            continue
        why = (
            f" It holds the sum of all tensors: did you reduce into rank {r} instead of dst={dst}?"
            if _same(x, total)
            else " Receive into a separate buffer (torch.empty_like), not into the tensor you were given."
        )
        raise _Problem(
            r, f"{desc}: rank {r}'s tensor changed from {short(inputs[r])} to {short(x)}; only dst's tensor may "
            f"change.{why}"
        )
    x, exp = reports[dst]["after"], reports[dst]["expected"]
    if _same(x, exp):
        return
    where = f"{desc}: rank {dst}'s tensor (dst)"
    if n > 1 and _same(x, inputs[dst]):
        raise _Problem(dst, f"{where} still holds only its own values {short(x)}, expected the sum. {IN_PLACE_HINT}")
    if n > 1 and _same(x, total - inputs[dst]):
        raise _Problem(dst, f"{where} is the sum of the other ranks' tensors without its own: did you forget dst's "
                       "own contribution?")
    _expect(dst, x, exp, where, "It should be the sum of every rank's tensor (dst's included).")


def _run_all_reduce(fn, trial, rank, n):
    import torch.distributed as dist

    expected = _tensor_of(trial, rank)
    dist.all_reduce(expected)
    x = _tensor_of(trial, rank)
    with labsupport.CommCounter() as cc:
        fn(x)
    return {"expected": expected, "after": x, "comm": cc.summary}


def _diagnose_all_reduce(trial, n, reports):
    inputs = {r: _tensor_of(trial, r) for r in range(n)}
    desc = _describe(trial, "all_reduce(tensor)")
    done = [r for r in range(n) if _same(reports[r]["after"], reports[r]["expected"])]
    for r in range(n):
        x, exp = reports[r]["after"], reports[r]["expected"]
        if r in done:
            continue
        where = f"{desc}: rank {r}'s tensor"
        if n > 1 and _same(x, inputs[r]):
            hint = (
                f"Rank {done[0]} has the sum: did you send the result back to every rank?" if done else IN_PLACE_HINT
            )
            raise _Problem(r, f"{where} still holds its own values {short(x)}, expected the sum. {hint}")
        if n > 1 and _same(x, exp - inputs[r]):
            raise _Problem(r, f"{where} is the sum of the other ranks' tensors: did you forget this rank's own tensor?")
        if n > 1 and exp.dtype.is_floating_point and _same(x, exp / n):
            raise _Problem(r, f"{where} is the average of the tensors; all_reduce sums (do not divide by world_size).")
        _expect(r, x, exp, where, "Every rank should end with the sum of all ranks' tensors.")


def _check_items(rank: int, items: list, expected: list, inputs: dict, what: str) -> None:
    """Item i must equal ``expected[i]`` (rank i's tensor); name what a wrong item holds instead."""
    for i, (item, exp) in enumerate(zip(items, expected)):
        if _same(item, exp):
            continue
        k = _which(item, inputs)
        if k is not None:
            raise _Problem(
                rank, f"{what}: item {i} holds rank {k}'s tensor, expected rank {i}'s: item i must come from rank i. "
                "Check the rank order of your list (an off-by-one?)."
            )
        _expect(rank, item, exp, f"{what}: item {i}", f"Item {i} should be rank {i}'s tensor.")


def _run_gather(fn, trial, rank, n):
    import torch
    import torch.distributed as dist

    dst = trial["root"]
    mine = _tensor_of(trial, rank)
    bucket = [torch.empty_like(mine) for _ in range(n)] if rank == dst else None
    dist.gather(mine, bucket, dst=dst)
    x = _tensor_of(trial, rank)
    with labsupport.CommCounter() as cc:
        got = fn(x, dst)
    return {"expected": bucket, "after": x, "got": _portable(got), "comm": cc.summary}


def _diagnose_gather(trial, n, reports):
    dst = trial["root"]
    inputs = {r: _tensor_of(trial, r) for r in range(n)}
    desc = _describe(trial, f"gather(tensor, dst={dst})")
    for r in range(n):
        got = reports[r]["got"]
        if r != dst and got is not None:
            why = f" Did you use dst={dst} as the root?" if isinstance(got, list) else ""
            raise _Problem(r, f"{desc} returned {_show(got)} on rank {r}; it returns None on every rank except "
                           f"dst.{why}")
    what = f"{desc} on rank {dst} (dst)"
    got = _expect_list(dst, reports[dst]["got"], what, n)
    _check_items(dst, got, reports[dst]["expected"], inputs, what)
    for r in range(n):
        _expect_unchanged(r, reports[r]["after"], inputs[r], f"{desc}: rank {r}'s input tensor",
                          "gather must not change its input.")


def _run_all_gather(fn, trial, rank, n):
    import torch
    import torch.distributed as dist

    mine = _tensor_of(trial, rank)
    bucket = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(bucket, mine)
    x = _tensor_of(trial, rank)
    with labsupport.CommCounter() as cc:
        got = fn(x)
    return {"expected": bucket, "after": x, "got": _portable(got), "comm": cc.summary}


def _diagnose_all_gather(trial, n, reports):
    inputs = {r: _tensor_of(trial, r) for r in range(n)}
    desc = _describe(trial, "all_gather(tensor)")
    for r in range(n):
        what = f"{desc} on rank {r}"
        got = _expect_list(r, reports[r]["got"], what, n)
        _check_items(r, got, reports[r]["expected"], inputs, what)
    for r in range(n):
        _expect_unchanged(r, reports[r]["after"], inputs[r], f"{desc}: rank {r}'s input tensor",
                          "all_gather must not change its input.")


def _run_scatter(fn, trial, rank, n):
    import torch.distributed as dist

    src = trial["root"]
    expected = _garbage(trial, rank)
    dist.scatter(expected, _chunks_of(trial, rank, n) if rank == src else None, src=src)
    out = _garbage(trial, rank)
    chunks = _chunks_of(trial, rank, n) if rank == src else None
    with labsupport.CommCounter() as cc:
        fn(out, chunks, src)
    return {"expected": expected, "after": out, "chunks": chunks, "comm": cc.summary}


def _diagnose_scatter(trial, n, reports):
    src = trial["root"]
    desc = _describe(trial, f"scatter(out, chunks, src={src})")
    src_chunks = _chunks_of(trial, src, n)
    for r in range(n):
        out, exp = reports[r]["after"], reports[r]["expected"]
        if _same(out, exp):
            continue
        where = f"{desc}: rank {r}'s out"
        if _same(out, _garbage(trial, r)):
            extra = " The source must also copy its own chunk into its out." if r == src else ""
            raise _Problem(r, f"{where} was not filled (it still holds {short(out)}).{extra} {IN_PLACE_HINT}")
        j = _which(out, dict(enumerate(src_chunks)))
        if j is not None:
            raise _Problem(r, f"{where} holds chunks[{j}] of rank {src}, expected chunks[{r}]: rank r gets chunks[r].")
        _expect(r, out, exp, where, f"It should hold chunks[{r}] of rank {src}.")
    for j in range(n):
        _expect_unchanged(src, reports[src]["chunks"][j], src_chunks[j], f"{desc}: chunks[{j}] on the source",
                          "scatter must not change the chunks it sends.")


def _run_reduce_scatter(fn, trial, rank, n):
    import torch
    import torch.distributed as dist

    expected = torch.empty_like(_chunks_of(trial, rank, n)[0])
    dist.reduce_scatter(expected, _chunks_of(trial, rank, n))
    chunks = _chunks_of(trial, rank, n)
    with labsupport.CommCounter() as cc:
        got = fn(chunks)
    return {"expected": expected, "chunks": chunks, "got": _portable(got), "comm": cc.summary}


def _diagnose_reduce_scatter(trial, n, reports):
    desc = _describe(trial, "reduce_scatter(chunks)")
    inputs = {r: _chunks_of(trial, r, n) for r in range(n)}
    sums = {j: sum(inputs[r][j] for r in range(n)) for j in range(n)}
    for r in range(n):
        got, exp = reports[r]["got"], reports[r]["expected"]
        if _same(got, exp):
            continue
        where = f"{desc}: rank {r}'s result"
        own = inputs[r]
        if n > 1 and _same(got, own[r]):
            raise _Problem(r, f"{where} is this rank's own chunks[{r}], not reduced: add chunks[{r}] of every other "
                           "rank.")
        if n > 1 and _same(got, sums[r] - own[r]):
            raise _Problem(r, f"{where} is the sum of the other ranks' chunks[{r}] without this rank's own: add "
                           "your own chunk.")
        j = _which(got, {j: sums[j] for j in range(n) if j != r})
        if j is not None:
            raise _Problem(r, f"{where} is the sum of chunks[{j}], expected chunks[{r}]: rank r keeps the sum of "
                           "everyone's chunks[r].")
        if n > 1 and _same(got, sum(own)):
            raise _Problem(r, f"{where} is the sum of this rank's own chunks; it should be the sum over ranks of "
                           f"chunks[{r}].")
        _expect(r, got, exp, where, f"It should be the sum over all ranks of their chunks[{r}].")
    for r in range(n):
        for j in range(n):
            _expect_unchanged(r, reports[r]["chunks"][j], inputs[r][j], f"{desc}: rank {r}'s chunks[{j}]",
                              "reduce_scatter must not change its input chunks: sum into a new tensor "
                              "(e.g. start from chunks[rank].clone()).")


def _run_all_to_all(fn, trial, rank, n):
    import torch
    import torch.distributed as dist

    expected = [torch.empty_like(c) for c in _chunks_of(trial, rank, n)]
    dist.all_to_all(expected, _chunks_of(trial, rank, n))
    chunks = _chunks_of(trial, rank, n)
    with labsupport.CommCounter() as cc:
        got = fn(chunks)
    return {"expected": expected, "chunks": chunks, "got": _portable(got), "comm": cc.summary}


def _diagnose_all_to_all(trial, n, reports):
    desc = _describe(trial, "all_to_all(chunks)")
    inputs = {r: _chunks_of(trial, r, n) for r in range(n)}
    names = {(r, j): inputs[r][j] for r in range(n) for j in range(n)}
    for r in range(n):
        what = f"{desc} on rank {r}"
        items = _expect_list(r, reports[r]["got"], what, n)
        if n > 1 and all(_same(items[j], inputs[r][j]) for j in range(n)):
            raise _Problem(r, f"{what} returned its own input chunks; item i should be the chunk rank i sent to this "
                           f"rank (rank i's chunks[{r}]).")
        for i, (item, exp) in enumerate(zip(items, reports[r]["expected"])):
            if _same(item, exp):
                continue
            k = _which(item, names)
            if k is not None:
                raise _Problem(r, f"{what}: item {i} holds rank {k[0]}'s chunks[{k[1]}], expected rank {i}'s "
                               f"chunks[{r}]: rank i sends its chunks[j] to rank j, which stores it as item i.")
            _expect(r, item, exp, f"{what}: item {i}", f"It should be rank {i}'s chunks[{r}].")
    for r in range(n):
        for j in range(n):
            _expect_unchanged(r, reports[r]["chunks"][j], inputs[r][j], f"{desc}: rank {r}'s chunks[{j}]",
                              "all_to_all must not change its input chunks.")


_RUN = {
    "broadcast": (_run_broadcast, _diagnose_broadcast),
    "reduce": (_run_reduce, _diagnose_reduce),
    "all_reduce": (_run_all_reduce, _diagnose_all_reduce),
    "gather": (_run_gather, _diagnose_gather),
    "all_gather": (_run_all_gather, _diagnose_all_gather),
    "scatter": (_run_scatter, _diagnose_scatter),
    "reduce_scatter": (_run_reduce_scatter, _diagnose_reduce_scatter),
    "all_to_all": (_run_all_to_all, _diagnose_all_to_all),
}


def _verdict(name: str, trial: dict, n: int, reports: list):
    """None if every rank's answer is right, else (rank to blame, message). The same on every rank."""
    for r in range(n):
        try:
            only_point_to_point(reports[r]["comm"], name)
        except AssertionError as exc:
            return r, str(exc)
    try:
        _RUN[name][1](trial, n, reports)
    except _Problem as p:
        return p.rank, p.message
    return None


def _probe(name: str, fn, trials: list) -> bool:
    """Runs on every rank. Per trial: run, share every rank's report, diagnose; the blamed rank raises."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    for trial in trials:
        report = _RUN[name][0](fn, trial, rank, n)
        reports = [None] * n
        dist.all_gather_object(reports, report)
        verdict = _verdict(name, trial, n, reports)
        if verdict is not None:
            blamed, message = verdict
            if rank == blamed:
                raise AssertionError(message)
            return False
    return True


def _check(name: str, fn, timeout, world_sizes=WORLD_SIZES) -> None:
    if not callable(fn):
        raise AssertionError(f"{name} should be a function, got {type(fn).__name__}.")
    seed = draw_seed()
    for world_size in world_sizes:
        run_on_workers(
            _probe, name, fn, _draw_trials(seed, world_size), world_size=world_size, what=SIGNATURES[name],
            timeout=timeout,
        )


def check_broadcast(broadcast, timeout: float | None = None) -> None:
    """``broadcast(tensor, src)``: in place, equal to ``dist.broadcast``, send/recv only."""
    _check("broadcast", broadcast, timeout)


def check_reduce(reduce, timeout: float | None = None) -> None:
    """``reduce(tensor, dst)``: the sum in dst's tensor, the others unchanged, send/recv only."""
    _check("reduce", reduce, timeout)


def check_all_reduce(all_reduce, timeout: float | None = None) -> None:
    """``all_reduce(tensor)``: the sum in place on every rank, equal to ``dist.all_reduce``, send/recv only."""
    _check("all_reduce", all_reduce, timeout)


def check_gather(gather, timeout: float | None = None) -> None:
    """``gather(tensor, dst)``: the list of all tensors on dst, None elsewhere, send/recv only."""
    _check("gather", gather, timeout)


def check_all_gather(all_gather, timeout: float | None = None) -> None:
    """``all_gather(tensor)``: the list of all tensors on every rank, send/recv only."""
    _check("all_gather", all_gather, timeout)


def check_scatter(scatter, timeout: float | None = None) -> None:
    """``scatter(out, chunks, src)``: ``out`` filled with src's ``chunks[rank]``, chunks untouched, send/recv only."""
    _check("scatter", scatter, timeout)


def check_reduce_scatter(reduce_scatter, timeout: float | None = None) -> None:
    """``reduce_scatter(chunks)``: the sum over ranks of ``chunks[rank]``, chunks untouched, send/recv only."""
    _check("reduce_scatter", reduce_scatter, timeout)


def check_all_to_all(all_to_all, timeout: float | None = None) -> None:
    """``all_to_all(chunks)``: item i is rank i's ``chunks[rank]``, chunks untouched, send/recv only."""
    _check("all_to_all", all_to_all, timeout)
