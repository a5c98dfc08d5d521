"""What the tap on torch.distributed costs per call, on one gloo rank.

    python benchmarks/tap.py [-n 20000]

Times ``dist.all_reduce`` of a 4-element tensor on a one-rank worker (no network: what is left is the call's own
cost): the original function (no tap), the tap with no observer, the tap with the call board (a worker's normal
state), and the call board with a ``CommCounter``. Prints microseconds per call and each one's overhead over the
original (the median of several rounds). Numbers vary with the machine; compare versions on the same one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import labsupport  # noqa: E402


def measure(n: int, rounds: int = 7) -> dict:
    import statistics

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from labsupport import tap

    x = torch.ones(4)
    original = next(f for f in tap._originals()  # the wrappers keep no __wrapped__
                    if getattr(f, "__name__", "") == "all_reduce" and "c10d" in getattr(f, "__module__", ""))

    def timed(all_reduce) -> float:
        start = time.perf_counter()
        for _ in range(n):
            all_reduce(x)
        return (time.perf_counter() - start) / n * 1e6

    everyone = tap.observers()

    def no_observer():
        with tap._LOCK:
            tap._set(())
        try:
            return timed(dist.all_reduce)
        finally:
            with tap._LOCK:
                tap._set(everyone)

    def counted():
        with labsupport.CommCounter():
            return timed(dist.all_reduce)

    def untapped():
        with tap._LOCK:
            tap._set(())
        try:
            return timed(original)
        finally:
            with tap._LOCK:
                tap._set(everyone)

    configs = {"original": untapped, "tap, no observer": no_observer,
               "tap + call board": lambda: timed(dist.all_reduce), "+ CommCounter": counted}
    for run in configs.values():  # warm-up
        run()
    samples = {name: [] for name in configs}
    for _ in range(rounds):  # interleaved, so that a slow patch of the machine hits every configuration
        for name, run in configs.items():
            samples[name].append(run())
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20000, help="calls per measurement (default: 20000)")
    args = parser.parse_args()
    results = labsupport.run(measure, args.n, world_size=1, timeout=600)[0]
    base = results["original"]
    for name, us in results.items():
        print(f"{name:20s} {us:7.1f} us per dist.all_reduce   overhead {us - base:+6.1f} us")
    labsupport.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
