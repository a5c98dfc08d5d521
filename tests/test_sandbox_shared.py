"""labsupport._sandbox, what notebook 09's checks need of it: groups that leave ranks out, a forbidden class and a
forbidden function of a module the call imports itself.
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


def makes_a_grad_scaler(n):
    return torch.amp.GradScaler("cpu", init_scale=float(n)).get_scale()


class GrownFromGradScaler(torch.amp.GradScaler):
    pass


def subclasses_a_grad_scaler(n):
    return GrownFromGradScaler("cpu", init_scale=float(n)).get_scale()


def imports_the_checkpoint_module(n):
    import torch.distributed.checkpoint as dcp

    dcp.save({"x": torch.ones(n)}, checkpoint_id="here")


RULES = {"torch.amp:GradScaler": "no GradScaler here", "torch.distributed.checkpoint:save": "no dcp.save here"}


def refused_then_allowed(forbidden, allowed, n):
    """The host's side: the forbidden call, then the same sandbox without the rule."""
    try:
        forbidden(n)
    except RuntimeError as exc:
        return str(exc), allowed(n)
    return None, allowed(n)


@pytest.mark.parametrize("fn, said", [(makes_a_grad_scaler, "no GradScaler here"),
                                      (subclasses_a_grad_scaler, "no GradScaler here"),
                                      (imports_the_checkpoint_module, "no dcp.save here")])
def test_a_forbidden_class_or_a_function_of_a_module_imported_later_raises_the_rule(fn, said):
    got = labsupport.run(refused_then_allowed, sandboxed(fn, forbid=RULES), sandboxed(makes_a_grad_scaler), 3,
                         world_size=1, timeout=60)
    assert got == [(said, 3.0)]  # once the call is over, the built-in is back
