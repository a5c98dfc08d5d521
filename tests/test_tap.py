"""labsupport.tap: one tap on torch.distributed sees the calls of FSDP2, DTensor tensor parallelism, hand-written
collectives, functional collectives and backend objects, as torch's own CommDebugMode counts them."""

import warnings

import torch
import torch.distributed as dist

import labsupport
from labsupport import CommCounter, tap
from labsupport.comm import CommSummary


def _kinds_of_debug_mode(counts: dict) -> dict:
    """CommDebugMode's counts ({op: n}) by the torch.distributed name CommCounter uses."""
    names = {
        "_allgather_base_": "all_gather_into_tensor", "allgather_into_tensor_coalesced_": "all_gather_into_tensor",
        "_reduce_scatter_base_": "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor",
        "allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather_into_tensor",
        "reduce_scatter_tensor": "reduce_scatter_tensor", "all_to_all_single": "all_to_all_single",
        "broadcast_": "broadcast", "broadcast": "broadcast",
    }
    out: dict = {}
    for op, n in counts.items():
        kind = names[str(op).rpartition(".")[2]]
        out[kind] = out.get(kind, 0) + n
    return out


def _by_kind(calls) -> dict:
    out: dict = {}
    for c in calls:
        out[c.kind] = out.get(c.kind, 0) + 1
    return out


def fully_shard_step():
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    warnings.simplefilter("ignore")

    def step(model, opt):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

    seen = []
    for recorder in (CommCounter, CommDebugMode):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with recorder() as rec:
            step(model, opt)
        seen.append(rec)
    cc, debug = seen
    return _by_kind(cc.calls), _kinds_of_debug_mode(debug.get_comm_counts()), [(c.nbytes, c.group) for c in cc.calls]


def test_fully_shard_step_is_counted_as_comm_debug_mode_counts_it():
    for counted, debug, details in labsupport.run(fully_shard_step, world_size=2, timeout=120):
        assert counted == debug == {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 2}, (counted, debug)
        assert all(group == (0, 1) and nbytes > 0 for nbytes, group in details)


def tensor_parallel_mlp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    mlp = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 8, requires_grad=True)
    with CommCounter() as cc:
        mlp(x).sum().backward()
    with CommDebugMode() as debug:
        mlp(x).sum().backward()
    return [(c.kind, c.peer, c.group, c.nbytes) for c in cc.calls], _kinds_of_debug_mode(debug.get_comm_counts())


def test_parallelize_module_forward_and_backward_are_counted():
    for calls, debug in labsupport.run(tensor_parallel_mlp, world_size=2, timeout=120):
        assert debug == {"all_reduce": 2}
        # forward: RowwiseParallel's partial sums of the output (4 x 8); backward: ColwiseParallel's input gradient
        assert calls == [("all_reduce", None, (0, 1), 4 * 8 * 4)] * 2


def ring_all_reduce(t):
    """A from-scratch all-reduce of a tensor with one element per rank: send/recv only."""
    rank, n = dist.get_rank(), dist.get_world_size()
    total = t.clone()
    buf = t.clone()
    recv = torch.empty_like(t)
    for _ in range(n - 1):
        req = dist.isend(buf, (rank + 1) % n)
        dist.recv(recv, (rank - 1) % n)
        req.wait()
        total += recv
        buf = recv.clone()
    return total


def cheating_all_reduce(t):
    """A "from-scratch" all-reduce that calls a functional collective: a built-in all the same."""
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(t, "sum", dist.group.WORLD)


def hand_written():
    from autograder.checks._common import only_point_to_point

    out = []
    for fn in (ring_all_reduce, cheating_all_reduce):
        with CommCounter() as cc:
            result = fn(torch.full((3,), float(dist.get_rank() + 1)))
        try:
            only_point_to_point(cc.summary, fn.__name__)
            verdict = "accepted"
        except AssertionError as exc:
            verdict = str(exc)
        out.append((result.tolist(), sorted(cc.kinds), cc.peers, verdict))
    return out


def test_hand_written_collectives_are_point_to_point_and_a_functional_one_is_not():
    for rank, (ring, cheat) in enumerate(labsupport.run(hand_written, world_size=3)):
        assert ring == ([6.0] * 3, ["recv", "send"], {(rank + 1) % 3, (rank - 1) % 3}, "accepted")
        assert cheat[0] == [6.0] * 3 and cheat[1] == ["all_reduce"]
        assert "called torch.distributed.all_reduce" in cheat[3]


def functional_and_backend():
    import torch.distributed._functional_collectives as funcol

    rank = dist.get_rank()
    group_name = dist.group.WORLD.group_name
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    with CommCounter() as cc:
        a = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
        b = funcol.all_to_all_single(torch.arange(4.0) + 10 * rank, [2, 2], [2, 2], dist.group.WORLD)
        c = torch.ops._c10d_functional.all_reduce(torch.ones(2, dtype=torch.float64), "sum", group_name)
        c = torch.ops._c10d_functional.wait_tensor(c)
        d = torch.ones(5)
        backend.allreduce([d]).wait()
        e = torch.full((3,), float(rank))
        if rank == 0:
            backend.send([e], 1, 0).wait()
        else:
            backend.recv([e], 0, 0).wait()
    calls = [(c.kind, c.peer, c.group, c.nbytes) for c in cc.calls]
    return calls, a.tolist(), b.tolist(), c.tolist(), d.tolist(), e.tolist()


def test_functional_collectives_and_backend_objects_are_recorded():
    (calls0, *values0), (calls1, *values1) = labsupport.run(functional_and_backend, world_size=2)
    assert calls0 == [("all_reduce", None, (0, 1), 16), ("all_to_all_single", None, (0, 1), 16),
                      ("all_reduce", None, (0, 1), 16), ("all_reduce", None, (0, 1), 20), ("send", 1, (0, 1), 12)]
    assert calls1[-1] == ("recv", 0, (0, 1), 12) and calls1[:-1] == calls0[:-1]
    assert values0 == [[2.0] * 4, [0.0, 1.0, 10.0, 11.0], [2.0, 2.0], [2.0] * 5, [0.0] * 3]
    assert values1[-1] == [0.0] * 3 and values1[1] == [2.0, 3.0, 12.0, 13.0]


class _Stopper:
    """An observer that refuses every all-reduce before it goes out, and sees every call leave."""

    def __init__(self):
        self.left = []

    def enter(self, call):
        if call.is_comm and not call.in_comm and call.kind == "all_reduce":
            raise AssertionError("no all_reduce here")

    def exit(self, call):
        self.left.append((call.level, call.name))


def observer_stops_a_call():
    stopper = _Stopper()
    tap.subscribe(stopper)
    try:
        dist.all_reduce(torch.ones(1))
        stopped = False
    except AssertionError:
        stopped = True
    finally:
        tap.unsubscribe(stopper)
    dist.all_reduce(torch.ones(1))  # after unsubscribing: goes through
    return stopped, stopper.left, tap.current() is None


def test_an_observer_can_stop_a_call_before_it_goes_out():
    for stopped, left, idle in labsupport.run(observer_stops_a_call, world_size=2):
        assert stopped and idle
        # the refused process-group call never went out; the dist.all_reduce around it left with its exception
        assert left == [("api", "all_reduce")]


def test_describing_calls_outside_any_worker_needs_no_process_group():
    call = tap.Call("api", "all_reduce", (torch.ones(2),), {}, None, None)
    assert (call.kind, call.peer, call.group, call.nbytes, call.is_comm) == ("all_reduce", None, (), 0, False)
    inner = tap.Call("pg", "allreduce", ([torch.ones(2)],), {}, None, call)
    assert inner.is_comm and not inner.in_comm and inner.nbytes == 8
    innermost = tap.Call("wait", "wait", (), {}, None, inner)
    assert innermost.in_comm and isinstance(CommSummary(rank=0).calls, list)


class _Seen:
    def __init__(self, nested):
        self.nested, self.calls = nested, []

    def enter(self, call):
        self.calls.append((call.level, call.name, call.outer is None, call.in_comm))

    def exit(self, call):
        pass


def outermost_and_nested():
    outer_only, everything = _Seen(nested=False), _Seen(nested=True)
    for obs in (outer_only, everything):
        tap.subscribe(obs)
    try:
        dist.all_reduce(torch.ones(2))
    finally:
        for obs in (outer_only, everything):
            tap.unsubscribe(obs)
    return outer_only.calls, everything.calls


def test_observers_of_outermost_calls_only_skip_the_nested_ones():
    for outer_only, everything in labsupport.run(outermost_and_nested, world_size=2):
        assert outer_only == [("api", "all_reduce", True, False)]
        # dist.all_reduce calls the process group, then waits on the Work it returned: both inside the API call
        assert everything == [("api", "all_reduce", True, False), ("pg", "allreduce", False, False),
                              ("wait", "wait", False, False)]
