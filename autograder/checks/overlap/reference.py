"""The references of notebook 10_overlap: the ZB-H1 schedule, an event simulator that knows the weight-gradient
pass ``W``, the in-flight count up to ``W``, the zig-zag layout and dense causal attention (the oracle of
``zigzag_ring_attention``; the other two oracles are one line each, in their probes). They live here, not in ``labsupport`` (students receive that
package).
"""

from __future__ import annotations

import math
import random



def reference_zero_bubble(p: int, m: int) -> list:
    """ZB-H1 (Qi et al., ICLR 2024, arXiv 2401.10241, §3.1): 1F1B's warm-up, then F, B (input gradient) pairs; stage
    ``s`` puts off its first ``s`` weight gradients ``W`` and runs one after every later ``B``, the rest at the end.
    So every stage keeps at most ``p`` micro-batches from ``F`` to ``W``, the first stage's 1F1B peak."""
    out = []
    for s in range(p):
        w = min(p - s - 1, m)
        ops = [("F", i) for i in range(w)]
        nb = nw = 0
        for i in range(m - w):
            ops += [("F", w + i), ("B", nb)]
            nb += 1
            if nb > s:
                ops.append(("W", nw))
                nw += 1
        while nb < m:
            ops.append(("B", nb))
            nb += 1
            if nb > s:
                ops.append(("W", nw))
                nw += 1
        ops += [("W", i) for i in range(nw, m)]
        out.append(ops)
    return out


def _deps(s: int, p: int, op: str, mb: int) -> list:
    if op == "F":
        return [(s - 1, "F", mb)] if s > 0 else []
    if op == "B":
        return [(s, "F", mb)] + ([(s + 1, "B", mb)] if s < p - 1 else [])
    return [(s, "B", mb)]  # "W": the weight gradient needs this stage's output gradient, from its B


def reference_simulate_w(schedule, t_fwd: float, t_bwd: float, t_w: float = 0.0) -> dict:
    """05's fixed-point sweep with a third operation: ``W`` takes ``t_w`` and waits for the same stage's ``B``."""
    p = len(schedule)
    done, nxt, free = {}, [0] * p, [0.0] * p
    busy = [[] for _ in range(p)]
    remaining = sum(len(ops) for ops in schedule)
    cost = {"F": t_fwd, "B": t_bwd, "W": t_w}
    while remaining:
        progressed = False
        for s in range(p):
            while nxt[s] < len(schedule[s]):
                op, mb = schedule[s][nxt[s]]
                deps = _deps(s, p, op, mb)
                if any(d not in done for d in deps):
                    break
                start = max([free[s]] + [done[d] for d in deps])
                end = start + cost[op]
                done[(s, op, mb)] = free[s] = end
                busy[s].append((start, end, op, mb))
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [f"stage {s} at {schedule[s][nxt[s]]}" for s in range(p) if nxt[s] < len(schedule[s])]
            raise ValueError("the schedule cannot run: " + ", ".join(stuck) + " wait for operations that never come")
    makespan = max((b[-1][1] for b in busy if b), default=0.0)
    work = sum(e - s for b in busy for s, e, _, _ in b)
    return {"makespan": makespan, "bubble_fraction": 1.0 - work / (p * makespan) if makespan > 0 else 0.0,
            "busy": busy}


def reference_in_flight_w(schedule) -> list:
    """Per stage, the most micro-batches whose F has run and whose activations are still needed: until W when the
    schedule splits the backward, until B otherwise."""
    out = []
    for ops in schedule:
        split = any(op == "W" for op, _ in ops)
        live, peak = set(), 0
        for op, mb in ops:
            if op == "F":
                live.add(mb)
            elif op == ("W" if split else "B"):
                live.discard(mb)
            peak = max(peak, len(live))
        out.append(peak)
    return out


def random_valid_schedule_w(p: int, m: int, rng: random.Random) -> list:
    """A runnable schedule with W, in an order nobody writes (05's random list scheduler, with W)."""
    from ..pipeline_parallel.reference import random_valid_schedule

    return random_valid_schedule(p, m, rng, with_w=True)


def zigzag_positions(world: int, rank: int, chunk: int) -> list:
    """Sequence positions rank ``rank`` holds: chunk ``rank`` then chunk ``2·world − 1 − rank``."""
    return [pos for which in (rank, 2 * world - 1 - rank) for pos in range(which * chunk, which * chunk + chunk)]


def dense_causal(q, k, v, rows=None):
    """(B, S, H, D) each: causal attention in one process, in float64 for the oracle; ``rows``, a list of query
    positions, computes those only (the result's second dimension follows them)."""
    import torch

    S = q.shape[1]
    rows = torch.arange(S) if rows is None else torch.as_tensor(rows)
    qf, kf, vf = (t.double().transpose(1, 2) for t in (q[:, rows], k, v))
    scores = qf @ kf.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.arange(S)[None, :] > rows[:, None], -math.inf)
    return (torch.softmax(scores, -1) @ vf).transpose(1, 2).to(q.dtype)
