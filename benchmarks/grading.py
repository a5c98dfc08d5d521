"""How long grading takes: N copies of the solutions graded with --jobs 1 and with --jobs 2.

    python benchmarks/grading.py [-n 6] [--assignment ID] [--course DIR] [--jobs 1 2] [--rounds 1] [--package DIR]

Makes N students who each hand in every assignment's solution notebook, runs ``python -m autograder grade`` on
them serially and then with two jobs (each a fresh command, start-up included), checks that both runs agree and
give full marks, and prints the two times and their ratio. ``--course tests/fixtures/course`` measures the small
demo course instead of the real one (seconds instead of minutes). For each run it also prints where the time went:
building the template course (nbgrader's release and gradebook), the pool of grading processes, merging the
gradebooks, and per notebook the nbgrader run (kernel start and cells) and the wait for the judge. ``--package DIR``
grades with the ``autograder`` package found in DIR (e.g. an older checkout) to compare two versions.

A shared machine's speed drifts by tens of percent within minutes. ``--rounds R`` runs the ``--jobs`` values in
turn R times and gives each speed-up as the median of the ratios within a round (runs back to back), next to what
bounds it: how much of the machine a serial run already uses, and how well this machine runs two processes at once
(``benchmarks/machine.py``; ``--no-ceiling`` skips it).

Two bounds are printed from the serial run, whose cores are sampled every 0.2 s. ``cores / cores busy`` holds if
the other jobs fill every moment one job waits. Copies of one notebook, however, run in step: their waits (a cell's
time-out, such as 01's deadlock demo) come at the same moments, and while they work each already keeps more than one
core busy (the ranks of a run, the judge beside the kernel). For that case the bound is
``cores / (waiting share + working share x cores busy while working)``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CPU: dict[int, float] = {}  # --jobs -> CPU seconds of the grading command and the processes it waited for
MACHINE_CPU: dict[int, float] = {}  # --jobs -> CPU seconds the whole machine used meanwhile (Linux), every process
PROFILE: dict[int, list[tuple[float, float]]] = {}  # --jobs -> [(seconds, cores busy)], sampled during the run
IDLE = 0.15  # fewer cores busy than this: the machine waits (a notebook's time-out, a deadlock demo)


def machine_cpu() -> float | None:
    """CPU seconds this machine has spent so far (all processes, all cores); None where /proc/stat is missing.

    Processes nobody waits for (a fork server left to exit by itself, the workers it forks) are not in
    RUSAGE_CHILDREN; on an otherwise idle machine this counts them too.
    """
    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class Sampler(threading.Thread):
    """How many cores the machine keeps busy, sampled from /proc/stat every ``every`` seconds while it runs."""

    def __init__(self, every: float = 0.2):
        super().__init__(daemon=True)
        self.every, self.samples, self.halt = every, [], threading.Event()

    def run(self):
        last, at = machine_cpu(), time.perf_counter()
        while last is not None and not self.halt.wait(self.every):
            now, t = machine_cpu(), time.perf_counter()
            self.samples.append((t - at, (now - last) / (t - at)))
            last, at = now, t

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.halt.set()
        self.join()


def waits(samples: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(share of the time no core is busy, cores busy the rest of the time), or None without samples."""
    total = sum(dt for dt, _ in samples)
    active = [(dt, c) for dt, c in samples if c >= IDLE]
    if not total or not active:
        return None
    busy_time = sum(dt for dt, _ in active)
    return 1 - busy_time / total, sum(dt * c for dt, c in active) / busy_time


def in_step_bound(idle: float, busy: float, cores: int) -> float:
    """The speed-up of ``cores`` jobs over one when each runs the same notebook in step: their waits coincide, and
    while they work they ask for ``cores * busy`` cores."""
    return cores / (idle + (1 - idle) * max(1.0, busy))


def grade(subs: Path, out: Path, jobs: int, course: Path, assignment: str | None, package: Path = REPO) -> float:
    cmd = [sys.executable, "-m", "autograder", "grade", str(subs), "--jobs", str(jobs), "--out", str(out),
           "--course", str(course)]
    if assignment:
        cmd += ["--assignment", assignment]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(package), os.environ.get("PYTHONPATH")])),
               AUTOGRADER_TIMINGS=str(out.parent / f"timings-{out.name}.json"))
    machine = machine_cpu()
    started = time.perf_counter()
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    with Sampler() as sampler:
        proc = subprocess.run(cmd, cwd=package, env=env, capture_output=True, text=True, check=False)
    PROFILE[jobs] = sampler.samples
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU[jobs] = (after.ru_utime - cpu.ru_utime) + (after.ru_stime - cpu.ru_stime)
    if machine is not None:
        MACHINE_CPU[jobs] = machine_cpu() - machine
    if proc.returncode != 0:
        sys.exit(f"grading failed ({' '.join(cmd)}):\n{proc.stdout}\n{proc.stderr}")
    return seconds


def breakdown(path: Path, jobs: int, seconds: float) -> str:
    """Where the time of one run went (from the grader's AUTOGRADER_TIMINGS file)."""
    if not path.exists():
        return "    (no timings: the graded package does not write them)"
    data = json.loads(path.read_text())
    phases, tasks = data["phases"], data["tasks"]
    lines = [f"    start-up {seconds - sum(phases.values()):5.1f} s, template {phases['template']:5.1f} s, "
             f"pool {phases['pool']:6.1f} s, merge {phases['merge']:4.1f} s"]
    if tasks:
        def mean(key):
            return sum(t.get(key, 0.0) for t in tasks) / len(tasks)
        busy = sum(t.get("total", 0.0) for t in tasks)
        idle = jobs * phases["pool"] - busy
        lines.append(f"    per notebook: {mean('total'):5.1f} s, of which nbgrader autograde {mean('autograde'):5.1f} s, "
                     f"waiting for the judge {mean('judge_wait'):4.1f} s (the judge ran {mean('judge_run'):4.1f} s)")
        lines.append(f"    grading processes idle or starting: {idle:5.1f} process-seconds "
                     f"({idle / max(jobs * phases['pool'], 1e-9):.0%} of {jobs} x pool)")
    return "\n".join(lines)


def check_grades(out: Path, seen: list) -> None:
    """Warn when a run's grades differ from the first run's, or are not full marks."""
    with open(out / "grades.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    if seen and rows != seen[0]:
        print("warning: this run's grades differ from the first run's")
    if not seen:
        seen.append(rows)
        not_full = [r for r in rows if r["status"] != "ok" or r["points"] != r["max_points"]]
        if not_full:
            print(f"warning: {len(not_full)} solution notebooks did not get full marks, e.g. {not_full[0]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--copies", type=int, default=6, help="number of students (default: 6)")
    parser.add_argument("--assignment", metavar="ID", help="only this assignment (default: all)")
    parser.add_argument("--course", type=Path, default=REPO, help="course root (default: this repository)")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2], help="the --jobs values to time (default: 1 2)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the --jobs values in turn this many times (default: 1); speed-ups are medians")
    parser.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                        help="do not measure how well this machine runs two processes at once")
    parser.add_argument("--package", type=Path, default=REPO,
                        help="folder holding the autograder package to run (default: this repository)")
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
        rows: list = []
        print(f"grading {args.copies} copies of the solutions of {', '.join(ids)} ({n} notebooks) "
              f"on {os.cpu_count()} cores", flush=True)
        if hasattr(os, "getloadavg") and os.getloadavg()[0] > 0.5:
            print(f"  note: the machine is busy (load {os.getloadavg()[0]:.1f}): times and ratios are not "
                  "representative", flush=True)
        times: dict[int, list[float]] = {j: [] for j in args.jobs}
        busy: dict[int, list[float]] = {j: [] for j in args.jobs}
        profiles: dict[int, list[tuple[float, float]]] = {j: [] for j in args.jobs}
        for round_ in range(args.rounds):
            if args.rounds > 1:
                print(f"round {round_ + 1} of {args.rounds}", flush=True)
            for jobs in args.jobs:
                out = Path(tmp) / f"out{jobs}"
                shutil.rmtree(out, ignore_errors=True)
                seconds = grade(subs, out, jobs, course, args.assignment, args.package.resolve())
                times[jobs].append(seconds)
                if jobs in MACHINE_CPU:
                    busy[jobs].append(MACHINE_CPU[jobs] / seconds)
                profiles[jobs].append(waits(PROFILE.get(jobs, [])))
                print(f"  --jobs {jobs}: {seconds:7.1f} s  ({seconds / n:.1f} s per notebook, "
                      f"{CPU[jobs] / n:.1f} CPU s per notebook"
                      + (f"; the machine: {MACHINE_CPU[jobs] / n:.1f} CPU s per notebook, "
                         f"{MACHINE_CPU[jobs] / seconds:.2f} cores busy" if jobs in MACHINE_CPU else "") + ")",
                      flush=True)
                print(breakdown(Path(tmp) / f"timings-out{jobs}.json", jobs, seconds), flush=True)
                check_grades(out, rows)
        base = args.jobs[0]
        for jobs in args.jobs[1:]:
            ratios = [a / b for a, b in zip(times[base], times[jobs])]
            spread = f" (rounds: {', '.join(f'{r:.2f}x' for r in ratios)})" if len(ratios) > 1 else ""
            print(f"  speed-up with --jobs {jobs}: {statistics.median(ratios):.2f}x{spread}")
        if busy[base] and base == 1:
            serial = statistics.median(busy[base])
            cores = os.cpu_count() or 1
            print(f"  a serial run keeps {serial:.2f} cores busy: with no overhead at all, {cores} cores give at most "
                  f"{cores / serial:.2f}x, if the other jobs' work fills every wait of each")
            shape = [p for p in profiles[base] if p is not None]
            if shape:
                idle = statistics.median(p[0] for p in shape)
                active = statistics.median(p[1] for p in shape)
                print(f"  it waits with no core busy {idle:.0%} of the time (a notebook's time-outs, e.g. a deadlock "
                      f"demo) and keeps {active:.2f} cores busy the rest (the ranks of a run, the judge): {cores} jobs "
                      f"grading the same notebook in step wait together, which gives at most "
                      f"{in_step_bound(idle, active, cores):.2f}x")
        if args.ceiling:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import machine

            print("  this machine running two processes at once (benchmarks/machine.py):")
            print(machine.report(machine.speedups(seconds=1.0, repeat=3)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
