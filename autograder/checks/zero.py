"""Checks for notebook 06_zero: ``check_model_state_bytes``, ``check_ShardedOptimizer``, ``check_Zero2Optimizer``.

The calculator is compared with the formulas on sizes, degrees, stages and K drawn at grading time, and with the
paper's own numbers (Table 1 and the Figure 1 example of arXiv 1910.02054).

The optimizers are trained on real workers (2, 3 and 4 ranks) on ``ZeroProbeNet``: parameters of uneven sizes, one
of them odd-sized, and a frozen layer. Every rank runs a plain backward on its own slice of each batch; the oracle
is the unsharded optimizer trained in one process on the whole batch (recomputed inside every worker). For AdamW
(learning rate, weight decay, betas drawn; an eps large enough that rounding cannot swing a step) and SGD with
momentum (a missing average is nearly invisible to Adam, which is almost scale-invariant, but not to SGD),
10 steps each:

* after every ``step()``, every rank's weights equal the oracle's (fp32, tight tolerance);
* the optimizer state each rank holds (the ``state`` of every torch optimizer reachable from the student's object)
  is about 1/N of the oracle's: at most Ψ/N plus the largest parameter per state tensor kind, and the ranks
  together hold no more than one copy (plus padding);
* what a rank keeps alive after the first ``step()`` is measured, not walked: a census of every tensor storage and
  Python buffer in the worker (``autograder.checks._memory``), taken before the constructor and after the step,
  less the model, its gradients and the check's own tensors, must be that rank's shard: the state, parameters and
  gradients of the optimizers in the student's object (each about 1/N of the model), plus 512 B. State kept in a
  closure, a global, numpy copies, behind a decoy optimizer, is counted wherever it is;
* one ``step()`` moves at most 2Ψ per rank (the paper's accounting, ``labsupport.lessons.zero.traffic_bytes``,
  plus padding), as data parallelism does;
* ZeRO-2: no all-reduce of gradients; after ``step()`` no model parameter has a ``.grad`` and the gradients the
  rank still holds cover about 1/N of the elements.

Probes keep the ranks in step: after each step every rank reports whether it found a problem (a small all-reduce
outside the counted region) and all stop together.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn as nn

from ._common import PROBE_TIMEOUT, call_student, draw_seed, run_on_workers, short, tolerance
from ._common import stop_if_any as _stop_if_any
from ._memory import MemoryWatch, fmt_bytes

__all__ = ["check_model_state_bytes", "check_ShardedOptimizer", "check_Zero2Optimizer", "ZeroProbeNet",
           "reference_model_state_bytes"]

STEPS = 10
ROWS = 12  # divisible by 2, 3 and 4
D_IN, D_OUT = 10, 3
WORLD_SIZES = (2, 3, 4)
#: Seconds per probe. Generous: the first torch optimizer a fresh worker builds imports torch._dynamo (about 800
#: modules, 5 s of CPU on an idle core, far more on a loaded machine); a deadlock is still stopped well inside the
#: grader's cell time-out, since the first world size that fails ends the check.
PROBE_TIMEOUT_ZERO = max(PROBE_TIMEOUT, 100.0)
#: Bytes a rank may keep beyond the model, its gradients and its shard (a few scalars of bookkeeping).
CENSUS_SLACK = 512


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


class ZeroProbeNet(nn.Module):
    """Parameters of uneven sizes (an odd-sized gain vector among them) and a frozen layer. Trainable elements:
    10*20+20 + 20*14+14 + 14*24+24 + 24*3+3 + 7 (gain, used on a slice) = 956; frozen: 14*14+14."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, 20)
        self.mid = nn.Linear(20, 14)
        self.frozen = nn.Linear(14, 14)
        self.frozen.requires_grad_(False)
        self.wide = nn.Linear(14, 24)
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(7))
        self.out = nn.Linear(24, D_OUT)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.frozen(torch.tanh(self.mid(h))))
        h = torch.tanh(self.wide(h))
        h = torch.cat([h[:, :7] * self.gain, h[:, 7:]], dim=1)
        return self.out(h)


def _make_model(seed: int) -> ZeroProbeNet:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return ZeroProbeNet()


def _data(seed: int):
    gen = torch.Generator().manual_seed(seed + 11)
    return torch.randn(STEPS, ROWS, D_IN, generator=gen), torch.randn(STEPS, ROWS, D_OUT, generator=gen)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


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


def _step_failure(setup, step, rank, world, model, oracle, names, left, calls, psi, largest, pad, opt, zero2,
                  volumes):
    """What is wrong after one step on this rank (None if nothing): zero_grad, weights, communication, gradients."""
    from labsupport.lessons.zero import find_optimizers, traffic_bytes

    if left:
        return (f"{setup}: after zero_grad() at step {step}, rank {rank} still had a non-zero gradient in "
                f"'{left[0]}': zero_grad() must clear (or set to None) every parameter's .grad.")
    for (name, p), q in zip(model.named_parameters(), oracle.parameters()):
        if not (p.shape == q.shape and torch.allclose(p.detach(), q.detach(), **tolerance(q.dtype))):
            hint = ("it is frozen (requires_grad=False): leave it out of the shards, so that it is never updated"
                    if not p.requires_grad else
                    "if this rank does not own it, step() must bring it the owner's updated values (broadcast from "
                    "the owner, or all-gather the shards), and the owner must be the same on every rank; gradients "
                    "must be averaged (sum / N) before the update")
            return (f"{setup}: after step {step}, rank {rank}'s '{name}' differs from the unsharded optimizer's: "
                    f"got {short(p)}, expected {short(q)}; {hint}.")
    elt = next(p for p in model.parameters() if p.requires_grad).element_size()
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
        held = [names[id(p)] for p in model.parameters() if p.grad is not None]
        if held:
            return (f"{setup}: after step {step}, rank {rank} still holds the gradient of '{held[0]}' (p.grad): "
                    "ZeRO-2 keeps only its shard of the averaged gradient; free the others (p.grad = None) once "
                    "they are copied into the flat buffer.")
        own = {id(t.grad): t.grad.numel() for o in find_optimizers(opt) for g in o.param_groups
               for t in g["params"] if t.grad is not None}
        if sum(own.values()) > psi / world + largest + pad:
            return (f"{setup}: after step {step}, rank {rank}'s optimizer still holds gradients of "
                    f"{sum(own.values())} elements, out of Ψ = {psi}: keep only this rank's shard (about Ψ/N = "
                    f"{math.ceil(psi / world)}).")
    return None


def _model_tensors(model):
    """A model's parameters and their gradients: what the check itself holds (and ZeRO-1 keeps the gradients)."""
    return [t for p in model.parameters() for t in (p, p.grad) if t is not None]


def _kept_storage_elements(opts) -> int:
    """Elements of the distinct storages behind the tensors the optimizers update: a slice of a bigger tensor keeps
    all of it alive."""
    storages = {}
    for o in opts:
        for group in o.param_groups:
            for t in group["params"]:
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes() // max(t.element_size(), 1)
    return sum(storages.values())


def _state_failure(setup, rank, world, opt, oracle_opt, psi, largest, pad, zero2=False):
    """What is wrong with the optimizer state this rank holds (None if nothing). Collective: every rank calls it."""
    import torch.distributed as dist

    from labsupport.lessons.zero import find_optimizers

    opts = find_optimizers(opt)
    mine = _state_elements(opts)
    kinds = _state_elements([oracle_opt]) // psi
    bound = kinds * (psi / world + largest + world)
    total = torch.tensor([mine])
    dist.all_reduce(total)
    if not opts:
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
    kept = _kept_storage_elements(opts)
    if zero2 and kept > psi / world + largest + pad:
        return (f"{setup}: rank {rank}'s optimizer updates tensors whose storage holds {kept} elements, about the "
                f"whole model (Ψ = {psi}), not a 1/{world} shard: a slice of the flat buffer keeps all of it alive. "
                ".clone() your shard.")
    return None


def _census_failure(setup, rank, world, watch, opt, known, psi, largest, pad, kinds, elt):
    """What this rank keeps alive after step() beyond the model, its gradients and the check's own tensors, from a
    census of the whole worker process (``_memory``), not from the student's attributes. Only the optimizer state,
    parameters and gradients of the optimizers found in the student's object count as its shard, each up to about
    1/N of the model. Collective: every rank calls it."""
    import torch.distributed as dist

    from labsupport.lessons.zero import find_optimizers

    kept = watch.kept(known)
    watch.close()
    measured = kept.total
    share = (psi / world + largest + pad) * elt
    opts = find_optimizers(opt)
    state = [v for o in opts for s in o.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    params = [p for o in opts for g in o.param_groups for p in g["params"] if isinstance(p, torch.Tensor)]
    kept.explain(state, kinds * share + 8 * len(state))  # 8 B: a step counter per parameter
    kept.explain(params, share)
    kept.explain([p.grad for p in params if p.grad is not None], share)
    beyond = kept.total
    together = torch.tensor([float(measured)], dtype=torch.float64)
    dist.all_reduce(together)
    one_copy = (kinds + 2) * (psi + pad) * elt + world * CENSUS_SLACK
    watch.measured = (measured, beyond)  # for the report of a run (bytes kept beyond the model, beyond the shard)
    if beyond > CENSUS_SLACK:
        return (f"{setup}: rank {rank} keeps {fmt_bytes(beyond)} of tensors alive after step() beyond its shard "
                f"({fmt_bytes(CENSUS_SLACK)} allowed): the full optimizer state (or another full-size copy of the "
                "model's data) is still held somewhere (a closure, a list, a global, an attribute) — keep only this "
                f"rank's shard, in the optimizer you build over it. Largest: {kept.largest()}.")
    if together.item() > one_copy:
        return (f"{setup}: the {world} ranks together keep {fmt_bytes(together.item())} of tensors alive after step() "
                f"beyond the model and its gradients, more than one sharded copy of the optimizer state, parameters "
                f"and gradients ({fmt_bytes(one_copy)}): a full copy is held on every rank — keep only this rank's "
                "shard.")
    return None


def _probe(cls, cls_name, zero2, seed):
    import torch.distributed as dist

    from labsupport import CommCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    X, Y = _data(seed)
    report = []
    for opt_name, kwargs in _configs(seed):
        optimizer_cls = getattr(torch.optim, opt_name)
        model, oracle = _make_model(seed), _make_model(seed)
        names = {id(p): n for n, p in model.named_parameters()}
        trainable = [p for p in model.parameters() if p.requires_grad]
        psi = sum(p.numel() for p in trainable)
        largest = max(p.numel() for p in trainable)
        pad = world * len(trainable)  # room for padding, up to one partial row per parameter
        oracle_opt = optimizer_cls(oracle.parameters(), **kwargs)
        setup = f"{cls_name}(model.parameters(), torch.optim.{opt_name}, **{kwargs}) on {world} ranks (seed {seed})"
        opt = None
        watch = MemoryWatch()  # the baseline: a few milliseconds of CPU in a worker
        opt = call_student(f"{cls_name}(...) with torch.optim.{opt_name}", cls, model.parameters(), optimizer_cls,
                       **kwargs)
        volumes = []
        for step in range(STEPS):
            x, y = X[step].chunk(world)[rank], Y[step].chunk(world)[rank]
            call_student(f"{cls_name}.zero_grad()", opt.zero_grad)
            left = [names[id(p)] for p in model.parameters() if p.grad is not None and p.grad.abs().sum() > 0]
            _loss(model, x, y).backward()
            with CommCounter() as cc:
                try:
                    call_student(f"{cls_name}.step() (step {step})", opt.step)
                except AssertionError as exc:
                    if zero2 and "sizes" in str(exc) and psi % world:
                        raise AssertionError(f"Ψ = {psi} elements on {world} ranks do not split evenly: S = "
                                             "ceil(Ψ/N), and the flat buffer padded with zeros to N·S elements, so "
                                             f"that every chunk has S elements. {exc}") from None
                    raise
            oracle_opt.zero_grad()
            _loss(oracle, X[step], Y[step]).backward()
            oracle_opt.step()
            failure = _step_failure(setup, step, rank, world, model, oracle, names, left, cc.calls, psi, largest,
                                    pad, opt, zero2, volumes)
            if step == 0:  # collective: every rank calls it
                state_failure = _state_failure(setup, rank, world, opt, oracle_opt, psi, largest, pad, zero2)
                kinds = _state_elements([oracle_opt]) // psi
                known = [X, Y, *_model_tensors(model), *_model_tensors(oracle)]
                known += [v for s in oracle_opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
                census_failure = _census_failure(setup, rank, world, watch, opt, known, psi, largest, pad, kinds,
                                                 trainable[0].element_size())
                failure = failure or state_failure or census_failure
            if _stop_if_any(failure):
                return None
        report.append((opt_name, max(volumes) / (psi * trainable[0].element_size())))
        report.append(("census", *watch.measured))  # bytes kept beyond the model, and beyond the shard
    return report


def _check_optimizer(cls, cls_name, zero2):
    seed = draw_seed()
    what = f"{cls_name} (seed {seed})"
    for world in WORLD_SIZES:
        run_on_workers(_probe, cls, cls_name, zero2, seed, world_size=world, what=what, timeout=PROBE_TIMEOUT_ZERO)


def check_ShardedOptimizer(ShardedOptimizer):
    """ZeRO-1: SGD with momentum and AdamW, 10 steps on 2, 3 and 4 ranks: weights equal to the unsharded optimizer,
    about 1/N of the state per rank, at most 2Ψ moved per step."""
    _check_optimizer(ShardedOptimizer, "ShardedOptimizer", zero2=False)


def check_Zero2Optimizer(Zero2Optimizer):
    """ZeRO-2: as ZeRO-1, plus: gradients reduce-scattered (no all-reduce), no full gradient held after step()."""
    _check_optimizer(Zero2Optimizer, "Zero2Optimizer", zero2=True)
