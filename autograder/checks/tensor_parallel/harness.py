"""Running the tensor-parallel probes in step, and what every probe compares with.

Every probe runs on all ranks of a world split into tensor-parallel groups (``_tp_group``); after each phase the
ranks agree on whether one of them failed (``_agree``), so that all stop at the same point and none waits in a
collective the others never enter. Also here: the dense oracle's inputs (``_dense``, ``_randn``), the collectives
recorded by ``CommCounter`` and compared with the expected ones (``_comm_failure``), and messages about what from_dense
raised (``_group_hint``, ``_value_error``).
"""

from __future__ import annotations

import re

import torch

from .._common import run_on_workers, tolerance

#: (world_size, tensor-parallel size): every rank in one group, 4 ranks as two groups of 2, and one rank (last:
#: a bug shows more clearly on several ranks).
CONFIGS = ((2, 2), (3, 3), (4, 4), (4, 2), (1, 1))


# ---------------------------------------------------------------------------------------------------------------
# running probes


#: What a rank that found nothing wrong returns when another rank did (all stop at the same point).
ELSEWHERE = "(another rank failed)"


def _agree(failure) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([0 if failure is None else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _guarded(body, *args):
    """Run a probe body; an AssertionError becomes this rank's failure, agreed on with the other ranks."""
    try:
        failure = body(*args)
    except AssertionError as exc:
        failure = str(exc)
    _agree(failure)
    return failure


def _run(probe, *args, what: str, seed: int, configs=CONFIGS):
    """``probe`` on every configuration."""
    for world_size, tp in configs:
        results = run_on_workers(_guarded, probe, tp, *args, world_size=world_size, what=what)
        for failure in results:
            if failure and failure != ELSEWHERE:
                layout = "" if tp == world_size else f", tensor-parallel groups of {tp}"
                raise AssertionError(f"(t={tp}{layout}, seed {seed}) {failure}")


def _tp_group(tp: int):
    """(group to pass, its global ranks, t, this rank's index in it): the whole world, or contiguous groups."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if tp == world:
        return None, tuple(range(world)), tp, rank
    groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, world, tp)]
    first = rank - rank % tp
    return groups[rank // tp], tuple(range(first, first + tp)), tp, rank % tp


def _dense(seed: int, make):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return make()


def _randn(seed: int, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, **tolerance(b.dtype))


def _describe(calls) -> str:
    if not calls:
        return "no communication"
    return ", ".join(f"{c.kind} of {c.nbytes} B" for c in calls)


def _comm_failure(calls, expected, ranks, t, where, hint=""):
    """``expected``: list of (set of accepted kinds, bytes) in order. None when the calls match."""
    if t == 1 and not calls:
        return None  # one rank: skipping the collective is fine (and so is a one-rank collective)
    got = [(c.kind, c.nbytes) for c in calls]
    ok = len(got) == len(expected) and all(k in kinds and n == nb for (k, n), (kinds, nb) in zip(got, expected))
    want = ", ".join(f"{'/'.join(sorted(kinds))} of {nb} B" for kinds, nb in expected) or "no communication"
    if not ok:
        return f"{where}: expected {want}; recorded {_describe(calls)}. {hint}".strip()
    for c in calls:
        if tuple(c.group) != tuple(ranks):
            return (f"{where}: the {c.kind} went over ranks {c.group}, but this rank's tensor-parallel group is "
                    f"{ranks}: pass group= to every collective (and use dist.get_rank(group), "
                    "dist.get_world_size(group)).")
    return None


def _group_hint(label, error, t):
    """The message for an error from_dense raised: a ValueError on sizes that do divide by t gets a hint about the
    group."""
    kind, message = error
    if kind == "ValueError" and t:
        return (f"{label} raised ValueError: {message}, but every size here divides by t = {t}, the number of ranks "
                "in `group`: take t and r from the group (dist.get_world_size(group), dist.get_rank(group)), not "
                "from the whole world.")
    return f"{label} raised {kind}: {message}"


def _value_error(raised, size_name: str, size: int, t: int, what: str):
    """``raised``: what from_dense raised (type, message) in the sandbox for a size not divisible by t, or None; it
    must be a ValueError whose message names the size and t."""
    if raised is None:
        return (f"{what} with {size_name} = {size} on t = {t} ranks did not raise: {size} is not divisible by {t}, "
                "raise ValueError naming the size and t.")
    if not (isinstance(raised, tuple) and len(raised) == 2):
        return f"{what} with {size_name} = {size} on t = {t} ranks: the scenario's answer was changed in the sandbox."
    kind, text = raised
    if kind == "ValueError":
        if not (re.search(rf"(?<!\d){size}(?!\d)", text) and re.search(rf"(?<!\d){t}(?!\d)", text)):
            return (f"{what} with {size_name} = {size} on t = {t} ranks raised ValueError({text!r}); its message "
                    f"should name the size ({size}) and t ({t}).")
        return None
    return (f"{what} with {size_name} = {size} on t = {t} ranks raised {kind}: {text}; raise ValueError naming the "
            f"size and t when {size_name} is not divisible by t.")
