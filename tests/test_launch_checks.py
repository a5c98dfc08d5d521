"""Mutation tests for autograder.checks.launch (notebook 00_launch): ``check_rank_table``."""

import functools
import itertools
import os

import pytest

from autograder.checks import launch as L


def _valid(nnodes, nproc_per_node):
    for name, v in (("nnodes", nnodes), ("nproc_per_node", nproc_per_node)):
        if type(v) is not int or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


# ----------------------------------------------------------------------------------------------------------------
# Correct alternatives (the notebook's solution is a comprehension with // and %)


def table_nested_loops(nnodes, nproc_per_node):
    if isinstance(nnodes, bool) or isinstance(nproc_per_node, bool):
        raise ValueError("bools are not sizes")
    if not isinstance(nnodes, int) or not isinstance(nproc_per_node, int):
        raise ValueError("sizes must be ints")
    if min(nnodes, nproc_per_node) < 1:
        raise ValueError("sizes must be at least 1")
    rows = []
    for node in range(nnodes):
        for local in range(nproc_per_node):
            rows.append(
                dict(WORLD_SIZE=nnodes * nproc_per_node, NODE_RANK=node, LOCAL_RANK=local, RANK=len(rows))
            )
    return rows


def table_product(nnodes, nproc_per_node):
    _valid(nnodes, nproc_per_node)
    world = nnodes * nproc_per_node
    pairs = itertools.product(range(nnodes), range(nproc_per_node))
    return [{"RANK": i, "LOCAL_RANK": l, "NODE_RANK": n, "WORLD_SIZE": world} for i, (n, l) in enumerate(pairs)]


@pytest.mark.parametrize("fn", [table_nested_loops, table_product])
def test_correct_alternatives_pass(fn):
    L.check_rank_table(fn)


def test_oracle_matches_the_two_node_example():
    rows = L.expected_rank_table(2, 4)
    assert [(r["RANK"], r["LOCAL_RANK"], r["NODE_RANK"]) for r in rows][4:6] == [(4, 0, 1), (5, 1, 1)]
    assert {r["WORLD_SIZE"] for r in rows} == {8}


# ----------------------------------------------------------------------------------------------------------------
# Planted bugs


def local_rank_is_rank(nnodes, nproc_per_node):
    rows = table_product(nnodes, nproc_per_node)
    return [dict(r, LOCAL_RANK=r["RANK"]) for r in rows]


def round_robin_nodes(nnodes, nproc_per_node):
    rows = table_product(nnodes, nproc_per_node)
    return [dict(r, NODE_RANK=r["RANK"] % nnodes) for r in rows]


def world_is_per_node(nnodes, nproc_per_node):
    rows = table_product(nnodes, nproc_per_node)
    return [dict(r, WORLD_SIZE=nproc_per_node) for r in rows]


def one_based(nnodes, nproc_per_node):
    rows = table_product(nnodes, nproc_per_node)
    return [dict(r, RANK=r["RANK"] + 1) for r in rows]


def local_rank_major(nnodes, nproc_per_node):
    """Rows sorted by LOCAL_RANK instead of RANK."""
    return sorted(table_product(nnodes, nproc_per_node), key=lambda r: (r["LOCAL_RANK"], r["NODE_RANK"]))


def no_validation(nnodes, nproc_per_node):
    world = nnodes * nproc_per_node
    return [{"RANK": r, "LOCAL_RANK": r % nproc_per_node, "NODE_RANK": r // nproc_per_node, "WORLD_SIZE": world}
            for r in range(int(world))]


def accepts_bool(nnodes, nproc_per_node):
    if not isinstance(nnodes, int) or not isinstance(nproc_per_node, int) or min(nnodes, nproc_per_node) < 1:
        raise ValueError("bad sizes")
    return table_product(int(nnodes), int(nproc_per_node))


def raises_type_error(nnodes, nproc_per_node):
    if not isinstance(nnodes, int) or not isinstance(nproc_per_node, int):
        raise TypeError("sizes must be ints")
    return table_product(nnodes, nproc_per_node)


def string_values(nnodes, nproc_per_node):
    return [{k: str(v) for k, v in r.items()} for r in table_product(nnodes, nproc_per_node)]


def dict_by_rank(nnodes, nproc_per_node):
    return {r["RANK"]: r for r in table_product(nnodes, nproc_per_node)}


def missing_node_rank(nnodes, nproc_per_node):
    return [{k: v for k, v in r.items() if k != "NODE_RANK"} for r in table_product(nnodes, nproc_per_node)]


def tuple_rows(nnodes, nproc_per_node):
    return [tuple(r.values()) for r in table_product(nnodes, nproc_per_node)]


def one_node_only(nnodes, nproc_per_node):
    return table_product(1, nproc_per_node)


def key_error(nnodes, nproc_per_node):
    return [{"RANK": r}["LOCAL_RANK"] for r in range(nnodes * nproc_per_node)]


def not_done(nnodes, nproc_per_node):
    raise NotImplementedError()


def endless(nnodes, nproc_per_node):
    while True:
        pass


def differs_on_a_real_launch(nnodes, nproc_per_node):
    """Right when called alone, wrong inside a multi-rank launch (reaches the comparison with the environment)."""
    rows = table_product(nnodes, nproc_per_node)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        rows = [dict(r, NODE_RANK=1) for r in rows]
    return rows


BUGS = [
    (local_rank_is_rank, r"rank_table\(2, 4\)\[4\] .* wrong LOCAL_RANK\. LOCAL_RANK counts .* RANK % nproc_per_node"),
    (round_robin_nodes, r"rank_table\(2, 4\)\[1\] .* wrong NODE_RANK\. ranks fill node 0 first"),
    (world_is_per_node, r"wrong WORLD_SIZE\. WORLD_SIZE is the number of processes in the whole job"),
    (one_based, r"rank_table\(2, 4\)\[0\] .* wrong RANK\. rows must be in rank order"),
    (local_rank_major, r"rank_table\(2, 4\)\[1\] .* wrong RANK, LOCAL_RANK, NODE_RANK\. rows must be in rank order"),
    (no_validation, r"rank_table\(0, 4\) should raise ValueError \(nnodes must be at least 1\), but it returned \[\]"),
    (accepts_bool, r"rank_table\(True, 4\) should raise ValueError .*not a bool"),
    (raises_type_error, r"rank_table\(2\.0, 4\) raised TypeError: sizes must be ints; it should raise ValueError"),
    (string_values, r"rank_table\(2, 4\)\[0\]\['RANK'\] is '0' \(str\); use ints"),
    (dict_by_rank, r"rank_table\(2, 4\) should return a list of dicts, one per process; got dict"),
    (missing_node_rank, r"expected exactly \['RANK', 'LOCAL_RANK', 'NODE_RANK', 'WORLD_SIZE'\] \(missing \['NODE_RANK'\]\)"),
    (tuple_rows, r"rank_table\(2, 4\)\[0\] should be a dict, got tuple"),
    (one_node_only, r"rank_table\(2, 4\) returned 4 rows, expected 8"),
    (key_error, r"rank_table\(2, 4\) raised KeyError: 'LOCAL_RANK'"),
    (not_done, r"rank_table is not started: it still raises NotImplementedError"),
    (differs_on_a_real_launch, r"On a real single-node launch of \d processes, rank \d sees .* but rank_table\(1, \d\)"),
]


@pytest.mark.parametrize("bug,message", BUGS, ids=[b.__name__ for b, _ in BUGS])
def test_planted_bug_is_caught(bug, message):
    with pytest.raises(AssertionError, match=message):
        L.check_rank_table(bug)


@pytest.mark.timing
def test_endless_loop_times_out():
    with pytest.raises(AssertionError, match=r"rank_table did not return within 2 s: is there an endless loop\?"):
        L.check_rank_table(endless, timeout=2)


def test_other_worker_failures_are_reported():
    """A crash of the process rank_table runs in (its sandbox) still becomes an AssertionError."""

    def exits(nnodes, nproc_per_node):
        os._exit(3)

    with pytest.raises(AssertionError, match=r"rank_table\(2, 4\) raised RuntimeError: the function's process exited "
                                             r"with code 3 while running rank_table"):
        L.check_rank_table(exits)


class _BreaksOnArrival:
    """A callable that pickles but cannot be rebuilt on the worker."""

    def __call__(self, nnodes, nproc_per_node):
        return table_product(nnodes, nproc_per_node)

    def __reduce__(self):
        return (_explode, ())


def _explode():
    raise ValueError("cannot rebuild this object")


def test_failures_outside_rank_table_are_reported():
    with pytest.raises(AssertionError, match=r"rank_table\(2, 4\) raised ValueError: cannot rebuild this object"):
        L.check_rank_table(_BreaksOnArrival())


# ----------------------------------------------------------------------------------------------------------------
# What decides points is out of the answer's reach: it runs in the sandbox, the check in its host


def patches_the_check(nnodes, nproc_per_node):
    """A wrong table that replaces the check's oracle and comparison where it runs: only its sandbox changes."""
    import autograder.checks.launch as checks

    checks.expected_rank_table = lambda nnodes, nproc_per_node: []
    checks._check_table = lambda *args, **kwargs: None
    return []


def honest_habits(nnodes, nproc_per_node):
    """Correct, with habits honest code has: a cached helper, a note on stderr, a traceback printed and re-raised."""
    import sys
    import traceback

    try:
        _valid(nnodes, nproc_per_node)
    except ValueError:
        traceback.print_exc()
        raise
    print(f"{nnodes} x {nproc_per_node}", file=sys.stderr)
    return [dict(_row(r, nproc_per_node), WORLD_SIZE=nnodes * nproc_per_node) for r in range(nnodes * nproc_per_node)]


@functools.lru_cache(maxsize=None)
def _row(rank, nproc_per_node):
    return {"RANK": rank, "LOCAL_RANK": rank % nproc_per_node, "NODE_RANK": rank // nproc_per_node}


def test_an_answer_that_patches_the_check_loses_its_points():
    with pytest.raises(AssertionError, match=r"rank_table\(2, 4\) returned 0 rows, expected 8"):
        L.check_rank_table(patches_the_check)


def test_honest_habits_pass():
    L.check_rank_table(honest_habits)
