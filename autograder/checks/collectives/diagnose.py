"""Recognising a wrong answer to a collective and wording its message.

Each collective's *diagnosis* is given every rank's report (see ``probes``) and runs the same on every rank: it
raises ``_Problem`` naming the first rank whose answer is wrong and what that rank holds instead ("item 1 holds rank
0's tensor, expected rank 1's"), since every rank can rebuild every rank's inputs from the seed.
"""

from __future__ import annotations

from .._common import close, expect_tensor, short
from .trials import _chunks_of, _garbage, _tensor_of


IN_PLACE_HINT = (
    "The result must be written into the tensor you were given (tensor.copy_(...), tensor += ..., or "
    "dist.recv(tensor, ...)): assigning a new tensor to the parameter name does not change the caller's tensor."
)


def _describe(trial: dict, call: str) -> str:
    return f"{call} with {trial['dtype']} tensors of shape {tuple(trial['shape'])} (seed {trial['seed']})"


def _show(obj) -> str:
    """Like ``short``, but a list of tensors stays readable: its length and its first items."""
    if isinstance(obj, list):
        head = ", ".join(short(x, limit=4) for x in obj[:2])
        more = ", ..." if len(obj) > 2 else ""
        return f"a list of {len(obj)} item(s) [{head}{more}]"
    return short(obj)


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
