"""Command line: ``python -m autograder {release,grade,merge,student-edition,check} ...`` (``--help`` on each).

A student edition (no ``autograder/checks/``) offers ``check`` only, and says so when asked for the others."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._quick_start import skip_iri_grammars

skip_iri_grammars()  # before anything loads nbformat

from .nbgrader_config import CELL_TIMEOUT  # noqa: E402


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


#: The commands that need the course repository (solutions/, the hidden checks in autograder/checks/): a student
#: edition has only ``check``.
INSTRUCTOR_COMMANDS = ("release", "grade", "merge", "student-edition")
#: The package's name on pip (pyproject.toml), for the install lines the errors give.
DISTRIBUTION = "distributed-training-course"


def in_student_edition() -> bool:
    """This copy of the package is a student edition's (``python -m autograder student-edition``): it has no hidden
    checks, so only ``check`` can work."""
    return not (Path(__file__).resolve().parent / "checks").is_dir()


def build_parser(edition: bool | None = None) -> argparse.ArgumentParser:
    """The command line; in a student edition (``edition``, by default told from this copy) only ``check``."""
    edition = in_student_edition() if edition is None else edition
    parser = argparse.ArgumentParser(
        prog="python -m autograder",
        description="Check a notebook of the course before handing it in (student edition: the instructor's "
                    "commands are not part of it)." if edition else
                    "Release, grade and check the course's nbgrader notebooks.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    if not edition:
        _add_instructor_commands(sub)
    _add_check(sub)
    return parser


def _add_instructor_commands(sub) -> None:
    p = sub.add_parser("release", help="regenerate notebooks/ (and notebooks-zh/) from solutions/",
                       description="Regenerate the student notebooks (notebooks/ID/) from the nbgrader sources "
                                   "(solutions/ID/) with nbgrader generate_assignment, and the release in each "
                                   "language the course has catalogs for (notebooks-LANG/ID/, from the same sources "
                                   "with their translated cells, i18n/LANG/notebooks/ID.po). The output has no "
                                   "outputs or execution counts and is byte-for-byte reproducible.")
    p.add_argument("--assignment", metavar="ID", help="only this assignment (default: all)")
    p.add_argument("--lang", metavar="LANG", help="only the release in this language: en, or a language with "
                   "catalogs (zh) (default: every language; with --out: en)")
    p.add_argument("--out", metavar="DIR", help="write the release in one language (--lang, default en) here "
                   "instead of notebooks/ (notebooks-LANG/)")
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
    p.add_argument("--lang", metavar="LANG", default="en", help="the edition's language: en (default) or zh, the "
                   "Chinese edition (the Chinese release notebooks, a Chinese README and JupyterLab in Chinese)")
    _add_course(p)


def _add_check(sub) -> None:
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    edition = in_student_edition()
    if edition and argv and argv[0] in INSTRUCTOR_COMMANDS:
        print(f"error: `python -m autograder {argv[0]}` is one of the instructor's commands, which need the course "
              "repository (solutions/ and the hidden checks in autograder/checks/); this is the student edition, "
              "which has neither. Here you check a notebook: python -m autograder check notebooks/ID/ID.ipynb",
              file=sys.stderr)
        return 2
    args = build_parser(edition).parse_args(argv)
    from .course import Course, CourseError

    try:
        if args.command == "release":
            from .course import release
            from .progress import Progress

            course = Course.at(args.course)
            ids = course.select(args.assignment)
            langs = course.languages() if args.lang is None and args.out is None else [args.lang or "en"]
            if langs[0] not in course.languages():
                raise CourseError(f"--lang {langs[0]}: the course has no catalogs for it (i18n/{langs[0]}/notebooks/);"
                                  f" its languages are {', '.join(course.languages())}")
            progress = Progress(len(ids) * len(langs), "release")
            for k, lang in enumerate(langs):
                for path in release(course, ids, args.out, progress=progress, lang=lang, done=k * len(ids)):
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
                                 branch=args.branch, lang=args.lang)
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
              f"extras (nbgrader and the notebook runner): {lab_extras_hint()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted" + (" (SIGTERM)" if _TERMINATED else ""), file=sys.stderr)
        return 143 if _TERMINATED else 130
    return 2


_TERMINATED = False


def _pip_source() -> dict | None:
    """Where pip installed this package from (its ``direct_url.json``, PEP 610), or None."""
    import json
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        text = distribution(DISTRIBUTION).read_text("direct_url.json")
        return json.loads(text) if text else None
    except (PackageNotFoundError, OSError, ValueError):
        return None


_HERE = object()   # lab_extras_hint's defaults: told from this copy of the package


def lab_extras_hint(source=_HERE, folder=_HERE, hosted_at=_HERE) -> str:
    """How to add the lab extras to this install, in the form that fits it: ``source`` is pip's record of where it
    came from (a dict, or None; default: this package's), ``folder`` the course folder this package lives in when it
    runs from one (or None; default: told from this file), ``hosted_at`` the address a student edition was written
    for (``--url``; default: the edition's record of it, if any).

    * installed from git (``%pip install git+URL`` on Colab or Kaggle, where there is no course folder): the same
      address with the extras, ``pip install "distributed-training-course[lab] @ git+URL"``;
    * run from a course folder (``./course``, ``pip install -e .``): ``./course setup`` there;
    * otherwise the git form with the edition's address, or a placeholder for it.
    """
    source = _pip_source() if source is _HERE else source
    if folder is _HERE:
        root = Path(__file__).resolve().parent.parent
        folder = root if (root / "course").is_file() and (root / "pyproject.toml").is_file() else None
    vcs = (source or {}).get("vcs_info")
    if vcs and (source or {}).get("url"):
        address = f"git+{source['url']}" + (f"@{vcs['requested_revision']}" if vcs.get("requested_revision") else "")
        return (f"this Python has the light install from {address}, which brings what the notebooks need and not "
                f'the grading tools. Add them with: pip install "{DISTRIBUTION}[lab] @ {address}" (in a notebook '
                "cell: %pip install ...)")
    if folder is not None:
        return (f"./course setup in the course's folder ({folder}), or pip install -e '.[lab]' there. The light "
                "install has what the notebooks need, not the grading tools.")
    if hosted_at is _HERE:
        try:
            from ._hosted_at import URL as hosted_at
        except ImportError:
            hosted_at = None
    address = f"git+{hosted_at}" if hosted_at else "git+<URL of the course's repository>"
    return (f'pip install "{DISTRIBUTION}[lab] @ {address}" (in a notebook cell: %pip install ...). The light '
            "install has what the notebooks need, not the grading tools.")

#: What the grading tools need beyond the light install (``pip install .``): the ``lab`` extras of pyproject.toml.
_LAB_MODULES = {"nbformat", "nbgrader", "nbclient", "nbconvert", "jupyter_client", "ipykernel", "traitlets",
                "jupyter_core", "jupyterlab"}


def _stop_on_sigterm() -> None:
    """SIGTERM (``kill``, ``scancel``, a job's time limit) stops grading as Ctrl-C does: every process the run
    started is stopped and every temporary file removed (a SIGKILL a moment later leaves the files in $TMPDIR)."""
    import faulthandler
    import signal

    # a run that seems stuck can be asked where it is: kill -USR1 PID writes every thread's stack to stderr
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)

    def stop(signum, frame):
        global _TERMINATED
        _TERMINATED = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping takes a moment: once is enough
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


if __name__ == "__main__":
    sys.exit(main())
