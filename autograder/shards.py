"""``python -m autograder merge OUT_1 ... OUT_N --out DIR``: join the outputs of ``grade --shard K/N`` runs.

Each shard's output directory holds ``grades.csv``, ``feedback/STUDENT/ID.html``, maybe ``logs/STUDENT/ID.log``
and ``gradebook.db``. The merged directory has one CSV (rows sorted as ``grade`` sorts them), every page and log,
and one nbgrader gradebook with every submission and its per-test scores. A notebook that appears in two outputs
is an error (the shards overlap), as is an output without ``grades.csv``.
"""

from __future__ import annotations

import csv
import shutil
import warnings
from pathlib import Path

from .course import CourseError
from .worker import CSV_COLUMNS


def _rows(out: Path) -> list[dict]:
    path = out / "grades.csv"
    if not path.is_file():
        raise CourseError(f"{out} has no grades.csv (is it the --out of a grade run?)")
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in CSV_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise CourseError(f"{path} lacks the columns {', '.join(missing)} (written by another version?)")
        return list(reader)


def merge_gradebooks(sources: list[Path], target: Path) -> None:
    """One gradebook with every submission of ``sources`` (nbgrader gradebooks of the same course)."""
    from nbgrader.api import Gradebook

    from .nbgrader_config import make_config

    sources = [s for s in sources if s.is_file()]
    if target.exists():
        target.unlink()
    if not sources:
        return
    shutil.copyfile(sources[0], target)
    course_id = make_config(str(target.parent)).CourseDirectory.course_id
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SQLAlchemy chatter from nbgrader's models
        with Gradebook(f"sqlite:///{target}", course_id) as gb:
            known = {a.name for a in gb.assignments}
            for source in sources[1:]:
                with Gradebook(f"sqlite:///{source}", course_id) as other:
                    for assignment in other.assignments:
                        if assignment.name not in known:
                            raise CourseError(f"{source} has assignment {assignment.name}, which "
                                              f"{sources[0]} does not: were the shards graded alike?")
                        for sub in assignment.submissions:
                            scores = {g.name: (g.auto_score, g.needs_manual_grade)
                                      for nb in sub.notebooks for g in nb.grades}
                            gb.update_or_create_student(sub.student.id)
                            new = gb.add_submission(assignment.name, sub.student.id)
                            for nb in new.notebooks:
                                for grade in nb.grades:
                                    grade.auto_score, grade.needs_manual_grade = scores.get(grade.name, (0.0, True))
                            gb.db.commit()


def merge(outputs, out, stream=None) -> list[dict]:
    """Merge the grade outputs ``outputs`` into ``out`` (see the module docstring); returns the CSV rows."""
    import sys

    stream = stream or sys.stdout
    outputs = [Path(o).resolve() for o in outputs]
    out = Path(out).resolve()
    if out in outputs:
        raise CourseError(f"--out {out} is one of the outputs being merged")
    rows, seen = [], {}
    for o in outputs:
        if not o.is_dir():
            raise CourseError(f"{o} does not exist or is not a directory")
        for row in _rows(o):
            key = (row["student"], row["assignment"])
            if key in seen:
                raise CourseError(f"{key[0]}/{key[1]} was graded in both {seen[key]} and {o}: the outputs overlap")
            seen[key] = o
            rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    for o in outputs:
        for sub in ("feedback", "logs"):
            if (o / sub).is_dir():
                shutil.copytree(o / sub, out / sub, dirs_exist_ok=True)
    merge_gradebooks([o / "gradebook.db" for o in outputs], out / "gradebook.db")
    rows.sort(key=lambda r: (r["student"], r["assignment"]))
    with open(out / "grades.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in CSV_COLUMNS})
    ok = sum(r["status"] == "ok" for r in rows)
    flagged = [r for r in rows if r.get("flags")]
    print(f"Merged {len(outputs)} outputs: {len(rows)} notebooks, {ok} ok, {len(rows) - ok} failed, "
          f"{len(flagged)} flagged for review.", file=stream)
    for r in flagged:
        print(f"  {r['student']}/{r['assignment']}: {r['flags']}", file=stream)
    print(f"Wrote {out / 'grades.csv'}, {out / 'feedback'}/ and {out / 'gradebook.db'}.", file=stream)
    return rows
