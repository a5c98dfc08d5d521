"""How fast notebook 02's network simulator is on 1024 ranks, and what simulating a step in one go saves.

    python benchmarks/netsim.py [--ranks 1024] [--repeats 3]

For each algorithm, the best of the repeats of ``netsim.simulate`` on a 64 MiB all-reduce over a hierarchical
topology (8 ranks a node). Ring and recursive doubling are one-to-one in every step (each rank sends and receives
at most one message), which ``simulate`` does with numpy in one go; the same schedules walked message by message
give the ratio. The notebook's aim: 1024 ranks in well under a second. ``tests/test_ring_allreduce_netsim.py``
checks that such steps are never walked message by message; no test times them.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labsupport.lessons.ring_allreduce import netsim  # noqa: E402


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def message_by_message(schedule: netsim.Schedule) -> netsim.Schedule:
    """The same schedule, with every step marked as not one-to-one: ``simulate`` walks its messages."""
    walked = {id(st): replace(st, _one_to_one=False) for st in schedule.steps}
    return netsim.Schedule(schedule.name, schedule.world_size, [walked[id(st)] for st in schedule.steps])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    p, nbytes = args.ranks, 2**26
    topo = netsim.Hierarchical(8, 1e-6, 1e-10, 1e-5, 1e-9)
    print(f"{p} ranks, 64 MiB, 8 ranks a node; best of {args.repeats}")
    print(f"  {'algorithm':<20}{'steps':>7}{'ms':>10}   {'message by message':>18}")
    for name, make in netsim.ALGORITHMS.items():
        schedule = make(p, nbytes)
        seconds = best(lambda: netsim.simulate(schedule, topo), args.repeats)
        walked = ""
        if all(st.one_to_one for st in schedule.steps):
            slow = best(lambda: netsim.simulate(message_by_message(schedule), topo), args.repeats)
            walked = f"{slow * 1000:9.1f} ms, {slow / seconds:5.1f}x"
        print(f"  {name:<20}{len(schedule.steps):7d}{seconds * 1000:10.1f}   {walked:>18}".rstrip())


if __name__ == "__main__":
    main()
