"""Checks for notebook 06_zero: ``check_model_state_bytes``, ``check_ShardedOptimizer``, ``check_Zero2Optimizer``.

The calculator is compared with the formulas on sizes, degrees, stages and K drawn at grading time, and with the
paper's own numbers (Table 1 and the Figure 1 example of arXiv 1910.02054).

The optimizers run in the grading sandbox (``in_sandbox`` with the drivers of ``zero_drivers``); the host of each
rank judges them from its own oracle, its own record of the communication and the sandbox's memory read from
``/proc``. On 2, 3 and 4 ranks, on ``ZeroProbeNet`` (parameters of uneven sizes, one of them odd-sized, and a
frozen layer), every rank runs a plain backward on its own slice of each batch; the oracle is the unsharded
optimizer trained in the host on the whole batch. For AdamW (learning rate, weight decay, betas drawn; an eps large
enough that rounding cannot swing a step) and SGD with momentum (a missing average is nearly invisible to Adam,
which is almost scale-invariant, but not to SGD), 10 steps each:

* after every ``step()``, every rank's weights equal the oracle's (fp32, tight tolerance);
* one ``step()`` moves at most 2Ψ per rank (the paper's accounting, ``labsupport.lessons.zero.traffic_bytes``,
  plus padding), as data parallelism does, in the host's record; ``zero_grad()`` moves nothing, the constructor at
  most 2Ψ;
* ZeRO-2: no all-reduce of gradients;
* what the student's object shows (the ``state`` of every torch optimizer reachable from it, the ``.grad`` left on
  the model) is read in the sandbox for messages about honest mistakes (about 1/N of the state per rank, the
  shares balanced, no full gradient kept in ZeRO-2): it can only take points away.

Then on 4 ranks, a model of 4 M parameters (``zero_drivers.BigNet``), AdamW, 2 steps: the sandbox's resident size,
read from ``/proc`` before the constructor and after each step (the driver frees its garbage and trims the heap
first), may grow by what the object's optimizers hold (their state, the shard they update and its gradient), at most
a 1/N share of each (less the model's gradients in ZeRO-2, which frees them), plus ``MEMORY_SLACK``; the weights
sampled at drawn positions equal the oracle's. A full copy of the optimizer state kept anywhere else (a global, a
closure, bytes, numpy) is in the process, so it is counted.

Probes keep the ranks in step: after each step every rank reports whether it found a problem (a small all-reduce in
the host) and all stop together.
"""

from __future__ import annotations

import math
import random

import torch

from . import zero_drivers as _drivers
from ._common import PROBE_TIMEOUT, agree as _agree, draw_seed, in_sandbox, run_on_workers, short, tolerance
from ._common import stop_if_any as _stop_if_any
from ._host import Recorder, fmt_bytes
from .zero_drivers import ZeroProbeNet

__all__ = ["check_model_state_bytes", "check_ShardedOptimizer", "check_Zero2Optimizer", "ZeroProbeNet",
           "reference_model_state_bytes"]

STEPS = 10
WORLD_SIZES = (2, 3, 4)
#: The memory scenario: on this many ranks (where a 1/N share, even claimed in full, stays far below a full copy of
#: the state), this many steps; what a rank may keep beyond its optimizers' share, as a fraction of the model's bytes
#: (what a process's own allocations move, after the heap is trimmed, is far below it).
MEMORY_WORLD, MEMORY_STEPS, MEMORY_SLACK = 4, 2, 0.25
#: Seconds per probe. Generous: the first torch optimizer a fresh worker builds imports torch._dynamo (about 800
#: modules, 5 s of CPU on an idle core, far more on a loaded machine); a deadlock is still stopped well inside the
#: grader's cell time-out, since the first world size that fails ends the check.
PROBE_TIMEOUT_ZERO = max(PROBE_TIMEOUT, 100.0)


def reference_model_state_bytes(num_params, dp_degree, stage, k=12):
    """The formulas of the ZeRO paper (section 5): bytes of model state per device."""
    psi, n = float(num_params), float(dp_degree)
    return {0: (4 + k) * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n, 3: (4 + k) * psi / n}[stage]


# ---------------------------------------------------------------------------------------------------------------
# the calculator


def check_model_state_bytes(model_state_bytes):
    """Drawn sizes, degrees, stages and K against the formulas; the paper's Table 1 and Figure 1; ValueError."""
    from labsupport.lessons.zero import PAPER_FIGURE1, PAPER_TABLE1

    seed = draw_seed()
    rng = random.Random(seed)

    def call(*args, **kwargs):
        try:
            return model_state_bytes(*args, **kwargs)
        except NotImplementedError:
            raise AssertionError("model_state_bytes is not started: it still raises NotImplementedError.") from None
        except Exception as exc:
            raise AssertionError(f"model_state_bytes{args} raised {type(exc).__name__}: {exc}") from None

    hints = {0: "stage 0 holds everything on every device: (2 + 2 + K) Ψ",
             1: "stage 1 shards only the optimizer state: 2Ψ + 2Ψ + KΨ/N",
             2: "stage 2 shards gradients and optimizer state: 2Ψ + (2 + K)Ψ/N",
             3: "stage 3 shards everything: (2 + 2 + K)Ψ/N"}
    cases = [(7.5e9, 64, s, 12) for s in range(4)]
    for _ in range(40):
        psi = rng.choice([rng.randint(1, 10**6), rng.randint(10**6, 10**12), rng.uniform(1e6, 1e12)])
        cases.append((psi, rng.choice([1, 2, 3, 7, 8, 64, 1000, rng.randint(1, 5000)]), rng.randint(0, 3),
                      rng.choice([12, 4, 8, 16, 0, rng.randint(1, 20)])))
    for psi, n, stage, k in cases:
        got = call(psi, n, stage, k=k) if k != 12 or rng.random() < 0.5 else call(psi, n, stage)
        expected = reference_model_state_bytes(psi, n, stage, k)
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            raise AssertionError(f"model_state_bytes({psi!r}, {n}, {stage}, k={k}) returned {short(got)}: "
                                 "return a number of bytes (int or float).")
        if not math.isclose(got, expected, rel_tol=1e-9):
            raise AssertionError(f"model_state_bytes({psi!r}, {n}, {stage}, k={k}) = {got!r}, expected {expected!r}"
                                 f": {hints[stage]} (seed {seed}).")
    for (psi, n), printed in PAPER_TABLE1.items():
        for stage, value in zip((1, 2, 3), printed):
            got = call(psi, n, stage) / 1e9
            if abs(got - value) > max(1.0, 0.01 * value) and abs(got - value) / value > 0.01:
                raise AssertionError(f"Table 1 of the paper: Ψ = {psi:g}, N = {n}, stage {stage}: {value} GB, "
                                     f"yours {got:.4g} GB. {hints[stage]}.")
    for stage, value in enumerate(PAPER_FIGURE1["gb"]):
        got = call(PAPER_FIGURE1["num_params"], PAPER_FIGURE1["dp_degree"], stage) / 1e9
        if abs(got - value) > 0.06 * max(1.0, value / 10):
            raise AssertionError(f"The paper's Figure 1 (7.5B parameters, 64 GPUs): stage {stage} is {value} GB, "
                                 f"yours {got:.4g} GB. {hints[stage]}.")
    for bad in [(1e9, 8, 4), (1e9, 8, -1), (0, 8, 1), (-5, 8, 2), (1e9, 0, 1), (1e9, -2, 0)]:
        try:
            model_state_bytes(*bad)
        except ValueError:
            continue
        except NotImplementedError:
            raise AssertionError("model_state_bytes is not started: it still raises NotImplementedError.") from None
        except Exception as exc:
            raise AssertionError(f"model_state_bytes{bad} raised {type(exc).__name__}: raise ValueError for a stage "
                                 "outside 0..3 or a non-positive size.") from None
        raise AssertionError(f"model_state_bytes{bad} returned instead of raising ValueError: stages are 0 to 3, "
                             "num_params and dp_degree must be positive.")


# ---------------------------------------------------------------------------------------------------------------
# the optimizers


def _make_model(seed: int, big: bool = False):
    return _drivers.make_model(seed, big)


def _data(seed: int, steps: int = STEPS, big: bool = False):
    return _drivers.data(seed, steps, big)


def _loss(model, x, y):
    return _drivers.loss(model, x, y)


def _configs(seed: int):
    rng = random.Random(seed)
    # eps well above fp32 rounding: Adam's first step is about lr * g / (|g| + eps), so for a gradient element near
    # zero a tiny eps lets the last bits of the averaging (N partial sums vs one whole-batch sum) move the weight by
    # up to lr, and a correct answer would fail now and then.
    adamw = {"lr": rng.choice([3e-3, 1e-2, 2e-2]), "weight_decay": rng.choice([0.01, 0.1]),
             "betas": (rng.choice([0.8, 0.9]), rng.choice([0.99, 0.999])), "eps": 1e-3}
    sgd = {"lr": rng.choice([0.05, 0.1]), "momentum": rng.choice([0.8, 0.9])}
    return [("SGD", sgd), ("AdamW", adamw)]


def _state_elements(opts) -> int:
    """Elements of per-parameter state tensors (0-dim step counters left out)."""
    return sum(v.numel() for o in opts for s in o.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _raised(cls_name, error, zero2, psi, world):
    where, kind, message = error
    text = f"{cls_name}{where} raised {kind}: {message}" if where else message
    if zero2 and psi % world and ("size" in message or "shape" in message or "deadlocked" in message):
        text = (f"Ψ = {psi} elements on {world} ranks do not split evenly: S = ceil(Ψ/N), and the flat buffer "
                f"padded with zeros to N·S elements, so that every chunk has S elements. {text}")
    return AssertionError(text)


def _step_failure(setup, step, rank, world, weights, oracle, names, record, calls, psi, largest, pad, zero2, elt,
                  volumes):
    """What is wrong after one step on this rank (None if nothing): zero_grad, weights, communication, gradients.
    ``record``: the driver's report of the step; ``calls``: the host's record of the step's communication."""
    from labsupport.lessons.zero import traffic_bytes

    if record["left"]:
        return (f"{setup}: after zero_grad() at step {step}, rank {rank} still had a non-zero gradient in "
                f"'{record['left'][0]}': zero_grad() must clear (or set to None) every parameter's .grad.")
    for (name, q), p in zip(oracle.named_parameters(), weights):
        if not (isinstance(p, torch.Tensor) and p.shape == q.shape
                and torch.allclose(p, q.detach(), **tolerance(q.dtype))):
            hint = ("it is frozen (requires_grad=False): leave it out of the shards, so that it is never updated"
                    if not q.requires_grad else
                    "if this rank does not own it, step() must bring it the owner's updated values (broadcast from "
                    "the owner, or all-gather the shards), and the owner must be the same on every rank; gradients "
                    "must be averaged (sum / N) before the update")
            return (f"{setup}: after step {step}, rank {rank}'s '{name}' differs from the unsharded optimizer's: "
                    f"got {short(p)}, expected {short(q)}; {hint}.")
    volume = traffic_bytes(calls, world)
    volumes.append(volume)
    reduced = sum(c.nbytes for c in calls if c.kind == "all_reduce")
    if zero2 and reduced > 0.25 * psi * elt:
        return (f"{setup}: step {step} on rank {rank} all-reduced {reduced} bytes: in ZeRO-2 each rank must receive "
                "only the averaged gradient of its own shard, so reduce-scatter the flat gradient "
                "(dist.reduce_scatter) instead of all-reducing it.")
    if volume > 2 * psi * elt + 2 * pad * elt + 64:
        kinds = sorted({c.kind for c in calls})
        return (f"{setup}: one step() on rank {rank} moved {volume / (psi * elt):.2f}Ψ (the paper's accounting: "
                f"all-reduce 2n, reduce/broadcast/reduce-scatter n, all-gather N·n; calls: {', '.join(kinds)}); ZeRO "
                "should cost what data parallelism costs, 2Ψ: send each gradient only to its owner (dist.reduce, or "
                "reduce-scatter), then send each updated shard once (broadcast from its owner, or all-gather).")
    if zero2:
        if record["held"]:
            return (f"{setup}: after step {step}, rank {rank} still holds the gradient of '{record['held'][0]}' "
                    "(p.grad): ZeRO-2 keeps only its shard of the averaged gradient; free the others (p.grad = None) "
                    "once they are copied into the flat buffer.")
        held = record["facts"]["grad_elements"]
        if held > psi / world + largest + pad:
            return (f"{setup}: after step {step}, rank {rank}'s optimizer still holds gradients of {held} elements, "
                    f"out of Ψ = {psi}: keep only this rank's shard (about Ψ/N = {math.ceil(psi / world)}).")
    return None


def _state_failure(setup, rank, world, facts, oracle_opt, psi, largest, pad, zero2=False):
    """What is wrong with the optimizer state this rank's object shows (None if nothing): read from the driver's
    report, so it can only take points away. Collective: every rank calls it."""
    import torch.distributed as dist

    mine = facts["state_elements"]
    kinds = _state_elements([oracle_opt]) // psi
    bound = kinds * (psi / world + largest + world)
    total = torch.tensor([mine])
    dist.all_reduce(total)
    if not facts["optimizers"]:
        return (f"{setup}: no torch.optim optimizer found in your object: build optimizer_cls over this rank's shard "
                "and keep it as an attribute (e.g. self.optim).")
    if mine > bound and total.item() <= kinds * (psi + pad):
        return (f"{setup}: rank {rank} holds optimizer state for {mine} elements, more than Ψ/N plus the largest "
                f"parameter ({int(bound)}), though the ranks together hold one copy: the shares are unbalanced. Give "
                "the parameters out largest first, each to the rank with the fewest elements so far.")
    if mine > bound:
        return (f"{setup}: rank {rank} holds optimizer state for {mine} elements; the unsharded optimizer holds "
                f"{kinds * psi} in all, so each of {world} ranks should hold about 1/{world} of it (at most "
                f"{int(bound)}: Ψ/N plus the largest parameter, per state tensor). Build optimizer_cls over this "
                "rank's shard only.")
    if total.item() > kinds * (psi + pad):
        return (f"{setup}: the ranks together hold optimizer state for {total.item()} elements, more than one copy "
                f"({kinds * psi}): the shards must not overlap.")
    kept = facts["storage_elements"]
    if zero2 and kept > psi / world + largest + pad:
        return (f"{setup}: rank {rank}'s optimizer updates tensors whose storage holds {kept} elements, about the "
                f"whole model (Ψ = {psi}), not a 1/{world} shard: a slice of the flat buffer keeps all of it alive. "
                ".clone() your shard.")
    return None


def _phase(phases, i) -> list:
    return phases[i] if i < len(phases) else []


def _quiet_failure(setup, rank, world, phases, psi, elt, pad):
    """Communication outside step(): none in zero_grad() (nor in the backward the check runs), and at most a
    step's worth (2Ψ) in the constructor (a broadcast of the initial parameters, say)."""
    from labsupport.lessons.zero import traffic_bytes

    built = traffic_bytes(phases[0], world)
    if built > 2 * psi * elt + 2 * pad * elt + 64:
        return (f"{setup}: the constructor on rank {rank} moved {built / (psi * elt):.2f}Ψ "
                f"({', '.join(sorted({c.kind for c in phases[0]}))}): building the shards needs no communication "
                "(every rank has the same parameters), a broadcast of them at most.")
    for step, calls in enumerate(phases[1::2]):
        if calls:
            return (f"{setup}: rank {rank} called {', '.join(f'{c.kind} of {c.nbytes} B' for c in calls[:3])} in "
                    f"zero_grad() before step {step}: zero_grad() only clears gradients, and every byte a step "
                    "moves belongs in step().")
    return None


def _readable(got, steps) -> bool:
    """The driver's report has the shape the driver gives it (student code shares its process: it could break it)."""
    return (type(got) is dict and type(got.get("steps")) is list and len(got["steps"]) <= steps
            and all(type(s) is dict and type(s.get("facts")) is dict and type(s.get("weights")) is list
                    for s in got["steps"]))


_UNREADABLE = ("{}: what the scenario returned on rank {} is not what it returns (something in the sandbox changed "
               "it); graded as a failure.")


def _probe(fn, cls_name, zero2, seed):
    """On the host of each rank: run the scenario of each optimizer in the sandbox (``zero_drivers.drive_training``)
    and judge it against the unsharded optimizer trained here, with the host's own record of the calls."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    X, Y = _data(seed)
    report = []
    for opt_name, kwargs in _configs(seed):
        optimizer_cls = getattr(torch.optim, opt_name)
        oracle = _make_model(seed)
        trainable = [p for p in oracle.parameters() if p.requires_grad]
        psi, largest, elt = sum(p.numel() for p in trainable), max(p.numel() for p in trainable), 4
        pad = world * len(trainable)  # room for padding, up to one partial row per parameter
        oracle_opt = optimizer_cls(oracle.parameters(), **kwargs)
        names = {i: n for i, (n, _) in enumerate(oracle.named_parameters())}
        setup = f"{cls_name}(model.parameters(), torch.optim.{opt_name}, **{kwargs}) on {world} ranks (seed {seed})"
        with Recorder() as rec:
            got = fn(opt_name, kwargs, seed, STEPS)
        if not _readable(got, STEPS):
            raise AssertionError(_UNREADABLE.format(setup, rank))
        phases, volumes = rec.phases(), []
        failure = _quiet_failure(setup, rank, world, phases, psi, elt, pad)
        for step, record in enumerate(got["steps"]):
            oracle_opt.zero_grad()
            _loss(oracle, X[step], Y[step]).backward()
            oracle_opt.step()
            failure = failure or _step_failure(setup, step, rank, world, record["weights"], oracle, names, record,
                                               _phase(phases, 2 + 2 * step), psi, largest, pad, zero2, elt, volumes)
            if step == 0:  # collective: every rank calls it
                failure = failure or _state_failure(setup, rank, world, record["facts"], oracle_opt, psi, largest,
                                                    pad, zero2)
            if _stop_if_any(failure):
                return None
        error = got.get("error")
        if _agree(error):
            if error:
                raise _raised(cls_name, error, zero2, psi, world)
            return None
        report.append((opt_name, max(volumes) / (psi * elt)))
    return report


def _memory_probe(fn, cls_name, zero2, seed):
    """On the host of each rank: the big model's scenario (``zero_drivers.drive_memory``); the sandbox's resident
    size, read from /proc at the driver's marks, must grow from before the constructor to after each step by no
    more than what its optimizers hold, at most a 1/N share of the state, parameters and gradients."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    kwargs = _configs(seed)[1][1]
    oracle = _make_model(seed, big=True)
    X, Y = _data(seed, MEMORY_STEPS, big=True)
    params = list(oracle.parameters())
    psi, largest, elt = sum(p.numel() for p in params), max(p.numel() for p in params), 4
    pad = world * len(params)
    rng = random.Random(seed + 5)
    sample = [sorted(rng.sample(range(p.numel()), 8)) for p in params]
    oracle_opt = torch.optim.AdamW(params, **kwargs)
    setup = (f"{cls_name}(model.parameters(), torch.optim.AdamW, **{kwargs}) on {world} ranks, a model of "
             f"Ψ = {psi} parameters (seed {seed})")
    with Recorder() as rec:
        got = fn(kwargs, seed, MEMORY_STEPS, sample)
    if not _readable(got, MEMORY_STEPS):
        raise AssertionError(_UNREADABLE.format(setup, rank))
    failure = None
    share = (psi / world + largest + pad) * elt
    for step, record in enumerate(got["steps"]):
        oracle_opt.zero_grad()
        _loss(oracle, X[step], Y[step]).backward()
        oracle_opt.step()
        for i, (p, idx) in enumerate(zip(params, sample)):
            want = p.detach().reshape(-1)[idx]
            w = record["weights"][i] if i < len(record["weights"]) else None
            if failure is None and not (isinstance(w, torch.Tensor) and w.shape == want.shape
                                        and torch.allclose(w, want, **tolerance(want.dtype))):
                failure = (f"{setup}: after step {step}, rank {rank}'s weights differ from the unsharded optimizer's "
                           f"(parameter {i}: got {short(w)}, expected {short(want)}).")
        rss = rec.rss
        if failure is None and len(rss) > step + 1:
            grown = rss[step + 1] - rss[0]
            held = record["facts"].get("held_bytes")
            allowed = min(held if isinstance(held, (int, float)) else 0, 4 * share)  # state (2), shard, its grad
            if zero2:  # the model's gradients, made before the constructor, are gone after a ZeRO-2 step
                allowed -= psi * elt
            beyond = grown - allowed
            if beyond > MEMORY_SLACK * psi * elt:
                failure = (f"{setup}: after step {step}, rank {rank}'s process holds {fmt_bytes(grown)} more than "
                           f"before the constructor (read by the system), {fmt_bytes(beyond)} beyond its shard: its "
                           f"optimizers hold {fmt_bytes(allowed)} (their state, and the shard they update with its "
                           "gradient). The full optimizer state (or another full-size copy of the model's data) is "
                           "kept somewhere else (a global, a closure, bytes or numpy copies): keep only this rank's "
                           "shard, in the optimizer you build over it.")
        if _stop_if_any(failure):
            return None
    error = got.get("error")
    if _agree(error) and error:
        raise _raised(cls_name, error, False, psi, world)
    return None


def _check_optimizer(cls, cls_name, zero2):
    seed = draw_seed()
    what = f"{cls_name} (seed {seed})"
    training = in_sandbox(cls, what, driver=_drivers.drive_training)
    psi = sum(p.numel() for p in _make_model(seed).parameters() if p.requires_grad)
    for world in WORLD_SIZES:
        try:
            run_on_workers(_probe, training, cls_name, zero2, seed, world_size=world, what=what,
                           timeout=PROBE_TIMEOUT_ZERO)
        except AssertionError as exc:
            if zero2 and psi % world and "deadlocked" in str(exc):  # some ranks' chunks fit, the others' did not
                raise _raised(cls_name, ("", "a deadlock", str(exc)), True, psi, world) from None
            raise
    memory = in_sandbox(cls, what, driver=_drivers.drive_memory)
    run_on_workers(_memory_probe, memory, cls_name, zero2, seed, world_size=MEMORY_WORLD, what=what,
                   timeout=PROBE_TIMEOUT_ZERO)


def check_ShardedOptimizer(ShardedOptimizer):
    """ZeRO-1: SGD with momentum and AdamW, 10 steps on 2, 3 and 4 ranks: weights equal to the unsharded optimizer,
    about 1/N of the state per rank, at most 2Ψ moved per step, none in zero_grad(); on a larger model, the memory
    the process keeps after a step is its shard."""
    _check_optimizer(ShardedOptimizer, "ShardedOptimizer", zero2=False)


def check_Zero2Optimizer(Zero2Optimizer):
    """ZeRO-2: as ZeRO-1, plus: gradients reduce-scattered (no all-reduce), no full gradient held after step()."""
    _check_optimizer(Zero2Optimizer, "Zero2Optimizer", zero2=True)
