"""``%%visible_test`` and ``require_passed`` in a real kernel: Run All goes past an exercise not written yet, stops
at a wrong one, and nothing is swallowed while grading; Validate (``NBGRADER_VALIDATING=1``) fails until the visible
tests pass."""

import os

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

SETUP = "import labsupport\nimport torch.distributed as dist\n%load_ext labsupport"


def _notebook(answer: str, visible: str, grade: str = 'labsupport.require_passed("f")') -> nbformat.NotebookNode:
    cells = [SETUP, answer, f"%%visible_test f\n{visible}", grade, 'print("the notebook went on")']
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])


def _run(nb, **env):
    """Execute ``nb`` top to bottom in a fresh kernel with ``env`` added; the text each cell printed."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ["".join(o.get("text", "") for o in c.outputs if o.output_type == "stream") for c in nb.cells]


def _error(nb, **env) -> str:
    with pytest.raises(CellExecutionError) as info:
        _run(nb, **env)
    return str(info.value)


UNDONE = "def f():\n    raise NotImplementedError()"
DONE = "def f():\n    return 1"
WRONG = "def f():\n    return 2"


def test_run_all_goes_past_an_exercise_not_written_yet():
    out = _run(_notebook(UNDONE, "assert f() == 1, 'f() should be 1'"))
    assert "f is not implemented yet" in out[2] and "the notebook goes on" in out[2]
    assert "the notebook went on" in out[4]


def test_not_implemented_on_a_rank_is_skipped_too():
    visible = "labsupport.run(lambda: f(), world_size=2, timeout=30)"
    out = _run(_notebook(UNDONE, visible))
    assert "f is not implemented yet" in out[2]
    assert "the notebook went on" in out[4]


def test_a_wrong_answer_stops_run_all_with_its_message():
    err = _error(_notebook(WRONG, "assert f() == 1, 'f() should be 1'"))
    assert "f() should be 1" in err


def test_nothing_is_swallowed_while_grading():
    err = _error(_notebook(UNDONE, "assert f() == 1"), LABSUPPORT_GRADING="1")
    assert "NotImplementedError" in err


@pytest.mark.parametrize("answer, passes", [(UNDONE, False), (DONE, True)])
def test_require_passed_tells_validate_the_truth(answer, passes):
    nb = _notebook(answer, "assert f() == 1")
    if passes:
        _run(nb, NBGRADER_VALIDATING="1")
        _run(nb)  # and outside Validate it never fails
    else:
        assert "f: its visible tests do not pass yet" in _error(nb, NBGRADER_VALIDATING="1")
        assert "the notebook went on" in _run(_notebook(answer, "assert f() == 1"))[4]


def test_require_passed_fails_when_the_visible_test_never_ran():
    nb = _notebook(DONE, "assert f() == 1")
    nb.cells[2].source = "pass"
    assert "its visible tests did not run" in _error(nb, NBGRADER_VALIDATING="1")


def test_a_bad_name_is_a_clear_error():
    nb = _notebook(DONE, "pass")
    nb.cells[2].source = "%%visible_test not a name\npass"
    assert "%%visible_test takes the exercise's name" in _error(nb)


@pytest.mark.parametrize("answer, runs", [(DONE, True), (WRONG, False), (UNDONE, False)])
def test_a_demo_skips_at_once_unless_the_exercise_passed_its_visible_test(answer, runs):
    """``require_visible`` in a demo: it runs after a passing visible test; after a failing one (which stops Run All,
    so the demo is run by hand or while grading) or an unwritten exercise, it raises NotImplementedError at once."""
    nb = _notebook(answer, "assert f() == 1", grade="pass")
    nb.cells[4].source = ('try:\n    labsupport.require_visible("f")\n    print("the demo ran")\n'
                          'except NotImplementedError as exc:\n    print("skipped:", exc)')
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True)
    client.execute()
    out = "".join(o.get("text", "") for o in nb.cells[4].outputs if o.output_type == "stream")
    if runs:
        assert "the demo ran" in out, out
    else:
        assert "skipped: f has not passed its visible test in this kernel yet" in out, out
