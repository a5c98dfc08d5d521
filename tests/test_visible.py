"""``%%visible_test`` and ``require_passed`` in a real kernel: Run All goes past an exercise not written yet, stops
at a wrong one, and nothing is swallowed while grading; Validate (``NBGRADER_VALIDATING=1``) fails until the visible
tests pass, and nbgrader's own Validator shows one checklist (passes / not started / fails) with the details of the
first failure and none of the library's frames."""

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
        err = _error(nb, NBGRADER_VALIDATING="1")
        assert "0 of 1 exercises pass" in err and "f  not started" in err, err
        assert "the notebook went on" in _run(_notebook(answer, "assert f() == 1"))[4]


def test_require_passed_fails_when_the_visible_test_never_ran():
    nb = _notebook(DONE, "assert f() == 1")
    nb.cells[2].source = "pass"
    assert "f  not run: its visible test did not run" in _error(nb, NBGRADER_VALIDATING="1")


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


def _nbgrader_notebook(exercises: dict) -> nbformat.NotebookNode:
    """A notebook as nbgrader releases it: per exercise ``{name: answer}`` an answer cell, its visible test (the
    function returns the number of its name's letters) and its graded cell calling ``require_passed``."""
    def meta(grade_id, grade=False, solution=False, locked=True):
        m = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": 3, "solution": solution,
             "task": False}
        if grade:
            m["points"] = 1
        return {"nbgrader": m}

    cells = [nbformat.v4.new_code_cell(SETUP, metadata=meta("setup"))]
    for name, answer in exercises.items():
        cells += [
            nbformat.v4.new_code_cell(answer, metadata=meta(name, solution=True, locked=False)),
            nbformat.v4.new_code_cell(f"%%visible_test {name}\nassert {name}() == {len(name)}, "
                                      f"'{name}() should be {len(name)}, got ' + str({name}())",
                                      metadata=meta(f"test_{name}_visible")),
            nbformat.v4.new_code_cell(f'"""{name}: hidden tests."""\nlabsupport.require_passed("{name}")',
                                      metadata=meta(f"test_{name}", grade=True)),
        ]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def _validate(tmp_path, exercises: dict) -> dict:
    """nbgrader's Validator (what the Validate button calls) on that notebook, saved in ``tmp_path``."""
    from nbgrader.validator import Validator

    path = tmp_path / "exercises.ipynb"
    nbformat.write(_nbgrader_notebook(exercises), path)
    cwd = os.getcwd()
    try:
        return Validator().validate(str(path))
    finally:
        os.chdir(cwd)   # the Validator changes folder as it works


def test_validate_reads_like_a_checklist(tmp_path):
    """One done, one not started, one wrong, one done: a single failed cell (the last exercise's), whose error is a
    line per exercise and then the first failure's details, with no frame of the library's."""
    results = _validate(tmp_path, {
        "ab": "def ab():\n    return 2",
        "cde": "def cde():\n    # YOUR CODE HERE\n    raise NotImplementedError()",
        "fghi": "def fghi():\n    return 5",
        "jklmn": "def jklmn():\n    return 5",
    })
    assert list(results) == ["failed"] and len(results["failed"]) == 1, results
    failed = results["failed"][0]
    assert 'require_passed("jklmn")' in failed["source"]
    lines = failed["raw_error"].strip().splitlines()
    assert lines[0].startswith("2 of 4 exercises pass their visible tests"), lines
    assert lines[1:5] == ["  ab     passes",
                          "  cde    not started (it still raises NotImplementedError)",
                          "  fghi   fails: fghi() should be 4, got 5",
                          "  jklmn  passes"], lines
    assert lines[6] == "The first failure, fghi:" and lines[7] == "fghi() should be 4, got 5", lines
    assert lines[8].startswith("  at its visible test, line 1: assert fghi() == 4"), lines
    assert len(lines) == 9, lines
    for ours in ("visible.py", "Traceback", "labsupport/", "File "):
        assert ours not in failed["raw_error"], (ours, failed["raw_error"])


def test_validate_names_what_is_not_started_and_a_failure_on_a_rank(tmp_path):
    """An exercise whose ranks raise reports the rank's message on its line; the last exercise not started is
    reported on the last cell like the others; an untouched notebook says what to do next."""
    results = _validate(tmp_path, {
        "ab": "def ab():\n    return labsupport.run(lambda: dist.get_rank() + 2, world_size=2, timeout=60)[1]\n",
        "cde": "def cde():\n    def boom():\n        raise ValueError('the shard is empty')\n"
               "    return labsupport.run(boom, world_size=2, timeout=60)",
        "fghi": "def fghi():\n    raise NotImplementedError()",
    })
    error = results["failed"][0]["raw_error"]
    lines = error.strip().splitlines()
    assert lines[1:4] == ["  ab    fails: ab() should be 2, got 3",
                          "  cde   fails: rank 0 raised ValueError: the shard is empty; rank 1 raised ValueError: the "
                          "shard is empty",
                          "  fghi  not started (it still raises NotImplementedError)"], lines
    assert "visible.py" not in error and "Traceback (most recent" not in error, error

    results = _validate(tmp_path, {"ab": "def ab():\n    raise NotImplementedError()"})
    lines = results["failed"][0]["raw_error"].strip().splitlines()
    assert lines[1] == "  ab  not started (it still raises NotImplementedError)", lines
    assert lines[-1].startswith("Write the exercises not started yet"), lines


def test_validate_passes_when_every_exercise_does(tmp_path):
    assert _validate(tmp_path, {"ab": "def ab():\n    return 2", "cde": "def cde():\n    return 3"}) == {}


def test_an_exception_with_no_message_on_a_rank_says_what_raised_it():
    """``raise NotImplementedError()`` in a method run on real workers: the report names the method ("rank 0 raised
    NotImplementedError: MiniFSDP.forward is not implemented yet"), not an empty reason; an ``assert`` without a
    message names the function, the cell's line and its source."""
    cells = [
        SETUP,
        "import torch.nn as nn\n\n"
        "class MiniFSDP(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n\n"
        "    def forward(self, x):\n"
        "        # YOUR CODE HERE\n"
        "        raise NotImplementedError()\n\n"
        "def check_positive(x):\n"
        "    assert x > 0\n",
        "try:\n"
        "    labsupport.run(lambda: MiniFSDP()(1), world_size=2, timeout=60)\n"
        "except labsupport.WorkerError as exc:\n"
        "    print(str(exc).splitlines()[0])",
        "try:\n"
        "    labsupport.run(lambda: check_positive(-dist.get_rank()), world_size=2, timeout=60)\n"
        "except labsupport.WorkerError as exc:\n"
        "    print(str(exc).splitlines()[0])\n"
        "    print(exc.exc_message)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    out = _run(nb)
    assert out[2].strip() == ("rank 0 raised NotImplementedError: MiniFSDP.forward is not implemented yet; "
                              "rank 1 raised NotImplementedError: MiniFSDP.forward is not implemented yet"), out[2]
    first, message = out[3].strip().splitlines()
    assert first.startswith("rank 0 raised AssertionError: (no message) in check_positive, Cell In[2], line 12: "
                            "assert x > 0"), first
    assert message.startswith("(no message) in check_positive"), message
