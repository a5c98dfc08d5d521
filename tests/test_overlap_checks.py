"""autograder.checks.overlap: correct implementations pass; planted bugs lose the points with their own message.

Bugs: in ``allgather_matmul`` the product before the transfer is posted, a blocking send (ordered so it does not
deadlock), the chunks in the wrong order, the built-in all-gather, one product of the gathered input at the end,
group ranks used as global ranks, no product on one rank; in ``matmul_reduce_scatter`` all partial products first, a
blocking send, the wrong chunk kept, the built-in reduce-scatter, group ranks used as global ranks; in
``zero_bubble_schedule`` 1F1B with B split but W right after it (no gain), W before B, too many warm-up forwards, a
schedule that cannot run, a table of ZB-H1 at the sizes the check once used; in ``simulate_schedule`` W taking
t_bwd, W waiting for the next stage, a makespan taken from the first stage or from the last operation simulated
instead of the last one to end; in ``zigzag_ring_attention`` the contiguous split's mask, all blocks computed and
masked, the masked blocks skipped on one kind of step only (unequal work), the transfer posted after the step's
products, the built-in all-gather, group ranks used as global ranks. Correct alternatives: other ways of writing
each (double buffering, W @ x.T, batch_isend_irecv with group_peer, einsum with group_dst/group_src, the diagonal
blocks skipped block by block, an event-driven simulator).
"""

import math

import pytest
import torch
import torch.distributed as dist

from autograder.checks.overlap import (check_allgather_matmul, check_matmul_reduce_scatter, check_simulate_schedule,
                                       check_zero_bubble_schedule, check_zigzag_ring_attention)
from autograder.checks.overlap.reference import reference_simulate_w, reference_zero_bubble
from autograder.checks.pipeline_parallel.reference import reference_1f1b


def _fails(check, fn, *words):
    with pytest.raises(AssertionError) as info:
        check(fn)
    text = str(info.value)
    for w in words:
        assert w in text, text
    return text


# ---------------------------------------------------------------------------------------------------------------
# allgather_matmul


def _peers(group, rank, world):
    """The global ranks of the next and the previous rank on the ring of ``group``."""
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return glob((rank + 1) % world), glob((rank - 1) % world)


def agm_ok(x_shard, weight, group=None):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = _peers(group, rank, world)
    n = x_shard.shape[0]
    out = x_shard.new_empty(world * n, weight.shape[0])
    cur = x_shard
    for step in range(world):
        src = (rank - step) % world
        if step < world - 1:
            buf = torch.empty_like(x_shard)
            reqs = [dist.isend(cur.contiguous(), nxt, group=group), dist.irecv(buf, prv, group=group)]
        out[src * n:(src + 1) * n] = cur @ weight.T
        if step < world - 1:
            for r in reqs:
                r.wait()
            cur = buf
    return out


def agm_batch(x_shard, weight, group=None):
    """Correct alternative: batch_isend_irecv with group ranks (group_peer), W @ x.T, results gathered in a list."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    parts, cur = [None] * world, x_shard
    for step in range(world):
        src = (rank - step) % world
        if step < world - 1:
            buf = torch.empty_like(x_shard)
            reqs = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, cur, group=group, group_peer=(rank + 1) % world),
                dist.P2POp(dist.irecv, buf, group=group, group_peer=(rank - 1) % world)])
        parts[src] = (weight @ cur.T).T
        if step < world - 1:
            for r in reqs:
                r.wait()
            cur = buf
    return torch.cat(parts)


def agm_group_ranks(x_shard, weight, group=None):
    """Group ranks passed where isend/irecv take global ones (right on the default group only)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n, cur = x_shard.shape[0], x_shard
    out = x_shard.new_empty(world * n, weight.shape[0])
    for step in range(world):
        src = (rank - step) % world
        if step < world - 1:
            buf = torch.empty_like(x_shard)
            reqs = [dist.isend(cur, (rank + 1) % world, group=group), dist.irecv(buf, (rank - 1) % world, group=group)]
        out[src * n:(src + 1) * n] = cur @ weight.T
        if step < world - 1:
            for r in reqs:
                r.wait()
            cur = buf
    return out


def agm_matmul_first(x_shard, weight, group=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    n, parts, cur = x_shard.shape[0], [None] * world, x_shard
    for step in range(world):
        src = (rank - step) % world
        parts[src] = cur @ weight.T                       # computed before the next transfer is posted
        if step < world - 1:
            buf = torch.empty_like(x_shard)
            reqs = [dist.isend(cur, (rank + 1) % world), dist.irecv(buf, (rank - 1) % world)]
            for r in reqs:
                r.wait()
            cur = buf
    return torch.cat(parts)


def agm_blocking(x_shard, weight, group=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    parts, cur = [None] * world, x_shard
    for step in range(world):
        src = (rank - step) % world
        if step < world - 1:
            buf = torch.empty_like(x_shard)
            if rank % 2 == 0:                             # ordered so that blocking calls cannot deadlock
                dist.send(cur, (rank + 1) % world)
                dist.recv(buf, (rank - 1) % world)
            else:
                dist.recv(buf, (rank - 1) % world)
                dist.send(cur, (rank + 1) % world)
        parts[src] = cur @ weight.T
        if step < world - 1:
            cur = buf
    return torch.cat(parts)


def agm_wrong_order(x_shard, weight, group=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    parts, cur = [], x_shard
    for step in range(world):
        if step < world - 1:
            buf = torch.empty_like(x_shard)
            reqs = [dist.isend(cur, (rank + 1) % world), dist.irecv(buf, (rank - 1) % world)]
        parts.append(cur @ weight.T)                       # in arrival order, not rank order
        if step < world - 1:
            for r in reqs:
                r.wait()
            cur = buf
    return torch.cat(parts)


def agm_builtin(x_shard, weight, group=None):
    parts = [torch.empty_like(x_shard) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x_shard)
    return torch.cat([p @ weight.T for p in parts])


def agm_gather_then_one(x_shard, weight, group=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    parts, cur = [None] * world, x_shard
    parts[rank] = x_shard
    for step in range(1, world):
        buf = torch.empty_like(x_shard)
        reqs = [dist.isend(cur, (rank + 1) % world), dist.irecv(buf, (rank - 1) % world)]
        for r in reqs:
            r.wait()
        cur = buf
        parts[(rank - step) % world] = cur
    return torch.cat(parts) @ weight.T


def agm_alone_forgets_product(x_shard, weight, group=None):
    """Right on a ring; with one rank it returns the chunk itself instead of its product with the weight."""
    if dist.get_world_size(group) == 1:
        return x_shard.clone()
    return agm_ok(x_shard, weight, group)


def test_allgather_matmul_accepts_correct():
    check_allgather_matmul(agm_ok)
    check_allgather_matmul(agm_batch)


@pytest.mark.parametrize("fn, words", [
    (agm_matmul_first, ["before posting"]),
    (agm_blocking, ["blocking dist.send"]),
    (agm_wrong_order, ["place each where it belongs"]),
    (agm_builtin, ["torch.distributed.all_gather"]),
    (agm_gather_then_one, ["one product per chunk"]),
    (agm_group_ranks, ["on the group of global ranks [1, 2, 3]", "isend/irecv take global ranks"]),
    (agm_alone_forgets_product, ["1 ranks", "expected shape"]),
])
def test_allgather_matmul_rejects_bugs(fn, words):
    _fails(check_allgather_matmul, fn, *words)


# ---------------------------------------------------------------------------------------------------------------
# matmul_reduce_scatter


def mrs_ok(x, weight_shard, group=None):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = _peers(group, rank, world)
    chunks = x.chunk(world)
    acc = chunks[(rank - 1) % world] @ weight_shard.T
    for step in range(1, world):
        buf = torch.empty_like(acc)
        reqs = [dist.isend(acc, nxt, group=group), dist.irecv(buf, prv, group=group)]
        part = chunks[(rank - 1 - step) % world] @ weight_shard.T     # the next chunk while acc travels
        for r in reqs:
            r.wait()
        acc = buf + part
    return acc


def mrs_einsum(x, weight_shard, group=None):
    """Correct alternative: einsum, group ranks given as group_dst/group_src, the sends kept and waited at the end."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = x.shape[0] // world
    acc = torch.einsum("ik,ok->io", x[((rank - 1) % world) * n:][:n], weight_shard)
    sends = []
    for step in range(1, world):
        buf = torch.empty_like(acc)
        sends.append(dist.isend(acc, group=group, group_dst=(rank + 1) % world))
        recv = dist.irecv(buf, group=group, group_src=(rank - 1) % world)
        c = (rank - 1 - step) % world
        part = torch.einsum("ik,ok->io", x[c * n:(c + 1) * n], weight_shard)
        recv.wait()
        acc = buf + part
    for s in sends:
        s.wait()
    return acc


def mrs_group_ranks(x, weight_shard, group=None):
    """Group ranks passed where isend/irecv take global ones (right on the default group only)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    chunks = x.chunk(world)
    acc = chunks[(rank - 1) % world] @ weight_shard.T
    for step in range(1, world):
        buf = torch.empty_like(acc)
        reqs = [dist.isend(acc, (rank + 1) % world, group=group), dist.irecv(buf, (rank - 1) % world, group=group)]
        part = chunks[(rank - 1 - step) % world] @ weight_shard.T
        for r in reqs:
            r.wait()
        acc = buf + part
    return acc


def mrs_all_first(x, weight_shard, group=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    parts = [c @ weight_shard.T for c in x.chunk(world)]          # every product before any transfer
    acc = parts[(rank - 1) % world]
    for step in range(1, world):
        buf = torch.empty_like(acc)
        reqs = [dist.isend(acc, (rank + 1) % world), dist.irecv(buf, (rank - 1) % world)]
        for r in reqs:
            r.wait()
        acc = buf + parts[(rank - 1 - step) % world]
    return acc


def mrs_blocking(x, weight_shard, group=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = x.chunk(world)
    acc = chunks[(rank - 1) % world] @ weight_shard.T
    for step in range(1, world):
        buf = torch.empty_like(acc)
        if rank % 2 == 0:
            dist.send(acc, (rank + 1) % world)
            dist.recv(buf, (rank - 1) % world)
        else:
            dist.recv(buf, (rank - 1) % world)
            dist.send(acc, (rank + 1) % world)
        acc = buf + chunks[(rank - 1 - step) % world] @ weight_shard.T
    return acc


def mrs_wrong_chunk(x, weight_shard, group=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = x.chunk(world)
    acc = chunks[rank] @ weight_shard.T                               # ends with chunk rank + 1
    for step in range(1, world):
        buf = torch.empty_like(acc)
        reqs = [dist.isend(acc, (rank + 1) % world), dist.irecv(buf, (rank - 1) % world)]
        part = chunks[(rank - step) % world] @ weight_shard.T
        for r in reqs:
            r.wait()
        acc = buf + part
    return acc


def mrs_builtin(x, weight_shard, group=None):
    world = dist.get_world_size()
    parts = [c @ weight_shard.T for c in x.chunk(world)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts)
    return out


def test_matmul_reduce_scatter_accepts_correct():
    check_matmul_reduce_scatter(mrs_ok)
    check_matmul_reduce_scatter(mrs_einsum)


@pytest.mark.parametrize("fn, words", [
    (mrs_all_first, ["before posting"]),
    (mrs_blocking, ["blocking dist."]),
    (mrs_wrong_chunk, ["rank r must end with chunk r"]),
    (mrs_builtin, ["reduce_scatter"]),
    (mrs_group_ranks, ["on the group of global ranks [1, 2, 3]", "isend/irecv take global ranks"]),
])
def test_matmul_reduce_scatter_rejects_bugs(fn, words):
    _fails(check_matmul_reduce_scatter, fn, *words)


# ---------------------------------------------------------------------------------------------------------------
# zero_bubble_schedule and simulate_schedule with W


def zb_ok(p, m):
    return reference_zero_bubble(p, m)


def zb_alt(p, m):
    """Correct alternative: ZB-H1 written as the list of deferred W's that each B releases."""
    out = []
    for s in range(p):
        w = min(p - s - 1, m)
        ops, pending = [("F", i) for i in range(w)], []
        fwd = w
        for b in range(m):
            if fwd < m:
                ops.append(("F", fwd))
                fwd += 1
            ops.append(("B", b))
            pending.append(b)
            if len(pending) > s:
                ops.append(("W", pending.pop(0)))
        ops += [("W", i) for i in pending]
        out.append(ops)
    return out


def zb_w_at_once(p, m):
    return [[x for op, mb in ops for x in ([(op, mb), ("W", mb)] if op == "B" else [(op, mb)])]
            for ops in reference_1f1b(p, m)]


def zb_w_first(p, m):
    return [[("W", mb) if op == "B" else ("B", mb) if op == "W" else (op, mb) for op, mb in ops]
            for ops in reference_zero_bubble(p, m)]


def zb_too_many_warmup(p, m):
    out = []
    for s in range(p):
        w = min(p - s, m)                                  # one more forward before the first B
        ops = [("F", i) for i in range(w)]
        for i in range(m - w):
            ops += [("F", w + i), ("B", i), ("W", i)]
        for i in range(m - w, m):
            ops += [("B", i), ("W", i)]
        out.append(ops)
    return out


def zb_deadlock(p, m):
    sched = reference_zero_bubble(p, m)
    if p > 1 and m > 1:
        last = sched[-1]
        i, j = last.index(("F", 0)), last.index(("F", 1))
        last[i], last[j] = last[j], last[i]                # the last stage wants F1 before F0: fine...
        b0, f1 = last.index(("B", 0)), last.index(("F", 0))
        last[b0], last[f1] = last[f1], last[b0]            # ...and B0 before F0: can never run
    return sched


def test_zero_bubble_accepts_correct():
    check_zero_bubble_schedule(zb_ok)
    check_zero_bubble_schedule(zb_alt)


@pytest.mark.parametrize("fn, words", [
    (zb_w_at_once, ["let the W's wait"]),
    (zb_w_first, ["then W"]),
    (zb_too_many_warmup, ["1F1B's peak"]),
    (zb_deadlock, ["zero_bubble_schedule("]),
])
def test_zero_bubble_rejects_bugs(fn, words):
    _fails(check_zero_bubble_schedule, fn, *words)


def test_zero_bubble_rejects_a_table_of_the_sizes_it_once_drew_from():
    """ZB-H1 looked up for every size the check once fixed or drew (p 2..6, m 1..10), W right after B beyond: the
    sizes drawn at grading time (one with p >= 7 and m >= 11) find it out, and the message gives the seed."""
    table = {(p, m): reference_zero_bubble(p, m) for p in range(2, 7) for m in range(1, 11)}

    def zb_table(p, m):
        return [list(ops) for ops in table[p, m]] if (p, m) in table else zb_w_at_once(p, m)

    _fails(check_zero_bubble_schedule, zb_table, "let the W's wait", "(seed ")


def sim_ok(schedule, t_fwd, t_bwd, t_w=0.0):
    return reference_simulate_w(schedule, t_fwd, t_bwd, t_w)


def sim_recursive(schedule, t_fwd, t_bwd, t_w=0.0):
    """Correct alternative: finish times by recursion over dependencies."""
    import functools

    p = len(schedule)
    index = {(s, op, mb): i for s, ops in enumerate(schedule) for i, (op, mb) in enumerate(ops)}
    cost = {"F": t_fwd, "B": t_bwd, "W": t_w}

    @functools.lru_cache(None)
    def end(s, i):
        op, mb = schedule[s][i]
        deps = [end(s, i - 1)] if i else [0.0]
        if op == "F" and s > 0:
            deps.append(end(s - 1, index[(s - 1, "F", mb)]))
        if op == "B" and s < p - 1:
            deps.append(end(s + 1, index[(s + 1, "B", mb)]))
        return max(deps) + cost[op]

    busy = [[(end(s, i) - cost[op], end(s, i), op, mb) for i, (op, mb) in enumerate(ops)]
            for s, ops in enumerate(schedule)]
    makespan = max(b[-1][1] for b in busy)
    work = sum(e - a for b in busy for a, e, _, _ in b)
    return {"busy": busy, "makespan": makespan, "bubble_fraction": 1 - work / (p * makespan)}


def sim_w_costs_b(schedule, t_fwd, t_bwd, t_w=0.0):
    return reference_simulate_w(schedule, t_fwd, t_bwd, t_bwd)


def sim_w_waits_next(schedule, t_fwd, t_bwd, t_w=0.0):
    """W treated like B: it waits for the next stage."""
    renamed = [[("B", mb) if op == "W" else ("X", mb) if op == "B" else (op, mb) for op, mb in ops]
               for ops in schedule]
    p = len(schedule)
    done, nxt, free, busy = {}, [0] * p, [0.0] * p, [[] for _ in range(p)]
    left = sum(map(len, schedule))
    while left:
        for s in range(p):
            while nxt[s] < len(schedule[s]):
                op, mb = schedule[s][nxt[s]]
                deps = {"F": [(s - 1, "F", mb)] if s else [], "B": [(s + 1, "B", mb)] if s < p - 1 else [],
                        "W": [(s, "B", mb)] + ([(s + 1, "W", mb)] if s < p - 1 else [])}[op]
                if any(d not in done for d in deps):
                    break
                a = max([free[s]] + [done[d] for d in deps])
                e = a + {"F": t_fwd, "B": t_bwd, "W": t_w}[op]
                done[(s, op, mb)] = free[s] = e
                busy[s].append((a, e, op, mb))
                nxt[s] += 1
                left -= 1
    del renamed
    makespan = max(b[-1][1] for b in busy)
    return {"busy": busy, "makespan": makespan,
            "bubble_fraction": 1 - sum(e - a for b in busy for a, e, _, _ in b) / (p * makespan)}


def sim_events(schedule, t_fwd, t_bwd, t_w=0.0):
    """Correct alternative: a clock that jumps from one finishing operation to the next (a heap of times); the
    makespan is the latest end of any span."""
    import heapq

    p, cost = len(schedule), {"F": t_fwd, "B": t_bwd, "W": t_w}
    done, nxt, free, busy = {}, [0] * p, [0.0] * p, [[] for _ in range(p)]
    heap, waiting = [(0.0, s) for s in range(p)], set()
    while heap:
        _, s = heapq.heappop(heap)
        if nxt[s] == len(schedule[s]):
            continue
        op, mb = schedule[s][nxt[s]]
        deps = {"F": [(s - 1, "F", mb)] if s else [], "W": [(s, "B", mb)],
                "B": [(s, "F", mb)] + ([(s + 1, "B", mb)] if s < p - 1 else [])}[op]
        if any(d not in done for d in deps):
            waiting.add(s)
            continue
        start = max([free[s]] + [done[d] for d in deps])
        done[(s, op, mb)] = free[s] = start + cost[op]
        busy[s].append((start, start + cost[op], op, mb))
        nxt[s] += 1
        for w in waiting | {s}:
            heapq.heappush(heap, (free[s], w))
        waiting.clear()
    if any(nxt[s] < len(schedule[s]) for s in range(p)):
        raise ValueError("this schedule deadlocks")
    makespan = max(end for spans in busy for _, end, _, _ in spans)
    work = sum(end - start for spans in busy for start, end, _, _ in spans)
    return {"busy": busy, "makespan": makespan, "bubble_fraction": 1 - work / (p * makespan)}


def sim_makespan_first_stage(schedule, t_fwd, t_bwd, t_w=0.0):
    """The makespan read off stage 0, which ends last in GPipe, 1F1B and ZB-H1 (not when another stage owes W's)."""
    out = reference_simulate_w(schedule, t_fwd, t_bwd, t_w)
    makespan = out["busy"][0][-1][1]
    work = sum(end - start for spans in out["busy"] for start, end, _, _ in spans)
    return {"busy": out["busy"], "makespan": makespan, "bubble_fraction": 1 - work / (len(schedule) * makespan)}


def sim_makespan_last_simulated(schedule, t_fwd, t_bwd, t_w=0.0):
    """The makespan is the end of the operation simulated last (the sweep's order), not the latest end."""
    p, cost = len(schedule), {"F": t_fwd, "B": t_bwd, "W": t_w}
    done, nxt, free, busy, last = {}, [0] * p, [0.0] * p, [[] for _ in range(p)], 0.0
    while any(nxt[s] < len(schedule[s]) for s in range(p)):
        before = sum(nxt)
        for s in range(p):
            while nxt[s] < len(schedule[s]):
                op, mb = schedule[s][nxt[s]]
                deps = {"F": [(s - 1, "F", mb)] if s else [], "W": [(s, "B", mb)],
                        "B": [(s, "F", mb)] + ([(s + 1, "B", mb)] if s < p - 1 else [])}[op]
                if any(d not in done for d in deps):
                    break
                start = max([free[s]] + [done[d] for d in deps])
                done[(s, op, mb)] = free[s] = last = start + cost[op]
                busy[s].append((start, last, op, mb))
                nxt[s] += 1
        if sum(nxt) == before:
            raise ValueError("this schedule deadlocks")
    work = sum(end - start for spans in busy for start, end, _, _ in spans)
    return {"busy": busy, "makespan": last, "bubble_fraction": 1 - work / (p * last)}


def test_simulate_accepts_correct():
    check_simulate_schedule(sim_ok)
    check_simulate_schedule(sim_recursive)
    check_simulate_schedule(sim_events)


@pytest.mark.parametrize("fn, words", [
    (sim_w_costs_b, ["A W takes t_w"]),
    (sim_w_waits_next, ["expected"]),
    (sim_makespan_first_stage, ["the last operation of any stage ends", "not the end of stage 0"]),
    (sim_makespan_last_simulated, ["the last operation of any stage ends"]),
])
def test_simulate_rejects_bugs(fn, words):
    _fails(check_simulate_schedule, fn, *words)


@pytest.mark.parametrize("seed", [15014074, *range(1, 41)])
def test_simulate_names_a_w_that_takes_t_bwd_whatever_the_draw(seed, monkeypatch):
    """A W that takes t_bwd on one stage delays the B's of the stages before it: the message names the W (the
    earliest span off its time), not a late B on stage 0, whichever orders the seed draws (15014074 drew one where
    stage 0's B1 came first in the scan)."""
    from autograder.checks.overlap import schedules

    monkeypatch.setattr(schedules, "draw_seed", lambda: seed)
    _fails(check_simulate_schedule, sim_w_costs_b, "A W takes t_w")


# ---------------------------------------------------------------------------------------------------------------
# zigzag_ring_attention


def _fold(state, scores, v):
    m, l, acc = state
    m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
    shrink, p = torch.exp(m - m_new), torch.exp(scores - m_new)
    return m_new, l * shrink + p.sum(-1, keepdim=True), acc * shrink + p @ v


def _zigzag(q, k, v, mode="ok", group=None):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = ((rank + 1) % world, (rank - 1) % world) if mode == "group_ranks" else _peers(group, rank, world)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))               # (B, H, 2c, D)
    c = q.shape[2] // 2
    q = q / math.sqrt(q.shape[-1])
    m = torch.full((*q.shape[:-1], 1), -math.inf, dtype=q.dtype)
    state = (m, torch.zeros_like(m), torch.zeros_like(q))
    kv = torch.stack([k, v]).contiguous()
    mine = [rank, 2 * world - 1 - rank]
    for step in range(world):
        src = (rank - step) % world
        if step < world - 1 and mode != "late":
            buf = torch.empty_like(kv)
            reqs = [dist.isend(kv, nxt, group=group), dist.irecv(buf, prv, group=group)]
        theirs = [src, 2 * world - 1 - src]
        if mode == "contiguous":
            qpos = torch.arange(2 * c) + 2 * c * rank
            kpos = torch.arange(2 * c) + 2 * c * src
        else:
            qpos = torch.cat([torch.arange(c) + c * i for i in mine])
            kpos = torch.cat([torch.arange(c) + c * j for j in theirs])
        if mode in ("ok", "contiguous", "dense") or (mode == "lopsided" and src > rank):
            scores = q @ kv[0].transpose(-2, -1)
            future = kpos[None, :] > qpos[:, None]
            if future.all(-1).any() and mode != "dense":
                pass
            scores = scores.masked_fill(future, -math.inf)
            rows = ~future.all(-1)
            if mode == "ok" and not rows.all():                        # rows with nothing to see this step
                part = _fold(tuple(t[:, :, rows] for t in state), scores[:, :, rows], kv[1])
                state = tuple(torch.cat([p, s[:, :, ~rows]], 2) if False else _put(s, rows, p)
                              for s, p in zip(state, part))
            else:
                state = _fold_masked(state, scores, kv[1])
        else:                                                          # block by block, skipping what is masked
            for qi, qc in enumerate(mine):
                for ki, kc in enumerate(theirs):
                    if kc > qc:
                        continue
                    qs = slice(qi * c, (qi + 1) * c)
                    sc = q[:, :, qs] @ kv[0][:, :, ki * c:(ki + 1) * c].transpose(-2, -1)
                    if kc == qc:
                        sc = sc.masked_fill(torch.ones(c, c, dtype=torch.bool).triu(1), -math.inf)
                    part = _fold(tuple(t[:, :, qs] for t in state), sc, kv[1][:, :, ki * c:(ki + 1) * c])
                    state = tuple(_put(s, qs, p) for s, p in zip(state, part))
        if step < world - 1 and mode == "late":                        # the transfer after the products
            buf = torch.empty_like(kv)
            reqs = [dist.isend(kv, nxt, group=group), dist.irecv(buf, prv, group=group)]
        if step < world - 1:
            for r in reqs:
                r.wait()
            kv = buf
    m, l, acc = state
    return (acc / l).transpose(1, 2)


def _put(whole, where, part):
    out = whole.clone()
    out[:, :, where] = part
    return out


def _fold_masked(state, scores, v):
    """Fold a block whose rows may be entirely masked (they keep their state)."""
    m, l, acc = state
    m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
    safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    shrink, p = torch.exp(m - safe), torch.exp(scores - safe)
    return m_new, l * shrink + p.sum(-1, keepdim=True), acc * shrink + p @ v


def zz_ok(q, k, v, group=None):
    return _zigzag(q, k, v, "blocks", group)


def zz_halves(q, k, v, group=None):
    """Correct alternative: the reference layout of zig-zag ring attention implementations: own chunks as one
    masked 2c x 2c block, earlier ranks' first chunk against both queries, later ranks' k/v against the second."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = _peers(group, rank, world)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    c = qt.shape[2] // 2
    qt = qt / math.sqrt(qt.shape[-1])
    m = torch.full((*qt.shape[:-1], 1), -math.inf, dtype=qt.dtype)
    state = (m, torch.zeros_like(m), torch.zeros_like(qt))
    kv = torch.stack([kt, vt]).contiguous()
    for step in range(world):
        src = (rank - step) % world
        if step < world - 1:
            buf = torch.empty_like(kv)
            reqs = [dist.isend(kv, nxt, group=group), dist.irecv(buf, prv, group=group)]
        if step == 0:
            qpos = torch.cat([torch.arange(c) + c * rank, torch.arange(c) + c * (2 * world - 1 - rank)])
            sc = (qt @ kv[0].transpose(-2, -1)).masked_fill(qpos[None, :] > qpos[:, None], -math.inf)
            state = _fold(state, sc, kv[1])
        elif src < rank:                                   # its first chunk is before both of mine
            state = _fold(state, qt @ kv[0][:, :, :c].transpose(-2, -1), kv[1][:, :, :c])
        else:                                              # both its chunks are before my second only
            part = _fold(tuple(t[:, :, c:] for t in state), qt[:, :, c:] @ kv[0].transpose(-2, -1), kv[1])
            state = tuple(_put(s, slice(c, None), p) for s, p in zip(state, part))
        if step < world - 1:
            for r in reqs:
                r.wait()
            kv = buf
    m, l, acc = state
    return (acc / l).transpose(1, 2)


def zz_late(q, k, v, group=None):
    return _zigzag(q, k, v, "late")


def zz_contiguous(q, k, v, group=None):
    return _zigzag(q, k, v, "contiguous")


def zz_dense(q, k, v, group=None):
    return _zigzag(q, k, v, "dense")


def zz_lopsided(q, k, v, group=None):
    return _zigzag(q, k, v, "lopsided")


def zz_group_ranks(q, k, v, group=None):
    return _zigzag(q, k, v, "group_ranks", group)


def zz_builtin(q, k, v, group=None):
    world = dist.get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(world)], [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    return zz_ok(q, k, v)


def test_zigzag_accepts_correct():
    check_zigzag_ring_attention(zz_ok)
    check_zigzag_ring_attention(zz_halves)


@pytest.mark.parametrize("fn, words", [
    (zz_contiguous, ["contiguous split"]),
    (zz_late, ["no block product underneath"]),
    (zz_dense, ["skip the blocks that are entirely masked"]),
    (zz_lopsided, ["the same work"]),
    (zz_builtin, ["torch.distributed.all_gather"]),
    (zz_group_ranks, ["on the group of global ranks [1, 2, 3]", "isend/irecv take global ranks"]),
])
def test_zigzag_rejects_bugs(fn, words):
    _fails(check_zigzag_ring_attention, fn, *words)
