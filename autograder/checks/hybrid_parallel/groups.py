"""``check_parallel_groups``: the layout rule rank = tp_rank + tp·dp_rank + tp·dp·pp_rank as the reference, and the
groups of ``init_device_mesh`` on 4 real ranks.
"""

from __future__ import annotations

import random

import torch

from .._common import draw_seed, run_on_workers, short


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
            raise AssertionError("parallel_groups is not started: it still raises NotImplementedError.") from None
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
            raise AssertionError("parallel_groups is not started: it still raises NotImplementedError.") from None
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
