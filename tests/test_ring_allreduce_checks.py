"""Mutation tests for the 02_ring_allreduce checks: planted bugs lose the points, correct alternatives pass.

Each wrong implementation below is a mistake students make (or published tutorials made); each test asserts the
check raises AssertionError and that its message points at the cause. Real workers, no mocks.
"""

import itertools
import math

import pytest
import torch
import torch.distributed as dist

import autograder.checks.ring_allreduce.trials as T
import labsupport
from autograder.checks import ring_allreduce as R
from autograder.checks.ring_allreduce.diagnose import _why_wrong_sum
from labsupport.lessons.ring_allreduce import netsim

# ----------------------------------------------------------------------------------------------------------------
# Correct alternatives


def rs_reverse(tensor):
    """Reduce-scatter rotating the other way round the ring: send left, receive from the right."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = tensor.flatten().tensor_split(n)
    to, frm = (r - 1) % n, (r + 1) % n
    for step in range(n - 1):
        send = chunks[(r + step + 1) % n]
        recv = chunks[(r + step + 2) % n]
        buf = torch.empty_like(recv)
        s = dist.isend(send, to)
        dist.irecv(buf, frm).wait()
        s.wait()
        recv += buf
    return chunks[r].clone()


def ag_reverse(chunk):
    n, r = dist.get_world_size(), dist.get_rank()
    out = [None] * n
    out[r] = chunk.clone()
    to, frm = (r - 1) % n, (r + 1) % n
    for step in range(n - 1):
        have = out[(r + step) % n]
        nxt = torch.empty_like(chunk)
        ops = [dist.P2POp(dist.isend, have, to), dist.P2POp(dist.irecv, nxt, frm)]
        for q in dist.batch_isend_irecv(ops):
            q.wait()
        out[(r + step + 1) % n] = nxt
    return out


def ar_reverse(tensor):
    """All-reduce, rotating the other way, with its own in-place all-gather (tensor_split chunks)."""
    n, r = dist.get_world_size(), dist.get_rank()
    flat = tensor.view(-1)
    chunks = flat.tensor_split(n)
    rs_reverse(tensor)  # leaves chunk r of `tensor` holding the full sum
    to, frm = (r - 1) % n, (r + 1) % n
    for step in range(n - 1):
        s = dist.isend(chunks[(r + step) % n], to)
        dist.irecv(chunks[(r + step + 1) % n], frm).wait()
        s.wait()
    return tensor


def ar_padded(tensor):
    """All-reduce by padding to a multiple of world_size and reusing the equal-chunk reduce-scatter/all-gather."""
    n = dist.get_world_size()
    flat = tensor.reshape(-1)
    c = math.ceil(flat.numel() / n)
    padded = torch.zeros(c * n, dtype=tensor.dtype)
    padded[: flat.numel()] = flat
    mine = R.reference_ring_reduce_scatter(padded)
    parts = R.reference_ring_all_gather(mine.clone())
    tensor.copy_(torch.cat(parts)[: flat.numel()].view(tensor.shape))


@pytest.mark.parametrize(
    "check, fn",
    [
        (R.check_ring_reduce_scatter, R.reference_ring_reduce_scatter),
        (R.check_ring_all_gather, R.reference_ring_all_gather),
        (R.check_ring_all_reduce, R.reference_ring_all_reduce),
        (R.check_alpha_beta_cost, R.reference_alpha_beta_cost),
    ],
    ids=["reduce_scatter", "all_gather", "all_reduce", "alpha_beta_cost"],
)
def test_reference_passes(check, fn):
    check(fn)


@pytest.mark.parametrize(
    "check, fn",
    [
        (R.check_ring_reduce_scatter, rs_reverse),
        (R.check_ring_all_gather, ag_reverse),
        (R.check_ring_all_reduce, ar_reverse),
        (R.check_ring_all_reduce, ar_padded),
    ],
    ids=["rs_reverse", "ag_reverse", "ar_reverse", "ar_padded"],
)
def test_correct_alternative_passes(check, fn):
    check(fn)


def _big_reference_all_reduce(numel, rs_segments, ag_segments):
    torch.manual_seed(dist.get_rank())
    x = torch.randn(numel, dtype=torch.float64)
    want = x.clone()
    dist.all_reduce(want)
    R.reference_ring_all_reduce(x, rs_segments=rs_segments, ag_segments=ag_segments)
    y = torch.randn(3, numel // 3, dtype=torch.float64).t()  # non-contiguous input
    want_y = y.clone()
    dist.all_reduce(want_y)
    R.reference_ring_all_reduce(y, rs_segments=rs_segments, ag_segments=ag_segments)
    return torch.allclose(x, want) and torch.allclose(y, want_y)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reference_all_reduce_pipelined_segments(world_size):
    """The benchmark's pipelined ring (several segments per chunk) is exact too, also for strided tensors."""
    assert all(labsupport.run(_big_reference_all_reduce, 300_007 * 3, 3, 5, world_size=world_size, timeout=60))
    assert all(labsupport.run(_big_reference_all_reduce, 300_007 * 3, 1, None, world_size=world_size, timeout=60))
    # the defaults: 2 reduce-scatter pieces, and 4 all-gather pieces on 4 ranks (chunks of 2 MiB and more)
    assert all(labsupport.run(_big_reference_all_reduce, 350_003 * 3, None, None, world_size=world_size, timeout=60))


# ----------------------------------------------------------------------------------------------------------------
# ring_all_reduce: planted bugs


def ar_whole_tensor(tensor):
    """The tutorial bug: pass the whole (accumulating) tensor round the ring N-1 times."""
    n, r = dist.get_world_size(), dist.get_rank()
    send = tensor.clone()
    acc = tensor.clone()
    for _ in range(n - 1):
        recv = torch.empty_like(send)
        s = dist.isend(send, (r + 1) % n)
        dist.irecv(recv, (r - 1) % n).wait()
        s.wait()
        acc += recv
        send = recv
    tensor.copy_(acc)


def ar_average(tensor):
    R.reference_ring_all_reduce(tensor)
    if tensor.dtype.is_floating_point:
        tensor /= dist.get_world_size()
    else:
        tensor //= dist.get_world_size()


def ar_wrong_chunk_after_rs(tensor):
    """After the reduce-scatter rank r holds chunk r, but the all-gather starts by forwarding chunk r+1."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).tensor_split(n)
    R.reference_ring_reduce_scatter(tensor)
    for step in range(n - 1):
        s = dist.isend(chunks[(r - step + 1) % n], (r + 1) % n)
        dist.irecv(chunks[(r - step) % n], (r - 1) % n).wait()
        s.wait()


def ar_drop_remainder(tensor):
    """Chunks of numel // N elements: the last numel % N elements are never reduced."""
    n, r = dist.get_world_size(), dist.get_rank()
    c = tensor.numel() // n
    if c == 0:
        return
    flat = tensor.view(-1)
    chunks = [flat[j * c : (j + 1) * c] for j in range(n)]
    for step in range(n - 1):
        send, recv = chunks[(r - step - 1) % n], chunks[(r - step - 2) % n]
        buf = torch.empty_like(recv)
        s = dist.isend(send, (r + 1) % n)
        dist.irecv(buf, (r - 1) % n).wait()
        s.wait()
        recv += buf
    for step in range(n - 1):
        s = dist.isend(chunks[(r - step) % n], (r + 1) % n)
        dist.irecv(chunks[(r - step - 1) % n], (r - 1) % n).wait()
        s.wait()


def ar_blocking(tensor):
    """Blocking send then recv: every rank sends first, nobody receives."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).tensor_split(n)
    for step in range(n - 1):
        send, recv = chunks[(r - step - 1) % n], chunks[(r - step - 2) % n]
        buf = torch.empty_like(recv)
        dist.send(send, (r + 1) % n)
        dist.recv(buf, (r - 1) % n)
        recv += buf
    for step in range(n - 1):
        dist.send(chunks[(r - step) % n], (r + 1) % n)
        dist.recv(chunks[(r - step - 1) % n], (r - 1) % n)


def ar_plus_two(tensor):
    """Skips a neighbour: sends to rank + 2 and receives from rank - 2 (correct sums for odd N, not a ring)."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).tensor_split(n)
    to, frm = (r + 2) % n, (r - 2) % n
    # walk the "ring" rank, rank+2, rank+4, ...: position of each rank in it
    order = [(2 * k) % n for k in range(n)]
    pos = order.index(r) if r in order else 0
    for step in range(n - 1):
        send, recv = chunks[(pos - step - 1) % n], chunks[(pos - step - 2) % n]
        buf = torch.empty_like(recv)
        s = dist.isend(send, to)
        dist.irecv(buf, frm).wait()
        s.wait()
        recv += buf
    for step in range(n - 1):
        s = dist.isend(chunks[(pos - step) % n], to)
        dist.irecv(chunks[(pos - step - 1) % n], frm).wait()
        s.wait()


def ar_builtin(tensor):
    dist.all_reduce(tensor)


def ar_gather_to_root(tensor):
    """Everyone sends the whole tensor to rank 0, which sums and sends the result back."""
    n, r = dist.get_world_size(), dist.get_rank()
    if r == 0:
        for q in range(1, n):
            buf = torch.empty_like(tensor)
            dist.recv(buf, q)
            tensor += buf
        for q in range(1, n):
            dist.send(tensor, q)
    else:
        dist.send(tensor, 0)
        dist.recv(tensor, 0)


def ar_not_implemented(tensor):
    raise NotImplementedError()


def _fails(check, fn, *words, **kw):
    with pytest.raises(AssertionError) as info:
        check(fn, **kw)
    msg = str(info.value)
    for w in words:
        assert w.lower() in msg.lower(), f"expected {w!r} in the message:\n{msg}"
    return msg


def test_all_reduce_whole_tensor_per_step_is_caught():
    msg = _fails(R.check_ring_all_reduce, ar_whole_tensor, "sent", "bytes", "one chunk", world_sizes=(3,))
    assert "2 * (world_size - 1) * ceil(numel / world_size) * itemsize" in msg


def test_all_reduce_average_is_caught():
    _fails(R.check_ring_all_reduce, ar_average, "average", world_sizes=(2,))


def test_all_reduce_wrong_chunk_after_reduce_scatter_is_caught():
    _fails(R.check_ring_all_reduce, ar_wrong_chunk_after_rs, "wrong sum", "chunk", world_sizes=(3,))


def test_all_reduce_dropped_remainder_is_caught():
    _fails(R.check_ring_all_reduce, ar_drop_remainder, "remainder", "numel % world_size", world_sizes=(3,))


@pytest.mark.timing
def test_all_reduce_blocking_send_deadlock_is_caught(settled_timeouts):
    """Reported once every rank is blocked in its send (settled_timeouts), so the advice is about the deadlock."""
    _fails(R.check_ring_all_reduce, ar_blocking, "deadlocked", "isend", world_sizes=(3,), timeout=3)


def test_all_reduce_sending_to_rank_plus_two_is_caught():
    # with 5 ranks, rank+2 forms a single cycle and the sums are right: only the neighbour check catches it
    _fails(R.check_ring_all_reduce, ar_plus_two, "sent to rank", "neighbours", world_sizes=(5,))
    _fails(R.check_ring_all_reduce, ar_plus_two, "neighbours", world_sizes=(4,))


def test_all_reduce_builtin_is_caught():
    _fails(R.check_ring_all_reduce, ar_builtin, "torch.distributed.all_reduce", "send/recv", world_sizes=(2,))


def test_all_reduce_gather_to_root_is_caught():
    _fails(R.check_ring_all_reduce, ar_gather_to_root, "neighbours", world_sizes=(4,))
    # with 3 ranks everyone is a neighbour of rank 0: the byte count catches it
    _fails(R.check_ring_all_reduce, ar_gather_to_root, "bytes", world_sizes=(3,))


def test_all_reduce_not_implemented_is_reported():
    _fails(R.check_ring_all_reduce, ar_not_implemented, "not started: it still raises NotImplementedError",
           world_sizes=(2,))


def test_all_reduce_first_failure_stops_with_default_world_sizes():
    """With the default world sizes the check stops at the first failing one (here 2, after 1 passes)."""
    msg = _fails(R.check_ring_all_reduce, ar_average, "world_size=2")
    assert "seed" in msg


def test_non_callable_is_reported():
    _fails(R.check_ring_all_reduce, None, "should be a function")
    _fails(R.check_alpha_beta_cost, 3, "should be a function")


# ----------------------------------------------------------------------------------------------------------------
# ring_reduce_scatter: planted bugs


def rs_rotation_off_by_one(tensor):
    """The common indexing slip: step s sends chunk (r - s) and receives (r - s - 1), so rank r ends with chunk
    r + 1 fully reduced, and returns chunk r (which is only partly reduced)."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = tensor.flatten().tensor_split(n)
    for step in range(n - 1):
        send, recv = chunks[(r - step) % n], chunks[(r - step - 1) % n]
        buf = torch.empty_like(recv)
        s = dist.isend(send, (r + 1) % n)
        dist.irecv(buf, (r - 1) % n).wait()
        s.wait()
        recv += buf
    return chunks[r]


def rs_returns_next_chunk(tensor):
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = tensor.flatten().tensor_split(n)
    for step in range(n - 1):
        send, recv = chunks[(r - step) % n], chunks[(r - step - 1) % n]
        buf = torch.empty_like(recv)
        s = dist.isend(send, (r + 1) % n)
        dist.irecv(buf, (r - 1) % n).wait()
        s.wait()
        recv += buf
    return chunks[(r + 1) % n]


def rs_average(tensor):
    out = R.reference_ring_reduce_scatter(tensor)
    return out / dist.get_world_size() if out.dtype.is_floating_point else out // dist.get_world_size()


def rs_one_step_short(tensor):
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = tensor.flatten().tensor_split(n)
    for step in range(1, n - 1):
        send, recv = chunks[(r - step - 1) % n], chunks[(r - step - 2) % n]
        buf = torch.empty_like(recv)
        s = dist.isend(send, (r + 1) % n)
        dist.irecv(buf, (r - 1) % n).wait()
        s.wait()
        recv += buf
    return chunks[r]


def rs_via_all_reduce(tensor):
    dist.all_reduce(tensor)
    return tensor.flatten().tensor_split(dist.get_world_size())[dist.get_rank()]


def rs_whole_tensor(tensor):
    out = tensor.clone()
    ar_whole_tensor(out)
    return out.flatten().tensor_split(dist.get_world_size())[dist.get_rank()]


def rs_returns_list(tensor):
    return [R.reference_ring_reduce_scatter(tensor)]


def rs_wrong_shape(tensor):
    return R.reference_ring_reduce_scatter(tensor).reshape(1, -1)


def test_reduce_scatter_off_by_one_rotation_is_caught():
    _fails(R.check_ring_reduce_scatter, rs_rotation_off_by_one, "ring_reduce_scatter on rank", "own data",
           "(rank - s - 2) % N", world_sizes=(3,))


def test_reduce_scatter_wrong_index_is_caught():
    _fails(R.check_ring_reduce_scatter, rs_returns_next_chunk, "chunk index = rank", world_sizes=(2,))


def test_reduce_scatter_average_is_caught():
    _fails(R.check_ring_reduce_scatter, rs_average, "average", world_sizes=(4,))


def test_reduce_scatter_missing_step_is_caught():
    _fails(R.check_ring_reduce_scatter, rs_one_step_short, "missing", "world_size - 1 steps", world_sizes=(4,))


def test_reduce_scatter_via_builtin_is_caught():
    _fails(R.check_ring_reduce_scatter, rs_via_all_reduce, "torch.distributed.all_reduce", world_sizes=(2,))


def test_reduce_scatter_whole_tensor_is_caught():
    _fails(R.check_ring_reduce_scatter, rs_whole_tensor, "bytes", "(world_size - 1) * ceil", world_sizes=(3,))


def test_reduce_scatter_wrong_type_and_shape_are_caught():
    _fails(R.check_ring_reduce_scatter, rs_returns_list, "returned list", world_sizes=(2,))
    _fails(R.check_ring_reduce_scatter, rs_wrong_shape, "shape", "tensor_split(2)", world_sizes=(2,))


# ----------------------------------------------------------------------------------------------------------------
# ring_all_gather: planted bugs


def ag_rotated(chunk):
    out = R.reference_ring_all_gather(chunk)
    return out[1:] + out[:1]


def ag_shared_buffer(chunk):
    """Receives every chunk into the same buffer: all items end up as the last chunk received."""
    n, r = dist.get_world_size(), dist.get_rank()
    out = [None] * n
    out[r] = chunk
    buf = torch.empty_like(chunk)
    have = chunk
    for step in range(n - 1):
        s = dist.isend(have, (r + 1) % n)
        dist.irecv(buf, (r - 1) % n).wait()
        s.wait()
        out[(r - step - 1) % n] = buf
        have = buf.clone()
    return out


def ag_builtin(chunk):
    out = [torch.empty_like(chunk) for _ in range(dist.get_world_size())]
    dist.all_gather(out, chunk)
    return out


def ag_through_root(chunk):
    """Gather on rank 0, then rank 0 sends everything to everyone."""
    n, r = dist.get_world_size(), dist.get_rank()
    out = [torch.empty_like(chunk) for _ in range(n)]
    out[r] = chunk.clone()
    if r == 0:
        for q in range(1, n):
            dist.recv(out[q], q)
        for q in range(1, n):
            for j in range(n):
                dist.send(out[j], q)
    else:
        dist.send(chunk, 0)
        for j in range(n):
            dist.recv(out[j], 0)
    return out


def ag_missing_own(chunk):
    return R.reference_ring_all_gather(chunk)[:-1]


def ag_returns_tensor(chunk):
    return torch.stack(R.reference_ring_all_gather(chunk))


def test_all_gather_wrong_order_is_caught():
    _fails(R.check_ring_all_gather, ag_rotated, "item 0", "holds rank 1's chunk", world_sizes=(3,))


def test_all_gather_shared_buffer_is_caught():
    _fails(R.check_ring_all_gather, ag_shared_buffer, "ring_all_gather on rank", "item", world_sizes=(3,))


def test_all_gather_builtin_is_caught():
    _fails(R.check_ring_all_gather, ag_builtin, "torch.distributed.all_gather", world_sizes=(2,))


def test_all_gather_through_root_is_caught():
    _fails(R.check_ring_all_gather, ag_through_root, "neighbours", world_sizes=(4,))
    _fails(R.check_ring_all_gather, ag_through_root, "bytes", world_sizes=(3,))


def test_all_gather_wrong_length_and_type_are_caught():
    _fails(R.check_ring_all_gather, ag_missing_own, "list of 1 items", world_sizes=(2,))
    _fails(R.check_ring_all_gather, ag_returns_tensor, "returned Tensor", world_sizes=(2,))


# ----------------------------------------------------------------------------------------------------------------
# alpha_beta_cost: planted bugs


def _good(algorithm, p, n, a, b):
    return R.reference_alpha_beta_cost(algorithm, p, n, a, b)


def abc_table(algorithm, p, n, a, b):
    """Correct, written differently: a table of lambdas, and the steps of recursive doubling with floats:
    log2(p) when it is a whole number, floor(log2 p) + 2 otherwise."""
    table = {
        "naive": lambda: 2 * (p - 1) * (a + n * b),
        "ring": lambda: 2 * (p - 1) * (a + n / p * b),
        "recursive_doubling": lambda: (math.log2(p) if math.log2(p).is_integer() else math.floor(math.log2(p)) + 2)
        * (a + n * b),
    }
    if algorithm not in table:
        raise ValueError(algorithm)
    return table[algorithm]()


def abc_by_steps(algorithm, p, n, a, b):
    """Correct, written differently: add up the cost of every step, one message per step on the critical path."""
    if algorithm == "naive":
        steps, per_message = 2 * (p - 1), n
    elif algorithm == "ring":
        steps, per_message = 2 * (p - 1), n / p
    elif algorithm == "recursive_doubling":
        steps, reached = 0, 1
        while 2 * reached <= p:  # exchanges among the largest power of two of ranks: their number doubles each step
            reached, steps = 2 * reached, steps + 1
        if reached < p:  # the ranks left over fold in before and get the sum back after
            steps += 2
        per_message = n
    else:
        raise ValueError(f"no algorithm called {algorithm}")
    total = 0.0
    for _ in range(steps):
        total += a + per_message * b
    return total


@pytest.mark.parametrize("fn", [abc_table, abc_by_steps])
def test_alpha_beta_cost_correct_alternatives_pass(fn):
    for p in range(1, 1100):  # both agree with the steps of the simulator's schedule wherever the check draws p
        assert fn("recursive_doubling", p, 1, 1.0, 0.0) == len(netsim.recursive_doubling_allreduce(p, 1).steps)
    R.check_alpha_beta_cost(fn)
    R.check_alpha_beta_cost(fn, trials=400)


def abc_ring_one_phase(algorithm, p, n, a, b):
    if algorithm == "ring":
        return 2 * (p - 1) * a + n * (p - 1) / p * b
    return _good(algorithm, p, n, a, b)


def abc_ring_latency(algorithm, p, n, a, b):
    if algorithm == "ring":
        return (p - 1) * a + 2 * n * (p - 1) / p * b
    return _good(algorithm, p, n, a, b)


def abc_naive_half(algorithm, p, n, a, b):
    if algorithm == "naive":
        return (p - 1) * (a + n * b)
    return _good(algorithm, p, n, a, b)


def abc_rd_floor(algorithm, p, n, a, b):
    if algorithm == "recursive_doubling":
        return math.floor(math.log2(p)) * (a + n * b)
    return _good(algorithm, p, n, a, b)


def abc_rd_no_ceil(algorithm, p, n, a, b):
    if algorithm == "recursive_doubling":
        return math.log2(p) * (a + n * b)
    return _good(algorithm, p, n, a, b)


def abc_rd_ceil(algorithm, p, n, a, b):
    """ceil(log2 p) steps for every p: right for powers of two only."""
    if algorithm == "recursive_doubling":
        return math.ceil(math.log2(p)) * (a + n * b)
    return _good(algorithm, p, n, a, b)


def abc_rd_plus_one(algorithm, p, n, a, b):
    """floor(log2 p) + 2 steps for every p, powers of two included."""
    if algorithm == "recursive_doubling":
        return (math.floor(math.log2(p)) + 2) * (a + n * b) if p > 1 else 0.0
    return _good(algorithm, p, n, a, b)


def abc_ring_p1(algorithm, p, n, a, b):
    if algorithm == "ring":
        return 2 * p * a + 2 * n * (p - 1) / p * b
    return _good(algorithm, p, n, a, b)


def abc_no_error(algorithm, p, n, a, b):
    try:
        return _good(algorithm, p, n, a, b)
    except ValueError:
        return 0.0


def abc_key_error(algorithm, p, n, a, b):
    table = {"ring": 0, "naive": 1, "recursive_doubling": 2}
    table[algorithm]
    return _good(algorithm, p, n, a, b)


def abc_returns_string(algorithm, p, n, a, b):
    return f"{_good(algorithm, p, n, a, b):.3g} s"


def abc_crashes(algorithm, p, n, a, b):
    return 1 / 0


def abc_not_implemented(algorithm, p, n, a, b):
    raise NotImplementedError()


@pytest.mark.parametrize(
    "fn, words",
    [
        (abc_ring_one_phase, ["'ring'", "alpha=0", "bandwidth", "2(p-1) steps"]),
        (abc_ring_latency, ["'ring'", "beta=0", "latency", "p-1 steps each"]),
        (abc_naive_half, ["'naive'", "2(p-1)·(alpha + n·beta)"]),
        (abc_rd_floor, ["'recursive_doubling'", "world_size=6", "floor(log2 p) + 2"]),
        (abc_rd_no_ceil, ["'recursive_doubling'", "world_size=6", "floor(log2 p) + 2"]),
        (abc_rd_ceil, ["'recursive_doubling'", "world_size=6", "ceil(log2 p) is one step short"]),
        (abc_rd_plus_one, ["'recursive_doubling'", "world_size=4", "log2 p steps when p is a power of two"]),
        (abc_ring_p1, ["world_size=4", "latency"]),
        (abc_no_error, ["ValueError", "unknown algorithm"]),
        (abc_key_error, ["raised KeyError"]),
        (abc_returns_string, ["expected a number"]),
        (abc_crashes, ["raised ZeroDivisionError"]),
        (abc_not_implemented, ["not started: it still raises NotImplementedError"]),
    ],
)
def test_alpha_beta_cost_bugs_are_caught(fn, words):
    _fails(R.check_alpha_beta_cost, fn, *words)


def abc_one_rank_wrong(algorithm, p, n, a, b):
    if p == 1:
        return a
    return _good(algorithm, p, n, a, b)


def test_alpha_beta_cost_one_rank():
    _fails(R.check_alpha_beta_cost, abc_one_rank_wrong, "world_size=1", "nothing to communicate")


def abc_random_only(algorithm, p, n, a, b):
    """Right on the hand-picked cases, wrong on big world sizes: only the random draws catch it."""
    if p > 8:
        return 0.0
    return _good(algorithm, p, n, a, b)


def test_alpha_beta_cost_random_inputs():
    _fails(R.check_alpha_beta_cost, abc_random_only, "seed", "latency")


# ----------------------------------------------------------------------------------------------------------------
# The remaining messages


def ar_recv_from_far_rank(tensor):
    n, r = dist.get_world_size(), dist.get_rank()
    buf = torch.empty(1, dtype=tensor.dtype)
    dist.recv(buf, (r + 2) % n)


def test_receive_from_a_non_neighbour_is_caught_before_it_hangs():
    _fails(R.check_ring_all_reduce, ar_recv_from_far_rank, "received from rank", "neighbours", world_sizes=(4,))


def ar_size_mismatch(tensor):
    """Sends 2 elements where the neighbour receives 1: gloo aborts the receiving process."""
    n, r = dist.get_world_size(), dist.get_rank()
    s = dist.isend(torch.zeros(2), (r + 1) % n)
    dist.irecv(torch.empty(1), (r - 1) % n).wait()
    s.wait()


def test_message_size_mismatch_crash_is_explained():
    _fails(R.check_ring_all_reduce, ar_size_mismatch, "crashed a worker", "size differs", world_sizes=(2,))


def ar_shape_changed(tensor):
    R.reference_ring_all_reduce(tensor)
    tensor.data = tensor.reshape(-1)


def test_all_reduce_not_in_place_is_caught():
    _fails(R.check_ring_all_reduce, ar_shape_changed, "changed the tensor's shape or dtype", "in place",
           world_sizes=(2,))


def ar_off_by_one_element(tensor):
    R.reference_ring_all_reduce(tensor)
    if tensor.numel() >= 1000:
        tensor.view(-1)[7] += 1


def test_all_reduce_single_wrong_element_is_located():
    _fails(R.check_ring_all_reduce, ar_off_by_one_element, "1 of", "flat index 7", world_sizes=(2,))


def rs_wrong_dtype(tensor):
    return R.reference_ring_reduce_scatter(tensor).double()


def test_reduce_scatter_wrong_dtype_is_caught():
    _fails(R.check_ring_reduce_scatter, rs_wrong_dtype, "expected dtype", world_sizes=(2,))


def ag_zeros_for_others(chunk):
    out = [torch.zeros_like(chunk) for _ in range(dist.get_world_size())]
    out[dist.get_rank()] = chunk.clone()
    return out


def ag_wrong_dtype(chunk):
    return [c.double() if c.dtype == torch.float32 else c.float() for c in R.reference_ring_all_gather(chunk)]


def test_all_gather_nobodys_chunk_and_wrong_dtype_are_caught():
    _fails(R.check_ring_all_gather, ag_zeros_for_others, "nobody's chunk", world_sizes=(3,))
    _fails(R.check_ring_all_gather, ag_wrong_dtype, "expected dtype", world_sizes=(2,))


def test_integer_inputs_name_the_missing_ranks_exactly():
    """A partial sum over some ranks is never mistaken for another (one-element chunks, many seeds)."""
    for seed in range(1, 150):
        for n in (2, 3, 4, 5):
            parts = [T._make(seed, 0, q, (1,), "int32") for q in range(n)]
            for size in range(1, n):
                for subset in itertools.combinations(range(n), size):
                    partial = sum(parts[q] for q in subset)
                    hint = _why_wrong_sum(partial, parts, "int32")
                    named = f"just rank {subset[0]}'s own data" if size == 1 else f"ranks {list(subset)} only"
                    assert named in hint, (seed, n, subset, hint)


def _is_prime(m):
    return m > 1 and all(m % d for d in range(2, math.isqrt(m) + 1))


def test_every_numel_gets_multi_dimensional_shapes():
    """Every numel is drawn in two multi-dimensional shapes and one flat one, for every world size: a composite
    numel spread over at least two dimensions larger than 1, a prime (or 1) between ones; every dtype once."""
    seen = set()
    for seed in range(1, 300):
        for n in R.WORLD_SIZES:
            cases = T._cases(seed, n)
            numels = [m for m in (1, n - 1, 1000, 2**16 + 3) if m >= 1]
            assert len(cases) == 3 * len(numels)
            for m in set(numels):
                mine = [(shape, dt) for shape, dt in cases if math.prod(shape) == m]
                copies = numels.count(m)
                assert sorted(dt for _, dt in mine) == sorted(T._DTYPES * copies), (seed, n, m, mine)
                multi = [shape for shape, _ in mine if len(shape) >= 2 and (
                    sum(d > 1 for d in shape) >= 2 if len(T._prime_factors(m)) >= 2 else max(shape) == m)]
                flat = [shape for shape, _ in mine if len(shape) <= 1 or shape == (1, m)]
                assert len(multi) >= 2 * copies and len(flat) >= copies, (seed, n, m, mine)
                assert all(1 <= len(shape) <= 3 for shape in multi)
                seen.update((m, shape) for shape, _ in mine)
    assert _is_prime(2**16 + 3)  # so its multi-dimensional shapes are (1, p, 1) and the like
    for m, some in [(1000, {(10, 100), (8, 125), (2, 4, 125)}), (4, {(2, 2)}), (2**16 + 3, {(1, 2**16 + 3, 1)}),
                    (1, {(), (1,), (1, 1), (1, 1, 1)})]:
        assert {(m, s) for s in some} <= seen, m
