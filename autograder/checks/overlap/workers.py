"""The checks of the three distributed exercises of notebook 10 and their probes: ``check_allgather_matmul``,
``check_matmul_reduce_scatter``, ``check_zigzag_ring_attention``.

The student's function runs in each rank's grading sandbox (``drivers.on_ring``, which also lists the products it
computed, for the messages of honest mistakes). Each probe, in the host, draws its inputs from a seed shared by all
ranks (so every rank can build the one-process oracle), calls the function under ``CommCounter`` and ``Transfers``
(``probes``: the sandbox's CPU time under each transfer, from the host's record) and judges on that rank. Every case
ends with one small all-gather outside the recorded region through which the ranks share the problems they found,
so a wrong answer never turns into a deadlock of the check itself and every rank reports the same one. Each check
runs on the default group (an odd ring and an even one) and on a group of global ranks 1, 2, 3 of 4 workers, whose
group rank r is global rank r + 1. The sizes make one product take milliseconds of CPU, far above what relaying a
request costs; values are multiples of 1/4, so products are exact in any order and dtype.
"""

from __future__ import annotations

import math
import random

import torch

from .._common import draw_seed, expect_tensor, in_sandbox, run_on_workers, tolerance
from .drivers import on_ring
from .probes import SHARE, Transfers, product_cpu, rows_of, under
from .reference import dense_causal, zigzag_positions

DTYPES = (torch.float32, torch.float64)


#: The ring of the subgroup case: 4 workers, rank 0 outside it, so that group rank r is never global rank r.
SUBGROUP = (1, 2, 3)

#: What a subgroup case adds to a failure's message.
GROUP_HINT = (" With a group, dist.isend/irecv take global ranks: the neighbours of group rank r = "
              "dist.get_rank(group) are dist.get_global_rank(group, (r ± 1) % N), or pass group=group with those.")


def _world_sizes(rng: random.Random) -> list:
    return [3, rng.choice([2, 4])]  # an odd ring always, and an even one


def _ring(ring):
    """(this rank's place in the ring or None outside it, the ring's size, its global ranks, words for the label):
    the default group when ``ring`` is None, else the group of the global ranks ``ring`` that ``on_ring`` makes."""
    import torch.distributed as dist

    me = dist.get_rank()
    if ring is None:
        world = dist.get_world_size()
        return me, world, list(range(world)), ""
    where = f", on the group of global ranks {list(ring)} of {dist.get_world_size()}"
    return (list(ring).index(me) if me in ring else None), len(ring), list(ring), where


def _stop_on_any(problem) -> None:
    """Called by every rank: all raise the first problem any rank found (a rank outside the ring has none)."""
    from .._common import share

    found = [p for p in share(problem) if p]
    if found:
        raise AssertionError(found[0])


def _call(fn, what, args, ring):
    """``fn`` (run by ``on_ring``) on ``args``: ((its result, the products it listed), None) or ((None, []), the
    error it raised)."""
    try:
        got = fn(args, ring)  # on_ring in the sandbox
    except (NotImplementedError, AssertionError):
        raise
    except Exception as exc:  # noqa: BLE001 - any other error is the student's, reported with the rank
        return (None, []), f"{what} raised {type(exc).__name__}: {exc}"
    if not isinstance(got, dict):
        return (None, []), f"{what} returned nothing readable"
    return (got.get("out"), list(got.get("products") or [])), None


def _exact(gen, *shape, dtype):
    """Values that are multiples of 1/4 in [-2, 2]: every product and sum of them is exact in float32 too."""
    return (torch.randint(-8, 9, shape, generator=gen) / 4).to(dtype)


def _traffic_problem(cc, what: str, steps: int, chunk_bytes: int, chunk_name: str, ring: list) -> str | None:
    """The ring's traffic: point-to-point only, to one neighbour each way (global ranks ``ring`` in ring order),
    ``steps`` messages of one chunk each."""
    import torch.distributed as dist

    me, world = dist.get_rank(), len(ring)
    rank = ring.index(me)
    others = sorted(cc.kinds - {"send", "recv"})
    if others:
        built_in = {"all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
                    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}
        name = built_in.get(others[0], others[0])
        return (f"{what} called torch.distributed.{name} on rank {rank}: build the ring from isend/irecv only; "
                "the built-in collective is what this exercise takes apart.")
    neighbours = {ring[(rank + 1) % world], ring[(rank - 1) % world]}
    far = sorted({c.peer for c in cc.calls if c.peer is not None} - neighbours)
    if far:
        if ring != list(range(dist.get_world_size())):
            return (f"{what}: group rank {rank} (global rank {me}) exchanged messages with global rank {far[0]}, "
                    f"which is not its neighbour on the ring (global ranks {sorted(neighbours)})." + GROUP_HINT)
        return (f"rank {rank} exchanged messages with rank {far[0]}, which is not a neighbour on the ring: each rank "
                f"sends to one neighbour and receives from the other.")
    sent = [c.nbytes for c in cc.calls if c.kind == "send"]
    if len(sent) != steps or any(b != chunk_bytes for b in sent):
        return (f"rank {rank} sent {len(sent)} message(s) of {sorted(set(sent))} bytes; a ring of {world} ranks "
                f"needs {steps} step(s), each one message of one {chunk_name} ({chunk_bytes} bytes).")
    return None


def _overlap_problem(log: Transfers, what: str, steps: int, product: float) -> str | None:
    """For ring step k = 1..steps: the k-th send and recv posted with isend/irecv, and at least ``SHARE`` of one
    product's CPU time (``product`` seconds, measured by the host) spent by the function between post and wait."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for kind in ("send", "recv"):
        posts = [p for p in log.posts if p["what"] == kind]
        for k, post in enumerate(posts[:steps], start=1):
            if post["blocking"]:
                call, post_it = ("dist.send", "isend") if kind == "send" else ("dist.recv", "irecv")
                return (f"rank {rank} used the blocking {call} for ring step {k}: it returns only when the transfer "
                        f"is over, so nothing overlaps it. Post the transfer with dist.{post_it}, compute, then "
                        "wait() on the request.")
            if under(post) < SHARE * product:
                return (f"{what}: rank {rank}'s {kind} of ring step {k} had no product underneath it: between its "
                        f"post and its wait the function used {under(post) * 1e3:.2f} ms of CPU, one product of a "
                        f"chunk takes {product * 1e3:.2f} ms. A product made before posting the transfer, or one "
                        "product of everything once the transfers are over, overlaps nothing: post the next "
                        "transfer with isend/irecv, compute one product per chunk (the one already here), then wait.")
    return None


# ---------------------------------------------------------------------------------------------------------------
# allgather_matmul


def _agm_case(allgather_matmul, seed: int, dtype, rows: int, k: int, out: int, ring=None):
    from labsupport import CommCounter

    rank, world, members, where = _ring(ring)
    label = (f"allgather_matmul (seed {seed}, {world} ranks{where}, x_shard {rows}x{k}, weight {out}x{k}, "
             f"{str(dtype)[6:]})")
    gen = torch.Generator().manual_seed(seed)
    shards = [_exact(gen, rows, k, dtype=dtype) for _ in range(world)]
    weight = _exact(gen, out, k, dtype=dtype)
    mine, w = shards[rank if rank is not None else 0].clone(), weight.clone()
    allgather_matmul(None, ring)  # every rank: the group, made outside the counters
    with CommCounter() as cc, Transfers() as log:
        (got, products), problem = _call(allgather_matmul, "allgather_matmul", (mine, w), ring)
    if rank is None:  # outside the ring
        return _stop_on_any(None)
    expected = torch.cat(shards) @ weight.T
    if problem and ring is not None:
        problem = f"{label}: {problem}.{GROUP_HINT}"
    if problem is None and not (torch.equal(mine, shards[rank]) and torch.equal(w, weight)):
        problem = f"{label}: rank {rank}'s x_shard or weight was changed; leave the inputs untouched."
    if problem is None:
        try:
            expect_tensor(got, expected, f"{label}: rank {rank}'s result",
                          "It must equal all_gather(x_shard) along dim 0, in rank order, @ weight.T.")
        except AssertionError as exc:
            problem = str(exc)
            if isinstance(got, torch.Tensor) and got.shape == expected.shape:
                for r in range(world):
                    block = got[r * rows:(r + 1) * rows]
                    s = next((s for s in range(world) if s != r and torch.equal(
                        block.to(dtype), expected[s * rows:(s + 1) * rows])), None)
                    if s is not None:
                        problem += (f" Rows {r * rows}..{(r + 1) * rows - 1} hold rank {s}'s chunk times the "
                                    f"weight: chunk j comes from rank j, place each where it belongs.")
                        break
    products = [p for p in products if rows_of(p, (out, k)) is not None]
    if problem is None:
        sizes = [rows_of(p, (out, k)) for p in products]
        if len(products) != world or any(s != rows for s in sizes):
            problem = (f"{label}: rank {rank} multiplied by the weight {len(products)} time(s), on {sizes} rows; "
                       f"compute one product per chunk ({world} of {rows} rows each) as each chunk is here, not one "
                       "product of the gathered input once every transfer is over.")
    if problem is None:
        problem = _traffic_problem(cc, label, world - 1, rows * k * mine.element_size(), "x_shard", members)
    if problem is None and world > 1:
        problem = _overlap_problem(log, label, world - 1, product_cpu((mine, w.T)))
    _stop_on_any(problem)


def _sizes(rng: random.Random) -> tuple:
    """rows, k, out: one product of a chunk takes milliseconds; the three sizes differ (``rows_of``)."""
    return rng.choice([384, 448]), rng.choice([768, 832]), rng.choice([896, 960])


def check_allgather_matmul(allgather_matmul) -> None:
    seed = draw_seed()
    rng = random.Random(seed)
    fn = in_sandbox(allgather_matmul, "allgather_matmul(x_shard, weight, group=None)", allow={"send", "recv"},
                    driver=on_ring)
    for world in _world_sizes(rng):
        run_on_workers(_agm_case, fn, rng.randrange(2**31), rng.choice(DTYPES), *_sizes(rng),
                       world_size=world, what="allgather_matmul")
    sizes = _sizes(rng)
    run_on_workers(_agm_case, fn, rng.randrange(2**31), rng.choice(DTYPES), *sizes, SUBGROUP,
                   world_size=4, what=f"allgather_matmul on a group of global ranks {list(SUBGROUP)}")
    run_on_workers(_agm_case, fn, rng.randrange(2**31), rng.choice(DTYPES), *sizes,
                   world_size=1, what="allgather_matmul on one rank")


# ---------------------------------------------------------------------------------------------------------------
# matmul_reduce_scatter


def _mrs_case(matmul_reduce_scatter, seed: int, dtype, rows: int, k: int, out: int, ring=None):
    from labsupport import CommCounter

    rank, world, members, where = _ring(ring)
    label = (f"matmul_reduce_scatter (seed {seed}, {world} ranks{where}, x {world * rows}x{k}, weight_shard "
             f"{out}x{k}, {str(dtype)[6:]})")
    gen = torch.Generator().manual_seed(seed)
    xs = [_exact(gen, world * rows, k, dtype=dtype) for _ in range(world)]
    ws = [_exact(gen, out, k, dtype=dtype) for _ in range(world)]
    x, w = xs[rank if rank is not None else 0].clone(), ws[rank if rank is not None else 0].clone()
    matmul_reduce_scatter(None, ring)  # every rank: the group, made outside the counters
    with CommCounter() as cc, Transfers() as log:
        (got, products), problem = _call(matmul_reduce_scatter, "matmul_reduce_scatter", (x, w), ring)
    if rank is None:  # outside the ring
        return _stop_on_any(None)
    full = sum(x_ @ w_.T for x_, w_ in zip(xs, ws))
    expected = full[rank * rows:(rank + 1) * rows]
    if problem and ring is not None:
        problem = f"{label}: {problem}.{GROUP_HINT}"
    if problem is None and not (torch.equal(x, xs[rank]) and torch.equal(w, ws[rank])):
        problem = f"{label}: rank {rank}'s x or weight_shard was changed; leave the inputs untouched."
    if problem is None:
        hint = "It must equal rows rank·n .. (rank+1)·n − 1 of the sum over ranks of x @ weight_shard.T."
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and not torch.equal(got.to(dtype), expected):
            own = (x @ w.T)[rank * rows:(rank + 1) * rows]
            if torch.equal(got.to(dtype), own):
                hint = "It is this rank's own partial product only: add the partial results of the other ranks."
            for s in range(world):
                if s != rank and torch.equal(got.to(dtype), full[s * rows:(s + 1) * rows]):
                    hint = (f"It is the reduced chunk {s}: rank r must end with chunk r; check which chunk each ring "
                            "step computes.")
        try:
            expect_tensor(got, expected, f"{label}: rank {rank}'s result", hint)
        except AssertionError as exc:
            problem = str(exc)
    products = [p for p in products if rows_of(p, (out, k)) is not None]
    if problem is None:
        sizes = [rows_of(p, (out, k)) for p in products]
        if len(products) != world or any(s != rows for s in sizes):
            problem = (f"{label}: rank {rank} multiplied by weight_shard {len(products)} time(s), on {sizes} rows; "
                       f"compute the partial result chunk by chunk ({world} products of {rows} rows), sending each "
                       "while the next is computed, not one product of the whole x.")
    if problem is None:
        problem = _traffic_problem(cc, label, world - 1, rows * out * x.element_size(), "partial-result chunk",
                                   members)
    if problem is None and world > 1:
        problem = _overlap_problem(log, label, world - 1, product_cpu((x[:rows], w.T)))
    _stop_on_any(problem)


def check_matmul_reduce_scatter(matmul_reduce_scatter) -> None:
    seed = draw_seed()
    rng = random.Random(seed)
    fn = in_sandbox(matmul_reduce_scatter, "matmul_reduce_scatter(x, weight_shard, group=None)",
                    allow={"send", "recv"}, driver=on_ring)
    for world in _world_sizes(rng):
        run_on_workers(_mrs_case, fn, rng.randrange(2**31), rng.choice(DTYPES), *_sizes(rng),
                       world_size=world, what="matmul_reduce_scatter")
    run_on_workers(_mrs_case, fn, rng.randrange(2**31), rng.choice(DTYPES), *_sizes(rng), SUBGROUP,
                   world_size=4, what=f"matmul_reduce_scatter on a group of global ranks {list(SUBGROUP)}")


# ---------------------------------------------------------------------------------------------------------------
# zigzag_ring_attention


def block_products(products, batch: int, heads: int, chunk: int, head_dim: int) -> float:
    """The matrix products of attention on one rank (``(op, shapes, flops)`` each), in units of one chunk of queries
    against one chunk of keys (its scores and its weighted sum of values: 4·B·H·c²·D flops)."""
    return sum(p[2] for p in products) / (4 * batch * heads * chunk * chunk * head_dim)


def _zz_case(zigzag_ring_attention, seed: int, dtype, batch: int, chunk: int, heads: int, head_dim: int,
             ring=None):
    from labsupport import CommCounter

    from .._common import share

    rank, world, members, where = _ring(ring)
    S = 2 * world * chunk
    label = (f"zigzag_ring_attention (seed {seed}, {world} ranks{where}, B={batch}, S={S}, H={heads}, "
             f"D={head_dim}, {str(dtype)[6:]})")
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, S, heads, head_dim, generator=gen, dtype=dtype) for _ in range(3))
    pos = torch.tensor(zigzag_positions(world, rank if rank is not None else 0, chunk))
    mine = [t[:, pos].clone() for t in (q, k, v)]
    kept = [t.clone() for t in mine]
    zigzag_ring_attention(None, ring)  # every rank: the group, made outside the counters
    with CommCounter() as cc, Transfers() as log:
        (got, products), problem = _call(zigzag_ring_attention, "zigzag_ring_attention", tuple(mine), ring)
    if rank is None:  # outside the ring
        share(None)
        return _stop_on_any(None)
    expected = dense_causal(q, k, v, pos)
    if problem and ring is not None:
        problem = f"{label}: {problem}.{GROUP_HINT}"
    if problem is None and not all(torch.equal(a, b) for a, b in zip(mine, kept)):
        problem = f"{label}: rank {rank}'s q, k or v was changed; leave the inputs untouched."
    if problem is None:
        hint = ("Rank r holds sequence chunks r and 2N−1−r (N ranks): a query of chunk i sees the keys of chunks "
                "before i in full and of chunk i up to itself.")
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and world > 1:
            wrong = _contiguous_answer(q, k, v, rank, world, chunk)
            if torch.allclose(got.to(dtype), wrong.to(dtype), **tolerance(dtype)):
                hint = ("This is the causal attention of a contiguous split (rank r holding positions 2rc .. "
                        "2(r+1)c − 1): here rank r holds chunks r and 2N−1−r, mask by those positions.")
        try:
            expect_tensor(got, expected, f"{label}: rank {rank}'s output", hint)
        except AssertionError as exc:
            problem = str(exc)
    if problem is None:
        kv_bytes = sum(t.numel() * t.element_size() for t in mine[1:])
        others = sorted(cc.kinds - {"send", "recv"})
        neighbours = {members[(rank + 1) % world], members[(rank - 1) % world]}
        far = sorted({c.peer for c in cc.calls if c.peer is not None} - neighbours)
        if others:
            problem = (f"{label}: rank {rank} called torch.distributed.{others[0]}: pass k and v around the ring "
                       "with isend/irecv, so that no rank ever holds the whole sequence's keys and values.")
        elif far:
            problem = (f"{label}: rank {rank} exchanged messages with global rank {far[0]}, which is not its ring "
                       f"neighbour (global ranks {sorted(neighbours)})." + (GROUP_HINT if ring is not None else ""))
        elif cc.bytes_sent != (world - 1) * kv_bytes:
            problem = (f"{label}: rank {rank} sent {cc.bytes_sent} bytes; the ring passes this rank's k and v on "
                       f"{world - 1} time(s): {(world - 1) * kv_bytes} bytes.")
    if problem is None:  # each ring step computes two blocks of queries against keys while its transfer runs
        qc, kc = (t.transpose(1, 2) for t in mine[:2])
        block = product_cpu((qc, kc[:, :, :chunk].transpose(-2, -1)), (qc @ kc[:, :, :chunk].transpose(-2, -1),
                                                                        kc[:, :, :chunk]))
        for kind in ("send", "recv"):
            for n, post in enumerate([p for p in log.posts if p["what"] == kind], start=1):
                if post["blocking"] or under(post) < SHARE * block:
                    why = ("a blocking call" if post["blocking"] else
                           f"{under(post) * 1e3:.2f} ms of CPU between its post and its wait, where two blocks take "
                           f"{block * 1e3:.2f} ms: posted after the products of its step, or waited for before them")
                    problem = (f"{label}: rank {rank}'s {kind} of k/v for ring step {n} ran with no block product "
                               f"underneath it ({why}): post the next step's transfer with isend/irecv, compute "
                               "with the k/v already here, then wait.")
                    break
            if problem:
                break
    count = block_products(products, batch, heads, chunk, head_dim)
    everyone = share(count)
    counts = [everyone[g] for g in members]
    if problem is None:
        low, high = min(counts), max(counts)
        needed = 2 * world + 1
        if high - low > 1e-6:
            problem = (f"{label}: the ranks computed {[round(c, 2) for c in counts]} block products (one chunk of "
                       f"queries against one chunk of keys): a zig-zag split gives every rank the same work. Skip "
                       "the blocks that are entirely in the future the same way on every step.")
        elif high > needed + 1 + 1e-6:
            problem = (f"{label}: every rank computed {round(high, 2)} block products; causal attention on this split "
                       f"needs {needed} (at most {needed + 1} when a rank's own two chunks are done as one masked "
                       "block): skip the blocks that are entirely masked.")
    _stop_on_any(problem)
    return count


def _contiguous_answer(q, k, v, rank, world, chunk):
    """What a rank gets when it treats its two chunks as contiguous positions 2rc .. 2(r+1)c − 1 of the sequence
    and its neighbours' k/v likewise (08's split), computed from the zig-zag data it is given."""
    order = torch.cat([torch.tensor(zigzag_positions(world, r, chunk)) for r in range(world)])
    qz, kz, vz = (t[:, order] for t in (q, k, v))           # the sequence as the ranks hold it, read as contiguous
    return dense_causal(qz, kz, vz, list(range(rank * 2 * chunk, (rank + 1) * 2 * chunk)))


def _zz_sizes(rng: random.Random) -> tuple:
    """batch, chunk, heads, head_dim: one block of attention takes milliseconds of CPU."""
    return 1, rng.choice([320, 352]), 4, 128


def check_zigzag_ring_attention(zigzag_ring_attention) -> None:
    seed = draw_seed()
    rng = random.Random(seed)
    fn = in_sandbox(zigzag_ring_attention, "zigzag_ring_attention(q, k, v, group=None)", allow={"send", "recv"},
                    driver=on_ring)
    for world in _world_sizes(rng):
        run_on_workers(_zz_case, fn, rng.randrange(2**31), rng.choice(DTYPES), *_zz_sizes(rng),
                       world_size=world, what="zigzag_ring_attention")
    run_on_workers(_zz_case, fn, rng.randrange(2**31), rng.choice(DTYPES), *_zz_sizes(rng), SUBGROUP, world_size=4,
                   what=f"zigzag_ring_attention on a group of global ranks {list(SUBGROUP)}")
