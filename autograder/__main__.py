"""Command line: ``python -m autograder {release,grade,merge,student-edition,check} ...`` (``--help`` on each)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .nbgrader_config import CELL_TIMEOUT


def _add_course(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--course", metavar="DIR", default=None,
                        help="course root holding solutions/ and notebooks/ (default: this repository)")


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _check_output_dir(out: str) -> None:
    """Raise CourseError unless ``out`` is a directory or can be made one (no file in the way)."""
    from .course import CourseError

    path = Path(out)
    for existing in (path, *path.parents):
        if existing.exists():
            if existing.is_dir():
                return
            if existing == path:
                raise CourseError(f"--out {out} exists and is not a directory")
            raise CourseError(f"--out {out}: {existing} exists and is not a directory")


def _shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N such as 2/8, got {text!r}") from None
    if n < 1 or not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"expected 1 <= K <= N, got {text!r}")
    return k, n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m autograder",
        description="Release, grade and check the course's nbgrader notebooks.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("release", help="regenerate notebooks/ from solutions/",
                       description="Regenerate the student notebooks (notebooks/ID/) from the nbgrader sources "
                                   "(solutions/ID/) with nbgrader generate_assignment. The output has no "
                                   "outputs or execution counts and is byte-for-byte reproducible.")
    p.add_argument("--assignment", metavar="ID", help="only this assignment (default: all)")
    p.add_argument("--out", metavar="DIR", help="write the release here instead of notebooks/")
    _add_course(p)

    p = sub.add_parser("grade", help="grade a folder of submissions",
                       description="Grade SUBMISSIONS_DIR/STUDENT/ASSIGNMENT/ASSIGNMENT.ipynb with nbgrader. "
                                   "Writes DIR/grades.csv (student, assignment, points, max_points, status, "
                                   "reason, tampered_cells, flags), DIR/feedback/STUDENT/ASSIGNMENT.html, a merged "
                                   "nbgrader gradebook DIR/gradebook.db and, for notebooks nbgrader could not "
                                   "grade, its log in DIR/logs/STUDENT/ASSIGNMENT.log; prints a summary. "
                                   "Points come from a judge process that runs the hidden tests on the "
                                   "definitions of the student's cells only; code an honest answer never needs, "
                                   "and tests where the notebook's own run and the judge's differ, are flagged "
                                   "for review.")
    p.add_argument("submissions", metavar="SUBMISSIONS_DIR")
    p.add_argument("--assignment", metavar="ID",
                   help="grade only this assignment (default: every course assignment found in the submissions)")
    p.add_argument("--jobs", metavar="N", type=int, default=1,
                   help="grade N notebooks at a time in separate processes (default: 1)")
    p.add_argument("--out", metavar="DIR", default="grading-out", help="output directory (default: grading-out)")
    p.add_argument("--cell-timeout", metavar="S", type=_positive, default=CELL_TIMEOUT,
                   help=f"seconds a cell may run before it is interrupted (default: {CELL_TIMEOUT})")
    p.add_argument("--shard", metavar="K/N", type=_shard, default=None,
                   help="grade only the K-th of N slices of the students (K from 1; students in sorted order, "
                        "dealt round-robin), e.g. one task of a SLURM job array; join the outputs with merge")
    _add_course(p)

    p = sub.add_parser("merge", help="merge the outputs of several grade --shard runs",
                       description="Merge the output directories of grade runs (e.g. the N shards of a job array) "
                                   "into one: grades.csv, feedback/, logs/ and gradebook.db. A notebook graded "
                                   "in two of them is an error.")
    p.add_argument("outputs", metavar="OUT", nargs="+", help="output directories of grade runs")
    p.add_argument("--out", metavar="DIR", required=True, help="where to write the merged output")

    p = sub.add_parser("student-edition", help="write the tree students receive (no solutions, no hidden tests)",
                       description="Write DIR: a git-ready copy of the course for students: release notebooks, "
                                   "the GPU demos, labsupport, the autograder package without its hidden checks (so "
                                   "that `check` runs the visible tests), ./course, pyproject.toml, environment.yml "
                                   "and a README for students. No solutions/, no autograder/checks/, no tests.")
    p.add_argument("dest", metavar="DIR", help="target directory (must not exist, or be empty)")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists")
    p.add_argument("--url", metavar="URL", help="where the edition will be hosted, e.g. https://github.com/you/course:"
                   " written into its README's Colab line and its demos' install lines (default: a placeholder)")
    p.add_argument("--branch", metavar="NAME", help="the branch of URL students install from and open the demos "
                   "of (default: the repository's default branch; the Colab links then name main)")
    _add_course(p)

    p = sub.add_parser("check", help="run a notebook's tests and print its score and the grader's messages",
                       description="Run NOTEBOOK top to bottom in a fresh kernel (in the notebook's folder, with "
                                   "LABSUPPORT_GRADING=1) and report, per exercise, whether its tests pass. Where "
                                   "the course's hidden tests are present (the course repository), the grader's "
                                   "judge runs them meanwhile and each exercise gets the grader's verdict and "
                                   "message; elsewhere (the student edition) the visible tests give an estimate. "
                                   "Exit status: 0 when every test passes, 1 otherwise, 2 on bad input.")
    p.add_argument("notebook", metavar="NOTEBOOK")
    p.add_argument("--course", metavar="DIR", default=None,
                   help="course root holding solutions/ and notebooks/ (default: this repository)")
    p.add_argument("--cell-timeout", metavar="S", type=_positive, default=CELL_TIMEOUT,
                   help=f"seconds a cell may run before it is interrupted (default: {CELL_TIMEOUT})")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .course import Course, CourseError

    try:
        if args.command == "release":
            from .course import release
            from .progress import Progress

            course = Course.at(args.course)
            ids = course.select(args.assignment)
            written = release(course, ids, args.out, progress=Progress(len(ids), "release"))
            for path in written:
                print(path)
            return 0
        if args.command == "grade":
            from .grading import grade

            if args.jobs < 1:
                raise CourseError("--jobs must be at least 1")
            _check_output_dir(args.out)
            _stop_on_sigterm()
            grade(args.submissions, Course.at(args.course), args.assignment, args.jobs, args.out, args.cell_timeout,
                  shard=args.shard)
            return 0
        if args.command == "merge":
            from .shards import merge

            _check_output_dir(args.out)
            merge(args.outputs, args.out)
            return 0
        if args.command == "student-edition":
            from .edition import write_edition

            path = write_edition(Course.at(args.course), args.dest, force=args.force, url=args.url,
                                 branch=args.branch)
            print(f"Wrote the student edition to {path}")
            return 0
        if args.command == "check":
            from .check import check

            return check(args.notebook, args.cell_timeout, course_root=args.course)
    except CourseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if exc.name not in _LAB_MODULES:
            raise
        print(f"error: `python -m autograder {args.command}` needs {exc.name}, which comes with the course's lab "
              "extras: ./course setup, or pip install -e '.[lab]' in the course's folder. The light install (for "
              "Colab) has what the notebooks need, not the grading tools.", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted" + (" (SIGTERM)" if _TERMINATED else ""), file=sys.stderr)
        return 143 if _TERMINATED else 130
    return 2


_TERMINATED = False

#: What the grading tools need beyond the light install (``pip install .``): the ``lab`` extras of pyproject.toml.
_LAB_MODULES = {"nbformat", "nbgrader", "nbclient", "nbconvert", "jupyter_client", "ipykernel", "traitlets",
                "jupyter_core", "jupyterlab"}


def _stop_on_sigterm() -> None:
    """SIGTERM (``kill``, ``scancel``, a job's time limit) stops grading as Ctrl-C does: every process the run
    started is stopped and every temporary file removed (a SIGKILL a moment later leaves the files in $TMPDIR)."""
    import signal

    def stop(signum, frame):
        global _TERMINATED
        _TERMINATED = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping takes a moment: once is enough
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


if __name__ == "__main__":
    sys.exit(main())
