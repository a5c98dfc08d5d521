"""What runs in the grading sandbox for ``check_run_pipeline``: the layers of one stage, the stage that records its
forward and backward passes, and ``drive_pipeline``, which builds this rank's stage from the parameters the host
drew and calls the student's ``run_pipeline`` on it.

This module travels by value to the sandbox (``in_sandbox``'s ``driver``), so it imports only the standard library
and torch. What ``drive_pipeline`` returns is the student's answer: the host compares it with its own one-process
training, and reads what crossed to the other stages from its own record.
"""

from __future__ import annotations

import torch
import torch.nn as nn

D = 6  # width of every layer: stage inputs and outputs all have the micro-batch's shape (rows, D)


class _Residual(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def layer(kind: int, d: int = D) -> nn.Module:
    """One of four kinds of layers (``kind`` modulo 4), all of width ``d``."""
    kind %= 4
    if kind == 0:
        return nn.Sequential(nn.Linear(d, d), nn.Tanh())
    if kind == 1:
        return _Residual(d)
    if kind == 2:
        return nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d, bias=False), nn.GELU())
    return nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))


def loss_fn(out, target):
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
    """The stage handed to ``run_pipeline``: runs ``inner`` and records ``("F", k)`` for the k-th forward call and
    ``("B", k)`` when that forward's backward starts on this stage."""

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


def drive_pipeline(run_pipeline, kinds, params, schedule, microbatches, targets):
    """This rank's stage (layers of ``kinds`` holding ``params``, in ``parameters()`` order) run by the student's
    ``run_pipeline``: ``{"loss": what it returned, "events": the stage's F/B record, "grads": each parameter's
    .grad}``."""
    inner = nn.Sequential(*[layer(k) for k in kinds])
    with torch.no_grad():
        for p, value in zip(inner.parameters(), params):
            p.copy_(value)
    stage = RecordingStage(inner)
    loss = run_pipeline(stage, schedule, microbatches, targets, loss_fn)
    return {"loss": loss, "events": list(stage.events), "grads": [p.grad for p in inner.parameters()]}
