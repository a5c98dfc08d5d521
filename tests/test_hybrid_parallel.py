"""labsupport.lessons.hybrid_parallel: the demo model trains and splits as the notebook assumes, the published
configurations are consistent with the papers' parameter counts, and every figure draws.

The training test runs the notebook's recipe in small: the single-process TinyGPT against DP × TP on 4 real ranks
(parallelize_module over a tensor-parallel sub-mesh, gradients averaged over the data-parallel group).

The ring-attention tests run the demo of section 5 on 2 and 4 real ranks against softmax(QKᵀ/√d)V written out in
one process, with and without the causal mask; the same comparison rejects two planted wrong ways of combining the
blocks, and the bytes each rank sent must be the formula's.
"""

import math

import matplotlib
import pytest
import torch
import torch.nn.functional as F

matplotlib.use("Agg")

import labsupport  # noqa: E402
from labsupport.lessons import hybrid_parallel as lesson  # noqa: E402


def test_tinygpt_shapes_and_parts():
    model = lesson.TinyGPT()
    x, y = lesson.make_data(2, 3)
    assert x.shape == y.shape == (2, 3, 16) and x.dtype == torch.long
    logits = model(x[0])
    assert logits.shape == (3, 16, 32)
    h = model.embed_tokens(x[0])
    for block in model.blocks:
        h = block(h)
    torch.testing.assert_close(model.logits(h), logits)


def test_make_data_is_learnable_and_deterministic():
    x, y = lesson.make_data(4, 8, seed=3)
    x2, y2 = lesson.make_data(4, 8, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[..., 1:], y[..., :-1])                  # targets are the next tokens
    # the rule: next = table[current] for about 90% of positions
    pairs = {}
    for a, b in zip(x.flatten().tolist(), y.flatten().tolist()):
        pairs.setdefault(a, []).append(b)
    agree = sum(max(v.count(t) for t in set(v)) for v in pairs.values()) / x.numel()
    assert agree > 0.8


def test_attention_reshapes_with_any_number_of_local_heads():
    attn = lesson.model.Attention(16, 4)
    x = torch.randn(2, 5, 16)
    assert attn(x).shape == (2, 5, 16)
    with pytest.raises(ValueError):
        lesson.model.Attention(10, 4)


def test_published_parameter_counts():
    """Model.num_params reproduces Narayanan et al. 2021's Table 1 counts, and GPT-3 is 175B."""
    printed = {"39.1B": 39.1, "76.1B": 76.1, "145.6B": 145.6, "310.1B": 310.1, "529.6B": 529.6, "1008.0B": 1008.0}
    for row in lesson.NARAYANAN_TABLE1:
        assert round(row["model"].num_params / 1e9, 1) == printed[row["model"].name]
        d = row["gpus"] // (row["t"] * row["p"])
        assert d * row["t"] * row["p"] == row["gpus"] and row["model"].global_batch % d == 0
        assert row["model"].num_layers % row["p"] == 0 and row["model"].heads % row["t"] == 0
    assert math.isclose(lesson.GPT3_175B.num_params, 174.6e9, rel_tol=1e-3)
    assert lesson.DGX_A100(1024).num_gpus == 1024


@pytest.mark.filterwarnings("error::UserWarning")  # e.g. "Tight layout not applied": a figure with no room
def test_plots_draw():
    groups = {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
              "pp": [[0, 4], [1, 5], [2, 6], [3, 7]]}
    for fig in (lesson.plot_parallel_groups(groups, 8),
                lesson.plot_loss_curves({"a": [3, 2, 1], "b": [3, 2, 1]}),
                lesson.plot_all_to_all([[0, 64], [128, 0]]),
                lesson.plot_memory_plan([("x", {"model_state": 40e9, "activations": 50e9})], 80e9),
                lesson.plot_ring_attention([[(0, True), (1, False)], [(1, True), (0, True)]])):
        assert fig.axes
        matplotlib.pyplot.close(fig)


def test_pipeline_arrows_pass_no_other_rank():
    """tp=4, dp=2, pp=2: every pipeline arrow (its lines and its arrow head, as straight segments) keeps clear of
    every rank's circle but the two it joins."""
    import numpy as np

    tp, dp, pp = 4, 2, 2
    rank = lambda p, d, t: (p * dp + d) * tp + t  # noqa: E731
    groups = {"tp": [[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
              "dp": [[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
              "pp": [[rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)]}
    fig = lesson.plot_parallel_groups(groups, tp * dp * pp)
    ax = fig.axes[0]
    circles = [p for p in ax.patches if isinstance(p, matplotlib.patches.Circle)]
    assert len(circles) == tp * dp * pp
    green = matplotlib.colors.to_rgba(lesson.plots._PP)
    paths = [np.column_stack(line.get_data()) for line in ax.lines
             if matplotlib.colors.to_rgba(line.get_color()) == green and len(line.get_xdata())]
    paths += [np.array([a.xyann, a.xy]) for a in ax.texts if isinstance(a, matplotlib.text.Annotation)]
    assert len(paths) == 2 * tp * dp  # a line and an arrow head per pipeline hop
    for path in paths:
        points = np.concatenate([np.linspace(a, b, 50) for a, b in zip(path, path[1:])])
        for circle in circles:
            distance = np.hypot(*(points - np.array(circle.center)).T)
            touching = distance.min() < circle.radius
            ends = min(np.hypot(*(path[0] - circle.center)), np.hypot(*(path[-1] - circle.center)))
            assert not touching or ends < circle.radius, f"a pipeline arrow crosses the rank at {circle.center}"
    matplotlib.pyplot.close(fig)


def test_group_plot_refuses_groups_that_miss_a_rank():
    with pytest.raises(ValueError, match="missing"):
        lesson.plot_parallel_groups({"tp": [[0, 1]], "dp": [[0], [1]], "pp": [[0], [1]]}, 4)


def _train_single(X, Y, lr):
    torch.manual_seed(0)
    model = lesson.TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for x, y in zip(X, Y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _train_dp_tp(X, Y, lr):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    torch.manual_seed(0)
    model = lesson.TinyGPT()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    dp_rank, out = mesh.get_local_rank("dp"), []
    for x, y in zip(X, Y):
        loss = F.cross_entropy(model(x.chunk(2)[dp_rank]).flatten(0, 1), y.chunk(2)[dp_rank].flatten())
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, group=mesh.get_group("dp"))
                g /= 2
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=mesh.get_group("dp"))
        out.append(loss.item() / 2)
    return out


@pytest.mark.slow
def test_dp_tp_training_follows_the_single_process():
    X, Y = lesson.make_data(3, 8)
    single = _train_single(X, Y, 0.5)
    for losses in labsupport.run(_train_dp_tp, X, Y, 0.5, world_size=4, timeout=180):
        assert max(abs(a - b) for a, b in zip(losses, single)) < 1e-5, (losses, single)


# --- context parallelism: ring attention (section 5) ---------------------------------------------------------------

def _softmax_attention(q, k, v, causal):
    """softmax(QKᵀ/√d)V over the whole sequence, written out: (B, S, H, D) each -> (B, S, H, D)."""
    q, k, v = (t.transpose(1, 2).double() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        S = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), -math.inf)
    return (scores.softmax(-1) @ v).transpose(1, 2).float()


def _update_without_rescaling(state, scores, v):
    """Planted bug: tracks the running maximum but never shrinks the old sum and output when it grows."""
    m, l, acc = state
    m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
    p = torch.exp(scores - m_new)
    return m_new, l + p.sum(-1, keepdim=True), acc + p @ v


def _update_mean_of_blocks(state, scores, v):
    """Planted bug: each block's own softmax, averaged over the blocks."""
    m, l, acc = state
    return m, l + 1, acc + scores.softmax(-1) @ v


def _ring(world, causal, update=lesson.online_softmax_update, heads=3):
    """The demo on ``world`` ranks (3 heads: a number Ulysses could not split over 2 or 4 ranks); returns the
    largest difference from the written-out attention, the per-rank reports, and the shapes."""
    torch.manual_seed(10 * world + causal)
    shape = (2, 4 * world, heads, 8)                              # (B, S, H, D): 4 positions per rank
    q, k, v = (torch.randn(shape) for _ in range(3))
    ranks = labsupport.run(lesson.ring_attention_on_ranks, q, k, v, causal, update, world_size=world, timeout=60)
    out = torch.cat([r["out"] for r in ranks], dim=1)
    return (out - _softmax_attention(q, k, v, causal)).abs().max().item(), ranks, shape


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_attention_matches_full_attention(world, causal):
    error, ranks, (B, S, H, D) = _ring(world, causal)
    assert error < 1e-5, f"ring attention on {world} ranks (causal={causal}) differs from full attention by {error}"
    sent = lesson.attention_comm_bytes(B, S, H, D, world)["ring"]["sent"]
    assert sent == 2 * (world - 1) * B * (S // world) * H * D * 4
    for rank, r in enumerate(ranks):
        assert r["kinds"] == ["recv", "send"], f"rank {rank} used {r['kinds']}: only point-to-point calls"
        assert r["bytes_sent"] == r["bytes_received"] == sent, (rank, r["bytes_sent"], r["bytes_received"], sent)
        held = [(rank - step) % world for step in range(world)]   # from the previous rank, one step at a time
        assert r["blocks"] == [(b, not causal or b <= rank) for b in held], (rank, r["blocks"])


@pytest.mark.parametrize("update", [_update_without_rescaling, _update_mean_of_blocks],
                         ids=["no-rescaling", "mean-of-blocks"])
def test_wrong_block_combination_is_rejected(update):
    """The comparison above can fail: a combination that is not the online softmax misses by far more than
    rounding, causal or not."""
    for causal in (False, True):
        error, _, _ = _ring(4, causal, update)
        assert error > 1e-2, f"{update.__name__} (causal={causal}) passed with error {error}"


def test_online_softmax_folds_blocks_into_the_softmax():
    """Folding two blocks of scores one after the other gives softmax over both, whatever their order."""
    torch.manual_seed(0)
    scores, v = 3 * torch.randn(1, 2, 5, 6), torch.randn(1, 2, 6, 4)
    expected = scores.softmax(-1) @ v
    for order in ((slice(0, 2), slice(2, 6)), (slice(2, 6), slice(0, 2))):
        m = torch.full((1, 2, 5, 1), -math.inf)
        state = (m, torch.zeros_like(m), torch.zeros(1, 2, 5, 4))
        for part in order:
            state = lesson.online_softmax_update(state, scores[..., part], v[..., part, :])
        torch.testing.assert_close(state[2] / state[1], expected)


def test_attention_comm_bytes():
    """B=2, S=16, H=4, D=8, float32 on 4 ranks: a shard is 1024 B; the ring and the all-gather send 6 shards,
    Ulysses 3; doubling S and P leaves Ulysses near 4 shards while the ring doubles."""
    four = lesson.attention_comm_bytes(2, 16, 4, 8, world=4)
    assert four["shard"] == 1024
    assert four["ring"] == {"sent": 6144, "kv_held": 4096}
    assert four["ulysses"] == {"sent": 3072, "kv_held": 2048}
    assert four["all_gather_kv"] == {"sent": 6144, "kv_held": 8192}
    eight = lesson.attention_comm_bytes(2, 32, 8, 8, world=8, itemsize=2)   # same shard in 16 bits, 8 heads
    assert eight["shard"] == 1024 and eight["ring"]["sent"] == 14 * 1024 and eight["ulysses"]["sent"] == 3584
    assert lesson.attention_comm_bytes(2, 12, 3, 8, world=4)["ulysses"] is None      # 4 does not divide 3 heads
    with pytest.raises(ValueError, match="multiple"):
        lesson.attention_comm_bytes(2, 10, 4, 8, world=4)


def test_ring_attention_refuses_a_sequence_that_does_not_split():
    q = torch.randn(1, 6, 2, 4)
    with pytest.raises(labsupport.WorkerError, match="multiple of the 4 ranks"):
        labsupport.run(lesson.ring_attention_on_ranks, q, q, q, world_size=4, timeout=60)


def test_demos_skip_at_once_while_an_exercise_fails():
    """08's demos wait for the exercises they run (``fixtures/gating.py``)."""
    from gating import assert_demos_gated

    assert_demos_gated("08_hybrid_parallel", 3)
