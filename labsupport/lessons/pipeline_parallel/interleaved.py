"""Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", arXiv 2104.04473, §2.2.2), simulated.

Each of the ``p`` ranks holds ``v`` model chunks instead of one contiguous stage: with ``p = 2, v = 2`` the model's
quarters go to ranks 0, 1, 0, 1. A micro-batch then crosses ``p * v`` virtual stages, each ``v`` times shorter, so
filling and draining the pipe takes ``v`` times less time: the bubble is ``(p - 1) / v`` operations long instead of
``p - 1``, for ``v`` times more messages. The order is Megatron-LM's: micro-batches go through in groups of ``p``;
rank ``r`` warms up with ``2 (p - r - 1) + (v - 1) p`` forwards, then alternates, then drains. It needs ``m`` to be
a multiple of ``p``.

``interleaved_schedule(p, m, v)`` gives per rank a list of ``(op, mb, chunk)``; ``simulate_interleaved(p, m, v,
t_fwd, t_bwd)`` runs it with ``t_fwd`` / ``t_bwd`` the time of a whole stage's forward / backward (a chunk takes
``1/v`` of it) and returns ``{"makespan", "bubble_fraction", "busy"}`` with ``busy`` entries ``(start, end, op, mb,
chunk)``. Both require ``v >= 2``: with one chunk per rank this is plain 1F1B, which your own functions cover.
"""

from __future__ import annotations

__all__ = ["interleaved_schedule", "simulate_interleaved"]


def _validate(p: int, m: int, v: int) -> None:
    if v < 2:
        raise ValueError("v must be at least 2; v = 1 is plain 1F1B (use one_f_one_b_schedule and simulate_schedule)")
    if p < 1 or m < 1 or m % p:
        raise ValueError(f"the interleaved schedule needs m to be a multiple of p, got p={p}, m={m}")


def interleaved_schedule(num_ranks: int, num_microbatches: int, v: int) -> list:
    p, m = num_ranks, num_microbatches
    _validate(p, m, v)
    total = m * v

    def unit(k, backward):  # the k-th forward (backward) a rank runs: which micro-batch, which chunk
        group = k // p
        chunk = group % v
        return (k // (p * v)) * p + k % p, (v - 1 - chunk) if backward else chunk

    out = []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * p, total)
        ops = [("F", *unit(k, False)) for k in range(warm)]
        for i in range(total - warm):
            ops += [("F", *unit(warm + i, False)), ("B", *unit(i, True))]
        ops += [("B", *unit(k, True)) for k in range(total - warm, total)]
        out.append(ops)
    return out


def simulate_interleaved(num_ranks: int, num_microbatches: int, v: int, t_fwd: float = 1.0,
                         t_bwd: float = 2.0) -> dict:
    p = num_ranks
    schedule = interleaved_schedule(num_ranks, num_microbatches, v)
    last = p * v - 1  # the last virtual stage
    done, free, nxt = {}, [0.0] * p, [0] * p
    busy = [[] for _ in range(p)]
    left = sum(len(ops) for ops in schedule)
    while left:
        placed = False
        for r in range(p):
            while nxt[r] < len(schedule[r]):
                op, mb, chunk = schedule[r][nxt[r]]
                j = chunk * p + r  # virtual stage
                if op == "F":
                    needs = [("F", mb, j - 1)] if j > 0 else []
                else:
                    needs = [("F", mb, j)] + ([("B", mb, j + 1)] if j < last else [])
                if any(n not in done for n in needs):
                    break
                start = max([free[r]] + [done[n] for n in needs])
                end = start + (t_fwd if op == "F" else t_bwd) / v
                done[(op, mb, j)] = free[r] = end
                busy[r].append((start, end, op, mb, chunk))
                nxt[r] += 1
                left -= 1
                placed = True
        if not placed:  # pragma: no cover (the order above always runs)
            raise RuntimeError("interleaved schedule stalled")
    makespan = max(free)
    work = sum(e - s for spans in busy for s, e, *_ in spans)
    return {"makespan": makespan, "bubble_fraction": 1 - work / (p * makespan), "busy": busy}
