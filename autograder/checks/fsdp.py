"""Checks for notebook 07_fsdp: ``check_MiniFSDP``, ``check_traffic_per_step``.

``check_MiniFSDP`` builds ``ProbeNet`` (``fsdp_drivers``) on every rank from the same seed: four children of uneven
sizes (a nested ``Sequential``, a ``LayerNorm`` whose bias is frozen, a child without parameters that is no unit)
and a parameter of the root's own, with sizes drawn so that several units do not divide by the world size (the
padding path). It wraps the model in the student's ``MiniFSDP`` on 2, 3 and 4 ranks, trains a few steps with SGD
and momentum, each rank on its slice of every batch, and compares with the oracle: the same model trained in one
process on the whole batch (fp32, tight tolerance). The shards are compared element by element with the layout the
notebook states (unit flats in ``parameters()`` order, each the concatenation of the unit's parameters,
zero-padded to a multiple of N, rank r holding the r-th equal slice).

The student's class runs in grading's sandbox (``in_sandbox(..., driver=fsdp_drivers.scene)``), one call per
phase (construction, then each step). Everything that decides is the host's, never the answer's bookkeeping:

* values: each rank's shards, returned as plain tensors, against the host's own oracle;
* communication: the host's record of what the sandbox asked it to carry (``labsupport._sandbox.record``: kinds
  as the sandbox called them) and the bytes its own calls moved (the tap, in the host). Only all-gathers and
  reduce-scatters are carried (``allow``); per step two all-gathers per unit (one may be saved, for a unit kept
  gathered from its forward into its backward) moving at least the shards' bytes twice over (less that unit's),
  and one reduce-scatter per unit with trainable parameters moving at least the trainable units' padded bytes;
* memory, on the larger model (some 12 MiB of parameters, units of comparable size): the sandbox's anonymous
  resident memory, read from ``/proc`` by the host. The sandbox is started afresh, warmed up without any student
  code and given the answer's definitions (its baseline); after construction, and after each step while the
  sandbox waits idle, it may keep its shards, the optimizer's momentum and the plain copy of what it returned last
  (half the model allowed for noise: a copy of the model, wherever it is kept, is far above); and at every
  all-gather of a forward, what it holds beyond what it held before the step is at most the root's own unit plus
  the largest unit (plus the second largest when prefetching; an eighth of the model for noise).

Probes keep the ranks in step: every phase ends with every rank reporting whether it found a problem, so a wrong
answer never turns into a deadlock.
"""

from __future__ import annotations

import inspect
import math
import re

import torch

from ._common import draw_seed, in_sandbox, run_on_workers, short, tolerance
from ._host import fmt_bytes
from .fsdp_drivers import LR, MOMENTUM, ProbeNet, draw_sizes, make_data, make_model, ping, scene, unit_layout
from .fsdp_traffic import check_traffic_per_step, expected_traffic

__all__ = ["check_MiniFSDP", "check_traffic_per_step", "ProbeNet", "expected_traffic", "unit_layout"]

STEPS = 3
GATHER = {"all_gather", "all_gather_into_tensor"}
SCATTER = {"reduce_scatter", "reduce_scatter_tensor"}
#: what the exercise may ask the host to carry (as the sandbox names its requests)
ALLOWED = {"all_gather", "reduce_scatter"}
#: of the model's bytes, what the sandbox's resident memory may vary by beyond what it should hold: idle between
#: calls (measured: under an eighth; a copy of the model is twice the allowance), and at an all-gather of a forward
#: (measured: the shard being sent; the units kept gathered by a wrapper that never frees are above)
NOISE_KEPT, NOISE_FORWARD = 1 / 2, 1 / 8


def _make_model(seed: int, big: bool = False) -> ProbeNet:
    return make_model(seed, draw_sizes(seed, big))


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for _, p in params])


def _oracle_flats(seed: int, sizes, steps: int, rows: int):
    """Per step (0 = before training), each unit's flat parameter after training on the whole batch in one
    process."""
    model = make_model(seed, sizes)
    X, Y = make_data(seed, sizes, steps, rows)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=MOMENTUM)
    flats = [[_flat(params) for _, _, params in unit_layout(model)]]
    for s in range(steps):
        ((model(X[s]) - Y[s]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        flats.append([_flat(params) for _, _, params in unit_layout(model)])
    return flats


# ---------------------------------------------------------------------------------------------------------------
# on the workers (the host: the student's class runs in the sandbox)


def _agree(failure) -> str | None:
    """Every rank learns every rank's problem; all return the first one (so all stop at the same point)."""
    import torch.distributed as dist

    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, failure)
    return next((f if r == dist.get_rank() else f"{f} (seen on rank {r})" for r, f in enumerate(found) if f), None)


class _Carried:
    """A tap observer of the host: every communication call the host makes for the sandbox, with its bytes and the
    sandbox's resident size when the request arrived (read from ``/proc``). ``kinds()`` names them as the sandbox
    asked for them (the host's record), where a sandbox carried them."""

    nested = True

    def __init__(self):
        from labsupport import _sandbox

        self.sandbox, self.calls = _sandbox, []
        self.first = len(_sandbox.record())

    def enter(self, call):
        if call.is_comm and not call.in_comm:
            self.calls.append([call.kind, call.nbytes, _rss()])

    def exit(self, call):
        pass

    def __enter__(self):
        from labsupport import tap

        tap.subscribe(self)
        return self

    def __exit__(self, *exc):
        from labsupport import tap

        tap.unsubscribe(self)

    def kinds(self) -> list:
        asked = [entry[0] for entry in self.sandbox.record()[self.first:]]
        return asked if len(asked) == len(self.calls) else [kind for kind, _, _ in self.calls]


def _refused(exc) -> str:
    """The message of a failure inside the student's call; a refused collective explained for this exercise."""
    text = str(exc)
    found = re.match(r"\S+ called torch\.distributed\.(\w+) on rank (\d+):", text)
    return _other_collective(found[1], found[2]) if found and "after it returned" not in text else text


def _other_collective(kind: str, rank) -> str:
    return (f"MiniFSDP called torch.distributed.{kind} on rank {rank}: FSDP moves parameters with all-gathers and "
            "gradients with reduce-scatters, nothing else (no all_reduce, reduce, broadcast or point-to-point). A "
            "rank needs only its own shard of the summed gradient: reduce-scatter the unit's flat gradient (half the "
            "traffic of an all-reduce) and keep no full gradient.")


def _shards_failure(shards, units, world: int, rank: int, expected_flats) -> str | None:
    """Layout of the shards: one per unit, 1-D, ceil(numel/N) elements, this rank's slice of the padded flat."""
    names = [name or "the root's own parameters" for name, _, _ in units]
    if not isinstance(shards, list) or len(shards) != len(units):
        got = len(shards) if isinstance(shards, list) else 0
        return (f"MiniFSDP.parameters() yielded {got} tensor(s), expected {len(units)}: one flat shard per "
                f"unit ({', '.join(names)}), in that order (children in registration order, the root's own last). "
                "Full-size parameters must not remain: the module's parameters are replaced by the shards.")
    for k, (shard, (uname, numel, params), flat) in enumerate(zip(shards, units, expected_flats)):
        chunk = math.ceil(numel / world)
        if not isinstance(shard, torch.Tensor) or shard.dim() != 1 or shard.numel() != chunk:
            got = tuple(shard.shape) if isinstance(shard, torch.Tensor) else type(shard).__name__
            return (f"shard {k} (unit {names[k]}, {numel} values) has shape {got}, expected ({chunk},) = "
                    f"ceil({numel} / {world}): every rank's shard has the same length, so pad the flat parameter "
                    f"with zeros to a multiple of the world size ({chunk * world}) before slicing it.")
        expected = _slice(flat, chunk, world, rank)
        if shard.dtype != expected.dtype or not torch.allclose(shard.detach(), expected, **tolerance(expected.dtype)):
            return (f"shard {k} (unit {names[k]}) on rank {rank} is {short(shard)}, expected {short(expected)}: "
                    f"slice {rank} of the zero-padded concatenation of {', '.join(n for n, _ in params)} "
                    "(each flattened, in named_parameters() order).")
        if any(p.requires_grad for _, p in params) and not shard.requires_grad:
            return f"shard {k} (unit {names[k]}) does not require grad: the optimizer could never update it."
    return None


def _slice(flat, chunk: int, world: int, rank: int):
    return torch.cat([flat, flat.new_zeros(chunk * world - flat.numel())])[rank * chunk:(rank + 1) * chunk]


def _values_failure(shards, units, world: int, rank: int, flats, step: int) -> str | None:
    """This rank's shards after ``step`` against its slices of the oracle's flats; the parameter that differs."""
    for k, (got, (uname, numel, params)) in enumerate(zip(shards, units)):
        chunk = math.ceil(numel / world)
        want, before = (_slice(f[k], chunk, world, rank) for f in (flats[step + 1], flats[step]))
        if torch.allclose(got, want, **tolerance(want.dtype)):
            continue
        bad = int((~torch.isclose(got, want, **tolerance(want.dtype))).nonzero()[0]) + rank * chunk
        offset = 0
        for pname, p in params:
            if offset + p.numel() > bad:
                break
            offset += p.numel()
        lo, hi = max(offset, rank * chunk) - rank * chunk, min(offset + p.numel(), (rank + 1) * chunk) - rank * chunk
        frozen = "" if p.requires_grad else " This parameter is frozen: it must not change."
        return (f"after step {step}, {pname} (unit {uname or 'root'}) is {short(got[lo:hi])} on rank {rank}, "
                f"expected {short(want[lo:hi])} (one process trained on the whole batch).{frozen}"
                + _param_hint(got[lo:hi], want[lo:hi], before[lo:hi], world))
    return None


def _traffic_failure(kinds, nbytes, units, world: int, step: int, rank: int) -> str | None:
    """Calls and bytes of one step, from the host's record (``nbytes``: what the host's own calls moved). (In a
    sandbox ``allow`` refuses other collectives before they go out; without one they show here.)"""
    other = next((k for k in kinds if k not in GATHER | SCATTER), None)
    if other is not None:
        return f"step {step}: {_other_collective(other, rank)}"
    n_units = len(units)
    trainable = [any(p.requires_grad for _, p in params) for _, _, params in units]
    shard_bytes = [4 * math.ceil(n / world) for _, n, _ in units]
    gathers = [b for k, b in zip(kinds, nbytes) if k in GATHER]
    scatters = [b for k, b in zip(kinds, nbytes) if k in SCATTER]
    if not 2 * n_units - 1 <= len(gathers) <= 2 * n_units:
        return (f"step {step}: {len(gathers)} all-gather call(s) in forward and backward, expected {2 * n_units} "
                f"(two per unit, {n_units} units): gather a unit before its forward, free it after, and gather it "
                "again before its backward." + (" Fewer means the full parameters were kept from forward to "
                                                "backward." if len(gathers) < 2 * n_units - 1 else ""))
    need = 2 * sum(shard_bytes) - max(shard_bytes)
    if sum(gathers) < need:
        return (f"step {step}: the all-gathers carried {sum(gathers)} bytes from this rank, but gathering every unit "
                f"before its forward and again before its backward sends its shards twice: at least {need} bytes "
                f"(the shards are {sum(shard_bytes)} bytes). The full parameters must come from the shards, gathered "
                "again at every step, not from a copy kept between steps.")
    if not sum(trainable) <= len(scatters) <= n_units:
        return (f"step {step}: {len(scatters)} reduce-scatter call(s), expected {sum(trainable)} (one per unit with "
                "trainable parameters, once its gradient is complete).")
    need = sum(world * b for b, t in zip(shard_bytes, trainable) if t)
    if sum(scatters) < need:
        return (f"step {step}: the reduce-scatters carried {sum(scatters)} bytes from this rank, expected at least "
                f"{need}: each unit's whole (padded) flat gradient, summed over the ranks and cut into shards.")
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


def _rss():
    """The sandbox's anonymous and shared resident memory (bytes), read from ``/proc`` by the host: what tensors,
    arrays and Python objects occupy (its pages of program files, loaded as code runs, are left out); None without
    a sandbox."""
    from labsupport import _sandbox

    memory = _sandbox.memory()
    return None if memory is None else memory["data"]


def _since(base):
    now = _rss()
    return None if now is None or base is None else now - base


def _kept_failure(kept, allowed: int, margin: float, rank: int, world: int, when: str, advice: str) -> str | None:
    if kept is None or kept <= allowed + margin:
        return None
    return (f"{when} rank {rank}'s process keeps {fmt_bytes(kept)} more than before the model was made, "
            f"{fmt_bytes(kept - allowed)} beyond its shards ({fmt_bytes(allowed)} with their optimizer state and "
            f"the copy it returned, total/{world} plus padding each; {fmt_bytes(margin)} allowed for noise), as the "
            "kernel counts its memory: expected its shards only. Full-size parameters (or copies of them) are still "
            "held somewhere (an attribute, a class attribute, a global, a closure, a list, another library's buffer). "
            f"{advice}")


def _forward_failure(carried, kinds, before, allowed: int, margin: float, rank: int, step: int, parts: str):
    """At each all-gather of the forward (the calls before the first reduce-scatter), what the sandbox holds beyond
    what it held before the step."""
    for i, ((_, _, rss), kind) in enumerate(zip(carried.calls, kinds)):
        if kind in SCATTER:
            break
        if kind in GATHER and None not in (rss, before) and rss - before > allowed + margin:
            return (f"step {step}: during forward, at all-gather {i + 1}, rank {rank}'s process held "
                    f"{fmt_bytes(rss - before)} more than before the step: parameters held at once beyond the bound "
                    f"{fmt_bytes(allowed)} = {parts} ({fmt_bytes(margin)} allowed for noise). Free each unit's "
                    "gathered parameters right after its forward and again after its backward; note that autograd "
                    "keeps views of the gathered flat for backward, so dropping your own references does not free "
                    "it (free its storage: untyped_storage().resize_(0), and gather into it again before backward).")
    return None


def _probe(fn, start, seed: int, big: bool, rows: int, kwargs: dict, extra_units: int):
    import torch.distributed as dist

    from labsupport import _sandbox

    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = draw_sizes(seed, big)
    units = unit_layout(make_model(seed, sizes))
    flats = _oracle_flats(seed, sizes, STEPS, rows)
    padded = [4 * math.ceil(n / world) * world for _, n, _ in units]
    shard_bytes, model_bytes = sum(padded) // world, sum(4 * n for _, n, _ in units)
    children = sorted((b for (name, _, _), b in zip(units, padded) if name), reverse=True)
    root = sum(b for (name, _, _), b in zip(units, padded) if not name)
    in_forward = root + sum(children[:1 + extra_units])
    parts = (f"the root's own {fmt_bytes(root)} + the largest unit {fmt_bytes(children[0])}"
             + (f" + the second largest {fmt_bytes(children[1])} (prefetching)" if extra_units else ""))
    _sandbox.close()  # a fresh sandbox, without any student code run yet: its resident memory is the baseline
    start()
    fn("end")  # what the answer's definitions import when they are loaded is not counted
    base = _rss() if big else None
    try:
        try:  # (between calls the sandbox still holds the plain copy of what it returned last)
            shards, failure = fn("build", seed, sizes, rows, STEPS, kwargs), None
        except AssertionError as exc:
            shards, failure = None, _refused(exc)
        failure = failure or _shards_failure(shards, units, world, rank, flats[0])
        if failure is None and base is not None:
            failure = _kept_failure(_since(base), 2 * shard_bytes, model_bytes * NOISE_KEPT, rank, world,
                                    "after construction",
                                    "Keep no full-size parameter (nor a reference to one).")
        if (failure := _agree(failure)) is not None:
            return failure
        for step in range(STEPS):
            before = _rss()
            try:
                with _Carried() as carried:
                    shards = fn("step", step)
            except AssertionError as exc:
                failure = f"step {step}: {_refused(exc)}"
            if failure is None:
                kinds = carried.kinds()
                failure = _traffic_failure(kinds, [b for _, b, _ in carried.calls], units, world, step, rank)
            if failure is None and base is not None:
                failure = _forward_failure(carried, kinds, before, in_forward, model_bytes * NOISE_FORWARD, rank,
                                           step, parts)
            failure = failure or _values_failure(shards, units, world, rank, flats, step)
            if failure is None and base is not None:
                failure = _kept_failure(_since(base), 3 * shard_bytes, model_bytes * NOISE_KEPT, rank, world,
                                        f"after step {step}", "Free every gathered unit after its backward.")
            if (failure := _agree(failure)) is not None:
                return failure
        return None
    finally:
        try:
            fn("end")
        except Exception:
            pass


def _guarded(body, *args):
    """Run a probe body; an AssertionError becomes the rank's failure message, agreed on with the other ranks."""
    try:
        return body(*args)
    except AssertionError as exc:
        failure = str(exc)
    return _agree(failure)


def check_MiniFSDP(MiniFSDP) -> None:
    """On 2, 3 and 4 ranks: shards laid out and padded as stated; a few SGD steps equal one-process training on the
    whole batch (a frozen parameter stays put); per step two all-gathers per unit and one reduce-scatter per
    trainable unit, carrying at least the bytes these need, and no other collective; a rank's process keeps
    total/N of the parameters between steps and holds no more than the root's own and the largest unit beyond
    that during forward (the larger model: memory from /proc)."""
    seed = draw_seed()
    configs = [(2, {}, 0, True), (3, {}, 0, False), (4, {}, 0, False)]
    if "prefetch" in inspect.signature(MiniFSDP).parameters:
        configs.append((3, {"prefetch": True}, 1, True))  # the stretch: graded when offered
    fn = in_sandbox(MiniFSDP, "MiniFSDP", allow=ALLOWED, driver=scene, arena=False)  # memory read at each call
    start = in_sandbox(0, "MiniFSDP", allow=set(), driver=ping)  # no student code in it
    for world_size, kwargs, extra, big in configs:
        results = run_on_workers(_guarded, _probe, fn, start, seed, big, 4 * world_size, kwargs, extra,
                                 world_size=world_size, what="MiniFSDP", timeout=60)
        failure = next((f for f in results if f), None)
        if failure:
            raise AssertionError(f"{failure} (world_size={world_size}, seed {seed})")
