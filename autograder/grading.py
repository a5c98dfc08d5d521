"""``python -m autograder grade``: grade a folder of submissions with nbgrader, robustly and in parallel.

Flow:

1. ``discover`` finds ``STUDENT/ASSIGNMENT/ASSIGNMENT.ipynb`` for every student and assignment; a missing or
   renamed notebook becomes a ``failed`` row right away, with what was found instead.
2. ``build_course_dir`` makes a template nbgrader course (release + gradebook) in a temporary directory.
3. One fork server, started before the template (``judge.SharedServer``), serves every kernel and judge of the
   run: each would otherwise import torch into a server of its own. ``--jobs N`` worker processes copy the
   template into their own course directory and gradebook and take submissions one at a time: parse, compare
   with the release (``tamper.repair``), screen the student's cells (``screen``: flags for review), hand the
   student's cells to a judge process (``judge.py``, started by the grader, never by the kernel), ``nbgrader
   autograde`` through the Python API with our guarded ``Execute`` preprocessor while the judge works, take the
   points from the judge (a test where the kernel's run and the judge's differ is flagged), write the feedback
   page.
4. The parent merges all results into one gradebook, writes ``grades.csv`` and prints a summary with the flagged
   notebooks. ``--shard K/N`` grades one slice of the students; ``shards.merge`` joins the slices' outputs.

Whatever happens to one submission (invalid JSON, a dead kernel, a cell that ignores interrupts, tampering) ends
as a row with ``status`` and ``reason``; it never stops the others.
"""

from __future__ import annotations

import concurrent.futures as cf
import csv
import json
import os
import multiprocessing
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

from .course import RELEASE, Course, CourseError, build_course_dir, scratch_databases
from .feedback import Summary, render
from .nbgrader_config import CELL_TIMEOUT
from .progress import Progress
from .judge import SharedServer, remove_leftovers
from .worker import CSV_COLUMNS, Result, Task, init_worker, max_points, run_tag, run_task

__all__ = ["CSV_COLUMNS", "Progress", "Result", "Task", "discover", "grade", "merge_gradebook", "summary_table",
           "write_csv"]

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
# the parent: run tasks, merge, report


def _context():
    # fork is cheap (the parent already imported nbgrader) and safe here (the parent runs no threads);
    # where fork is not the safe default, spawn.
    if sys.platform.startswith("linux"):
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def _failed(task: Task, reason: str) -> Result:
    return Result(task.student, task.assignment, 0.0, _MAX_POINTS.get(task.assignment, 0.0), "failed", reason)


_MAX_POINTS: dict[str, float] = {}
_WEIGHTS: dict[str, int] = {}   # assignment -> a guess of how long it takes to grade (its source's code size)


def _pool_round(indices, tasks, jobs, initargs, on_result) -> list[int]:
    """Grade ``indices`` with ``jobs`` processes; returns the ones lost because a worker process died."""
    broken = []
    workers = max(1, min(jobs, len(indices)))
    unstarted = _context().Value("i", len(indices))
    pool = cf.ProcessPoolExecutor(workers, mp_context=_context(), initializer=init_worker,
                                  initargs=(*initargs, unstarted))
    try:
        # heaviest first (longest-processing-time order), so that the last notebook to finish is a short one and
        # no grading process sits idle for long at the end; a missing notebook costs nothing
        order = sorted(indices, key=lambda i: -_WEIGHTS.get(tasks[i].assignment, 0) if tasks[i].notebook else 1)
        futures = {pool.submit(run_task, i, tasks[i]): i for i in order}
        for fut in cf.as_completed(futures):
            i = futures[fut]
            try:
                on_result(i, fut.result())
            except cf.process.BrokenProcessPool:
                broken.append(i)
            except Exception as exc:  # a bug in the grader: report it on this row
                on_result(i, _failed(tasks[i], f"grading failed: internal error {type(exc).__name__}: {exc}"))
    except BaseException:  # Ctrl-C or SIGTERM: stop now, do not wait for the queued notebooks
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        _kill_trees(processes)
        raise
    pool.shutdown(wait=True)
    return sorted(broken)


def _kill_trees(processes) -> None:
    """Kill the grading processes and the kernels they started. A judge ends with its grading process, a worker
    with whoever asked for it; the folders of the kernels' workers go once the kernels are gone."""
    import psutil

    from labsupport._pool import remove_stale_dirs

    kernels = []
    for proc in processes:
        try:
            kernels += psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            pass
    for proc in processes:
        proc.kill()
    for kernel in kernels:
        try:
            kernel.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(kernels, timeout=10)
    for proc in processes:
        proc.join(10)
    deadline = time.monotonic() + 5  # an orphaned kernel is reaped by init a moment after it died
    while any(psutil.pid_exists(k.pid) for k in kernels) and time.monotonic() < deadline:
        time.sleep(0.05)
    remove_stale_dirs(tempfile.gettempdir())


def _run_pool(tasks, jobs, initargs, progress) -> list[Result]:
    """Grade every task; survive a worker process that dies (student code can kill its kernel's parent).

    When a worker dies, every unfinished task of its pool is lost with it. The notebooks that were being graded at
    that moment (their markers are still in ``running/``) are suspects and are regraded alone, each in a pool of
    its own; the others simply go into the next round. A suspect that kills its own pool too gets a failed row.
    """
    results: dict[int, Result] = {}
    running = Path(initargs[1]) / "running"
    running.mkdir(exist_ok=True)

    def on_result(i, result):
        results[i] = result
        progress.update(len(results), f"{result.student}/{result.assignment}: "
                                      f"{result.points:g}/{result.max_points:g} {result.status}")

    pending, suspects = list(range(len(tasks))), []
    while pending or suspects:
        if pending:
            broken = _pool_round(pending, tasks, jobs, initargs, on_result)
            marked = {int(p.name) for p in running.iterdir()}
            for p in running.iterdir():
                p.unlink()
            caught = [i for i in broken if i in marked] or broken  # no marker: a worker died before any task
            suspects += caught
            pending = [i for i in broken if i not in caught]
            continue
        i = suspects.pop(0)
        if _pool_round([i], tasks, 1, initargs, on_result):
            on_result(i, _failed(tasks[i], "grading failed: the grading process was killed while running this "
                                           "notebook (by the notebook's code, e.g. os.kill(os.getppid(), ...), or "
                                           "out of memory)"))
            for p in running.iterdir():
                p.unlink()
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


def flagged_lines(results: list[Result]) -> list[str]:
    """One line per flagged notebook, for the summary."""
    return [f"  {r.student}/{r.assignment}: {'; '.join(r.flags)}" for r in
            sorted(results, key=lambda r: (r.student, r.assignment)) if r.flags]


def shard_of(tasks: list[Task], shard: tuple[int, int] | None) -> list[Task]:
    """The tasks of the K-th of N slices (K from 1): the students in sorted order, dealt round-robin, so each slice
    gets every K-th student with all of their notebooks and the same input always gives the same slices."""
    if shard is None:
        return tasks
    k, n = shard
    students = sorted({t.student for t in tasks})
    mine = {s for i, s in enumerate(students) if i % n == k - 1}
    return [t for t in tasks if t.student in mine]


def grade(submissions, course: Course, assignment: str | None = None, jobs: int = 1, out="grading-out",
          cell_timeout: float = CELL_TIMEOUT, stream=None, shard: tuple[int, int] | None = None) -> list[Result]:
    """Grade ``submissions`` into ``out`` (see the module docstring); returns the results in CSV order.

    ``shard=(K, N)`` grades only the K-th of N slices of the students (see ``shard_of``); ``merge`` joins the
    outputs of all N.
    """
    stream = stream or sys.stdout
    submissions, out = Path(submissions).resolve(), Path(out).resolve()
    if jobs < 1:
        raise CourseError("--jobs must be at least 1")
    tasks = shard_of(discover(submissions, course, assignment), shard)
    if not tasks:
        print(f"shard {shard[0]}/{shard[1]} has no students (there are fewer students than shards)", file=stream)
        out.mkdir(parents=True, exist_ok=True)
        write_csv(out / "grades.csv", [])
        return []
    assignments = sorted({t.assignment for t in tasks})
    out.mkdir(parents=True, exist_ok=True)
    for t in tasks:  # a page or log left by an earlier run must not pass for this run's
        (out / "feedback" / t.student / f"{t.assignment}.html").unlink(missing_ok=True)
        (out / "logs" / t.student / f"{t.assignment}.log").unlink(missing_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="autograder-grade-") as tmp, \
            SharedServer(f"judge-{run_tag(tmp)}-fork-"):  # it imports torch while the template is built
        scratch_databases(tmp)
        template = build_course_dir(course, assignments, Path(tmp) / "template")
        phases = {"template": time.monotonic() - started}
        for aid in assignments:
            _MAX_POINTS[aid] = max_points(template / RELEASE / aid / f"{aid}.ipynb")
            _WEIGHTS[aid] = course.source_notebook(aid).stat().st_size
        progress = Progress(len(tasks), "grading")
        initargs = (str(template), tmp, str(out), cell_timeout, str(course.root))
        try:
            results = _run_pool(tasks, jobs, initargs, progress)
        finally:
            remove_leftovers(run_tag(tmp))
        phases["pool"] = time.monotonic() - started - phases["template"]
        merge_gradebook(template / "gradebook.db", out / "gradebook.db", results)
        phases["merge"] = time.monotonic() - started - phases["template"] - phases["pool"]
    timings = os.environ.get("AUTOGRADER_TIMINGS")
    if timings:  # where the time went, for benchmarks/grading.py
        Path(timings).write_text(json.dumps({"phases": phases, "tasks": [
            {"student": r.student, "assignment": r.assignment, **r.phases} for r in results]}, indent=1))
    for r in results:  # rows made here (a grading process died) still get their page
        page = out / "feedback" / r.student / f"{r.assignment}.html"
        if not page.exists():
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(render(Summary(r.student, r.assignment, r.points, r.max_points, r.status, r.reason)),
                            encoding="utf-8")
    results.sort(key=lambda r: (r.student, r.assignment))
    write_csv(out / "grades.csv", results)
    ok = sum(r.status == "ok" for r in results)
    print(summary_table(results), file=stream)
    flagged = flagged_lines(results)
    if flagged:
        print(f"\nFlagged for review ({len(flagged)}): see the flags column of grades.csv", file=stream)
        print("\n".join(flagged), file=stream)
    print(f"\nGraded {len(results)} notebooks in {time.monotonic() - started:.1f} s with {jobs} job(s): "
          f"{ok} ok, {len(results) - ok} failed.\nWrote {out / 'grades.csv'}, {out / 'feedback'}/ and "
          f"{out / 'gradebook.db'}.", file=stream)
    return results
