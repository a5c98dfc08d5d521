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


# ----------------------------------------------------------------------------------------------------------------
# Notebooks 01-03: demos that run the student's code on workers ask require_visible first


def _gating_problems(path, unused=None):
    """Every code cell that runs an exercise on workers (directly, or through a function of an earlier cell that
    uses one) calls ``labsupport.require_visible`` for each exercise it uses, before its first ``labsupport.run``
    after the exercise is first mentioned: a deadlocking answer makes the demo skip at once, not wait out its time
    limit. ``unused``: {text of a demo cell: exercises that a function it calls mentions but it does not run}.
    Returns the problems found and the number of demos."""
    import re
    from pathlib import Path

    import nbformat

    nb = nbformat.read(Path(__file__).resolve().parent.parent / path, as_version=4)
    exercises = {c.metadata["nbgrader"]["grade_id"] for c in nb.cells
                 if c.metadata.get("nbgrader", {}).get("solution")}
    uses = {}  # function defined in a demo cell -> the exercises it runs

    def mentioned(source):
        found = set()
        for name in exercises:
            if re.search(rf"(?<![\w.\"']){re.escape(name)}\b(?![\"'])", source):
                found.add(name)
        for fn, names in uses.items():
            if re.search(rf"(?<![\w.]){re.escape(fn)}\b", source):
                found |= names
        return found

    problems, demos = [], 0
    for cell in nb.cells:
        source = cell.source
        if (cell.cell_type != "code" or cell.metadata.get("nbgrader", {}).get("solution")
                or cell.metadata.get("nbgrader", {}).get("grade") or source.startswith("%%visible_test")):
            continue
        needed = mentioned(source)
        for match in re.finditer(r"^def (\w+)\(", source, flags=re.M):
            end = re.search(r"\n(?=\S)", source[match.end():])  # the next line that is not indented
            body = source[match.start(): match.end() + end.start()] if end else source[match.start():]
            if mentioned(body):
                uses[match.group(1)] = mentioned(body)
        if not needed or "labsupport.run(" not in source:
            continue
        demos += 1
        needed -= next((names for marker, names in (unused or {}).items() if marker in source), set())
        first = min(m.start() for name in needed
                    for m in [re.search(rf"(?<![\w.\"']){re.escape(name)}\b(?![\"'])", source)] +
                    [re.search(rf"(?<![\w.]){re.escape(fn)}\b", source) for fn, names in uses.items()
                     if name in names] if m)
        runs = [m.start() for m in re.finditer(r"labsupport\.run\(", source) if m.start() > first]
        gates = [m.start() for m in re.finditer(r"labsupport\.require_visible\(", source)]
        if runs and (not gates or min(gates) > runs[0]):
            problems.append(f"runs the student's code before labsupport.require_visible: {source[:120]!r}")
        for name in needed:
            if f'require_visible("{name}")' not in source and not (
                    f'"{name}"' in source and re.search(r"require_visible\((?!\")", source)):
                problems.append(f"does not ask require_visible about {name}: {source[:120]!r}")
        if "finish the exercise" not in source:
            problems.append(f"does not tell the student to finish the exercises: {source[:120]!r}")
    return problems, demos


@pytest.mark.parametrize("path, demos, unused", [
    ("solutions/01_collectives/01_collectives.ipynb", 2, None),
    ("solutions/02_ring_allreduce/02_ring_allreduce.ipynb", 3, None),
    # the bucket-size sweep runs wrapper("naive") and wrapper("bucketed") only
    ("solutions/03_data_parallel/03_data_parallel.ipynb", 5, {"CAPS_MB = ": {"OverlapDDP"}}),
])
def test_demos_of_01_to_03_skip_at_once_while_an_exercise_fails(path, demos, unused):
    problems, found = _gating_problems(path, unused)
    assert not problems, "\n".join(problems)
    assert found == demos
