"""autograder.checks.pipeline_parallel: correct implementations pass; planted bugs lose the points with their own
message.

Bugs: stages that grow towards the end, no ValueError, GPipe's backwards in reverse, 1F1B without warm-up, with one
warm-up forward too many, with B before F in the steady phase, a simulator that ignores the cross-stage dependency,
one that computes the bubble of one stage, in-flight counts that never go down; answers right only at the sizes the
checks once fixed (a table of the reference there, something wrong elsewhere); and in ``run_pipeline``: the received
activation not made a leaf of the stage's graph (no gradient to send back), gradients sent to the wrong neighbour,
a receive buffer reused for every micro-batch, the loss summed instead of averaged, blocking sends (a deadlock in
1F1B on gloo), and a schedule ignored. Correct alternatives: other ways of writing each function, a simulator
written as a recursion over finish times and one as a list scheduler with a priority queue, a run_pipeline with
isend/irecv everywhere.
"""

import copy
import functools
import heapq

import pytest
import torch
import torch.distributed as dist

from autograder.checks import pipeline_parallel as pp
from autograder.checks.pipeline_parallel import (
    check_gpipe_schedule,
    check_max_in_flight,
    check_one_f_one_b_schedule,
    check_partition_layers,
    check_run_pipeline,
    check_simulate_schedule,
)

DEADLOCK_TIMEOUT = 8.0

# ---------------------------------------------------------------------------------------------------------------
# partition_layers


def partition_ok(num_layers, num_stages):
    if num_stages < 1 or num_layers < 1 or num_stages > num_layers:
        raise ValueError("bad")
    q, r = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        out.append(range(start, start + q + (s < r)))
        start = out[-1].stop
    return out


def partition_cumulative(num_layers, num_stages):
    """Correct alternative: boundaries from a formula."""
    if not (1 <= num_stages <= num_layers):
        raise ValueError("bad")
    q, r = divmod(num_layers, num_stages)
    bounds = [s * q + min(s, r) for s in range(num_stages + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def partition_late_big(num_layers, num_stages):
    """The extra layers go to the last stages."""
    if not (1 <= num_stages <= num_layers):
        raise ValueError("bad")
    q, r = divmod(num_layers, num_stages)
    bounds = [s * q + max(0, s - (num_stages - r)) for s in range(num_stages + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def partition_no_error(num_layers, num_stages):
    q, r = divmod(num_layers, max(num_stages, 1))
    out, start = [], 0
    for s in range(num_stages):
        out.append(range(start, start + q + (s < r)))
        start = out[-1].stop
    return out


def partition_lists(num_layers, num_stages):
    return [list(r) for r in partition_ok(num_layers, num_stages)]


def partition_table(num_layers, num_stages):
    """Right for every size the check once drew from (fewer than 60 layers), the stages in reverse order beyond."""
    if num_layers < 60:
        return pp.reference_partition(num_layers, num_stages)
    return partition_ok(num_layers, num_stages)[::-1]


def test_partition_accepts_correct():
    check_partition_layers(partition_ok)
    check_partition_layers(partition_cumulative)


@pytest.mark.parametrize("bad, match", [
    (partition_late_big, "larger stages come first"),
    (partition_no_error, "expected ValueError"),
    (partition_lists, "list of range objects"),
    (partition_table, r"\(seed \d+\): the ranges must cover layers 0\.\.\d+ in order"),
])
def test_partition_rejects(bad, match):
    with pytest.raises(AssertionError, match=match):
        check_partition_layers(bad)


# ---------------------------------------------------------------------------------------------------------------
# answers that are tables: right at the (p, m) every check used before it drew sizes, wrong at any other

OLD_SHAPES = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (3, 1), (3, 2), (3, 3), (3, 7), (4, 1), (4, 3), (4, 4), (4, 8),
              (5, 2), (5, 9), (8, 3), (8, 16)]
OLD_SIMULATOR_SHAPES = [(1, 3), (2, 1), (2, 4), (3, 2), (4, 1), (4, 4), (4, 8), (5, 3), (2, 3), (3, 5), (4, 2), (4, 7)]


def _table(reference, shapes, fallback):
    table = {shape: reference(*shape) for shape in shapes}

    def answer(p, m):
        return copy.deepcopy(table[p, m]) if (p, m) in table else fallback(p, m)

    return answer


def _by_shape(shapes, right, wrong):
    """A function of a schedule that is right when the schedule's (p, m) is one of ``shapes``."""
    def answer(schedule, *times):
        p, m = len(schedule), len(schedule[0]) // 2
        return (right if (p, m) in shapes else wrong)(schedule, *times)

    return answer


# ---------------------------------------------------------------------------------------------------------------
# schedules


def gpipe_ok(p, m):
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]


def gpipe_lists(p, m):
    """Correct alternative: lists [op, mb] instead of tuples."""
    return [[[op, i] for op in "FB" for i in range(m)] for _ in range(p)]


def gpipe_reversed_backward(p, m):
    return [[("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))] for _ in range(p)]


def gpipe_interleaved(p, m):
    return [[op for i in range(m) for op in (("F", i), ("B", i))] for _ in range(p)]


def one_f_one_b_ok(p, m):
    out = []
    for s in range(p):
        w = min(p - s - 1, m)
        ops = [("F", i) for i in range(w)]
        for i in range(m - w):
            ops += [("F", w + i), ("B", i)]
        out.append(ops + [("B", i) for i in range(m - w, m)])
    return out


def one_f_one_b_queue(p, m):
    """Correct alternative: pull from two queues."""
    out = []
    for s in range(p):
        fwd, bwd, ops = list(range(m)), list(range(m)), []
        for _ in range(min(p - s - 1, m)):
            ops.append(("F", fwd.pop(0)))
        while fwd:
            ops.append(("F", fwd.pop(0)))
            ops.append(("B", bwd.pop(0)))
        ops += [("B", i) for i in bwd]
        out.append(ops)
    return out


def one_f_one_b_no_warmup(p, m):
    return [[op for i in range(m) for op in (("F", i), ("B", i))] for _ in range(p)]


def one_f_one_b_warmup_too_long(p, m):
    return pp.reference_1f1b(p, m, lambda s: p - s)


def one_f_one_b_backward_first(p, m):
    out = []
    for s in range(p):
        w = min(p - s - 1, m)
        ops = [("F", i) for i in range(w)]
        for i in range(m - w):
            ops += [("B", i), ("F", w + i)]
        out.append(ops + [("B", i) for i in range(m - w, m)])
    return out


def test_schedules_accept_correct():
    check_gpipe_schedule(gpipe_ok)
    check_gpipe_schedule(gpipe_lists)
    check_one_f_one_b_schedule(one_f_one_b_ok)
    check_one_f_one_b_schedule(one_f_one_b_queue)


@pytest.mark.parametrize("check, bad, match", [
    (check_gpipe_schedule, gpipe_reversed_backward, "all m backwards in the same order"),
    (check_gpipe_schedule, gpipe_interleaved, "all m forwards in micro-batch order"),
    (check_gpipe_schedule, lambda p, m: gpipe_ok(p, m)[:-1], "expected a list of"),
    (check_gpipe_schedule, lambda p, m: [ops[:-1] for ops in gpipe_ok(p, m)], "exactly once; missing B"),
    (check_one_f_one_b_schedule, one_f_one_b_no_warmup, r"forwards before its first backward; expected min\(p - s"),
    (check_one_f_one_b_schedule, one_f_one_b_warmup_too_long, "before its first backward"),
    (check_one_f_one_b_schedule, one_f_one_b_backward_first, "B0 comes before F0|before its first backward"),
    (check_one_f_one_b_schedule, lambda p, m: [list(reversed(ops)) for ops in one_f_one_b_ok(p, m)],
     "comes before F"),
])
def test_schedules_reject(check, bad, match):
    with pytest.raises(AssertionError, match=match):
        check(bad)


@pytest.mark.parametrize("check, bad, match", [
    (check_gpipe_schedule, lambda p, m: _table(pp.reference_gpipe, OLD_SHAPES, gpipe_reversed_backward)(p, m),
     r"\(seed \d+\).*all m backwards in the same order"),
    (check_one_f_one_b_schedule, lambda p, m: _table(pp.reference_1f1b, OLD_SHAPES, gpipe_ok)(p, m),
     r"\(seed \d+\).*forwards before its first backward"),
])
def test_schedules_reject_a_table_of_the_fixed_sizes(check, bad, match):
    """The reference's answers at every fixed (p, m) of the check, GPipe (or GPipe's backwards reversed) elsewhere:
    the sizes drawn at grading time (one larger than any fixed one) find it out."""
    with pytest.raises(AssertionError, match=match):
        check(bad)


def test_schedule_cannot_run_is_explained():
    # stage 0 waits for B0 before sending F1, stage 1 waits for F1 before running B0: a cycle
    def bad(p, m):
        s = gpipe_ok(p, m)
        if p >= 2 and m >= 2:
            s[0] = [op for i in range(m) for op in (("F", i), ("B", i))]
        return s

    with pytest.raises(AssertionError, match="cannot all run"):
        check_gpipe_schedule(bad)


# ---------------------------------------------------------------------------------------------------------------
# simulate_schedule


def simulate_ok(schedule, t_fwd, t_bwd):
    return pp.reference_simulate(schedule, t_fwd, t_bwd)


def simulate_recursive(schedule, t_fwd, t_bwd):
    """Correct alternative: finish(s, k) = max(finish of the previous op on s, finish of what op k waits for) + t."""
    p = len(schedule)
    where = {(s, op, mb): k for s, ops in enumerate(schedule) for k, (op, mb) in enumerate(ops)}

    @functools.lru_cache(maxsize=None)
    def finish(s, k):
        op, mb = schedule[s][k]
        ready = finish(s, k - 1) if k else 0.0
        if op == "F" and s > 0:
            ready = max(ready, finish(s - 1, where[(s - 1, "F", mb)]))
        if op == "B" and s < p - 1:
            ready = max(ready, finish(s + 1, where[(s + 1, "B", mb)]))
        return ready + (t_fwd if op == "F" else t_bwd)

    busy = []
    for s, ops in enumerate(schedule):
        busy.append([(finish(s, k) - (t_fwd if op == "F" else t_bwd), finish(s, k), op, mb)
                     for k, (op, mb) in enumerate(ops)])
    makespan = max(row[-1][1] for row in busy)
    work = sum(e - b for row in busy for b, e, _, _ in row)
    return {"makespan": makespan, "bubble_fraction": 1 - work / (p * makespan), "busy": busy}


def simulate_heap(schedule, t_fwd, t_bwd):
    """Correct alternative: a list scheduler that always places, next, the ready operation that can start first
    (a priority queue of stages keyed by that start time)."""
    p = len(schedule)
    done, nxt, free = {}, [0] * p, [0.0] * p
    busy = [[] for _ in range(p)]

    def start_time(s):
        op, mb = schedule[s][nxt[s]]
        deps = [(s - 1, "F", mb)] if op == "F" and s > 0 else []
        if op == "B":
            deps = [(s, "F", mb)] + ([(s + 1, "B", mb)] if s < p - 1 else [])
        return max([free[s]] + [done[d] for d in deps]) if all(d in done for d in deps) else None

    queued = set()
    heap = []
    while True:
        for s in range(p):
            if s not in queued and nxt[s] < len(schedule[s]) and start_time(s) is not None:
                heapq.heappush(heap, (start_time(s), s))
                queued.add(s)
        if not heap:
            break
        start, s = heapq.heappop(heap)
        queued.discard(s)
        op, mb = schedule[s][nxt[s]]
        end = start + (t_fwd if op == "F" else t_bwd)
        done[(s, op, mb)] = free[s] = end
        busy[s].append((start, end, op, mb))
        nxt[s] += 1
    makespan = max(row[-1][1] for row in busy)
    work = sum(e - b for row in busy for b, e, _, _ in row)
    return {"makespan": makespan, "bubble_fraction": 1 - work / (p * makespan), "busy": busy}


def simulate_no_cross_stage(schedule, t_fwd, t_bwd):
    busy = []
    for ops in schedule:
        t, row = 0.0, []
        for op, mb in ops:
            d = t_fwd if op == "F" else t_bwd
            row.append((t, t + d, op, mb))
            t += d
        busy.append(row)
    makespan = max(r[-1][1] for r in busy)
    return {"makespan": makespan, "bubble_fraction": 0.0, "busy": busy}


def simulate_one_stage_bubble(schedule, t_fwd, t_bwd):
    out = pp.reference_simulate(schedule, t_fwd, t_bwd)
    first = out["busy"][0]
    out["bubble_fraction"] = 1 - sum(e - s for s, e, _, _ in first) / (len(schedule) * out["makespan"])
    return out


def simulate_forgets_forward_on_same_stage(schedule, t_fwd, t_bwd):
    """Ignores that a backward waits for the same stage's forward; also drops the stage clock for backwards."""
    p = len(schedule)
    out = pp.reference_simulate(schedule, t_fwd, t_bwd)
    busy = [list(row) for row in out["busy"]]
    busy[0] = [(s + 0.5, e + 0.5, op, mb) for s, e, op, mb in busy[0]]
    return {"makespan": out["makespan"], "bubble_fraction": out["bubble_fraction"], "busy": busy[:p]}


def simulate_backward_waits_wrong_neighbour(schedule, t_fwd, t_bwd):
    """A backward waits for stage s-1's backward instead of stage s+1's."""
    where = {(s, op, mb): k for s, ops in enumerate(schedule) for k, (op, mb) in enumerate(ops)}

    @functools.lru_cache(maxsize=None)
    def finish(s, k):
        op, mb = schedule[s][k]
        ready = finish(s, k - 1) if k else 0.0
        if s > 0:
            ready = max(ready, finish(s - 1, where[(s - 1, op, mb)]))
        return ready + (t_fwd if op == "F" else t_bwd)

    busy = [[(finish(s, k) - (t_fwd if op == "F" else t_bwd), finish(s, k), op, mb) for k, (op, mb) in enumerate(ops)]
            for s, ops in enumerate(schedule)]
    makespan = max(row[-1][1] for row in busy)
    work = sum(e - b for row in busy for b, e, _, _ in row)
    return {"makespan": makespan, "bubble_fraction": 1 - work / (len(schedule) * makespan), "busy": busy}


def simulate_mutates(schedule, t_fwd, t_bwd):
    out = pp.reference_simulate(schedule, t_fwd, t_bwd)
    schedule[0].reverse()
    return out


def test_simulator_accepts_correct():
    check_simulate_schedule(simulate_ok)
    check_simulate_schedule(simulate_recursive)
    check_simulate_schedule(simulate_heap)


@pytest.mark.parametrize("bad, match", [
    (simulate_no_cross_stage, "That is one stage's own work"),
    (simulate_backward_waits_wrong_neighbour, "a backward for its backward on stage s\\+1"),
    (simulate_one_stage_bubble, r"bubble_fraction .* expected \(p - 1\)/\(m \+ p - 1\)"),
    (simulate_forgets_forward_on_same_stage, r"busy\[0\]\[0\]"),
    (simulate_mutates, "changed the schedule"),
    (lambda s, f, b: (1.0, 0.5, []), "expected a dict"),
    (_by_shape(OLD_SIMULATOR_SHAPES, simulate_ok, simulate_no_cross_stage), r"\(seed \d+\)"),
])
def test_simulator_rejects(bad, match):
    with pytest.raises(AssertionError, match=match):
        check_simulate_schedule(bad)


# ---------------------------------------------------------------------------------------------------------------
# max_in_flight


def in_flight_ok(schedule):
    out = []
    for ops in schedule:
        live, peak = set(), 0
        for op, mb in ops:
            (live.add if op == "F" else live.discard)(mb)
            peak = max(peak, len(live))
        out.append(peak)
    return out


def in_flight_forwards(schedule):
    return [sum(op == "F" for op, _ in ops) for ops in schedule]


def in_flight_one_f_one_b_formula(schedule):
    p = len(schedule)
    m = len(schedule[0]) // 2
    return [min(p - s, m) for s in range(p)]


def test_in_flight_accepts_correct():
    check_max_in_flight(in_flight_ok)


@pytest.mark.parametrize("bad", [in_flight_forwards, in_flight_one_f_one_b_formula,
                                 _by_shape(OLD_SHAPES + [(3, 5), (4, 6), (5, 4)], in_flight_ok, in_flight_forwards)])
def test_in_flight_rejects(bad):
    with pytest.raises(AssertionError, match="whose F has run and whose B has not"):
        check_max_in_flight(bad)


# ---------------------------------------------------------------------------------------------------------------
# run_pipeline (real workers)


def run_ok(stage_module, schedule, microbatches, targets, loss_fn, *, reuse_buffer=False, no_leaf=False,
           grad_to=-1, blocking=False, average=True, ignore_schedule=False, drop_requests=False):
    rank, p = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == p - 1
    m = len(microbatches)
    ops = gpipe_ok(p, m)[rank] if ignore_schedule else schedule[rank]
    inputs, outputs, pending, total = {}, {}, [], 0.0
    buffer = torch.empty_like(microbatches[0])
    for op, mb in ops:
        if op == "F":
            if first:
                x = microbatches[mb]
            else:
                x = buffer if reuse_buffer else torch.empty_like(microbatches[mb])
                dist.recv(x, src=rank - 1)
                if not no_leaf:
                    x.requires_grad_()
            y = stage_module(x)
            if last:
                y = loss_fn(y, targets[mb]) / (m if average else 1)
                total += y.item()
            elif blocking:
                dist.send(y.detach(), dst=rank + 1)
            elif drop_requests:                 # the request is never waited on
                dist.isend(y.detach(), dst=rank + 1)
            else:
                pending.append(dist.isend(y.detach(), dst=rank + 1))
            inputs[mb], outputs[mb] = x, y
        else:
            x, y = inputs.pop(mb), outputs.pop(mb)
            if last:
                y.backward()
            else:
                g = torch.empty_like(y)
                dist.recv(g, src=rank + 1)
                y.backward(g)
            if not first:
                dst = rank + grad_to
                g = x.grad   # None when the received tensor was not made a leaf: isend raises TypeError
                if 0 <= dst < p:
                    if blocking:
                        dist.send(g, dst=dst)
                    else:
                        pending.append(dist.isend(g, dst=dst))
    for w in pending:
        w.wait()
    return total if last else None


def run_isend_irecv(stage_module, schedule, microbatches, targets, loss_fn):
    """Correct alternative: every message asynchronous; a receive is waited for right before it is needed."""
    rank, p = dist.get_rank(), dist.get_world_size()
    m = len(microbatches)
    kept, sends, total = {}, [], 0.0
    for op, mb in schedule[rank]:
        if op == "F":
            if rank == 0:
                x = microbatches[mb]
            else:
                x = torch.empty_like(microbatches[mb])
                dist.irecv(x, src=rank - 1).wait()
                x.requires_grad_()
            y = stage_module(x)
            if rank == p - 1:
                y = loss_fn(y, targets[mb]) / m
                total += float(y)
            else:
                sends.append(dist.isend(y.detach().clone(), dst=rank + 1))
            kept[mb] = (x, y)
        else:
            x, y = kept.pop(mb)
            grad = None
            if rank < p - 1:
                grad = torch.empty_like(y)
                dist.irecv(grad, src=rank + 1).wait()
            torch.autograd.backward(y, grad)
            if rank > 0:
                sends.append(dist.isend(x.grad, dst=rank - 1))
    for w in sends:
        w.wait()
    return total if rank == p - 1 else None


def test_run_pipeline_accepts_correct():
    check_run_pipeline(run_ok)


def test_run_pipeline_accepts_isend_irecv():
    check_run_pipeline(run_isend_irecv, world_sizes=(3,))


@pytest.mark.parametrize("kwargs, match", [
    (dict(no_leaf=True), r"raised TypeError.*make the received tensor a leaf of this stage's graph"),
    (dict(reuse_buffer=True), "a reused receive buffer is overwritten"),
    (dict(average=False), "m times too large: average the loss"),
    (dict(ignore_schedule=True), r"run exactly this stage's list"),
])
def test_run_pipeline_rejects(kwargs, match, settled_timeouts):
    with pytest.raises(AssertionError, match=match) as info:
        check_run_pipeline(functools.partial(run_ok, **kwargs), world_sizes=(3,), timeout=DEADLOCK_TIMEOUT)
    assert len(str(info.value)) <= 400, str(info.value)   # the feedback page cuts at 400: the hint must get there


@pytest.mark.parametrize("kwargs", [dict(grad_to=+1), dict(blocking=True)])
def test_run_pipeline_deadlocks_are_reported(kwargs, settled_timeouts):
    with pytest.raises(AssertionError, match="deadlock|exchanged messages with rank"):
        check_run_pipeline(functools.partial(run_ok, **kwargs), world_sizes=(3,), timeout=DEADLOCK_TIMEOUT)


def test_unwaited_requests_are_named(settled_timeouts):
    """Where the student's function runs in a sandbox its host performs every request and logs whether it was
    waited for: an isend never waited on is named (without a sandbox, the message may never be delivered, and the
    deadlock report says the same: "Every rank was waiting to receive: ...")."""
    with pytest.raises(AssertionError) as info:
        check_run_pipeline(functools.partial(run_ok, drop_requests=True), world_sizes=(2,), timeout=DEADLOCK_TIMEOUT)
    assert "a message sent with isend whose request was never waited on" in str(info.value), str(info.value)


def test_run_pipeline_not_implemented():
    def todo(*args):
        raise NotImplementedError()

    with pytest.raises(AssertionError, match="not started: it still raises NotImplementedError"):
        check_run_pipeline(todo, world_sizes=(2,))


def test_random_valid_schedules_run_and_vary():
    import random

    rng = random.Random(0)
    seen = set()
    for _ in range(20):
        s = pp.random_valid_schedule(3, 4, rng)
        pp.reference_simulate(s, 1.0, 1.0)  # never raises
        seen.add(tuple(map(tuple, s)))
    assert len(seen) > 3
