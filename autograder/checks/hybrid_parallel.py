"""Checks for notebook 08_hybrid_parallel: ``check_parallel_groups``, ``check_dispatch_tokens``,
``check_combine_tokens``, ``check_activation_bytes``, ``check_fits``.

* ``parallel_groups`` is compared, for many shapes drawn at grading time (up to thousands of ranks), with the layout
  rule rank = tp_rank + tp·dp_rank + tp·dp·pp_rank, and on 4 real ranks with the groups of
  ``init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))``. Group order does not matter.
* ``dispatch_tokens`` / ``combine_tokens`` run on 2, 3 and 4 ranks with random routing (uneven counts, an expert
  that receives nothing, a rank with no tokens), float32 and float64, against the single-process layer computed
  inside every worker from all ranks' inputs. ``combine_tokens`` is fed the reference dispatch, so each exercise is
  graded on its own. How: tokens cross ranks in all-to-all calls (``CommCounter``): at least the rows bound for
  other ranks, at most every row once plus a little metadata; no send/recv.
* ``activation_bytes`` and ``fits`` are compared with the formulas of Korthikanti et al. 2022 (Table 2) and of
  the ZeRO paper (Rajbhandari et al. 2020), restated here as oracles.

Probes keep the ranks in step: after every case each rank reports what it found (``all_gather_object``, outside the
counted region) and all stop together with the first rank's message. A student's exception is raised at once (the
other ranks may be waiting in a collective), and the launcher stops the rest.
"""

from __future__ import annotations

import math
import random

import torch

from ._common import draw_seed, run_on_workers, short

__all__ = ["check_parallel_groups", "check_dispatch_tokens", "check_combine_tokens", "check_activation_bytes",
           "check_fits", "reference_parallel_groups", "reference_dispatch", "reference_activation_bytes",
           "reference_fits", "moe_cases"]


# ---------------------------------------------------------------------------------------------------------------
# parallel_groups


def reference_parallel_groups(world_size: int, tp: int, pp: int) -> dict:
    """Megatron's layout: ``arange(world).view(pp, dp, tp)``; a group varies one coordinate."""
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ValueError(f"tp·pp = {tp * pp} does not divide world_size = {world_size}")
    dp = world_size // (tp * pp)
    grid = torch.arange(world_size).view(pp, dp, tp)
    return {
        "tp": grid.reshape(-1, tp).tolist(),
        "dp": grid.permute(0, 2, 1).reshape(-1, dp).tolist(),
        "pp": grid.permute(1, 2, 0).reshape(-1, pp).tolist(),
    }


def _normalise(groups, what):
    if not isinstance(groups, dict) or set(groups) != {"tp", "dp", "pp"}:
        keys = sorted(groups) if isinstance(groups, dict) else type(groups).__name__
        raise AssertionError(f"{what}: expected a dict with keys 'tp', 'dp', 'pp', got {keys}.")
    out = {}
    for dim, value in groups.items():
        try:
            out[dim] = sorted(tuple(sorted(int(r) for r in g)) for g in value)
        except TypeError:
            raise AssertionError(f"{what}: groups[{dim!r}] must be a list of rank lists, got {short(value)}.") from None
    return out


def _diagnose(got, expected, world_size, tp, pp):
    dp = world_size // (tp * pp)
    if got == expected:
        return
    hint = ""
    if pp > 1 and got["pp"] != expected["pp"] and any(g == tuple(range(g[0], g[0] + pp)) for g in got["pp"]):
        hint = " Your pipeline groups hold neighbouring ranks: pipeline is the outermost dimension (pp_rank changes slowest)."
    elif tp > 1 and dp > 1 and (got["tp"] == expected["dp"] or got["dp"] == expected["tp"]):
        hint = (" Your tensor-parallel and data-parallel groups are swapped: tensor-parallel ranks are adjacent "
                "(tp_rank is the fastest-moving coordinate), then data-parallel.")
    for dim in ("tp", "dp", "pp"):
        if got[dim] == expected[dim]:
            continue
        size = {"tp": tp, "dp": dp, "pp": pp}[dim]
        bad = [g for g in got[dim] if g not in expected[dim]]
        wrong = f"e.g. {list(bad[0])} is not one of them" if bad else "some are missing"
        raise AssertionError(
            f"parallel_groups({world_size}, tp={tp}, pp={pp})[{dim!r}]: expected {len(expected[dim])} groups of "
            f"{size} ranks {[list(g) for g in expected[dim][:4]]}{' ...' if len(expected[dim]) > 4 else ''}, "
            f"{wrong}; yours: {[list(g) for g in got[dim][:4]]}{' ...' if len(got[dim]) > 4 else ''}. "
            f"Rule: rank = tp_rank + tp·dp_rank + tp·dp·pp_rank.{hint}"
        )


def _mesh_groups(shapes):
    """On each rank: for every (tp, pp), the ranks of this rank's DeviceMesh group per dimension."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    out = []
    for tp, pp in shapes:
        mesh = init_device_mesh("cpu", (pp, world // (tp * pp), tp), mesh_dim_names=("pp", "dp", "tp"))
        out.append({d: tuple(dist.get_process_group_ranks(mesh.get_group(d))) for d in ("tp", "dp", "pp")})
    return out


def check_parallel_groups(parallel_groups):
    """Many shapes against the layout rule; ValueError when tp·pp does not divide the world; DeviceMesh on 4 ranks."""
    seed = draw_seed()
    rng = random.Random(seed)

    def call(*args):
        try:
            return parallel_groups(*args)
        except NotImplementedError:
            raise AssertionError("parallel_groups is not implemented yet (it raised NotImplementedError).") from None
        except Exception as exc:
            raise AssertionError(f"parallel_groups{args} raised {type(exc).__name__}: {exc}") from None

    shapes = [(8, 2, 2), (1, 1, 1), (4, 4, 1), (4, 1, 4), (6, 3, 1), (12, 2, 3), (16, 2, 2), (1024, 8, 8)]
    for _ in range(25):
        tp, pp, dp = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 3, 4, 5]), rng.choice([1, 2, 3, 4, 6, 16])
        shapes.append((tp * pp * dp, tp, pp))
    for world, tp, pp in shapes:
        got = _normalise(call(world, tp, pp), f"parallel_groups({world}, tp={tp}, pp={pp})")
        _diagnose(got, _normalise(reference_parallel_groups(world, tp, pp), "reference"), world, tp, pp)

    for world, tp, pp in [(8, 3, 1), (8, 1, 3), (12, 8, 1), (6, 2, 2), (16, 4, 8), (10, 4, 1)]:
        try:
            parallel_groups(world, tp, pp)
        except ValueError:
            continue
        except NotImplementedError:
            raise AssertionError("parallel_groups is not implemented yet (it raised NotImplementedError).") from None
        except Exception as exc:
            raise AssertionError(f"parallel_groups({world}, tp={tp}, pp={pp}) should raise ValueError (tp·pp = "
                                 f"{tp * pp} does not divide {world}); it raised {type(exc).__name__}: {exc}") from None
        raise AssertionError(f"parallel_groups({world}, tp={tp}, pp={pp}) should raise ValueError: tp·pp = {tp * pp} "
                             f"does not divide world_size = {world}.")

    mesh_shapes = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)]
    per_rank = run_on_workers(_mesh_groups, mesh_shapes, world_size=4, what="init_device_mesh (the oracle)")
    for i, (tp, pp) in enumerate(mesh_shapes):
        mesh = {d: sorted({r[i][d] for r in per_rank}) for d in ("tp", "dp", "pp")}
        got = _normalise(call(4, tp, pp), f"parallel_groups(4, tp={tp}, pp={pp})")
        for d in ("tp", "dp", "pp"):
            if got[d] != mesh[d]:
                raise AssertionError(
                    f"parallel_groups(4, tp={tp}, pp={pp})[{d!r}] = {[list(g) for g in got[d]]}, but "
                    f"init_device_mesh('cpu', ({pp}, {4 // (tp * pp)}, {tp}), mesh_dim_names=('pp', 'dp', 'tp')) "
                    f"makes {[list(g) for g in mesh[d]]}."
                )


# ---------------------------------------------------------------------------------------------------------------
# mixture of experts: dispatch and combine


def moe_cases(seed: int, world_size: int) -> list:
    """Inputs for every rank: a list of cases, each ``{"num_experts", "tokens": [per rank], "experts": [per rank]}``.
    Every case has an expert that receives no token; some have a rank with no tokens, or every token on one expert."""
    rng = random.Random(seed * 31 + world_size)
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for index in range(4):
        k = rng.choice([1, 2]) if index else 2
        num_experts = world_size * k
        d = rng.randint(16, 24)
        dtype = rng.choice([torch.float32, torch.float64])
        empty = rng.randrange(num_experts)
        allowed = [e for e in range(num_experts) if e != empty]
        if index == 3:
            allowed = [rng.choice(allowed)]  # every token to one expert
        tokens, experts = [], []
        idle = rng.randrange(world_size) if index in (1, 3) else None
        for r in range(world_size):
            n = 0 if r == idle else rng.randint(3, 14)
            tokens.append(torch.randn(n, d, generator=gen, dtype=torch.float64).to(dtype))
            choice = torch.randint(0, len(allowed), (n,), generator=gen)
            experts.append(torch.tensor(allowed, dtype=torch.long)[choice])
        cases.append({"num_experts": num_experts, "tokens": tokens, "experts": experts, "empty": empty})
    return cases


def reference_dispatch(tokens_per_rank, experts_per_rank, num_experts, rank):
    """What ``dispatch_tokens`` returns on ``rank``: per local expert, the rows routed to it, by source rank then
    position."""
    world = len(tokens_per_rank)
    k = num_experts // world
    return [torch.cat([t[e == rank * k + j] for t, e in zip(tokens_per_rank, experts_per_rank)])
            for j in range(k)]


def _expert_fn(e: int, x):
    """What expert ``e`` does in the checks: a narrower output that carries the expert's number."""
    width = x.shape[1] // 2 + 3
    return x[:, :width] * (e + 1) + 0.25 * e


def _agree(failure):
    """Every rank learns the first problem any rank found (rank order), or None: all stop at the same point, and
    whichever rank reports it, the message is the one that explains it."""
    import torch.distributed as dist

    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, failure)
    return next((f for f in found if f is not None), None)


_METADATA = 64  # bytes of counts a rank may exchange per peer and per expert, beyond the rows themselves


def _volume(calls, rows_bytes, remote_bytes, num_experts, world, what):
    kinds = {c.kind for c in calls}
    if kinds & {"send", "recv"}:
        return (f"{what} used send/recv: exchange the rows with one all-to-all (dist.all_to_all_single or "
                "dist.all_to_all), the collective this exercise is about.")
    moved = sum(c.nbytes for c in calls if c.kind in ("all_to_all", "all_to_all_single"))
    total = sum(c.nbytes for c in calls)
    if moved < remote_bytes:
        return (f"{what} passed {moved} B through all-to-all calls, but {remote_bytes} B of rows are bound for "
                "other ranks: the rows themselves must travel in the all-to-all.")
    allowed = rows_bytes + _METADATA * (num_experts + world)
    if total > allowed:
        return (f"{what} communicated {total} B ({sorted(kinds)}); sending every row once takes {rows_bytes} B, "
                "plus a few counts: send each row only to the rank that needs it.")
    return None


def _copy(ts):
    return [t.clone() for t in ts]


def _moe_probe(fn, seed, which):
    import torch.distributed as dist

    from labsupport import CommCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    for index, case in enumerate(moe_cases(seed, world)):
        E, tokens, experts = case["num_experts"], case["tokens"], case["experts"]
        k = E // world
        mine, route = tokens[rank].clone(), experts[rank].clone()
        owner = route // k
        failure = None
        where = (f"case {index + 1} (seed {seed}): {E} experts on {world} ranks, {len(mine)} tokens of width "
                 f"{mine.shape[1]} ({str(mine.dtype).replace('torch.', '')}) on rank {rank}, expert {case['empty']} "
                 "gets no token")
        try:
            if which == "dispatch":
                with CommCounter() as cc:
                    got = fn(mine, route, E)
                expected = reference_dispatch(tokens, experts, E, rank)
                if not isinstance(got, (list, tuple)) or len(got) != k:
                    failure = (f"dispatch_tokens should return a list of {k} tensors (one per local expert, empty "
                               f"ones included), got {short(got)}; {where}.")
                else:
                    for j, (g, x) in enumerate(zip(got, expected)):
                        e = rank * k + j
                        if not isinstance(g, torch.Tensor) or g.shape != x.shape or g.dtype != x.dtype:
                            failure = (f"item {j} (expert {e}): expected shape {tuple(x.shape)} {x.dtype}, got "
                                       f"{short(g)}; an expert with no tokens gets a (0, d) tensor; {where}.")
                        elif not torch.equal(g, x):
                            failure = (f"item {j} (expert {e}) holds the right number of rows in the wrong order or "
                                       f"with wrong values: got {short(g)}, expected {short(x)}. Rows are ordered by "
                                       f"source rank, then by position in that rank's tokens; {where}.")
                        if failure:
                            break
                rows = mine.numel() * mine.element_size()
                remote = int((owner != rank).sum()) * mine.shape[1] * mine.element_size()
                failure = failure or _volume(cc.calls, rows, remote, E, world, "dispatch_tokens")
            else:
                inputs = reference_dispatch(tokens, experts, E, rank)
                outputs = [_expert_fn(rank * k + j, x) for j, x in enumerate(inputs)]
                given = _copy(outputs)
                with CommCounter() as cc:
                    got = fn(given, route, E)
                width = mine.shape[1] // 2 + 3
                expected = torch.zeros(len(mine), width, dtype=mine.dtype)
                for i in range(len(mine)):
                    expected[i] = _expert_fn(int(route[i]), mine[i:i + 1])[0]
                if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
                    failure = (f"combine_tokens should return a ({len(mine)}, {width}) {expected.dtype} tensor (one "
                               f"row per token of this rank, the experts' width), got {short(got)}; {where}.")
                elif not torch.equal(got, expected):
                    bad = int((got != expected).any(dim=1).nonzero()[0])
                    hint = ""
                    order = torch.argsort(route, stable=True)
                    if torch.equal(got, expected[order]):
                        hint = (" Your rows are sorted by expert: put each row back at the position of its token "
                                "(the inverse of the permutation that grouped them by expert).")
                    failure = (f"row {bad} (token {bad}, routed to expert {int(route[bad])}) is "
                               f"{short(got[bad])}, expected {short(expected[bad])}.{hint} {where}.")
                rows = sum(o.numel() * o.element_size() for o in outputs)
                own_rows = sum(int(((experts[s] // k) == rank).sum()) for s in range(world) if s != rank)
                remote = own_rows * width * mine.element_size()
                failure = failure or _volume(cc.calls, rows, remote, E, world, "combine_tokens")
                if failure is None and any(not torch.equal(a, b) for a, b in zip(given, outputs)):
                    failure = f"combine_tokens changed expert_outputs in place: leave its inputs untouched; {where}."
            if failure is None and (not torch.equal(mine, tokens[rank]) or not torch.equal(route, experts[rank])):
                failure = f"{which}_tokens changed its inputs in place: leave tokens and expert_of_token untouched; {where}."
        except (NotImplementedError, AssertionError):
            raise
        except Exception as exc:
            # raise at once: the other ranks may be blocked in a collective this rank never reached, and the
            # launcher stops them when one rank fails
            raise AssertionError(f"{which}_tokens raised {type(exc).__name__}: {exc}; {where}.") from None
        first = _agree(failure)
        if first is not None:
            raise AssertionError(first)
    return True


def _check_moe(fn, which):
    seed = draw_seed()
    for world in (2, 3, 4):
        run_on_workers(_moe_probe, fn, seed, which, world_size=world, what=f"{which}_tokens", timeout=30)


def check_dispatch_tokens(dispatch_tokens):
    """On 2, 3, 4 ranks: each expert's rows, in source-rank order, sent once through all-to-all."""
    _check_moe(dispatch_tokens, "dispatch")


def check_combine_tokens(combine_tokens):
    """On 2, 3, 4 ranks: every token's expert output back at the token's position, through all-to-all."""
    _check_moe(combine_tokens, "combine")


# ---------------------------------------------------------------------------------------------------------------
# the planner


def reference_activation_bytes(seq_len, micro_batch, hidden, heads, tp=1, sequence_parallel=False, recompute="none"):
    """Korthikanti et al. 2022, Table 2: activation bytes per transformer layer per GPU (16-bit activations)."""
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    if recompute == "full":
        return 2.0 * s * b * h
    attention = 5 * a * s / (h * t) if recompute == "none" else 0.0
    if recompute not in ("none", "selective"):
        raise ValueError(recompute)
    rest = 34 / t if sequence_parallel else 10 + 24 / t
    return s * b * h * (rest + attention)


def _zero(psi, n, stage, k=12):
    return {0: (4 + k) * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n, 3: (4 + k) * psi / n}[stage]


def reference_fits(model, cluster, dp, tp, pp, zero_stage=0, micro_batch=1, recompute="none",
                   sequence_parallel=False) -> dict:
    """The memory terms of the notebook's planner."""
    psi = model.num_params / (tp * pp)
    m = model.global_batch // (dp * micro_batch)
    act = min(pp, m) * (model.num_layers / pp) * reference_activation_bytes(
        model.seq_len, micro_batch, model.hidden, model.heads, tp, sequence_parallel, recompute)
    state = _zero(psi, dp, zero_stage)
    return {"params_per_gpu": psi, "model_state": state, "activations": act, "total": state + act,
            "fits": state + act <= cluster.memory_bytes, "microbatches": m}


def _close(a, b):
    return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


def check_activation_bytes(activation_bytes):
    """Drawn shapes, t, sequence parallelism and recomputation against Table 2 of Korthikanti et al. 2022."""
    seed = draw_seed()
    rng = random.Random(seed)
    cases = [(2048, 1, 12288, 96, 8, sp, rc) for sp in (False, True) for rc in ("none", "selective", "full")]
    cases += [(2048, 1, 12288, 96, 1, False, "none")]
    for _ in range(40):
        a = rng.choice([8, 16, 32, 64, 96])
        cases.append((rng.choice([512, 1024, 2048, 4096]), rng.randint(1, 8), a * rng.choice([64, 128]), a,
                      rng.choice([1, 2, 4, 8]), rng.random() < 0.5, rng.choice(["none", "selective", "full"])))
    names = {"none": "no recomputation", "selective": "selective recomputation", "full": "full recomputation"}
    for s, b, h, a, t, sp, rc in cases:
        try:
            got = activation_bytes(s, b, h, a, tp=t, sequence_parallel=sp, recompute=rc)
        except NotImplementedError:
            raise AssertionError("activation_bytes is not implemented yet (it raised NotImplementedError).") from None
        except Exception as exc:
            raise AssertionError(f"activation_bytes(s={s}, b={b}, h={h}, a={a}, tp={t}, sequence_parallel={sp}, "
                                 f"recompute={rc!r}) raised {type(exc).__name__}: {exc}") from None
        expected = reference_activation_bytes(s, b, h, a, t, sp, rc)
        if not _close(got, expected):
            hint = {"none": "sbh(10 + 24/t + 5as/(ht)), or sbh(34/t + 5as/(ht)) with sequence parallelism",
                    "selective": "the same without the 5as/(ht) term",
                    "full": "2sbh: only each layer's input is kept"}[rc]
            ratio = f" ({got / expected:.3g}× the expected value)" if isinstance(got, (int, float)) and expected else ""
            raise AssertionError(
                f"activation_bytes(s={s}, b={b}, h={h}, a={a}, tp={t}, sequence_parallel={sp}, recompute={rc!r}) "
                f"= {short(got)}, expected {expected:.6g}{ratio}. With {names[rc]}: {hint} (Korthikanti et al. "
                "2022, Table 2). Every term but the 2sbh of full recomputation is divided among the t ranks."
            )
    try:
        activation_bytes(2048, 1, 1024, 16, recompute="sometimes")
    except ValueError:
        pass
    except Exception as exc:
        raise AssertionError(f"activation_bytes(..., recompute='sometimes') should raise ValueError, it raised "
                             f"{type(exc).__name__}: {exc}") from None
    else:
        raise AssertionError("activation_bytes(..., recompute='sometimes') should raise ValueError.")


def check_fits(fits):
    """Drawn models and layouts: the model-state (ZeRO) and activation terms, their sum, the verdict; ValueError."""
    from labsupport.lessons.hybrid_parallel import DGX_A100, GPT3_175B, NARAYANAN_TABLE1, Model

    seed = draw_seed()
    rng = random.Random(seed)
    cases = [(GPT3_175B, 1024, 16, 8, 8, 0, 1, "full", False), (GPT3_175B, 1024, 16, 8, 8, 0, 1, "none", False),
             (GPT3_175B, 1024, 16, 8, 8, 1, 1, "selective", True)]
    for row in NARAYANAN_TABLE1[:3]:
        cases.append((row["model"], row["gpus"], row["gpus"] // (row["t"] * row["p"]), row["t"], row["p"], 0, 1,
                      "full", False))
    for _ in range(30):
        a = rng.choice([16, 32, 64])
        tp, pp, dp = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8, 16])
        b = rng.choice([1, 2, 4])
        model = Model("drawn", pp * rng.randint(1, 6), a * rng.choice([64, 128]), a, rng.choice([1024, 2048]),
                      global_batch=dp * b * rng.choice([1, 2, 3, 8, 16]))
        cases.append((model, tp * pp * dp, dp, tp, pp, rng.randint(0, 3), b, rng.choice(["none", "selective", "full"]),
                      rng.random() < 0.5))
    for model, gpus, dp, tp, pp, stage, b, rc, sp in cases:
        cluster = DGX_A100(gpus)
        call = (f"fits({model.name}, {gpus} GPUs, dp={dp}, tp={tp}, pp={pp}, zero_stage={stage}, micro_batch={b}, "
                f"recompute={rc!r}, sequence_parallel={sp})")
        try:
            got = fits(model, cluster, dp, tp, pp, stage, b, rc, sequence_parallel=sp)
        except NotImplementedError:
            raise AssertionError("fits is not implemented yet (it raised NotImplementedError).") from None
        except Exception as exc:
            raise AssertionError(f"{call} raised {type(exc).__name__}: {exc}") from None
        expected = reference_fits(model, cluster, dp, tp, pp, stage, b, rc, sp)
        if not isinstance(got, dict):
            raise AssertionError(f"{call} should return a dict, got {short(got)}.")
        hints = {
            "model_state": f"ZeRO stage {stage} over dp={dp} of Ψ = num_params/(tp·pp) = {expected['params_per_gpu']:.4g} "
                           "parameters per GPU, K = 12",
            "activations": f"min(pp, m) = {min(pp, expected['microbatches'])} micro-batches in flight × "
                           f"num_layers/pp = {model.num_layers / pp:g} layers × activation_bytes(...)",
            "total": "model_state + activations",
        }
        for key in ("model_state", "activations", "total"):
            if key not in got or not _close(got[key], expected[key]):
                raise AssertionError(f"{call}[{key!r}] = {short(got.get(key))}, expected {expected[key]:.6g}: "
                                     f"{hints[key]}.")
        if got.get("fits") is not bool(expected["fits"]):
            raise AssertionError(f"{call}['fits'] = {short(got.get('fits'))}, expected {expected['fits']} (total "
                                 f"{expected['total'] / 1e9:.1f} GB against {cluster.memory_bytes / 1e9:.0f} GB).")
        step = got.get("step_time")
        if not isinstance(step, (int, float)) or isinstance(step, bool) or not (0 < step < math.inf):
            raise AssertionError(f"{call}['step_time'] should be a positive number of seconds, got {short(step)}.")
    try:
        fits(GPT3_175B, DGX_A100(1024), 8, 8, 8, 0, 1, "full")
    except ValueError:
        return
    except Exception as exc:
        raise AssertionError(f"fits with dp·tp·pp = 512 on 1024 GPUs should raise ValueError, it raised "
                             f"{type(exc).__name__}: {exc}") from None
    raise AssertionError("fits with dp·tp·pp = 512 on 1024 GPUs should raise ValueError (every GPU has one place).")
