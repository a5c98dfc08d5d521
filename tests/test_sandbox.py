"""labsupport._sandbox: a student's function runs in a process of its own per rank, behind a host that carries its
messages (the boundary grading draws; see README "What grading trusts").

Each test runs real gloo workers whose check code (the host) calls a function wrapped by ``sandboxed``: what the
host's ``CommCounter`` records is what crossed to the other ranks; what the sandbox may not do (a built-in the
exercise forbids, a socket, another process, the grader's modules, communication after returning) fails with a
message that says so; honest habits (prints to stderr, a printed traceback, warnings, a cached helper) run as in a
notebook.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import labsupport
from labsupport import launch
from labsupport._sandbox import Unplain, sandboxed
from labsupport.comm import CommCounter

pytestmark = pytest.mark.slow

P2P = {"send", "recv"}


def ring_all_reduce(tensor):
    n, r = dist.get_world_size(), dist.get_rank()
    total = tensor.clone()
    for k in range(1, n):
        incoming = torch.empty_like(tensor)
        request = dist.isend(tensor, (r + k) % n)
        dist.recv(incoming, (r - k) % n)
        request.wait()
        total += incoming
    tensor.copy_(total)


def probe(fn, *extra):
    """The host's side (a check): inputs, the call inside a counter, and what came back."""
    x = torch.arange(6, dtype=torch.float32) + dist.get_rank()
    with CommCounter() as cc:
        out = fn(x, *extra)
    return {"x": x, "out": out, "calls": [(c.kind, c.peer, c.nbytes) for c in cc.summary.calls],
            "pid": os.getpid()}


def run(fn, n=3, allow=P2P, timeout=30, **kwargs):
    return labsupport.run(probe, sandboxed(fn, fn.__name__, allow), world_size=n, timeout=timeout, **kwargs)


def test_the_host_carries_and_records_every_message():
    ranks = run(ring_all_reduce)
    expected = sum(torch.arange(6, dtype=torch.float32) + r for r in range(3))
    for r, got in enumerate(ranks):
        torch.testing.assert_close(got["x"], expected)  # in place: the host's own tensor was changed
        assert sorted(got["calls"]) == sorted([("send", (r + 1) % 3, 24), ("recv", (r - 1) % 3, 24),
                                               ("send", (r + 2) % 3, 24), ("recv", (r - 2) % 3, 24)])


def uses_all_reduce(tensor):
    dist.all_reduce(tensor)


def uses_functional(tensor):
    import torch.distributed._functional_collectives as fc

    tensor.copy_(fc.wait_tensor(fc.all_reduce(tensor, "sum", dist.group.WORLD)))


@pytest.mark.parametrize("fn", [uses_all_reduce, uses_functional])
def test_a_builtin_the_exercise_forbids_is_refused_with_the_rule(fn):
    with pytest.raises(labsupport.WorkerError, match=r"called torch\.distributed\.all_reduce on rank \d: build it "
                                                     r"from send/recv \(or isend/irecv\) only"):
        run(fn, n=2)


def test_any_call_goes_through_when_the_exercise_allows_it():
    ranks = run(uses_all_reduce, n=2, allow=None)
    assert ranks[0]["calls"] == [("all_reduce", None, 24)]
    torch.testing.assert_close(ranks[1]["x"], torch.arange(6, dtype=torch.float32) * 2 + 1)


def coalesced(tensor):
    parts = [tensor[:2].clone(), tensor[2:].clone()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # all_reduce_coalesced is deprecated
        dist.all_reduce_coalesced(parts)
    tensor.copy_(torch.cat(parts))


def test_an_all_reduce_of_several_tensors_reduces_each_in_one_call():
    """all_reduce_coalesced: every tensor of the list is reduced, in one all-reduce of their bytes."""
    ranks = run(coalesced, n=2, allow=None)
    for got in ranks:
        assert got["calls"] == [("all_reduce", None, 24)]
        torch.testing.assert_close(got["x"], torch.arange(6, dtype=torch.float32) * 2 + 1)


def changes_it_in_flight(tensor):
    work = dist.all_reduce(tensor, async_op=True)
    tensor /= dist.get_world_size()  # a race on a worker: the all-reduce writes into this tensor while it runs
    work.wait()


def test_a_tensor_changed_while_its_all_reduce_runs_is_an_error():
    """On a worker the outcome depends on when the all-reduce finishes; through the host it would always be the sum
    (the result lands at wait()), hiding the race: it is an error that says so."""
    with pytest.raises(labsupport.WorkerError, match=r"was changed before its wait\(\)"):
        run(changes_it_in_flight, n=2, allow=None)


def returns_a_subclass(tensor):
    class Later(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.detach:
                dist.all_reduce(args[0].as_subclass(torch.Tensor))
            return super().__torch_function__(func, types, args, kwargs or {})

    return tensor.as_subclass(Later)


def test_a_result_that_communicates_when_read_is_refused():
    with pytest.raises(labsupport.WorkerError, match="grading refused: returns_a_subclass called "
                                                     r"torch\.distributed\.all_reduce after it returned"):
        run(returns_a_subclass, n=2, allow=None)


def returns_odd_things(tensor):
    return [tensor.double(), {"k": (1, 2.5)}, (x for x in ()), None]


def test_results_come_back_as_plain_data():
    out = run(returns_odd_things, n=1)[0]["out"]
    assert type(out[0]) is torch.Tensor and out[0].dtype == torch.float64
    assert out[1] == {"k": (1, 2.5)} and out[3] is None
    assert isinstance(out[2], Unplain) and out[2].kind == "generator"


def opens_a_socket(tensor):
    import socket

    socket.socket()


def starts_a_process(tensor):
    import subprocess

    subprocess.run(["true"])


def signals_its_host(tensor):
    os.kill(os.getppid(), 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="seccomp is Linux's")
@pytest.mark.parametrize("fn", [opens_a_socket, starts_a_process, signals_its_host])
def test_the_sandbox_has_no_way_out_but_its_host(fn):
    with pytest.raises(labsupport.WorkerError, match="PermissionError"):
        run(fn, n=1)


def imports_the_grader(tensor):
    import autograder.checks  # noqa: F401


def test_the_grader_cannot_be_imported_in_the_sandbox(monkeypatch):
    monkeypatch.delenv("LABSUPPORT_TEST_GRADER_IN_SANDBOX", raising=False)
    with pytest.raises(labsupport.WorkerError, match="the grader's modules are not available where your function "
                                                     "runs"):
        run(imports_the_grader, n=1)


@functools.lru_cache(maxsize=None)
def cached_peers(n, r):
    return tuple(p for p in range(n) if p != r)


class Total:
    def __init__(self, t):
        self.t = t.clone()


def with_habits(tensor):
    import inspect
    import traceback

    n, r = dist.get_world_size(), dist.get_rank()
    print(f"rank {r} starts", file=sys.stderr)
    assert "tensor" in inspect.signature(with_habits).parameters
    try:
        raise ValueError("a debugging leftover")
    except ValueError:
        traceback.print_exc()
    total = Total(tensor)
    for peer in cached_peers(n, r):
        incoming = torch.empty_like(tensor)
        request = dist.isend(tensor, peer)
        dist.recv(incoming, peer)
        request.wait()
        total.t += incoming
    tensor.copy_(total.t)
    warnings.warn("done")
    return "ok"


def test_honest_habits_run_as_in_a_notebook(capfd):
    ranks = run(with_habits, n=2)
    assert [r["out"] for r in ranks] == ["ok", "ok"]
    torch.testing.assert_close(ranks[0]["x"], torch.arange(6, dtype=torch.float32) * 2 + 1)
    err = capfd.readouterr().err
    assert "[rank 0] rank 0 starts" in err and "[rank 1] rank 1 starts" in err
    assert "ValueError: a debugging leftover" in err and "UserWarning: done" in err


def test_grading_shows_the_workers_stderr_on_stdout(capfd, monkeypatch):
    """nbgrader gives no points to a test cell with output on stderr: while grading it goes to stdout."""
    monkeypatch.setenv("LABSUPPORT_GRADING", "1")
    run(with_habits, n=2)
    out, err = capfd.readouterr()
    assert "[rank 1] rank 1 starts" in out and "UserWarning: done" in out
    assert "rank 1 starts" not in err


def raises_not_implemented(tensor):
    raise NotImplementedError


def test_an_unwritten_function_says_so():
    with pytest.raises(labsupport.WorkerError, match="raises_not_implemented is not started: it still raises NotImplementedError"):
        run(raises_not_implemented, n=1)


def waits_forever(tensor):
    dist.recv(tensor, (dist.get_rank() + 1) % dist.get_world_size())


@pytest.mark.timing
def test_a_deadlock_report_shows_where_the_students_code_waits(settled_timeouts):
    with pytest.raises(labsupport.WorkerTimeout) as info:
        run(waits_forever, n=2, timeout=4)
    text = str(info.value)
    assert "rank 0: blocked in recv(src=1)" in text and "rank 1: blocked in recv(src=0)" in text, text
    assert "dist.recv(tensor, (dist.get_rank() + 1) % dist.get_world_size())" in text, text
    assert "labsupport/_sandbox" not in text and "labsupport/_relay" not in text, text
    # the killed workers' sandboxes left their pids next to the stack files; the new workers must not inherit them
    # (a later report would signal a process that is gone, or one that reused its pid, and read no stack)
    labsupport.run(os.getpid, world_size=2)
    assert [w for w in launch._POOL.workers.values() if os.path.exists(w.stack_file + ".sandbox")] == []


def my_pid(tensor):
    return os.getpid(), os.getcwd(), dist.get_rank(), dist.get_world_size(), os.environ["RANK"]


def test_the_sandbox_starts_each_task_afresh_and_ends_with_its_worker():
    import psutil

    first = run(my_pid, n=2)
    second = run(my_pid, n=3)
    for ranks, n in ((first, 2), (second, 3)):
        assert [r["out"][2:] for r in ranks] == [(r, n, str(r)) for r in range(n)]  # the task's rank and size
        assert all(r["out"][0] != r["pid"] for r in ranks)  # another process than the host
    sandboxes = {r["out"][0] for r in first + second}
    folders = {r["out"][1] for r in first + second}
    assert all(os.path.basename(f).startswith("sandbox-") for f in folders), folders  # a private folder
    labsupport.shutdown()
    deadline = time.monotonic() + 60  # ends as soon as they are gone
    while time.monotonic() < deadline and any(psutil.pid_exists(p) or os.path.exists(f)
                                               for p, f in zip(sandboxes, folders)):
        time.sleep(0.05)
    assert not any(psutil.pid_exists(p) for p in sandboxes)
    assert not any(os.path.exists(f) for f in folders)


def shards_with_the_builtin(n):
    from torch.utils.data import DistributedSampler

    return list(DistributedSampler(range(n), num_replicas=2, rank=0, shuffle=False))


def test_the_builtin_an_exercise_rebuilds_raises_inside_its_call():
    rules = {"torch.utils.data:DistributedSampler": "do not", "torch.utils.data.distributed:DistributedSampler":
             "do not"}

    def call(fn, n):
        return fn(n)

    with pytest.raises(labsupport.WorkerError, match="RuntimeError: do not"):
        labsupport.run(call, sandboxed(shards_with_the_builtin, forbid=rules), 6, world_size=1)
    assert labsupport.run(call, sandboxed(shards_with_the_builtin), 6, world_size=1) == [[0, 2, 4]]


# ---------------------------------------------------------------------------------------------------------------
# what the host measures from outside, a class driven in the sandbox, and the sandbox's files


def keeps_files(tensor):
    import glob

    out = {}
    with open("mine.txt", "w") as fh:  # its own folder (the working directory): allowed
        fh.write(str(dist.get_rank()))
    out["own"] = open("mine.txt").read()
    for what, path, mode in (("tmp", "/tmp/labsupport-sandbox-test.txt", "w"),
                             ("pool", os.path.join(os.path.dirname(os.getcwd()), "x.txt"), "w")):
        try:
            open(path, mode).close()
            out[what] = "written"
        except PermissionError:
            out[what] = "refused"
    try:
        out["others"] = sorted(glob.glob(os.path.join(os.path.dirname(os.getcwd()), "sandbox-*", "mine.txt")))
    except PermissionError:
        out["others"] = "refused"
    out["torch"] = torch.ones(2).sum().item()  # Python's and torch's files are still read
    return out


def test_a_sandbox_writes_only_its_own_folder_and_reads_no_other_ranks():
    from labsupport import _landlock

    if _landlock.restrict.__defaults__ is None and not sys.platform.startswith("linux"):
        pytest.skip("Landlock is Linux's")
    ranks = run(keeps_files, n=2, allow=None)
    for r, got in enumerate(ranks):
        out = got["out"]
        assert out["own"] == str(r) and out["torch"] == 2.0
        assert out["tmp"] == "refused" and out["pool"] == "refused", out
        assert out["others"] in ("refused", []), out  # not even its own folder is seen from the pool's
    assert not os.path.exists("/tmp/labsupport-sandbox-test.txt")


def overlaps(tensor, work):
    peer = 1 - dist.get_rank()
    incoming = torch.empty_like(tensor)
    requests = [dist.isend(tensor, peer), dist.irecv(incoming, peer)]
    a = torch.randn(256, 256)
    for _ in range(work):  # real products while the messages travel
        a = torch.tanh(a @ a)
    for request in requests:
        request.wait()
    return incoming


def cpu_between(fn, work):
    from labsupport import _sandbox

    fn(torch.ones(1000), work)
    return [(kind, cpu_waited - cpu_posted) for kind, _, _, _, _, cpu_posted, cpu_waited in _sandbox.record()]


def test_the_host_reads_the_work_done_between_a_post_and_its_wait():
    """CPU time, read from /proc outside the sandbox: what ran between a post and its wait, whatever the load."""
    idle = labsupport.run(cpu_between, sandboxed(overlaps, "overlaps"), 0, world_size=2, timeout=60)
    busy = labsupport.run(cpu_between, sandboxed(overlaps, "overlaps"), 40, world_size=2, timeout=60)
    for rank in range(2):
        assert [k for k, _ in busy[rank]] == ["send", "recv"]
        # 40 products of 256x256 matrices: over 40 million multiply-adds between the first post and its wait
        assert busy[rank][0][1] > 0.005 and busy[rank][0][1] > 5 * idle[rank][0][1], (idle, busy)


KEPT = []


def holds(mib):
    KEPT.append(torch.ones(mib * 2**18))  # float32: mib MiB, kept after the call
    return len(KEPT)


def peak_of(fn, mib):
    from labsupport import _sandbox

    fn(0)  # the sandbox starts at its first call
    _sandbox.reset_peak()
    before = _sandbox.memory()
    fn(mib)
    after = _sandbox.memory()
    return before, after


def test_the_host_reads_the_sandboxs_memory():
    [(before, after)] = labsupport.run(peak_of, sandboxed(holds, "holds"), 200, world_size=1)
    assert after["rss"] - before["rss"] >= 190 * 2**20 and after["peak"] >= after["rss"]
    assert after["data"] - before["data"] >= 190 * 2**20


class Accumulator:  # a student's class: its state lives in the sandbox from call to call of the driver
    def __init__(self):
        self.total = torch.zeros(3)

    def add(self, tensor):
        dist.all_reduce(tensor)
        self.total += tensor


def drive_accumulator(cls, steps):
    acc = cls()
    seen = []
    for step in range(steps):
        acc.add(torch.full((3,), float(step + dist.get_rank())))
        seen.append(acc.total.clone())
    return seen


def test_a_driver_exercises_a_students_class_in_the_sandbox():
    def host(fn):
        with CommCounter() as cc:
            seen = fn(3)
        return seen, [c.kind for c in cc.summary.calls]

    fn = sandboxed(Accumulator, "Accumulator", {"all_reduce"}, driver=drive_accumulator)
    for seen, kinds in labsupport.run(host, fn, world_size=2):
        assert [t.tolist() for t in seen] == [[1.0] * 3, [4.0] * 3, [9.0] * 3]
        assert kinds == ["all_reduce"] * 3


def tensor_forms(tensor):
    n = dist.get_world_size()
    gathered = torch.empty(tensor.numel() * n)
    dist.all_gather_into_tensor(gathered, tensor)
    summed = torch.empty(tensor.numel() // n)
    dist.reduce_scatter_tensor(summed, tensor)
    swapped = torch.empty_like(tensor)
    dist.all_to_all_single(swapped, tensor)
    return gathered, summed, swapped


def test_the_single_tensor_collectives_go_through_the_host():
    """all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single (each a method of its own in torch 2.13's
    ProcessGroup) reach the host like every other call."""
    ranks = run(tensor_forms, n=2, allow=None)
    x = [torch.arange(6, dtype=torch.float32) + r for r in range(2)]
    for r, got in enumerate(ranks):
        gathered, summed, swapped = got["out"]
        torch.testing.assert_close(gathered, torch.cat(x))
        torch.testing.assert_close(summed, (x[0] + x[1]).chunk(2)[r])
        torch.testing.assert_close(swapped, torch.cat([x[0].chunk(2)[r], x[1].chunk(2)[r]]))
        assert sorted(kind for kind, _, _ in got["calls"]) == ["all_gather", "all_to_all_single", "reduce_scatter"]


def uneven_reduce_scatter(tensor):
    out = torch.empty(2)
    dist.reduce_scatter(out, list(torch.arange(5.0).chunk(dist.get_world_size())))  # 3 + 2 elements, not 2 + 2


def test_a_collective_with_the_wrong_sizes_fails_at_once_on_every_rank():
    """As gloo's own check does in a worker: not a deadlock of the ranks whose sizes happen to fit."""
    with pytest.raises(labsupport.WorkerError) as info:
        run(uneven_reduce_scatter, n=2, allow=None)
    assert "each the output's size" in str(info.value) and "rank 0" in str(info.value) and "rank 1" in str(info.value)


def recorded(fn):
    from labsupport import _sandbox

    fn(torch.arange(6, dtype=torch.float32))
    return [(kind, nbytes) for kind, _, nbytes, *_ in _sandbox.record()]


def test_the_hosts_log_names_each_request_and_the_bytes_it_handed_over():
    for got in labsupport.run(recorded, sandboxed(tensor_forms, "tensor_forms"), world_size=2):
        assert got == [("all_gather", 24), ("reduce_scatter", 24), ("all_to_all", 24)], got
