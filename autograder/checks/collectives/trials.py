"""The inputs of the collectives' checks, drawn from the seed: every rank can rebuild every rank's inputs.

Values are multiples of 1/4 in a small range, so sums are exact in any order and dtype; draws whose answers the
diagnoses could not tell apart are replaced (``_telling``).
"""

from __future__ import annotations

import random

SHAPES = ((5,), (2, 3), (3, 1, 2), (1,), (4, 4))
DTYPES = ("float32", "int64", "float64", "int32")
TRIALS_PER_WORLD_SIZE = 3


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
