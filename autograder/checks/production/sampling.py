"""``shard_indices`` (09, exercise 1): ``DistributedSampler``'s indices, taken from ``DistributedSampler`` itself,
drawn cases against them (the student's function runs them all in one call in a sandbox, ``drivers.deal``), and a
hint for the likeliest mistake behind a wrong list."""

from __future__ import annotations

import random

import torch

from .._common import BUILT_INS, draw_seed, in_sandbox, run_on_workers, short
from . import drivers


class _Range:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def reference_shard_indices(num_samples, num_replicas, rank, epoch=0, seed=0, shuffle=True, drop_last=False):
    """``DistributedSampler``'s indices, taken from ``DistributedSampler`` itself."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(_Range(num_samples), num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def _diagnose_indices(got, num_samples, num_replicas, rank, epoch, seed, shuffle, drop_last):
    """A hint for the likeliest mistake behind a wrong list of indices."""
    expected = reference_shard_indices(num_samples, num_replicas, rank, epoch, seed, shuffle, drop_last)
    if len(got) != len(expected):
        if drop_last and num_samples % num_replicas:
            return (f"with drop_last=True each rank gets floor({num_samples}/{num_replicas}) = {len(expected)} "
                    "indices: cut the (shuffled) list to num_replicas * that many, dropping the tail, no padding")
        if num_samples % num_replicas:
            return (f"with drop_last=False each rank gets ceil({num_samples}/{num_replicas}) = {len(expected)} "
                    "indices: pad the list by repeating it from its start until its length is a multiple of "
                    "num_replicas (more than once when num_samples < num_replicas)")
        return f"each rank gets num_samples / num_replicas = {len(expected)} indices"
    if shuffle:
        wrong_epoch = reference_shard_indices(num_samples, num_replicas, rank, 0, seed, shuffle, drop_last)
        if epoch and got == wrong_epoch:
            return ("these are epoch 0's indices: shuffle with a torch.Generator seeded with seed + epoch, so that "
                    "every epoch has its own order")
    full = (torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
            if shuffle else list(range(num_samples)))
    positions = range(rank, len(expected) * num_replicas, num_replicas)  # this rank's places in the padded list
    padding = [i for i, p in enumerate(positions) if p >= num_samples]
    if padding and all(got[i] == expected[i] for i in range(len(got)) if i not in padding):
        return (f"the first {len(got) - len(padding)} indices are right, the padding is not: pad the list by "
                "repeating it from its start (the first indices of the permutation, not its last ones nor any "
                "others), more than once round when num_samples < num_replicas")
    if sorted(got) != sorted(expected) and set(got) <= set(full):
        per = len(expected)
        padded = (full * (1 + (num_replicas * per) // max(num_samples, 1)))[:num_replicas * per]
        if got == padded[rank * per:(rank + 1) * per]:
            return ("this is a contiguous block: DistributedSampler deals the indices out in turn, rank r taking "
                    "positions r, r + num_replicas, r + 2*num_replicas, ... (indices[rank::num_replicas])")
    if sorted(got) == sorted(expected):
        return "the right indices in the wrong order: keep the permutation's order, then take indices[rank::num_replicas]"
    if shuffle:
        return ("shuffle with torch.randperm(num_samples, generator=g), g = torch.Generator() seeded with seed + "
                "epoch (the global random state must play no part)")
    return "without shuffling the list starts as 0, 1, ..., num_samples - 1"


def _deal_probe(fn, cases, global_seeds, bad_ranks):
    return fn(cases, global_seeds, bad_ranks)


def check_shard_indices(shard_indices):
    """Drawn sizes, ranks, epochs, seeds, shuffle and drop_last against DistributedSampler; ValueError for a bad rank.
    Every call runs in a one-rank sandbox, where ``DistributedSampler`` itself raises."""
    seed0 = draw_seed()
    rng = random.Random(seed0)
    cases = [(10, 3, r, 0, 0, True, False) for r in range(3)] + [(2, 5, r, 1, 3, True, False) for r in range(5)]
    cases += [(11, 4, 3, 2, 7, True, True), (7, 7, 6, 0, 0, False, False), (1, 3, 2, 4, 1, True, False)]
    for _ in range(60):
        n = rng.choice([rng.randint(1, 12), rng.randint(13, 200)])
        world = rng.choice([1, 2, 3, 4, 5, 7, 8])
        cases.append((n, world, rng.randrange(world), rng.randint(0, 9), rng.randint(0, 1000), rng.random() < 0.8,
                      rng.random() < 0.4))
    # with drop_last and fewer samples than ranks DistributedSampler gives every rank nothing: legal, not instructive
    cases = [case[:6] + (case[6] and case[0] >= case[1],) for case in cases]
    global_seeds = [rng.randint(0, 10**6) for _ in cases]  # the global state must not matter
    bad_ranks = [(10, 3, 3), (10, 3, -1), (5, 2, 7)]
    fn = in_sandbox(shard_indices, "shard_indices", driver=drivers.deal, forbid=BUILT_INS["shard_indices"])
    outcomes = run_on_workers(_deal_probe, fn, cases, global_seeds, bad_ranks, world_size=1,
                              what=f"shard_indices (seed {seed0})")[0]
    for (n, world, rank, epoch, seed, shuffle, drop_last), outcome in zip(cases, outcomes):
        call = (f"shard_indices({n}, {world}, {rank}, epoch={epoch}, seed={seed}, shuffle={shuffle}, "
                f"drop_last={drop_last})")
        if outcome[0] != "ok":
            raise AssertionError(f"{call} raised {outcome[1]}: {outcome[2]}")
        got = outcome[1]
        if isinstance(got, torch.Tensor):
            raise AssertionError(f"{call} returned a tensor: return a list of ints (.tolist()).")
        if not isinstance(got, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in got):
            raise AssertionError(f"{call} returned {short(got)}: return a list of Python ints.")
        expected = reference_shard_indices(n, world, rank, epoch, seed, shuffle, drop_last)
        if list(got) != expected:
            hint = _diagnose_indices(list(got), n, world, rank, epoch, seed, shuffle, drop_last)
            raise AssertionError(f"{call} = {short(list(got))}, DistributedSampler gives {short(expected)}: {hint} "
                                 f"(seed {seed0}).")
    for bad, outcome in zip(bad_ranks, outcomes[len(cases):]):
        wanted = _sampler_error(*bad)
        if outcome[0] == "ok":
            raise AssertionError(f"shard_indices{bad} returned instead of raising ValueError({wanted!r}): rank must "
                                 "be in [0, num_replicas), as DistributedSampler requires.")
        if outcome[1] != "ValueError":
            raise AssertionError(f"shard_indices{bad} raised {outcome[1]}: raise ValueError({wanted!r}) when rank is "
                                 "not in [0, num_replicas), as DistributedSampler does.")
        if outcome[2] != wanted:
            raise AssertionError(f"shard_indices{bad} raised ValueError({outcome[2]!r}): say what "
                                 f"DistributedSampler says, ValueError({wanted!r}).")


def _sampler_error(num_samples, num_replicas, rank) -> str:
    """The message of the ValueError ``DistributedSampler`` raises for a rank out of range."""
    from torch.utils.data import DistributedSampler

    try:
        DistributedSampler(_Range(num_samples), num_replicas=num_replicas, rank=rank)
    except ValueError as exc:
        return str(exc)
    raise RuntimeError(f"DistributedSampler accepted rank {rank} of {num_replicas}")
