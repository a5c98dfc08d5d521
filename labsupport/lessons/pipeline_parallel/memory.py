"""Measuring activation memory on the CPU, and activation checkpointing.

A CPU has no ``torch.cuda.max_memory_allocated``. ``LiveBytes`` does the same job for the tensors a piece of code
creates: a ``TorchDispatchMode`` sees every operation's outputs, keeps a weak reference to each new storage, and
after every operation adds up the storages still alive. A view (``w.t()``, ``x[0]``) shares its input's storage and
is not new memory; a storage freed and reused at the same address is seen as freed first. Tensors created before the
block (parameters, pre-allocated gradients, the inputs) are not counted. Backward runs inside the mode too, so the
peak includes what backward allocates. It costs a Python call per operation: fine for toy models.

``checkpoint_sweep`` measures activation checkpointing on a chain of ``n`` layers cut into segments of ``k``:
``torch.utils.checkpoint.checkpoint`` keeps only each segment's input during forward and recomputes the segment's
inside during backward, so about ``n / k`` inputs stay alive after forward, plus ``k`` layers' activations while one
segment is recomputed; ``k = sqrt(n)`` minimises the sum (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost", arXiv 1604.06174), at the price of one extra forward.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes", "CheckpointedStage", "checkpoint_sweep"]


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as meter: ...``: ``meter.live`` bytes alive now, ``meter.peak`` the most at any moment.

    Example::

        with LiveBytes() as meter:
            loss = model(x).pow(2).mean()
            kept = meter.live               # what forward keeps for backward (and the loss)
            loss.backward()
        meter.peak
    """

    def __init__(self):
        super().__init__()
        self._refs = {}  # storage address -> (weak reference, bytes)
        self.live = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._purge()
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in inputs and key not in self._refs and storage.nbytes():
                    from torch.multiprocessing.reductions import StorageWeakRef

                    self._refs[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        return out

    def _purge(self) -> None:
        dead = [k for k, (ref, _) in self._refs.items() if ref.expired()]
        for k in dead:
            self.live -= self._refs.pop(k)[1]

    def __exit__(self, *exc):
        self._purge()
        return super().__exit__(*exc)


class CheckpointedStage(nn.Module):
    """Runs the blocks of ``stage`` (an ``nn.Sequential``) in segments of ``every`` blocks, each under
    ``torch.utils.checkpoint.checkpoint``: only the segments' inputs are kept for backward."""

    def __init__(self, stage: nn.Sequential, every: int = 1):
        super().__init__()
        self.stage = stage
        self.every = max(1, every)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        blocks = list(self.stage)
        for i in range(0, len(blocks), self.every):
            segment = nn.Sequential(*blocks[i:i + self.every])
            x = checkpoint(segment, x, use_reentrant=False)
        return x


def _chain(num_layers: int, width: int, seed: int = 0) -> nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(num_layers)])


def checkpoint_sweep(num_layers: int = 16, width: int = 256, rows: int = 256, every=(0, 1, 2, 4, 8, 16),
                     repeats: int = 3) -> list:
    """For each segment length ``k`` in ``every`` (0 = no checkpointing): one forward and backward of a chain of
    ``num_layers`` blocks on ``rows`` x ``width`` inputs. Returns dicts with ``k``, ``kept`` (bytes alive after
    forward), ``peak`` (bytes alive at the worst moment, backward included), ``seconds`` (the fastest forward+backward of
    ``repeats`` runs, measured without the meter: other programs only ever add time), ``forward_seconds`` and ``unit`` (bytes of one
    ``rows x width`` activation). Gradients are allocated beforehand and not counted. Runs on one thread (as each
    worker does): several threads spinning on a busy machine turn milliseconds into seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _sweep(num_layers, width, rows, every, repeats)
    finally:
        torch.set_num_threads(threads)


def _sweep(num_layers, width, rows, every, repeats):
    model = _chain(num_layers, width)
    x = torch.randn(rows, width)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    rows_out = []
    for k in every:
        net = model if k == 0 else CheckpointedStage(model, k)
        net(x).pow(2).mean().backward()  # warm-up
        with LiveBytes() as meter:
            loss = net(x).pow(2).mean()
            kept = meter.live
            loss.backward()
            del loss
        times, fwd = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            loss = net(x).pow(2).mean()
            mid = time.perf_counter()
            loss.backward()
            times.append(time.perf_counter() - start)
            fwd.append(mid - start)
        rows_out.append({"k": k, "kept": kept, "peak": meter.peak, "seconds": min(times),
                         "forward_seconds": min(fwd), "unit": rows * width * x.element_size()})
    return rows_out
