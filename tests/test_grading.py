"""The grader's commands on the demo course (tests/fixtures/course): CLI, release, check, and the tamper repair.

The bad-submission matrix is in test_grading_matrix.py, parallel grading and workers in test_grading_parallel.py.
"""

import shutil
import sys
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import demo_submissions as demo  # noqa: E402

from autograder.tamper import repair  # noqa: E402

COURSE = demo.COURSE


# ---------------------------------------------------------------------------------------------------------------
# command line


@pytest.mark.parametrize("command", [[], ["release"], ["grade"], ["check"], ["merge"], ["student-edition"]])
def test_help(command):
    proc = demo.cli(*command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: python -m autograder" in proc.stdout


def _one_line_error(proc, *expected):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for text in expected:
        assert text in lines[0], lines[0]


@pytest.mark.parametrize("below", [False, True], ids=["out-is-a-file", "out-is-below-a-file"])
def test_grade_out_is_a_file(tmp_path, below):
    demo.write(tmp_path / "subs", {"alice": "good"})
    existing = tmp_path / "grades.txt"
    existing.write_text("not a folder\n")
    out = existing / "run1" if below else existing
    proc = demo.cli("grade", tmp_path / "subs", "--course", COURSE, "--out", out)
    _one_line_error(proc, "--out", str(out), "exists and is not a directory")
    assert existing.read_text() == "not a folder\n"


def test_grade_missing_submissions_dir(tmp_path):
    proc = demo.cli("grade", tmp_path / "nope", "--course", COURSE, "--out", tmp_path / "out")
    _one_line_error(proc, "does not exist", "nope")
    assert not (tmp_path / "out").exists()


def test_grade_unknown_assignment(tmp_path):
    demo.write(tmp_path / "subs", {"alice": "good"})
    proc = demo.cli("grade", tmp_path / "subs", "--assignment", "42_nothing", "--course", COURSE)
    _one_line_error(proc, "unknown assignment '42_nothing'", "98_workers, 99_demo")


def test_grade_without_students(tmp_path):
    (tmp_path / "subs").mkdir()
    proc = demo.cli("grade", tmp_path / "subs", "--course", COURSE)
    _one_line_error(proc, "no student folders")


def test_grade_without_any_course_assignment(tmp_path):
    (tmp_path / "subs" / "alice" / "hw1").mkdir(parents=True)
    proc = demo.cli("grade", tmp_path / "subs", "--course", COURSE)
    _one_line_error(proc, "no submissions of 98_workers, 99_demo")


def test_grade_bad_jobs(tmp_path):
    demo.write(tmp_path / "subs", {"alice": "good"})
    proc = demo.cli("grade", tmp_path / "subs", "--jobs", "0", "--course", COURSE)
    _one_line_error(proc, "--jobs")


def test_course_without_solutions(tmp_path):
    proc = demo.cli("release", "--course", tmp_path)
    _one_line_error(proc, "no assignments")
    proc = demo.cli("release", "--course", tmp_path / "missing")
    _one_line_error(proc, "does not exist")


def test_check_missing_notebook(tmp_path):
    _one_line_error(demo.cli("check", tmp_path / "x.ipynb"), "does not exist")


def test_check_not_a_notebook(tmp_path):
    path = tmp_path / "x.ipynb"
    path.write_text("{ not json")
    _one_line_error(demo.cli("check", path), "cannot read")


def test_nbgrader_config_file_maps_the_course():
    """nbgrader itself can load autograder/nbgrader_config.py: solutions/ is the source, notebooks/ the release."""
    from traitlets.config.loader import PyFileConfigLoader

    path = demo.REPO / "autograder" / "nbgrader_config.py"
    cfg = PyFileConfigLoader(path.name, path=str(path.parent)).load_config()
    assert cfg.CourseDirectory.root == str(demo.REPO)
    assert (cfg.CourseDirectory.source_directory, cfg.CourseDirectory.release_directory) == ("solutions", "notebooks")
    assert cfg.Execute.timeout >= 120 and cfg.Execute.interrupt_on_timeout
    assert cfg.OverwriteCells.add_missing_cells is True


# ---------------------------------------------------------------------------------------------------------------
# release


def _files(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_release_reproduces_the_committed_notebooks(tmp_path):
    """``release`` rewrites notebooks/ byte for byte as committed (which an earlier run produced), and drops
    files that are not part of the release any more."""
    course = tmp_path / "course"
    shutil.copytree(COURSE / "solutions", course / "solutions")
    (course / "notebooks" / "99_demo").mkdir(parents=True)
    (course / "notebooks" / "99_demo" / "stale.txt").write_text("old")
    (course / "notebooks" / "99_demo" / "99_demo.ipynb").write_text("{}")
    proc = demo.cli("release", "--course", course)
    assert proc.returncode == 0, proc.stderr
    committed = _files(COURSE / "notebooks")
    assert sorted(committed) == ["98_workers/98_workers.ipynb", "99_demo/99_demo.ipynb"]
    assert _files(course / "notebooks") == committed
    assert "release 2/2" in proc.stderr  # progress


def test_release_has_no_solutions_hidden_tests_or_outputs():
    for path in (COURSE / "notebooks").rglob("*.ipynb"):
        text = path.read_text()
        assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text, path
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path
        for line in demo.hidden_test_lines(path.stem):
            assert line not in text, (path, line)


# ---------------------------------------------------------------------------------------------------------------
# check (student side)


def _copy_nb(tmp_path, nb, name="99_demo") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    nbformat.write(nb, folder / f"{name}.ipynb")
    return folder / f"{name}.ipynb"


def test_check_good_notebook(tmp_path, graders_env):
    """All visible tests pass; the kernel runs in the notebook's folder with LABSUPPORT_GRADING=1."""
    nb = demo.good()
    nb.cells[demo.index(nb, "mean")].source = ("import os\nassert os.environ['LABSUPPORT_GRADING'] == '1'\n"
                                               "assert os.path.exists('marker.txt')\n"
                                               + nb.cells[demo.index(nb, "mean")].source)
    path = _copy_nb(tmp_path, nb)
    (path.parent / "marker.txt").write_text("here")
    proc = demo.cli("check", path, env=graders_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Local estimate: 5 / 5" in proc.stdout
    assert "estimate" in proc.stdout and "hidden tests" in proc.stdout
    for name in ("add", "mean", "count_words"):
        assert any(line.split()[:1] == [name] and "ok" in line for line in proc.stdout.splitlines()), name


def test_check_untouched_release(tmp_path, graders_env):
    proc = demo.cli("check", _copy_nb(tmp_path, demo.release()), env=graders_env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Local estimate: 0 / 5" in proc.stdout
    assert proc.stdout.count("FAIL") == 3 and "NotImplementedError" in proc.stdout


def test_check_shows_the_failing_visible_test(tmp_path, graders_env):
    nb = demo.good()
    nb.cells[demo.index(nb, "mean")].source = "def mean(xs):\n    return 0"
    nb.cells[demo.index(nb, "count_words")].source += "\nimport os\nos.kill(os.getpid(), 9)"
    proc = demo.cli("check", _copy_nb(tmp_path, nb), env=graders_env)
    assert proc.returncode == 1
    assert "`test_mean_visible`: AssertionError: mean([1, 2]) should be 1.5" in proc.stdout, proc.stdout
    assert "kernel died while running `count_words`" in proc.stdout, proc.stdout
    assert "Local estimate: 1 / 5" in proc.stdout


def test_check_names_the_answer_cells_own_error_first_and_every_other_problem(tmp_path, graders_env):
    nb = demo.good()
    nb.cells[demo.index(nb, "mean")].source = "def mean(xs)\n    return 0"   # a syntax error
    proc = demo.cli("check", _copy_nb(tmp_path, nb), env=graders_env)
    assert proc.returncode == 1
    line = next(line for line in proc.stdout.splitlines() if line.split()[:1] == ["mean"])
    assert "FAIL" in line and "SyntaxError" in line, proc.stdout
    assert "also: `test_mean_visible`" in proc.stdout and "(and " not in proc.stdout, proc.stdout


# ---------------------------------------------------------------------------------------------------------------
# the repair done before nbgrader sees a submission (no kernels)


def _ids(nb):
    return [c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells]


def test_repair_leaves_a_clean_submission_alone():
    fixed, report = repair(demo.good(), demo.release(), demo.solution())
    assert report.tampered_cells == [] and report.notes() == []
    assert [c.source for c in fixed.cells] == [c.source for c in demo.good().cells]


def test_repair_accepts_the_instructor_solution():
    _, report = repair(demo.solution(), demo.release(), demo.solution())
    assert report.tampered_cells == [] and report.notes() == []


def test_repair_puts_deleted_cells_back_in_place():
    """A deleted hidden-test cell right after a read-only visible test (where nbgrader itself crashes)."""
    nb = demo.good()
    del nb.cells[demo.index(nb, "test_mean")]
    del nb.cells[demo.index(nb, "test_mean_visible_2")]
    fixed, report = repair(nb, demo.release(), demo.solution())
    assert _ids(fixed) == _ids(demo.release())
    assert report.deleted == ["test_mean_visible_2", "test_mean"]
    assert report.tampered_cells == ["test_mean", "test_mean_visible_2"]


def test_repair_restores_edited_cells_and_metadata():
    nb = demo.good()
    nb.cells[demo.index(nb, "test_add")].source = "pass"
    nb.cells[demo.index(nb, "test_mean")].metadata["nbgrader"]["points"] = 100
    nb.cells[demo.index(nb, "setup")].cell_type = "markdown"
    fixed, report = repair(nb, demo.release(), demo.solution())
    rel = demo.release()
    for gid in ("test_add", "test_mean", "setup"):
        got, want = fixed.cells[demo.index(fixed, gid)], rel.cells[demo.index(rel, gid)]
        assert (got.source, got.cell_type, got.metadata["nbgrader"]) == (want.source, want.cell_type,
                                                                         want.metadata["nbgrader"])
    assert report.edited == ["test_add"]
    assert sorted(report.metadata_changed) == ["setup", "test_mean"]


def test_repair_recognises_stripped_metadata():
    nb = demo.good()
    for cell in nb.cells:
        cell.metadata.pop("nbgrader", None)
    fixed, report = repair(nb, demo.release(), demo.solution())
    assert _ids(fixed) == _ids(demo.release())
    assert report.answers_stripped == ["add", "mean", "count_words"]
    assert "test_add" in report.stripped and "setup" in report.stripped
    # the student's answers are kept
    assert "return a + b" in fixed.cells[demo.index(fixed, "add")].source


def test_repair_drops_unknown_and_duplicate_ids():
    nb = demo.good()
    extra = nbformat.v4.new_code_cell("x = 1", metadata={"nbgrader": {"grade_id": "bogus", "locked": True,
                                                                       "grade": False, "solution": False}})
    dup = nbformat.v4.new_code_cell("def add(a, b):\n    return 0", metadata={"nbgrader": dict(
        nb.cells[demo.index(nb, "add")].metadata["nbgrader"])})
    nb.cells.insert(0, extra)
    nb.cells.insert(1, dup)
    fixed, report = repair(nb, demo.release(), demo.solution())
    assert report.unknown_ids == ["bogus"] and report.duplicates == ["add"]
    assert _ids(fixed).count("add") == 1 and "bogus" not in _ids(fixed)


# ---------------------------------------------------------------------------------------------------------------
# reading a submission (no kernels)


def test_reading_submissions(tmp_path):
    """Small slips in the notebook format are mended; files that are not notebooks get a precise reason."""
    import json

    from autograder.reading import _read_submission

    nb = json.loads((COURSE / "notebooks" / "99_demo" / "99_demo.ipynb").read_text())
    nb["cells"][1]["stray_key"] = 1
    del nb["cells"][2]["id"]
    del nb["cells"][1]["outputs"]
    cases = {"slips": json.dumps(nb), "empty": "", "list": "[]", "cut": json.dumps(nb)[:-50]}
    got = {}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        got[name] = _read_submission(str(tmp_path / name))
    assert got["slips"][1] is None and len(got["slips"][0].cells) == len(nb["cells"])
    assert got["empty"][1] == "grading failed: the notebook file is empty (0 bytes of JSON)"
    assert got["list"][1] == "grading failed: the file is JSON but not a Jupyter notebook (it has no cells)"
    assert got["cut"][1].startswith("grading failed: notebook is not valid JSON (line ")


def test_csv_reasons_are_cut_at_a_sentence_or_a_word():
    from autograder.reading import _one_line

    message = ("reduce_scatter on rank 1 returned the sum of the other ranks' chunks without this rank's own. "
               "Add your own chunk before returning, and check item i must hold rank i's chunk in every rank order.")
    short = _one_line(message, 120)
    assert short == "reduce_scatter on rank 1 returned the sum of the other ranks' chunks without this rank's own. …"
    words = _one_line("word " * 60, 50)
    assert words.endswith(" …") and all(w == "word" for w in words[:-2].split())
    assert _one_line("fits\nsecond line") == "fits"
