"""autograder.checks.hybrid_parallel: correct implementations pass; planted bugs lose the points with the right
message.

parallel_groups: the loop version and a reshape version with the groups listed in another order pass; tp and dp
swapped, pipeline innermost, no ValueError fail. dispatch/combine (real workers, 2 to 4 ranks): the
``all_to_all_single`` version, one that picks rows with masks and puts them back with ``index_copy_``, an all-to-all
of flattened rows posted with async_op=True and the functional all-to-all pass; dropping the empty experts' tensors,
rows in the wrong order, returning rows in expert order, send/recv instead of an all-to-all, gathering every row on
every rank, rows read from files beside an all-to-all of the right size (of zeros, or of the real rows) fail (the
other ranks' files are not in a sandbox's own temporary folder; ``test_hybrid_parallel_sandbox_checks.py`` has the
cheats a sandbox stops and the honest habits it keeps). The
planner: a rewritten formula passes; forgetting 1/t, ignoring sequence parallelism, dividing full recomputation by
t, ZeRO's 1/dp forgotten, every micro-batch counted in flight fail; the step time: the same model written out
differently passes; a constant, one without communication and one without the bubble fail.
"""

import pytest
import torch
import torch.distributed as dist

import labsupport
from autograder.checks.hybrid_parallel import (
    check_activation_bytes,
    check_combine_tokens,
    check_dispatch_tokens,
    check_fits,
    check_parallel_groups,
    reference_activation_bytes,
    reference_fits,
    reference_parallel_groups,
)

# ---------------------------------------------------------------------------------------------------------------
# parallel_groups


def groups_loops(world_size, tp, pp):
    if world_size % (tp * pp):
        raise ValueError("tp·pp must divide world_size")
    dp = world_size // (tp * pp)
    rank = lambda t, d, p: t + tp * d + tp * dp * p  # noqa: E731
    return {"tp": [[rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
            "dp": [[rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
            "pp": [[rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)]}


def groups_reshape_other_order(world_size, tp, pp):
    """Correct alternative: DeviceMesh's grid, groups listed in reverse and as tuples."""
    groups = reference_parallel_groups(world_size, tp, pp)
    return {k: [tuple(g) for g in reversed(v)] for k, v in groups.items()}


def groups_tp_dp_swapped(world_size, tp, pp):
    if world_size % (tp * pp):
        raise ValueError("no")
    dp = world_size // (tp * pp)
    rank = lambda t, d, p: d + dp * t + tp * dp * p  # noqa: E731
    return {"tp": [[rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
            "dp": [[rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
            "pp": [[rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)]}


def groups_pp_innermost(world_size, tp, pp):
    if world_size % (tp * pp):
        raise ValueError("no")
    dp = world_size // (tp * pp)
    rank = lambda t, d, p: p + pp * t + pp * tp * d  # noqa: E731
    return {"tp": [[rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
            "dp": [[rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
            "pp": [[rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)]}


def groups_no_error(world_size, tp, pp):
    return groups_loops(world_size - world_size % (tp * pp), tp, pp)


def groups_todo(world_size, tp, pp):
    raise NotImplementedError()


def test_parallel_groups_correct_passes():
    check_parallel_groups(groups_loops)
    check_parallel_groups(groups_reshape_other_order)


@pytest.mark.parametrize("impl, expected", [
    (groups_tp_dp_swapped, "tensor-parallel ranks are adjacent"),
    (groups_pp_innermost, "pipeline is the outermost"),
    (groups_no_error, "should raise ValueError"),
    (groups_todo, "not started: it still raises NotImplementedError"),
])
def test_parallel_groups_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_parallel_groups(impl)
    assert expected in str(info.value), str(info.value)


def test_reference_groups_match_the_rule():
    g = reference_parallel_groups(8, 2, 2)
    assert g == {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                 "pp": [[0, 4], [1, 5], [2, 6], [3, 7]]}


# ---------------------------------------------------------------------------------------------------------------
# dispatch_tokens / combine_tokens


def _counts(expert_of_token, num_experts):
    world = dist.get_world_size()
    send = torch.bincount(expert_of_token, minlength=num_experts).view(world, num_experts // world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return send, recv


def dispatch_single(tokens, expert_of_token, num_experts):
    world = dist.get_world_size()
    k = num_experts // world
    send, recv = _counts(expert_of_token, num_experts)
    order = torch.argsort(expert_of_token, stable=True)
    got = tokens.new_empty(int(recv.sum()), tokens.shape[1])
    dist.all_to_all_single(got, tokens[order], recv.sum(1).tolist(), send.sum(1).tolist())
    pieces = got.split(recv.flatten().tolist())
    return [torch.cat([pieces[s * k + j] for s in range(world)]) for j in range(k)]


def dispatch_masks(tokens, expert_of_token, num_experts):
    """Correct alternative: rows picked with a mask per expert (no sort), counts per destination rank only."""
    world = dist.get_world_size()
    k = num_experts // world
    send, recv = _counts(expert_of_token, num_experts)
    outgoing = torch.cat([tokens[expert_of_token == e] for e in range(num_experts)])
    incoming = tokens.new_empty(int(recv.sum()), tokens.shape[1])
    dist.all_to_all_single(incoming, outgoing, output_split_sizes=recv.sum(1).tolist(),
                           input_split_sizes=send.sum(1).tolist())
    by_source = [x.split(recv[s].tolist()) for s, x in enumerate(incoming.split(recv.sum(1).tolist()))]
    return [torch.cat([by_source[s][j] for s in range(world)]) for j in range(k)]


def dispatch_drops_empty(tokens, expert_of_token, num_experts):
    return [x for x in dispatch_single(tokens, expert_of_token, num_experts) if len(x)]


def dispatch_expert_major_source_minor_wrong(tokens, expert_of_token, num_experts):
    """Rows of each expert in reverse source-rank order."""
    world = dist.get_world_size()
    k = num_experts // world
    send, recv = _counts(expert_of_token, num_experts)
    order = torch.argsort(expert_of_token, stable=True)
    got = tokens.new_empty(int(recv.sum()), tokens.shape[1])
    dist.all_to_all_single(got, tokens[order], recv.sum(1).tolist(), send.sum(1).tolist())
    pieces = got.split(recv.flatten().tolist())
    return [torch.cat([pieces[s * k + j] for s in reversed(range(world))]) for j in range(k)]


def dispatch_send_recv(tokens, expert_of_token, num_experts):
    """Right rows, but exchanged with send/recv (the counted kind a check can see) instead of an all-to-all."""
    world, rank = dist.get_world_size(), dist.get_rank()
    k = num_experts // world
    send, recv = _counts(expert_of_token, num_experts)
    incoming = []
    for s in range(world):
        if s == rank:
            incoming.append(torch.cat([tokens[expert_of_token == rank * k + j] for j in range(k)]))
            continue
        incoming.append(tokens.new_empty(int(recv[s].sum()), tokens.shape[1]))
    reqs = []
    for r in range(world):
        if r != rank:
            out = torch.cat([tokens[expert_of_token == r * k + j] for j in range(k)])
            reqs.append(dist.isend(out.contiguous(), r))
            reqs.append(dist.irecv(incoming[r], r))
    for q in reqs:
        q.wait()
    pieces = [x.split(recv[s].tolist()) for s, x in enumerate(incoming)]
    return [torch.cat([pieces[s][j] for s in range(world)]) for j in range(k)]


def dispatch_gather_everything(tokens, expert_of_token, num_experts):
    """Right rows, but every rank's tokens are sent to every rank (an all-to-all of whole copies)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    k = num_experts // world
    sizes = torch.tensor([len(tokens)] * world)
    their = torch.empty_like(sizes)
    dist.all_to_all_single(their, sizes)
    rows = tokens.new_empty(int(their.sum()), tokens.shape[1])
    routes = expert_of_token.new_empty(int(their.sum()))
    dist.all_to_all_single(rows, tokens.repeat(world, 1), their.tolist(), sizes.tolist())
    dist.all_to_all_single(routes, expert_of_token.repeat(world), their.tolist(), sizes.tolist())
    return [rows[routes == rank * k + j] for j in range(k)]


def combine_single(expert_outputs, expert_of_token, num_experts):
    world = dist.get_world_size()
    k = num_experts // world
    send, recv = _counts(expert_of_token, num_experts)
    pieces = [out.split(recv[:, j].tolist()) for j, out in enumerate(expert_outputs)]
    outgoing = torch.cat([pieces[j][s] for s in range(world) for j in range(k)])
    back = outgoing.new_empty(len(expert_of_token), expert_outputs[0].shape[1])
    dist.all_to_all_single(back, outgoing, send.sum(1).tolist(), recv.sum(1).tolist())
    result = torch.empty_like(back)
    result[torch.argsort(expert_of_token, stable=True)] = back
    return result


def combine_index_copy(expert_outputs, expert_of_token, num_experts):
    """Correct alternative: rows put back with index_copy_, one (destination rank, expert) piece at a time."""
    world = dist.get_world_size()
    k = num_experts // world
    send, recv = _counts(expert_of_token, num_experts)
    pieces = [out.split(recv[:, j].tolist()) for j, out in enumerate(expert_outputs)]
    outgoing = torch.cat([pieces[j][s] for s in range(world) for j in range(k)])
    width = expert_outputs[0].shape[1]
    incoming = outgoing.new_empty(len(expert_of_token), width)
    dist.all_to_all_single(incoming, outgoing, send.sum(1).tolist(), recv.sum(1).tolist())
    result = outgoing.new_empty(len(expert_of_token), width)
    rows = incoming.split(send.flatten().tolist())
    for e in range(num_experts):
        result.index_copy_(0, (expert_of_token == e).nonzero().flatten(), rows[e])
    return result


def combine_expert_order(expert_outputs, expert_of_token, num_experts):
    world = dist.get_world_size()
    k = num_experts // world
    send, recv = _counts(expert_of_token, num_experts)
    pieces = [out.split(recv[:, j].tolist()) for j, out in enumerate(expert_outputs)]
    outgoing = torch.cat([pieces[j][s] for s in range(world) for j in range(k)])
    back = outgoing.new_empty(len(expert_of_token), expert_outputs[0].shape[1])
    dist.all_to_all_single(back, outgoing, send.sum(1).tolist(), recv.sum(1).tolist())
    return back


def combine_todo(expert_outputs, expert_of_token, num_experts):
    raise NotImplementedError()


def dispatch_async_flat(tokens, expert_of_token, num_experts):
    """Correct alternative: the rows travel flattened, in an all-to-all posted with async_op=True and waited for."""
    world = dist.get_world_size()
    k, d = num_experts // world, tokens.shape[1]
    send, recv = _counts(expert_of_token, num_experts)
    flat = tokens[torch.argsort(expert_of_token, stable=True)].reshape(-1)
    got = tokens.new_empty(int(recv.sum()) * d)
    work = dist.all_to_all_single(got, flat, (recv.sum(1) * d).tolist(), (send.sum(1) * d).tolist(), async_op=True)
    work.wait()
    pieces = got.view(-1, d).split(recv.flatten().tolist())
    return [torch.cat([pieces[s * k + j] for s in range(world)]) for j in range(k)]


def combine_functional(expert_outputs, expert_of_token, num_experts):
    """The rows go back through the functional all-to-all (what DTensor and compiled code use)."""
    from torch.distributed import _functional_collectives as funcol

    world = dist.get_world_size()
    k = num_experts // world
    send, recv = _counts(expert_of_token, num_experts)
    pieces = [out.split(recv[:, j].tolist()) for j, out in enumerate(expert_outputs)]
    outgoing = torch.cat([pieces[j][s] for s in range(world) for j in range(k)])
    back = funcol.all_to_all_single(outgoing, send.sum(1).tolist(), recv.sum(1).tolist(), dist.group.WORLD)
    back = funcol.wait_tensor(back)
    result = torch.empty_like(back)
    result[torch.argsort(expert_of_token, stable=True)] = back
    return result


def test_moe_correct_passes():
    check_dispatch_tokens(dispatch_single)
    check_dispatch_tokens(dispatch_masks)
    check_dispatch_tokens(dispatch_async_flat)
    check_combine_tokens(combine_single)
    check_combine_tokens(combine_index_copy)


def test_moe_rows_through_the_functional_all_to_all_pass():
    """The functional all-to-all (a private module: the screen flags it for a person, which changes no points) is
    waited for as soon as it is posted, and the rows changed in transit still reach the answer."""
    check_combine_tokens(combine_functional)


# Answers that move the rows through files in the temporary folder, beside an all-to-all of the right size: a decoy
# of zeros, or even the real rows (then only the rows returned come from the files). In grading each rank's function
# runs in a sandbox whose temporary folder is its own: the other ranks' files are not there. (Without a sandbox the
# check changes each row in transit, so rows read from files are not the ones the all-to-all delivered.)

_CALLS = [0]


def _files(rank):
    import os
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), f"moe-files-{os.environ['MASTER_PORT']}")
    os.makedirs(folder, exist_ok=True)
    _CALLS[0] += 1
    return lambda r: os.path.join(folder, f"{_CALLS[0]}-{r}.pt")


def _through_files(mine, send, recv, *decoy):
    """Save ``mine``, learn the counts (every rank has saved once it has them), load everyone's, run the all-to-all
    ``decoy`` (its input, and whether to send the real rows), remove the file: every rank's ``mine``."""
    import os

    rank, world = dist.get_rank(), dist.get_world_size()
    path = _files(rank)
    torch.save(mine, path(rank))
    dist.all_to_all_single(recv, send)
    everyone = [torch.load(path(r)) for r in range(world)]
    rows, width, real, back = decoy
    into, out_of = (send, recv) if back else (recv, send)   # combine sends back what dispatch received
    incoming = rows.new_empty(int(into.sum()), width)
    outgoing = rows if real else torch.zeros(len(rows), width, dtype=rows.dtype)
    dist.all_to_all_single(incoming, outgoing, into.sum(1).tolist(), out_of.sum(1).tolist())
    os.remove(path(rank))
    try:
        os.rmdir(os.path.dirname(path(rank)))   # the last rank to get here removes the folder
    except OSError:
        pass
    return everyone


def dispatch_files(tokens, expert_of_token, num_experts, real=False):
    world, rank = dist.get_world_size(), dist.get_rank()
    k = num_experts // world
    send = torch.bincount(expert_of_token, minlength=num_experts).view(world, k)
    recv = torch.empty_like(send)
    order = torch.argsort(expert_of_token, stable=True)
    everyone = _through_files((tokens, expert_of_token), send, recv, tokens[order], tokens.shape[1], real, False)
    return [torch.cat([t[e == rank * k + j] for t, e in everyone]) for j in range(k)]


def dispatch_files_real_rows(tokens, expert_of_token, num_experts):
    return dispatch_files(tokens, expert_of_token, num_experts, real=True)


def combine_files(expert_outputs, expert_of_token, num_experts):
    world, rank = dist.get_world_size(), dist.get_rank()
    k = num_experts // world
    send = torch.bincount(expert_of_token, minlength=num_experts).view(world, k)
    recv = torch.empty_like(send)
    width = expert_outputs[0].shape[1]
    outgoing = torch.cat(list(expert_outputs))
    everyone = _through_files((list(expert_outputs), expert_of_token), send, recv, outgoing, width, False, True)
    result = outgoing.new_empty(len(expert_of_token), width)
    for i, e in enumerate(expert_of_token.tolist()):
        owner, j = divmod(e, k)
        before = sum(int((everyone[s][1] == e).sum()) for s in range(rank))   # rows of expert e from lower ranks
        result[i] = everyone[owner][0][j][before + int((expert_of_token[:i] == e).sum())]
    return result


@pytest.mark.parametrize("check, impl", [
    (check_dispatch_tokens, dispatch_files),
    (check_dispatch_tokens, dispatch_files_real_rows),
    (check_combine_tokens, combine_files),
])
def test_moe_rows_through_files_fail(check, impl):
    with pytest.raises(AssertionError) as info:
        check(impl)
    assert "raised FileNotFoundError" in str(info.value), str(info.value)


def dispatch_no_regroup(tokens, expert_of_token, num_experts):
    """Forgets to regroup what arrived (by source rank, then expert) by local expert."""
    world = dist.get_world_size()
    send, recv = _counts(expert_of_token, num_experts)
    order = torch.argsort(expert_of_token, stable=True)
    got = tokens.new_empty(int(recv.sum()), tokens.shape[1])
    dist.all_to_all_single(got, tokens[order], recv.sum(1).tolist(), send.sum(1).tolist())
    return list(got.split(recv.sum(0).tolist())) if world else None


def dispatch_skips_when_empty(tokens, expert_of_token, num_experts):
    """A rank with no tokens returns at once, leaving the others waiting in the count exchange."""
    if len(tokens) == 0:
        return [tokens.new_empty(0, tokens.shape[1]) for _ in range(num_experts // dist.get_world_size())]
    return dispatch_single(tokens, expert_of_token, num_experts)


def dispatch_no_count_exchange(tokens, expert_of_token, num_experts):
    """Assumes every rank receives what it sends: the sizes disagree and gloo aborts a rank."""
    world = dist.get_world_size()
    k = num_experts // world
    send = torch.bincount(expert_of_token, minlength=num_experts).view(world, k)
    order = torch.argsort(expert_of_token, stable=True)
    got = tokens.new_empty(len(tokens), tokens.shape[1])
    dist.all_to_all_single(got, tokens[order], send.sum(1).tolist(), send.sum(1).tolist())
    return list(got.split(k * [len(tokens) // k] + [len(tokens) % k])[:k])


def combine_skips_when_empty(expert_outputs, expert_of_token, num_experts):
    if len(expert_of_token) == 0:
        return expert_outputs[0].new_empty(0, expert_outputs[0].shape[1])
    return combine_single(expert_outputs, expert_of_token, num_experts)


@pytest.mark.parametrize("check, impl, expected", [
    (check_dispatch_tokens, dispatch_drops_empty, "empty ones included"),
    (check_dispatch_tokens, dispatch_expert_major_source_minor_wrong, "by source rank, then by position"),
    (check_dispatch_tokens, dispatch_no_regroup, "by source rank, then by position"),
    pytest.param(check_dispatch_tokens, dispatch_skips_when_empty, "had returned from dispatch_tokens",
                 marks=pytest.mark.timing),
    pytest.param(check_combine_tokens, combine_skips_when_empty, "had returned from combine_tokens",
                 marks=pytest.mark.timing),
    (check_dispatch_tokens, dispatch_send_recv, "used send/recv"),
    (check_dispatch_tokens, dispatch_gather_everything, "send each row only to the rank that needs it"),
    (check_combine_tokens, combine_expert_order, "sorted by expert"),
    (check_combine_tokens, combine_todo, "not started: it still raises NotImplementedError"),
])
def test_moe_bugs_fail(check, impl, expected, settled_timeouts):
    with pytest.raises(AssertionError) as info:
        check(impl, timeout=8)   # two of them deadlock: reported once the ranks are blocked (settled_timeouts)
    assert expected in str(info.value), str(info.value)
    assert len(str(info.value)) <= 400, str(info.value)   # the feedback page cuts at 400: every word gets there


def test_mismatched_split_sizes_name_the_counts():
    """Skipping the count exchange makes gloo abort one rank (or, when the sizes happen to agree, misplaces rows);
    whichever rank is reported, the message says why."""
    with pytest.raises(AssertionError) as info:
        check_dispatch_tokens(dispatch_no_count_exchange)
    text = str(info.value)   # the sizes may happen to agree: then the rows land in the wrong places
    assert "exchange the counts" in text or "crashed a worker" in text or "should be a (" in text, text


# ---------------------------------------------------------------------------------------------------------------
# the planner


def act_expanded(seq_len, micro_batch, hidden, heads, tp=1, sequence_parallel=False, recompute="none"):
    """Correct alternative: the table's rows written out one by one."""
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    rows = {
        ("none", False): 10 * s * b * h + 24 * s * b * h / t + 5 * a * s * s * b / t,
        ("none", True): 34 * s * b * h / t + 5 * a * s * s * b / t,
        ("selective", False): 10 * s * b * h + 24 * s * b * h / t,
        ("selective", True): 34 * s * b * h / t,
    }
    if recompute == "full":
        return 2 * s * b * h
    if (recompute, bool(sequence_parallel)) not in rows:
        raise ValueError(recompute)
    return rows[recompute, bool(sequence_parallel)]


def act_no_t(seq_len, micro_batch, hidden, heads, tp=1, sequence_parallel=False, recompute="none"):
    return act_expanded(seq_len, micro_batch, hidden, heads, 1, sequence_parallel, recompute)


def act_ignores_sp(seq_len, micro_batch, hidden, heads, tp=1, sequence_parallel=False, recompute="none"):
    return act_expanded(seq_len, micro_batch, hidden, heads, tp, False, recompute)


def act_full_over_t(seq_len, micro_batch, hidden, heads, tp=1, sequence_parallel=False, recompute="none"):
    if recompute == "full":
        return 2 * seq_len * micro_batch * hidden / tp
    return act_expanded(seq_len, micro_batch, hidden, heads, tp, sequence_parallel, recompute)


def step_expanded(model, cluster, dp, tp, pp, zero_stage, micro_batch, recompute, leave_out=()):
    """Correct alternative of the step-time model: the FLOPs multiplied out term by term, the ring's cost written
    per step of the ring, the communication summed per micro-batch; ``leave_out`` drops terms (planted bugs)."""
    l, h, s, V, B = model.num_layers, model.hidden, model.seq_len, model.vocab, model.global_batch
    m = B // (dp * micro_batch)
    c = 4 if recompute == "full" else 3                      # passes over the layer: f, b = 2f, recomputed f
    flops = 24 * c * B * s * l * h * h + 4 * c * B * s * s * l * h + 1.5 * c * B * s * h * V
    compute = flops / cluster.efficiency / cluster.peak_flops / cluster.num_gpus
    bubble = 0.0 if "bubble" in leave_out else compute * (pp - 1) / m

    def all_reduce(n, nbytes, bw):                         # 2(n-1) steps, each a message of nbytes/n
        return sum(cluster.alpha + nbytes / n / bw for _ in range(2 * (n - 1)))

    act = 2 * s * micro_batch * h
    per_micro_batch = 0.0
    if "comm" not in leave_out:
        tp_bw = cluster.inter_bw if tp > cluster.gpus_per_node else cluster.intra_bw
        per_micro_batch += (l // pp) * (6 if recompute == "full" else 4) * all_reduce(tp, act, tp_bw)
        per_micro_batch += 2 * (cluster.alpha + act / cluster.inter_bw) if pp > 1 else 0.0
    one_node = pp == 1 and tp * dp <= cluster.gpus_per_node
    grads = 0.0 if "comm" in leave_out else all_reduce(dp, 2 * model.num_params / (tp * pp),
                                                        cluster.intra_bw if one_node else cluster.inter_bw)
    return compute + bubble + m * per_micro_batch + grads * (3 / 2 if zero_stage == 3 else 1)


def _fits_with(act, zero_div=True, in_flight="min", step="model"):
    def fits(model, cluster, dp, tp, pp, zero_stage=0, micro_batch=1, recompute="none", sequence_parallel=False):
        if dp * tp * pp != cluster.num_gpus:
            raise ValueError("dp·tp·pp must be the number of GPUs")
        psi = model.num_params / (tp * pp)
        n = dp if zero_div else 1
        state = [16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n, 16 * psi / n][zero_stage]
        m = model.global_batch // (dp * micro_batch)
        flight = min(pp, m) if in_flight == "min" else m
        a = flight * model.num_layers / pp * act(model.seq_len, micro_batch, model.hidden, model.heads, tp,
                                                   sequence_parallel, recompute)
        time = 1.0 if step == "constant" else step_expanded(model, cluster, dp, tp, pp, zero_stage, micro_batch,
                                                            recompute, () if step == "model" else (step,))
        return {"model_state": state, "activations": a, "total": state + a,
                "fits": state + a <= cluster.memory_bytes, "step_time": time}
    return fits


def test_planner_correct_passes():
    check_activation_bytes(act_expanded)
    check_activation_bytes(reference_activation_bytes)
    check_fits(_fits_with(act_expanded))


@pytest.mark.parametrize("check, impl, expected", [
    (check_activation_bytes, act_no_t, "divided among the t ranks"),
    (check_activation_bytes, act_ignores_sp, "sequence_parallel=True"),
    (check_activation_bytes, act_full_over_t, "2sbh"),
    (check_fits, _fits_with(act_expanded, zero_div=False), "'model_state'"),
    (check_fits, _fits_with(act_expanded, in_flight="all"), "micro-batches in flight"),
    (check_fits, _fits_with(act_no_t), "'activations'"),
    (check_fits, _fits_with(act_expanded, step="constant"), "stays the same with infinitely fast links"),
    (check_fits, _fits_with(act_expanded, step="comm"), "it leaves out communication"),
    (check_fits, _fits_with(act_expanded, step="bubble"), "add the bubble"),
])
def test_planner_bugs_fail(check, impl, expected):
    with pytest.raises(AssertionError) as info:
        check(impl)
    assert expected in str(info.value), str(info.value)


def _fits_numpy(model, cluster, dp, tp, pp, zero_stage=0, micro_batch=1, recompute="none", sequence_parallel=False):
    """Correct alternative in numpy: its numbers are numpy floats and its verdict a numpy.bool_."""
    import numpy as np

    out = _fits_with(act_expanded)(model, cluster, dp, tp, pp, zero_stage, micro_batch, recompute, sequence_parallel)
    total = np.float64(out["model_state"]) + np.float64(out["activations"])
    return dict(out, total=total, fits=total <= np.float64(cluster.memory_bytes))


def act_not_written(*args, **kwargs):
    raise NotImplementedError


def test_fits_is_graded_on_its_own():
    """A fits that uses the student's (wrong) activation_bytes as the exercise says keeps its points; numpy's
    verdict counts as a verdict; a fits stopped by an unwritten activation_bytes is told so."""
    check_fits(_fits_with(act_no_t), act_no_t)
    check_fits(_fits_with(act_full_over_t), act_full_over_t)
    check_fits(_fits_numpy)
    with pytest.raises(AssertionError, match="micro-batches in flight"):
        check_fits(_fits_with(act_no_t, in_flight="all"), act_no_t)   # its own mistake still costs its points
    with pytest.raises(AssertionError, match="'activations'"):
        check_fits(_fits_with(act_no_t), act_expanded)                 # not the activation_bytes it was given
    with pytest.raises(AssertionError, match=r"activation_bytes \(exercise 4\), which is not started either"):
        check_fits(_fits_with(act_not_written), act_not_written)
    with pytest.raises(AssertionError, match="should be True or False, got 'yes'"):
        check_fits(lambda *a, **k: dict(_fits_with(act_expanded)(*a, **k), fits="yes"))


def test_published_configurations_fit_only_with_recomputation():
    """Narayanan et al. 2021 Table 1 from 145.6B up, and GPT-3 175B at t = 8, p = 8 on 1024 GPUs: without
    recomputation or sequence parallelism none fits in 80 GB; with full recomputation, or with sequence parallelism
    and selective recomputation (Korthikanti et al. 2022), every one does. The smaller rows fit either way."""
    from labsupport.lessons.hybrid_parallel import DGX_A100, GPT3_175B, NARAYANAN_TABLE1

    rows = [(r["model"], r["gpus"], r["t"], r["p"]) for r in NARAYANAN_TABLE1] + [(GPT3_175B, 1024, 8, 8)]
    for model, gpus, t, p in rows:
        d = gpus // (t * p)
        plan = lambda rc, sp=False: reference_fits(model, DGX_A100(gpus), d, t, p, 0, 1, rc, sp)["fits"]  # noqa
        assert plan("full") and plan("selective", True), model.name
        assert plan("none") == (model.num_params < 100e9), model.name


def dispatch_raises_on_rank_1(tokens, expert_of_token, num_experts):
    """Rank 1 fails before its first collective while the others wait in theirs: reported, not a deadlock."""
    if dist.get_rank() == 1:
        raise RuntimeError("index out of range")
    return dispatch_single(tokens, expert_of_token, num_experts)


@pytest.mark.timing
def test_an_exception_on_one_rank_is_reported_not_a_deadlock(monkeypatch):
    """The probe raises at once on the failing rank, so the launcher ends the call with that rank's WorkerError; a
    probe that first waited for the other ranks to agree would deadlock with them and end in a WorkerTimeout after
    the check's 30 s (how the launcher ended each call is recorded here, not how long it took)."""
    ended = []
    run = labsupport.run

    def recorded(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except Exception as exc:
            ended.append(type(exc))
            raise

    monkeypatch.setattr(labsupport, "run", recorded)
    with pytest.raises(AssertionError) as info:
        check_dispatch_tokens(dispatch_raises_on_rank_1)
    assert "raised RuntimeError: index out of range" in str(info.value), str(info.value)
    assert ended == [labsupport.WorkerError], ended
