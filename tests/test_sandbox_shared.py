"""labsupport._sandbox, what notebook 09's checks need of it: groups that leave ranks out.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import labsupport
from labsupport._sandbox import sandboxed

pytestmark = pytest.mark.slow


def call(fn, *args):
    return fn(*args)


def in_pairs(value):
    """Two groups of two on four ranks: each rank's sandbox makes both, but belongs to one."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    x = torch.tensor([float(value + dist.get_rank())])
    dist.all_reduce(x, group=pairs[dist.get_rank() // 2])
    return x.item()


def test_groups_that_leave_ranks_out_reach_the_host():
    assert labsupport.run(call, sandboxed(in_pairs), 10, world_size=4, timeout=60) == [21.0, 21.0, 25.0, 25.0]
