"""How well this machine runs two processes at once: the ceiling for ``grade --jobs 2``.

    python benchmarks/machine.py [--seconds 2] [--repeat 3]

Runs each of three workloads once alone and then as two copies at the same time, and prints the speed-up of the
pair (2 x the time alone / the time of the pair; 2.00x on two cores that do not slow each other down). The
workloads stand for what a grading run spends its CPU on:

* ``interpreter``: a pure-Python loop over small integers (bytecode, little memory);
* ``objects``: building and dropping dicts, lists and strings (memory, caches, the garbage collector), like
  nbgrader, nbformat and the feedback page;
* ``import torch``: a fresh Python importing torch and torch.distributed, like each kernel, judge and server.

Virtual machines often give two vCPUs that share one physical core, or a host that is busy: then two copies run
at well under 2x, and no grading run can beat the pair's speed-up. Each ratio is the median of ``--repeat``
trials, each one copy alone and then the pair, back to back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

WORKLOADS = {
    "interpreter": "t = 0\nfor i in range({n}):\n    t += i * i % 7\n",
    "objects": ("for _ in range({n} // 2000):\n"
                "    rows = [{{'k': str(i), 'v': [i, i + 1], 't': (i, 'x' * (i % 9))}} for i in range(2000)]\n"
                "    rows.sort(key=lambda r: r['t'])\n"),
    "import torch": "import torch, torch.distributed\n",
}


def _command(name: str, n: int) -> list[str]:
    return [sys.executable, "-c", WORKLOADS[name].format(n=n)]


def _wall(commands: list[list[str]]) -> float:
    started = time.perf_counter()
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL) for cmd in commands]
    for p in procs:
        if p.wait() != 0:
            sys.exit(f"a workload failed: {' '.join(p.args)}")
    return time.perf_counter() - started


def _size(name: str, seconds: float) -> int:
    """The loop count for which one copy of ``name`` takes about ``seconds`` (1 for ``import torch``)."""
    if name == "import torch":
        return 1
    n = 200_000
    while True:
        took = _wall([_command(name, n)])
        if took > 0.5:
            return max(1, int(n * seconds / took))
        n *= 4


def speedups(seconds: float = 2.0, repeat: int = 3) -> dict[str, tuple[float, float, float]]:
    """{workload: (seconds alone, seconds of the pair, speed-up)}: ``repeat`` trials of one copy alone followed by
    the pair, back to back (a shared machine's speed drifts); the medians of the times and of the trials' ratios."""
    results = {}
    for name in WORKLOADS:
        n = _size(name, seconds)
        _wall([_command(name, n)])  # warm the page cache
        alone, pair = [], []
        for _ in range(repeat):
            alone.append(_wall([_command(name, n)]))
            pair.append(_wall([_command(name, n)] * 2))
        ratio = statistics.median(2 * a / p for a, p in zip(alone, pair))
        results[name] = (statistics.median(alone), statistics.median(pair), ratio)
    return results


def report(results: dict[str, tuple[float, float, float]]) -> str:
    lines = [f"  {name:<12} alone {alone:5.2f} s, two at once {pair:5.2f} s: {ratio:.2f}x"
             for name, (alone, pair, ratio) in results.items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one copy of a loop (default: 2)")
    parser.add_argument("--repeat", type=int, default=3, help="trials, each alone then the pair (default: 3)")
    args = parser.parse_args()
    print(f"two processes at once on {os.cpu_count()} cores (2.00x: they do not slow each other down)", flush=True)
    if hasattr(os, "getloadavg") and os.getloadavg()[0] > 0.5:
        print(f"  note: the machine is busy (load {os.getloadavg()[0]:.1f}): the ratios are not representative")
    print(report(speedups(args.seconds, args.repeat)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
