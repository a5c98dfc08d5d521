"""What grading's boundary costs: the hidden checks of a notebook's solutions with and without the sandbox of each rank.

    python benchmarks/sandbox.py [--assignment 01_collectives] [--rounds 3]

Each run is a fresh Python process that defines the solution's answers as the judge does (compiled as
``<student code: ...>``) and calls every check of the notebook's hidden-test cells on real workers. It compares the
student's code in a sandbox behind its host (``labsupport/_sandbox.py``, as grading runs every check) with the same
code run in the worker itself (``LABSUPPORT_SANDBOX=0``; target: at most 1.3x). The two kinds of run alternate,
since a shared machine's speed drifts; it prints each time, the machine's load average, and the ratio of the
medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_RUN = r'''
import json, sys, time
import nbformat
nb = nbformat.read(sys.argv[1], as_version=4)
ns = {}
setup = [c.source for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "setup"]
for source in setup:
    exec(compile("\n".join(l for l in source.splitlines() if not l.lstrip().startswith(("%", "!"))), "<setup>",
                 "exec"), ns)
for c in nb.cells:
    meta = c.metadata.get("nbgrader", {})
    if c.cell_type == "code" and meta.get("solution") and not meta.get("grade"):
        exec(compile(c.source, "<student code: " + meta.get("grade_id", "cell") + ">", "exec"), ns)
started = time.perf_counter()
for c in nb.cells:
    meta = c.metadata.get("nbgrader", {})
    if c.cell_type == "code" and meta.get("grade") and "### BEGIN HIDDEN TESTS" in c.source:
        hidden = c.source.split("### BEGIN HIDDEN TESTS", 1)[1].split("### END HIDDEN TESTS", 1)[0]
        exec(compile(hidden, "<hidden>", "exec"), ns)
print(json.dumps(time.perf_counter() - started))
import labsupport
labsupport.shutdown()
'''


def once(notebook: Path, sandbox: bool) -> float:
    env = dict(os.environ, LABSUPPORT_SANDBOX="1" if sandbox else "0", MPLBACKEND="Agg", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _RUN, str(notebook)], env=env, cwd=notebook.parent,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the checks failed (LABSUPPORT_SANDBOX={int(sandbox)}):\n{proc.stderr[-3000:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1]))


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - no load average on this system
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assignment", default="01_collectives")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    notebook = ROOT / "solutions" / args.assignment / f"{args.assignment}.ipynb"
    times = {True: [], False: []}
    for i in range(args.rounds):
        for sandbox in ((True, False) if i % 2 == 0 else (False, True)):
            started = time.perf_counter()
            checks = once(notebook, sandbox)
            times[sandbox].append(checks)
            print(f"round {i + 1}: {'with' if sandbox else 'without'} the sandbox: checks {checks:.1f} s "
                  f"(process {time.perf_counter() - started:.1f} s; load average {_load()})", flush=True)
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    print(f"{args.assignment}: the hidden checks take {ratio:.2f}x as long with the sandbox (median of "
          f"{args.rounds}; target at most 1.3x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
