"""labsupport.lessons.hybrid_parallel: the demo model trains and splits as the notebook assumes, the published
configurations are consistent with the papers' parameter counts, and every figure draws.

The training test runs the notebook's recipe in small: the single-process TinyGPT against DP × TP on 4 real ranks
(parallelize_module over a tensor-parallel sub-mesh, gradients averaged over the data-parallel group).
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


def test_plots_draw():
    groups = {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
              "pp": [[0, 4], [1, 5], [2, 6], [3, 7]]}
    for fig in (lesson.plot_parallel_groups(groups, 8),
                lesson.plot_loss_curves({"a": [3, 2, 1], "b": [3, 2, 1]}),
                lesson.plot_all_to_all([[0, 64], [128, 0]]),
                lesson.plot_memory_plan([("x", {"model_state": 40e9, "activations": 50e9})], 80e9)):
        assert fig.axes
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


def test_dp_tp_training_follows_the_single_process():
    X, Y = lesson.make_data(3, 8)
    single = _train_single(X, Y, 0.5)
    for losses in labsupport.run(_train_dp_tp, X, Y, 0.5, world_size=4, timeout=180):
        assert max(abs(a - b) for a, b in zip(losses, single)) < 1e-5, (losses, single)
