"""Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", arXiv 2104.04473, §2.2.2): Megatron-LM's order and its event simulation.

This is a reference, so it lives here and not in ``labsupport`` (students receive that package, and this simulator
is notebook 05's ``simulate_schedule`` with a chunk index added). Notebook 05 shows its result for the one size it
draws, stored as data in ``labsupport/lessons/pipeline_parallel/interleaved.py``; ``stored_spans()`` writes that data
and a test checks that the stored copy equals what this module computes.

Each of the ``p`` ranks holds ``v`` model chunks: with ``p = 2, v = 2`` the model's quarters go to ranks 0, 1, 0, 1.
A micro-batch crosses ``p v`` virtual stages, each ``v`` times shorter. The order is Megatron-LM's: micro-batches go
through in groups of ``p``; rank ``r`` warms up with ``2 (p - r - 1) + (v - 1) p`` forwards, then alternates, then
drains. Megatron-LM needs ``m`` to be a multiple of ``p`` for it.
"""

from __future__ import annotations

__all__ = ["interleaved_schedule", "simulate_interleaved", "stored_spans", "STORED_SIZES"]

#: (p, m, v, t_fwd, t_bwd) of the runs notebook 05 draws.
STORED_SIZES = [(4, 8, 2, 1.0, 2.0), (4, 8, 4, 1.0, 2.0)]


def _validate(p: int, m: int, v: int) -> None:
    if v < 2:
        raise ValueError("v must be at least 2; v = 1 is plain 1F1B")
    if p < 1 or m < 1 or m % p:
        raise ValueError(f"Megatron-LM's interleaved order needs m to be a multiple of p, got p={p}, m={m}")


def interleaved_schedule(num_ranks: int, num_microbatches: int, v: int) -> list:
    """Per rank, a list of ``(op, mb, chunk)`` in Megatron-LM's order."""
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
    """``t_fwd`` / ``t_bwd``: a whole stage's forward / backward (a chunk takes ``1/v`` of it). Returns
    ``{"makespan", "bubble_fraction", "busy"}`` with ``busy`` entries ``(start, end, op, mb, chunk)``."""
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


def stored_spans() -> dict:
    """The data notebook 05 draws: ``(p, m, v, t_fwd, t_bwd) -> per rank, a list of (start, op, mb, chunk)``."""
    out = {}
    for p, m, v, t_fwd, t_bwd in STORED_SIZES:
        busy = simulate_interleaved(p, m, v, t_fwd, t_bwd)["busy"]
        out[p, m, v, t_fwd, t_bwd] = [[(start, op, mb, chunk) for start, _, op, mb, chunk in spans] for spans in busy]
    return out
