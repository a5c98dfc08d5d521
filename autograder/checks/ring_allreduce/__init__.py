"""Checks for 02_ring_allreduce, and the reference ring the benchmark measures.

Exercises checked here: ``ring_reduce_scatter(tensor)``, ``ring_all_gather(chunk)``, ``ring_all_reduce(tensor)``
and ``alpha_beta_cost(algorithm, world_size, nbytes, alpha, beta)``.

Each collective check runs the student's function on 1, 2, 3, 4 and 5 ranks with inputs drawn at grading time
(several numels, including fewer elements than ranks and numels not divisible by the world size; float32, float64,
int64; 0-d to 3-d shapes, every numel in two multi-dimensional shapes and one flat one), compares with the sum over
ranks computed in one process (what ``dist.all_reduce`` / ``dist.reduce_scatter`` return), and checks how the result
was obtained with ``CommCounter``: point-to-point calls only, only with the two ring neighbours, and no more bytes
than a ring needs.

The ``reference_*`` functions are this course's reference implementations (not shipped to students);
``benchmarks/ring.py`` measures ``reference_ring_all_reduce`` against ``dist.all_reduce``.

``reference`` holds the reference implementations, ``trials`` draws the inputs, ``probes`` is what runs on the
workers, ``diagnose`` recognises a wrong answer and words its message.
"""

from __future__ import annotations

import math
import random

from .._common import draw_seed, in_sandbox, run_on_workers, short
from .probes import _probe_all_gather, _probe_all_reduce, _probe_reduce_scatter
from .reference import (
    reference_alpha_beta_cost,
    reference_ring_all_gather,
    reference_ring_all_reduce,
    reference_ring_reduce_scatter,
)
from .trials import _cases

__all__ = [
    "check_ring_reduce_scatter",
    "check_ring_all_gather",
    "check_ring_all_reduce",
    "check_alpha_beta_cost",
    "reference_ring_reduce_scatter",
    "reference_ring_all_gather",
    "reference_ring_all_reduce",
    "reference_alpha_beta_cost",
    "WORLD_SIZES",
]

#: World sizes every collective check runs on, in this order (the first failing one stops the check).
WORLD_SIZES = (1, 2, 3, 4, 5)


_DEADLOCK_HINT = (
    " In a ring every rank sends to its right neighbour at the same moment; a blocking dist.send waits until the "
    "receiver posts its recv, so if every rank sends first, all of them wait forever. Post the send and the "
    "receive together (dist.isend + dist.irecv, or dist.batch_isend_irecv) and then wait on both."
)


_SIZE_MISMATCH_HINT = (
    " With gloo this usually means a message arrived whose size differs from the buffer posted to receive it: "
    "at every step, the chunk a rank sends must have the same number of elements as the buffer its right "
    "neighbour receives into (check the chunk indices on both sides; with tensor_split, chunks can differ in "
    "size by one element)."
)


def _run_all(probe, fn, what, world_sizes, timeout):
    if not callable(fn):
        raise AssertionError(f"{what} should be a function, got {type(fn).__name__}.")
    seed = draw_seed()
    fn = in_sandbox(fn, what, allow={"send", "recv"})
    for n in world_sizes:
        cases = _cases(seed, n)
        try:
            run_on_workers(probe, fn, seed, cases, world_size=n, what=what, timeout=timeout, backend="gloo")
        except AssertionError as exc:
            msg = str(exc)
            if "deadlocked" in msg:
                msg += _DEADLOCK_HINT
            elif "SIGABRT" in msg:
                msg += _SIZE_MISMATCH_HINT
            raise AssertionError(msg) from None


def check_ring_reduce_scatter(ring_reduce_scatter, *, world_sizes=WORLD_SIZES, timeout=None):
    """``ring_reduce_scatter(tensor)`` returns chunk ``rank`` of ``tensor.flatten().tensor_split(world_size)``
    summed over ranks, using only sends/recvs with ring neighbours and at most (N-1) chunks of bytes per rank."""
    _run_all(_probe_reduce_scatter, ring_reduce_scatter, "ring_reduce_scatter", world_sizes, timeout)


def check_ring_all_gather(ring_all_gather, *, world_sizes=WORLD_SIZES, timeout=None):
    """``ring_all_gather(chunk)`` returns every rank's chunk in rank order, ring neighbours only."""
    _run_all(_probe_all_gather, ring_all_gather, "ring_all_gather", world_sizes, timeout)


def check_ring_all_reduce(ring_all_reduce, *, world_sizes=WORLD_SIZES, timeout=None):
    """``ring_all_reduce(tensor)`` sums in place over ranks, ring neighbours only, at most 2(N-1) chunks sent."""
    _run_all(_probe_all_reduce, ring_all_reduce, "ring_all_reduce", world_sizes, timeout)


_TERMS = {
    "ring": ("2(p-1)·alpha + 2n(p-1)/p·beta",
             "latency: reduce-scatter and all-gather take p-1 steps each, one alpha per step",
             "bandwidth: 2(p-1) steps, each moving one chunk of n/p bytes"),
    "naive": ("2(p-1)·(alpha + n·beta)",
              "latency: the root receives p-1 messages one after another, then sends p-1",
              "bandwidth: each of the 2(p-1) messages through the root carries all n bytes"),
    "recursive_doubling": ("log2(p)·(alpha + n·beta) for p a power of two, (floor(log2 p) + 2)·(alpha + n·beta) "
                           "otherwise",
                           "latency: log2 p steps when p is a power of two; for any other p, floor(log2 p) + 2 "
                           "(the ranks beyond the largest power of two fold their data into a partner first and "
                           "get the result back at the end; ceil(log2 p) is one step short)",
                           "bandwidth: every step exchanges the whole n bytes"),
}


def check_alpha_beta_cost(alpha_beta_cost, *, trials: int = 40):
    """``alpha_beta_cost`` matches the formulas on chosen and random inputs; unknown names raise ValueError."""
    if not callable(alpha_beta_cost):
        raise AssertionError(f"alpha_beta_cost should be a function, got {type(alpha_beta_cost).__name__}.")
    seed = draw_seed()
    rng = random.Random(seed)
    cases = []
    for alg in ("ring", "naive", "recursive_doubling"):
        cases += [(alg, 4, 1000, 1.0, 0.0, 1), (alg, 4, 1000, 0.0, 1.0, 2), (alg, 6, 3000, 1.0, 0.0, 1),
                  (alg, 6, 3000, 0.0, 1.0, 2), (alg, 1, 1000, 1.0, 1.0, 0)]
    for _ in range(trials):
        cases.append((rng.choice(list(_TERMS)), rng.randint(1, 1024), rng.randint(1, 2**30),
                      10 ** rng.uniform(-7, -3), 10 ** rng.uniform(-12, -8), None))
    for alg, p, n, a, b, term in cases:
        call = f"alpha_beta_cost({alg!r}, world_size={p}, nbytes={n}, alpha={a:.3g}, beta={b:.3g})"
        try:
            got = alpha_beta_cost(alg, p, n, a, b)
        except NotImplementedError:
            raise AssertionError("alpha_beta_cost is not started: it still raises NotImplementedError.") from None
        except Exception as exc:
            raise AssertionError(f"{call} raised {type(exc).__name__}: {exc}") from None
        expected = reference_alpha_beta_cost(alg, p, n, a, b)
        try:
            value = float(got)
        except (TypeError, ValueError):
            raise AssertionError(f"{call} returned {short(got)}, expected a number ({expected:.6g}).") from None
        if not math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-15):
            formula, lat, bw = _TERMS[alg]
            if term == 0:
                why = "with one rank there is nothing to communicate, so the cost is 0."
            elif term == 1:
                why = f"with beta=0 only the latency term counts: {lat}."
            elif term == 2:
                why = f"with alpha=0 only the bandwidth term counts: {bw}."
            else:
                why = f"({lat}; {bw}.)"
            raise AssertionError(
                f"{call} returned {value:.6g}, expected {expected:.6g} = {formula}: {why} (seed {seed})"
            )
    for bad in ("bogus", "Ring", "tree"):
        try:
            got = alpha_beta_cost(bad, 4, 1000, 1e-5, 1e-9)
        except ValueError:
            continue
        except Exception as exc:
            raise AssertionError(
                f"alpha_beta_cost({bad!r}, ...) raised {type(exc).__name__}; raise ValueError for an unknown "
                "algorithm name."
            ) from None
        raise AssertionError(
            f"alpha_beta_cost({bad!r}, ...) returned {short(got)}; it should raise ValueError for an unknown "
            "algorithm name (known: 'naive', 'ring', 'recursive_doubling')."
        )
