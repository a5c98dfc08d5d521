"""Grading one submission, inside a grader worker process.

A worker copies the template nbgrader course (release + gradebook) into a directory of its own, then grades
submissions one at a time (``grade_task``): read the notebook, compare it with the release and repair it
(``tamper.repair``), run ``nbgrader autograde`` in-process with our guarded ``Execute`` preprocessor, read the
scores from its gradebook, and write the student's feedback page. Anything that goes wrong becomes the ``status``
and ``reason`` of that one result.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import feedback as fb
from .checks._common import REFUSED
from .course import RELEASE, SOURCE
from .execute import CURRENT, guarded_execute_class, kernel_env, nbgrader_meta, reset_record, speaking
from .judge import judge_spec
from .reading import (
    _compose,
    _failure_reason,
    _one_line,
    _other_errors,
    _outcomes,
    _read_submission,
    _unique_ids,
)
from .screen import screen_notebook

INFRA_ATTEMPTS = 3  # tries of nbgrader autograde when it fails before any cell of the submission ran
CSV_COLUMNS = ["student", "assignment", "points", "max_points", "status", "reason", "tampered_cells", "flags"]


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
    phases: dict = field(default_factory=dict)         # seconds spent per phase (benchmarks/grading.py)
    flags: list[str] = field(default_factory=list)     # "cell: reason", for a person to review
    language: str = "en"                               # the submission's (its set-up cell's): feedback speaks it

    def row(self) -> dict:
        return {
            "student": self.student, "assignment": self.assignment, "points": f"{self.points:g}",
            "max_points": f"{self.max_points:g}", "status": self.status, "reason": self.reason,
            "tampered_cells": ";".join(self.tampered_cells), "flags": "; ".join(self.flags),
        }


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


def init_worker(template: str, work_root: str, out_dir: str, cell_timeout: float, course_root: str,
                unstarted=None) -> None:
    """Set up a grading process. ``unstarted`` (a shared ``multiprocessing.Value``) counts the submissions no
    process has started yet: a spare judge is started only while there is one left for it."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the grading command's handler is for the grading command
    root = Path(tempfile.mkdtemp(prefix="worker-", dir=work_root))
    _quiet_process(root.with_suffix(".log"))
    os.environ.update(kernel_env([course_root]))
    # this process's temporary files (the kernels' connection files among them) go with the grading run's
    # directory, even when this process is killed before it can clean up; the kernels keep the usual TMPDIR
    kernels_tmp = tempfile.gettempdir()
    tempfile.tempdir = str(root)
    course_dir = root / "course"
    shutil.copytree(template, course_dir)
    from nbgrader.converters import Autograde
    from nbgrader.preprocessors import Execute

    from .course import nbgrader_api, scratch_databases

    scratch_databases(work_root)

    defaults = Autograde.autograde_preprocessors.default()
    preprocessors = [guarded_execute_class() if p is Execute else p for p in defaults]
    api = nbgrader_api(course_dir, cell_timeout=cell_timeout, Autograde__autograde_preprocessors=preprocessors)
    _WORKER.update(root=course_dir, api=api, out=Path(out_dir), timeout=cell_timeout,
                   releases={}, sources={}, secrets={}, translations={}, running=Path(work_root) / "running",
                   course_root=course_root, judge=None, judge_logs=root.with_suffix(".judges"),
                   unstarted=unstarted, tag=run_tag(work_root), kernels_tmp=kernels_tmp)
    _WORKER["judge_logs"].mkdir(exist_ok=True)
    # the grading run's fork server (``judge.SharedServer``, started by the parent) is shared, not this process's
    from labsupport._forkserver import forget_inherited_server

    forget_inherited_server()
    if unstarted is None or unstarted.value > 0:
        _spare_judge()
    # a grader worker ends with os._exit: multiprocessing's finalizers still run, atexit handlers do not
    import multiprocessing.util

    multiprocessing.util.Finalize(None, _close_spare, exitpriority=10)


def _close_spare():
    judge = _WORKER.get("judge")
    if judge is not None:
        judge.close()


def run_tag(work_root: str) -> str:
    """A short name for this grading run (the random part of its temporary directory's name)."""
    return Path(work_root).name.rsplit("-", 1)[-1]


def _spare_judge():
    """Start the judge for the next submission now: its start-up overlaps this submission's kernel run."""
    from .judge import Judge

    try:
        _WORKER["judge"] = Judge(_WORKER["course_root"], _WORKER["judge_logs"], _WORKER["tag"])
    except OSError:
        _WORKER["judge"] = None


def _take_judge():
    from .judge import Judge

    judge, _WORKER["judge"] = _WORKER.get("judge"), None
    if judge is None or not judge.alive():
        judge = Judge(_WORKER["course_root"], _WORKER["judge_logs"], _WORKER["tag"])
    unstarted = _WORKER.get("unstarted")
    if unstarted is None or unstarted.value > 0:
        _spare_judge()
    return judge


def _release(aid: str):
    import nbformat

    if aid not in _WORKER["releases"]:
        root = _WORKER["root"]
        release = nbformat.read(root / RELEASE / aid / f"{aid}.ipynb", as_version=4)
        source = nbformat.read(root / SOURCE / aid / f"{aid}.ipynb", as_version=4)
        _WORKER["releases"][aid] = release
        _WORKER["sources"][aid] = source
        _WORKER["secrets"][aid] = fb.hidden_lines(source, release)
        _WORKER["translations"][aid] = _translations(aid)
    return _WORKER["releases"][aid], _WORKER["secrets"][aid]


def _translations(aid: str) -> dict:
    """The translated versions of ``aid`` whose read-only cells are not edits (``tamper.repair``), or none where
    the course's catalogs cannot be read (Babel missing)."""
    from .course import Course

    try:
        from .translation import translated_versions
    except ImportError:
        return {}
    return translated_versions(Course.at(_WORKER["course_root"]), aid)


def max_points(release) -> float:
    """Total points of a release notebook (a path or a notebook)."""
    if isinstance(release, (str, Path)):
        release = json.loads(Path(release).read_text(encoding="utf-8"))
    cells = release["cells"]
    return float(sum(nbgrader_meta(c).get("points", 0) for c in cells if nbgrader_meta(c).get("grade")))


def run_task(index: int, task: Task) -> Result:
    """``grade_task`` with a marker file in ``running/`` while it runs (see ``grading._run_pool``)."""
    marker = _WORKER["running"] / str(index)
    marker.touch()
    unstarted = _WORKER.get("unstarted")
    if unstarted is not None:
        with unstarted.get_lock():
            unstarted.value = max(0, unstarted.value - 1)
    try:
        return grade_task(task)
    finally:
        marker.unlink(missing_ok=True)


def grade_task(task: Task) -> Result:
    """Grade one submission in this worker process (see ``init_worker``)."""
    started = time.monotonic()
    release, secret = _release(task.assignment)
    total = max_points(release)
    result = Result(task.student, task.assignment, 0.0, total, "failed", task.problem or "")
    summary_notes: list[str] = []
    graded = None
    try:
        if task.problem is None:
            graded = _grade_notebook(task, release, secret, result, summary_notes)
    except Exception as exc:  # a bug or an nbgrader surprise: report it on this row, keep grading the others
        result.status, result.points = "failed", 0.0
        result.reason = f"grading failed: internal error {type(exc).__name__}: {str(exc)[:300]}"
    outcomes = [fb.TestOutcome(**t) for t in result.tests]
    summary = fb.Summary(task.student, task.assignment, result.points, total, result.status, result.reason,
                         outcomes, summary_notes)
    summary.flags = list(result.flags)
    clean = fb.clean_notebook(graded, release, {o.grade_id: o for o in outcomes}, secret) if graded else None
    page = _WORKER["out"] / "feedback" / task.student / f"{task.assignment}.html"
    page.parent.mkdir(parents=True, exist_ok=True)
    with speaking(result.language):
        page.write_text(fb.render(summary, clean), encoding="utf-8")
    result.seconds = time.monotonic() - started
    result.phases["total"] = result.seconds
    return result


def _judge_timeout(n_tests: int) -> float:
    return 120.0 + n_tests * (_WORKER["timeout"] + 30.0)


def _judged(outcomes: list, judge, result: Result, secret) -> list:
    """The kernel's outcomes with the judge's points; a test where the two differ is flagged."""
    from .judge import Judge, verdicts_to_points

    full = {o.grade_id: o.max_points for o in outcomes}
    waited = time.monotonic()
    report = judge.result(_judge_timeout(len(full)))
    result.phases["judge_wait"] = time.monotonic() - waited
    result.phases["judge_run"] = float(report.get("seconds") or 0.0)
    if report.get("error") and "did not finish" not in report["error"]:
        # the judge itself failed (not a time-out that student code can cause): one more try, from scratch
        again = Judge(_WORKER["course_root"], _WORKER["judge_logs"], _WORKER["tag"])
        again.start(dict(judge.spec_sent))
        report = again.result(_judge_timeout(len(full)))
    verdicts = verdicts_to_points(report, full)
    judged, disagree = [], []
    for o in outcomes:
        points, message = verdicts[o.grade_id]
        kernel_passed = o.message is None and o.points >= o.max_points
        if kernel_passed != (message is None):
            disagree.append(f"{o.grade_id} (kernel: {'passed' if kernel_passed else 'failed'}, judge: "
                            f"{'passed' if message is None else 'failed: ' + _one_line(fb.clean_value(message, secret), 120)})")
        if message is not None and o.message is None:
            o = fb.TestOutcome(o.grade_id, points, o.max_points, fb.clean_value(message, secret) or "failed")
        elif message is None:
            o = fb.TestOutcome(o.grade_id, points, o.max_points, None)
        else:
            o = fb.TestOutcome(o.grade_id, points, o.max_points, o.message)
        judged.append(o)
    refused = [f"{gid}: {_one_line(fb.clean_value(m, secret), 200)}" for gid, (_, m) in verdicts.items()
               if m and REFUSED in m]
    if refused:  # a sandbox refused a request after the student's function returned (labsupport/_sandbox_host.py)
        result.flags.append("refused on the workers: " + "; ".join(refused)[:600])
    if report.get("error"):
        result.flags.append(f"judge: {report['error']}")
    if report.get("in_process"):
        result.flags.append("judge: a check was about to run student code in the grader's own process (stopped): "
                            + ", ".join(report["in_process"])[:300])
    if disagree:
        result.flags.append("hidden tests: the kernel's run and the judge's differ on " + ", ".join(disagree))
        skipped = [s for s in report.get("skipped", []) if "`" in s]
        if skipped:
            result.flags.append("judge skipped definitions: " + "; ".join(skipped)[:400])
    return judged


def _grade_notebook(task: Task, release, secret, result: Result, notes: list[str]):
    import nbformat
    from nbgrader.api import Gradebook

    from .tamper import repair

    nb, problem = _read_submission(task.notebook)
    if problem:
        result.reason = problem
        return None
    repaired, report = repair(nb, release, _WORKER["sources"][task.assignment],
                              _WORKER["translations"][task.assignment])
    _unique_ids(repaired)
    result.tampered_cells = report.tampered_cells
    result.language = report.language
    result.flags = [str(f) for f in screen_notebook(repaired, release)]
    # the judge gets the student's cells now, from the file, before any kernel runs them
    judge = _take_judge()
    judge.start(judge_spec(repaired, _WORKER["sources"][task.assignment], release, _WORKER["timeout"],
                           language=report.language))
    root, api = _WORKER["root"], _WORKER["api"]
    submitted = root / "submitted" / task.student / task.assignment
    autograded = root / "autograded" / task.student / task.assignment
    for d in (submitted, autograded):
        shutil.rmtree(d, ignore_errors=True)
    submitted.mkdir(parents=True)
    nbformat.write(repaired, submitted / f"{task.assignment}.ipynb")
    for _attempt in range(INFRA_ATTEMPTS):
        reset_record()
        kernel_started = time.monotonic()
        with speaking(report.language):   # the kernel's (its set-up cell is restored to the English one)
            outcome = api.autograde(task.assignment, task.student, force=True, create=True)
        result.phases["autograde"] = time.monotonic() - kernel_started
        # Failed while no cell of the student was running (the kernel did not start: on a busy machine a port
        # picked for it can be taken before it binds it; or nbgrader tripped): not the student's doing, try again.
        if outcome.get("success") or CURRENT.failure or CURRENT.running or CURRENT.ran_cells:
            break
        shutil.rmtree(autograded, ignore_errors=True)
    tamper_notes = report.notes()
    try:
        if not outcome.get("success"):
            judge.close()
            log = _WORKER["out"] / "logs" / task.student / f"{task.assignment}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text((outcome.get("log") or "") + "\n" + (outcome.get("error") or ""), encoding="utf-8")
            result.reason = _compose([_failure_reason(outcome, _WORKER["timeout"]),
                                      f"nbgrader's log: logs/{task.student}/{task.assignment}.log"] + tamper_notes)
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
        outcomes = _judged(outcomes, judge, result, secret)
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
        judge.close()
        shutil.rmtree(submitted.parent, ignore_errors=True)
        shutil.rmtree(autograded.parent, ignore_errors=True)
        # nbgrader stops a kernel without letting it clean up: the folder its workers used goes now
        from labsupport._pool import remove_stale_dirs

        remove_stale_dirs(_WORKER["kernels_tmp"])
