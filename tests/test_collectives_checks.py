"""Mutation tests for autograder.checks.collectives (notebook 01_collectives).

Each planted bug (a wrong implementation written here as a plain function) must make its check fail with a message
that names the problem; correct implementations that differ from the notebook's solution (other message orders,
isend/irecv or batch_isend_irecv instead of send/recv, trees and rings instead of a star) must pass.
Everything runs on real workers.
"""

import re

import pytest
import torch
import torch.distributed as dist

import autograder.checks.collectives.trials as T
from autograder.checks import collectives as C
from autograder.checks.collectives.diagnose import _Problem
from autograder.checks.collectives.probes import _RUN

#: Deadlocking mutants are stopped after this many seconds (the real probe time-out is longer).
SHORT = 4.0


def _rw():
    return dist.get_rank(), dist.get_world_size()


# ----------------------------------------------------------------------------------------------------------------
# Correct alternatives (different from the notebook's solutions)


def bc_tree(tensor, src):
    """Binomial tree, isend/irecv, ranks renumbered so that src is 0."""
    rank, n = _rw()
    rel = (rank - src) % n
    mask = 1
    while mask < n:  # receive from the parent
        if rel & mask:
            dist.irecv(tensor, src=(rel - mask + src) % n).wait()
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:  # pass on to the children
        if rel + mask < n:
            sends.append(dist.isend(tensor, dst=(rel + mask + src) % n))
        mask >>= 1
    for s in sends:
        s.wait()


def bc_chain(tensor, src):
    """A chain src -> src+1 -> ... in send/recv."""
    rank, n = _rw()
    rel = (rank - src) % n
    if rel > 0:
        dist.recv(tensor, src=(rank - 1) % n)
    if rel < n - 1:
        dist.send(tensor, dst=(rank + 1) % n)


def red_tree(tensor, dst):
    """Binomial tree towards dst; intermediate ranks add into a scratch buffer, never into their input."""
    rank, n = _rw()
    rel = (rank - dst) % n
    acc = tensor.clone()
    buf = torch.empty_like(tensor)
    mask = 1
    while mask < n:
        if rel & mask:
            dist.send(acc, dst=(rel - mask + dst) % n)
            return
        if rel + mask < n:
            dist.recv(buf, src=(rel + mask + dst) % n)
            acc += buf
        mask <<= 1
    tensor.copy_(acc)


def red_irecv_all(tensor, dst):
    """dst posts every irecv at once, in reverse order."""
    rank, n = _rw()
    if rank != dst:
        dist.isend(tensor, dst=dst).wait()
        return
    bufs = {p: torch.empty_like(tensor) for p in range(n) if p != dst}
    reqs = [dist.irecv(bufs[p], src=p) for p in reversed(range(n)) if p != dst]
    for r in reqs:
        r.wait()
    for p in sorted(bufs):
        tensor += bufs[p]


def ar_exchange_batch(tensor):
    """Everyone sends to everyone with batch_isend_irecv, then sums in rank order."""
    rank, n = _rw()
    bufs = {p: torch.empty_like(tensor) for p in range(n) if p != rank}
    ops = [dist.P2POp(dist.isend, tensor, p) for p in bufs] + [dist.P2POp(dist.irecv, bufs[p], p) for p in bufs]
    if ops:
        for r in dist.batch_isend_irecv(ops):
            r.wait()
    for p in sorted(bufs):
        tensor += bufs[p]


def ar_tree(tensor):
    """Tree reduce to the last rank, then tree broadcast from it."""
    n = dist.get_world_size()
    red_tree(tensor, n - 1)
    bc_tree(tensor, n - 1)


def ga_irecv_reverse(tensor, dst):
    rank, n = _rw()
    if rank != dst:
        dist.send(tensor, dst=dst)
        return None
    out = [tensor.clone() if p == rank else torch.empty_like(tensor) for p in range(n)]
    reqs = [dist.irecv(out[p], src=p) for p in reversed(range(n)) if p != rank]
    for r in reqs:
        r.wait()
    return tuple(out)  # a tuple is accepted as well as a list


def ag_ring_parity(tensor):
    """Ring: pass the newest item to the right n-1 times; even ranks send first, odd ranks receive first."""
    rank, n = _rw()
    out = [None] * n
    out[rank] = tensor.clone()
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_idx, recv_idx = (rank - step) % n, (rank - step - 1) % n
        buf = torch.empty_like(tensor)
        if rank % 2 == 0:
            dist.send(out[send_idx], dst=right)
            dist.recv(buf, src=left)
        else:
            dist.recv(buf, src=left)
            dist.send(out[send_idx], dst=right)
        out[recv_idx] = buf
    return out


def sc_isend_reverse(out, chunks, src):
    rank, n = _rw()
    if rank == src:
        reqs = [dist.isend(chunks[p], dst=p) for p in reversed(range(n)) if p != src]
        out.copy_(chunks[src])
        for r in reqs:
            r.wait()
    else:
        dist.irecv(out, src=src).wait()


def rs_ring(chunks):
    """Ring reduce-scatter: n-1 steps, each rank adds what its left neighbour sends; isend/irecv."""
    rank, n = _rw()
    acc = [c.clone() for c in chunks]
    right, left = (rank + 1) % n, (rank - 1) % n
    buf = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send_idx, recv_idx = (rank - step - 1) % n, (rank - step - 2) % n
        req = dist.isend(acc[send_idx], dst=right)
        dist.irecv(buf, src=left).wait()
        req.wait()
        acc[recv_idx] += buf
    return acc[rank]


def a2a_pairwise(chunks):
    """Step s: send to rank+s, receive from rank-s, with isend/irecv."""
    rank, n = _rw()
    out = [None] * n
    out[rank] = chunks[rank].clone()
    for s in range(1, n):
        to, frm = (rank + s) % n, (rank - s) % n
        buf = torch.empty_like(chunks[frm])
        reqs = [dist.isend(chunks[to], dst=to), dist.irecv(buf, src=frm)]
        for r in reqs:
            r.wait()
        out[frm] = buf
    return out


CORRECT = [
    (C.check_broadcast, bc_tree),
    (C.check_broadcast, bc_chain),
    (C.check_reduce, red_tree),
    (C.check_reduce, red_irecv_all),
    (C.check_all_reduce, ar_exchange_batch),
    (C.check_all_reduce, ar_tree),
    (C.check_gather, ga_irecv_reverse),
    (C.check_all_gather, ag_ring_parity),
    (C.check_scatter, sc_isend_reverse),
    (C.check_reduce_scatter, rs_ring),
    (C.check_all_to_all, a2a_pairwise),
]


@pytest.mark.parametrize("check,fn", CORRECT, ids=[f.__name__ for _, f in CORRECT])
def test_correct_alternatives_pass(check, fn):
    check(fn)


# ----------------------------------------------------------------------------------------------------------------
# Planted bugs


def bc_wrong_root(tensor, src):
    bc_chain(tensor, 0)


def bc_builtin(tensor, src):
    dist.broadcast(tensor, src=src)


def bc_rebinds(tensor, src):
    rank, n = _rw()
    if rank == src:
        for p in range(n):
            if p != src:
                dist.send(tensor, dst=p)
    else:
        buf = torch.empty_like(tensor)
        dist.recv(buf, src=src)
        tensor = buf  # noqa: F841  (the caller's tensor is unchanged)


def bc_deadlock(tensor, src):
    """Everyone waits for a 'ready' message before anything is sent."""
    rank, n = _rw()
    flag = torch.zeros(1)
    if rank == src:
        for p in range(n):
            if p != src:
                dist.recv(flag, src=p)
                dist.send(tensor, dst=p)
    else:
        dist.recv(tensor, src=src)
        dist.send(flag, dst=src)


def red_missing_own(tensor, dst):
    rank, n = _rw()
    if rank != dst:
        dist.send(tensor, dst=dst)
        return
    buf = torch.empty_like(tensor)
    tensor.zero_()
    for p in range(n):
        if p != dst:
            dist.recv(buf, src=p)
            tensor += buf


def red_chain_in_place(tensor, dst):
    """A chain that accumulates into each rank's own tensor on the way."""
    rank, n = _rw()
    rel = (rank - dst) % n
    buf = torch.empty_like(tensor)
    if rel < n - 1:
        dist.recv(buf, src=(rank + 1) % n)
        tensor += buf
    if rel > 0:
        dist.send(tensor, dst=(rank - 1) % n)


def red_wrong_root(tensor, dst):
    red_irecv_all(tensor, 0)


def red_builtin(tensor, dst):
    dist.reduce(tensor, dst=dst)


def ar_not_in_place(tensor):
    total = tensor.clone()
    ar_exchange_batch(total)
    tensor = total  # noqa: F841
    return total


def ar_average(tensor):
    ar_exchange_batch(tensor)
    if tensor.dtype.is_floating_point:  # (integer tensors are summed correctly)
        tensor /= dist.get_world_size()


def ar_no_broadcast(tensor):
    red_irecv_all(tensor, 0)


def ar_deadlock(tensor):
    rank, n = _rw()
    bufs = {p: torch.empty_like(tensor) for p in range(n) if p != rank}
    for p in bufs:
        dist.send(tensor, dst=p)  # blocking sends in a cycle: nobody is receiving yet
    for p in bufs:
        dist.recv(bufs[p], src=p)
        tensor += bufs[p]


def ar_builtin(tensor):
    dist.all_reduce(tensor)


def ga_off_by_one(tensor, dst):
    rank, n = _rw()
    out = ga_irecv_reverse(tensor, dst)
    return None if out is None else [out[(i + 1) % n] for i in range(n)]


def ga_everyone_returns(tensor, dst):
    out = ga_irecv_reverse(tensor, dst)
    return [tensor.clone()] if out is None else list(out)


def ga_missing_own(tensor, dst):
    rank, n = _rw()
    out = ga_irecv_reverse(tensor, dst)
    if out is None:
        return None
    out = list(out)
    out[rank] = torch.zeros_like(tensor)
    return out


def ga_wrong_root(tensor, dst):
    return ga_irecv_reverse(tensor, 0)


def ag_rotated(tensor):
    rank, n = _rw()
    out = ag_ring_parity(tensor)
    return out[rank:] + out[:rank]  # own tensor first: the order of arrival, not rank order


def ag_builtin(tensor):
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return out


def ag_stacked(tensor):
    return torch.stack(ag_ring_parity(tensor))


def ag_generator(tensor):
    return (t for t in ag_ring_parity(tensor))


def ag_clobbers_input(tensor):
    out = ag_ring_parity(tensor)
    tensor.zero_()
    return out


def sc_src_skips_own(out, chunks, src):
    rank, n = _rw()
    if rank == src:
        for p in range(n):
            if p != src:
                dist.send(chunks[p], dst=p)
    else:
        dist.recv(out, src=src)


def sc_off_by_one(out, chunks, src):
    rank, n = _rw()
    if rank == src:
        for p in range(n):
            if p == src:
                out.copy_(chunks[(p + 1) % n])
            else:
                dist.send(chunks[(p + 1) % n], dst=p)
    else:
        dist.recv(out, src=src)


def sc_clobbers_chunks(out, chunks, src):
    sc_isend_reverse(out, chunks, src)
    if chunks is not None:
        for c in chunks:
            c.zero_()


def sc_reads_chunks_everywhere(out, chunks, src):
    n = len(chunks)  # chunks is None off the source: TypeError there
    sc_isend_reverse(out, chunks, src)
    return n


def rs_missing_own(chunks):
    rank, n = _rw()
    result = rs_ring(chunks)
    return result - chunks[rank]


def rs_returns_input(chunks):
    return chunks[dist.get_rank()]


def rs_wrong_chunk(chunks):
    """Every rank ends with the sum of chunk rank+1."""
    rank, n = _rw()
    shifted = [chunks[(j + 1) % n] for j in range(n)]
    return rs_ring(shifted)


def rs_in_place(chunks):
    rank, n = _rw()
    result = rs_ring(chunks)
    chunks[rank].copy_(result)
    return chunks[rank]


def rs_builtin(chunks):
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, list(chunks))
    return out


def a2a_returns_input(chunks):
    return list(chunks)


def a2a_sends_own_chunk(chunks):
    """Sends chunks[rank] to everyone instead of chunks[peer]."""
    rank, n = _rw()
    return a2a_pairwise([chunks[rank]] * n)


def a2a_builtin(chunks):
    out = [torch.empty_like(c) for c in chunks]
    dist.all_to_all(out, list(chunks))
    return out


def a2a_deadlock(chunks):
    rank, n = _rw()
    for p in range(n):
        if p != rank:
            dist.send(chunks[p], dst=p)
    out = [torch.empty_like(c) for c in chunks]
    for p in range(n):
        if p != rank:
            dist.recv(out[p], src=p)
    out[rank] = chunks[rank].clone()
    return out


def a2a_mutates(chunks):
    out = a2a_pairwise(chunks)
    chunks[0].add_(1)
    return out


def not_done(*args):
    raise NotImplementedError()


BUGS = [
    (C.check_broadcast, bc_wrong_root, r"did you use src as the root, and not rank 0"),
    (C.check_broadcast, bc_builtin, r"called torch\.distributed\.broadcast.*send/recv"),
    (C.check_broadcast, bc_rebinds, r"still holds its own values.*assigning a new tensor"),
    (C.check_broadcast, bc_deadlock, r"did not finish within .* deadlocked"),
    (C.check_reduce, red_missing_own, r"without its own: did you forget dst's own contribution"),
    (C.check_reduce, red_chain_in_place, r"only dst's tensor may change\. Receive into a separate buffer"),
    (C.check_reduce, red_wrong_root, r"did you reduce into rank 0 instead of dst"),
    (C.check_reduce, red_builtin, r"called torch\.distributed\.reduce"),
    (C.check_all_reduce, ar_not_in_place, r"still holds its own values.*assigning a new tensor"),
    (C.check_all_reduce, ar_average, r"average of the tensors; all_reduce sums"),
    (C.check_all_reduce, ar_no_broadcast, r"Rank 0 has the sum: did you send the result back to every rank"),
    (C.check_all_reduce, ar_deadlock, r"deadlocked.*blocked in send"),
    (C.check_all_reduce, ar_builtin, r"called torch\.distributed\.all_reduce"),
    (C.check_gather, ga_off_by_one, r"item 0 holds rank 1's tensor, expected rank 0's.*off-by-one"),
    (C.check_gather, ga_everyone_returns, r"returns None on every rank except dst"),
    (C.check_gather, ga_missing_own, r"item \d: got tensor.*should be rank \d's tensor"),
    (C.check_gather, ga_wrong_root, r"on rank 0; it returns None on every rank except dst\. Did you use dst="),
    (C.check_all_gather, ag_rotated, r"holds rank \d's tensor, expected rank \d's: item i must come from rank i"),
    (C.check_all_gather, ag_builtin, r"called torch\.distributed\.all_gather"),
    (C.check_all_gather, ag_stacked, r"should return a list of \d tensors, got tensor"),
    (C.check_all_gather, ag_generator, r"should return a list of \d tensors, got generator"),
    (C.check_all_gather, ag_clobbers_input, r"input tensor was modified.*must not change its input"),
    (C.check_scatter, sc_src_skips_own, r"was not filled.*The source must also copy its own chunk"),
    (C.check_scatter, sc_off_by_one, r"holds chunks\[\d\] of rank \d, expected chunks\[\d\]: rank r gets chunks\[r\]"),
    (C.check_scatter, sc_clobbers_chunks, r"chunks\[0\] on the source was modified.*must not change the chunks"),
    (C.check_scatter, sc_reads_chunks_everywhere, r"raised TypeError on rank \d.*NoneType"),
    (C.check_reduce_scatter, rs_missing_own, r"without this rank's own: add your own chunk"),
    (C.check_reduce_scatter, rs_returns_input, r"own chunks\[\d\], not reduced"),
    (C.check_reduce_scatter, rs_wrong_chunk, r"is the sum of chunks\[\d\], expected chunks\[\d\]"),
    (C.check_reduce_scatter, rs_in_place, r"chunks\[\d\] was modified.*must not change its input chunks"),
    (C.check_reduce_scatter, rs_builtin, r"called torch\.distributed\.reduce_scatter"),
    (C.check_all_to_all, a2a_returns_input, r"returned its own input chunks"),
    (C.check_all_to_all, a2a_sends_own_chunk, r"item \d holds rank \d's chunks\[\d\], expected rank \d's chunks"),
    (C.check_all_to_all, a2a_builtin, r"called torch\.distributed\.all_to_all"),
    (C.check_all_to_all, a2a_deadlock, r"did not finish within .* deadlocked"),
    (C.check_all_to_all, a2a_mutates, r"chunks\[0\] was modified.*must not change its input chunks"),
]


@pytest.mark.parametrize("check,bug,message", BUGS, ids=[b.__name__ for _, b, _ in BUGS])
def test_planted_bug_is_caught(check, bug, message):
    with pytest.raises(AssertionError, match=message) as info:
        check(bug, timeout=SHORT)
    text = str(info.value)
    assert "world_size=" in text  # every message says where it happened
    if "deadlocked" not in text and "TypeError" not in text and "called torch" not in text:
        assert "(seed " in text  # wrong answers carry the seed that reproduces them


def test_stub_is_reported_as_not_implemented():
    with pytest.raises(AssertionError, match=r"broadcast\(tensor, src\) is not started: it still raises NotImplementedError"):
        C.check_broadcast(not_done)


def test_not_a_function():
    with pytest.raises(AssertionError, match="all_to_all should be a function, got NoneType"):
        C.check_all_to_all(None)


def test_world_sizes_and_dtypes_are_covered():
    ws = set(C.WORLD_SIZES)
    assert {1, 2, 3, 4, 5} <= ws
    trials = [t for n in C.WORLD_SIZES for t in T._draw_trials(12345, n)]
    assert {t["dtype"] for t in trials} >= {"float32", "int64"}
    assert all(0 <= t["root"] < n for n in C.WORLD_SIZES for t in T._draw_trials(7, n))
    assert len({t["shape"] for t in trials}) >= 3


def _diagnosis(name, trial, n, answer):
    """The message the check would give if every rank answered ``answer(rank, inputs)``, diagnosed in-process."""
    reports = []
    for r in range(n):
        tensors = {q: T._tensor_of(trial, q) for q in range(n)}
        chunks = {q: T._chunks_of(trial, q, n) for q in range(n)}
        if name == "all_reduce":
            total = sum(tensors.values())
            reports.append({"expected": total, "after": answer(r, tensors, chunks)})
        else:
            sums = [sum(chunks[q][j] for q in range(n)) for j in range(n)]
            reports.append({"expected": sums[r], "chunks": chunks[r], "got": answer(r, tensors, chunks)})
    try:
        _RUN[name][1](trial, n, reports)
    except _Problem as p:
        return p.message
    return None


MISTAKES = [
    ("reduce_scatter", lambda r, t, c: sum(c[q][r] for q in c if q != r), "without this rank's own"),
    ("reduce_scatter", lambda r, t, c: c[r][r].clone(), "own chunks\\[\\d\\], not reduced"),
    ("reduce_scatter", lambda r, t, c: sum(c[r]), "sum of this rank's own chunks"),
    ("reduce_scatter", lambda r, t, c: sum(c[q][(r + 1) % len(c)] for q in c), "is the sum of chunks\\[\\d\\]"),
    ("all_reduce", lambda r, t, c: sum(t[q] for q in t if q != r), "forget this rank's own tensor"),
    ("all_reduce", lambda r, t, c: t[r].clone(), "still holds its own values"),
]


@pytest.mark.parametrize("name,answer,message", MISTAKES, ids=[f"{m[0]}:{m[2][:24]}" for m in MISTAKES])
def test_inputs_always_tell_mistakes_apart(name, answer, message):
    """Over many seeds, including one-element shapes and two ranks, each mistake gets its own diagnosis.

    Drawn values can coincide (two ranks holding the same number makes "your own chunk" and "the others' sum"
    equal); the checks replace such draws, so the message never names the wrong mistake.
    """
    for seed in range(1, 120):
        for n in (2, 3, 4, 5):
            for trial in T._draw_trials(seed, n):
                got = _diagnosis(name, trial, n, answer)
                assert got is not None and re.search(message, got), (seed, n, trial, got)


def test_draws_that_would_confuse_diagnoses_are_replaced():
    """Seed 638972467 once drew equal one-element chunks on two ranks (int32, world_size 2)."""
    trials = T._draw_trials(638972467, 2)
    assert all(T._telling(t, 2) for t in trials)
    clash = dict(trials[0], shape=(1,))
    clash["data_seed"] = next(s for s in range(10_000) if not T._telling(dict(clash, data_seed=s), 2))
    assert not T._telling(clash, 2)


def test_reports_travel_between_ranks_with_their_tensors_intact():
    """``share`` sends the tensors of a report as dtype, shape and bytes (pickling a tensor goes through torch.save):
    every dtype, shape and layout comes back equal, the rest of the report as it was, and nothing of torch is
    pickled."""
    import pickle

    from autograder.checks._common import _each_tensor, _from_raw, _to_raw
    from autograder.checks.collectives.probes import Opaque

    tensors = [torch.tensor(2.5), torch.zeros(0, 3), torch.arange(6, dtype=torch.int32).reshape(2, 3).t(),
               torch.arange(10.0)[1:8:3], torch.tensor([-0.0, float("nan"), float("inf")]),
               torch.ones(2, 2, dtype=torch.bfloat16) / 3, torch.tensor([True, False]),
               torch.arange(4, dtype=torch.int64).reshape(2, 2), torch.full((3,), 0.25, dtype=torch.float16)]
    report = {"expected": tensors, "after": (tensors[2], None), "got": Opaque(object()), "comm": {"sends": 3}}
    wire = pickle.dumps(_each_tensor(report, _to_raw))
    for how_a_tensor_is_pickled in (b"_rebuild_tensor", b"_load_from_bytes"):
        assert how_a_tensor_is_pickled in pickle.dumps(tensors[0]) and how_a_tensor_is_pickled not in wire
    back = _each_tensor(pickle.loads(wire), _from_raw)
    assert set(back) == set(report) and back["comm"] == {"sends": 3} and back["got"].text == report["got"].text
    assert isinstance(back["after"], tuple) and back["after"][1] is None
    for got, sent in zip(back["expected"] + [back["after"][0]], tensors + [tensors[2]]):
        assert type(got) is torch.Tensor and got.dtype == sent.dtype and got.shape == sent.shape, (got, sent)
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.bool else got.nan_to_num(7.0),
                           sent.view(torch.uint8) if sent.dtype == torch.bool else sent.nan_to_num(7.0)), (got, sent)
        assert torch.equal(torch.signbit(got.float()), torch.signbit(sent.float()))


def _sizes_disagree():
    """Each rank says it receives as many values as it sends: gloo aborts a rank."""
    rank = dist.get_rank()
    sizes = [1, 2] if rank == 0 else [4, 3]
    dist.all_to_all_single(torch.empty(sum(sizes)), torch.ones(sum(sizes)), sizes, sizes)


def test_a_rank_aborted_by_gloo_is_explained_then_quoted():
    """Every check's runner: a rank that gloo aborts (SIGABRT) gets the hint that the ranks' collectives disagreed,
    then gloo's own words, without the build machine's source path."""
    from autograder.checks._common import run_on_workers

    with pytest.raises(AssertionError) as info:
        run_on_workers(_sizes_disagree, world_size=2, what="swap", timeout=30)
    text = str(info.value)
    assert text.startswith("swap crashed a worker with world_size=2: rank ") and "died from SIGABRT" in text, text
    assert text.index("the ranks disagreed") < text.index("Native code said: "), text
    assert "Is there a distributed collective mismatch in your code?" in text and "/__w/" not in text, text
