"""The bad-submission matrix: one ``grade --jobs 2`` run over good, untouched and broken submissions of 99_demo.

Every broken submission must end as a row with a reason a person can act on, and the good ones next to it must be
graded exactly as if they were alone.
"""

import os
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import demo_submissions as demo  # noqa: E402

CELL_TIMEOUT = 5  # seconds; the demo's cells take milliseconds, the loops are meant to hit it

STUDENTS = [
    "good", "solution", "release", "partial", "invalid_json", "renamed", "missing_folder", "deleted_test",
    "edited_tests", "stripped_metadata", "infinite_loop", "ignores_sigint", "kills_kernel", "kills_grader", "sys_exit",
    "huge_output", "html_injection", "only_98",
]

# student: (points, status, phrases the reason must contain, tampered cells)
EXPECTED = {
    "good": (5, "ok", [], ""),
    "solution": (5, "ok", [], ""),
    "release": (0, "ok", ["failed tests: test_add (NotImplementedError", "test_count_words (NotImplementedError"],
                ""),
    "partial": (1, "ok", ["test_mean (NotImplementedError"], ""),
    "invalid_json": (0, "failed", ["grading failed: notebook is not valid JSON (line"], ""),
    "renamed": (0, "failed", ["missing notebook: expected renamed/99_demo/99_demo.ipynb, found 99_demo (1).ipynb"],
                ""),
    "missing_folder": (0, "failed", ["missing notebook: expected missing_folder/99_demo/99_demo.ipynb",
                                     "no folder missing_folder/99_demo/", "99_dmeo/"], ""),
    "deleted_test": (4, "ok", ["deleted read-only cells (put back before grading): test_add",
                               "test_add (AssertionError: add(-1, 5) returned -6, expected 4)"], "test_add"),
    "edited_tests": (3, "ok", ["edited read-only cells (restored before grading): test_mean_visible, test_mean",
                               "failed tests: test_mean (AssertionError"], "test_mean;test_mean_visible"),
    "stripped_metadata": (5, "ok", ["without nbgrader metadata", "add, mean, count_words"],
                          ("setup;test_add;test_add_visible;test_count_words;test_mean;test_mean_visible;"
                           "test_mean_visible_2")),
    "infinite_loop": (3, "ok", [f"cells stopped after the {CELL_TIMEOUT} s limit: `test_count_words`"], ""),
    "ignores_sigint": (0, "failed", ["grading failed: cell `add` was still running after the 5 s limit",
                                     "ignored the interrupt"], ""),
    "kills_kernel": (0, "failed", ["grading failed: the kernel died while running cell `mean`"], ""),
    "kills_grader": (0, "failed", ["grading failed: the grading process was killed while running this notebook"],
                     ""),
    "sys_exit": (5, "ok", ["errors in other cells: `mean` (SystemExit)"], ""),
    "huge_output": (5, "ok", ["output cut in `mean`"], ""),
    "html_injection": (5, "ok", [], ""),
    # handed in the other assignment only (graded with --assignment 99_demo)
    "only_98": (0, "failed", [("missing notebook: expected only_98/99_demo/99_demo.ipynb; there is no folder "
                               "only_98/99_demo/ (only_98/ holds 98_workers/)")], ""),
}
VARIANT = {"only_98": "worker_good"}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    demo.write(root / "subs", {s: VARIANT.get(s, s) for s in STUDENTS})
    scratch = root / "tmp"  # the grader's temporary course directories (and so its kernels' cwd) live here
    scratch.mkdir()
    started = time.monotonic()
    proc = demo.cli("grade", root / "subs", "--jobs", 2, "--out", root / "out", "--course", demo.COURSE,
                    "--assignment", demo.DEMO, "--cell-timeout", CELL_TIMEOUT, env={"TMPDIR": str(scratch)})
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"out": root / "out", "proc": proc, "seconds": seconds, "scratch": scratch,
            "grades": demo.read_grades(root / "out" / "grades.csv")}


def test_every_student_has_one_row(matrix):
    assert sorted(matrix["grades"]) == sorted((s, demo.DEMO) for s in STUDENTS)
    header = (matrix["out"] / "grades.csv").read_text().splitlines()[0]
    assert header == "student,assignment,points,max_points,status,reason,tampered_cells,flags"


@pytest.mark.parametrize("student", STUDENTS)
def test_row(matrix, student):
    points, status, phrases, tampered = EXPECTED[student]
    row = matrix["grades"][(student, demo.DEMO)]
    assert (float(row["points"]), row["max_points"], row["status"]) == (points, "5", status), row
    for phrase in phrases:
        assert phrase in row["reason"], (phrase, row["reason"])
    if not phrases:
        assert row["reason"] == "", row
    assert row["tampered_cells"] == tampered, row
    assert "\n" not in row["reason"]


@pytest.mark.parametrize("student", STUDENTS)
def test_feedback_page(matrix, student):
    """Every row has a feedback page with its score and reason, and without hidden tests or solution markers."""
    page = (matrix["out"] / "feedback" / student / f"{demo.DEMO}.html").read_text()
    text = demo.html_text(page)
    row = matrix["grades"][(student, demo.DEMO)]
    assert f"Score: {row['points']} / 5" in text
    if row["status"] == "failed":
        assert row["reason"] in text
    for line in demo.hidden_test_lines():
        assert line not in text and line not in page, (student, line)
    for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
        assert marker not in page, (student, marker)
    assert len(page) < 200_000, (student, len(page))


def test_feedback_shows_failures_without_tracebacks(matrix):
    text = demo.html_text((matrix["out"] / "feedback" / "deleted_test" / f"{demo.DEMO}.html").read_text())
    assert "failed (0 / 1 points): AssertionError: add(-1, 5) returned -6, expected 4" in text
    assert "passed: 2 / 2 points" in text
    # the graded cell shows one line, no traceback (which would repeat the message a third time)...
    assert text.count("add(-1, 5) returned -6, expected 4") == 2
    # ...while a visible test keeps its traceback: the student wrote that code and can read it
    assert "----> 1 assert add(1, 2) == 3" in text


def test_feedback_runs_no_student_html(matrix):
    """A student's Markdown and rich outputs cannot put script into the page someone else may open."""
    page = (matrix["out"] / "feedback" / "html_injection" / f"{demo.DEMO}.html").read_text()
    assert "<script" not in page.lower() and "<svg" not in page.lower()
    assert "<strong>bold</strong>" in page  # Markdown formatting still works


def test_kernel_runs_in_grading_mode(matrix):
    """The demo's setup cell prints whether LABSUPPORT_GRADING=1 reached the kernel; its output is in the page."""
    text = demo.html_text((matrix["out"] / "feedback" / "good" / f"{demo.DEMO}.html").read_text())
    assert "grading mode: True" in text


def test_huge_output_is_cut(matrix):
    text = demo.html_text((matrix["out"] / "feedback" / "huge_output" / f"{demo.DEMO}.html").read_text())
    assert "line 10" in text and "line 99999" not in text


def test_gradebook_has_every_row(matrix):
    from nbgrader.api import Gradebook

    from autograder.nbgrader_config import make_config

    course_id = make_config(str(matrix["out"])).CourseDirectory.course_id
    with Gradebook(f"sqlite:///{matrix['out'] / 'gradebook.db'}", course_id) as gb:
        assert sorted(s.id for s in gb.students) == sorted(STUDENTS)
        for student in STUDENTS:
            sub = gb.find_submission(demo.DEMO, student)
            row = matrix["grades"][(student, demo.DEMO)]
            assert (sub.score, sub.max_score) == (float(row["points"]), 5.0), student
            assert sub.needs_manual_grade == (row["status"] == "failed"), student


def test_summary_table(matrix):
    out = matrix["proc"].stdout
    assert out.splitlines()[0].split() == ["student", "assignment", "points", "status", "reason"]
    for student in STUDENTS:
        assert any(line.startswith(student + " ") for line in out.splitlines()), student
    assert f"Graded {len(STUDENTS)} notebooks" in out and "11 ok, 7 failed" in out


def test_nothing_left_running(matrix):
    """No kernel or worker process started by the grading run outlives it."""
    scratch = str(matrix["scratch"])
    deadline = time.monotonic() + 60  # the loop ends as soon as nothing is left
    while True:
        left = []
        for proc in psutil.process_iter(["pid", "cmdline", "cwd"]):
            try:
                where = (proc.info["cwd"] or "") + " " + " ".join(proc.info["cmdline"] or [])
            except (psutil.Error, TypeError):
                continue
            if scratch in where and proc.pid != os.getpid():
                left.append((proc.pid, where[:200]))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left
    assert list(matrix["scratch"].iterdir()) == []  # temporary course directories removed
