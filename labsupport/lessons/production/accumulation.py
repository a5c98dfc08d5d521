"""One optimizer step over several micro-batches, for notebook 09_production: ``accumulation_step`` takes it each way
of ``ACCUMULATION_WAYS`` (``no_sync``, clipping once, ``unscale_`` before clipping) with torch's DDP,
``clip_grad_norm_`` and ``GradScaler``, against one process.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn


#: The ways ``accumulation_step`` takes the step, in the order it reports them.
ACCUMULATION_WAYS = (
    "no_sync, clip once after the last micro-batch",
    "all-reduce after every micro-batch, clip once",
    "clip after every micro-batch",
    "GradScaler: unscale_, then clip",
    "GradScaler: clip the scaled gradients",
)


def _accumulation_model() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _accumulation_batch(rows: int):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(rows, 16, generator=gen), 3 * torch.randn(rows, 4, generator=gen)


def accumulation_step(micro_batches: int = 4, batch: int = 4, max_norm: float = 0.5, init_scale: float = 2.0**12,
                      lr: float = 0.1) -> dict:
    """On every rank of the default group (N ranks): one SGD step of gradient accumulation over ``micro_batches``
    micro-batches of ``batch`` samples per rank, taken each way of ``ACCUMULATION_WAYS`` with torch's
    ``DistributedDataParallel``, ``clip_grad_norm_`` and ``GradScaler("cpu")``, against one process that takes the
    same step on the whole global batch (N · micro_batches · batch samples, the loss their mean) with its gradient
    clipped to ``max_norm``. Each micro-batch's loss is divided by ``micro_batches``, so the accumulated gradient is
    the mean's.

    Returns ``{way: {"allreduces": the gradient all-reduces DDP made (one per bucket per synchronised backward),
    "norm": the norm clip_grad_norm_ returned (its last call), "error": largest |update - one process's update| /
    largest |one process's update|}}``; ``"one process"`` holds the reference's norm."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    rank, world, k = dist.get_rank(), dist.get_world_size(), micro_batches
    x, y = _accumulation_batch(world * k * batch)
    start = [p.detach().clone() for p in _accumulation_model().parameters()]

    ref = _accumulation_model()                                  # one process, the whole global batch
    F.mse_loss(ref(x), y).backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    ref_update = [p.detach() - s for p, s in zip(ref.parameters(), start)]
    scale = max(u.abs().max() for u in ref_update)

    def counting_hook(state, bucket):                           # DDP's own all-reduce, counted
        state["allreduces"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    mine = slice(rank * k * batch, (rank + 1) * k * batch)      # this rank's samples, cut into micro-batches
    xs, ys = x[mine].chunk(k), y[mine].chunk(k)
    out = {"one process": {"allreduces": 0, "norm": ref_norm, "error": 0.0}}
    for way in ACCUMULATION_WAYS:
        model = _accumulation_model()
        ddp = DistributedDataParallel(model)
        state = {"allreduces": 0}
        ddp.register_comm_hook(state, counting_hook)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if way.startswith("GradScaler") else None
        norm = None
        for i in range(k):
            last = i == k - 1
            quiet = ddp.no_sync() if not last and not way.startswith("all-reduce") else contextlib.nullcontext()
            with quiet:
                loss = F.mse_loss(ddp(xs[i]), ys[i]) / k
                (scaler.scale(loss) if scaler else loss).backward()
            if way == "clip after every micro-batch":
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if scaler is not None and "unscale_" in way:
            scaler.unscale_(opt)                                 # now the gradients are the true ones
        if way != "clip after every micro-batch":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if scaler is not None:
            scaler.step(opt)                                     # unscales first unless unscale_ already did
            scaler.update()
        else:
            opt.step()
        update = [p.detach() - s for p, s in zip(model.parameters(), start)]
        error = max((u - r).abs().max() for u, r in zip(update, ref_update)) / scale
        out[way] = {"allreduces": state["allreduces"], "norm": float(norm), "error": float(error)}
    return out
