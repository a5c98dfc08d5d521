"""labsupport._sandbox, what notebook 09's checks need of it: groups that leave ranks out, a forbidden class and a
forbidden function of a module the call imports itself, a folder every rank's sandbox shares for one exercise (a
checkpoint's), and the kernel's count of the bytes a sandbox read, taken by its host.
"""

from __future__ import annotations

import os
import shutil
import tempfile

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


def shares_a_file(folder, nbytes):
    """Rank 0 writes a file in ``folder``; after a barrier, every rank reads it."""
    path = os.path.join(folder, "common.bin")
    if dist.get_rank() == 0:
        with open(path, "wb") as f:
            f.write(b"x" * nbytes)
    dist.barrier()
    with open(path, "rb") as f:
        return len(f.read())


def measured(fn, folder, nbytes):
    """The host's side: the sandbox's ``rchar`` before and after the call, read from /proc by the host."""
    from labsupport import _sandbox

    fn(folder, 1)  # the sandbox exists, and what a first call reads is read
    before = _sandbox.io()
    got = fn(folder, nbytes)
    after = _sandbox.io()
    return got, after["rchar"] - before["rchar"], _sandbox.pid()


def test_a_shared_folder_is_every_ranks_and_the_host_counts_the_bytes_read():
    folder = tempfile.mkdtemp(prefix="sandbox-shared-")
    try:
        with pytest.raises(labsupport.WorkerError, match="PermissionError"):  # not shared: refused
            labsupport.run(measured, sandboxed(shares_a_file), folder, 1 << 20, world_size=2, timeout=60)
        first = labsupport.run(measured, sandboxed(shares_a_file, shared=[folder]), folder, 1 << 20, world_size=2,
                               timeout=60)
        for got, read, _ in first:
            assert got == 1 << 20 and 1 << 20 <= read < (1 << 20) + 64 * 1024
        # a function without the folder gets a sandbox of its own again: not the one that had it
        again = labsupport.run(measured, sandboxed(shares_a_file, shared=[folder]), folder, 8, world_size=2,
                               timeout=60)
        assert [pid for *_, pid in again] == [pid for *_, pid in first]
        with pytest.raises(labsupport.WorkerError, match="PermissionError"):
            labsupport.run(measured, sandboxed(shares_a_file), folder, 8, world_size=2, timeout=60)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
