"""The diagrams of notebooks 00 and 01 draw what they should (cheap structural checks; look at the PNGs by eye)."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from labsupport.lessons import collectives as plots  # noqa: E402
from labsupport.lessons import launch as launch_lesson  # noqa: E402
from labsupport.lessons import collectives as mod  # noqa: E402


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def _texts(ax):
    return [t.get_text() for t in ax.texts]


@pytest.mark.parametrize("name", mod.COLLECTIVE_NAMES)
def test_each_collective_has_before_and_after(name):
    fig = plots.plot_collective(name, world_size=3, root=1)
    assert isinstance(fig, Figure)
    before, after = fig.axes
    for ax in (before, after):
        assert [t for t in _texts(ax) if t.startswith("rank ")] == ["rank 0", "rank 1", "rank 2"]
    assert before.get_title() == "before" and after.get_title() == "after"


def test_cells_show_the_right_data():
    fig = plots.plot_collective("all_to_all", world_size=3)
    labels = [t for t in _texts(fig.axes[1]) if not t.startswith("rank ")]
    assert labels == ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2"]  # the transpose, rank by rank
    fig = plots.plot_collective("gather", world_size=3, root=2)
    assert _texts(fig.axes[1]).count("None") == 2
    fig = plots.plot_collective("reduce_scatter", world_size=2)
    assert "a1+b1" in _texts(fig.axes[1])
    # a sum cell is striped with one colour per contributor, plus its outline
    cells = [p for p in fig.axes[1].patches if isinstance(p, Rectangle)]
    assert len(cells) == 2 * (2 + 1)


def test_all_collectives_has_sixteen_panels():
    fig = plots.plot_all_collectives(world_size=4)
    assert isinstance(fig, Figure)
    assert len(fig.axes) == 16


def test_rank_layout_two_nodes_by_four():
    fig = launch_lesson.plot_rank_layout(2, 4)
    (ax,) = fig.axes
    texts = " ".join(_texts(ax))
    assert "RANK 7" in texts and "LOCAL_RANK 3" in texts and "NODE_RANK=1" in texts
    assert "10.0.0.1:29500" in texts
    assert len([p for p in ax.patches if type(p) is Rectangle]) == 8  # one slot per process
    assert "WORLD_SIZE = 8" in ax.get_title()


def test_comm_counts_bars_and_expected_ticks():
    measured = {"broadcast": [2, 0, 0], "reduce": [0, 1, 1]}
    fig = plots.plot_comm_counts(measured, expected=measured, what="messages sent")
    (ax,) = fig.axes
    assert len(ax.patches) == 6  # one bar per collective and rank
    assert len(ax.collections) == 3  # the expected ticks, one set per rank
    assert ax.get_ylabel() == "messages sent"


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: plots.plot_collective("allreduce"), "unknown collective 'allreduce'"),
        (lambda: plots.plot_collective("broadcast", world_size=0), "world_size must be an int from 1 to 8"),
        (lambda: plots.plot_collective("broadcast", world_size=3, root=3), "root must be a rank from 0 to 2"),
        (lambda: plots.plot_all_collectives(world_size=9), "world_size must be an int from 1 to 8"),
        (lambda: launch_lesson.plot_rank_layout(0, 4), "nnodes must be an int from 1 to 16"),
        (lambda: launch_lesson.plot_rank_layout(2, True), "nproc_per_node must be an int from 1 to 16"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()
