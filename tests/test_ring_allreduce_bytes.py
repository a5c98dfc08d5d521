"""Notebook 02's introduction: a ring that passes the whole tensor round sends N/2 times the bytes of the real ring.

The number is computed here twice, from the course's own byte counting: ``CommCounter`` on real workers running
the whole-tensor ring (as in PyTorch's distributed tutorial) and the reference ring, and the simulator's schedules
for 4 and 64 ranks, the examples the text gives.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import labsupport
from autograder.checks.ring_allreduce import reference_ring_all_reduce
from labsupport.lessons.ring_allreduce import netsim

NOTEBOOK = Path(__file__).resolve().parent.parent / "solutions/02_ring_allreduce/02_ring_allreduce.ipynb"


def whole_tensor_ring(tensor):
    """N-1 steps; in each, the whole tensor received in the previous step goes on to the right and is added in."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    passing, incoming, total = tensor.clone(), torch.empty_like(tensor), tensor.clone()
    for _ in range(world_size - 1):
        ops = [dist.P2POp(dist.isend, passing, right), dist.P2POp(dist.irecv, incoming, left)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        total += incoming
        passing, incoming = incoming, passing
    tensor.copy_(total)
    return tensor


def _bytes_sent(all_reduce, numel):
    x = torch.full((numel,), float(dist.get_rank() + 1))
    with labsupport.CommCounter() as cc:
        all_reduce(x)
    n = dist.get_world_size()
    assert torch.equal(x, torch.full((numel,), float(n * (n + 1) // 2)))
    return cc.bytes_sent


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_whole_tensor_ring_sends_n_over_2_times_the_bytes(n):
    numel = 12 * 5  # divisible by 2, 3 and 4: every chunk the same size
    whole = labsupport.run(_bytes_sent, whole_tensor_ring, numel, world_size=n, timeout=60)
    ring = labsupport.run(_bytes_sent, reference_ring_all_reduce, numel, world_size=n, timeout=60)
    S = numel * 4
    for rank in range(n):
        assert whole[rank] == (n - 1) * S
        assert ring[rank] * n == 2 * (n - 1) * S
        assert whole[rank] / ring[rank] == n / 2


def test_the_introduction_states_the_ratio_the_schedules_give():
    text = "".join(json.loads(NOTEBOOK.read_text())["cells"][0]["source"])
    assert "**N/2 times** too many (twice as\nmany on 4 ranks, 32 times as many on 64)" in text
    assert "N−1 times too many" not in text
    for n, said in ((4, 2), (64, 32)):
        whole = netsim.Schedule("whole tensor", n, [netsim.Step(list(range(n)), [(r + 1) % n for r in range(n)],
                                                                1.0, "pass on")] * (n - 1))
        ratio = whole.bytes_sent / netsim.ring_allreduce(n, 1.0).bytes_sent
        assert ratio == pytest.approx([said] * n) and said == n / 2
