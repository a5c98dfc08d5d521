"""Checks for notebook 05_pipeline_parallel: ``check_partition_layers``, ``check_gpipe_schedule``,
``check_one_f_one_b_schedule``, ``check_simulate_schedule``, ``check_max_in_flight``, ``check_run_pipeline``.

The references live here, not in ``labsupport`` (students receive that package): the layer partition, the two
schedules, an event simulator and the in-flight count. The reference simulator is written as a fixed-point sweep
over the stages (each pass starts every operation whose predecessors are done), so a student's simulator, however it
is written (a recursion over finish times, a priority queue of events, a sweep like this one), is compared with a
second, independent computation, and also with the closed forms (m + p - 1)(t_f + t_b) and (p - 1)/(m + p - 1).

Schedules are checked for many (p, m), ``m < p`` included. Simulators are also fed schedules no notebook cell uses:
naive model parallelism (F0 B0 F1 B1 ...), 1F1B with extra warm-up, and random valid orders (recorded from a list
scheduler with random durations, so that every order can run), with odd, unequal forward and backward times.

``run_pipeline`` runs on 2, 3 and 4 ranks with an odd number of layers of different kinds (the stages are unequal),
for GPipe and 1F1B, ``m < p``, ``m = p`` and ``m > p``, one micro-batch too. Each rank compares its loss and every
gradient with the same model trained in one process with the loss averaged over micro-batches. How: the stage the
student receives records the order of its forward and backward passes (compared with ``schedule[rank]``), and
``CommCounter`` records that only point-to-point messages to the neighbouring stages were used. Every case ends with
one small all-reduce outside the counted region through which all ranks learn whether one found a problem, so a
wrong answer never becomes a deadlock; a real deadlock is stopped by the probe's time limit.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn as nn

from ._common import call_student as _call, draw_seed, run_on_workers, short, tolerance

__all__ = [
    "check_partition_layers",
    "check_gpipe_schedule",
    "check_one_f_one_b_schedule",
    "check_simulate_schedule",
    "check_max_in_flight",
    "check_run_pipeline",
    "reference_partition",
    "reference_gpipe",
    "reference_1f1b",
    "reference_simulate",
    "reference_in_flight",
    "random_valid_schedule",
]

#: (p, m) pairs every schedule check covers: m < p, m = p, m > p, one stage, one micro-batch.
SHAPES = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (3, 1), (3, 2), (3, 3), (3, 7), (4, 1), (4, 3), (4, 4), (4, 8),
          (5, 2), (5, 9), (8, 3), (8, 16)]
TOL = 1e-9

# ---------------------------------------------------------------------------------------------------------------
# references


def reference_partition(num_layers: int, num_stages: int) -> list:
    if num_stages < 1 or num_layers < 1 or num_stages > num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {num_stages} stages")
    q, r = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        size = q + (1 if s < r else 0)
        out.append(range(start, start + size))
        start += size
    return out


def reference_gpipe(p: int, m: int) -> list:
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]


def reference_1f1b(p: int, m: int, warmup=None) -> list:
    """PipeDream-Flush; ``warmup(s)`` overrides the number of warm-up forwards (for schedules no student writes)."""
    out = []
    for s in range(p):
        w = min(p - s - 1, m) if warmup is None else min(warmup(s), m)
        ops = [("F", i) for i in range(w)]
        for i in range(m - w):
            ops += [("F", w + i), ("B", i)]
        ops += [("B", i) for i in range(m - w, m)]
        out.append(ops)
    return out


def naive_schedule(p: int, m: int) -> list:
    """One micro-batch at a time through the whole pipe: F0 B0 F1 B1 ... on every stage."""
    return [[op for i in range(m) for op in (("F", i), ("B", i))] for _ in range(p)]


def reference_simulate(schedule, t_fwd: float, t_bwd: float) -> dict:
    """Fixed-point sweep: repeat passes over the stages, starting each stage's next operation once what it waits
    for has finished; stop when all are placed (ValueError when a pass places nothing: the schedule cannot run)."""
    p = len(schedule)
    done = {}  # (stage, op, mb) -> end time
    nxt = [0] * p
    free = [0.0] * p
    busy = [[] for _ in range(p)]
    remaining = sum(len(ops) for ops in schedule)
    while remaining:
        progressed = False
        for s in range(p):
            while nxt[s] < len(schedule[s]):
                op, mb = schedule[s][nxt[s]]
                deps = []
                if op == "F" and s > 0:
                    deps.append((s - 1, "F", mb))
                if op == "B":
                    deps.append((s, "F", mb))
                    if s < p - 1:
                        deps.append((s + 1, "B", mb))
                if any(d not in done for d in deps):
                    break
                start = max([free[s]] + [done[d] for d in deps])
                end = start + (t_fwd if op == "F" else t_bwd)
                done[(s, op, mb)] = end
                busy[s].append((start, end, op, mb))
                free[s] = end
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule cannot run: some stage waits for an operation that never comes")
    makespan = max((b[-1][1] for b in busy if b), default=0.0)
    work = sum(e - s for b in busy for s, e, _, _ in b)
    bubble = 1.0 - work / (p * makespan) if makespan > 0 else 0.0
    return {"makespan": makespan, "bubble_fraction": bubble, "busy": busy}


def reference_in_flight(schedule) -> list:
    out = []
    for ops in schedule:
        live, peak = set(), 0
        for op, mb in ops:
            if op == "F":
                live.add(mb)
            else:
                live.discard(mb)
            peak = max(peak, len(live))
        out.append(peak)
    return out


def random_valid_schedule(p: int, m: int, rng: random.Random) -> list:
    """A schedule that can run, in an order no textbook uses: a list scheduler with random durations and random
    tie-breaking between a stage's ready forward and ready backward records the order each stage ran its work."""
    dur = {(s, op): rng.uniform(0.2, 2.0) for s in range(p) for op in "FB"}
    done, free = {}, [0.0] * p
    nf, nb = [0] * p, [0] * p  # next forward / backward micro-batch per stage (each kind in micro-batch order)
    order = [[] for _ in range(p)]
    while any(nb[s] < m for s in range(p)):
        choices = []
        for s in range(p):
            if nf[s] < m and (s == 0 or (s - 1, "F", nf[s]) in done):
                ready = 0.0 if s == 0 else done[(s - 1, "F", nf[s])]
                choices.append((max(free[s], ready), rng.random(), s, "F", nf[s]))
            if nb[s] < nf[s] and (s == p - 1 or (s + 1, "B", nb[s]) in done):
                ready = done[(s, "F", nb[s])] if s == p - 1 else done[(s + 1, "B", nb[s])]
                choices.append((max(free[s], ready), rng.random(), s, "B", nb[s]))
        start, _, s, op, mb = min(choices)
        done[(s, op, mb)] = free[s] = start + dur[(s, op)]
        order[s].append((op, mb))
        if op == "F":
            nf[s] += 1
        else:
            nb[s] += 1
    return order


# ---------------------------------------------------------------------------------------------------------------
# helpers


def _fmt(ops, limit: int = 12) -> str:
    items = [f"{o[0]}{o[1]}" if isinstance(o, (tuple, list)) and len(o) == 2 else repr(o) for o in ops]
    return " ".join(items[:limit]) + (" ..." if len(items) > limit else "")


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
    for s, ops in enumerate(schedule):
        expected = sorted((op, i) for op in "FB" for i in range(m))
        if sorted(ops) != expected:
            missing = sorted(set(expected) - set(ops))
            extra = [o for o in ops if ops.count(o) > 1 or o not in expected]
            raise AssertionError(
                f"{what}: stage {s} must run each of F0..F{m - 1} and B0..B{m - 1} exactly once; "
                + (f"missing {_fmt(missing)}" if missing else f"repeated or out of range: {_fmt(sorted(set(extra)))}")
                + f" (stage {s}: {_fmt(ops, 40)}).")
        for i in range(m):
            if ops.index(("B", i)) < ops.index(("F", i)):
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
    rng = random.Random(draw_seed())
    cases = [(1, 1), (5, 1), (5, 2), (7, 3), (9, 4), (8, 4), (4, 4), (10, 3), (13, 5)]
    cases += [(n, rng.randint(1, n)) for n in rng.sample(range(2, 60), 6)]
    for n, k in cases:
        got = _call(f"partition_layers({n}, {k})", partition_layers, n, k)
        what = f"partition_layers({n}, {k})"
        if not isinstance(got, list) or not all(isinstance(r, range) for r in got):
            raise AssertionError(f"{what}: expected a list of range objects, got {short(got)}.")
        if len(got) != k:
            raise AssertionError(f"{what}: expected {k} ranges (one per stage), got {len(got)}: {got}.")
        if any(r.step != 1 for r in got):
            raise AssertionError(f"{what}: every stage holds consecutive layers (step 1), got {got}.")
        flat = [i for r in got for i in r]
        if flat != list(range(n)):
            raise AssertionError(f"{what}: the ranges must cover layers 0..{n - 1} in order, each once; got {got}.")
        expected = reference_partition(n, k)
        if [len(r) for r in got] != [len(r) for r in expected]:
            raise AssertionError(f"{what}: stage sizes {[len(r) for r in got]}, expected {[len(r) for r in expected]}"
                                 ": sizes differ by at most one and the larger stages come first.")
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
    for p, m in SHAPES:
        what = f"{name}({p}, {m})"
        got = _normalise(_call(what, fn, p, m), p, what)
        _check_each_once(got, p, m, what)
        if extra is not None:
            extra(what, p, m, got)
        expected = reference(p, m)
        for s in range(p):
            if got[s] != expected[s]:
                k = next((i for i, (a, b) in enumerate(zip(got[s], expected[s])) if a != b), 0)
                raise AssertionError(
                    f"{what}: stage {s} runs {_fmt(got[s], 40)}; expected {_fmt(expected[s], 40)} (first "
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


def _simulator_cases(rng: random.Random):
    """(label, schedule, t_fwd, t_bwd, closed form or None)."""
    cases = []
    for p, m in [(1, 3), (2, 1), (2, 4), (3, 2), (4, 1), (4, 4), (4, 8), (5, 3)]:
        for label, sched in (("GPipe", reference_gpipe(p, m)), ("1F1B", reference_1f1b(p, m))):
            cases.append((f"{label} p={p} m={m}, t_fwd=1, t_bwd=2", sched, 1.0, 2.0, (p, m)))
    for p, m in [(2, 3), (3, 5), (4, 2), (4, 7)]:
        tf, tb = round(rng.uniform(0.1, 1.9), 3), round(rng.uniform(0.1, 3.7), 3)
        for label, sched in (("GPipe", reference_gpipe(p, m)), ("1F1B", reference_1f1b(p, m)),
                             ("naive (F0 B0 F1 B1 ...)", naive_schedule(p, m)),
                             ("1F1B with p warm-up forwards on every stage", reference_1f1b(p, m, lambda s: p)),
                             ("a random valid order", random_valid_schedule(p, m, rng))):
            cases.append((f"{label} p={p} m={m}, t_fwd={tf}, t_bwd={tb}", sched, tf, tb, None))
    return cases


def check_simulate_schedule(simulate_schedule) -> None:
    """Makespan, bubble and busy spans against the closed forms and an independent simulation, odd times."""
    rng = random.Random(draw_seed())
    for label, sched, tf, tb, closed in _simulator_cases(rng):
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
                        if math.isclose(makespan, serial, rel_tol=1e-9) and cp > 1 else "")
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
    rng = random.Random(draw_seed())
    cases = []
    for p, m in SHAPES:
        cases += [("GPipe", reference_gpipe(p, m)), ("1F1B", reference_1f1b(p, m))]
    for p, m in [(3, 5), (4, 6), (5, 4)]:
        cases += [("naive", naive_schedule(p, m)), ("a random valid order", random_valid_schedule(p, m, rng))]
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


# ---------------------------------------------------------------------------------------------------------------
# run_pipeline on workers

D = 6  # width of every layer: stage inputs and outputs all have the micro-batch's shape (rows, D)


class _Residual(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def _layer(kind: int, d: int) -> nn.Module:
    kind %= 4
    if kind == 0:
        return nn.Sequential(nn.Linear(d, d), nn.Tanh())
    if kind == 1:
        return _Residual(d)
    if kind == 2:
        return nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d, bias=False), nn.GELU())
    return nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))


def _model(num_layers: int, seed: int) -> nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(*[_layer(seed + i, D) for i in range(num_layers)])


def _loss_fn(out, target):
    return ((out - target) ** 2).mean()


class _Mark(torch.autograd.Function):
    """Identity that tells the recorder when the backward of forward number ``index`` reaches this stage."""

    @staticmethod
    def forward(ctx, x, recorder, index):
        ctx.recorder, ctx.index = recorder, index
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.recorder.events.append(("B", ctx.index))
        return grad, None, None


class RecordingStage(nn.Module):
    """The stage a probe hands to ``run_pipeline``: runs ``inner`` and records ``("F", k)`` for the k-th forward
    call and ``("B", k)`` when that forward's backward starts on this stage."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.events = []
        self._forwards = 0

    def forward(self, x):
        k = self._forwards
        self._forwards += 1
        self.events.append(("F", k))
        out = self.inner(x)
        return _Mark.apply(out, self, k) if out.requires_grad else out


def _agree(failure) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([0 if failure is None else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _pipeline_case(run_pipeline, num_layers: int, m: int, kind: str, rows: int, seed: int):
    """One case on this rank; returns a message or None."""
    import torch.distributed as dist

    from labsupport import CommCounter

    rank, p = dist.get_rank(), dist.get_world_size()
    label = f"run_pipeline with {kind} on {p} stages, {num_layers} layers, m={m} micro-batches of {rows} rows"
    ranges = reference_partition(num_layers, p)
    model = _model(num_layers, seed)
    stage = RecordingStage(nn.Sequential(*[model[i] for i in ranges[rank]]))
    schedule = (reference_gpipe if kind == "GPipe" else reference_1f1b)(p, m)
    gen = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(rows, D, generator=gen) for _ in range(m)]
    ys = [torch.randn(rows, D, generator=gen) for _ in range(m)]
    xs_kept, ys_kept = [x.clone() for x in xs], [y.clone() for y in ys]

    oracle = _model(num_layers, seed)
    oracle_loss = sum(_loss_fn(oracle(x), y) for x, y in zip(xs, ys)) / m
    oracle_loss.backward()
    oracle_params = [dict(oracle[i].named_parameters()) for i in ranges[rank]]

    failure = None
    with CommCounter() as cc:
        try:
            loss = run_pipeline(stage, schedule, xs, ys, _loss_fn)
        except (NotImplementedError, AssertionError):
            raise
        except Exception as exc:
            failure = f"{label}: rank {rank} raised {type(exc).__name__}: {exc}"
    if failure is None:
        failure = _judge(rank, p, m, label, stage, schedule, loss, oracle_loss, oracle_params, ranges, cc,
                         xs, xs_kept, ys, ys_kept)
    return failure


def _judge(rank, p, m, label, stage, schedule, loss, oracle_loss, oracle_params, ranges, cc, xs, xs_kept, ys,
           ys_kept):
    if any(not torch.equal(a, b) for a, b in zip(xs + ys, xs_kept + ys_kept)):
        return f"{label}: rank {rank} changed the micro-batches or targets it was given; leave them untouched."
    if rank == p - 1:
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                return f"{label}: the last stage returned {short(loss)}; expected the mean loss, one number."
            loss = loss.item()
        if not isinstance(loss, (float, int)):
            return f"{label}: the last stage (rank {rank}) returned {short(loss)}; expected the mean loss (a float)."
        if not math.isclose(loss, oracle_loss.item(), rel_tol=1e-5, abs_tol=1e-6):
            return (f"{label}: the last stage returned loss {loss:.6g}, expected {oracle_loss.item():.6g}, the mean "
                    "over the micro-batches of loss_fn(output, target).")
    elif loss is not None:
        return f"{label}: rank {rank} returned {short(loss)}; every stage but the last returns None."
    expected_events = []
    order = [mb for op, mb in schedule[rank] if op == "F"]
    for op, mb in schedule[rank]:
        expected_events.append((op, order.index(mb)))
    if stage.events[: len(expected_events)] != expected_events or len(stage.events) != len(expected_events):
        to_mb = lambda ev: [f"{op}{order[k] if k < len(order) else k}" for op, k in ev]  # noqa: E731
        return (f"{label}: stage {rank} ran {' '.join(to_mb(stage.events)[:24])}, but schedule[{rank}] is "
                f"{_fmt(schedule[rank], 24)}: run exactly this stage's list, in order, one stage_module call per F "
                "and one backward per B.")
    for local, i in enumerate(ranges[rank]):
        for name, ref in oracle_params[local].items():
            got = dict(stage.inner[local].named_parameters())[name].grad
            if got is None:
                return (f"{label}: on stage {rank}, layer {i}'s {name} has no gradient. Every B must backpropagate "
                        "through this stage's modules.")
            if got.shape != ref.grad.shape or not torch.allclose(got, ref.grad, **tolerance(ref.grad.dtype)):
                ratio = (got.flatten() @ ref.grad.flatten() / ref.grad.flatten().pow(2).sum().clamp_min(1e-30)).item()
                hint = ""
                if math.isclose(ratio, m, rel_tol=1e-3):
                    hint = " It is m times too large: average the loss over the micro-batches (divide each by m)."
                elif rank < p - 1:
                    hint = (" The stages after this one may be right: look at the gradient this stage receives "
                            "from stage " f"{rank + 1} (it must be the gradient of the loss with respect to the "
                            "activation that stage received: make the received tensor a leaf with requires_grad_() "
                            "and send its .grad back), and at the activation it was computed from (a fresh tensor "
                            "per micro-batch: a receive buffer reused for the next micro-batch overwrites what "
                            "backward needs).")
                return (f"{label}: on stage {rank}, layer {i}'s {name}.grad is {short(got)}, expected "
                        f"{short(ref.grad)} (one-process training, loss averaged over micro-batches).{hint}")
    other = sorted({c.kind for c in cc.calls} - {"send", "recv"})
    if other:
        return (f"{label}: rank {rank} called torch.distributed.{other[0]}: a pipeline passes activations and "
                "gradients with point-to-point messages only (send/recv, isend/irecv).")
    peers = {c.peer for c in cc.calls if c.peer is not None}
    if peers - {rank - 1, rank + 1}:
        return (f"{label}: rank {rank} exchanged messages with rank(s) {sorted(peers - {rank - 1, rank + 1})}; a "
                "stage only talks to its neighbours (activations to rank + 1, gradients to rank - 1).")
    return None


def _pipeline_probe(run_pipeline, cases):
    """All cases on this rank; every case ends with all ranks agreeing whether one failed."""
    for num_layers, m, kind, rows, seed in cases:
        failure = _pipeline_case(run_pipeline, num_layers, m, kind, rows, seed)
        if _agree(failure):
            return failure
    return None


def check_run_pipeline(run_pipeline, world_sizes=(2, 3, 4), timeout=None) -> None:
    """Loss and every gradient equal to one-process training, on 2, 3 and 4 stages, GPipe and 1F1B, any (p, m)."""
    seed = draw_seed()
    rng = random.Random(seed)
    for p in world_sizes:
        layers = [2 * p + 1, p + 2 if (p + 2) % 2 else p + 3]  # odd numbers of layers: unequal stages
        cases = []
        for m in sorted({1, max(1, p - 1), p, p + rng.randint(1, 3)}):
            for kind in ("1F1B", "GPipe"):
                cases.append((layers[len(cases) % 2], m, kind, rng.randint(2, 5), rng.randrange(1, 10**6)))
        results = run_on_workers(_pipeline_probe, run_pipeline, cases, world_size=p, what="run_pipeline",
                                 timeout=timeout)
        failures = [r for r in results if r]
        if failures:
            raise AssertionError(f"{failures[0]} (seed {seed})")
