"""labsupport.lessons.data_parallel and labsupport.plots: every plot returns a Figure with the expected axes and artists
(cheap checks); the one-process DP step behind the memory plot."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import labsupport.plots  # noqa: E402
from labsupport.lessons import data_parallel as plots  # noqa: E402
from labsupport.lessons.data_parallel import CATEGORIES, MemoryReport  # noqa: E402
from labsupport.timeline import Event  # noqa: E402


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def _bars(ax):
    return [c for c in ax.collections if isinstance(c, PolyCollection)]


def _rank(offset, overlapped):
    comm = [Event("all_reduce 4096 B", "comm", offset + (1.0 if overlapped else 3.0), offset + 3.5),
            Event("all_reduce 512 B", "comm", offset + (1.5 if overlapped else 3.0), offset + 3.2)]
    return [Event("forward", "compute", offset, offset + 1.0), Event("backward", "compute", offset + 1.0,
                                                                      offset + 3.0),
            Event("sync", "wait", offset + 3.0, offset + 3.6), Event("step", "compute", offset + 3.6,
                                                                    offset + 4.0)] + comm


def test_plot_timeline_one_axis_per_run_and_bars_per_span():
    runs = {"naive": [_rank(0, False), _rank(0.1, False)], "bucketed": [_rank(0, True), _rank(0.1, True)]}
    fig = labsupport.plots.plot_timeline(runs)
    assert isinstance(fig, Figure)
    assert len(fig.axes) == 2
    for ax in fig.axes:
        assert len(_bars(ax)) == 2 * 6  # 4 compute/wait spans + 2 comm spans per rank
        assert len(ax.get_yticklabels()) == 2
    # overlapped comm: the label reports a hidden fraction; the naive one 0%
    assert "0% of comm hidden" in fig.axes[0].get_yticklabels()[0].get_text()
    assert "100% of comm hidden" not in fig.axes[0].get_yticklabels()[0].get_text()


def test_plot_timeline_accepts_a_plain_list_and_dicts():
    events = [[{"name": "F0", "kind": "compute", "start": 0.0, "end": 1.0},
               {"name": "B0", "kind": "compute", "start": 1.0, "end": 2.0}]]
    fig = labsupport.plots.plot_timeline(events, title="pipeline", unit="s")
    assert len(fig.axes) == 1 and len(_bars(fig.axes[0])) == 2
    assert fig.axes[0].get_title(loc="left") == "pipeline"


def test_plot_dp_vs_ddp_two_panels():
    fig = plots.plot_dp_vs_ddp(num_devices=4)
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    assert len(fig.axes[0].patches) >= 4 and len(fig.axes[1].patches) >= 8  # boxes and arrows


def test_plot_dp_memory_bars_per_device():
    per = {c: 1 << 20 for c in CATEGORIES}
    report = MemoryReport("dp", bytes=[dict(per, **{"optimizer state": 8 << 20})] + [per] * 3,
                          seconds=[{"forward": 0.1, "backward": 0.2, "master only": 0.3}] * 4)
    ddp = [{"bytes": per, "seconds": {"forward": 0.1, "backward": 0.2, "optimizer": 0.05}}] * 4
    fig = plots.plot_dp_memory(report, ddp)
    assert isinstance(fig, Figure) and len(fig.axes) == 4
    assert len(fig.axes[0].patches) == 4 * len(CATEGORIES)
    assert len(fig.axes[2].patches) == 4 * 3  # forward, backward, master only
    only_dp = plots.plot_dp_memory(report)
    assert len(only_dp.axes) == 2


def test_plot_bucket_layout_with_and_without_measured():
    buckets = [[("4.bias", 16), ("4.weight", 1024)], [("2.weight", 4096)], [("0.bias", 64)]]
    fig = plots.plot_bucket_layout(buckets, cap_bytes=2000)
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    assert len(fig.axes[0].patches) == 3 + 4  # a frame per bucket, a block per parameter
    fig = plots.plot_bucket_layout(buckets, cap_bytes=2000, measured=[1040, 4096, 64])
    assert len(fig.axes[0].patches) == 3 + 4 + 3


def test_plot_step_sweep_and_loss_curves():
    fig = plots.plot_step_sweep([0.1, 1, 10], {"ours": [0.05, 0.04, None], "naive": 0.06})
    assert isinstance(fig, Figure) and len(fig.axes[0].lines) == 2
    assert len(fig.axes[0].lines[0].get_xdata()) == 2  # the missing point is skipped
    fig = plots.plot_loss_curves({"sync": [1.0, 0.5], "stale": [1.0, 2.0]})
    assert isinstance(fig, Figure) and len(fig.axes[0].lines) == 2


# ---------------------------------------------------------------------------------------------------------------
# the one-process DP step behind the memory plot


def test_dp_step_trains_like_one_process_and_loads_the_master():
    import copy

    import torch
    import torch.nn.functional as F

    from labsupport.lessons import data_parallel as dp

    torch.manual_seed(0)
    tokens, targets = torch.randint(0, 50, (8, 5)), torch.randint(0, 50, (8, 5))
    master = dp.TinyLM(vocab=50, dim=8, hidden=16)
    single = copy.deepcopy(master)
    report = dp.dp_step(master, torch.optim.Adam(master.parameters(), lr=0.01), tokens, targets, num_replicas=4)
    opt = torch.optim.Adam(single.parameters(), lr=0.01)
    F.cross_entropy(single(tokens).flatten(0, -2), targets.flatten()).backward()
    opt.step()
    for a, b in zip(master.parameters(), single.parameters()):
        torch.testing.assert_close(a, b)
    assert len(report.bytes) == 4 and len(report.seconds) == 4
    assert report.total(0) > 2 * report.total(1)
    assert report.bytes[1]["optimizer state"] == 0 and report.bytes[0]["optimizer state"] > 0
    assert report.seconds[1]["master only"] == 0 and report.seconds[0]["master only"] > 0


@pytest.mark.slow
def test_ddp_rank_report_is_level():
    import torch

    import labsupport
    from labsupport.lessons import data_parallel as dp

    tokens, targets = torch.randint(0, 50, (8, 5)), torch.randint(0, 50, (8, 5))
    reports = labsupport.run(dp.ddp_rank_report, dp.TinyLM, tokens, targets, world_size=2)
    assert reports[0]["bytes"] == reports[1]["bytes"]
    params = reports[0]["bytes"]["parameters"]
    assert 2 * params <= reports[0]["bytes"]["optimizer state"] <= 2 * params + 1024  # Adam: two moments + steps
    assert reports[0]["bytes"]["communication buffers"] == reports[0]["bytes"]["gradients"]  # DDP's bucket buffers


def test_the_lesson_modules_leave_the_exercises_to_the_student():
    """03's exercises (broadcast_parameters, average_gradients, OverlapDDP, BucketedDDP) are the student's: the lesson
    modules students receive broadcast and all-reduce nowhere, and hook gradients only in ``record_ready``, the visible
    test's recorder of when each gradient was ready, which communicates nothing (the DDP rank of the memory plot is
    PyTorch's own DistributedDataParallel)."""
    import ast
    from pathlib import Path

    from labsupport.lessons import data_parallel

    def calls(node):
        return {n.func.attr for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}

    hooks = {"register_post_accumulate_grad_hook", "register_hook"}
    for path in sorted(Path(data_parallel.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        recorders = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "record_ready"]
        for recorder in recorders:
            assert not calls(recorder) & {"broadcast", "all_reduce"}, path
            tree.body = [n for n in tree.body if n is not recorder]
        assert not calls(tree) & ({"broadcast", "all_reduce"} | hooks), path
    assert "DistributedDataParallel(" in Path(data_parallel.dp.__file__).read_text()


def _half_used_model():
    """A model whose forward uses only its first layer: the second layer's parameters get no gradient."""
    import torch.nn as nn

    class HalfUsed(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    return HalfUsed()


def _two_steps_with_an_unused_parameter():
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_half_used_model())
    model(torch.randn(2, 4)).sum().backward()          # the first step goes through
    try:
        model(torch.randn(2, 4)).sum().backward()      # the next forward finds the first reduction unfinished
    except RuntimeError as exc:
        return str(exc)
    return None


def test_torch_ddp_raises_at_the_next_iteration_for_a_parameter_without_gradient():
    """What notebook 03 says where BucketedDDP counts a missing gradient as zeros: PyTorch's DDP with its default
    find_unused_parameters=False raises at the next iteration's forward."""
    import labsupport

    for message in labsupport.run(_two_steps_with_an_unused_parameter, world_size=2, timeout=60):
        assert message and message.startswith("Expected to have finished reduction in the prior iteration"), message


def test_launched_late_reads_when_each_all_reduce_was_issued():
    """``launched_late`` (03's visible tests): each bucket whose gradients were all ready before a gradient must
    have been issued by then; the one that gradient completes may follow (another kind of hook runs later)."""
    buckets = [["c", "b"], ["a"]]
    assert plots.launched_late([("c", 0), ("b", 0), ("a", 1)], buckets) is None          # launched as they complete
    assert plots.launched_late([("c", 0), ("b", 1), ("a", 1)], buckets) is None
    said = plots.launched_late([("c", 0), ("b", 0), ("a", 0)], buckets)                  # held back to the end
    assert said.startswith("when the gradient of 'a' was ready, 0 all-reduce(s) had been issued, but 1 bucket(s) "
                           "were complete before it (e.g. ['c', 'b'])"), said
