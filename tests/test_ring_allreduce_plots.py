"""The plots of notebook 02 draw what they should (cheap structural checks; the PNGs were looked at by eye)."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

from labsupport.lessons import ring_allreduce as plots  # noqa: E402
from labsupport.lessons.ring_allreduce import plots as mod  # noqa: E402


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def test_reexported():
    for name in mod.__all__:  # the package re-exports its plots module
        assert getattr(plots, name) is getattr(mod, name)


def test_ring_states_follow_the_exercise_indexing():
    n = 4
    states = mod.ring_states(n)
    assert len(states) == 1 + 2 * (n - 1)
    everyone = tuple(range(n))
    after_rs = states[n - 1][1]
    for r in range(n):
        assert after_rs[r][r] == everyone, f"after the reduce-scatter rank {r} should hold the complete chunk {r}"
        # in reduce-scatter step 1 rank r sends chunk (r - 1) % n
        assert states[1][2][r] == (r - 1) % n
    assert all(cell == everyone for row in states[-1][1] for cell in row)


@pytest.mark.parametrize("n", [2, 4, 6])
def test_ring_steps_panels_and_arrows(n):
    fig = plots.plot_ring_steps(n)
    assert isinstance(fig, Figure)
    steps = 1 + 2 * (n - 1)
    drawn = [ax for ax in fig.axes if ax.get_title()]
    assert len(drawn) == steps
    assert "start" in drawn[0].get_title()
    assert "reduce-scatter step 1" in drawn[1].get_title() and "all-gather step" in drawn[-1].get_title()
    # one arrow per rank in every step panel, none at the start
    arrows = [sum(isinstance(p, FancyArrowPatch) for p in ax.patches) for ax in drawn]
    assert arrows == [0] + [n] * (steps - 1)
    ranks = [t.get_text() for t in drawn[0].texts if t.get_text().startswith("rank ")]
    assert ranks == [f"rank {r}" for r in range(n)]
    # the last panel: every cell holds the complete sum
    assert sum(t.get_text() == "\u03a3" for t in drawn[-1].texts) == n * n


@pytest.mark.parametrize("bad", [1, 7, 2.0, True, "4"])
def test_ring_steps_rejects_bad_world_size(bad):
    with pytest.raises(ValueError, match="from 2 to 6"):
        plots.plot_ring_steps(bad)


def test_traffic():
    fig = plots.plot_traffic({"parameter server": [(3, 3), (1, 1), (1, 1), (1, 1)],
                              "ring": [(1.5, 1.5)] * 4}, 1)
    assert len(fig.axes) == 2
    for ax in fig.axes:
        assert len(ax.patches) == 8  # sent and received bars for 4 ranks
        assert any(abs(line.get_ydata()[0] - 1.5) < 1e-12 for line in ax.get_lines())  # the 2(N-1)/N line


def test_bus_bandwidth():
    sizes = [2**12, 2**16, 2**20]
    fig = plots.plot_bus_bandwidth({"a, N=2": (2, sizes, [1e-4, 1e-3, 1e-2]),
                                    "b, N=4": (4, sizes, [2e-4, 2e-3, 2e-2])}, p2p=2e9)
    ax_t, ax_b = fig.axes
    assert len(ax_t.get_lines()) == 2 and len(ax_b.get_lines()) == 3  # + the point-to-point line
    # busbw of "a" at 1 MiB: 2^20 / 1e-2 * 2(1)/2 bytes/s
    assert abs(ax_b.get_lines()[0].get_ydata()[2] - 2**20 / 1e-2 / 1e9) < 1e-9


def test_measured_vs_predicted():
    fig = plots.plot_measured_vs_predicted({"ring": ([2, 4], [1e-3, 2e-3])},
                                           {"sim": ([2, 4, 8], [1e-3, 2e-3, 3e-3])}, 2**20)
    (ax,) = fig.axes
    assert len(ax.get_lines()) == 2 and "measured" in ax.get_title()
    fig = plots.plot_measured_vs_predicted({}, {"sim": ([2, 4], [1.0, 2.0])}, 2**30)
    assert "1 GiB: simulated" in fig.axes[0].get_title()
