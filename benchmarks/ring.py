"""The course's reference ring all-reduce vs dist.all_reduce (gloo, CPU), and both vs the loopback link.

    python benchmarks/ring.py [--sizes-mib 1,16,64] [--world-sizes 2,4] [--rounds 15]
    python benchmarks/ring.py --quick      # a few seconds: checks that it runs (tests/test_benchmarks.py)

For each world size, one set of ranks measures, for every size, the two all-reduces in alternating order round
after round (so a burst of load from elsewhere hits both alike); a call's time is that of its slowest rank. The
table shows median times, and two ratios: the median of the per-round ratios (robust to load that drifts) and the
ratio of the median times.
Bandwidths follow nccl-tests: algbw = size / time, busbw = algbw * 2(N-1)/N (the bytes each rank must move,
which makes busbw comparable with a link's bandwidth). The loopback point-to-point bandwidth (one rank sends the
largest size to another with blocking send/recv) is measured in the same run: it is the physical limit here.
Prints one table and the ratios ring/built-in of throughput (> 1 means the reference ring is faster).

The reference ring is ``autograder.checks.ring_allreduce.reference_ring_all_reduce`` (not shipped to students).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import labsupport


def _p2p_bandwidth(nbytes: int, rounds: int) -> float:
    import torch
    import torch.distributed as dist

    x = torch.ones(nbytes // 4)
    times = []
    for _ in range(rounds + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(x, 1)
            dist.recv(x[:1], 1)  # a one-element ack: the time covers the whole transfer
        elif dist.get_rank() == 1:
            dist.recv(x, 0)
            dist.send(x[:1], 0)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:])


def _measure(sizes: list[int], rounds: int, p2p_bytes: int):
    import torch
    import torch.distributed as dist

    from autograder.checks.ring_allreduce import reference_ring_all_reduce

    impls = {"builtin": dist.all_reduce, "ring": reference_ring_all_reduce}
    out = {}
    for nbytes in sizes:
        torch.manual_seed(dist.get_rank())
        x0 = torch.randn(nbytes // 4)
        x = x0.clone()
        want = x0.clone()
        dist.all_reduce(want)
        reference_ring_all_reduce(x)
        assert torch.allclose(x, want, rtol=1e-4, atol=1e-4), "the reference ring gave a wrong sum"
        times = {k: [] for k in impls}
        for i in range(rounds):
            order = list(impls) if i % 2 == 0 else list(impls)[::-1]
            for name in order:
                x.copy_(x0)
                dist.barrier()
                t0 = time.perf_counter()
                impls[name](x)
                dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                times[name].append(dt.item())
        out[nbytes] = {k: statistics.median(v) for k, v in times.items()}
        # each round measured both back to back: the median of the per-round ratios is robust to load that drifts
        out[nbytes]["ratio"] = statistics.median(b / r for b, r in zip(times["builtin"], times["ring"]))
    p2p = _p2p_bandwidth(p2p_bytes, rounds) if dist.get_world_size() == 2 else None
    return out, p2p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="1,16,64", help="comma-separated sizes in MiB (default 1,16,64)")
    ap.add_argument("--world-sizes", default="2,4", help="comma-separated world sizes; the first should be 2")
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds per size and implementation")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run, not a measurement: sizes 0.0625,4 MiB on 2 and 3 ranks, 2 rounds (the 4 MiB "
                         "on 3 ranks takes the ring's segmented all-gather)")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes_mib, args.world_sizes, args.rounds = "0.0625,4", "2,3", 2
    sizes = [int(float(s) * 2**20) for s in args.sizes_mib.split(",")]
    world_sizes = [int(n) for n in args.world_sizes.split(",")]

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    results, p2p = {}, None
    for n in world_sizes:
        res, bw = labsupport.run(_measure, sizes, args.rounds, max(sizes), world_size=n, timeout=1800)[0]
        results[n] = res
        p2p = bw if bw is not None else p2p

    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{os.cpu_count()} CPU cores; 1-minute load average {load_before:.1f} before, {load_after:.1f} after "
          "(other programs competing for the cores make both columns slower and noisier)")
    print(f"loopback point-to-point bandwidth: {p2p / 1e9:.2f} GB/s" if p2p else "loopback p2p: not measured")
    head = (f"{'ranks':>5} {'size':>8} | {'dist.all_reduce':^27} | {'reference ring':^27} | "
            f"{'ring/builtin':^15} | {'busbw/p2p':^13}")
    sub = (f"{'':>5} {'':>8} | {'ms':>7} {'algbw':>9} {'busbw':>9} | {'ms':>7} {'algbw':>9} {'busbw':>9} | "
           f"{'paired':>7} {'medians':>7} | {'builtin':>6} {'ring':>6}")
    print(head)
    print(sub)
    print("-" * len(sub))
    for n, res in results.items():
        for nbytes, t in res.items():
            row = f"{n:>5} {nbytes / 2**20:>6g}Mi |"
            bus = {}
            for name in ("builtin", "ring"):
                alg = nbytes / t[name]
                bus[name] = alg * 2 * (n - 1) / n
                row += f" {t[name] * 1e3:>7.2f} {alg / 1e9:>6.2f}GB/s {bus[name] / 1e9:>5.2f}GB/s |"
            row += f" {t['ratio']:>6.2f}x {t['builtin'] / t['ring']:>6.2f}x |"
            if p2p:
                row += f" {bus['builtin'] / p2p:>6.2f} {bus['ring'] / p2p:>6.2f}"
            print(row)
    print("\nring/builtin (> 1: the ring is faster): 'paired' is the median over rounds of dist.all_reduce time / "
          "reference ring time, both measured back to back in a round; 'medians' divides the two median times.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
