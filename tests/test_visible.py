"""``%%visible_test`` and ``require_passed`` in a real kernel: Run All goes past an exercise not written yet, stops
at a wrong one, and nothing is swallowed while grading; Validate (``NBGRADER_VALIDATING=1``) fails until the visible
tests pass, and nbgrader's own Validator shows one checklist (passes / not started / fails) with the details of the
first failure and none of the library's frames."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

REPO = Path(__file__).resolve().parent.parent
#: the kernels here fork their workers (when they start any) from the run's shared fork server (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("kernels_share_a_fork_server")

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
    assert "f is not started: it still raises NotImplementedError" in out[2] and "the notebook goes on" in out[2]
    assert "the notebook went on" in out[4]


def test_not_implemented_on_a_rank_is_skipped_too():
    visible = "labsupport.run(lambda: f(), world_size=2, timeout=30)"
    out = _run(_notebook(UNDONE, visible))
    assert "f is not started: it still raises NotImplementedError" in out[2]
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
        assert "0 of 1 exercises pass" in err and "f  not started: it still raises NotImplementedError" in err, err
        assert "the notebook went on" in _run(_notebook(answer, "assert f() == 1"))[4]


def test_require_passed_fails_when_the_visible_test_never_ran():
    nb = _notebook(DONE, "assert f() == 1")
    nb.cells[2].source = "pass"
    assert "f  not run: its visible test did not run" in _error(nb, NBGRADER_VALIDATING="1")


def test_a_bad_name_is_a_clear_error():
    nb = _notebook(DONE, "pass")
    nb.cells[2].source = "%%visible_test not a name\npass"
    assert "%%visible_test takes the exercise's name" in _error(nb)


@pytest.mark.parametrize("answer, says", [
    (DONE, "the demo ran"),
    (WRONG, "skipped: f fails its visible test (AssertionError at its visible test, line 1: assert f() == 1); this "
            "demo uses it"),
    (UNDONE, "skipped: f is not started: it still raises NotImplementedError"),
])
def test_a_demo_skips_at_once_unless_the_exercise_passed_its_visible_test(answer, says):
    """``require_visible`` in a demo: it runs after a passing visible test; after a failing one (which stops Run All,
    so the demo is run by hand or while grading) or an unwritten exercise, it raises NotImplementedError at once,
    and ``labsupport.skipped`` says why in the words Validate uses."""
    nb = _notebook(answer, "assert f() == 1", grade="pass")
    nb.cells[4].source = ('try:\n    labsupport.require_visible("f")\n    print("the demo ran")\n'
                          'except NotImplementedError as exc:\n    print(labsupport.skipped(exc, "f"))')
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True)
    client.execute()
    out = "".join(o.get("text", "") for o in nb.cells[4].outputs if o.output_type == "stream")
    assert out.strip() == says, out


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
    """nbgrader's Validator (what the Validate button calls) on that notebook, saved in ``tmp_path``, with the
    configuration the button's handler loads from the server's folder (the repository root, as ``./course lab``)."""
    from nbgrader.server_extensions.validate_assignment.handlers import ValidateAssignmentHandler
    from nbgrader.validator import Validator

    path = tmp_path / "exercises.ipynb"
    nbformat.write(_nbgrader_notebook(exercises), path)
    cwd = os.getcwd()
    try:
        os.chdir(REPO)
        config = ValidateAssignmentHandler.load_config(None)   # it uses nothing of the handler but the folder
        return Validator(config=config).validate(str(path))
    finally:
        os.chdir(cwd)   # the Validator changes folder as it works


def _dialog(failed: dict) -> list[str]:
    """The lines of one failed cell as Validate's dialog shows them: its source, then its error."""
    return failed["source"].splitlines() + failed["raw_error"].strip().splitlines()


def test_validate_reads_like_a_checklist(tmp_path):
    """One done, one not started, one wrong, one done: a single failed cell, which is the checklist itself (its
    source: a line per exercise; its error: the first failure's details), not the last exercise's hidden-test cell,
    with no frame of the library's."""
    results = _validate(tmp_path, {
        "ab": "def ab():\n    return 2",
        "cde": "def cde():\n    # YOUR CODE HERE\n    raise NotImplementedError()",
        "fghi": "def fghi():\n    return 5",
        "jklmn": "def jklmn():\n    return 5",
    })
    assert list(results) == ["failed"] and len(results["failed"]) == 1, results
    failed = results["failed"][0]
    assert "require_passed" not in failed["source"] and "hidden tests" not in failed["source"], failed["source"]
    lines = _dialog(failed)
    assert lines[0].startswith("2 of 4 exercises pass their visible tests"), lines
    assert lines[1:5] == ["  ab     passes",
                          "  cde    not started: it still raises NotImplementedError",
                          "  fghi   fails: fghi() should be 4, got 5",
                          "  jklmn  passes"], lines
    assert lines[5] == "The first failure, fghi:" and lines[6] == "fghi() should be 4, got 5", lines
    assert lines[7].startswith("  at its visible test, line 1: assert fghi() == 4"), lines
    assert len(lines) == 8, lines
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
    lines = _dialog(results["failed"][0])
    assert lines[1:4] == ["  ab    fails: ab() should be 2, got 3",
                          "  cde   fails: rank 0 raised ValueError: the shard is empty; rank 1 raised ValueError: the "
                          "shard is empty",
                          "  fghi  not started: it still raises NotImplementedError"], lines
    assert "visible.py" not in error and "Traceback (most recent" not in error, error

    results = _validate(tmp_path, {"ab": "def ab():\n    raise NotImplementedError()"})
    lines = _dialog(results["failed"][0])
    assert lines[1] == "  ab  not started: it still raises NotImplementedError", lines
    assert lines[-1].startswith("Write the exercises not started yet"), lines


def test_validate_passes_when_every_exercise_does(tmp_path):
    assert _validate(tmp_path, {"ab": "def ab():\n    return 2", "cde": "def cde():\n    return 3"}) == {}


def test_the_checklist_becomes_its_own_cell_only_under_validate(monkeypatch):
    """``checklist_first`` (Validate's executor calls it on each cell that raised) turns the hidden-test cell that
    raised the checklist into a cell of the course's own, in Validate's copy of the notebook: the checklist as its
    source, the first failure's details as its error, no points. Outside Validate it does nothing (grading never sees
    it), nor to a test cell whose source was edited (Validate still says so)."""
    from nbgrader.utils import compute_checksum

    from labsupport.visible import CHECKLIST_ID, checklist_first

    def hidden_cell(source='"""f: hidden tests."""\nlabsupport.require_passed("f")'):
        cell = nbformat.v4.new_code_cell(source, metadata={"nbgrader": {
            "grade": True, "grade_id": "test_f", "points": 1, "locked": True, "solution": False,
            "schema_version": 3}})
        cell.metadata["nbgrader"]["checksum"] = compute_checksum(cell)
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="before\n"),
                        nbformat.v4.new_output("error", ename="ValidationReport", evalue="0 of 1",
                                               traceback=["0 of 1 exercises pass", "  f  fails: no", "",
                                                          "The first failure, f:", "no"])]
        return cell

    monkeypatch.delenv("NBGRADER_VALIDATING", raising=False)
    untouched = hidden_cell()
    before = nbformat.v4.new_notebook(cells=[untouched])
    text = nbformat.writes(before)
    checklist_first(cell=untouched, cell_index=0, execute_reply={})
    assert nbformat.writes(before) == text

    monkeypatch.setenv("NBGRADER_VALIDATING", "1")
    cell = hidden_cell()
    checklist_first(cell=cell, cell_index=0, execute_reply={})
    assert cell.source == "0 of 1 exercises pass\n  f  fails: no"
    assert cell.metadata["nbgrader"]["grade_id"] == CHECKLIST_ID and cell.metadata["nbgrader"]["points"] == 0
    assert "checksum" not in cell.metadata["nbgrader"]
    assert [o["output_type"] for o in cell.outputs] == ["stream", "error"]
    assert cell.outputs[1]["traceback"] == ["The first failure, f:", "no"]

    edited = hidden_cell()
    edited.source = "pass"                       # the checksum no longer matches: left for Validate to report
    checklist_first(cell=edited, cell_index=0, execute_reply={})
    assert edited.source == "pass" and edited.metadata["nbgrader"]["grade_id"] == "test_f"


def test_shorten_cuts_at_a_line_or_a_word_and_says_so():
    """``labsupport.shorten`` (09's torchrun lines and deadlock report): whole when short enough; else cut at the
    last line break or space before the limit, never inside a word, with "… (cut)"; ``end=True`` keeps the end."""
    from labsupport import shorten

    assert shorten("short enough", 12) == "short enough"
    text = "the rank that never arrived is rank 2, stuck in time.sleep"
    cut = shorten(text, 30)
    assert cut == "the rank that never arrived is … (cut)", cut
    lines = "\n".join(f"[rank {r}] waiting in dist.barrier()" for r in range(20))
    cut = shorten(lines, 100)
    assert cut.endswith("\n… (cut)") and all(line.endswith("dist.barrier()") for line in cut.splitlines()[:-1]), cut
    assert len(cut) <= 100 + len("\n… (cut)")
    assert shorten("x" * 50, 10) == "x" * 10 + " … (cut)"            # one long word: nowhere better to cut
    tail = shorten(lines, 100, end=True)
    assert tail.startswith("(cut) …\n[rank ") and tail.endswith("[rank 19] waiting in dist.barrier()"), tail


def test_skipped_names_the_reason():
    """``labsupport.skipped`` (the demos of 09): an exercise's NotImplementedError, in the kernel or on a rank, says
    "not started: it still raises NotImplementedError", not the error's class; another error says what it was, cut
    at a word."""
    from labsupport import WorkerError, skipped

    on_rank = WorkerError("rank 0 raised NotImplementedError: clip_grad_norm_ is not implemented yet",
                          [{"rank": 0, "type": "NotImplementedError", "message": ""}])
    assert skipped(on_rank, "clip_grad_norm_") == \
        "skipped: clip_grad_norm_ is not started: it still raises NotImplementedError"
    assert skipped(NotImplementedError(), "shard_indices") == \
        "skipped: shard_indices is not started: it still raises NotImplementedError"
    wrong = skipped(AssertionError("the norm is " + "wrong " * 100), "clip_grad_norm_")
    assert wrong.startswith("skipped: clip_grad_norm_ is not ready: AssertionError: the norm is wrong")
    assert wrong.endswith("wrong … (cut)") and len(wrong) < 320, wrong
    crashed = WorkerError("rank 1 raised ValueError: the shard is empty\nrank 0 was stopped",
                          [{"rank": 1, "type": "ValueError", "message": "the shard is empty"}])
    assert skipped(crashed) == "skipped: an exercise this demo runs is not ready: rank 1 raised ValueError: the " \
                               "shard is empty"
