"""How long grading takes: N copies of the solutions graded with --jobs 1 and with --jobs 2.

    python benchmarks/grading.py [-n 6] [--assignment ID] [--course DIR]

Makes N students who each hand in every assignment's solution notebook, runs ``python -m autograder grade`` on
them serially and then with two jobs (each a fresh command, start-up included), checks that both runs agree and
give full marks, and prints the two times and their ratio. ``--course tests/fixtures/course`` measures the small
demo course instead of the real one (seconds instead of minutes).
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def grade(subs: Path, out: Path, jobs: int, course: Path, assignment: str | None) -> float:
    cmd = [sys.executable, "-m", "autograder", "grade", str(subs), "--jobs", str(jobs), "--out", str(out),
           "--course", str(course)]
    if assignment:
        cmd += ["--assignment", assignment]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"grading failed ({' '.join(cmd)}):\n{proc.stdout}\n{proc.stderr}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--copies", type=int, default=6, help="number of students (default: 6)")
    parser.add_argument("--assignment", metavar="ID", help="only this assignment (default: all)")
    parser.add_argument("--course", type=Path, default=REPO, help="course root (default: this repository)")
    args = parser.parse_args()
    course = args.course.resolve()
    solutions = course / "solutions"
    ids = [args.assignment] if args.assignment else sorted(
        d.name for d in solutions.iterdir() if (d / f"{d.name}.ipynb").is_file()) if solutions.is_dir() else []
    if not ids:
        sys.exit(f"no assignments in {solutions}")
    with tempfile.TemporaryDirectory(prefix="grading-bench-") as tmp:
        subs = Path(tmp) / "subs"
        for k in range(args.copies):
            for aid in ids:
                folder = subs / f"student{k:02d}" / aid
                folder.mkdir(parents=True)
                shutil.copyfile(solutions / aid / f"{aid}.ipynb", folder / f"{aid}.ipynb")
        n = args.copies * len(ids)
        print(f"grading {args.copies} copies of the solutions of {', '.join(ids)} ({n} notebooks) "
              f"on {os.cpu_count()} cores", flush=True)
        times = {}
        for jobs in (1, 2):
            times[jobs] = grade(subs, Path(tmp) / f"out{jobs}", jobs, course, args.assignment)
            print(f"  --jobs {jobs}: {times[jobs]:7.1f} s  ({times[jobs] / n:.1f} s per notebook)", flush=True)
        rows = {}
        for jobs in (1, 2):
            with open(Path(tmp) / f"out{jobs}" / "grades.csv", newline="") as f:
                rows[jobs] = list(csv.DictReader(f))
        if rows[1] != rows[2]:
            print("warning: the serial and parallel runs disagree")
        not_full = [r for r in rows[1] if r["status"] != "ok" or r["points"] != r["max_points"]]
        if not_full:
            print(f"warning: {len(not_full)} solution notebooks did not get full marks, e.g. {not_full[0]}")
        print(f"  speed-up with --jobs 2: {times[1] / times[2]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
