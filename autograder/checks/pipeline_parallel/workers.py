"""``check_run_pipeline`` and what runs on the workers for it: the model of layers of different kinds (``drivers``,
with the stage that records its passes, which runs in the grading sandbox with the student's function), the
one-process oracle, and the judgement of one rank's result in the host: loss and gradients against the oracle, and
the messages the host carried (``CommCounter``).
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn as nn

from .._common import draw_seed, in_sandbox, run_on_workers, short, tolerance
from .drivers import D, drive_pipeline, layer, loss_fn
from .reference import reference_1f1b, reference_gpipe, reference_partition
from .schedules import _fmt

#: Bytes a stage may send a neighbour per micro-batch beyond the activation or gradient itself (a shape, a flag).
METADATA = 64


# ---------------------------------------------------------------------------------------------------------------
# run_pipeline on workers


def _model(num_layers: int, seed: int) -> nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(*[layer(seed + i, D) for i in range(num_layers)])


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
    label = (f"run_pipeline ({kind}, {p} stages, {num_layers} layers, m={m} micro-batch{'es' if m != 1 else ''} of "
             f"{rows} rows)")
    ranges = reference_partition(num_layers, p)
    model = _model(num_layers, seed)
    mine = [(i, name, param) for i in ranges[rank] for name, param in model[i].named_parameters()]
    schedule = (reference_gpipe if kind == "GPipe" else reference_1f1b)(p, m)
    gen = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(rows, D, generator=gen) for _ in range(m)]
    ys = [torch.randn(rows, D, generator=gen) for _ in range(m)]
    xs_kept, ys_kept = [x.clone() for x in xs], [y.clone() for y in ys]
    # only this stage's layers go to the sandbox: the rest of the model reaches it through messages or not at all
    kinds, params = [seed + i for i in ranges[rank]], [param.detach().clone() for _, _, param in mine]

    oracle_loss = sum(loss_fn(model(x), y) for x, y in zip(xs, ys)) / m
    oracle_loss.backward()

    from labsupport import _sandbox

    before = len(_sandbox.record())
    with CommCounter() as cc:
        try:
            got = run_pipeline(kinds, params, schedule, xs, ys)
        except (NotImplementedError, AssertionError):
            raise
        except Exception as exc:
            # raise at once (no agreement round): a neighbour may wait for a message this rank will never send,
            # and the launcher stops the other ranks when one fails
            text = " ".join(str(exc).split())
            hint, cut = "", 200
            if "NoneType" in str(exc):
                hint = (" A tensor was None: if it is the received activation's .grad, make the received tensor a "
                        "leaf of this stage's graph (x.requires_grad_()) before running the stage.")
            elif "modified by an inplace operation" in str(exc):
                hint, cut = (" Receive each activation into a fresh tensor: a reused receive buffer is overwritten "
                             "before backward needs it."), 110
            raise AssertionError(f"{label}: rank {rank} raised {type(exc).__name__}: {text[:cut]}{hint}") from None
    if any(not torch.equal(a, b) for a, b in zip(xs + ys, xs_kept + ys_kept)):
        return f"{label}: rank {rank} changed the micro-batches or targets it was given; leave them untouched."
    unwaited = [(kind, peer) for kind, peer, *_, waited, _, _ in _sandbox.record()[before:] if waited is None]
    if unwaited:
        kind, peer = unwaited[0]
        return (f"{label}: rank {rank} never waited on its i{kind} {'to' if kind == 'send' else 'from'} rank {peer}: "
                "a message sent with isend whose request was never waited on may never be delivered; keep each "
                "request and wait() on it before returning.")
    return (_result_problem(rank, p, m, label, got, oracle_loss, schedule)
            or _grad_problem(rank, p, m, label, got, mine)
            or _traffic_problem(rank, p, m, label, cc, rows * D * xs[0].element_size()))


def _result_problem(rank, p, m, label, got, oracle_loss, schedule):
    """The loss returned, and the order of forwards and backwards this stage recorded (the student's side reports
    it: it diagnoses a schedule run in the wrong order, while the points rest on the values and the traffic)."""
    loss = got["loss"]
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
    order = [mb for op, mb in schedule[rank] if op == "F"]
    expected_events = [(op, order.index(mb)) for op, mb in schedule[rank]]
    events = [tuple(e) for e in got["events"]]
    if events != expected_events:
        to_mb = lambda ev: [f"{op}{order[k] if k < len(order) else k}" for op, k in ev]  # noqa: E731
        return (f"{label}: stage {rank} ran {' '.join(to_mb(events)[:24])}, but schedule[{rank}] is "
                f"{_fmt(schedule[rank], 24)}: run exactly this stage's list, in order, one stage_module call per F "
                "and one backward per B.")
    return None


def _grad_problem(rank, p, m, label, got, mine):
    """Every parameter's gradient against one-process training's."""
    grads = got["grads"]
    for index, (i, name, ref) in enumerate(mine):
        g = grads[index] if isinstance(grads, list) and index < len(grads) else None
        if not isinstance(g, torch.Tensor):
            return (f"{label}: on stage {rank}, layer {i}'s {name} has no gradient. Every B must backpropagate "
                    "through this stage's modules.")
        if g.shape != ref.grad.shape or not torch.allclose(g, ref.grad, **tolerance(ref.grad.dtype)):
            ratio = (g.flatten() @ ref.grad.flatten() / ref.grad.flatten().pow(2).sum().clamp_min(1e-30)).item() \
                if g.shape == ref.grad.shape else 0.0
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
            values = f" Got {short(g, 2)}, expected {short(ref.grad, 2)}."
            return message + values if len(message + values) < 360 else message   # the hint first
    return None


def _traffic_problem(rank, p, m, label, cc, act_bytes):
    """From the host's record: point-to-point messages with the neighbouring stages only, and each micro-batch's
    activation (to rank + 1) and gradient (to rank - 1) crossing as bytes, with no more than a little metadata."""
    other = sorted({c.kind for c in cc.calls} - {"send", "recv"})
    if other:
        return (f"{label}: rank {rank} called torch.distributed.{other[0]}: a pipeline passes activations and "
                "gradients with point-to-point messages only (send/recv, isend/irecv).")
    peers = {c.peer for c in cc.calls if c.peer is not None}
    if peers - {rank - 1, rank + 1}:
        return (f"{label}: rank {rank} exchanged messages with rank(s) {sorted(peers - {rank - 1, rank + 1})}; a "
                "stage only talks to its neighbours (activations to rank + 1, gradients to rank - 1).")
    for peer, what in ((rank + 1, "activation"), (rank - 1, "activation's gradient")):
        if not 0 <= peer < p:
            continue
        sent = sum(c.nbytes for c in cc.calls if c.kind == "send" and c.peer == peer)
        if not m * act_bytes <= sent <= m * (act_bytes + METADATA):
            return (f"{label}: rank {rank} sent {sent} bytes to rank {peer}; each of the {m} micro-batches' "
                    f"{what} ({act_bytes} bytes) must cross to stage {peer} as a message of its own tensor, once: "
                    f"{m * act_bytes} bytes.")
    return None


def _pipeline_probe(run_pipeline, cases):
    """All cases on this rank; every case ends with all ranks agreeing whether one failed."""
    # what torch imports at a stage's first backward(grad) (sympy: a second of CPU), imported here so that a sandbox
    # forked from this worker has it, and no rank is still importing while its neighbours wait for its messages
    import torch.fx.experimental.symbolic_shapes  # noqa: F401

    for num_layers, m, kind, rows, seed in cases:
        failure = _pipeline_case(run_pipeline, num_layers, m, kind, rows, seed)
        if _agree(failure):
            return failure
    return None


def check_run_pipeline(run_pipeline, world_sizes=(2, 3, 4), timeout=None) -> None:
    """Loss and every gradient equal to one-process training, on 2, 3 and 4 stages, GPipe and 1F1B, any (p, m)."""
    seed = draw_seed()
    rng = random.Random(seed)
    run_pipeline = in_sandbox(run_pipeline, "run_pipeline(stage_module, schedule, microbatches, targets, loss_fn)",
                              driver=drive_pipeline)
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
