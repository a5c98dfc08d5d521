"""Checks for notebook 00_launch: ``check_rank_table``.

``rank_table(nnodes, nproc_per_node)`` must list, in rank order, the environment torchrun gives every process of a
launch on ``nnodes`` machines with ``nproc_per_node`` processes each: ranks fill node 0 first, then node 1, ...

The check, in order (it stops at the first problem):

1. the shape of the answer for ``rank_table(2, 4)`` (a list of dicts with exactly the four keys and int values);
2. equality with an oracle for random sizes;
3. ``ValueError`` for bad input (not an int, a bool, less than 1);
4. the real thing: workers started by ``labsupport.run`` compare ``rank_table(1, world_size)[rank]`` with the
   environment variables they actually see.

Each part runs on a worker process, so an answer that never returns costs a time-out, not a hung grader; the
student's function runs in the grading sandbox of each worker (``in_sandbox``), with the task's environment, and
the worker (the host) compares what it returns with the oracle and with the environment it sees itself.
"""

from __future__ import annotations

import os
import random

import labsupport

from ._common import PROBE_TIMEOUT, draw_seed, in_sandbox, run_on_workers, short

__all__ = ["check_rank_table", "expected_rank_table"]

KEYS = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")

_HINTS = {
    "RANK": "rows must be in rank order: row i describes the process with RANK i",
    "LOCAL_RANK": "LOCAL_RANK counts the processes of one node from 0 (it picks the GPU): RANK % nproc_per_node",
    "NODE_RANK": "ranks fill node 0 first, then node 1, ...: NODE_RANK = RANK // nproc_per_node",
    "WORLD_SIZE": "WORLD_SIZE is the number of processes in the whole job: nnodes * nproc_per_node",
}

#: Inputs that must be refused with ValueError, and why.
BAD_INPUTS = (
    ((0, 4), "nnodes must be at least 1"),
    ((2, 0), "nproc_per_node must be at least 1"),
    ((-1, 4), "nnodes must be at least 1"),
    ((2, -3), "nproc_per_node must be at least 1"),
    ((2.0, 4), "nnodes must be an int, not a float"),
    ((2, 1.5), "nproc_per_node must be an int, not a float"),
    (("2", 4), "nnodes must be an int, not a str"),
    ((None, 4), "nnodes must be an int, not None"),
    ((True, 4), "nnodes must be an int, not a bool (True is an int in Python: test for bool first)"),
    ((2, False), "nproc_per_node must be an int, not a bool (False is an int in Python: test for bool first)"),
)


def expected_rank_table(nnodes: int, nproc_per_node: int) -> list[dict]:
    """The oracle: what torchrun gives each process, in rank order."""
    world = nnodes * nproc_per_node
    return [
        {"RANK": r, "LOCAL_RANK": r % nproc_per_node, "NODE_RANK": r // nproc_per_node, "WORLD_SIZE": world}
        for r in range(world)
    ]


def _call(rank_table, nnodes, nproc):
    """Call the student's function; an unexpected exception becomes a message naming the call."""
    try:
        return rank_table(nnodes, nproc)
    except (NotImplementedError, AssertionError):
        raise
    except Exception as exc:
        raise AssertionError(
            f"rank_table({nnodes!r}, {nproc!r}) raised {type(exc).__name__}: {exc}. "
            "It should return the list of dicts for a valid launch."
        ) from None


def _check_table(got, nnodes: int, nproc: int, seed=None) -> None:
    call = f"rank_table({nnodes}, {nproc})"
    seed_note = f" (seed {seed})" if seed is not None else ""
    want = expected_rank_table(nnodes, nproc)
    if not isinstance(got, list):
        raise AssertionError(f"{call} should return a list of dicts, one per process; got {type(got).__name__} "
                             f"{short(got)}{seed_note}")
    if len(got) != len(want):
        raise AssertionError(
            f"{call} returned {len(got)} rows, expected {len(want)}: one row per process, "
            f"nnodes * nproc_per_node = {nnodes} * {nproc}{seed_note}"
        )
    for i, (row, exp) in enumerate(zip(got, want)):
        if not isinstance(row, dict):
            raise AssertionError(f"{call}[{i}] should be a dict, got {type(row).__name__} {short(row)}{seed_note}")
        if set(row) != set(KEYS):
            missing = sorted(set(KEYS) - set(row), key=KEYS.index)
            extra = sorted(map(str, set(row) - set(KEYS)))
            raise AssertionError(
                f"{call}[{i}] has keys {sorted(map(str, row))}; expected exactly {list(KEYS)}"
                + (f" (missing {missing})" if missing else "")
                + (f" (unexpected {extra})" if extra else "")
                + seed_note
            )
        for key in KEYS:
            value = row[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise AssertionError(
                    f"{call}[{i}][{key!r}] is {value!r} ({type(value).__name__}); use ints. Environment variables "
                    f"are strings, but the table holds the numbers{seed_note}"
                )
        wrong = [k for k in KEYS if row[k] != exp[k]]
        if wrong:
            got_row = {k: row[k] for k in KEYS}
            raise AssertionError(
                f"{call}[{i}] is {got_row}, expected {exp}: wrong {', '.join(wrong)}. {_HINTS[wrong[0]]}{seed_note}"
            )


def _probe_oracle(rank_table, seed: int) -> bool:
    """Runs on one worker: shape, random sizes against the oracle, bad inputs."""
    _check_table(_call(rank_table, 2, 4), 2, 4)
    rng = random.Random(seed)
    sizes = [(1, 1), (3, 1), (1, 5)] + [(rng.randint(1, 6), rng.randint(1, 8)) for _ in range(12)]
    for nnodes, nproc in sizes:
        _check_table(_call(rank_table, nnodes, nproc), nnodes, nproc, seed)
    for (a, b), why in BAD_INPUTS:
        try:
            result = rank_table(a, b)
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as exc:
            raise AssertionError(
                f"rank_table({a!r}, {b!r}) raised {type(exc).__name__}: {exc}; it should raise ValueError "
                f"({why}). Check the arguments at the top of the function and raise ValueError yourself."
            ) from None
        raise AssertionError(
            f"rank_table({a!r}, {b!r}) should raise ValueError ({why}), but it returned {short(result)}."
        )
    return True


def _probe_environment(rank_table) -> bool:
    """Runs on every rank of a real single-node launch: the table must match this process's environment."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    seen = {k: int(os.environ[k]) for k in KEYS}
    table = _call(rank_table, 1, world)
    if not (isinstance(table, list) and len(table) == world and isinstance(table[rank], dict)):
        _check_table(table, 1, world)  # raises the layered message
    mine = {k: table[rank].get(k) for k in KEYS}
    if mine != seen:
        raise AssertionError(
            f"On a real single-node launch of {world} processes, rank {rank} sees {seen} in its environment, but "
            f"rank_table(1, {world})[{rank}] is {mine}."
        )
    return True


def _run_one(probe, *args, what: str, timeout: float):
    """Like run_on_workers with one worker, with messages that do not mention ranks (rank_table is not parallel)."""
    try:
        return labsupport.run(probe, *args, world_size=1, timeout=timeout, backend="gloo")
    except labsupport.WorkerTimeout:
        raise AssertionError(f"{what} did not return within {timeout:g} s: is there an endless loop?") from None
    except labsupport.WorkerError as exc:
        if exc.exc_type == "AssertionError":
            raise AssertionError(exc.exc_message) from None
        if exc.exc_type == "NotImplementedError":
            raise AssertionError(f"{what} is not started: it still raises NotImplementedError.") from None
        if exc.exc_type is None:
            raise AssertionError(f"{what} stopped its worker process: it {exc.exc_message}.") from None
        raise AssertionError(f"{what} failed: {exc.exc_type}: {exc.exc_message}") from None


def check_rank_table(rank_table, timeout: float | None = None) -> None:
    """Hidden test of ``rank_table``: oracle over random sizes, ValueError on bad input, the real environment."""
    timeout = PROBE_TIMEOUT if timeout is None else timeout
    seed = draw_seed()
    fn = in_sandbox(rank_table, "rank_table")
    _run_one(_probe_oracle, fn, seed, what="rank_table", timeout=timeout)
    for world in (1, 2, 3, 4):
        run_on_workers(_probe_environment, fn, world_size=world, what="rank_table", timeout=timeout)
