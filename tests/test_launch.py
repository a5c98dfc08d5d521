"""labsupport.run: results, output, every failure mode, and what is left behind afterwards.

No test here measures how soon something happens (``benchmarks/latency.py`` prints that): a test of a failure checks
that the failure, not the time-out, ended the call; a test of a time-out lets it fire only once the planted deadlock
is in place (``settled_timeouts``) and checks that it fired no earlier than its value. The tests marked ``timing``
involve real time and must pass on a loaded machine.
"""

import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import cloudpickle
import psutil
import pytest
import torch
import torch.distributed as dist

import labsupport
from labsupport import _board, _call, _callboard, _env, _pickling, _pool, _worker, launch, magics

WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1)


# ---------------------------------------------------------------------------------------------------------------
# what every test must leave behind: nothing but idle workers


def _children():
    return psutil.Process().children(recursive=True)


def _helpers() -> set:
    """multiprocessing's fork server and resource tracker: they stay between calls on purpose."""
    from multiprocessing import forkserver, resource_tracker

    pids = {
        getattr(forkserver._forkserver, "_forkserver_pid", None),
        getattr(resource_tracker._resource_tracker, "_pid", None),
    }
    return {p for p in pids if p}


def _unexpected_children(sandboxes: set = frozenset()) -> list:
    """Children that are neither a live pool worker, its sandbox, nor a helper: a killed worker not yet gone (or a
    zombie), or a process a call left behind."""
    allowed = _helpers() | {w.process.pid for w in launch._POOL.workers.values() if w.alive()} | set(sandboxes)
    out = []
    for p in _children():
        try:
            if p.pid not in allowed:
                out.append((p.pid, p.name(), p.status()))
        except psutil.NoSuchProcess:
            pass
    return out


#: Seconds the checks after each test wait for what they expect (a worker back in its loop, a killed one reaped):
#: they end as soon as it holds, so only a test that leaves something behind waits this long.
SETTLE = 60.0


def _pong(w, timeout: float = SETTLE) -> tuple:
    """Worker ``w``'s answer to a ping, from its main loop (so it is idle): (whether it still has a process group,
    its sandbox's pid or None)."""
    w.conn.send_bytes(pickle.dumps(("ping",)))
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and w.conn.poll(left), f"worker {w.index} did not answer a ping: it is not idle"
        msg = pickle.loads(w.conn.recv_bytes())
        if msg[0] == "pong":
            return msg[1], msg[2]


def _ping(w, timeout: float = SETTLE) -> bool:
    """Whether worker ``w`` still has a process group."""
    return _pong(w, timeout)[0]


def _sandboxes(workers) -> set:
    """The sandboxes that idle workers keep on purpose (grading's, labsupport._sandbox), each its worker's child."""
    out = set()
    for w in workers:
        pid = _pong(w)[1]
        if pid is not None:
            assert psutil.Process(pid).ppid() == w.process.pid, f"worker {w.index}'s sandbox is not its child"
            out.add(pid)
    return out


def _assert_no_leftovers(handlers) -> None:
    assert {s: signal.getsignal(s) for s in WATCHED_SIGNALS} == handlers, "the kernel's signal handlers changed"
    workers = list(launch._POOL.workers.values())
    sandboxes = _sandboxes([w for w in workers if w.alive()])
    deadline = time.monotonic() + SETTLE
    while _unexpected_children(sandboxes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _unexpected_children(sandboxes) == [], "a worker survived its call (or was not reaped)"
    for w in workers:
        assert w.alive(), f"worker {w.index} is in the pool but dead"
        assert _ping(w) is False, f"worker {w.index} still has the process group of an earlier call"
    deadline = time.monotonic() + SETTLE  # a spinning worker is never asleep: no wait is long enough for it
    busy = workers
    while busy and time.monotonic() < deadline:
        busy = []
        for w in workers:
            try:
                if psutil.Process(w.process.pid).status() not in (psutil.STATUS_SLEEPING, psutil.STATUS_IDLE):
                    busy.append(w.index)
            except psutil.NoSuchProcess:
                busy.append(w.index)
        if busy:
            time.sleep(0.05)
    assert busy == [], f"workers {busy} are still computing after their call"


@pytest.fixture(autouse=True)
def _no_leftovers():
    """After every outcome: no stuck, spinning or orphaned worker, no process group, the same signal handlers."""
    handlers = {s: signal.getsignal(s) for s in WATCHED_SIGNALS}
    yield
    _assert_no_leftovers(handlers)


# ---------------------------------------------------------------------------------------------------------------
# worker functions


def rank_info(offset=0, *, scale=1):
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": x.item(),
        "env": {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
        "value": (dist.get_rank() + offset) * scale,
        "threads": torch.get_num_threads(),
        "device": str(labsupport.device()),
    }


def chatty():
    for i in range(3):
        print(f"line {i} of rank {dist.get_rank()}", "with", "several", "parts")
    print("no newline at the end", end="")
    return dist.get_rank()


def raise_on(bad_ranks, exc_type=ValueError):
    if dist.get_rank() in bad_ranks:
        raise exc_type(f"planted failure on rank {dist.get_rank()}")
    t = torch.zeros(1)
    dist.recv(t, src=bad_ranks[0])  # would wait forever: the launcher must stop it


def die_with(how):
    if dist.get_rank() == 1:
        if how == "exit":
            os._exit(3)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "segv":
            import ctypes

            ctypes.string_at(0)
    t = torch.zeros(1)
    dist.recv(t, src=1)


def mismatched_all_to_all():
    """Each rank says it receives as many rows as it sends: the sizes disagree and gloo aborts a rank."""
    rank = dist.get_rank()
    sizes = [1 + rank, 3 - rank] if rank == 0 else [2, 5]
    out = torch.empty(sum(sizes))
    dist.all_to_all_single(out, torch.ones(sum(sizes)), sizes, sizes)


def recv_from_each_other():
    t = torch.zeros(1)
    dist.recv(t, src=1 - dist.get_rank())


def recv_from_the_left():
    t = torch.zeros(1)
    dist.recv(t, src=(dist.get_rank() - 1) % dist.get_world_size())


def wait_for_each_other():
    t = torch.zeros(2)
    if dist.get_rank() == 0:
        req = dist.irecv(t, src=1)
        req.wait()
    else:
        (req,) = dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 0)])
        req.wait()


def mismatched_collectives():
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=1)
    dist.barrier()


def skip_collective():
    t = torch.ones(4)
    if dist.get_rank() != 0:
        dist.all_reduce(t)
    return "done"


def return_unpicklable():
    import threading

    return threading.Lock()


def return_big():
    return torch.full((25 * 2**20,), float(dist.get_rank()))  # 100 MiB


def flood(lines):
    for i in range(lines):
        print(i)
    return "flooded"


def busy_loop_forever(looping_dir):
    open(os.path.join(looping_dir, f"looping-{dist.get_rank()}"), "w").close()
    while True:
        pass


def print_then_wait(shown_dir):
    """Print a line and a line that does not end (a progress bar), then wait until the notebook has shown both
    (the test's stdout leaves a file per rank): a launcher that held them back until the function returned would
    never let it return, and the rank says so after a minute."""
    print(f"early line from rank {dist.get_rank()}")
    print("x" * (launch.MAX_PARTIAL_LINE + 10), end="", flush=True)
    shown = os.path.join(shown_dir, f"shown-{dist.get_rank()}")
    deadline = time.monotonic() + 60
    while not os.path.exists(shown) and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.path.exists(shown)


def draw_and_change_state():
    state = (torch.randn(3), torch.get_default_dtype(), torch.is_grad_enabled())
    torch.randn(1000)  # the generator moves on
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    return state


def comm_through_the_board():
    from torch.distributed import distributed_c10d as c10d

    wrapped = all(
        getattr(getattr(dist, name), "_labsupport_tap", None) == "api" and getattr(dist, name) is getattr(c10d, name)
        for name in _callboard._CALLS
    )
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    t = torch.ones(2)
    with labsupport.CommCounter() as cc:
        if rank == 0:
            dist.send(t, peer)
            dist.recv(t, peer)
        else:
            dist.recv(t, peer)
            dist.send(t, peer)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, torch.zeros(2), peer)])
        for req in reqs:
            req.wait()
        dist.all_reduce(t)
    return wrapped, cc.count("send"), cc.count("recv"), cc.count("all_reduce"), _callboard._board.header()


# ---------------------------------------------------------------------------------------------------------------
# results and output


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_results_in_rank_order_with_torchrun_environment(world_size):
    results = labsupport.run(rank_info, 10, world_size=world_size, scale=2)
    assert [r["rank"] for r in results] == list(range(world_size))
    assert [r["value"] for r in results] == [(r + 10) * 2 for r in range(world_size)]
    assert all(r["sum"] == sum(range(world_size)) for r in results)
    for r in results:
        env = r["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(r["rank"])
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(world_size)
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert r["device"] == "cpu"
        assert r["threads"] == max(1, _pool._cores() // world_size)


def test_function_defined_at_run_time_and_closure():
    factor = 7

    def local(x):  # a closure, like a function defined in a notebook cell
        return x * factor + dist.get_rank()

    assert labsupport.run(local, 1, world_size=2) == [7, 8]


def test_module_and_class_defined_at_run_time_travel_both_ways():
    class Scale(torch.nn.Module):  # defined here, like in a notebook cell: pickled by value
        def __init__(self, k):
            super().__init__()
            self.w = torch.nn.Parameter(torch.full((2,), float(k)))

        def forward(self, x):
            return x * self.w

    class Record:
        def __init__(self, rank, value):
            self.rank, self.value = rank, value

    def work(model_cls):
        model = model_cls(dist.get_rank() + 1)
        out = model(torch.ones(2)).detach()
        dist.all_reduce(out)
        return model, Record(dist.get_rank(), out.sum().item())

    results = labsupport.run(work, Scale, world_size=2)
    for rank, (model, record) in enumerate(results):
        assert isinstance(model, Scale) and isinstance(record, Record)
        assert model.w.tolist() == [rank + 1.0] * 2
        assert (record.rank, record.value) == (rank, 6.0)
        assert model(torch.ones(2)).tolist() == [rank + 1.0] * 2  # and it still works in the notebook


def test_functions_sent_to_workers_keep_the_file_and_lines_of_their_code():
    """A worker's traceback can name the student's cell only if the code it runs still says where it came from
    (cloudpickle 3.1.3 and later rename the file of every code object it sends by value to "<dynamic-code>")."""
    ns = {}
    exec(compile("def outer(x):\n    def inner(y):\n        return 1 / y\n    return inner(x)\n",
                 "/tmp/ipykernel_1/123.py", "exec"), ns)
    rebuilt = _pickling.loads(_pickling.dumps(ns["outer"]))
    inner = next(c for c in rebuilt.__code__.co_consts if hasattr(c, "co_filename"))
    assert rebuilt.__code__.co_filename == inner.co_filename == "/tmp/ipykernel_1/123.py"
    assert (rebuilt.__code__.co_firstlineno, inner.co_firstlineno) == (1, 2)
    assert rebuilt(4) == 0.25
    with pytest.raises(ZeroDivisionError) as err:
        rebuilt(0)
    assert [(f.filename, f.lineno) for f in traceback.extract_tb(err.value.__traceback__)][-1] == \
        ("/tmp/ipykernel_1/123.py", 3)


def test_run_inside_a_worker_just_calls_the_function():
    """Inside an initialised process group (torchrun, or a worker), run calls fn for this rank only."""

    def inner(k):
        return dist.get_rank() * k

    def outer():
        return labsupport.run(inner, 10, world_size=4)

    assert labsupport.run(outer, world_size=2) == [[0], [10]]


def test_prints_are_prefixed_whole_lines(capfd):
    assert labsupport.run(chatty, world_size=4) == [0, 1, 2, 3]
    out = capfd.readouterr().out.splitlines()
    for r in range(4):
        mine = [line for line in out if line.startswith(f"[rank {r}] ")]
        assert mine == [f"[rank {r}] line {i} of rank {r} with several parts" for i in range(3)] + [
            f"[rank {r}] no newline at the end"
        ]
    assert all(line.startswith("[rank ") for line in out if line)


class _ShownWrites:
    """A stand-in for sys.stdout that records each write, and leaves a file in ``shown_dir`` for each rank once both
    of ``print_then_wait``'s lines of that rank were shown."""

    def __init__(self, shown_dir):
        self.writes = []
        self.shown_dir = shown_dir

    def write(self, text):
        self.writes.append(text)
        for r in (0, 1):
            if self.early(r) and self.unended(r):
                open(os.path.join(self.shown_dir, f"shown-{r}"), "a").close()
        return len(text)

    def early(self, r) -> bool:
        return any(f"[rank {r}] early line from rank {r}\n" in text for text in self.writes)

    def unended(self, r) -> bool:
        return any(f"[rank {r}] {'x' * 100}" in text for text in self.writes)

    def flush(self):
        pass


@pytest.mark.timing
def test_prints_reach_the_notebook_as_they_happen(monkeypatch, tmp_path):
    """Each rank waits, before it returns, until the notebook has shown its line and its unended long line: both
    reach the notebook while the function still runs, whatever the machine's load (no sleep to outlast)."""
    out = _ShownWrites(str(tmp_path))
    monkeypatch.setattr(sys, "stdout", out)
    shown = labsupport.run(print_then_wait, str(tmp_path), world_size=2, timeout=120)
    monkeypatch.undo()
    for r in (0, 1):
        assert out.early(r), "a printed line never reached the notebook"
        assert out.unended(r), "a long line without newline never reached the notebook"
    assert shown == [True, True], "a printed line waited for the function to return"


def test_partial_lines_are_kept_per_stream_and_capped(capsys):
    call = _call._Call(launch._POOL, 2, "gloo", 1.0)
    call._emit(0, "stdout", "progress: ")
    call._emit(0, "stderr", "a warning\n")
    call._emit(0, "stdout", "done\n")
    long = "y" * (launch.MAX_PARTIAL_LINE + 1)
    call._emit(1, "stdout", long)
    assert call.output.partial == {}  # memory stays bounded: the long fragment is already shown
    call._emit(1, "stderr", "no newline")
    call._flush_output()
    captured = capsys.readouterr()
    assert captured.out == f"[rank 0] progress: done\n[rank 1] {long}\n"
    assert captured.err == "[rank 0] a warning\n[rank 1] no newline\n"


def test_print_flood_is_capped_and_counted(capfd):
    assert labsupport.run(flood, 100_000, world_size=2, timeout=120) == ["flooded"] * 2
    out = capfd.readouterr().out.splitlines()
    assert len(out) <= 2 * (launch.MAX_LINES_PER_RANK + 2)
    assert any(f"… {100_000 - launch.MAX_LINES_PER_RANK} lines skipped …" in line for line in out)


def test_long_output_keeps_its_head_and_its_tail(capfd):
    """5,000 lines: the first 500 as they come, "… 4000 lines skipped …", then the last 500 (the final loss)."""
    assert labsupport.run(flood, 5000, world_size=2) == ["flooded"] * 2
    out = capfd.readouterr().out.splitlines()
    for r in (0, 1):
        mine = [line[len(f"[rank {r}] "):] for line in out if line.startswith(f"[rank {r}] ")]
        head, tail = launch.MAX_LINES_PER_RANK // 2, launch.MAX_LINES_PER_RANK - launch.MAX_LINES_PER_RANK // 2
        assert mine[:head] == [str(i) for i in range(head)]
        assert mine[head].startswith("… more output: its last") and "appear when the call ends" in mine[head]
        assert mine[head + 1] == f"… {5000 - head - tail} lines skipped …"
        assert mine[head + 2:] == [str(i) for i in range(5000 - tail, 5000)]


def test_output_memory_stays_bounded(capsys):
    from labsupport._output import RankOutput

    output = RankOutput(1, max_lines=6)
    for i in range(10_000):
        output.emit(0, "stdout" if i % 2 else "stderr", f"{i}\n")
    output.emit(0, "stdout", "z" * (launch.MAX_PARTIAL_LINE * 3) + "\n")
    assert len(output.tails[0]) == 3 and all(len(line) < launch.MAX_PARTIAL_LINE + 50 for _, line in output.tails[0])
    output.flush()
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["[rank 0] 0", "[rank 0] 2", "[rank 0] 9998"]
    assert captured.out.splitlines()[:2] == ["[rank 0] 1", "[rank 0] … more output: its last 3 lines appear when "
                                             "the call ends …"]
    cut = "[rank 0] " + "z" * launch.MAX_PARTIAL_LINE + " … (20000 more characters)"
    assert captured.out.splitlines()[2:] == ["[rank 0] … 9995 lines skipped …", "[rank 0] 9999", cut]


def test_large_return_value():
    a, b = labsupport.run(return_big, world_size=2)
    assert a.numel() == b.numel() == 25 * 2**20
    assert a[0].item() == 0.0 and b[-1].item() == 1.0


def test_unpicklable_return_value_is_a_clear_error():
    with pytest.raises(labsupport.WorkerError) as info:
        labsupport.run(return_unpicklable, world_size=2)
    msg = str(info.value)
    assert "cannot be sent back to the notebook" in msg and "lock" in msg.lower()
    assert info.value.exc_type == "TypeError"


# ---------------------------------------------------------------------------------------------------------------
# every call starts like a fresh process


def test_each_call_sees_the_notebooks_current_environment(monkeypatch):
    labsupport.run(rank_info, world_size=2)  # the workers exist before the variable does

    def read():
        return os.environ.get("LABSUPPORT_TEST_VARIABLE"), os.environ["RANK"]

    value = "set after the workers started"
    monkeypatch.setenv("LABSUPPORT_TEST_VARIABLE", value)
    assert labsupport.run(read, world_size=2) == [(value, "0"), (value, "1")]
    monkeypatch.delenv("LABSUPPORT_TEST_VARIABLE")
    assert labsupport.run(read, world_size=2) == [(None, "0"), (None, "1")]


def test_each_call_starts_with_fresh_random_numbers_and_defaults():
    fresh = torch.randn(3, generator=torch.Generator())  # what torch.randn(3) gives in a new process
    first = labsupport.run(draw_and_change_state, world_size=2)
    second = labsupport.run(draw_and_change_state, world_size=2)
    for x, dtype, grad in first + second:
        assert torch.equal(x, fresh)
        assert dtype == torch.float32 and grad is True


# ---------------------------------------------------------------------------------------------------------------
# failures


@pytest.mark.timing
def test_exception_names_every_failed_rank_and_points_at_the_line(monkeypatch):
    """Ranks 1 and 2 raise, ranks 0 and 3 wait for rank 1 forever.

    The launcher collects the other ranks' errors for ``_FAILURE_GRACE`` after the first; on a loaded machine rank
    2 may raise later than that. The schedule is fixed here: the grace lasts until both ranks have failed, then the
    launcher's own applies. A WorkerError (not WorkerTimeout) says the failures ended the call, not its time-out.
    """
    grace, handle = _call._FAILURE_GRACE, _call._Call._handle

    def _handle(self, rank, msg):
        handle(self, rank, msg)
        if len(self.failures) == 2:
            _call._FAILURE_GRACE = grace  # restored by monkeypatch after the test in any case

    monkeypatch.setattr(_call, "_FAILURE_GRACE", SETTLE)
    monkeypatch.setattr(_call._Call, "_handle", _handle)
    with pytest.raises(labsupport.WorkerError) as info:
        labsupport.run(raise_on, [1, 2], world_size=4, timeout=120)
    monkeypatch.undo()
    err = info.value
    assert err.rank == 1 and err.ranks == [1, 2]
    assert err.exc_type == "ValueError" and err.exc_message == "planted failure on rank 1"
    msg = str(err)
    assert "rank 1 raised ValueError: planted failure on rank 1" in msg
    assert "rank 2 raised ValueError: planted failure on rank 2" in msg
    assert 'raise exc_type(f"planted failure on rank {dist.get_rank()}")' in msg  # the user's source line
    assert "test_launch.py" in err.worker_traceback and "in raise_on" in err.worker_traceback
    assert "Ranks [0, 3] were stopped" in msg
    assert err.__cause__ is None and err.__suppress_context__  # no chained header above the error in a notebook
    assert isinstance(err.exception, ValueError) and str(err.exception) == "planted failure on rank 1"
    copy = pickle.loads(pickle.dumps(err))
    assert str(copy) == msg and copy.ranks == [1, 2] and copy.worker_traceback == err.worker_traceback
    assert labsupport.run(rank_info, world_size=4)[3]["rank"] == 3  # and the next call works


@pytest.mark.timing
@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_failure_ends_the_call_while_the_others_still_wait(world_size):
    """Rank 1 raises while every other rank waits for it forever: the error, not the call's time-out, ends the
    call (a WorkerError, not a WorkerTimeout after 120 s), and the waiting ranks are stopped. How soon it arrives is
    load-dependent: ``benchmarks/latency.py`` prints it against the 2 s the launcher aims for."""
    labsupport.run(rank_info, world_size=world_size)  # workers started
    with pytest.raises(labsupport.WorkerError) as info:
        labsupport.run(raise_on, [1], world_size=world_size, timeout=120)
    assert info.value.rank == 1 and info.value.exc_message == "planted failure on rank 1"
    others = [r for r in range(world_size) if r != 1]
    assert f"Ranks {others} were stopped" in str(info.value)


def test_system_exit_in_a_rank_is_reported():
    with pytest.raises(labsupport.WorkerError) as info:
        labsupport.run(raise_on, [0], SystemExit, world_size=2)
    assert info.value.exc_type == "SystemExit"


@pytest.mark.timing
@pytest.mark.parametrize(
    "how, expected",
    [("exit", "exited with code 3"), ("kill", "died from SIGKILL"), ("segv", "died from SIGSEGV")],
)
def test_rank_dying_without_exception(how, expected):
    """The process's exit, not the call's time-out, ends the call: a WorkerError naming how rank 1 died."""
    with pytest.raises(labsupport.WorkerError) as info:
        labsupport.run(die_with, how, world_size=3, timeout=120)
    assert info.value.rank == 1 and info.value.exc_type is None
    assert expected in str(info.value)
    assert info.value.exitcode == {"exit": 3, "kill": -signal.SIGKILL, "segv": -signal.SIGSEGV}[how]
    assert labsupport.run(rank_info, world_size=3)[1]["rank"] == 1


def test_a_native_abort_is_explained_by_what_native_code_said(capfd):
    """gloo's own words ("terminate called ... what(): ...") reach the error, not the terminal."""
    with pytest.raises(labsupport.WorkerError) as info:
        labsupport.run(mismatched_all_to_all, world_size=2, timeout=30)
    msg = str(info.value)
    assert "died from SIGABRT" in msg, msg
    assert "Is there a distributed collective mismatch in your code?" in msg, msg
    assert "enforce fail" not in msg and "/__w/" not in msg, msg   # the build machine's source path is dropped
    assert "terminate called" not in capfd.readouterr().err
    assert labsupport.run(rank_info, world_size=2)[1]["rank"] == 1


def test_errors_survive_pickling():
    """A WorkerError or WorkerTimeout may be copied to another process (a thread or process pool, a grader)."""
    failure = {"rank": 1, "type": "ValueError", "message": "bad", "traceback": "  File x", "exitcode": None}
    timeout = labsupport.WorkerTimeout("2 of 2 ranks ...", [0, 1], {0: "stack 0", 1: "stack 1"}, 2.0)
    error = labsupport.WorkerError("rank 1 raised ValueError: bad", [failure])
    for dumps in (pickle.dumps, cloudpickle.dumps):
        e = pickle.loads(dumps(error))
        assert type(e) is labsupport.WorkerError and str(e) == str(error)
        assert (e.rank, e.ranks, e.exc_type, e.exc_message) == (1, [1], "ValueError", "bad")
        assert e.worker_traceback == "  File x" and e.failures == [failure]
        t = pickle.loads(dumps(timeout))
        assert type(t) is labsupport.WorkerTimeout and str(t) == str(timeout)
        assert (t.ranks, t.stacks, t.timeout) == ([0, 1], {0: "stack 0", 1: "stack 1"}, 2.0)


def test_failure_while_initialising_the_process_group_says_so():
    payload = cloudpickle.dumps((rank_info, (), {}))
    with launch._POOL.lock, pytest.raises(labsupport.WorkerError) as info:
        _call._Call(launch._POOL, 2, "mpi", 10.0).run(payload)  # a backend this torch does not have
    assert "while initialising the process group" in str(info.value)
    assert "rank 0 raised RuntimeError" in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# deadlocks


@pytest.mark.timing
def test_deadlock_reports_where_every_rank_is_blocked(settled_timeouts):
    """The time-out fires no earlier than its value (a lower bound no load can break), and its report is taken once
    both ranks are blocked in their recv (``settled_timeouts``): the report, not a busy machine, is under test. A
    launcher that never stopped a deadlock would leave it to gloo's own time-out (60 s later), a WorkerError."""
    labsupport.run(rank_info, world_size=2)
    start = time.monotonic()
    with pytest.raises(labsupport.WorkerTimeout) as info:
        labsupport.run(recv_from_each_other, world_size=2, timeout=2)
    assert time.monotonic() - start >= 2
    err = info.value
    assert err.ranks == [0, 1]
    msg = str(err)
    # the peers as evaluated on each rank, not just the source line
    assert "rank 0: blocked in recv(src=1) of 1 float32 at " in msg
    assert "rank 1: blocked in recv(src=0) of 1 float32 at " in msg
    assert "test_launch.py, line" in msg and "dist.recv(t, src=1 - dist.get_rank())" in msg
    assert "in recv_from_each_other" in err.stacks[0]
    assert labsupport.run(rank_info, world_size=2)[0]["sum"] == 1.0


@pytest.mark.timing
def test_deadlock_of_eight_ranks_names_every_peer(settled_timeouts):
    labsupport.run(rank_info, world_size=8)
    start = time.monotonic()
    with pytest.raises(labsupport.WorkerTimeout) as info:
        labsupport.run(recv_from_the_left, world_size=8, timeout=3)
    assert time.monotonic() - start >= 3
    assert info.value.ranks == list(range(8))
    msg = str(info.value)
    for r in range(8):
        assert f"rank {r}: blocked in recv(src={(r - 1) % 8}) of 1 float32 at " in msg
        assert "in recv_from_the_left" in info.value.stacks[r]  # every dump was read whole


@pytest.mark.timing
def test_deadlock_in_wait_names_the_pending_call(settled_timeouts):
    labsupport.run(rank_info, world_size=2)
    with pytest.raises(labsupport.WorkerTimeout) as info:
        labsupport.run(wait_for_each_other, world_size=2, timeout=2)
    msg = str(info.value)
    assert "rank 0: blocked in wait() for irecv(src=1) of 2 float32 at " in msg
    assert "rank 1: blocked in wait() for batch_isend_irecv(irecv from 0) at " in msg


@pytest.mark.timing
def test_one_rank_skipping_a_collective_times_out_naming_the_blocked_rank(settled_timeouts):
    labsupport.run(rank_info, world_size=3)
    start = time.monotonic()
    with pytest.raises(labsupport.WorkerTimeout) as info:
        labsupport.run(skip_collective, world_size=3, timeout=2)
    assert time.monotonic() - start >= 2
    err = info.value
    assert 0 not in err.ranks and set(err.ranks) == {1, 2}
    msg = str(err)
    assert "ranks [0] had finished" in msg
    for r in (1, 2):
        assert f"rank {r}: blocked in all_reduce of 4 float32 at " in msg


@pytest.mark.timing
def test_mismatched_collectives_show_each_ranks_collective(settled_timeouts):
    labsupport.run(rank_info, world_size=2)
    start = time.monotonic()
    with pytest.raises(labsupport.WorkerTimeout) as info:
        labsupport.run(mismatched_collectives, world_size=2, timeout=2)
    assert time.monotonic() - start >= 2
    msg = str(info.value)
    assert "rank 0: blocked in all_reduce of 4 float32 at " in msg
    assert "rank 1: blocked in broadcast(src=1) of 4 float32 at " in msg


@pytest.mark.timing
def test_busy_loop_is_stopped_at_the_timeout(monkeypatch, tmp_path):
    """Ranks that never block are stopped too. The report is taken once both ranks are in their loop (each leaves
    a file as it enters it), not while a loaded machine still starts them."""
    import patience

    cpu_at_entry = {}

    def looping(w) -> bool:
        """Past its file, and spending CPU since: in the loop itself."""
        if not (tmp_path / f"looping-{w.index}").exists():
            return False
        cpu = sum(psutil.Process(w.process.pid).cpu_times()[:2])
        return cpu - cpu_at_entry.setdefault(w.index, cpu) > 0.05

    patience.install(monkeypatch.setattr, settled=looping)
    labsupport.run(rank_info, world_size=2)
    start = time.monotonic()
    with pytest.raises(labsupport.WorkerTimeout) as info:
        labsupport.run(busy_loop_forever, str(tmp_path), world_size=2, timeout=1)
    assert time.monotonic() - start >= 1
    # the stack is sampled wherever the loop is: on its "while True" line or on its "pass" line
    report = str(info.value)
    assert "rank 0: at " in report and ("while True" in report or ": pass" in report), report


# ---------------------------------------------------------------------------------------------------------------
# the call board


def test_call_board_describes_each_call_with_its_values():
    t, big = torch.zeros(4), torch.zeros(8)
    cases = {
        "send": ((t, 3), {}, "send(dst=3) of 4 float32"),
        "recv": ((t,), {"src": 1}, "recv(src=1) of 4 float32"),
        "isend": ((t,), {"group_dst": 2}, "isend(group_dst=2) of 4 float32"),
        "irecv": ((t,), {}, "irecv(src=any) of 4 float32"),
        "broadcast": ((t,), {"src": 0}, "broadcast(src=0) of 4 float32"),
        "reduce": ((t, 0), {"op": dist.ReduceOp.MIN}, "reduce(dst=0, op=MIN) of 4 float32"),
        "gather": ((t, None, 2), {}, "gather(dst=2) of 4 float32"),
        "scatter": ((t,), {"scatter_list": None, "src": 1}, "scatter(src=1) of 4 float32"),
        "all_reduce": ((t, dist.ReduceOp.MAX), {}, "all_reduce(op=MAX) of 4 float32"),
        "all_gather": (([t, t], t), {}, "all_gather of 4 float32"),
        "all_gather_into_tensor": ((big, t), {}, "all_gather_into_tensor of 4 float32"),
        "reduce_scatter": ((t, [t, t]), {}, "reduce_scatter of 2 x 4 float32"),
        "reduce_scatter_tensor": ((t,), {"input": big}, "reduce_scatter_tensor of 8 float32"),
        "all_to_all": (([t, t], [t, t]), {}, "all_to_all of 2 x 4 float32"),
        "all_to_all_single": ((big, big.long()), {}, "all_to_all_single of 8 int64"),
        "barrier": ((), {}, "barrier"),
    }
    assert set(cases) | {"batch_isend_irecv"} == set(_callboard._CALLS)
    for name, (args, kwargs, expected) in cases.items():
        assert _callboard._describe(name, args, kwargs) == expected
    assert _callboard._describe("all_reduce", (t,), {"op": dist.ReduceOp.SUM}) == "all_reduce of 4 float32"


def test_call_board_keeps_comm_counter_and_p2pop_working():
    results = labsupport.run(comm_through_the_board, world_size=2)
    for wrapped, sends, recvs, all_reduces, board in results:
        assert wrapped  # in torch.distributed and in distributed_c10d, the same wrapper
        assert (sends, recvs, all_reduces) == (2, 2, 1)  # CommCounter sees each call once
        assert board == b"\0\0\0\0"  # cleared once the calls returned


def test_call_board_can_be_read_from_the_notebook(tmp_path):
    path = tmp_path / "board"
    _board.new_board(str(path))
    assert path.stat().st_size == _board.BOARD_SIZE
    board = _board.Board(str(path))
    assert _board.read_board(str(path)) == ""
    board.post("recv(src=1) of 4 float32")
    assert _board.read_board(str(path)) == "recv(src=1) of 4 float32"
    board.post("é" * 2000)  # longer than the board: cut, still readable
    assert _board.read_board(str(path)).startswith("éé")
    board.clear()
    assert _board.read_board(str(path)) == ""
    assert _board.board_answered(str(path))  # asked, and in no call: not the same as never asked
    _board.new_board(str(path))
    assert not _board.board_answered(str(path))


def test_a_stack_dump_read_too_early_is_not_taken_for_whole():
    from labsupport._frames import dump_complete as _dump_complete

    dump = (
        "Thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n'
        "\n"
        "Current thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/torch/distributed/distributed_c10d.py", line 2799 in recv\n'
        '  File "/home/student/ring.py", line 12 in ring\n'
        '  File "<string>", line 1 in <module>\n'
    )
    assert _dump_complete(dump, 0x7F0000000001)
    assert not _dump_complete(dump.rsplit("  File", 1)[0], 0x7F0000000001)  # the outer frames are still missing
    assert not _dump_complete("", 0x7F0000000001)


def test_a_one_thread_dump_is_read_as_the_main_threads():
    from labsupport._frames import dump_complete as _dump_complete, parse_faulthandler

    dump = (
        "Stack (most recent call first):\n"
        '  File "/torch/distributed/distributed_c10d.py", line 2799 in recv\n'
        '  File "/home/student/ring.py", line 12 in ring\n'
        '  File "<string>", line 1 in <module>\n'
    )
    assert _dump_complete(dump, 0x7F0000000001)
    assert [f[2] for f in parse_faulthandler(dump, 0x7F0000000001)] == ["<module>", "ring", "recv"]
    assert not _dump_complete(dump.rsplit("  File", 1)[0], 0x7F0000000001)
    # a dump appended after a second signal: the first one counts
    assert [f[2] for f in parse_faulthandler(dump + dump.replace("ring", "other"), 1)] == ["<module>", "ring", "recv"]
    # deeper than faulthandler writes, or no Python frame: whole as it is
    assert _dump_complete("Stack (most recent call first):\n" + '  File "a.py", line 1 in f\n' * 3 + "  ...\n", 1)
    assert _dump_complete("Stack (most recent call first):\n  <no Python frame>\n", 1)


def test_a_dump_of_a_thread_that_threading_started_gives_no_frames():
    """Were the signal taken by a thread of the worker's other than the main one, its frames are not the rank's."""
    from labsupport._frames import parse_faulthandler

    reader = (
        "Stack (most recent call first):\n"
        '  File "/labsupport/_worker.py", line 150 in _reader\n'
        '  File "/usr/lib/python3.11/threading.py", line 975 in run\n'
        '  File "/usr/lib/python3.11/threading.py", line 1038 in _bootstrap_inner\n'
        '  File "/usr/lib/python3.11/threading.py", line 995 in _bootstrap\n'
    )
    assert parse_faulthandler(reader, 0x7F0000000001) == []
    assert parse_faulthandler(reader.replace("Stack (most recent call first)", "Thread 0x00007f0000000001"),
                              0x7F0000000001) == []


def _own_stack_dump():
    """A rank signals itself as a deadlock report would, and returns what its stack file received."""
    path = _worker._STACK_FILE[0]
    open(path, "w").close()
    os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs before kill returns
    with open(path) as fh:
        return fh.read()


def test_a_ranks_stack_dump_is_its_main_thread_alone_and_whole():
    """The dump a deadlock report reads holds the main thread only (not the reader thread that answers the call
    board, which a dump of every thread writes first) and reaches its outermost frame: a writer paused part way
    can never leave another thread's frames where the rank's should be."""
    from labsupport._frames import dump_complete as _dump_complete, parse_faulthandler

    for rank, text in enumerate(labsupport.run(_own_stack_dump, world_size=2)):
        assert text.startswith("Stack (most recent call first):"), text
        assert "Thread 0x" not in text and "threading.py" not in text, text
        ident = [w.main_ident for w in launch._POOL.workers.values() if w.index == rank][0]
        assert _dump_complete(text, ident)
        assert "_own_stack_dump" in [f[2] for f in parse_faulthandler(text, ident)]

# ---------------------------------------------------------------------------------------------------------------
# interrupts at awkward moments


def test_task_arriving_while_an_earlier_group_is_still_initialised(monkeypatch):
    """A lost "finish" (an interrupt just after the results came) must not break the next call."""

    def leftovers():
        return dist.get_rank(), _worker.LEFTOVER_GROUPS

    monkeypatch.setattr(_call._Call, "_send_finish", lambda self, workers: None)
    before = labsupport.run(leftovers, world_size=2)  # its process groups are never destroyed
    monkeypatch.undo()
    after = labsupport.run(leftovers, world_size=2)
    assert [(r, n + 1) for r, n in before] == after


def test_interrupt_after_the_results_leaves_no_process_group(monkeypatch):
    def interrupted(self):
        raise KeyboardInterrupt

    labsupport.run(rank_info, world_size=2)
    pids = sorted(w.process.pid for w in launch._POOL.workers.values())
    monkeypatch.setattr(_call._Call, "_flush_output", interrupted)
    with pytest.raises(KeyboardInterrupt):
        labsupport.run(rank_info, world_size=2)
    monkeypatch.undo()
    # every worker had its "finish": they live on, and the fixture checks none of them kept its group
    assert sorted(w.process.pid for w in launch._POOL.workers.values()) == pids


def test_interrupt_while_sending_finish_replaces_the_workers(monkeypatch):
    def interrupted(self, workers):
        raise KeyboardInterrupt

    def ranks():  # the pool's workers of a 2-rank call (an earlier test may have left workers 2, 3...)
        return {w.process.pid for i, w in launch._POOL.workers.items() if i < 2}

    labsupport.run(rank_info, world_size=2)
    pids = ranks()
    monkeypatch.setattr(_call._Call, "_send_finish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        labsupport.run(rank_info, world_size=2)
    monkeypatch.undo()
    assert not pids & ranks()
    assert labsupport.run(rank_info, world_size=2)[1]["sum"] == 1.0


def test_interrupt_while_workers_start_leaves_no_unready_worker(monkeypatch):
    with launch._POOL.lock:
        launch._POOL.kill(list(launch._POOL.workers.values()))  # the next call must start workers

    def interrupted(self, starting):
        raise KeyboardInterrupt

    monkeypatch.setattr(_pool._Pool, "_await_hello", interrupted)
    with pytest.raises(KeyboardInterrupt):
        labsupport.run(rank_info, world_size=2)
    monkeypatch.undo()
    assert launch._POOL.workers == {}
    assert labsupport.run(rank_info, world_size=2)[1]["rank"] == 1


# ---------------------------------------------------------------------------------------------------------------
# bad input


def test_bad_arguments_are_explained():
    with pytest.raises(TypeError, match="needs a function"):
        labsupport.run(42)
    with pytest.raises(ValueError, match="world_size must be between 1 and"):
        labsupport.run(rank_info, world_size=0)
    with pytest.raises(TypeError, match="world_size must be an int"):
        labsupport.run(rank_info, world_size=2.0)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        labsupport.run(rank_info, world_size=2, timeout=0)
    with pytest.raises(ValueError, match="backend must be 'auto', 'gloo' or 'nccl'"):
        labsupport.run(rank_info, world_size=2, backend="mpi")


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has GPUs")
def test_nccl_without_gpus_fails_before_starting_anything():
    before = {p.pid for p in _children()}
    with pytest.raises(ValueError, match="needs one GPU per rank: world_size=2, but this machine has"):
        labsupport.run(rank_info, world_size=2, backend="nccl")
    assert {p.pid for p in _children()} <= before


def test_unpicklable_argument_is_explained():
    import threading

    with pytest.raises(TypeError, match="could not send"):
        labsupport.run(rank_info, threading.Lock(), world_size=2)


# ---------------------------------------------------------------------------------------------------------------
# choosing the backend without touching CUDA


def _no_driver(*args):
    raise AssertionError("the notebook asked the CUDA driver: that initialises CUDA in the kernel")


def _no_subprocess(*args, **kwargs):
    raise AssertionError("no separate process was needed")


@pytest.fixture
def pretend_cuda_build(monkeypatch):
    """A torch built with CUDA whose driver must not be touched in the notebook."""
    monkeypatch.setattr(_env, "_GPU_COUNTS", {})
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", _no_driver, raising=False)
    monkeypatch.setattr(_env.subprocess, "run", _no_subprocess)
    return monkeypatch


def test_gpu_count_uses_nvml_and_never_the_driver(pretend_cuda_build):
    pretend_cuda_build.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    assert _env._gpu_count() == 2
    assert _env._resolve_backend("auto", 2) == "nccl"
    assert _env._resolve_backend("auto", 4) == "gloo"
    with pytest.raises(ValueError, match="world_size=4, but this machine has 2 GPU"):
        _env._resolve_backend("nccl", 4)


def test_gpu_count_asks_a_separate_process_when_nvml_cannot_tell(pretend_cuda_build):
    asked = []

    def fake_run(cmd, **kwargs):
        asked.append((cmd, os.environ.get("CUDA_VISIBLE_DEVICES")))
        assert kwargs.get("timeout"), "the separate process must have a time limit"
        return subprocess.CompletedProcess(cmd, 0, stdout="3\n", stderr="")

    pretend_cuda_build.setattr(torch.cuda, "_device_count_nvml", lambda: -1)
    pretend_cuda_build.setattr(_env.subprocess, "run", fake_run)
    pretend_cuda_build.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _env._gpu_count() == 3 and _env._gpu_count() == 3
    assert len(asked) == 1 and "torch.cuda.device_count()" in asked[0][0][-1]  # asked once, then remembered
    assert _env._resolve_backend("auto", 2) == "nccl"
    pretend_cuda_build.setenv("CUDA_VISIBLE_DEVICES", "0")  # another set of GPUs: ask again
    _env._gpu_count()
    assert [env for _, env in asked] == [None, "0"]


def test_gpu_count_without_cuda_build_or_with_cuda_in_use(pretend_cuda_build):
    pretend_cuda_build.setattr(torch.cuda, "_device_count_nvml", _no_driver)
    pretend_cuda_build.setattr(torch.cuda, "_is_compiled", lambda: False)
    assert _env._gpu_count() == 0
    pretend_cuda_build.setattr(torch.cuda, "_is_compiled", lambda: True)
    pretend_cuda_build.setattr(torch.cuda, "is_initialized", lambda: True)  # the notebook already uses CUDA
    pretend_cuda_build.setattr(torch.cuda, "device_count", lambda: 5)
    assert _env._gpu_count() == 5


def test_choosing_the_backend_never_initialises_cuda_in_the_notebook():
    labsupport.run(rank_info, world_size=2, backend="auto")
    assert not torch.cuda.is_initialized()


# ---------------------------------------------------------------------------------------------------------------
# %%distributed


def test_magic_passes_the_backend_on(monkeypatch, capsys):
    monkeypatch.setattr(_env, "_gpu_count", lambda: 8)  # "auto" would now choose NCCL
    magics.distributed("-n 2 --backend gloo", "print(dist.get_backend(), rank, world_size)", {"dist": dist})
    out = capsys.readouterr().out
    assert "[rank 0] gloo 0 2" in out and "[rank 1] gloo 1 2" in out


def test_magic_explains_a_name_it_could_not_send():
    import threading

    with pytest.raises(labsupport.WorkerError) as info:
        magics.distributed("-n 2", "with lock:\n    pass", {"lock": threading.Lock()})
    err = info.value
    assert err.exc_type == "NameError"
    assert "the notebook has 'lock', but it could not be sent to the workers (TypeError: " in err.exc_message


def test_magic_line_numbers_are_those_of_the_notebook_cell():
    with pytest.raises(labsupport.WorkerError) as info:
        magics.distributed("-n 2", "x = 1\nraise KeyError(rank)\n", {})
    # line 1 of a %%distributed cell is the %%distributed line itself
    assert ", line 3, in <module>" in info.value.worker_traceback
    assert "raise KeyError(rank)" in info.value.worker_traceback


# ---------------------------------------------------------------------------------------------------------------
# what is left behind


def test_shutdown_leaves_no_process_port_or_file():
    labsupport.run(rank_info, world_size=3)
    port = launch._POOL.store.port
    tmpdir = launch._POOL.tmpdir
    assert os.path.isdir(tmpdir)
    assert os.path.basename(tmpdir).startswith(f"labsupport-{os.getpid()}-")  # its owner, for a later clean-up
    labsupport.shutdown()
    psutil.wait_procs(_children(), timeout=SETTLE)  # returns as soon as they are gone
    assert [p for p in _children() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert not os.path.exists(tmpdir)
    with socket.socket() as s:  # the rendezvous port is free again
        s.bind(("127.0.0.1", port))
    assert labsupport.run(rank_info, world_size=2)[1]["rank"] == 1  # and everything starts again


def test_folder_of_a_dead_kernel_is_removed_by_the_next_pool():
    gone = subprocess.Popen(["true"])
    gone.wait()
    base = tempfile.gettempdir()
    stale = tempfile.mkdtemp(prefix=f"labsupport-{gone.pid}-", dir=base)
    alive = tempfile.mkdtemp(prefix=f"labsupport-{os.getppid()}-", dir=base)  # its kernel still runs
    mine = None
    try:
        mine = _pool._make_tmpdir()  # what a pool does when it starts
        assert os.path.basename(mine).startswith(f"labsupport-{os.getpid()}-")
        assert not os.path.exists(stale)
        assert os.path.isdir(alive)
    finally:
        for path in (stale, alive, mine):
            if path:
                shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("written, quoted", [
    ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
     "  what():  [enforce fail at /__w/x/pair.cc:456] a <= b. 8 vs 0. Is there a mismatch?\n", "a <= b. 8 vs 0. Is there a mismatch?"),
    ("terminate called after throwing an instance of 'c10::Error'\n  what():  \nthe reason\n", "the reason"),
    ("Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n", "Fatal Python error: Aborted"),
    ("free(): invalid pointer\n", "free(): invalid pointer"),
    ("double free or corruption (out)\n", "double free or corruption (out)"),
    ("*** stack smashing detected ***: terminated\n", "*** stack smashing detected ***: terminated"),
    ("python3: ring.c:7: step: Assertion `n > 0' failed.\n", "python3: ring.c:7: step: Assertion `n > 0' failed."),
    ("F1202 05:31:53.123456  4242 logger.cpp:99] Check failed: started\n*** Check failure stack trace: ***\n",
     "Check failed: started"),
    ("[W1125 pg.cpp:12] Warning: a warning of an earlier moment\n", None),
    ("", None),
])
def test_native_error_quotes_only_what_ended_the_process(written, quoted, tmp_path):
    from labsupport._native import native_error, native_log

    stack = str(tmp_path / "stack-1.txt")
    Path(native_log(stack)).write_text(written)
    assert native_error(stack) == quoted
    assert native_error(str(tmp_path / "stack-9.txt")) is None   # no file: nothing to quote
