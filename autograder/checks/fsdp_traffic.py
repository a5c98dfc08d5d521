"""Check for notebook 07_fsdp's ``traffic_per_step`` (a formula: nothing of it communicates, it runs where it is
called). ``autograder.checks.fsdp`` re-exports both names."""

from __future__ import annotations

import math
import random

from ._common import draw_seed

__all__ = ["check_traffic_per_step", "expected_traffic"]


def expected_traffic(strategy: str, num_params: int, world_size: int, shard_size=None) -> float:
    """Parameters' worth of data each rank sends per step with ring collectives (see the notebook)."""
    n = world_size
    if strategy in ("ddp", "zero2"):
        return 2 * (n - 1) / n * num_params
    if strategy == "fsdp":
        return 3 * (n - 1) / n * num_params
    if strategy == "hsdp":
        s = shard_size
        r = n // s
        return 3 * (s - 1) / s * num_params + 2 * (r - 1) / r * num_params / s
    raise ValueError(strategy)


def check_traffic_per_step(traffic_per_step) -> None:
    """traffic_per_step for ddp, zero2, fsdp and hsdp on drawn sizes (one rank, 1 and N shard groups included);
    ValueError for an unknown strategy, an hsdp without a shard size, and one that does not divide the world size."""
    rng = random.Random(draw_seed())
    cases = [("ddp", 1, None), ("fsdp", 1, None), ("zero2", 4, None), ("hsdp", 8, 8), ("hsdp", 8, 1), ("hsdp", 16, 4),
             ("hsdp", 6, 2)]
    for _ in range(12):
        n = rng.choice([2, 3, 4, 6, 8, 16, 64])
        strategy = rng.choice(["ddp", "zero2", "fsdp", "hsdp"])
        s = rng.choice([d for d in range(1, n + 1) if n % d == 0]) if strategy == "hsdp" else None
        cases.append((strategy, n, s))
    for strategy, n, s in cases:
        psi = rng.choice([1000, 7_500_000_000, 123_457])
        args = (strategy, psi, n) + ((s,) if s is not None else ())
        try:
            got = traffic_per_step(*args)
        except NotImplementedError:
            raise
        except Exception as exc:
            raise AssertionError(f"traffic_per_step{args} raised {type(exc).__name__}: {exc}") from None
        want = expected_traffic(strategy, psi, n, s)
        if not isinstance(got, (int, float)) or not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9):
            hints = {
                "ddp": " = 2(N-1)/N·Ψ: a ring all-reduce of the gradients sends 2(N-1)/N of them per rank",
                "zero2": " = 2(N-1)/N·Ψ, like DDP: a reduce-scatter of the gradients and an all-gather of the updated "
                         "parameters, (N-1)/N·Ψ each",
                "fsdp": " = 3(N-1)/N·Ψ: an all-gather of the parameters in forward and again in backward, a "
                        "reduce-scatter of the gradients",
                "hsdp": f" = 3(S-1)/S·Ψ inside the shard group + 2(R-1)/R·Ψ/S across the R = {n // s} replicas (each "
                        "rank all-reduces only its shard's gradient)" if s else "",
            }
            raise AssertionError(f"traffic_per_step{args} returned {got!r}, expected {want:.6g}{hints[strategy]}.")
    for bad in (("tp", 100, 4), ("hsdp", 100, 6, 4), ("hsdp", 100, 4, 3), ("hsdp", 100, 4)):
        try:
            traffic_per_step(*bad)
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as exc:
            raise AssertionError(f"traffic_per_step{bad} raised {type(exc).__name__}, expected ValueError.") from None
        raise AssertionError(f"traffic_per_step{bad} returned without a ValueError: "
                             + ("unknown strategy." if bad[0] == "tp" else "hsdp needs a shard_size." if len(bad) == 3
                                else "the shard size must divide the world size."))
