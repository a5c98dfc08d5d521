"""labsupport.lessons.fsdp: the parameter-memory recorder measures what is really alive, the small helpers, the
figures (in one process: no workers needed)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.nn as nn

from labsupport import CommCall
from labsupport.lessons import fsdp as lesson


class Holder(nn.Module):
    """A model whose 'parameters' are plain tensors hidden in the places a wrapper might keep them."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)                        # 12 + 3 floats = 60 bytes
        self.extra = {"cache": [torch.zeros(10)]}         # 40 bytes in a container
        secret = torch.zeros(5)                           # 20 bytes in a hook closure
        self.lin.register_forward_pre_hook(lambda mod, args: secret.sum() and None)


def test_reachable_tensors_follow_modules_containers_and_closures():
    model = Holder()
    paths = [path for path, _ in lesson.reachable_tensors(model)]
    assert any("weight" in p for p in paths) and any("cache" in p for p in paths)
    assert any("closure secret" in p for p in paths)
    assert lesson.ParamMemory(model).measure() == 60 + 40 + 20


def test_views_count_once_and_a_freed_storage_counts_zero():
    flat = torch.zeros(100)
    model = nn.Module()
    model.a, model.b = flat[:50].view(5, 10), flat[50:]
    mem = lesson.ParamMemory(model)
    assert mem.measure() == 400
    flat.untyped_storage().resize_(0)
    assert mem.measure() == 0


def test_parameters_kept_by_autograd_are_counted_until_backward():
    """A wrapper that 'frees' a gathered weight by dropping its references still holds it through the graph."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8, bias=False)
    gathered = lin.weight.detach().clone().requires_grad_()   # 256 bytes, as if all-gathered
    del lin._parameters["weight"]
    lin.weight = gathered * 1.0                               # a non-leaf view-like tensor on the graph
    mem = lesson.ParamMemory(lin, units={"lin": lin})
    with mem:
        out = lin(torch.randn(2, 8, requires_grad=True))   # the input's gradient needs the weight
        lin.weight = torch.empty(0)                          # dropped by the wrapper...
        after_forward = mem.sample("after forward")
        out.sum().backward()
    assert after_forward == 256                               # ...but autograd saved it for backward
    assert mem.measure() == 0                                 # gone once backward has used it
    assert mem.peak == 256
    phases = {phase for phase, _, _ in mem.samples}
    assert "forward lin" in phases and "backward lin" in phases


def test_unit_bytes_pad_each_unit_and_name_the_root():
    model = lesson.DemoNet([3, 5, 2])                         # block0: 20, block1: 12, gain: 2
    assert lesson.unit_bytes(model) == {"block0": 80, "block1": 48, "(root)": 8}
    assert lesson.unit_bytes(model, world_size=3) == {"block0": 84, "block1": 48, "(root)": 12}
    assert model(torch.randn(4, 3)).shape == (4, 2)


def test_ring_bytes_sent():
    calls = [CommCall(kind="all_gather_into_tensor", peer=None, group=(0, 1, 2, 3), nbytes=100),
             CommCall(kind="reduce_scatter_tensor", peer=None, group=(0, 1, 2, 3), nbytes=400),
             CommCall(kind="all_reduce", peer=None, group=(0, 1, 2, 3), nbytes=400),
             CommCall(kind="send", peer=1, group=(0, 1, 2, 3), nbytes=8)]
    assert lesson.ring_bytes_sent(calls, 4) == 300 + 300 + 600 + 8


@pytest.mark.parametrize("draw", ["shards", "schedule", "memory"])
def test_figures_draw(draw):
    import matplotlib.pyplot as plt

    if draw == "shards":
        ax = lesson.plot_shards({"a": 10, "b": 7, "(root)": 3}, world_size=3)
        assert len(ax.get_yticklabels()) == 3
    elif draw == "schedule":
        ax = lesson.plot_fsdp_schedule(num_units=3)
        assert ax.get_title()
    else:
        samples = [("start", "enter", 100), ("forward a", "save", 300), ("forward", "out", 100),
                   ("backward a", "use", 300), ("backward a", "use", 100)]
        ax = lesson.plot_param_memory({"rank 0": samples, "rank 1": samples}, bound=320, shards=100, unit="B")
        assert len(ax.lines) == 4
    plt.close("all")


def test_demos_skip_at_once_while_an_exercise_fails():
    """07's demos wait for the exercises they run (``fixtures/gating.py``)."""
    from gating import assert_demos_gated

    assert_demos_gated("07_fsdp", 3)
