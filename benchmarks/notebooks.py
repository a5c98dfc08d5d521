"""How long each notebook takes top to bottom: the solutions, in a fresh kernel, as a student runs them.

    python benchmarks/notebooks.py [--assignment ID ...] [--grading] [--budget 60]
    python benchmarks/notebooks.py --demos [NAME ...]

Executes ``solutions/ID/ID.ipynb`` (the answers filled in) with nbclient in a new kernel and prints, per notebook,
the wall time, the slowest cells, and the ratio to the budget (about a minute on two CPU cores is the course's
target). ``--demos`` runs the GPU demos of ``demos/`` instead, which on a machine without GPUs shrink their sizes
to fit two minutes (their default budget). ``--grading`` sets ``LABSUPPORT_GRADING=1`` as the autograder does, so measurements shrink. Every cell must
run without an error: a failing cell is reported and the script exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from autograder.execute import _remove_kernel_leftovers  # noqa: E402


def run(path: Path, grading: bool, cell_timeout: float) -> tuple[float, list[tuple[float, str]]]:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("LABSUPPORT_GRADING", None)
    if grading:
        env["LABSUPPORT_GRADING"] = "1"
    timings: list[tuple[float, str]] = []
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    started = time.perf_counter()
    try:
        with client.setup_kernel(env=env):
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                t0 = time.perf_counter()
                client.execute_cell(cell, index)  # raises CellExecutionError on an error
                first = next((ln for ln in cell.source.splitlines() if ln.strip()), "")[:50]
                timings.append((time.perf_counter() - t0, f"cell {index + 1}: {first}"))
        seconds = time.perf_counter() - started
    finally:
        _remove_kernel_leftovers(env)  # as the grader does after each notebook
    return seconds, sorted(timings, reverse=True)[:3]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assignment", nargs="*", help="assignment ids (default: every one in solutions/)")
    parser.add_argument("--grading", action="store_true", help="run as the autograder does (LABSUPPORT_GRADING=1)")
    parser.add_argument("--demos", nargs="*", help="run demos/NAME.ipynb instead (default: every demo)")
    parser.add_argument("--budget", type=float, help="seconds a notebook should take (default 60, demos 120)")
    parser.add_argument("--cell-timeout", type=float, default=300.0)
    args = parser.parse_args()
    if args.demos is not None:
        paths = {name: REPO / "demos" / f"{name}.ipynb" for name in args.demos}
        paths = paths or {p.stem: p for p in sorted((REPO / "demos").glob("*.ipynb"))}
    else:
        ids = args.assignment or sorted(p.name for p in (REPO / "solutions").iterdir()
                                        if (p / f"{p.name}.ipynb").is_file())
        paths = {aid: REPO / "solutions" / aid / f"{aid}.ipynb" for aid in ids}
    if args.budget is None:
        args.budget = 120.0 if args.demos is not None else 60.0
    try:
        load = f"{os.getloadavg()[0]:.1f}"
    except OSError:
        load = "?"
    print(f"{'grading' if args.grading else 'student'} mode, {os.cpu_count()} cores, load {load}; budget "
          f"{args.budget:g} s per notebook")
    failed = False
    for aid, path in paths.items():
        try:
            seconds, slowest = run(path, args.grading, args.cell_timeout)
        except Exception as exc:  # a cell failed: say which, go on with the others
            print(f"{aid:20s} FAILED: {str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}")
            failed = True
            continue
        print(f"{aid:20s} {seconds:6.1f} s   {seconds / args.budget:4.2f}x budget   slowest: "
              + "; ".join(f"{t:.1f} s {what}" for t, what in slowest))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
