"""autograder.checks.pipeline_parallel's ``check_run_pipeline`` with the student's function in the grading sandbox
(``labsupport._sandbox``): the host builds each stage from its own layers only, compares the loss and gradients
with one-process training, and reads what crossed between the stages from its own record.

Cheats, each written as a student would, lose the points: activations passed through files beside decoy messages
(the sandbox writes only its own folder; and where no sandbox runs, decoys smaller than an activation are found
out by the bytes the host carried), and a function that imports the grader under a name built from character codes
(the grader is not there). Honest habits (a print to stderr, a printed traceback, a cached helper, ``import sys``)
keep the points.
"""

import functools

import pytest
import torch
import torch.distributed as dist

from autograder.checks.pipeline_parallel import check_run_pipeline

pytestmark = pytest.mark.slow


def run_through_files(stage_module, schedule, microbatches, targets, loss_fn, folder=None, decoy_numel=None):
    """Each activation goes through a file the next stage reads; a decoy message of zeros (of the activation's
    size, or of ``decoy_numel`` values) tells it the file is there. Gradients travel as they should."""
    import os

    rank, p = dist.get_rank(), dist.get_world_size()
    m = len(microbatches)
    folder = folder or f"/tmp/pipeline-files-{os.environ['MASTER_PORT']}"
    os.makedirs(folder, exist_ok=True)
    decoy = (lambda like: torch.zeros_like(like)) if decoy_numel is None else (lambda like: torch.zeros(decoy_numel))
    kept, sends, total = {}, [], 0.0
    for op, mb in schedule[rank]:
        if op == "F":
            if rank == 0:
                x = microbatches[mb]
            else:
                dist.recv(decoy(microbatches[mb]), src=rank - 1)
                x = torch.load(os.path.join(folder, f"{rank - 1}-{mb}.pt")).requires_grad_()
            y = stage_module(x)
            if rank == p - 1:
                y = loss_fn(y, targets[mb]) / m
                total += y.item()
            else:
                torch.save(y.detach(), os.path.join(folder, f"{rank}-{mb}.pt"))
                sends.append(dist.isend(decoy(y), dst=rank + 1))
            kept[mb] = (x, y)
        else:
            x, y = kept.pop(mb)
            grad = None
            if rank < p - 1:
                grad = torch.empty_like(y)
                dist.recv(grad, src=rank + 1)
            torch.autograd.backward(y, grad)
            if rank > 0:
                sends.append(dist.isend(x.grad, dst=rank - 1))
    for s in sends:
        s.wait()
    return total if rank == p - 1 else None


def test_activations_through_files_fail():
    with pytest.raises(AssertionError) as info:
        check_run_pipeline(run_through_files, world_sizes=(3,))
    text = str(info.value)
    assert "raised PermissionError" in text, text


def test_activations_through_files_fail_on_the_bytes_carried_where_no_sandbox_runs(monkeypatch, tmp_path):
    """Without a sandbox (LABSUPPORT_SANDBOX=0: the function runs in the worker) the files work, so the check's own
    record of what crossed decides: one value per micro-batch is not an activation."""
    monkeypatch.setenv("LABSUPPORT_SANDBOX", "0")
    folder = str(tmp_path / "pipeline-files")   # every rank's worker reads and writes it (no sandbox), removed after
    with pytest.raises(AssertionError) as info:
        check_run_pipeline(functools.partial(run_through_files, folder=folder, decoy_numel=1), world_sizes=(3,))
    text = str(info.value)
    assert "must cross to stage" in text and "as a message of its own tensor" in text, text


def run_with_the_graders_help(stage_module, schedule, microbatches, targets, loss_fn):
    """Imports the grader (its name spelled in character codes, which no screen reads) to look at its model."""
    import importlib

    name = "".join(map(chr, [97, 117, 116, 111, 103, 114, 97, 100, 101, 114]))
    importlib.import_module(name + ".checks.pipeline_parallel.workers")
    return run_with_habits(stage_module, schedule, microbatches, targets, loss_fn)


def test_importing_the_grader_fails(grader_out_of_reach):
    with pytest.raises(AssertionError) as info:
        check_run_pipeline(run_with_the_graders_help, world_sizes=(2,))
    text = str(info.value)
    assert "the grader's modules are not available where your function runs" in text, text


@functools.lru_cache(maxsize=None)
def neighbours(rank, p):
    return (rank - 1 if rank > 0 else None), (rank + 1 if rank < p - 1 else None)


def run_with_habits(stage_module, schedule, microbatches, targets, loss_fn):
    import sys
    import traceback

    rank, p = dist.get_rank(), dist.get_world_size()
    prev, nxt = neighbours(rank, p)
    m = len(microbatches)
    print(f"stage {rank} runs {len(schedule[rank])} operations", file=sys.stderr)
    try:
        raise ValueError("a debugging leftover")
    except ValueError:
        traceback.print_exc()
    kept, sends, total = {}, [], 0.0
    for op, mb in schedule[rank]:
        if op == "F":
            if prev is None:
                x = microbatches[mb]
            else:
                x = torch.empty_like(microbatches[mb])
                dist.recv(x, src=prev)
                x.requires_grad_()
            y = stage_module(x)
            if nxt is None:
                y = loss_fn(y, targets[mb]) / m
                total += y.item()
            else:
                sends.append(dist.isend(y.detach(), dst=nxt))
            kept[mb] = (x, y)
        else:
            x, y = kept.pop(mb)
            grad = None
            if nxt is not None:
                grad = torch.empty_like(y)
                dist.recv(grad, src=nxt)
            torch.autograd.backward(y, grad)
            if prev is not None:
                sends.append(dist.isend(x.grad, dst=prev))
    for s in sends:
        s.wait()
    return total if nxt is None else None


def test_honest_habits_are_accepted():
    check_run_pipeline(run_with_habits, world_sizes=(2, 3))
