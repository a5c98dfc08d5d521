"""autograder.checks.hybrid_parallel's mixture-of-experts checks with the student's function in the grading sandbox
(``labsupport._sandbox``): what the host measures decides.

Cheats, each written as a student would, lose the points: rows passed through files in a folder every rank can name
beside a decoy all-to-all of the right size (the sandbox writes only its own folder), and a function that imports the
grader's reference under a name built from character codes (the grader is not there). Honest habits (a print to
stderr, a printed traceback, a cached helper, ``import sys``) keep them.
"""

import pytest
import torch
import torch.distributed as dist

from autograder.checks.hybrid_parallel import check_combine_tokens, check_dispatch_tokens

pytestmark = pytest.mark.slow


def dispatch_shared_folder(tokens, expert_of_token, num_experts):
    """Every rank saves its tokens in one folder, a decoy all-to-all of zeros of the right size runs, and each rank
    reads the others' rows from the files."""
    import os

    world, rank = dist.get_world_size(), dist.get_rank()
    k = num_experts // world
    send = torch.bincount(expert_of_token, minlength=num_experts).view(world, k)
    recv = torch.empty_like(send)
    folder = f"/tmp/moe-shared-{os.environ['MASTER_PORT']}"
    os.makedirs(folder, exist_ok=True)
    torch.save((tokens, expert_of_token), f"{folder}/{rank}.pt")
    dist.all_to_all_single(recv, send)
    decoy = torch.zeros(len(tokens), tokens.shape[1], dtype=tokens.dtype)
    incoming = tokens.new_empty(int(recv.sum()), tokens.shape[1])
    dist.all_to_all_single(incoming, decoy, recv.sum(1).tolist(), send.sum(1).tolist())
    everyone = [torch.load(f"{folder}/{r}.pt") for r in range(world)]
    return [torch.cat([t[e == rank * k + j] for t, e in everyone]) for j in range(k)]


def test_rows_through_a_shared_folder_fail():
    with pytest.raises(AssertionError) as info:
        check_dispatch_tokens(dispatch_shared_folder)
    text = str(info.value)
    assert "dispatch_tokens raised PermissionError" in text, text


def dispatch_from_the_grader(tokens, expert_of_token, num_experts):
    """Borrows the grader's reference: the module's name is spelled in character codes, so no screen reads it."""
    import importlib

    name = "".join(map(chr, [97, 117, 116, 111, 103, 114, 97, 100, 101, 114, 46, 99, 104, 101, 99, 107, 115]))
    reference = importlib.import_module(name + ".hybrid_parallel").reference_dispatch
    world, rank = dist.get_world_size(), dist.get_rank()
    everyone_tokens = [torch.empty(0, tokens.shape[1], dtype=tokens.dtype)] * world
    everyone_experts = [torch.empty(0, dtype=torch.long)] * world
    everyone_tokens[rank], everyone_experts[rank] = tokens, expert_of_token
    return reference(everyone_tokens, everyone_experts, num_experts, rank)


def test_importing_the_grader_fails(grader_out_of_reach):
    with pytest.raises(AssertionError) as info:
        check_dispatch_tokens(dispatch_from_the_grader)
    text = str(info.value)
    assert "the grader's modules are not available where your function runs" in text, text


def _habit_counts(expert_of_token, num_experts):
    world = dist.get_world_size()
    send = torch.bincount(expert_of_token, minlength=num_experts).view(world, num_experts // world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return send, recv


def dispatch_with_habits(tokens, expert_of_token, num_experts):
    import functools
    import sys
    import traceback

    @functools.lru_cache(maxsize=None)
    def experts_here(world, num_experts):
        return num_experts // world

    world = dist.get_world_size()
    k = experts_here(world, num_experts)
    print(f"rank {dist.get_rank()}: {len(tokens)} tokens", file=sys.stderr)
    try:
        raise ValueError("a debugging leftover")
    except ValueError:
        traceback.print_exc()
    send, recv = _habit_counts(expert_of_token, num_experts)
    order = torch.argsort(expert_of_token, stable=True)
    got = tokens.new_empty(int(recv.sum()), tokens.shape[1])
    dist.all_to_all_single(got, tokens[order], recv.sum(1).tolist(), send.sum(1).tolist())
    pieces = got.split(recv.flatten().tolist())
    return [torch.cat([pieces[s * k + j] for s in range(world)]) for j in range(k)]


def combine_with_habits(expert_outputs, expert_of_token, num_experts):
    import sys

    world = dist.get_world_size()
    k = num_experts // world
    send, recv = _habit_counts(expert_of_token, num_experts)
    print(f"rank {dist.get_rank()} sends back {int(recv.sum())} rows", file=sys.stderr)
    pieces = [out.split(recv[:, j].tolist()) for j, out in enumerate(expert_outputs)]
    outgoing = torch.cat([pieces[j][s] for s in range(world) for j in range(k)])
    back = outgoing.new_empty(len(expert_of_token), outgoing.shape[1])
    dist.all_to_all_single(back, outgoing, send.sum(1).tolist(), recv.sum(1).tolist())
    result = torch.empty_like(back)
    result[torch.argsort(expert_of_token, stable=True)] = back
    return result


def test_honest_habits_are_accepted():
    check_dispatch_tokens(dispatch_with_habits)
    check_combine_tokens(combine_with_habits)
