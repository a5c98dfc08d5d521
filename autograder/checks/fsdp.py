"""Checks for notebook 07_fsdp: ``check_MiniFSDP``, ``check_traffic_per_step``.

``check_MiniFSDP`` builds ``ProbeNet`` on every rank from the same seed: four children of uneven sizes (a nested
``Sequential``, a ``LayerNorm`` whose bias is frozen, a child without parameters that is no unit) and a parameter
of the root's own, with sizes drawn so that several units do not divide by the world size (the padding path). It
wraps the model in the student's ``MiniFSDP`` on 2, 3 and 4 ranks, trains a few steps with SGD and momentum, each
rank on its slice of every batch, and compares with the oracle: the same model trained in one process on the whole
batch (fp32, tight tolerance). The shards are compared element by element with the layout the notebook states
(unit flats in ``parameters()`` order, each the concatenation of the unit's parameters, zero-padded to a multiple of
N, rank r holding the r-th equal slice).

How the result was obtained is measured, never taken from the student's bookkeeping:

* memory between steps: a census of every tensor storage and Python buffer alive in the worker
  (``autograder.checks._memory``), taken before the model is made, after construction and after the first step,
  gives what a rank keeps wherever it keeps it (the check holds no reference to the model's parameters, nor to the
  shards beyond what ``parameters()`` returns and its optimizer's state); it must be its shards only (about
  total/N). After later steps, the storages reachable from the wrapper are measured (a cheaper walk);
* memory during the step: ``labsupport.lessons.fsdp.ParamMemory`` adds up, at every ATen operation of forward and
  backward, the distinct storages reachable from the wrapper (modules, attributes, containers, hook closures) plus
  the parameter storages autograd saved for backward: at most the shards plus the root's unit plus the largest child
  unit (plus the second largest when the optional ``prefetch=True`` is offered and used). (A census at every
  operation would cost too much; a copy kept out of the wrapper's reach during the step is not seen there, and one
  kept until the step ends is seen by the census.)
* communication: ``CommCounter`` around forward and backward: two all-gathers per unit (one may be saved, for a
  unit kept gathered from its forward into its backward), one reduce-scatter per unit with trainable parameters,
  no all-reduce.

Probes keep the ranks in step: every phase ends with every rank reporting whether it found a problem, so a wrong
answer never turns into a deadlock.
"""

from __future__ import annotations

import inspect
import math
import random

import torch
import torch.nn as nn

from ._common import call_student as _call, draw_seed, run_on_workers, short, tolerance
from ._memory import MemoryWatch, fmt_bytes

__all__ = ["check_MiniFSDP", "check_traffic_per_step", "ProbeNet", "expected_traffic", "unit_layout"]

LR, MOMENTUM, STEPS = 0.05, 0.9, 3
SLACK = 64  # bytes a wrapper may hold beyond the bound (a scalar or two of bookkeeping)
GATHER = {"all_gather", "all_gather_into_tensor"}
SCATTER = {"reduce_scatter", "reduce_scatter_tensor"}


class ProbeNet(nn.Module):
    """Units (direct children with parameters, in order): ``embed``, ``body`` (a nested Sequential, the largest),
    ``norm`` (its bias frozen), ``head``; ``act`` has no parameters; the root's own parameter is ``scale``."""

    def __init__(self, d_in: int, h1: int, h2: int, d_out: int):
        super().__init__()
        self.embed = nn.Linear(d_in, h1)
        self.body = nn.Sequential(nn.Linear(h1, h2), nn.Tanh(), nn.Linear(h2, h1))
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(h1)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.normal_()
        self.norm.bias.requires_grad_(False)
        self.head = nn.Linear(h1, d_out)
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(d_out))

    def forward(self, x):
        h = torch.tanh(self.embed(x))  # (B, h1)
        h = h + self.body(h)           # a residual: embed's output is used twice
        return self.head(self.norm(self.act(h))) * self.scale  # (B, d_out)


def _sizes(seed: int):
    """Layer sizes for which several units do not divide by 2, 3 and 4 (the padding path for every N)."""
    rng = random.Random(seed)
    while True:
        sizes = (rng.randint(3, 7), rng.randint(5, 11), rng.randint(9, 17), rng.randint(2, 5))
        numels = [u[1] for u in unit_layout(ProbeNet(*sizes))]
        if all(sum(n % w != 0 for n in numels) >= 2 for w in (2, 3, 4)):
            return sizes


def _make_model(seed: int) -> ProbeNet:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return ProbeNet(*_sizes(seed))


def unit_layout(module: nn.Module):
    """``[(unit name, numel, [(param name, Parameter), ...]), ...]``: each direct child with parameters in order,
    then the root's own parameters (unit name ``""``); every parameter in ``named_parameters`` order."""
    units = []
    for cname, child in module.named_children():
        params = [(f"{cname}.{n}", p) for n, p in child.named_parameters()]
        if params:
            units.append((cname, sum(p.numel() for _, p in params), params))
    own = [(n, p) for n, p in module._parameters.items() if p is not None]
    if own:
        units.append(("", sum(p.numel() for _, p in own), own))
    return units


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for _, p in params])


def _oracle_flats(seed: int, steps: int, rows: int):
    """Per step (0 = before training), each unit's flat parameter after training on the whole batch in one
    process; and the data."""
    model = _make_model(seed)
    gen = torch.Generator().manual_seed(seed + 11)
    d_in, d_out = model.embed.in_features, model.head.out_features
    X, Y = torch.randn(steps, rows, d_in, generator=gen), torch.randn(steps, rows, d_out, generator=gen)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=MOMENTUM)
    flats = [[_flat(params) for _, _, params in unit_layout(model)]]
    for s in range(steps):
        ((model(X[s]) - Y[s]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        flats.append([_flat(params) for _, _, params in unit_layout(model)])
    return flats, X, Y


# ---------------------------------------------------------------------------------------------------------------
# on the workers


def _agree(failure) -> str | None:
    """Every rank learns every rank's problem; all return the first one (so all stop at the same point)."""
    import torch.distributed as dist

    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, failure)
    return next((f if r == dist.get_rank() else f"{f} (seen on rank {r})" for r, f in enumerate(found) if f), None)


def _shards_failure(shards, units, world: int, rank: int, expected_flats) -> str | None:
    """Layout of the shards: one per unit, 1-D, ceil(numel/N) elements, this rank's slice of the padded flat."""
    names = [name or "the root's own parameters" for name, _, _ in units]
    if len(shards) != len(units):
        return (f"MiniFSDP.parameters() yielded {len(shards)} tensor(s), expected {len(units)}: one flat shard per "
                f"unit ({', '.join(names)}), in that order (children in registration order, the root's own last). "
                "Full-size parameters must not remain: the module's parameters are replaced by the shards.")
    for k, (shard, (uname, numel, params), flat) in enumerate(zip(shards, units, expected_flats)):
        chunk = math.ceil(numel / world)
        if not isinstance(shard, torch.Tensor) or shard.dim() != 1 or shard.numel() != chunk:
            got = tuple(shard.shape) if isinstance(shard, torch.Tensor) else type(shard).__name__
            return (f"shard {k} (unit {names[k]}, {numel} values) has shape {got}, expected ({chunk},) = "
                    f"ceil({numel} / {world}): every rank's shard has the same length, so pad the flat parameter "
                    f"with zeros to a multiple of the world size ({chunk * world}) before slicing it.")
        padded = torch.cat([flat, flat.new_zeros(chunk * world - numel)])
        expected = padded[rank * chunk:(rank + 1) * chunk]
        if shard.dtype != expected.dtype or not torch.allclose(shard.detach(), expected, **tolerance(expected.dtype)):
            return (f"shard {k} (unit {names[k]}) on rank {rank} is {short(shard)}, expected {short(expected)}: "
                    f"slice {rank} of the zero-padded concatenation of {', '.join(n for n, _ in params)} "
                    "(each flattened, in named_parameters() order).")
        if any(p.requires_grad for _, p in params) and not shard.requires_grad:
            return f"shard {k} (unit {names[k]}) does not require grad: the optimizer could never update it."
    return None


def _comm_failure(calls, units, step: int) -> str | None:
    n_units = len(units)
    n_trainable = sum(any(p.requires_grad for _, p in params) for _, _, params in units)
    kinds = [c.kind for c in calls]
    reduced = [c for c in calls if c.kind == "all_reduce" and c.nbytes > 8]
    if reduced:
        return (f"step {step}: {len(reduced)} all_reduce call(s) of {sum(c.nbytes for c in reduced)} bytes during "
                "forward and backward. A rank needs only its own shard of the summed gradient: reduce-scatter the "
                "unit's flat gradient (half the traffic of an all-reduce) and keep no full gradient.")
    gathers, scatters = sum(k in GATHER for k in kinds), sum(k in SCATTER for k in kinds)
    if not 2 * n_units - 1 <= gathers <= 2 * n_units:
        return (f"step {step}: {gathers} all-gather call(s) in forward and backward, expected {2 * n_units} (two per "
                f"unit, {n_units} units): gather a unit before its forward, free it after, and gather it again "
                "before its backward." + (" Fewer means the full parameters were kept from forward to backward."
                                          if gathers < 2 * n_units - 1 else ""))
    if not n_trainable <= scatters <= n_units:
        return (f"step {step}: {scatters} reduce-scatter call(s), expected {n_trainable} (one per unit with "
                "trainable parameters, once its gradient is complete).")
    return None


def _param_hint(got, expected, before, world: int) -> str:
    """What a wrong step looks like: N times too large (not averaged), no change, or something else."""
    moved, wanted = got - before, expected - before
    norm = float(wanted.pow(2).sum())
    if norm > 0:
        ratio = float((moved * wanted).sum()) / norm
        if abs(ratio - world) < 0.05 * world:
            return (f" The update is {world}x the expected one: the reduce-scattered gradient is a sum over the "
                    f"{world} ranks; divide it by the world size (the average).")
        if abs(ratio) < 1e-3:
            return " The parameters did not move: does the optimizer step on the shards, and do they get a .grad?"
    return ""


def _probe(MiniFSDP, seed: int, steps: int, rows: int, flats, X, Y, kwargs: dict, extra_units: int):
    import torch.distributed as dist

    from labsupport import CommCounter
    from labsupport.lessons.fsdp import ParamMemory

    rank, world = dist.get_rank(), dist.get_world_size()
    units = unit_layout(_make_model(seed))  # the layout, from a copy of the check's own (never given to MiniFSDP)
    label = "MiniFSDP" + (f"(..., {', '.join(f'{k}={v!r}' for k, v in kwargs.items())})" if kwargs else "")
    names = [name or "root" for name, _, _ in units]
    chunks = [math.ceil(n / world) for _, n, _ in units]
    shard_bytes = 4 * sum(chunks)
    child_bytes = sorted((4 * c * world for (name, _, _), c in zip(units, chunks) if name), reverse=True)
    root_bytes = sum(4 * c * world for (name, _, _), c in zip(units, chunks) if not name)
    bound = shard_bytes + root_bytes + sum(child_bytes[:1 + extra_units])
    # The model is made after the baseline of the census and the check keeps no reference to its parameters, so
    # every byte of it still alive later is kept by the wrapper, wherever it keeps it.
    watch = MemoryWatch()
    model = _make_model(seed)
    children = {name: getattr(model, name) for name, _, _ in units if name}

    wrapped = _call(f"{label} (the constructor)", MiniFSDP, model, **kwargs)
    model = None
    shards = list(_call(f"{label}.parameters()", wrapped.parameters))
    failure = _shards_failure(shards, units, world, rank, flats[0])
    if failure is None:
        failure = _kept_failure(watch.kept(), wrapped, shard_bytes, rank, world, "after construction",
                                "Keep no full-size parameter (nor a reference to one).")
    if (failure := _agree(failure)) is not None:
        return failure
    opt = torch.optim.SGD(shards, lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        x, y = X[step].chunk(world)[rank], Y[step].chunk(world)[rank]
        mem = ParamMemory(wrapped, units=children)
        failure = None
        try:
            with CommCounter() as cc, mem:
                out = _call(f"{label}: forward", wrapped, x)
                _call(f"{label}: backward", ((out - y) ** 2).mean().backward)
        except AssertionError as exc:
            failure = f"step {step}: {exc}"
        if failure is None:
            failure = _comm_failure(cc.calls, units, step)
        if failure is None and mem.peak > bound + SLACK:
            phase, op = next((ph, o) for ph, o, b in mem.samples if b == mem.peak)
            parts = f"shards {shard_bytes} + largest unit {child_bytes[0]}" + (
                f" + second largest {child_bytes[1]} (prefetching)" if extra_units else "") + (
                f" + root's own {root_bytes}" if root_bytes else "")
            failure = (f"step {step}: rank {rank} held {mem.peak} bytes of parameters at once (during '{phase}', "
                       f"at {op}), above the bound {bound} = {parts}. Free each unit's gathered parameters right after "
                       "its forward and again after its backward; note that autograd keeps views of the gathered "
                       "flat for backward, so dropping your own references does not free it (free its storage: "
                       "untyped_storage().resize_(0), and gather into it again before backward).")
        if (failure := _agree(failure)) is not None:
            return failure
        opt.step()
        opt.zero_grad()
        out = None
        if step == 0:
            known = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
            failure = _kept_failure(watch.kept(known), wrapped, shard_bytes, rank, world, f"after step {step}",
                                    "Free every gathered unit after its backward.")
            watch.close()
        elif ParamMemory(wrapped).measure() > shard_bytes + SLACK:  # later steps: what the wrapper holds
            failure = _kept_failure(None, wrapped, shard_bytes, rank, world, f"after step {step}",
                                    "Free every gathered unit after its backward.")
        if failure is None:
            gathered = []
            for k, shard in enumerate(shards):
                parts = [torch.empty_like(shard.detach()) for _ in range(world)]
                dist.all_gather(parts, shard.detach().contiguous())
                gathered.append(torch.cat(parts)[:units[k][1]])
            for k, (got, want) in enumerate(zip(gathered, flats[step + 1])):
                if not torch.allclose(got, want, **tolerance(want.dtype)):
                    offset = 0
                    for pname, p in units[k][2]:
                        g, w = got[offset:offset + p.numel()], want[offset:offset + p.numel()]
                        if not torch.allclose(g, w, **tolerance(w.dtype)):
                            frozen = "" if p.requires_grad else " This parameter is frozen: it must not change."
                            failure = (f"after step {step}, {pname} (unit {names[k]}) is {short(g)}, expected "
                                       f"{short(w)} (one process trained on the whole batch).{frozen}"
                                       + _param_hint(g, w, flats[step][k][offset:offset + p.numel()], world))
                            break
                        offset += p.numel()
                    break
        if (failure := _agree(failure)) is not None:
            return failure
    return None


def _kept_failure(kept, wrapped, shard_bytes: int, rank: int, world: int, when: str, advice: str):
    """Decided by ``kept``, the census of every storage this rank keeps alive beyond the check's own (see
    ``autograder.checks._memory``); without one (later steps), by what is reachable from the wrapper. The wrapper's
    reachable tensors name the likely culprit in the message."""
    from labsupport.lessons.fsdp import ParamMemory

    held = ParamMemory(wrapped).measure()
    if kept is not None and kept.total <= shard_bytes + SLACK:
        return None
    if held > shard_bytes + SLACK:
        where = ", ".join(f"{p} {n} B" for p, n in ParamMemory(wrapped).where()[:4])
        return (f"{when} rank {rank} holds {held} bytes of parameters, expected its shards only: {shard_bytes} "
                f"bytes (total/{world} plus padding). Largest tensors reachable from the wrapper: {where}. {advice}")
    if kept is None:
        return None
    return (f"{when} rank {rank} keeps {fmt_bytes(kept.total)} of tensors alive, {fmt_bytes(kept.total - shard_bytes)} "
            f"beyond its shards ({fmt_bytes(SLACK)} allowed): full-size parameters (or copies of them) are still held "
            f"somewhere (a class attribute, a global, a closure, a list) — keep only this rank's shards. Largest: "
            f"{kept.largest()}. {advice}")


def _guarded(body, *args):
    """Run a probe body; an AssertionError becomes the rank's failure message, agreed on with the other ranks."""
    try:
        return body(*args)
    except AssertionError as exc:
        failure = str(exc)
    return _agree(failure)


def check_MiniFSDP(MiniFSDP) -> None:
    """On 2, 3 and 4 ranks: shards laid out and padded as stated; a few SGD steps equal one-process training on the
    whole batch (a frozen parameter stays put); two all-gathers per unit and one reduce-scatter per trainable unit
    per step, no all-reduce; a rank keeps total/N of the parameters between steps and never materialises more than
    the shards plus the largest unit (plus the root's own)."""
    seed = draw_seed()
    configs = [(2, {}, 0), (3, {}, 0), (4, {}, 0)]
    if "prefetch" in inspect.signature(MiniFSDP).parameters:
        configs.append((3, {"prefetch": True}, 1))  # the stretch: graded when offered
    for world_size, kwargs, extra in configs:
        rows = 4 * world_size
        flats, X, Y = _oracle_flats(seed, STEPS, rows)
        results = run_on_workers(_guarded, _probe, MiniFSDP, seed, STEPS, rows, flats, X, Y, kwargs, extra,
                                 world_size=world_size, what="MiniFSDP", timeout=60)
        failure = next((f for f in results if f), None)
        if failure:
            raise AssertionError(f"{failure} (world_size={world_size}, seed {seed})")


# ---------------------------------------------------------------------------------------------------------------
# traffic_per_step


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
