"""``check_run_pipeline`` and what runs on the workers for it: the model of layers of different kinds, the stage
that records its forward and backward passes, the one-process oracle, and the judgement of one rank's result.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn as nn

from .._common import draw_seed, run_on_workers, short, tolerance
from .reference import reference_1f1b, reference_gpipe, reference_partition
from .schedules import _fmt


# ---------------------------------------------------------------------------------------------------------------
# run_pipeline on workers

D = 6  # width of every layer: stage inputs and outputs all have the micro-batch's shape (rows, D)


class _Residual(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def _layer(kind: int, d: int) -> nn.Module:
    kind %= 4
    if kind == 0:
        return nn.Sequential(nn.Linear(d, d), nn.Tanh())
    if kind == 1:
        return _Residual(d)
    if kind == 2:
        return nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d, bias=False), nn.GELU())
    return nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))


def _model(num_layers: int, seed: int) -> nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(*[_layer(seed + i, D) for i in range(num_layers)])


def _loss_fn(out, target):
    return ((out - target) ** 2).mean()


class _Mark(torch.autograd.Function):
    """Identity that tells the recorder when the backward of forward number ``index`` reaches this stage."""

    @staticmethod
    def forward(ctx, x, recorder, index):
        ctx.recorder, ctx.index = recorder, index
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.recorder.events.append(("B", ctx.index))
        return grad, None, None


class RecordingStage(nn.Module):
    """The stage a probe hands to ``run_pipeline``: runs ``inner`` and records ``("F", k)`` for the k-th forward
    call and ``("B", k)`` when that forward's backward starts on this stage."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.events = []
        self._forwards = 0

    def forward(self, x):
        k = self._forwards
        self._forwards += 1
        self.events.append(("F", k))
        out = self.inner(x)
        return _Mark.apply(out, self, k) if out.requires_grad else out


def _agree(failure) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([0 if failure is None else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _pipeline_case(run_pipeline, num_layers: int, m: int, kind: str, rows: int, seed: int):
    """One case on this rank; returns a message or None."""
    import torch.distributed as dist

    from labsupport import CommCounter

    rank, p = dist.get_rank(), dist.get_world_size()
    label = f"run_pipeline ({kind}, {p} stages, {num_layers} layers, m={m} micro-batch{'es' if m != 1 else ''} of {rows} rows)"
    ranges = reference_partition(num_layers, p)
    model = _model(num_layers, seed)
    stage = RecordingStage(nn.Sequential(*[model[i] for i in ranges[rank]]))
    schedule = (reference_gpipe if kind == "GPipe" else reference_1f1b)(p, m)
    gen = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(rows, D, generator=gen) for _ in range(m)]
    ys = [torch.randn(rows, D, generator=gen) for _ in range(m)]
    xs_kept, ys_kept = [x.clone() for x in xs], [y.clone() for y in ys]

    oracle = _model(num_layers, seed)
    oracle_loss = sum(_loss_fn(oracle(x), y) for x, y in zip(xs, ys)) / m
    oracle_loss.backward()
    oracle_params = [dict(oracle[i].named_parameters()) for i in ranges[rank]]

    with CommCounter() as cc:
        try:
            loss = run_pipeline(stage, schedule, xs, ys, _loss_fn)
        except (NotImplementedError, AssertionError):
            raise
        except Exception as exc:
            # raise at once (no agreement round): a neighbour may wait for a message this rank will never send,
            # and the launcher stops the other ranks when one fails
            text = " ".join(str(exc).split())
            hint = ""
            if "NoneType" in str(exc):
                hint = (" A tensor was None: if it is the received activation's .grad, make the received tensor a "
                        "leaf of this stage's graph (x.requires_grad_()) before running the stage.")
            raise AssertionError(f"{label}: rank {rank} raised {type(exc).__name__}: {text[:200]}{hint}") from None
    return _judge(rank, p, m, label, stage, schedule, loss, oracle_loss, oracle_params, ranges, cc,
                  xs, xs_kept, ys, ys_kept)


def _judge(rank, p, m, label, stage, schedule, loss, oracle_loss, oracle_params, ranges, cc, xs, xs_kept, ys,
           ys_kept):
    if any(not torch.equal(a, b) for a, b in zip(xs + ys, xs_kept + ys_kept)):
        return f"{label}: rank {rank} changed the micro-batches or targets it was given; leave them untouched."
    if rank == p - 1:
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                return f"{label}: the last stage returned {short(loss)}; expected the mean loss, one number."
            loss = loss.item()
        if not isinstance(loss, (float, int)):
            return f"{label}: the last stage (rank {rank}) returned {short(loss)}; expected the mean loss (a float)."
        if not math.isclose(loss, oracle_loss.item(), rel_tol=1e-5, abs_tol=1e-6):
            return (f"{label}: the last stage returned loss {loss:.6g}, expected {oracle_loss.item():.6g}, the mean "
                    "over the micro-batches of loss_fn(output, target).")
    elif loss is not None:
        return f"{label}: rank {rank} returned {short(loss)}; every stage but the last returns None."
    expected_events = []
    order = [mb for op, mb in schedule[rank] if op == "F"]
    for op, mb in schedule[rank]:
        expected_events.append((op, order.index(mb)))
    if stage.events[: len(expected_events)] != expected_events or len(stage.events) != len(expected_events):
        to_mb = lambda ev: [f"{op}{order[k] if k < len(order) else k}" for op, k in ev]  # noqa: E731
        return (f"{label}: stage {rank} ran {' '.join(to_mb(stage.events)[:24])}, but schedule[{rank}] is "
                f"{_fmt(schedule[rank], 24)}: run exactly this stage's list, in order, one stage_module call per F "
                "and one backward per B.")
    for local, i in enumerate(ranges[rank]):
        for name, ref in oracle_params[local].items():
            got = dict(stage.inner[local].named_parameters())[name].grad
            if got is None:
                return (f"{label}: on stage {rank}, layer {i}'s {name} has no gradient. Every B must backpropagate "
                        "through this stage's modules.")
            if got.shape != ref.grad.shape or not torch.allclose(got, ref.grad, **tolerance(ref.grad.dtype)):
                ratio = (got.flatten() @ ref.grad.flatten() / ref.grad.flatten().pow(2).sum().clamp_min(1e-30)).item()
                hint = ""
                if math.isclose(ratio, m, rel_tol=1e-3):
                    hint = " It is m times too large: average the loss over the micro-batches (divide each by m)."
                elif rank < p - 1:
                    hint = (f" Check what stage {rank + 1} sends back (the received activation's .grad, made a leaf "
                            "with requires_grad_()) and that each received activation is a fresh tensor (a reused "
                            "receive buffer is overwritten before backward needs it).")
                else:
                    hint = (" Check that each received activation is a fresh tensor (a reused receive buffer is "
                            "overwritten before backward needs it).")
                message = f"{label}: on stage {rank}, layer {i}'s {name}.grad is not one-process training's.{hint}"
                values = f" Got {short(got, 2)}, expected {short(ref.grad, 2)}."
                return message + values if len(message + values) < 360 else message   # the hint first
    other = sorted({c.kind for c in cc.calls} - {"send", "recv"})
    if other:
        return (f"{label}: rank {rank} called torch.distributed.{other[0]}: a pipeline passes activations and "
                "gradients with point-to-point messages only (send/recv, isend/irecv).")
    peers = {c.peer for c in cc.calls if c.peer is not None}
    if peers - {rank - 1, rank + 1}:
        return (f"{label}: rank {rank} exchanged messages with rank(s) {sorted(peers - {rank - 1, rank + 1})}; a "
                "stage only talks to its neighbours (activations to rank + 1, gradients to rank - 1).")
    return None


def _pipeline_probe(run_pipeline, cases):
    """All cases on this rank; every case ends with all ranks agreeing whether one failed."""
    for num_layers, m, kind, rows, seed in cases:
        failure = _pipeline_case(run_pipeline, num_layers, m, kind, rows, seed)
        if _agree(failure):
            return failure
    return None


def check_run_pipeline(run_pipeline, world_sizes=(2, 3, 4), timeout=None) -> None:
    """Loss and every gradient equal to one-process training, on 2, 3 and 4 stages, GPipe and 1F1B, any (p, m)."""
    seed = draw_seed()
    rng = random.Random(seed)
    for p in world_sizes:
        layers = [2 * p + 1, p + 2 if (p + 2) % 2 else p + 3]  # odd numbers of layers: unequal stages
        cases = []
        for m in sorted({1, max(1, p - 1), p, p + rng.randint(1, 3)}):
            for kind in ("1F1B", "GPipe"):
                cases.append((layers[len(cases) % 2], m, kind, rng.randint(2, 5), rng.randrange(1, 10**6)))
        results = run_on_workers(_pipeline_probe, run_pipeline, cases, world_size=p, what="run_pipeline",
                                 timeout=timeout)
        failures = [r for r in results if r]
        if failures:
            raise AssertionError(f"{failures[0]} (seed {seed})")
