"""The measurements a notebook shows agree with the theory it states, when the course's own solutions run them.

These run the notebooks' own cells (setup, the answer cells filled with the solutions, the measurement cell) in
this process, so a regression in ``CommCounter`` or in a measurement cell shows up as a wrong number here instead
of a quietly wrong table in front of students.
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import demo_submissions as demo  # noqa: E402

from labsupport import visible  # noqa: E402

COLLECTIVES = ["broadcast", "reduce", "all_reduce", "gather", "all_gather", "scatter", "reduce_scatter", "all_to_all"]


def _python(source: str) -> str:
    """A cell's source without IPython's magic lines."""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("%"))


def _namespace_with_answers(aid: str, answers: list[str]) -> tuple[dict, list]:
    """Run the setup cell and the given answer cells (solution code) of ``aid``; return (namespace, cells)."""
    nb = demo.good(aid, course=demo.REPO)
    ns = {"__name__": "__main__"}  # functions defined here travel to the workers by value, as from a notebook
    exec(_python(nb.cells[demo.index(nb, "setup")].source), ns)
    for grade_id in answers:
        exec(nb.cells[demo.index(nb, grade_id)].source, ns)
        visible._RESULTS[grade_id] = {"solution": visible._Outcome(visible.PASSES)}  # as if its visible test passed
    return ns, nb.cells


def test_01_message_counts_match_the_simple_algorithms(capsys):
    ns, cells = _namespace_with_answers("01_collectives", COLLECTIVES)
    measuring = next(c for c in cells if c.cell_type == "code" and "def count_messages" in c.source)
    exec(_python(measuring.source), ns)
    assert ns["per_rank"] is not None, capsys.readouterr().out
    world, nbytes = ns["WORLD"], ns["NUMEL"] * 4
    assert sorted(ns["measured"]) == sorted(COLLECTIVES)
    for name in COLLECTIVES:
        expected = ns["simple_algorithm_messages"](name, world)
        assert ns["measured"][name] == expected, (name, ns["measured"][name], expected)
        sent = [ns["per_rank"][r][name][1] for r in range(world)]
        assert sent == [m * nbytes for m in expected], (name, sent)
    # the table states what a root and a leaf send: check the rows of the markdown against the same function
    assert ns["simple_algorithm_messages"]("all_reduce", world) == [world - 1] + [1] * (world - 1)
    assert ns["simple_algorithm_messages"]("broadcast", world) == [world - 1] + [0] * (world - 1)
    assert ns["simple_algorithm_messages"]("gather", world) == [0] + [1] * (world - 1)
    assert ns["simple_algorithm_messages"]("all_to_all", world) == [world - 1] * world
