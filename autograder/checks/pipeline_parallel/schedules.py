"""The checks of the exercises that run in one process: ``partition_layers``, the two schedules, the simulator and
the in-flight count, with what they share (reading a schedule back, checking that it can run, formatting it in a
message).
"""

from __future__ import annotations

import math
import random

from .._common import call_student as _call, draw_seed, short
from .reference import (naive_schedule, random_valid_schedule, reference_1f1b, reference_gpipe, reference_in_flight,
                        reference_partition, reference_simulate)

#: (p, m) pairs every schedule check covers: m < p, m = p, m > p, one stage, one micro-batch. The checks add pairs
#: drawn at grading time (``drawn_shapes``), so an answer cannot be a table of these.
SHAPES = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (3, 1), (3, 2), (3, 3), (3, 7), (4, 1), (4, 3), (4, 4), (4, 8),
          (5, 2), (5, 9), (8, 3), (8, 16)]
TOL = 1e-9


def drawn_shapes(rng: random.Random, many: int = 8, small: int = 4, large: bool = True) -> list:
    """(p, m) pairs drawn at grading time: ``many`` with p in 1..12 and m in 1..40, ``small`` with m <= p (the
    pipeline never fills), and one larger than any of ``SHAPES`` (p in 13..24, m in 41..96)."""
    pairs = [(rng.randint(1, 12), rng.randint(1, 40)) for _ in range(many)]
    for _ in range(small):
        p = rng.randint(2, 12)
        pairs.append((p, rng.randint(1, p)))
    if large:
        pairs.append((rng.randint(13, 24), rng.randint(41, 96)))
    return pairs


# ---------------------------------------------------------------------------------------------------------------
# helpers


def _fmt(ops, limit: int = 12, start: int = 0) -> str:
    items = [f"{o[0]}{o[1]}" if isinstance(o, (tuple, list)) and len(o) == 2 else repr(o) for o in ops]
    start = max(0, min(start, len(items) - limit))
    more = " ..." if len(items) > start + limit else ""
    return ("... " if start else "") + " ".join(items[start:start + limit]) + more


def _normalise(schedule, p: int, what: str) -> list:
    """Lists of (op, mb) tuples, or an AssertionError that says what the shape should be."""
    if not isinstance(schedule, (list, tuple)) or len(schedule) != p:
        n = len(schedule) if isinstance(schedule, (list, tuple)) else type(schedule).__name__
        raise AssertionError(f"{what}: expected a list of {p} lists (one per stage), got {short(schedule) if n == 0 else n}"
                             f"{' items' if isinstance(n, int) else ''}.")
    out = []
    for s, ops in enumerate(schedule):
        if not isinstance(ops, (list, tuple)):
            raise AssertionError(f"{what}: stage {s}'s entry is a {type(ops).__name__}, expected a list of (op, mb).")
        row = []
        for item in ops:
            if (not isinstance(item, (tuple, list)) or len(item) != 2 or item[0] not in ("F", "B")
                    or not isinstance(item[1], int) or isinstance(item[1], bool)):
                raise AssertionError(f"{what}: stage {s} holds {item!r}; every item must be a tuple (\"F\", mb) or "
                                     "(\"B\", mb) with mb an int.")
            row.append((item[0], item[1]))
        out.append(row)
    return out


def _check_each_once(schedule, p: int, m: int, what: str) -> None:
    expected = sorted((op, i) for op in "FB" for i in range(m))
    for s, ops in enumerate(schedule):
        if sorted(ops) != expected:
            missing = sorted(set(expected) - set(ops))
            extra = [o for o in ops if ops.count(o) > 1 or o not in expected]
            raise AssertionError(
                f"{what}: stage {s} must run each of F0..F{m - 1} and B0..B{m - 1} exactly once; "
                + (f"missing {_fmt(missing)}" if missing else f"repeated or out of range: {_fmt(sorted(set(extra)))}")
                + f" (stage {s}: {_fmt(ops, 40)}).")
        at = {o: k for k, o in enumerate(ops)}
        for i in range(m):
            if at[("B", i)] < at[("F", i)]:
                raise AssertionError(f"{what}: on stage {s}, B{i} comes before F{i}: a backward needs its forward's "
                                     f"activations (stage {s}: {_fmt(ops, 40)}).")
    try:
        reference_simulate(schedule, 1.0, 2.0)
    except ValueError:
        raise AssertionError(f"{what}: the stages' orders cannot all run: a stage waits for a forward or backward "
                             "that its neighbour only runs later. Forwards flow from stage 0 to p-1, backwards back "
                             f"(schedule: {[_fmt(o, 16) for o in schedule]}).") from None


# ---------------------------------------------------------------------------------------------------------------
# the checks


def check_partition_layers(partition_layers) -> None:
    """Contiguous ranges covering 0..n-1, sizes differing by at most one, earlier never smaller; ValueError."""
    seed = draw_seed()
    rng = random.Random(seed)
    cases = [(n, k, "") for n, k in [(1, 1), (5, 1), (5, 2), (7, 3), (9, 4), (8, 4), (4, 4), (10, 3), (13, 5)]]
    drawn = [(n, rng.randint(1, n)) for n in rng.sample(range(2, 60), 4)]
    drawn += [(n, rng.randint(2, min(n, 64))) for n in (rng.randint(60, 5000) for _ in range(4))]
    drawn += [(n, rng.randint(n - 8, n)) for n in (rng.randint(60, 400) for _ in range(2))]  # about a layer a stage
    cases += [(n, k, f" (seed {seed})") for n, k in drawn]
    for n, k, drawn_with in cases:
        what = f"partition_layers({n}, {k}){drawn_with}"
        got = _call(what, partition_layers, n, k)
        if not isinstance(got, list) or not all(isinstance(r, range) for r in got):
            raise AssertionError(f"{what}: expected a list of range objects, got {short(got)}.")
        if len(got) != k:
            raise AssertionError(f"{what}: expected {k} ranges (one per stage), got {len(got)}: {short(got)}.")
        if any(r.step != 1 for r in got):
            raise AssertionError(f"{what}: every stage holds consecutive layers (step 1), got {short(got)}.")
        flat = [i for r in got for i in r]
        if flat != list(range(n)):
            raise AssertionError(f"{what}: the ranges must cover layers 0..{n - 1} in order, each once; got "
                                 f"{short(got)}.")
        sizes, expected = [len(r) for r in got], [len(r) for r in reference_partition(n, k)]
        if sizes != expected:
            raise AssertionError(f"{what}: stage sizes {short(sizes)}, expected {short(expected)}: sizes differ by at "
                                 "most one and the larger stages come first.")
    for n, k in [(3, 4), (0, 1), (4, 0), (2, -1)]:
        try:
            got = partition_layers(n, k)
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as exc:
            raise AssertionError(f"partition_layers({n}, {k}) raised {type(exc).__name__}; expected ValueError.") \
                from None
        raise AssertionError(f"partition_layers({n}, {k}) returned {short(got)}; expected ValueError (every stage "
                             "needs at least one layer, and both numbers must be at least 1).")


def _check_schedule(fn, name: str, reference, rule: str, extra=None) -> None:
    seed = draw_seed()
    shapes = [(p, m, "") for p, m in SHAPES] + [(p, m, f" (seed {seed})") for p, m in drawn_shapes(random.Random(seed))]
    for p, m, drawn_with in shapes:
        what = f"{name}({p}, {m}){drawn_with}"
        got = _normalise(_call(what, fn, p, m), p, what)
        _check_each_once(got, p, m, what)
        if extra is not None:
            extra(what, p, m, got)
        expected = reference(p, m)
        for s in range(p):
            if got[s] != expected[s]:
                k = next((i for i, (a, b) in enumerate(zip(got[s], expected[s])) if a != b), 0)
                raise AssertionError(
                    f"{what}: stage {s} runs {_fmt(got[s], 40, k - 8)}; expected {_fmt(expected[s], 40, k - 8)} (first "
                    f"difference at position {k}: {got[s][k][0]}{got[s][k][1]} instead of "
                    f"{expected[s][k][0]}{expected[s][k][1]}). {rule}")


def check_gpipe_schedule(gpipe_schedule) -> None:
    """Every stage: F0..F(m-1) then B0..B(m-1), for many (p, m)."""
    _check_schedule(gpipe_schedule, "gpipe_schedule", reference_gpipe,
                    "GPipe: every stage runs all m forwards in micro-batch order, then all m backwards in the same "
                    "order.")


def _warm_up(what, p, m, got):
    """The warm-up said on its own: how many forwards a stage runs before its first backward."""
    for s, ops in enumerate(got):
        first_b = next(i for i, o in enumerate(ops) if o[0] == "B")
        if first_b != min(p - s, m):
            raise AssertionError(
                f"{what}: stage {s} runs {first_b} forwards before its first backward; expected min(p - s, m) = "
                f"{min(p - s, m)}: min(p - s - 1, m) = {min(p - s - 1, m)} warm-up forwards, then (if any "
                f"micro-batch is left) the steady phase's first forward (stage {s}: {_fmt(ops, 40)}).")


def check_one_f_one_b_schedule(one_f_one_b_schedule) -> None:
    """Warm-up min(p-s-1, m) forwards, then F/B alternating, then drain, for many (p, m), m < p included."""
    _check_schedule(one_f_one_b_schedule, "one_f_one_b_schedule", reference_1f1b,
                    "1F1B: stage s first runs min(p - s - 1, m) warm-up forwards, then alternates one forward and "
                    "one backward (forward first) until the forwards run out, then runs the remaining backwards.",
                    extra=_warm_up)


def _times(rng: random.Random) -> tuple:
    """A forward and a backward time drawn at grading time: odd, unequal, either one the longer."""
    return round(rng.uniform(0.1, 1.9), 3), round(rng.uniform(0.1, 3.7), 3)


def _simulator_cases(rng: random.Random, seed: int):
    """(label, schedule, t_fwd, t_bwd, closed form or None). Fixed sizes, then sizes and times drawn at grading time
    (the schedules with a long chain of dependencies, naive and random orders, stay at p·m <= 160, so that a
    simulator written as a recursion over finish times stays within Python's recursion limit)."""
    cases = []
    closed = [(p, m, 1.0, 2.0, "") for p, m in [(1, 3), (2, 1), (2, 4), (3, 2), (4, 1), (4, 4), (4, 8), (5, 3)]]
    closed += [(p, m, *_times(rng), f" (seed {seed})") for p, m in drawn_shapes(rng, many=4, small=2)]
    for p, m, tf, tb, drawn_with in closed:
        for label, sched in (("GPipe", reference_gpipe(p, m)), ("1F1B", reference_1f1b(p, m))):
            cases.append((f"{label} p={p} m={m}, t_fwd={tf:g}, t_bwd={tb:g}{drawn_with}", sched, tf, tb, (p, m)))
    others = [(2, 3), (3, 5), (4, 2), (4, 7)]
    others += [(p, rng.randint(1, min(20, 160 // p))) for p in (rng.randint(2, 8) for _ in range(4))]
    for p, m in others:
        tf, tb = _times(rng)
        for label, sched in (("GPipe", reference_gpipe(p, m)), ("1F1B", reference_1f1b(p, m)),
                             ("naive (F0 B0 F1 B1 ...)", naive_schedule(p, m)),
                             ("1F1B with p warm-up forwards on every stage", reference_1f1b(p, m, lambda s: p)),
                             ("a random valid order", random_valid_schedule(p, m, rng))):
            cases.append((f"{label} p={p} m={m}, t_fwd={tf:g}, t_bwd={tb:g} (seed {seed})", sched, tf, tb, None))
    return cases


def check_simulate_schedule(simulate_schedule) -> None:
    """Makespan, bubble and busy spans against the closed forms and an independent simulation, odd times."""
    seed = draw_seed()
    rng = random.Random(seed)
    for label, sched, tf, tb, closed in _simulator_cases(rng, seed):
        copy = [list(ops) for ops in sched]
        got = _call(f"simulate_schedule on {label}", simulate_schedule, copy, tf, tb)
        if copy != sched:
            raise AssertionError(f"simulate_schedule changed the schedule it was given ({label}): leave it as it is.")
        ref = reference_simulate(sched, tf, tb)
        if not isinstance(got, dict) or not {"makespan", "bubble_fraction", "busy"} <= set(got):
            raise AssertionError(f"simulate_schedule ({label}): expected a dict with keys 'makespan', "
                                 f"'bubble_fraction', 'busy'; got {short(got)}.")
        p = len(sched)
        try:
            makespan, bubble = float(got["makespan"]), float(got["bubble_fraction"])
        except (TypeError, ValueError):
            raise AssertionError(f"simulate_schedule ({label}): makespan and bubble_fraction must be numbers, got "
                                 f"{short(got['makespan'])} and {short(got['bubble_fraction'])}.") from None
        if closed is not None:
            cp, cm = closed
            want = (cm + cp - 1) * (tf + tb)
            if not math.isclose(makespan, want, rel_tol=1e-9, abs_tol=TOL):
                serial = cm * (tf + tb)
                hint = (" That is one stage's own work: a forward on stage s must also wait for the same micro-batch's "
                        "forward on stage s-1 to finish (and a backward for stage s+1's backward)."
                        if math.isclose(makespan, serial, rel_tol=1e-9) and cp > 1 else
                        " Each operation starts when its stage is free and what it waits for has finished: a forward "
                        "waits for the same micro-batch's forward on stage s-1, a backward for its backward on stage "
                        "s+1 (and this stage's own forward of it).")
                raise AssertionError(f"simulate_schedule ({label}): makespan {makespan:g}, expected "
                                     f"(m + p - 1)(t_fwd + t_bwd) = {want:g}.{hint}")
            want_b = (cp - 1) / (cm + cp - 1)
            if not math.isclose(bubble, want_b, rel_tol=1e-9, abs_tol=TOL):
                raise AssertionError(f"simulate_schedule ({label}): bubble_fraction {bubble:.6g}, expected "
                                     f"(p - 1)/(m + p - 1) = {want_b:.6g}: the idle share of all stages' time, "
                                     "1 - (sum of busy time) / (p * makespan).")
        if not math.isclose(makespan, ref["makespan"], rel_tol=1e-9, abs_tol=TOL):
            raise AssertionError(f"simulate_schedule ({label}): makespan {makespan:.6g}, expected "
                                 f"{ref['makespan']:.6g}. Each operation starts as soon as its stage is free and what "
                                 "it waits for has finished: F of mb on stage s-1 for a forward; B of mb on stage "
                                 "s+1 (and this stage's own F of mb) for a backward.")
        if not math.isclose(bubble, ref["bubble_fraction"], rel_tol=1e-9, abs_tol=TOL):
            raise AssertionError(f"simulate_schedule ({label}): bubble_fraction {bubble:.6g}, expected "
                                 f"{ref['bubble_fraction']:.6g} = 1 - (sum of busy time) / (p * makespan).")
        busy = got["busy"]
        if not isinstance(busy, (list, tuple)) or len(busy) != p:
            raise AssertionError(f"simulate_schedule ({label}): 'busy' must hold one list per stage ({p}), got "
                                 f"{short(busy)}.")
        for s in range(p):
            rows = list(busy[s])
            if len(rows) != len(ref["busy"][s]):
                raise AssertionError(f"simulate_schedule ({label}): busy[{s}] has {len(rows)} entries, expected "
                                     f"{len(ref['busy'][s])} (one (start, end, op, mb) per operation, in order).")
            for k, (row, want) in enumerate(zip(rows, ref["busy"][s])):
                ok = (isinstance(row, (tuple, list)) and len(row) == 4 and tuple(row[2:]) == want[2:]
                      and math.isclose(float(row[0]), want[0], rel_tol=1e-9, abs_tol=TOL)
                      and math.isclose(float(row[1]), want[1], rel_tol=1e-9, abs_tol=TOL))
                if not ok:
                    raise AssertionError(
                        f"simulate_schedule ({label}): busy[{s}][{k}] is {short(row)}, expected "
                        f"({want[0]:.6g}, {want[1]:.6g}, {want[2]!r}, {want[3]}): stage {s}'s operations in the "
                        "order of its list, each as (start, end, op, mb).")


def check_max_in_flight(max_in_flight) -> None:
    """Per stage, the most micro-batches forwarded and not yet backwarded, on standard and random schedules."""
    seed = draw_seed()
    rng = random.Random(seed)
    cases = []
    for p, m in SHAPES:
        cases += [("GPipe", reference_gpipe(p, m)), ("1F1B", reference_1f1b(p, m))]
    for p, m in drawn_shapes(rng):
        cases += [(f"GPipe, seed {seed}", reference_gpipe(p, m)), (f"1F1B, seed {seed}", reference_1f1b(p, m))]
    others = [(p, m, "") for p, m in [(3, 5), (4, 6), (5, 4)]]
    others += [(p, m, f", seed {seed}") for p, m in drawn_shapes(rng, many=3, small=1, large=False)]
    for p, m, drawn in others:
        cases += [(f"naive{drawn}", naive_schedule(p, m)),
                  (f"1F1B with p warm-up forwards on every stage{drawn}", reference_1f1b(p, m, lambda s: p)),
                  (f"a random valid order, seed {seed}", random_valid_schedule(p, m, rng))]
    for label, sched in cases:
        p, m = len(sched), len(sched[0]) // 2
        copy = [list(ops) for ops in sched]
        got = _call(f"max_in_flight on {label} p={p} m={m}", max_in_flight, copy)
        want = reference_in_flight(sched)
        if copy != sched:
            raise AssertionError("max_in_flight changed the schedule it was given: leave it as it is.")
        if not isinstance(got, (list, tuple)) or [int(x) if isinstance(x, (int, float)) else x for x in got] != want:
            raise AssertionError(f"max_in_flight ({label}, p={p}, m={m}): got {short(got)}, expected {want} (per "
                                 "stage, the largest number of micro-batches whose F has run and whose B has not; "
                                 f"stage 0 runs {_fmt(sched[0], 24)}).")
