"""Notebook 03, section 7, tells how torch's DistributedDataParallel buckets gradients; this test runs DDP and checks it.

The notebook counts DDP's all-reduces with a communication hook (PyTorch's ``allreduce_hook``, which calls
``dist.all_reduce`` from Python, where ``CommCounter`` sees it) for its 6-layer MLP of width 256 with a 0.3 MB cap
and with the default cap, and its text states what comes out. Here the same model (the notebook's own
``make_mlp``, from its lesson module) runs under DDP on 2 gloo ranks with the same hook, plus a record of the
parameters in each bucket, and every statement of the text is asserted: when torch changes its bucketing, this test
fails instead of the text going stale. The statements are quoted from the notebook too, so that rewording them
means looking here.
"""

import json
import re
from pathlib import Path

import pytest

import labsupport
from autograder.checks.data_parallel import expected_buckets

NOTEBOOK = Path(__file__).resolve().parent.parent / "solutions" / "03_data_parallel" / "03_data_parallel.ipynb"

WIDTH, DEPTH = 256, 6
LAYER = WIDTH * WIDTH * 4 + WIDTH * 4          # bytes of one Linear(256, 256): weight and bias in float32
MODEL = DEPTH * LAYER
MiB = 2**20


def _cells():
    return json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]


def _text(cell) -> str:
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


def _section_7() -> tuple[str, str]:
    """(the code of section 7's comparison cell, the markdown after it, whitespace collapsed)."""
    cells = _cells()
    start = next(i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                 and "## 7. Compared with `torch.nn.parallel.DistributedDataParallel`" in _text(c))
    code = next(c for c in cells[start:] if c["cell_type"] == "code")
    after = cells[cells.index(code) + 1]
    assert after["cell_type"] == "markdown"
    return _text(code), " ".join(_text(after).split())


def _notebook_make_mlp():
    """The ``make_mlp`` notebook 03 trains (from its lesson module), so a change of the model shows up here."""
    from labsupport.lessons.data_parallel import make_mlp

    return make_mlp


def _ddp_layouts(make_mlp, configs, steps):
    """On every rank: for each DDP keyword set, per step, the all-reduce sizes ``CommCounter`` saw and the
    parameter names of each bucket in the order DDP handed them to the hook; and DDP's bucket cap in bytes."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    rank = dist.get_rank()
    out = {}
    for label, kwargs in configs.items():
        model = make_mlp(WIDTH, depth=DEPTH, seed=rank)
        names = {p.data_ptr(): name for name, p in model.named_parameters()}
        ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
        buckets = []

        def counting_hook(state, bucket, buckets=buckets, names=names):
            buckets.append([names[p.data_ptr()] for p in bucket.parameters()])
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counting_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        per_step = []
        for _ in range(steps):
            buckets.clear()
            with labsupport.CommCounter() as cc:
                ddp(torch.randn(16, WIDTH, generator=gen)).pow(2).mean().backward()
            per_step.append(([c.nbytes for c in cc.calls if c.kind == "all_reduce"], list(buckets)))
            opt.step()
            opt.zero_grad()
        out[label] = {"steps": per_step, "cap": ddp.bucket_bytes_cap, "grad_as_view": ddp.gradient_as_bucket_view,
                      # the flag was called broadcast_buffers before torch 2.13 renamed it
                      "sync_buffers": getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None))}
    out["first bucket bytes"] = dist._DEFAULT_FIRST_BUCKET_BYTES
    return out


@pytest.fixture(scope="module")
def layouts():
    configs = {
        "cap 0.3": {"bucket_cap_mb": 0.3},                       # the notebook's first run
        "default": {},                                            # its second run
        "explicit 25": {"bucket_cap_mb": 25},                     # "with an explicit cap, every bucket gets that cap"
        "find unused": {"find_unused_parameters": True},          # "(unless find_unused_parameters=True)"
    }
    results = labsupport.run(_ddp_layouts, _notebook_make_mlp(), configs, 3, world_size=2, backend="gloo",
                             timeout=120)
    assert results[0] == results[1], "the two ranks saw different buckets"
    return results[0]


def _layers(names) -> list:
    """Layer indices (of the Sequential) in the order their parameters appear, each once."""
    return list(dict.fromkeys(int(n.split(".")[0]) for n in names))


def test_notebook_still_runs_this_experiment():
    code, _ = _section_7()
    assert "lesson.make_mlp(256, depth=6, seed=rank)" in code
    assert "for cap in (0.3, None):" in code
    assert "register_comm_hook(None, allreduce_hook)" in code
    make_mlp = _notebook_make_mlp()
    assert sum(p.numel() * 4 for p in make_mlp(WIDTH, depth=DEPTH).parameters()) == MODEL


def test_first_step_is_one_bucket(layouts):
    _, text = _section_7()
    assert ("in the first step DDP reduces everything in a single all-reduce (unless `find_unused_parameters=True`, "
            "which keeps a layout made from the registration order and never rebuilds it)") in text
    stated = re.search(r"records the order the gradients became ready, and \*\*rebuilds\*\* its buckets", text)
    assert stated
    for label in ("cap 0.3", "default", "explicit 25"):
        sizes, buckets = layouts[label]["steps"][0]
        assert sizes == [MODEL], (label, sizes)
        assert _layers(buckets[0]) == [0, 2, 4, 6, 8, 10], (label, buckets)   # registration order, not measured
        # the rebuilt buckets of step 2 follow the order the gradients became ready: the last layer first
        assert _layers(sum(layouts[label]["steps"][1][1], [])) == [10, 8, 6, 4, 2, 0], label
    unused = layouts["find unused"]["steps"]
    assert len(unused[0][0]) > 1 and unused[0] == unused[1] == unused[2], unused
    registration = [f"{2 * k}.{kind}" for k in range(DEPTH) for kind in ("weight", "bias")]
    spans = [[registration.index(name) for name in bucket] for bucket in unused[0][1]]
    for span in spans:  # each bucket a run of consecutive parameters in registration order...
        assert span == list(range(span[0], span[0] + len(span))), spans
    assert [span[0] for span in spans] == sorted((span[0] for span in spans), reverse=True), spans  # ...last first


def test_explicit_cap_closes_a_bucket_once_reached(layouts):
    _, text = _section_7()
    assert "DDP closes a bucket once it has *reached* the cap, so a 0.3 MB cap gives buckets of two layers" in text
    assert "our rule closes it *before* it would go past, so ours hold about one layer each" in text
    cap = layouts["cap 0.3"]["cap"]
    assert cap == int(0.3 * MiB) and LAYER < cap < 2 * LAYER
    for step in (1, 2):
        sizes, buckets = layouts["cap 0.3"]["steps"][step]
        assert sizes == [2 * LAYER] * 3, sizes                     # two layers each: past the cap
        assert [_layers(b) for b in buckets] == [[10, 8], [6, 4], [2, 0]], buckets
    ours = expected_buckets(_notebook_make_mlp()(WIDTH, depth=DEPTH), 0.3)
    assert len(ours) == DEPTH and all(sum(n for _, n in b) <= cap for b in ours)


def test_default_cap_and_small_first_bucket(layouts):
    _, text = _section_7()
    assert "With the default 25 MB cap, DDP caps the first bucket at 1 MB (`dist._DEFAULT_FIRST_BUCKET_BYTES`)" in text
    assert "with an explicit cap, every bucket gets that cap" in text
    assert ("the last four layers of the model fill the 1 MB first bucket and the remaining two share a 25 MB one; "
            "ours, with a single 25 MB cap, is one bucket") in text
    by_torch = layouts["default"]
    assert by_torch["cap"] == 25 * MiB                 # the cap of every bucket after the first
    for step in (1, 2):
        sizes, buckets = by_torch["steps"][step]
        assert sizes == [4 * LAYER, 2 * LAYER], sizes
        assert [_layers(b) for b in buckets] == [[10, 8, 6, 4], [2, 0]], buckets
    # an explicit 25 MB cap has no small first bucket: one bucket for the whole 1.5 MB model
    assert layouts["explicit 25"]["steps"][1][0] == [MODEL]
    assert len(expected_buckets(_notebook_make_mlp()(WIDTH, depth=DEPTH), 25.0)) == 1


def test_first_bucket_constant(layouts):
    import torch.distributed as dist

    assert dist._DEFAULT_FIRST_BUCKET_BYTES == layouts["first bucket bytes"] == MiB
    assert 3 * LAYER < MiB <= 4 * LAYER          # so four layers are needed to reach it


def test_reducer_defaults_named_in_the_text(layouts):
    import inspect

    import torch.nn as nn

    _, text = _section_7()
    default = layouts["default"]
    assert default["grad_as_view"] is False
    assert "(`gradient_as_bucket_view=True`, off by default)" in text
    assert default["sync_buffers"] is True
    assert "it copies rank 0's buffers to the other ranks before every forward (on by default:" in text
    params = inspect.signature(nn.parallel.DistributedDataParallel).parameters
    assert ("forward_sync_buffers" in params) == ("`forward_sync_buffers`" in text)
    assert params["find_unused_parameters"].default is False
    assert params["bucket_cap_mb"].default is None     # None means 25 MB, with the 1 MB first bucket
