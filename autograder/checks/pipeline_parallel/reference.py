"""The references of notebook 05_pipeline_parallel: the layer partition, the two schedules (and schedules no
notebook cell uses: naive model parallelism, random valid orders), the event simulator and the in-flight count.
They live here, not in ``labsupport`` (students receive that package).
"""

from __future__ import annotations

import random

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


def random_valid_schedule(p: int, m: int, rng: random.Random, with_w: bool = False) -> list:
    """A schedule that can run, in an order no textbook uses: a list scheduler with random durations and random
    tie-breaking between a stage's ready work records the order each stage ran it. ``with_w``: the backward is split
    into B (input gradient) and W (weight gradient, ready once that micro-batch's B is done), as in notebook 10."""
    kinds = "FBW" if with_w else "FB"
    dur = {(s, op): rng.uniform(0.2, 2.0) for s in range(p) for op in kinds}
    done, free = {}, [0.0] * p
    nxt = {op: [0] * p for op in kinds}  # next micro-batch of each kind per stage (each kind in micro-batch order)
    nf, nb = nxt["F"], nxt["B"]
    last = nxt[kinds[-1]]
    order = [[] for _ in range(p)]
    while any(last[s] < m for s in range(p)):
        choices = []
        for s in range(p):
            if nf[s] < m and (s == 0 or (s - 1, "F", nf[s]) in done):
                ready = 0.0 if s == 0 else done[(s - 1, "F", nf[s])]
                choices.append((max(free[s], ready), rng.random(), s, "F", nf[s]))
            if nb[s] < nf[s] and (s == p - 1 or (s + 1, "B", nb[s]) in done):
                ready = done[(s, "F", nb[s])] if s == p - 1 else done[(s + 1, "B", nb[s])]
                choices.append((max(free[s], ready), rng.random(), s, "B", nb[s]))
            if with_w and nxt["W"][s] < nb[s]:
                choices.append((max(free[s], done[(s, "B", nxt["W"][s])]), rng.random(), s, "W", nxt["W"][s]))
        start, _, s, op, mb = min(choices)
        done[(s, op, mb)] = free[s] = start + dur[(s, op)]
        order[s].append((op, mb))
        nxt[op][s] += 1
    return order
