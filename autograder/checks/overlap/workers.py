"""The checks of the three distributed exercises of notebook 10 and their probes: ``check_allgather_matmul``,
``check_matmul_reduce_scatter``, ``check_zigzag_ring_attention``.

Each probe draws its inputs from a seed shared by all ranks (so every rank can build the one-process oracle),
calls the student's function under ``CommCounter`` and an ``OrderLog``, and judges on that rank. Every case ends
with one small all-gather outside the recorded region through which the ranks share the problems they found, so a
wrong answer never turns into a deadlock of the check itself and every rank reports the same one. Each check runs
on the default group (an odd ring and an even one) and on a group of global ranks 1, 2, 3 of 4 workers, whose group
rank r is global rank r + 1.
"""

from __future__ import annotations

import math
import random

import torch

from .._common import draw_seed, expect_tensor, run_on_workers, tolerance
from .probes import OrderLog, rows_of
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
    """(this rank's place in the ring or None outside it, the ring's size, its group or None, its global ranks,
    words for the label): the default group when ``ring`` is None, else a group of the global ranks ``ring``, which
    every rank makes (``dist.new_group`` is called by all)."""
    import torch.distributed as dist

    me = dist.get_rank()
    if ring is None:
        world = dist.get_world_size()
        return me, world, None, list(range(world)), ""
    group = dist.new_group(list(ring))
    where = f", on the group of global ranks {list(ring)} of {dist.get_world_size()}"
    return (list(ring).index(me) if me in ring else None), len(ring), group, list(ring), where


def _group_kwargs(group) -> dict:
    return {} if group is None else {"group": group}


def _stop_on_any(problem) -> None:
    """Called by every rank: all raise the first problem any rank found (a rank outside the ring has none)."""
    from .._common import share

    found = [p for p in share(problem) if p]
    if found:
        raise AssertionError(found[0])


def _call(fn, what, *args, **kwargs):
    try:
        return fn(*args, **kwargs), None
    except (NotImplementedError, AssertionError):
        raise
    except Exception as exc:  # noqa: BLE001 - any other error is the student's, reported with the rank
        return None, f"{what} raised {type(exc).__name__}: {exc}"


def _refused(log, cc, label: str) -> str | None:
    import torch.distributed as dist

    if log.refused is None:
        return None
    name = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}.get(log.refused,
                                                                                                   log.refused)
    return (f"{label}: rank {dist.get_rank()} called torch.distributed.{name}: build the ring from isend/irecv "
            "only; the built-in collective is what this exercise takes apart.")


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


def _overlap_problem(log: OrderLog, what: str, products: list, steps: int, needs: tuple, first: int) -> str | None:
    """For ring step k = 1..steps: the k-th transfers of each kind in ``needs`` posted with isend/irecv before
    product number ``k - 1 + first`` and waited for after it started."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for kind in needs:
        posts = [p for p in log.posts if p["what"] == kind]
        for k in range(1, steps + 1):
            if k > len(posts):
                return None  # the traffic check says what is missing
            post, product = posts[k - 1], products[k - 1 + first]
            call = "dist.send" if kind == "send" else "dist.recv"
            if post["blocking"]:
                post_it = "isend" if kind == "send" else "irecv"
                return (f"rank {rank} used the blocking {call} for ring step {k}: it returns only when the transfer "
                        f"is over, so nothing overlaps it. Post the transfer with dist.{post_it}, compute, then "
                        "wait() on the request.")
            if post["pos"] > product["pos"]:
                return (f"rank {rank} ran matrix product number {k - 1 + first + 1} before posting the {kind} of ring "
                        f"step {k}: post the next transfer first, then multiply the chunk already here, so that the "
                        "transfer runs during the product.")
            if post["waited"] is not None and post["waited"] < product["pos"]:
                return (f"rank {rank} waited for the {kind} of ring step {k} before matrix product number "
                        f"{k - 1 + first + 1}: the transfer was over before the product began. Wait after the product.")
    return None


# ---------------------------------------------------------------------------------------------------------------
# allgather_matmul


def _agm_case(allgather_matmul, seed: int, dtype, rows: int, k: int, out: int, ring=None):
    from labsupport import CommCounter

    rank, world, group, members, where = _ring(ring)
    if rank is None:  # outside the ring
        return _stop_on_any(None)
    label = (f"allgather_matmul (seed {seed}, {world} ranks{where}, x_shard {rows}x{k}, weight {out}x{k}, "
             f"{str(dtype)[6:]})")
    gen = torch.Generator().manual_seed(seed)
    shards = [torch.randn(rows, k, generator=gen, dtype=dtype) for _ in range(world)]
    weight = torch.randn(out, k, generator=gen, dtype=dtype)
    expected = torch.cat(shards) @ weight.T
    mine, w = shards[rank].clone(), weight.clone()
    with CommCounter() as cc, OrderLog() as log:
        got, problem = _call(allgather_matmul, "allgather_matmul", mine, w, **_group_kwargs(group))
    if problem and group is not None:
        problem = f"{label}: {problem}.{GROUP_HINT}"
    problem = _refused(log, cc, label) or problem
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
                    for s in range(world):
                        if s != r and torch.allclose(block, expected[s * rows:(s + 1) * rows], **tolerance(dtype)):
                            problem += (f" Rows {r * rows}..{(r + 1) * rows - 1} hold rank {s}'s chunk times the "
                                        f"weight: chunk j comes from rank j, place each where it belongs.")
                            break
                    else:
                        continue
                    break
    products = [p for p in log.products if rows_of(p, (out, k)) is not None]
    if problem is None:
        sizes = [rows_of(p, (out, k)) for p in products]
        if len(products) != world or any(s != rows for s in sizes):
            problem = (f"{label}: rank {rank} multiplied by the weight {len(products)} time(s), on {sizes} rows; "
                       f"compute one product per chunk ({world} of {rows} rows each) as each chunk is here, not one "
                       "product of the gathered input once every transfer is over.")
    if problem is None:
        problem = _traffic_problem(cc, label, world - 1, rows * k * mine.element_size(), "x_shard", members)
    if problem is None:
        problem = _overlap_problem(log, label, products, world - 1, ("send", "recv"), first=0)
    _stop_on_any(problem)


def check_allgather_matmul(allgather_matmul) -> None:
    seed = draw_seed()
    rng = random.Random(seed)
    for world in _world_sizes(rng):
        rows, k, out = rng.choice([2, 3, 5]), rng.choice([7, 9]), rng.choice([4, 6, 11])
        run_on_workers(_agm_case, allgather_matmul, rng.randrange(2**31), rng.choice(DTYPES), rows, k, out,
                       world_size=world, what="allgather_matmul")
    rows, k, out = rng.choice([2, 3, 5]), rng.choice([7, 9]), rng.choice([4, 6, 11])
    run_on_workers(_agm_case, allgather_matmul, rng.randrange(2**31), rng.choice(DTYPES), rows, k, out, SUBGROUP,
                   world_size=4, what=f"allgather_matmul on a group of global ranks {list(SUBGROUP)}")
    run_on_workers(_agm_case, allgather_matmul, rng.randrange(2**31), rng.choice(DTYPES), rows, k, out,
                   world_size=1, what="allgather_matmul on one rank")


# ---------------------------------------------------------------------------------------------------------------
# matmul_reduce_scatter


def _mrs_case(matmul_reduce_scatter, seed: int, dtype, rows: int, k: int, out: int, ring=None):
    from labsupport import CommCounter

    rank, world, group, members, where = _ring(ring)
    if rank is None:  # outside the ring
        return _stop_on_any(None)
    label = (f"matmul_reduce_scatter (seed {seed}, {world} ranks{where}, x {world * rows}x{k}, weight_shard "
             f"{out}x{k}, {str(dtype)[6:]})")
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(world * rows, k, generator=gen, dtype=dtype) for _ in range(world)]
    ws = [torch.randn(out, k, generator=gen, dtype=dtype) for _ in range(world)]
    full = sum(x @ w.T for x, w in zip(xs, ws))
    expected = full[rank * rows:(rank + 1) * rows]
    x, w = xs[rank].clone(), ws[rank].clone()
    with CommCounter() as cc, OrderLog() as log:
        got, problem = _call(matmul_reduce_scatter, "matmul_reduce_scatter", x, w, **_group_kwargs(group))
    if problem and group is not None:
        problem = f"{label}: {problem}.{GROUP_HINT}"
    problem = _refused(log, cc, label) or problem
    if problem is None and not (torch.equal(x, xs[rank]) and torch.equal(w, ws[rank])):
        problem = f"{label}: rank {rank}'s x or weight_shard was changed; leave the inputs untouched."
    if problem is None:
        hint = "It must equal rows rank·n .. (rank+1)·n − 1 of the sum over ranks of x @ weight_shard.T."
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and not torch.allclose(
                got.to(dtype), expected, **tolerance(dtype)):
            own = (x @ w.T)[rank * rows:(rank + 1) * rows]
            if torch.allclose(got.to(dtype), own, **tolerance(dtype)):
                hint = "It is this rank's own partial product only: add the partial results of the other ranks."
            for s in range(world):
                if s != rank and torch.allclose(got.to(dtype), full[s * rows:(s + 1) * rows], **tolerance(dtype)):
                    hint = (f"It is the reduced chunk {s}: rank r must end with chunk r; check which chunk each ring "
                            "step computes.")
        try:
            expect_tensor(got, expected, f"{label}: rank {rank}'s result", hint)
        except AssertionError as exc:
            problem = str(exc)
    products = [p for p in log.products if rows_of(p, (out, k)) is not None]
    if problem is None:
        sizes = [rows_of(p, (out, k)) for p in products]
        if len(products) != world or any(s != rows for s in sizes):
            problem = (f"{label}: rank {rank} multiplied by weight_shard {len(products)} time(s), on {sizes} rows; "
                       f"compute the partial result chunk by chunk ({world} products of {rows} rows), sending each "
                       "while the next is computed, not one product of the whole x.")
    if problem is None:
        problem = _traffic_problem(cc, label, world - 1, rows * out * x.element_size(), "partial-result chunk",
                                   members)
    if problem is None:
        problem = _overlap_problem(log, label, products, world - 1, ("send", "recv"), first=1)
    _stop_on_any(problem)


def check_matmul_reduce_scatter(matmul_reduce_scatter) -> None:
    seed = draw_seed()
    rng = random.Random(seed)
    for world in _world_sizes(rng):
        rows, k, out = rng.choice([2, 3, 5]), rng.choice([7, 9]), rng.choice([4, 6, 11])
        run_on_workers(_mrs_case, matmul_reduce_scatter, rng.randrange(2**31), rng.choice(DTYPES), rows, k, out,
                       world_size=world, what="matmul_reduce_scatter")
    rows, k, out = rng.choice([2, 3, 5]), rng.choice([7, 9]), rng.choice([4, 6, 11])
    run_on_workers(_mrs_case, matmul_reduce_scatter, rng.randrange(2**31), rng.choice(DTYPES), rows, k, out,
                   SUBGROUP, world_size=4, what=f"matmul_reduce_scatter on a group of global ranks {list(SUBGROUP)}")


# ---------------------------------------------------------------------------------------------------------------
# zigzag_ring_attention


def block_products(log: OrderLog, batch: int, heads: int, chunk: int, head_dim: int) -> float:
    """The matrix products of attention on one rank, in units of one chunk of queries against one chunk of keys
    (its scores and its weighted sum of values: 4·B·H·c²·D flops)."""
    return sum(p["flops"] for p in log.products) / (4 * batch * heads * chunk * chunk * head_dim)


def _zz_case(zigzag_ring_attention, seed: int, dtype, batch: int, chunk: int, heads: int, head_dim: int,
             ring=None):
    from labsupport import CommCounter

    from .._common import share

    rank, world, group, members, where = _ring(ring)
    if rank is None:  # outside the ring
        share(None)
        return _stop_on_any(None)
    S = 2 * world * chunk
    label = (f"zigzag_ring_attention (seed {seed}, {world} ranks{where}, B={batch}, S={S}, H={heads}, "
             f"D={head_dim}, {str(dtype)[6:]})")
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, S, heads, head_dim, generator=gen, dtype=dtype) for _ in range(3))
    pos = torch.tensor(zigzag_positions(world, rank, chunk))
    expected = dense_causal(q, k, v)[:, pos]
    mine = [t[:, pos].clone() for t in (q, k, v)]
    kept = [t.clone() for t in mine]
    with CommCounter() as cc, OrderLog() as log:
        got, problem = _call(zigzag_ring_attention, "zigzag_ring_attention", *mine, **_group_kwargs(group))
    if problem and group is not None:
        problem = f"{label}: {problem}.{GROUP_HINT}"
    if log.refused:
        problem = (f"{label}: rank {rank} called torch.distributed.{log.refused}: pass k and v around the ring "
                   "with isend/irecv, so that no rank ever holds the whole sequence's keys and values.")
    if problem is None and not all(torch.equal(a, b) for a, b in zip(mine, kept)):
        problem = f"{label}: rank {rank}'s q, k or v was changed; leave the inputs untouched."
    if problem is None:
        hint = ("Rank r holds sequence chunks r and 2N−1−r (N ranks): a query of chunk i sees the keys of chunks "
                "before i in full and of chunk i up to itself.")
        if isinstance(got, torch.Tensor) and got.shape == expected.shape:
            wrong = _contiguous_answer(q, k, v, rank, world, chunk)
            if wrong is not None and torch.allclose(got.to(dtype), wrong.to(dtype), **tolerance(dtype)) and world > 1:
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
                       f"neighbour (global ranks {sorted(neighbours)})." + (GROUP_HINT if group is not None else ""))
        elif cc.bytes_sent != (world - 1) * kv_bytes:
            problem = (f"{label}: rank {rank} sent {cc.bytes_sent} bytes; the ring passes this rank's k and v on "
                       f"{world - 1} time(s): {(world - 1) * kv_bytes} bytes.")
    if problem is None:
        for kind in ("send", "recv"):
            for k, post in enumerate([p for p in log.posts if p["what"] == kind], start=1):
                end = math.inf if post["waited"] is None else post["waited"]
                under = [p for p in log.products if post["pos"] < p["pos"] < end]
                if post["blocking"] or not under:
                    why = ("a blocking call" if post["blocking"] else
                           "posted after the products of its step, or waited for before them")
                    problem = (f"{label}: rank {rank}'s {kind} of k/v for ring step {k} ran with no block product "
                               f"underneath it ({why}): post the next step's transfer with isend/irecv, compute "
                               "with the k/v already here, then wait.")
                    break
            if problem:
                break
    count = block_products(log, batch, heads, chunk, head_dim)
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
    return dense_causal(qz, kz, vz)[:, rank * 2 * chunk:(rank + 1) * 2 * chunk]


def check_zigzag_ring_attention(zigzag_ring_attention) -> None:
    seed = draw_seed()
    rng = random.Random(seed)
    for world in _world_sizes(rng):
        run_on_workers(_zz_case, zigzag_ring_attention, rng.randrange(2**31), rng.choice(DTYPES),
                       rng.choice([1, 2]), rng.choice([2, 3]), rng.choice([1, 2]), rng.choice([4, 5]),
                       world_size=world, what="zigzag_ring_attention")
    run_on_workers(_zz_case, zigzag_ring_attention, rng.randrange(2**31), rng.choice(DTYPES), rng.choice([1, 2]),
                   rng.choice([2, 3]), rng.choice([1, 2]), rng.choice([4, 5]), SUBGROUP, world_size=4,
                   what=f"zigzag_ring_attention on a group of global ranks {list(SUBGROUP)}")
