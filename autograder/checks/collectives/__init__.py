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

``trials`` draws the inputs, ``probes`` is what runs on the workers, ``diagnose`` recognises a wrong answer and words
its message.
"""

from __future__ import annotations

from .._common import draw_seed, in_sandbox, run_on_workers
from .probes import _probe
from .trials import _draw_trials

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


def _check(name: str, fn, timeout, world_sizes=WORLD_SIZES) -> None:
    if not callable(fn):
        raise AssertionError(f"{name} should be a function, got {type(fn).__name__}.")
    seed = draw_seed()
    fn = in_sandbox(fn, SIGNATURES[name], allow={"send", "recv"})
    for world_size in world_sizes:
        run_on_workers(
            _probe, name, fn, _draw_trials(seed, world_size), world_size=world_size, what=SIGNATURES[name],
            timeout=timeout, backend="gloo",
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
