"""CommCounter sees every torch.distributed call, however it was written."""

import torch
import torch.distributed as dist
from torch.distributed import isend as imported_isend  # a name imported before the counter exists

import labsupport
from labsupport.comm import CommCounter


def point_to_point():
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    t = torch.ones(10)  # 40 bytes
    with CommCounter() as cc:
        if rank == 0:
            dist.send(t, 1)
            imported_isend(t, 1).wait()
            dist.isend(t[:5], 1).wait()
        else:
            dist.recv(t, 0)
            dist.irecv(t, 0).wait()
            dist.recv(t[:5], src=0)
        ops = [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, torch.empty(10), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return cc.summary


def test_point_to_point_calls_with_peers_and_bytes():
    s0, s1 = labsupport.run(point_to_point, world_size=2)
    assert [(c.kind, c.peer, c.nbytes) for c in s0.calls] == [
        ("send", 1, 40), ("send", 1, 40), ("send", 1, 20), ("send", 1, 40), ("recv", 1, 40)
    ]
    assert s0.messages_sent == 4 and s0.bytes_sent == 140 and s0.bytes_received == 40
    assert s1.count("recv") == 4 and s1.bytes_received == 140 and s1.bytes_sent == 40
    assert s0.peers == {1} and s1.peers == {0}
    assert s0.kinds == {"send", "recv"} and s0.collectives == []
    assert all(c.group == (0, 1) for c in s0.calls)


def collectives():
    n, rank = dist.get_world_size(), dist.get_rank()
    t = torch.ones(4)
    with CommCounter() as cc:
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        dist.broadcast(t, src=0)
        dist.reduce(t, dst=0)
        dist.all_gather([torch.empty(4) for _ in range(n)], t)
        dist.all_gather_into_tensor(torch.empty(4 * n), t)
        dist.gather(t, [torch.empty(4) for _ in range(n)] if rank == 0 else None, dst=0)
        dist.scatter(t, [torch.ones(4) for _ in range(n)] if rank == 0 else None, src=0)
        dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * n))
        dist.all_to_all_single(torch.empty(4 * n), torch.ones(4 * n))
        dist.barrier()
    return cc.summary


def test_every_collective_is_seen_sync_and_async():
    for s in labsupport.run(collectives, world_size=2):
        kinds = [c.kind for c in s.calls]
        assert kinds[:2] == ["all_reduce", "all_reduce"]
        for kind in ("broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter",
                     "reduce_scatter_tensor", "all_to_all_single", "barrier"):
            assert kind in kinds, (kind, kinds)
        assert s.calls[0].nbytes == 16 and s.calls[0].peer is None
        assert s.kinds.isdisjoint({"send", "recv"}) and len(s.collectives) == len(s.calls)


def nested_and_outside():
    t = torch.ones(2)
    dist.all_reduce(t)  # before any counter: not recorded anywhere
    with CommCounter() as outer:
        dist.all_reduce(t)
        with CommCounter() as inner:
            dist.broadcast(t, 0)
    dist.all_reduce(t)  # after: not recorded
    return [c.kind for c in outer.calls], [c.kind for c in inner.calls], repr(inner)


def test_counters_nest_and_stop_at_exit():
    outer, inner, text = labsupport.run(nested_and_outside, world_size=2)[0]
    assert outer == ["all_reduce", "broadcast"]
    assert inner == ["broadcast"]
    assert text.startswith("CommCounter(rank=0, calls=1") and "collectives=['broadcast']" in text


def subgroup():
    group = dist.new_group([1, 2])
    t = torch.ones(3)
    with CommCounter() as cc:
        if dist.get_rank() == 1:
            dist.send(t, dst=2, group=group)
        elif dist.get_rank() == 2:
            dist.recv(t, src=1, group=group)
    return cc.as_dict()


def test_peers_are_global_ranks_in_a_subgroup():
    d = labsupport.run(subgroup, world_size=3)
    assert d[0]["calls"] == []
    assert d[1]["calls"] == [{"kind": "send", "peer": 2, "group": (1, 2), "nbytes": 12}]
    assert d[2]["bytes_received"] == 12 and d[2]["calls"][0]["peer"] == 1


def async_and_list_forms():
    n, rank = dist.get_world_size(), dist.get_rank()
    t = torch.ones(4)
    with CommCounter() as cc:
        works = [
            dist.broadcast(t, src=0, async_op=True),
            dist.reduce(t, dst=0, async_op=True),
            dist.all_gather([torch.empty(4) for _ in range(n)], t, async_op=True),
            dist.all_gather_into_tensor(torch.empty(4 * n), t, async_op=True),
            dist.gather(t, [torch.empty(4) for _ in range(n)] if rank == 0 else None, dst=0, async_op=True),
            dist.scatter(t, [torch.ones(4) for _ in range(n)] if rank == 0 else None, src=0, async_op=True),
            dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * n), async_op=True),
            dist.all_to_all_single(torch.empty(4 * n), torch.ones(4 * n), async_op=True),
            dist.barrier(async_op=True),
        ]
        for work in works:
            work.wait()
        dist.all_to_all([torch.empty(4) for _ in range(n)], [torch.ones(4) for _ in range(n)])
        # object collectives are built on tensor collectives: they show up as those
        objects = [{"rank": rank}]
        dist.broadcast_object_list(objects, src=0)
    return cc.summary


def test_async_list_and_object_forms_are_seen():
    for s in labsupport.run(async_and_list_forms, world_size=2):
        kinds = [c.kind for c in s.calls]
        assert kinds[:9] == ["broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter",
                             "reduce_scatter_tensor", "all_to_all_single", "barrier"], kinds
        assert "all_to_all" in kinds[9:], kinds
        assert kinds.count("broadcast") >= 2, kinds  # broadcast_object_list: sizes, then the pickled bytes
        # nbytes is this rank's data: the 4 floats of t, also where the output is larger (gather, all-gather)
        by_kind = {c.kind: c.nbytes for c in s.calls[:9]}
        assert by_kind == {"broadcast": 16, "reduce": 16, "all_gather": 16, "all_gather_into_tensor": 16,
                           "gather": 16, "scatter": 32 if s.rank == 0 else 0, "reduce_scatter_tensor": 32,
                           "all_to_all_single": 32, "barrier": 0}, by_kind
        assert s.kinds.isdisjoint({"send", "recv"})


def from_any_source():
    rank = dist.get_rank()
    t = torch.zeros(3)
    with CommCounter() as cc:
        if rank == 0:
            sender = dist.recv(t, src=None)  # whoever sends first
            dist.irecv(t).wait()             # no src: any source, asynchronously
        else:
            dist.send(torch.full((3,), 1.0), dst=0)
            dist.send(torch.full((3,), 2.0), dst=0)
            sender = None
    return sender, [(c.kind, c.peer, c.nbytes) for c in cc.calls]


def test_receive_from_any_source_has_no_peer():
    (sender, calls0), (_, calls1) = labsupport.run(from_any_source, world_size=2)
    assert sender == 1
    assert calls0 == [("recv", None, 12), ("recv", None, 12)]
    assert calls1 == [("send", 0, 12), ("send", 0, 12)]
