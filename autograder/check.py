"""``python -m autograder check NOTEBOOK``: what the grader would say, before handing in.

Runs the notebook top to bottom in a fresh kernel (working directory: the notebook's folder,
``LABSUPPORT_GRADING=1``) and reports per exercise whether its answer cell and its tests ran without error.

Where this copy of the course has the hidden tests (the course repository: ``solutions/`` and
``autograder/checks/``), the grader's own judge runs them on the notebook's definitions while the kernel runs, and
each exercise shows the judge's verdict with the same message the grader's feedback page would give; the score is
the hidden tests' (on inputs drawn now). The student edition has no hidden tests: there the report comes from the
visible tests, and the score is an estimate.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from labsupport.i18n import _
from labsupport.visible import NOT_STARTED_LINE

from .course import CourseError
from .execute import cell_label, has_visible_code, kernel_env, nbgrader_meta, notebook_language, run_notebook, speaking
from .nbgrader_config import CELL_TIMEOUT
from .progress import Progress



@dataclass
class Exercise:
    name: str
    answer: int                                   # index of the answer cell
    tests: list[int] = field(default_factory=list)   # indices of its visible test cells (and its graded cell)
    points: float = 0.0


def exercises(nb) -> list[Exercise]:
    """Each answer cell with the read-only test cells that follow it (up to the next answer cell)."""
    found: list[Exercise] = []
    for i, cell in enumerate(nb.cells):
        meta = nbgrader_meta(cell)
        if meta.get("solution") and not meta.get("grade"):
            found.append(Exercise(meta.get("grade_id", f"cell {i + 1}"), i))
        elif found and cell.cell_type == "code" and str(meta.get("grade_id", "")).startswith("test_"):
            found[-1].tests.append(i)
            if meta.get("grade"):
                found[-1].points += float(meta.get("points", 0))
    return found


def _error_line(cell) -> str | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            ename, value = out.get("ename"), str(out.get("evalue", "")).strip().splitlines()
            if ename == "NotImplementedError" or (value and "NotImplementedError" in value[-1]):
                return _(NOT_STARTED_LINE)
            # a labsupport error leads with what happened on which rank (its last line says who was stopped)
            line = value[0] if ename in ("WorkerError", "WorkerTimeout") else value[-1] if value else ""
            return f"{ename}: {line}" if line else str(ename)
    return None


@dataclass
class Hidden:
    """The grader's hidden tests of one assignment, where this copy of the course has them (not in the student
    edition): the course root and the instructor's and the students' notebooks."""
    root: Path
    source: object
    release: object
    translations: dict   # {language: its source and release notebooks}: their read-only cells are not edits


def hidden_tests(path: Path, course_root=None) -> Hidden | None:
    import nbformat

    from .course import Course

    try:
        course = Course.at(course_root)
    except CourseError:
        return None
    aid = path.stem
    source, release = course.source_notebook(aid), course.notebooks / aid / f"{aid}.ipynb"
    if not ((course.root / "autograder" / "checks").is_dir() and source.is_file() and release.is_file()):
        return None
    try:
        from .translation import translated_versions

        translations = translated_versions(course, aid)
    except ImportError:   # no Babel to read the catalogs with
        translations = {}
    return Hidden(course.root, nbformat.read(source, as_version=4), nbformat.read(release, as_version=4),
                  translations)


def _judge(nb, hidden: Hidden, timeout: float, log_dir: Path):
    """Start the grader's judge on this notebook's definitions (it runs while the kernel does)."""
    from .judge import Judge, judge_spec
    from .tamper import repair

    repaired, report = repair(nb, hidden.release, hidden.source, hidden.translations)
    judge = Judge(str(hidden.root), log_dir, "check")
    judge.start(judge_spec(repaired, hidden.source, hidden.release, timeout, language=report.language))
    return judge


def _verdicts(judge, hidden: Hidden, timeout: float) -> dict:
    """grade_id -> (points, message or None): the judge's verdicts, worded as the grader's feedback words them."""
    from . import feedback as fb
    from .judge import verdicts_to_points

    full = _points(hidden.source)
    report = judge.result(120.0 + len(full) * (timeout + 30.0))
    secret = fb.hidden_lines(hidden.source, hidden.release)
    return {gid: (points, None if message is None else fb.clean_value(message, secret))
            for gid, (points, message) in verdicts_to_points(report, full).items()}


def _points(nb) -> dict[str, float]:
    return {nbgrader_meta(c)["grade_id"]: float(nbgrader_meta(c).get("points", 0))
            for c in nb.cells if nbgrader_meta(c).get("grade")}


def check(path, timeout: float = CELL_TIMEOUT, stream=None, course_root=None) -> int:
    """Run the check and print the report; returns the exit status (0 all tests pass, 1 otherwise). It speaks the
    notebook's language (a Chinese notebook's set-up cell switches to Chinese) unless ``LABSUPPORT_LANG`` names one."""
    import nbformat

    stream = stream or sys.stdout
    path = Path(path)
    if not path.is_file():
        raise CourseError(_("notebook {path} does not exist").format(path=path))
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as exc:
        raise CourseError(_("cannot read {path} as a notebook: {error}").format(
            path=path, error=str(exc).splitlines()[0] if str(exc) else repr(exc)))
    found = exercises(nb)
    if not found:
        raise CourseError(_("{path} has no exercises (no cells with nbgrader answer metadata)").format(path=path))
    with _language_of(nb):
        return _check(path, nb, found, timeout, stream, course_root)


@contextmanager
def _language_of(nb):
    """The report in the notebook's language, unless the environment (``LABSUPPORT_LANG``) names one."""
    if "LABSUPPORT_LANG" in os.environ:
        yield
        return
    with speaking(notebook_language(nb)):
        yield


def _check(path: Path, nb, found: list[Exercise], timeout: float, stream, course_root) -> int:
    import tempfile

    hidden = hidden_tests(path, course_root)
    if hidden:
        start = _("Checking {path} in a fresh kernel, and with the grader's hidden tests (this runs every cell; it can "
                  "take a minute)...")
    else:
        start = _("Checking {path} in a fresh kernel (this runs every cell; it can take a minute)...")
    print(start.format(path=path), file=stream, flush=True)
    folder = path.resolve().parent
    verdicts = None
    from .judge import SharedServer

    with SharedServer("check-"), tempfile.TemporaryDirectory(prefix="check-logs-") as logs:
        judge = _judge(nb, hidden, timeout, Path(logs)) if hidden else None
        try:
            progress = Progress(len(nb.cells), "running", plain=False)
            record = run_notebook(nb, folder, timeout, env=kernel_env([folder.parent.parent]), progress=progress)
            progress.close()
            if judge is not None:
                verdicts = _verdicts(judge, hidden, timeout)
        finally:
            if judge is not None:
                judge.close()
    earned, total, clean = _report(nb, found, record, verdicts, stream)
    if record.failure == "dead_kernel":
        print("\n" + _("The kernel died while running {cell}; later cells did not run.").format(
            cell=record.failure_cell), file=stream)
    elif record.failure == "unresponsive":
        print("\n" + _("{cell} was still running after {timeout} s and ignored the interrupt; later cells did not "
                       "run.").format(cell=record.failure_cell, timeout=f"{timeout:g}"), file=stream)
    elif record.failure:
        print("\n" + _("The run stopped early: {cell}").format(cell=record.failure_cell), file=stream)
    if record.timed_out:
        print("\n" + _("Stopped after {timeout} s: {cells}").format(timeout=f"{timeout:g}",
                                                                    cells=", ".join(record.timed_out)), file=stream)
    if verdicts is not None:
        print("\n" + _("Score from the grader's hidden tests: {earned} / {total} points.\n"
                       "The messages are the ones the grader's feedback gives. Grading draws new inputs and also runs "
                       "your notebook top to bottom, so keep every cell working.").format(
            earned=f"{earned:g}", total=f"{total:g}"), file=stream)
    else:
        print("\n" + _("Local estimate: {earned} / {total} points from the visible tests.\n"
                       "This is an estimate: grading also runs hidden tests, which are not in your copy, so your grade "
                       "can be lower.").format(earned=f"{earned:g}", total=f"{total:g}"), file=stream)
    return 0 if earned == total and clean and not record.failure else 1


def _report(nb, found: list[Exercise], record, verdicts: dict | None, stream) -> tuple[float, float, bool]:
    """One line per exercise, and one more per further problem; returns (points earned, points in all, whether
    nothing failed)."""
    width = max(len(e.name) for e in found)
    total = sum(e.points for e in found)
    earned, clean = 0.0, True
    for ex in found:
        own, problems = [], []   # the answer cell's own error comes first: it often causes the others
        for i in [ex.answer] + ex.tests:
            cell = nb.cells[i]
            if record.failure and cell.cell_type == "code" and cell.source.strip() \
                    and cell.get("execution_count") is None:
                problems.append(_("{cell} did not run").format(cell=cell_label(cell, i)))
                break
            err = _error_line(cell)
            if err and not (verdicts is not None and nbgrader_meta(cell).get("grade")):
                (own if i == ex.answer else problems).append(f"{cell_label(cell, i)}: {err}")
        hidden = [(nbgrader_meta(nb.cells[i])["grade_id"], verdicts.get(nbgrader_meta(nb.cells[i])["grade_id"]))
                  for i in ex.tests if verdicts is not None and nbgrader_meta(nb.cells[i]).get("grade")]
        failed_hidden = [f"{gid}: {v[1]}" for gid, v in hidden if v is not None and v[1] is not None]
        checked = any(has_visible_code(nb.cells[i].source) for i in ex.tests)
        if verdicts is not None:
            points = sum(v[0] for _, v in hidden if v is not None)
            earned += points
            problems = own + failed_hidden + problems
            verdict = "ok    " + _("hidden tests passed") if not problems else "FAIL  " + problems[0]
            if not failed_hidden and problems:
                verdict = "ok    " + _("hidden tests passed, but {problem}").format(problem=problems[0])
        elif own or problems:
            problems = own + problems
            verdict = "FAIL  " + problems[0]
        elif not checked:
            verdict = "----  " + _("no visible test for this exercise")
        else:
            verdict = "ok    " + _("visible tests passed")
            earned += ex.points
        clean = clean and not problems
        points = _("{points} pts").format(points=f"{ex.points:>4g}")
        print(f"  {ex.name.ljust(width)}  {points}  {verdict}", file=stream)
        for more in problems[1:]:
            print(f"  {' ' * width}            " + _("also: {problem}").format(problem=more), file=stream)
    return earned, total, clean
