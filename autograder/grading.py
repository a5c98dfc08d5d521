"""``python -m autograder grade``: grade a folder of submissions with nbgrader, robustly and in parallel.

Flow:

1. ``discover`` finds ``STUDENT/ASSIGNMENT/ASSIGNMENT.ipynb`` for every student and assignment; a missing or
   renamed notebook becomes a ``failed`` row right away, with what was found instead.
2. ``build_course_dir`` makes a template nbgrader course (release + gradebook) in a temporary directory.
3. ``--jobs N`` worker processes each copy the template into their own course directory and gradebook and take
   submissions one at a time: parse, compare with the release (``tamper.repair``), ``nbgrader autograde`` through
   the Python API with our guarded ``Execute`` preprocessor, read the scores, write the feedback page.
4. The parent merges all results into one gradebook, writes ``grades.csv`` and prints a summary.

Whatever happens to one submission (invalid JSON, a dead kernel, a cell that ignores interrupts, tampering) ends
as a row with ``status`` and ``reason``; it never stops the others.
"""

from __future__ import annotations

import concurrent.futures as cf
import csv
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import feedback as fb
from .course import RELEASE, SOURCE, Course, CourseError, build_course_dir
from .execute import CURRENT, cell_label, guarded_execute_class, kernel_env, nbgrader_meta, reset_record
from .nbgrader_config import CELL_TIMEOUT

CSV_COLUMNS = ["student", "assignment", "points", "max_points", "status", "reason", "tampered_cells"]
MAX_REASON = 1000


@dataclass
class Task:
    student: str
    assignment: str
    notebook: str | None          # path of the submitted notebook, None when it is missing
    problem: str | None = None    # why it cannot be graded (missing notebook)


@dataclass
class Result:
    student: str
    assignment: str
    points: float
    max_points: float
    status: str                   # "ok" or "failed"
    reason: str
    tampered_cells: list[str] = field(default_factory=list)
    tests: list[dict] = field(default_factory=list)   # {"grade_id", "points", "max_points", "message"}
    seconds: float = 0.0

    def row(self) -> dict:
        return {
            "student": self.student, "assignment": self.assignment, "points": f"{self.points:g}",
            "max_points": f"{self.max_points:g}", "status": self.status, "reason": self.reason,
            "tampered_cells": ";".join(self.tampered_cells),
        }


# ---------------------------------------------------------------------------------------------------------------
# finding submissions


def _listing(folder: Path, limit: int = 4) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if not p.name.startswith("."))
    if not names:
        return "nothing"
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def discover(submissions: Path, course: Course, assignment: str | None) -> list[Task]:
    """One task per (student, assignment); see the module docstring."""
    if not submissions.is_dir():
        raise CourseError(f"submissions directory {submissions} does not exist")
    known = course.select(assignment)
    students = sorted(p.name for p in submissions.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    if not students:
        raise CourseError(f"no student folders in {submissions} (expected STUDENT/ASSIGNMENT/ASSIGNMENT.ipynb)")
    if assignment is None:
        present = {a for s in students for a in known if (submissions / s / a).exists()}
        wanted = [a for a in known if a in present]
        if not wanted:
            raise CourseError(f"no submissions of {', '.join(known)} in {submissions} "
                              "(expected STUDENT/ASSIGNMENT/ASSIGNMENT.ipynb)")
    else:
        wanted = known
    tasks = []
    for student in students:
        for aid in wanted:
            folder = submissions / student / aid
            path = folder / f"{aid}.ipynb"
            expected = f"expected {student}/{aid}/{aid}.ipynb"
            if path.is_file():
                tasks.append(Task(student, aid, str(path)))
                continue
            if folder.is_dir():
                found = sorted(p.name for p in folder.glob("*.ipynb"))
                problem = (f"missing notebook: {expected}, found {', '.join(found)}" if found
                           else f"missing notebook: {expected}, found no notebook in {student}/{aid}/ "
                                f"(it holds {_listing(folder)})")
            else:
                problem = (f"missing notebook: {expected}; there is no folder {student}/{aid}/ "
                           f"({student}/ holds {_listing(submissions / student)})")
            tasks.append(Task(student, aid, None, problem))
    return tasks


# ---------------------------------------------------------------------------------------------------------------
# one worker process

_WORKER: dict = {}


def _quiet_process(log_path: Path) -> None:
    """Send this process's (and its kernels') stdout/stderr to a log file, keep nbgrader's logger off the terminal."""
    import logging

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.getLogger("traitlets").addHandler(logging.NullHandler())
    warnings.filterwarnings("ignore")


def _worker_init(template: str, work_root: str, out_dir: str, cell_timeout: float, course_root: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="worker-", dir=work_root))
    _quiet_process(root.with_suffix(".log"))
    os.environ.update(kernel_env([course_root]))
    course_dir = root / "course"
    shutil.copytree(template, course_dir)
    from nbgrader.converters import Autograde
    from nbgrader.preprocessors import Execute

    from .course import nbgrader_api

    defaults = Autograde.autograde_preprocessors.default()
    preprocessors = [guarded_execute_class() if p is Execute else p for p in defaults]
    api = nbgrader_api(course_dir, cell_timeout=cell_timeout, Autograde__autograde_preprocessors=preprocessors)
    _WORKER.update(root=course_dir, api=api, out=Path(out_dir), timeout=cell_timeout, releases={}, sources={}, secrets={})


def _release(aid: str):
    import nbformat

    if aid not in _WORKER["releases"]:
        root = _WORKER["root"]
        release = nbformat.read(root / RELEASE / aid / f"{aid}.ipynb", as_version=4)
        source = nbformat.read(root / SOURCE / aid / f"{aid}.ipynb", as_version=4)
        _WORKER["releases"][aid] = release
        _WORKER["sources"][aid] = source
        _WORKER["secrets"][aid] = fb.hidden_lines(source, release)
    return _WORKER["releases"][aid], _WORKER["secrets"][aid]


def _max_points(release) -> float:
    return float(sum(nbgrader_meta(c).get("points", 0) for c in release.cells if nbgrader_meta(c).get("grade")))


def _read_submission(path: str):
    """The submitted notebook, or the reason it cannot be read."""
    import nbformat

    try:
        raw = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        return None, f"grading failed: notebook is not UTF-8 text ({exc.reason} at byte {exc.start})"
    try:
        json.loads(raw)
    except json.JSONDecodeError as exc:
        return None, f"grading failed: notebook is not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})"
    try:
        nb = nbformat.reads(raw, as_version=4)
        nbformat.validate(nb)
    except Exception as exc:  # nbformat raises several kinds
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"grading failed: not a valid Jupyter notebook ({first[:200]})"
    return nb, None


def _unique_ids(nb) -> None:
    seen = set()
    for i, cell in enumerate(nb.cells):
        if "id" in cell:
            while cell.id in seen:
                cell.id = f"{cell.id}-{i}"
            seen.add(cell.id)


def _failure_reason(result: dict, timeout: float) -> str:
    rec = CURRENT
    if rec.failure == "dead_kernel":
        return (f"grading failed: the kernel died while running cell {rec.failure_cell} (the process was killed or "
                "exited: os._exit, os.kill, a crash in native code or running out of memory); no score was recorded")
    if rec.failure == "unresponsive":
        return (f"grading failed: cell {rec.failure_cell} was still running after the {timeout:g} s limit and "
                "ignored the interrupt (a loop that catches KeyboardInterrupt or ignores SIGINT?); the kernel was "
                "stopped and no score was recorded")
    text = (result.get("log") or "") + "\n" + (result.get("error") or "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "Please see the" not in ln]
    errors = [ln for ln in lines if "Error" in ln or "Exception" in ln] or lines or ["unknown error"]
    return f"grading failed: nbgrader could not grade this notebook ({errors[-1][:300]})"


def _outcomes(graded, scores: dict, secret: set[str]) -> list[fb.TestOutcome]:
    outcomes = []
    for cell in graded.cells:
        meta = nbgrader_meta(cell)
        gid = meta.get("grade_id")
        if not meta.get("grade") or gid not in scores:
            continue
        points, max_points = scores[gid]
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        message = None
        if errors:
            message = fb.short_message(errors[-1].get("ename", "Error"), errors[-1].get("evalue", ""), secret)
        elif points < max_points:
            message = "no points"
        outcomes.append(fb.TestOutcome(gid, points, max_points, message))
    return outcomes


def _other_errors(graded) -> list[str]:
    """Errors in cells that are not test cells (answer cells, the student's own cells)."""
    found = []
    for i, cell in enumerate(graded.cells):
        meta = nbgrader_meta(cell)
        if meta.get("grade") or (meta.get("locked") and not meta.get("solution")):
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error" and out.get("ename") != "CellTimeoutError":
                found.append(f"{cell_label(cell, i)} ({out.get('ename')})")
    return found


def _one_line(text: str, limit: int = 160) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _compose(parts: list[str]) -> str:
    reason = "; ".join(p for p in parts if p)
    return reason if len(reason) <= MAX_REASON else reason[:MAX_REASON - 3] + "..."


def grade_task(task: Task) -> Result:
    """Grade one submission in this worker process (see ``_worker_init``)."""
    started = time.monotonic()
    release, secret = _release(task.assignment)
    max_points = _max_points(release)
    result = Result(task.student, task.assignment, 0.0, max_points, "failed", task.problem or "")
    summary_notes: list[str] = []
    graded = None
    try:
        if task.problem is None:
            graded = _grade_notebook(task, release, secret, result, summary_notes)
    except Exception as exc:  # a bug or an nbgrader surprise: report it on this row, keep grading the others
        result.status, result.points = "failed", 0.0
        result.reason = f"grading failed: internal error {type(exc).__name__}: {str(exc)[:300]}"
    outcomes = [fb.TestOutcome(**t) for t in result.tests]
    summary = fb.Summary(task.student, task.assignment, result.points, max_points, result.status, result.reason,
                         outcomes, summary_notes)
    clean = fb.clean_notebook(graded, release, {o.grade_id: o for o in outcomes}, secret) if graded else None
    page = _WORKER["out"] / "feedback" / task.student / f"{task.assignment}.html"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(fb.render(summary, clean), encoding="utf-8")
    result.seconds = time.monotonic() - started
    return result


def _grade_notebook(task: Task, release, secret, result: Result, notes: list[str]):
    import nbformat
    from nbgrader.api import Gradebook

    from .tamper import repair

    nb, problem = _read_submission(task.notebook)
    if problem:
        result.reason = problem
        return None
    repaired, report = repair(nb, release, _WORKER["sources"][task.assignment])
    _unique_ids(repaired)
    result.tampered_cells = report.tampered_cells
    root, api = _WORKER["root"], _WORKER["api"]
    submitted = root / "submitted" / task.student / task.assignment
    autograded = root / "autograded" / task.student / task.assignment
    for d in (submitted, autograded):
        shutil.rmtree(d, ignore_errors=True)
    submitted.mkdir(parents=True)
    nbformat.write(repaired, submitted / f"{task.assignment}.ipynb")
    reset_record()
    outcome = api.autograde(task.assignment, task.student, force=True, create=True)
    tamper_notes = report.notes()
    try:
        if not outcome.get("success"):
            result.reason = _compose([_failure_reason(outcome, _WORKER["timeout"])] + tamper_notes)
            notes.extend(tamper_notes)
            for cell in repaired.cells:  # the feedback shows the code that was submitted, without outputs
                if cell.cell_type == "code":
                    cell.outputs, cell.execution_count = [], None
            return repaired
        graded = nbformat.read(autograded / f"{task.assignment}.ipynb", as_version=4)
        with Gradebook(api.coursedir.db_url, api.coursedir.course_id) as gb:
            sub = gb.find_submission_notebook(task.assignment, task.assignment, task.student)
            scores = {g.name: (float(g.score), float(g.max_score)) for g in sub.grades}
        outcomes = _outcomes(graded, scores, secret)
        result.tests = [asdict(o) for o in outcomes]
        result.points = float(sum(o.points for o in outcomes))
        result.status = "ok"
        parts = list(tamper_notes)
        if CURRENT.timed_out:
            parts.append(f"cells stopped after the {_WORKER['timeout']:g} s limit: {', '.join(CURRENT.timed_out)}")
        if CURRENT.truncated:
            parts.append(f"output cut in {', '.join(CURRENT.truncated)}")
        notes.extend(parts)
        others = _other_errors(graded)
        if others:
            parts.append(f"errors in other cells: {', '.join(others)}")
        failed = [f"{o.grade_id} ({_one_line(o.message)})" for o in outcomes if o.message is not None]
        if failed:
            parts.append(f"failed tests: {', '.join(failed)}")
        result.reason = _compose(parts)
        return graded
    finally:
        shutil.rmtree(submitted.parent, ignore_errors=True)
        shutil.rmtree(autograded.parent, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# the parent: run tasks, merge, report


class Progress:
    """A tiny progress bar on stderr: redrawn in place on a terminal, one plain line per step otherwise."""

    def __init__(self, total: int, label: str, stream=None):
        self.total, self.label = total, label
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.monotonic()

    def update(self, done: int, text: str = "") -> None:
        elapsed = time.monotonic() - self.start
        if self.tty:
            width = 24
            filled = int(width * done / max(self.total, 1))
            line = f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} {elapsed:5.0f}s {text}"
            self.stream.write(line[:120].ljust(120))
            if done >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(f"{self.label} {done}/{self.total} ({elapsed:.0f}s) {text}\n")
        self.stream.flush()


def _context():
    # fork is cheap (the parent already imported nbgrader) and safe here (the parent runs no threads);
    # where fork is not the safe default, spawn.
    if sys.platform.startswith("linux"):
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def _run_pool(tasks, jobs, initargs, progress) -> list[Result]:
    results: dict[int, Result] = {}
    pending = list(range(len(tasks)))
    for attempt in range(2):
        if not pending:
            break
        workers = max(1, min(jobs, len(pending)))
        broken = []
        with cf.ProcessPoolExecutor(workers, mp_context=_context(), initializer=_worker_init,
                                    initargs=initargs) as pool:
            futures = {pool.submit(grade_task, tasks[i]): i for i in pending}
            for fut in cf.as_completed(futures):
                i = futures[fut]
                try:
                    results[i] = fut.result()
                except cf.process.BrokenProcessPool:
                    broken.append(i)
                    continue
                except Exception as exc:
                    t = tasks[i]
                    results[i] = Result(t.student, t.assignment, 0.0, 0.0, "failed",
                                        f"grading failed: internal error {type(exc).__name__}: {exc}")
                r = results[i]
                progress.update(len(results), f"{r.student}/{r.assignment}: {r.points:g}/{r.max_points:g} {r.status}")
        pending = sorted(broken)
        jobs = 1  # a second try, one at a time, for what was lost with a crashed worker
    for i in pending:
        t = tasks[i]
        results[i] = Result(t.student, t.assignment, 0.0, 0.0, "failed",
                            "grading failed: the grading process died while grading this notebook (twice)")
        progress.update(len(results), f"{t.student}/{t.assignment}: failed")
    return [results[i] for i in range(len(tasks))]


def merge_gradebook(template_db: Path, target: Path, results: list[Result]) -> None:
    """One nbgrader gradebook with every result: the template's assignments plus a submission per row."""
    from nbgrader.api import Gradebook

    from .nbgrader_config import make_config

    if target.exists():
        target.unlink()
    shutil.copyfile(template_db, target)
    course_id = make_config(str(target.parent)).CourseDirectory.course_id
    with warnings.catch_warnings(), Gradebook(f"sqlite:///{target}", course_id) as gb:
        warnings.simplefilter("ignore")  # SQLAlchemy chatter from nbgrader's models
        for r in results:
            gb.update_or_create_student(r.student)
            sub = gb.add_submission(r.assignment, r.student)
            scores = {t["grade_id"]: t["points"] for t in r.tests}
            for notebook in sub.notebooks:
                for grade in notebook.grades:
                    grade.auto_score = scores.get(grade.name, 0.0)
                    # a notebook that could not be graded needs a person: formgrader lists it as such
                    grade.needs_manual_grade = r.status != "ok"
            gb.db.commit()


def write_csv(path: Path, results: list[Result]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in sorted(results, key=lambda r: (r.student, r.assignment)):
            writer.writerow(r.row())


def summary_table(results: list[Result], width: int = 70) -> str:
    rows = [("student", "assignment", "points", "status", "reason")]
    for r in sorted(results, key=lambda r: (r.student, r.assignment)):
        reason = r.reason if len(r.reason) <= width else r.reason[:width - 3] + "..."
        rows.append((r.student, r.assignment, f"{r.points:g}/{r.max_points:g}", r.status, reason))
    widths = [max(len(row[k]) for row in rows) for k in range(4)]
    lines = ["  ".join(row[k].ljust(widths[k]) for k in range(4)) + "  " + row[4] for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 6)
    return "\n".join(line.rstrip() for line in lines)


def grade(submissions, course: Course, assignment: str | None = None, jobs: int = 1, out="grading-out",
          cell_timeout: float = CELL_TIMEOUT, stream=None) -> list[Result]:
    """Grade ``submissions`` into ``out`` (see the module docstring); returns the results in CSV order."""
    stream = stream or sys.stdout
    submissions, out = Path(submissions).resolve(), Path(out).resolve()
    if jobs < 1:
        raise CourseError("--jobs must be at least 1")
    tasks = discover(submissions, course, assignment)
    assignments = sorted({t.assignment for t in tasks})
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="autograder-grade-") as tmp:
        template = build_course_dir(course, assignments, Path(tmp) / "template")
        progress = Progress(len(tasks), "grading")
        initargs = (str(template), tmp, str(out), cell_timeout, str(course.root))
        results = _run_pool(tasks, jobs, initargs, progress)
        merge_gradebook(template / "gradebook.db", out / "gradebook.db", results)
    results.sort(key=lambda r: (r.student, r.assignment))
    write_csv(out / "grades.csv", results)
    ok = sum(r.status == "ok" for r in results)
    print(summary_table(results), file=stream)
    print(f"\nGraded {len(results)} notebooks in {time.monotonic() - started:.1f} s with {jobs} job(s): "
          f"{ok} ok, {len(results) - ok} failed.\nWrote {out / 'grades.csv'}, {out / 'feedback'}/ and "
          f"{out / 'gradebook.db'}.", file=stream)
    return results
