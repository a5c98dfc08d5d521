"""A notebook's grading time with this checkout against another (an older commit's worktree), side by side.

    python benchmarks/grading_versions.py OTHER_DIR [--assignment 01_collectives] [--rounds 2]
    python benchmarks/grading_versions.py --no-sandbox [--assignment 10_overlap] [--rounds 2]

Each round grades one copy of the notebook's solution serially (``benchmarks/grading.py -n 1 --jobs 1``) with this
checkout's package and course, then with OTHER_DIR's (``--package OTHER_DIR --course OTHER_DIR``: its own notebook
with its own grader), and prints both times and their ratio; the last line is the median of the rounds' ratios.
The two runs of a round are back to back, since a shared machine's speed drifts.

With ``--no-sandbox`` the other run is this checkout's too, with each rank's answer run in its worker
(``LABSUPPORT_SANDBOX=0``) instead of a sandbox behind its host: what the boundary itself costs a whole grading, on
the same notebook and checks (an older commit may have other checks for the same notebook).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
_SERIAL = re.compile(r"--jobs 1:\s+([0-9.]+) s")


def graded_seconds(assignment: str, other: Path | None, sandbox: bool = True) -> float:
    cmd = [sys.executable, str(HERE / "grading.py"), "-n", "1", "--assignment", assignment, "--jobs", "1",
           "--no-ceiling"]
    if other is not None:
        cmd += ["--package", str(other), "--course", str(other)]
    env = dict(os.environ, LABSUPPORT_SANDBOX="1" if sandbox else "0")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    found = _SERIAL.search(proc.stdout)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"grading {assignment} with {other or 'this checkout'} failed:\n{proc.stdout}{proc.stderr}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, nargs="?",
                        help="the other checkout (e.g. git worktree add --detach DIR COMMIT)")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="compare with this checkout graded without the sandbox (LABSUPPORT_SANDBOX=0)")
    parser.add_argument("--assignment", default="01_collectives")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if (args.other is None) == (not args.no_sandbox):
        parser.error("name the other checkout, or --no-sandbox (not both)")
    ratios = []
    for i in range(1, args.rounds + 1):
        this = graded_seconds(args.assignment, None)
        other = graded_seconds(args.assignment, args.other, sandbox=not args.no_sandbox)
        ratios.append(this / other)
        print(f"round {i}: this {this:.1f} s, other {other:.1f} s, ratio {ratios[-1]:.2f}x", flush=True)
    print(f"{args.assignment}: median ratio {statistics.median(ratios):.2f}x (this / other, {args.rounds} rounds)")


if __name__ == "__main__":
    main()
