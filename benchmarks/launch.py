"""How fast a 4-rank cell starts: labsupport.run vs torch.multiprocessing.spawn.

    python benchmarks/launch.py [--world-size 4] [--repeats 5]

Each measurement is a whole cell: start (or reuse) the ranks, initialise the process group, all_reduce a tensor
of ones, return the rank. "first call" is the median over fresh Python processes (at least 3; it includes
starting the fork server and importing torch there), measured from `import labsupport`, and again as a notebook
makes it, timing only the run cell a few seconds after the import (the fork server started at the import);
"repeated" is the median of later calls in one process.
Prints the ratios. Nothing is written into the repository: the spawn script lives in a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

FIRST_CALL = textwrap.dedent(
    """
    import time, torch, torch.distributed as dist
    t0 = time.perf_counter()
    import labsupport
    def cell():
        x = torch.ones(1)
        dist.all_reduce(x)
        return dist.get_rank()
    assert labsupport.run(cell, world_size={n}) == list(range({n}))
    print(time.perf_counter() - t0)
    """
)

# The same first call as a notebook makes it: the setup cell imports labsupport (which starts the fork server in
# the background), the student reads on, then a cell calls run. Only the run cell is timed.
FIRST_CALL_NOTEBOOK = textwrap.dedent(
    """
    import os, time
    os.environ["LABSUPPORT_EARLY_START"] = "1"     # what importing labsupport in a notebook kernel does
    import torch, torch.distributed as dist
    import labsupport
    time.sleep({pause})
    def cell():
        x = torch.ones(1)
        dist.all_reduce(x)
        return dist.get_rank()
    t0 = time.perf_counter()
    assert labsupport.run(cell, world_size={n}) == list(range({n}))
    print(time.perf_counter() - t0)
    """
)
NOTEBOOK_PAUSE = 3.0  # seconds between the import cell and the first run cell

SPAWN = textwrap.dedent(
    """
    import os, sys, time, socket, torch, torch.distributed as dist, torch.multiprocessing as mp

    def worker(rank, n, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=n)
        x = torch.ones(1)
        dist.all_reduce(x)
        dist.destroy_process_group()

    if __name__ == "__main__":
        times = []
        for _ in range({repeats}):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            t0 = time.perf_counter()
            mp.spawn(worker, args=({n}, port), nprocs={n}, join=True)
            times.append(time.perf_counter() - t0)
        print(*times)
    """
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    n, repeats = args.world_size, args.repeats

    firsts = []
    for _ in range(max(3, repeats // 2)):
        out = subprocess.run([sys.executable, "-c", FIRST_CALL.format(n=n)], capture_output=True, text=True, check=True)
        firsts.append(float(out.stdout.split()[-1]))
    first = statistics.median(firsts)
    in_notebook = []
    for _ in range(max(3, repeats // 2)):
        script = FIRST_CALL_NOTEBOOK.format(n=n, pause=NOTEBOOK_PAUSE)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
        in_notebook.append(float(out.stdout.split()[-1]))
    first_in_notebook = statistics.median(in_notebook)

    import torch
    import torch.distributed as dist

    import labsupport

    def cell():
        x = torch.ones(1)
        dist.all_reduce(x)
        return dist.get_rank()

    labsupport.run(cell, world_size=n)
    repeated_times = []
    for _ in range(repeats * 4):
        t0 = time.perf_counter()
        labsupport.run(cell, world_size=n)
        repeated_times.append(time.perf_counter() - t0)
    repeated = statistics.median(repeated_times)
    labsupport.shutdown()

    with tempfile.TemporaryDirectory(prefix="spawn-bench-") as tmp:
        script = os.path.join(tmp, "spawn_bench.py")  # mp.spawn needs a file it can import, not "-c"
        with open(script, "w") as fh:
            fh.write(SPAWN.format(n=n, repeats=repeats))
        out = subprocess.run([sys.executable, script], capture_output=True, text=True, check=True, cwd=tmp)
    spawn = statistics.median(float(t) for t in out.stdout.split())

    print(f"{n}-rank cell: init -> all_reduce(ones) -> return rank   (median times)")
    rows = [
        ("torch.multiprocessing.spawn", spawn, ""),
        (f"labsupport.run, first call ({len(firsts)} fresh runs)", first, f"{spawn / first:6.1f}x faster than spawn"),
        (f"  the same, {NOTEBOOK_PAUSE:g} s after `import labsupport`", first_in_notebook,
         f"{spawn / first_in_notebook:6.1f}x faster than spawn"),
        ("labsupport.run, repeated calls", repeated, f"{spawn / repeated:6.1f}x faster than spawn"),
    ]
    for label, seconds, ratio in rows:
        print(f"  {label:<42}{seconds * 1000:9.1f} ms   {ratio}".rstrip())
    print("targets: first call >= 3x, repeated calls >= 20x")


if __name__ == "__main__":
    main()
