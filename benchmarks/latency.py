"""How soon labsupport.run gives control back: after a rank raises, after a rank dies, after the time-out, after Ctrl-C.

    python benchmarks/latency.py [--world-size 4] [--repeats 5]

Each row is the median, over the repeats, of the time from the event to the error reaching the caller: from the
failing rank's own clock just before it raises or exits (the other ranks wait for it in ``recv``), from the
time-out's deadline (every rank in ``recv``), from the SIGINT sent to this process while the ranks wait. It prints
the ratio to the 2 s the launcher aims for (it collects the other ranks' errors for ``_FAILURE_GRACE`` seconds after
the first one, then stops them). Load-dependent by nature, so no test asserts it: ``tests/test_launch.py`` checks
how each call ended (the failure, not the time-out), never how soon.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import labsupport  # noqa: E402
from labsupport import _call  # noqa: E402

TARGET = 2.0  # seconds: the launcher's aim for a failure or an interrupt to reach the notebook


def fail(stamp_dir: str, how: str):
    """Rank 1 writes the time, then raises or exits; every other rank waits for a message from it."""
    if dist.get_rank() == 1:
        with open(os.path.join(stamp_dir, "failed"), "w") as fh:
            fh.write(repr(time.time()))
        if how == "raise":
            raise ValueError("planted failure")
        os._exit(3)
    dist.recv(torch.zeros(1), src=1)


def deadlock():
    dist.recv(torch.zeros(1), src=(dist.get_rank() + 1) % dist.get_world_size())


def warm():
    return dist.get_rank()


def after_failure(n: int, how: str) -> float:
    labsupport.run(warm, world_size=n)  # workers started: only the failure is measured
    with tempfile.TemporaryDirectory() as stamps:
        try:
            labsupport.run(fail, stamps, how, world_size=n, timeout=120)
        except labsupport.WorkerError:
            reached = time.time()
        else:
            raise SystemExit("the planted failure was not reported")
        return reached - float(Path(stamps, "failed").read_text())


def after_timeout(n: int, timeout: float = 1.0) -> float:
    labsupport.run(warm, world_size=n)
    start = time.monotonic()
    try:
        labsupport.run(deadlock, world_size=n, timeout=timeout)
    except labsupport.WorkerTimeout:
        return time.monotonic() - (start + timeout)
    raise SystemExit("the deadlock was not reported")


def after_interrupt(n: int, pause: float = 1.0) -> float:
    labsupport.run(warm, world_size=n)
    sent = []

    def interrupt():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(pause, interrupt)  # the ranks are in their recv by then, on an idle machine
    timer.start()
    try:
        labsupport.run(deadlock, world_size=n, timeout=120)
    except KeyboardInterrupt:
        return time.monotonic() - sent[0]
    finally:
        timer.join()
    raise SystemExit("the interrupt did not stop the call")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    n = args.world_size
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a kernel, even when started in the background
    rows = [
        ("a rank raises, the others wait for it", lambda: after_failure(n, "raise")),
        ("a rank exits (os._exit), the others wait", lambda: after_failure(n, "exit")),
        ("the time-out passes (a deadlock)", lambda: after_timeout(n)),
        ("Ctrl-C while the ranks wait", lambda: after_interrupt(n)),
    ]
    try:
        load = f"{os.getloadavg()[0]:.1f}"
    except OSError:
        load = "?"
    print(f"{n} ranks, median of {args.repeats}, load {load}; the failure grace is {_call._FAILURE_GRACE:g} s")
    print(f"  {'event':<44}{'ms':>9}   {'of ' + format(TARGET, 'g') + ' s':>8}")
    for label, measure in rows:
        seconds = statistics.median(measure() for _ in range(args.repeats))
        print(f"  {label:<44}{seconds * 1000:9.1f}   {seconds / TARGET:7.2f}x")
    labsupport.shutdown()


if __name__ == "__main__":
    main()
