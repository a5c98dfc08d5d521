"""labsupport._relay: DTensor in a grading sandbox. Its device mesh, its sharding and its redistributions end in
the relay's process group like every other call, so the host carries and records them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import labsupport
from labsupport._sandbox import sandboxed
from labsupport.comm import CommCounter

pytestmark = pytest.mark.slow


def uses_dtensor(_):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    full = torch.arange(4.0 * n * 3).reshape(4 * n, 3)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    local = sharded.to_local().clone()
    whole = sharded.redistribute(mesh, [Replicate()]).to_local()
    total = (sharded * 2).sum().full_tensor()
    return local, whole, total


def recorded(fn):
    with CommCounter() as cc:
        out = fn(None)
    return out, [c.kind for c in cc.summary.calls]


def test_dtensor_runs_in_the_sandbox_and_its_messages_cross_through_the_host():
    n = 2
    full = torch.arange(4.0 * n * 3).reshape(4 * n, 3)
    for r, ((local, whole, total), kinds) in enumerate(
            labsupport.run(recorded, sandboxed(uses_dtensor, "uses_dtensor"), world_size=n, timeout=120)):
        torch.testing.assert_close(local, full.chunk(n)[r])
        torch.testing.assert_close(whole, full)
        assert float(total) == float(2 * full.sum())
        # what the host did for the sandbox: distribute_tensor scatters, Replicate gathers, the sum reduces
        assert kinds == ["scatter", "all_gather", "all_reduce"], kinds
