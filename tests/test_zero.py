"""labsupport.lessons.zero: the paper's numbers, the byte counting, the traffic accounting and the plots."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import nbformat
import pytest
import torch
import torch.nn as nn

from autograder.checks.zero import reference_model_state_bytes
from labsupport.comm import CommCall
from labsupport.lessons import zero as lesson


def test_paper_table_matches_the_formulas_as_printed():
    """Every printed entry is the formula truncated or rounded to the digits shown."""
    for (psi, n), printed in lesson.PAPER_TABLE1.items():
        for stage, value in zip((1, 2, 3), printed):
            exact = reference_model_state_bytes(psi, n, stage) / 1e9
            assert abs(exact - value) <= max(1.0, 0.01 * value), (psi, n, stage, exact, value)
    for stage, value in enumerate(lesson.PAPER_FIGURE1["gb"]):
        assert reference_model_state_bytes(7.5e9, 64, stage) / 1e9 == pytest.approx(value, abs=0.06)


def test_held_bytes_counts_each_kind_once():
    model = nn.Linear(10, 4)  # 44 parameters
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 10)).sum().backward()
    opt.step()
    held = lesson.held_bytes(model.parameters(), opt)
    assert held["parameters"] == 44 * 4
    assert held["gradients"] == 44 * 4
    assert held["optimizer state"] == 2 * 44 * 4 + 2 * 4  # exp_avg, exp_avg_sq, and a 4-byte step per tensor
    assert held["optimizer copies"] == 0


def test_held_bytes_finds_nested_optimizers_and_copies():
    model = nn.Linear(6, 2)

    class Wrapper:
        def __init__(self):
            self.shard = torch.zeros(5)
            self.inner = {"opts": [torch.optim.SGD([self.shard], lr=0.1, momentum=0.9)]}

    w = Wrapper()
    w.shard.grad = torch.ones(5)
    w.inner["opts"][0].step()
    assert lesson.find_optimizers(w) == w.inner["opts"]
    held = lesson.held_bytes(model.parameters(), w)
    assert held == {"parameters": 14 * 4, "gradients": 5 * 4, "optimizer state": 5 * 4, "optimizer copies": 5 * 4}


def test_held_bytes_counts_shared_storage_once():
    flat = torch.zeros(12, requires_grad=False)
    a, b = flat[:6].view(2, 3), flat[6:]
    assert lesson.held_bytes([a, b], None)["parameters"] == 48


def test_traffic_uses_the_papers_accounting():
    calls = [CommCall("all_reduce", None, (0, 1, 2, 3), 400), CommCall("reduce", None, (0, 1, 2, 3), 100),
             CommCall("broadcast", None, (0, 1, 2, 3), 100), CommCall("reduce_scatter", None, (0, 1, 2, 3), 400),
             CommCall("all_gather", None, (0, 1, 2, 3), 100), CommCall("barrier", None, (0, 1, 2, 3), 0)]
    assert lesson.traffic_bytes(calls, 4) == 800 + 100 + 100 + 400 + 400
    assert lesson.traffic_bytes([], 4) == 0


def test_measure_net_size_and_activation_bytes():
    model = lesson.MeasureNet.make(seed=0)
    params = [p.numel() for p in model.parameters()]
    assert sum(params) == 72394 and max(params) == 9216
    x = torch.randn(8, 64)
    fp32 = lesson.activation_bytes(model, x)
    bf16 = lesson.activation_bytes(model, x, autocast_dtype=torch.bfloat16)
    assert 0 < bf16["activations"] < fp32["activations"]
    assert fp32["weight copies"] == 0 and fp32["parameters"] > 0          # fp32 backward uses the weights themselves
    assert bf16["weight copies"] >= 2 * 9216 and bf16["parameters"] == 0   # autocast keeps 16-bit casts instead
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("world_size", [2, 4])
def test_plots_draw(world_size):
    fig = lesson.plot_sharding(world_size=world_size)
    assert len(fig.axes) == 4
    gpus = [1, 2, 4]
    fig = lesson.plot_memory_vs_gpus(gpus, {"a": [1e9, 5e8, 2.5e8]}, title="t")
    assert len(fig.axes[0].lines) >= 1
    rows = [{"label": "x", "measured": {"parameters": 10, "gradients": 5}, "calculated": 15}]
    fig = lesson.plot_measured(rows)
    assert fig.axes[0].get_ylabel() == "KiB per rank"
    matplotlib.pyplot.close("all")


NOTEBOOK = Path(__file__).resolve().parent.parent / "solutions/06_zero/06_zero.ipynb"


def _cells(grade_id=None):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    if grade_id is None:
        return nb.cells
    return next(c.source for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def _visible_test_error(answer_id: str, answer: str) -> str:
    """Run notebook 06's setup, the solutions before ``answer_id``, ``answer`` in its place and the visible test of
    ``answer_id``, in a real kernel; the visible test's error ("" when it passes)."""
    from nbclient import NotebookClient

    cells = []
    for cell in _cells():
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        if gid == answer_id:
            cells += [answer, _cells(f"test_{answer_id}_visible")]
            break
        if gid == "setup" or cell.metadata.get("nbgrader", {}).get("solution"):
            cells.append(cell.source)
    run = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    run.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(run, timeout=240, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return "".join(f"{o.ename}: {o.evalue}" for o in run.cells[-1].outputs if o.output_type == "error")


GREEDY = """        self.owner = {}
        loads = [0] * self.world_size
        for p in sorted(self.params, key=lambda p: p.numel(), reverse=True):   # largest first (a stable sort)
            r = loads.index(min(loads))                                         # the least-loaded rank
            self.owner[p] = r
            loads[r] += p.numel()
"""
ROUND_ROBIN = "        self.owner = {p: i % self.world_size for i, p in enumerate(self.params)}\n"


@pytest.mark.usefixtures("kernels_share_a_fork_server")
@pytest.mark.slow
def test_the_visible_test_names_round_robin_owners_unbalanced():
    """Owners dealt out in turn: AdamW's weights are still right (the first case passes), the shares are not."""
    solution = _cells("ShardedOptimizer")
    assert GREEDY in solution
    error = _visible_test_error("ShardedOptimizer", solution.replace(GREEDY, ROUND_ROBIN))
    assert "rank 0 owns 256 of the 288 elements" in error and "the owners are unbalanced" in error, error


@pytest.mark.usefixtures("kernels_share_a_fork_server")
@pytest.mark.slow
def test_the_visible_test_of_ShardedOptimizer_passes_on_the_solution():
    assert _visible_test_error("ShardedOptimizer", _cells("ShardedOptimizer")) == ""


def test_demos_skip_at_once_while_an_exercise_fails():
    """06's demos wait for the optimizers they run (``fixtures/gating.py``)."""
    from gating import assert_demos_gated

    assert_demos_gated("06_zero", 2)
