"""Every real assignment in solutions/: the committed release is what ``release`` generates (the English one in
notebooks/, the Chinese one in notebooks-zh/), the solution gets full marks from ``grade``, the untouched release gets
zero without a hang, a planted bug costs its own exercise's points and nothing else's, a Chinese solution and release
score exactly as the English ones, and nothing in git leaks or carries outputs.

All assignments are graded in the class's one ``grade --jobs 2`` run (``class_graded``, see
``fixtures/class_of_submissions.py``), so adding a notebook adds its own grading time and nothing more.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import demo_submissions as demo  # noqa: E402
from class_of_submissions import ASSIGNMENTS, CHECKED, CHECKED_WRONG, CHINESE, COURSE, MUTANTS  # noqa: E402

REPO = demo.REPO
PARAMS = ASSIGNMENTS or [pytest.param(None, marks=pytest.mark.skip(reason="no assignments in solutions/ yet"))]


@pytest.fixture(scope="session")
def regenerated(tmp_path_factory):
    """``regenerated(lang)``: a folder with the release in ``lang`` of every assignment, made once per session."""
    made = {}

    def release_in(lang: str) -> Path:
        if lang not in made:
            out = tmp_path_factory.mktemp(f"release-{lang}")
            proc = demo.cli("release", "--lang", lang, "--out", out, "--course", REPO)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            made[lang] = out
        return made[lang]

    return release_in


def _cell_scores(out: Path, student: str, aid: str) -> dict:
    """{grade_id: (score, max_score)} of one graded notebook, from the gradebook ``grade`` wrote."""
    import warnings

    from nbgrader.api import Gradebook

    from autograder.nbgrader_config import make_config

    course_id = make_config(str(out)).CourseDirectory.course_id
    with warnings.catch_warnings(), Gradebook(f"sqlite:///{out / 'gradebook.db'}", course_id) as gb:
        warnings.simplefilter("ignore")
        notebook = gb.find_submission_notebook(aid, aid, student)
        return {g.name: (g.score, g.max_score) for g in notebook.grades}


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("aid", PARAMS)
def test_release_is_what_solutions_generate(aid, lang, regenerated):
    """The English release is what solutions/ generates; the Chinese one what solutions/ and the catalogs of
    i18n/zh/ generate."""
    committed, fresh_root = COURSE.release_dir(lang) / aid, regenerated(lang)
    folder = committed.relative_to(REPO)
    assert committed.is_dir(), f"{folder} is missing: run python -m autograder release"
    files = sorted(p.relative_to(committed) for p in committed.rglob("*") if p.is_file()
                   and ".ipynb_checkpoints" not in p.parts and "__pycache__" not in p.parts)
    fresh = sorted(p.relative_to(fresh_root / aid) for p in (fresh_root / aid).rglob("*") if p.is_file())
    assert files == fresh
    for rel in files:
        assert (committed / rel).read_bytes() == (fresh_root / aid / rel).read_bytes(), \
            f"{folder}/{rel} differs from what solutions/ (and i18n/) generate: run python -m autograder release"


@pytest.mark.parametrize("aid", PARAMS)
def test_solution_gets_full_marks(aid, class_graded):
    grades = class_graded.grades
    row = grades[("solution", aid)]
    assert row["status"] == "ok", row
    assert float(row["points"]) == float(row["max_points"]) > 0, row
    assert row["tampered_cells"] == "", row
    # the points are the judge's, from the definitions alone; no flag: its verdicts agree with the kernel's
    assert row["flags"] == "", row


@pytest.mark.parametrize("aid", PARAMS)
def test_untouched_release_gets_zero(aid, class_graded):
    grades = class_graded.grades
    assert (COURSE.notebooks / aid / f"{aid}.ipynb").is_file(), f"notebooks/{aid} is missing: run release"
    row = grades[("release", aid)]
    assert row["status"] == "ok", row
    assert float(row["points"]) == 0.0 and float(row["max_points"]) > 0, row
    assert row["tampered_cells"] == "", row
    assert "cells stopped after" not in row["reason"], row  # failed quickly, no time limit was needed


@pytest.mark.parametrize("aid", sorted(MUTANTS))
def test_planted_bug_costs_its_exercise_and_nothing_else(aid, class_graded):
    grades, out = class_graded.grades, class_graded.out
    row = grades[("mutant", aid)]
    assert row["status"] == "ok", row
    assert row["tampered_cells"] == "", row
    scores = _cell_scores(out, "mutant", aid)
    lost = {f"test_{grade_id}" for grade_id in MUTANTS[aid]}
    assert lost <= set(scores), (lost, scores)
    for test_id, (score, max_score) in scores.items():
        if test_id in lost:
            assert score == 0, f"{test_id}: the planted bug should cost its points, got {score}/{max_score}"
        else:
            assert score == max_score > 0, f"{test_id}: a bug elsewhere cost this exercise {max_score - score} points"
    assert float(row["points"]) == sum(m for t, (_, m) in scores.items() if t not in lost), row


def test_a_chinese_solution_and_release_score_as_the_english_ones(class_graded):
    """The Chinese solution and release of one notebook (the class's ``solution_zh`` and ``release_zh``): the same
    points test by test as the English ones, no cell taken for an edit, no flag, no hidden test in the feedback."""
    grades, out = class_graded.grades, class_graded.out
    for english, chinese in (("solution", "solution_zh"), ("release", "release_zh")):
        en, zh = grades[(english, CHINESE)], grades[(chinese, CHINESE)]
        assert zh["status"] == "ok" and zh["tampered_cells"] == "" and zh["flags"] == "", zh
        assert (zh["points"], zh["max_points"]) == (en["points"], en["max_points"]), (en, zh)
        assert _cell_scores(out, chinese, CHINESE) == _cell_scores(out, english, CHINESE)
        text = demo.html_text(class_graded.feedback(chinese, CHINESE).read_text())
        for line in demo.hidden_test_lines(CHINESE, course=REPO):
            assert line not in text, (chinese, line)
    assert float(grades[("solution_zh", CHINESE)]["points"]) == float(grades[("solution_zh", CHINESE)]["max_points"])


@pytest.mark.parametrize("aid", PARAMS)
def test_feedback_has_no_hidden_test(aid, class_graded):
    secret = demo.hidden_test_lines(aid, course=REPO)
    assert (COURSE.notebooks / aid / f"{aid}.ipynb").is_file(), f"notebooks/{aid} is missing: run release"
    for student in ("solution", "release"):
        page = class_graded.feedback(student, aid).read_text()
        text = demo.html_text(page)
        for line in secret:
            assert line not in text, (student, line)
        assert "BEGIN HIDDEN TESTS" not in page and "BEGIN SOLUTION" not in page


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("aid", PARAMS)
def test_release_has_no_solution_or_hidden_test(aid, lang):
    path = COURSE.release_dir(lang) / aid / f"{aid}.ipynb"
    assert path.is_file(), f"{path.relative_to(REPO)} is missing: run release"
    text = path.read_text(encoding="utf-8")
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


def _diagnosis(message: str) -> str:
    """What a check's message says is wrong, without the inputs it drew (dtype, shape, seed, ranks, values)."""
    import re

    text = message.split("(seed ", 1)[-1].split("): ", 1)[-1].split(" (world_size=")[0]
    return re.sub(r"\s+", " ", re.sub(r"[-+]?\d[\d.e+-]*", "#", text)).strip()


def test_check_gives_the_graders_messages(class_graded):
    """``check`` on notebook 01 with a wrong ``reduce``, a reduce_scatter that forgets its own chunk and broadcast
    not written (student ``checked`` of the class): those three fail with the messages the grader's feedback gives
    for the same notebook (up to the values drawn), the others pass, and the score is the hidden tests'."""
    aid = CHECKED
    if ("checked", aid) not in class_graded.subs:
        pytest.skip(f"{aid} is not in solutions/")
    path = class_graded.subs[("checked", aid)]
    nb = nbformat.read(path, as_version=4)

    import tempfile

    tmp = tempfile.mkdtemp(prefix="c-", dir="/tmp")  # its own (short) temporary folder: check leaves nothing there
    try:
        proc = demo.cli("check", path, timeout=600, env={"TMPDIR": tmp})
        left = sorted(n for n in Path(tmp).iterdir() if not n.name.startswith("torchinductor_"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert left == [], f"check left {left}"
    lines = {ln.split()[0]: ln for ln in proc.stdout.splitlines() if ln.startswith("  ") and "pts" in ln}
    names = ["broadcast", "reduce", "all_reduce", "gather", "all_gather", "scatter", "reduce_scatter", "all_to_all"]
    assert sorted(lines) == sorted(names), proc.stdout
    wrong = set(CHECKED_WRONG)
    for name in set(names) - wrong:
        assert "ok    hidden tests passed" in lines[name], lines[name]
    assert "not started: it still raises NotImplementedError" in lines["broadcast"], lines["broadcast"]
    assert "without this rank's own: add your own chunk" in lines["reduce_scatter"], lines["reduce_scatter"]
    points = {c.metadata["nbgrader"]["grade_id"]: float(c.metadata["nbgrader"].get("points", 0))
              for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")}
    total = sum(points.values())
    lost = sum(points[f"test_{name}"] for name in wrong)
    assert f"Score from the grader's hidden tests: {total - lost:g} / {total:g} points" in proc.stdout, proc.stdout

    row = class_graded.grades[("checked", aid)]
    assert float(row["points"]) == total - lost, row
    html = class_graded.feedback("checked", aid).read_text(encoding="utf-8")
    import html as html_lib

    import re

    page = re.sub(r"\s+", " ", re.sub(r"[-+]?\d[\d.e+-]*", "#", html_lib.unescape(html)))
    for name in wrong:
        message = lines[name].split(f"test_{name}: ", 1)[1].split(" (and ")[0]
        assert _diagnosis(message) in page, f"{name}: check says {message!r}, the feedback page does not"
