"""Every real assignment in solutions/: the committed release is what ``release`` generates, the solution gets full
marks from ``grade``, the untouched release gets zero without a hang, and nothing in git leaks or carries outputs.

All assignments are graded in one ``grade --jobs 2`` run (a session fixture), so adding a notebook adds its own
grading time and nothing more.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import demo_submissions as demo  # noqa: E402

from autograder.course import Course  # noqa: E402

REPO = demo.REPO
COURSE = Course.at(REPO)
ASSIGNMENTS = COURSE.assignments()
PARAMS = ASSIGNMENTS or [pytest.param(None, marks=pytest.mark.skip(reason="no assignments in solutions/ yet"))]


@pytest.fixture(scope="session")
def regenerated(tmp_path_factory):
    out = tmp_path_factory.mktemp("release")
    proc = demo.cli("release", "--out", out, "--course", REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="session")
def graded(tmp_path_factory):
    """The solution and the untouched release of every assignment, graded in one run with two jobs."""
    root = tmp_path_factory.mktemp("course-grading")
    for aid in ASSIGNMENTS:
        for student, src in (("solution", COURSE.solutions), ("release", COURSE.notebooks)):
            if (src / aid / f"{aid}.ipynb").is_file():  # a missing release fails its own test below
                folder = root / "subs" / student / aid
                folder.mkdir(parents=True)
                shutil.copyfile(src / aid / f"{aid}.ipynb", folder / f"{aid}.ipynb")
    proc = demo.cli("grade", root / "subs", "--jobs", 2, "--out", root / "out", "--course", REPO, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return demo.read_grades(root / "out" / "grades.csv"), root / "out"


@pytest.mark.parametrize("aid", PARAMS)
def test_release_is_what_solutions_generate(aid, regenerated):
    committed = COURSE.notebooks / aid
    assert committed.is_dir(), f"notebooks/{aid} is missing: run python -m autograder release"
    files = sorted(p.relative_to(committed) for p in committed.rglob("*") if p.is_file()
                   and ".ipynb_checkpoints" not in p.parts and "__pycache__" not in p.parts)
    fresh = sorted(p.relative_to(regenerated / aid) for p in (regenerated / aid).rglob("*") if p.is_file())
    assert files == fresh
    for rel in files:
        assert (committed / rel).read_bytes() == (regenerated / aid / rel).read_bytes(), \
            f"notebooks/{aid}/{rel} differs from what solutions/ generates: run python -m autograder release"


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("aid", PARAMS)
def test_solution_gets_full_marks(aid, graded):
    grades, _ = graded
    row = grades[("solution", aid)]
    assert row["status"] == "ok", row
    assert float(row["points"]) == float(row["max_points"]) > 0, row
    assert row["tampered_cells"] == "", row


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("aid", PARAMS)
def test_untouched_release_gets_zero(aid, graded):
    grades, _ = graded
    assert (COURSE.notebooks / aid / f"{aid}.ipynb").is_file(), f"notebooks/{aid} is missing: run release"
    row = grades[("release", aid)]
    assert row["status"] == "ok", row
    assert float(row["points"]) == 0.0 and float(row["max_points"]) > 0, row
    assert row["tampered_cells"] == "", row
    assert "cells stopped after" not in row["reason"], row  # failed quickly, no time limit was needed


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("aid", PARAMS)
def test_feedback_has_no_hidden_test(aid, graded):
    _, out = graded
    secret = demo.hidden_test_lines(aid, course=REPO)
    assert (COURSE.notebooks / aid / f"{aid}.ipynb").is_file(), f"notebooks/{aid} is missing: run release"
    for student in ("solution", "release"):
        page = (out / "feedback" / student / f"{aid}.html").read_text()
        text = demo.html_text(page)
        for line in secret:
            assert line not in text, (student, line)
        assert "BEGIN HIDDEN TESTS" not in page and "BEGIN SOLUTION" not in page


@pytest.mark.parametrize("aid", PARAMS)
def test_release_has_no_solution_or_hidden_test(aid):
    assert (COURSE.notebooks / aid / f"{aid}.ipynb").is_file(), f"notebooks/{aid} is missing: run release"
    text = (COURSE.notebooks / aid / f"{aid}.ipynb").read_text()
    for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
        assert marker not in text, marker


def _tracked_notebooks() -> list[Path]:
    try:
        names = subprocess.run(["git", "ls-files", "*.ipynb"], cwd=REPO, capture_output=True, text=True,
                               check=True).stdout.split()
        return [REPO / n for n in names if (REPO / n).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        return sorted(p for d in ("solutions", "notebooks", "tests") for p in (REPO / d).rglob("*.ipynb"))


def test_no_notebook_in_git_has_outputs():
    bad = []
    for path in _tracked_notebooks():
        nb = json.loads(path.read_text(encoding="utf-8"))
        for i, cell in enumerate(nb.get("cells", [])):
            if cell.get("cell_type") == "code" and (cell.get("outputs") or cell.get("execution_count") is not None):
                bad.append(f"{path.relative_to(REPO)} cell {i + 1}")
    assert not bad, "notebooks with outputs or execution counts: " + ", ".join(bad)
