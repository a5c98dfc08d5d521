"""labsupport.lessons.tensor_parallel: the dense modules, the byte and volume measurements, the plots."""

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.nn as nn

from labsupport.comm import CommCall
from labsupport.lessons import tensor_parallel as lesson


def test_mlp_shapes_and_names():
    mlp = lesson.MLP(8)
    assert (mlp.fc1.in_features, mlp.fc1.out_features, mlp.fc2.out_features) == (8, 32, 8)
    assert lesson.MLP(8, ffn_hidden=12).fc1.out_features == 12
    assert mlp(torch.randn(3, 5, 8)).shape == (3, 5, 8)


def test_attention_runs_on_a_subset_of_heads():
    """The forward reads the number of heads from the projections' width: rank r's heads alone give rank r's part."""
    torch.manual_seed(0)
    attn = lesson.SelfAttention(12, num_heads=4)
    x = torch.randn(2, 5, 12)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    full = attn.attend(q, k, v)
    half = attn.attend(q[..., :6], k[..., :6], v[..., :6])     # heads 0 and 1
    torch.testing.assert_close(half, full[..., :6])
    with pytest.raises(ValueError, match="10"):
        lesson.SelfAttention(10, num_heads=4)


def test_attention_is_causal():
    torch.manual_seed(0)
    attn = lesson.SelfAttention(8, num_heads=2)
    x = torch.randn(1, 6, 8)
    y = attn(x)
    x2 = x.clone()
    x2[:, 4:] += 1.0                                   # change the future: the first four positions stay the same
    torch.testing.assert_close(attn(x2)[:, :4], y[:, :4])


def test_transformer_layer_swaps_blocks():
    layer = lesson.TransformerLayer(8, num_heads=2)
    assert layer(torch.randn(2, 3, 8)).shape == (2, 3, 8)
    layer.mlp = nn.Identity()
    assert layer(torch.randn(2, 3, 8)).shape == (2, 3, 8)


def test_tensor_bytes_counts_storages_once_at_full_size():
    w = torch.randn(8, 4)
    m = nn.Module()
    m.shard = nn.Parameter(w.chunk(2, 0)[0])          # a view: keeps all of w alive
    assert lesson.tensor_bytes(m).total == w.numel() * 4
    m.shard = nn.Parameter(w.chunk(2, 0)[0].clone())  # a copy: only the shard
    assert lesson.tensor_bytes(m).total == w.numel() * 2
    m.register_buffer("buf", torch.zeros(3))
    m.extra = [torch.zeros(5), {"k": torch.zeros(7)}]  # plain attributes, inside containers
    m.alias = m.shard                                 # the same storage again: counted once
    found = lesson.tensor_bytes(m)
    assert found.total == (16 + 3 + 5 + 7) * 4
    assert "extra[1]['k']" in found.largest(5)


def test_tensor_bytes_walks_submodules():
    mlp = lesson.MLP(4)
    assert lesson.tensor_bytes(mlp).total == sum(p.numel() * 4 for p in mlp.parameters())


def test_per_device_bytes_uses_ring_costs():
    calls = [CommCall("all_reduce", None, (0, 1, 2, 3), 4000), CommCall("all_gather_into_tensor", None, (), 1000),
             CommCall("reduce_scatter_tensor", None, (), 4000), CommCall("barrier", None, (), 0)]
    # all-reduce: 2(t-1)/t * 4000 = 6000; all-gather: (t-1) * 1000 = 3000; reduce-scatter: (t-1)/t * 4000 = 3000
    assert lesson.per_device_bytes(calls, 4) == pytest.approx(12000)
    assert lesson.per_device_bytes(calls, 1) == 0


def test_narayanan_formula():
    # 8 b s h (t-1)/t elements of 4 bytes
    assert lesson.narayanan_layer_bytes(3, 8, 48, 2) == 8 * 3 * 8 * 48 * 0.5 * 4
    assert lesson.narayanan_layer_bytes(1, 1, 1, 1) == 0
    assert lesson.narayanan_layer_bytes(1, 2, 3, 4, element_size=2) == 8 * 6 * 0.75 * 2
    # four all-reduces of b*s*h elements with ring costs give the formula
    calls = [CommCall("all_reduce", None, (), 3 * 8 * 48 * 4)] * 4
    assert lesson.per_device_bytes(calls, 4) == pytest.approx(lesson.narayanan_layer_bytes(3, 8, 48, 4))


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_plot_blocking_draws_one_block_per_rank(t):
    fig = lesson.plot_blocking(t)
    texts = [txt.get_text() for ax in fig.axes for txt in ax.texts]
    for r in range(t):
        assert any(f"A_{r}" in s for s in texts), texts
    assert any("sum of partials" in s for s in texts)
    matplotlib.pyplot.close(fig)


def test_plot_memory_and_volume():
    fig = lesson.plot_memory([1, 2, 4], [400, 210, 110], 400, weights_only=[380, 190, 95])
    assert len(fig.axes[0].lines) == 3
    fig2 = lesson.plot_volume([2, 4], [100.0, 150.0], [100.0, 150.0])
    assert len(fig2.axes[0].patches) == 4
    matplotlib.pyplot.close("all")


def test_demos_skip_at_once_while_an_exercise_fails():
    """04's demos wait for the layers they run: with a deadlocking copy_to_tp they skip at once instead of each
    waiting out its 60 to 90 s limit (``fixtures/gating.py``)."""
    from gating import assert_demos_gated

    assert_demos_gated("04_tensor_parallel", 3)
