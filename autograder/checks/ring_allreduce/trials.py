"""Inputs drawn at grading time: the cases (shape, dtype) of one world size, and every rank's tensor of a case."""

from __future__ import annotations

import random


_DTYPES = ("float32", "float64", "int64")


def _prime_factors(numel: int) -> list:
    factors, d = [], 2
    while d * d <= numel:
        while numel % d == 0:
            factors.append(d)
            numel //= d
        d += 1
    return factors + ([numel] if numel > 1 else [])


def _multi_dim_shape(numel: int, rng: random.Random) -> tuple:
    """A 2-d or 3-d shape of ``numel`` elements. A composite numel has its prime factors dealt at random over the
    dimensions, at least one each (1000 may give (8, 125), (10, 4, 25), ...; 4 gives (2, 2)); 1 and primes,
    which have no such factorisation, stand between ones ((1, p, 1), (p, 1), ...)."""
    factors = _prime_factors(numel)
    if len(factors) < 2:
        dims = [1] * rng.choice([2, 3])
        dims[rng.randrange(len(dims))] = numel
        return tuple(dims)
    rng.shuffle(factors)
    ndim = rng.choice([2, 3]) if len(factors) >= 3 else 2
    dims = factors[:ndim]
    for f in factors[ndim:]:
        dims[rng.randrange(ndim)] *= f
    return tuple(dims)


def _flat_shape(numel: int, rng: random.Random) -> tuple:
    """The shapes a flat tensor comes in: (numel,), (1, numel), and for one element also 0-d."""
    return rng.choice([(numel,), (1, numel)] + ([()] if numel == 1 else []))


def _cases(seed: int, world_size: int) -> list:
    """(shape, dtype name) pairs for one world size: every numel in {1, N-1, 1000, 2^16+3} with every dtype.

    Of a numel's three cases, two get a multi-dimensional shape (``_multi_dim_shape``, each drawn anew) and one a
    flat shape; which dtype gets which is drawn too.
    """
    rng = random.Random(seed * 31 + world_size)
    numels = [1, world_size - 1, 1000, 2**16 + 3]
    cases = []
    for m in numels:
        if m < 1:
            continue
        shapes = [_multi_dim_shape(m, rng), _multi_dim_shape(m, rng), _flat_shape(m, rng)]
        rng.shuffle(shapes)
        cases += list(zip(shapes, _DTYPES))
    rng.shuffle(cases)
    return cases


def _make(seed: int, case: int, rank: int, shape, dtype_name: str):
    import torch

    g = torch.Generator().manual_seed((seed * 1_000_003 + case * 101 + rank) % (2**63))
    dtype = getattr(torch, dtype_name)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    # Integers carry their rank in the low five bits (2**rank, up to five ranks): a sum over any set of ranks
    # then shows which ranks it holds, so a partial sum can never pass for another one by chance.
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype) * 32 + (1 << rank) % 32
