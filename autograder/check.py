"""``python -m autograder check NOTEBOOK``: the student's local estimate.

Runs the notebook top to bottom in a fresh kernel (working directory: the notebook's folder,
``LABSUPPORT_GRADING=1``), then reports per exercise whether its answer cell and its visible tests ran without
error. The hidden tests are not in a student's copy, so the score is an estimate: exercises whose visible tests all
pass, out of the total.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from .course import CourseError
from .execute import cell_label, has_visible_code, kernel_env, nbgrader_meta, run_notebook
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
            value = str(out.get("evalue", "")).strip().splitlines()
            return f"{out.get('ename')}: {value[-1]}" if value else str(out.get("ename"))
    return None


def check(path, timeout: float = CELL_TIMEOUT, stream=None) -> int:
    """Run the check and print the report; returns the exit status (0 all visible tests pass, 1 otherwise)."""
    import nbformat

    stream = stream or sys.stdout
    path = Path(path)
    if not path.is_file():
        raise CourseError(f"notebook {path} does not exist")
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as exc:
        raise CourseError(f"cannot read {path} as a notebook: {str(exc).splitlines()[0] if str(exc) else exc!r}")
    found = exercises(nb)
    if not found:
        raise CourseError(f"{path} has no exercises (no cells with nbgrader answer metadata)")
    print(f"Checking {path} in a fresh kernel (this runs every cell; it can take a minute)...", file=stream,
          flush=True)
    folder = path.resolve().parent
    progress = Progress(len(nb.cells), "running", plain=False)
    record = run_notebook(nb, folder, timeout, env=kernel_env([folder.parent.parent]), progress=progress)
    progress.close()

    width = max(len(e.name) for e in found)
    total = sum(e.points for e in found)
    earned = 0.0
    for ex in found:
        problems = []
        for i in [ex.answer] + ex.tests:
            cell = nb.cells[i]
            if record.failure and cell.cell_type == "code" and cell.source.strip() \
                    and cell.get("execution_count") is None:
                problems.append(f"{cell_label(cell, i)} did not run")
                break
            err = _error_line(cell)
            if err:
                problems.append(f"{cell_label(cell, i)}: {err}")
        checked = any(has_visible_code(nb.cells[i].source) for i in ex.tests)
        if problems:
            verdict = "FAIL  " + problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
        elif not checked:
            verdict = "----  no visible test for this exercise"
        else:
            verdict = "ok    visible tests passed"
            earned += ex.points
        print(f"  {ex.name.ljust(width)}  {ex.points:>4g} pts  {verdict}", file=stream)
    if record.failure == "dead_kernel":
        print(f"\nThe kernel died while running {record.failure_cell}; later cells did not run.", file=stream)
    elif record.failure == "unresponsive":
        print(f"\n{record.failure_cell} was still running after {timeout:g} s and ignored the interrupt; "
              "later cells did not run.", file=stream)
    elif record.failure:
        print(f"\nThe run stopped early: {record.failure_cell}", file=stream)
    if record.timed_out:
        print(f"\nStopped after {timeout:g} s: {', '.join(record.timed_out)}", file=stream)
    print(f"\nLocal estimate: {earned:g} / {total:g} points from the visible tests.\n"
          "This is an estimate: grading also runs hidden tests, which are not in your copy, so your grade can be "
          "lower.", file=stream)
    return 0 if earned == total and not record.failure else 1
