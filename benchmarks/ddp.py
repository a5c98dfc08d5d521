"""How much gradient communication hides behind backward: naive vs overlapped vs bucketed DDP (gloo, CPU).

    python benchmarks/ddp.py [--world-sizes 2,4] [--rounds 5] [--steps 6] [--width 512] [--depth 8] [--cap-mb 1]
    python benchmarks/ddp.py --quick       # a few seconds: checks that it runs (tests/test_benchmarks.py)

Model: an MLP of ``depth`` layers ``width`` x ``width`` (8 MB of fp32 weights with the defaults), batch 64 per rank.
Three ways to synchronise gradients, written out here as in notebook 03:

* naive: ``all_reduce`` every gradient after backward (blocking);
* overlapped: one ``async_op=True`` all-reduce per gradient, launched from a post-accumulate-grad hook;
* bucketed: gradients grouped in reverse registration order up to ``cap-mb``, one all-reduce per bucket, launched
  by the hook of the bucket's last gradient.

Every rank records each step with ``labsupport.Timeline``: forward, backward and the optimizer step as compute,
the wait for communication as a wait span, and every all-reduce from issue to completion (``tl.collectives()``).
The hidden fraction of a step is the share of the time some all-reduce was in flight during which the rank was
computing (``Timeline.hidden_fraction``), averaged over ranks. Per round, the variants run one after the other in
a rotating order (a burst of load from elsewhere hits all alike); the table reports medians over rounds of the
per-round medians over steps (the first step of each run is a warm-up and is dropped).
"""

from __future__ import annotations

import argparse
import statistics
import time

import labsupport

VARIANTS = ("naive", "overlapped", "bucketed")


def _wrap(variant, model, cap_mb):
    """(call the model, finish the gradient synchronisation) for one variant."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t, 0)
    params = [p for p in model.parameters() if p.requires_grad]
    if variant == "naive":
        def finish():
            for p in params:
                dist.all_reduce(p.grad)
                p.grad /= world
        return model, finish

    if variant == "overlapped":
        buckets = [[p] for p in reversed(params)]
    else:  # the layout the notebook and its checks use
        from autograder.checks.data_parallel import expected_buckets

        named = dict(model.named_parameters())
        buckets = [[named[name] for name, _ in b] for b in expected_buckets(model, cap_mb)]
    where = {p: i for i, b in enumerate(buckets) for p in b}
    ready = [0] * len(buckets)
    flights = {}

    def launch(i):
        flat = torch.cat([p.grad.reshape(-1) for p in buckets[i]])
        flights[i] = (flat, dist.all_reduce(flat, async_op=True))

    def hook(p):
        i = where[p]
        ready[i] += 1
        if ready[i] == len(buckets[i]):
            launch(i)

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for i in range(len(buckets)):
            if i not in flights:
                launch(i)
        for i, (flat, work) in flights.items():
            work.wait()
            flat /= world
            for p, piece in zip(buckets[i], flat.split([p.numel() for p in buckets[i]])):
                p.grad.copy_(piece.view_as(p))
        flights.clear()
        ready[:] = [0] * len(buckets)

    return model, finish


def _run(order, steps, width, depth, cap_mb, batch=64):
    """On every rank: each variant in ``order`` for ``steps`` steps, recorded as notebook 03 records them
    (``record_steps``: a barrier, then forward, backward, the wait and the step in one ``Timeline``); per variant,
    per step (hidden, seconds), without the first step (a warm-up)."""
    from labsupport.lessons.data_parallel import record_steps

    out = {}
    for variant in order:
        rows = record_steps(lambda model: _wrap(variant, model, cap_mb), steps + 1, batch, width, depth)
        out[variant] = [(r["hidden"], r["seconds"]) for r in rows[1:]]
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--cap-mb", type=float, default=1.0)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run, not a measurement: 2 ranks, 1 round of 2 steps, a 3 x 64 x 64 MLP with "
                             "buckets of at most 0.02 MB (3 buckets)")
    args = parser.parse_args(argv)
    if args.quick:
        args.world_sizes, args.rounds, args.steps, args.width, args.depth, args.cap_mb = "2", 1, 2, 64, 3, 0.02
    print(f"MLP {args.depth} x {args.width} x {args.width} ({args.depth * args.width * (args.width + 1) * 4 / 2**20:.1f}"
          f" MiB of gradients), bucket cap {args.cap_mb} MB, {args.rounds} rounds x {args.steps} steps")
    print(f"{'ranks':>5} {'variant':<11} {'ms/step':>8} {'hidden':>7}  (medians; hidden = share of all-reduce time "
          "overlapped by compute)")
    for world_size in (int(w) for w in args.world_sizes.split(",")):
        per_variant = {v: ([], []) for v in VARIANTS}
        t0 = time.perf_counter()
        for r in range(args.rounds):
            order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
            results = labsupport.run(_run, order, args.steps, args.width, args.depth, args.cap_mb,
                                     world_size=world_size, timeout=300)
            for v in VARIANTS:
                steps = range(args.steps)
                hidden = statistics.median(statistics.mean(res[v][s][0] for res in results) for s in steps)
                seconds = statistics.median(max(res[v][s][1] for res in results) for s in steps)
                per_variant[v][0].append(hidden)
                per_variant[v][1].append(seconds)
        for v in VARIANTS:
            hidden, seconds = per_variant[v]
            print(f"{world_size:>5} {v:<11} {1e3 * statistics.median(seconds):8.1f} "
                  f"{100 * statistics.median(hidden):6.0f}%")
        print(f"      ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
