"""Data parallelism in ONE process, with threads: what ``torch.nn.DataParallel`` does, on CPU replicas.

Notebook 03 uses this to show why DP loads its first device more than the others. One training step:

1. ``replicate``: copy the master's weights into every replica (the master is replica 0);
2. ``scatter``: split the batch along dimension 0, one chunk per replica;
3. ``parallel_apply``: one Python thread per replica runs its forward pass;
4. ``gather``: the outputs are concatenated on the master, which computes the loss;
5. backward: the master scatters the output gradient back, and each thread runs its replica's backward;
6. ``reduce_gradients``: the master receives every replica's gradients and sums them into its own;
7. the optimizer steps on the master only (the replicas are overwritten at the next step anyway).

Steps 1, 4, 6 and 7 run on the master alone, and the master alone holds the whole batch, the gathered outputs,
the gradients received from the others and the optimizer state. ``dp_step`` measures both: the bytes of the tensors
each replica holds (``MemoryReport``) and the seconds each replica is busy.

``ddp_rank_report`` measures the same categories on one rank of a step under PyTorch's
``DistributedDataParallel`` (call it inside ``labsupport.run``, one process per rank): every rank holds the same
things, so the bars come out level.

Example::

    from labsupport.lessons import data_parallel as lesson
    model = lesson.TinyLM()
    opt = torch.optim.Adam(model.parameters())
    report = lesson.dp_step(model, opt, tokens, targets, num_replicas=4)
    lesson.plot_dp_memory(report)
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "TinyLM",
    "replicate",
    "scatter",
    "parallel_apply",
    "gather",
    "reduce_gradients",
    "dp_step",
    "ddp_rank_report",
    "MemoryReport",
    "CATEGORIES",
]

#: What a device holds during a step, in the order the plots stack them.
CATEGORIES = (
    "parameters",
    "gradients",
    "activations",
    "outputs",
    "input batch",
    "communication buffers",
    "optimizer state",
)


class TinyLM(nn.Module):
    """A small next-token model whose output (batch x tokens x vocabulary logits) is big, like a language model's."""

    def __init__(self, vocab: int = 2000, dim: int = 64, hidden: int = 256):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, tokens):  # (B, T) -> (B, T, vocab)
        return self.out(torch.relu(self.up(self.embed(tokens))))


@dataclass
class MemoryReport:
    """Bytes each replica (or rank) holds per category, and seconds each was busy."""

    title: str
    bytes: list = field(default_factory=list)  # one dict category -> bytes per replica
    seconds: list = field(default_factory=list)  # one dict phase -> seconds per replica

    def total(self, i: int) -> int:
        return sum(self.bytes[i].values())


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class _SavedBytes:
    """Count the bytes autograd saves for backward in this thread (the activations)."""

    def __init__(self, module: nn.Module):
        self.total = 0
        self._seen = set()
        # weights are saved too (as views, e.g. W.t() for a matmul): they are not activations
        self._weights = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        key = (ptr, t.numel(), t.dtype)
        if key not in self._seen and ptr not in self._weights:
            self._seen.add(key)
            self.total += t.numel() * t.element_size()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def replicate(master: nn.Module, replicas: list) -> list:
    """Copy the master's parameters and buffers into each replica (replica 0 IS the master). Returns the replicas."""
    if not replicas:
        replicas.append(master)
    with torch.no_grad():
        for r in replicas[1:]:
            for dst, src in zip(r.parameters(), master.parameters()):
                dst.copy_(src)
            for dst, src in zip(r.buffers(), master.buffers()):
                dst.copy_(src)
    return replicas


def scatter(batch: torch.Tensor, n: int) -> list:
    """Split the batch along dimension 0 into ``n`` chunks (all on the master first: it loaded the whole batch)."""
    return list(batch.chunk(n))


def parallel_apply(replicas: list, inputs: list, seconds: list, activations: list) -> list:
    """Run ``replicas[i](inputs[i])`` in one thread per replica; record each thread's time and saved bytes."""
    outputs = [None] * len(replicas)
    errors = []

    def work(i):
        try:
            saved = _SavedBytes(replicas[i])
            start = time.perf_counter()
            with saved.hooks():
                outputs[i] = replicas[i](inputs[i])
            seconds[i]["forward"] += time.perf_counter() - start
            activations[i] = saved.total
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return outputs


def gather(outputs: list) -> torch.Tensor:
    """Concatenate the replicas' outputs on the master (a copy: the master now holds every replica's output)."""
    return torch.cat([o.detach() for o in outputs]).requires_grad_(True)


def reduce_gradients(master: nn.Module, replicas: list) -> int:
    """Sum every replica's gradients into the master's. Returns the bytes the master received (copies of the other
    replicas' gradients: on GPUs they travel to device 0 before they can be added)."""
    received = 0
    with torch.no_grad():
        for r in replicas[1:]:
            for dst, src in zip(master.parameters(), r.parameters()):
                if src.grad is None:
                    continue
                incoming = src.grad.clone()  # the copy that lands on the master
                received += incoming.numel() * incoming.element_size()
                if dst.grad is None:
                    dst.grad = incoming
                else:
                    dst.grad += incoming
    return received


def dp_step(master, optimizer, inputs, targets, num_replicas: int = 4, replicas: list | None = None) -> MemoryReport:
    """One DP training step on ``num_replicas`` thread replicas; returns what each replica held and how busy it was.

    ``replicas`` (a list) is reused between calls if given: the copies are made once, then refreshed each step.
    """
    n = num_replicas
    if replicas is None:
        replicas = []
    if not replicas:
        replicas.append(master)
        replicas.extend(copy.deepcopy(master) for _ in range(n - 1))
    seconds = [{"forward": 0.0, "backward": 0.0, "master only": 0.0} for _ in range(n)]
    activations = [0] * n

    t = time.perf_counter()
    replicate(master, replicas)
    x_chunks, y_chunks = scatter(inputs, n), scatter(targets, n)
    seconds[0]["master only"] += time.perf_counter() - t

    outputs = parallel_apply(replicas, x_chunks, seconds, activations)

    t = time.perf_counter()
    gathered = gather(outputs)  # (B, T, vocab) on the master
    loss = F.cross_entropy(gathered.flatten(0, -2), targets.flatten())
    loss.backward()  # only as far as the gathered outputs: d loss / d outputs, on the master
    grad_chunks = scatter(gathered.grad, n)
    seconds[0]["master only"] += time.perf_counter() - t

    def backward(i):
        start = time.perf_counter()
        outputs[i].backward(grad_chunks[i])
        seconds[i]["backward"] += time.perf_counter() - start

    threads = [threading.Thread(target=backward, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()

    t = time.perf_counter()
    received = reduce_gradients(master, replicas)
    optimizer.step()
    seconds[0]["master only"] += time.perf_counter() - t

    report = MemoryReport(title=f"DataParallel, {n} replicas in one process")
    params = _nbytes(master.parameters())
    grads = _nbytes(p.grad for p in master.parameters())
    state = _nbytes(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    for i in range(n):
        held = {c: 0 for c in CATEGORIES}
        held["parameters"] = params
        held["gradients"] = grads
        held["activations"] = activations[i]
        held["outputs"] = 2 * _nbytes([outputs[i]])  # its output and the output's gradient
        if i == 0:
            held["outputs"] += 2 * _nbytes([gathered])  # the gathered outputs and their gradient
            held["input batch"] = _nbytes([inputs, targets])
            held["communication buffers"] = received
            held["optimizer state"] = state
        else:
            held["input batch"] = _nbytes([x_chunks[i], y_chunks[i]])
        report.bytes.append(held)
    report.seconds = seconds
    for r in replicas[1:]:
        r.zero_grad(set_to_none=True)
    optimizer.zero_grad(set_to_none=True)
    return report


def ddp_rank_report(make_model, inputs, targets, seed: int = 0) -> dict:
    """Inside ``labsupport.run``: one training step with Adam under ``torch.nn.parallel.DistributedDataParallel`` on
    this rank's share of the batch; returns ``{"bytes": {category: bytes}, "seconds": {phase: seconds}}`` for this
    rank.

    PyTorch's own DDP does the communication (rank 0's weights broadcast when it wraps the model, gradients
    averaged in buckets during backward), so the tensors held are those of a real DDP rank. Its reducer keeps one
    flat buffer per bucket, together as large as the gradients (``gradient_as_bucket_view=False``, the default):
    those are the communication buffers.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed + rank)
    model = make_model()
    ddp = DistributedDataParallel(model)  # every rank now holds rank 0's weights
    optimizer = torch.optim.Adam(model.parameters())
    x, y = inputs.chunk(world)[rank], targets.chunk(world)[rank]  # each rank loads only its share
    saved = _SavedBytes(model)
    start = time.perf_counter()
    with saved.hooks():
        out = ddp(x)
    forward = time.perf_counter() - start
    start = time.perf_counter()
    loss = F.cross_entropy(out.flatten(0, -2), y.flatten())
    loss.backward()  # DDP's hooks all-reduce the buckets while backward runs, and wait for them before it returns
    backward = time.perf_counter() - start
    start = time.perf_counter()
    optimizer.step()
    other = time.perf_counter() - start
    params = list(model.parameters())
    held = {c: 0 for c in CATEGORIES}
    held["parameters"] = _nbytes(params)
    held["gradients"] = _nbytes(p.grad for p in params)
    held["activations"] = saved.total
    held["outputs"] = 2 * _nbytes([out])
    held["input batch"] = _nbytes([x, y])
    held["communication buffers"] = _nbytes(p.grad for p in params if p.requires_grad)  # the reducer's buckets
    held["optimizer state"] = _nbytes(
        v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    return {"bytes": held, "seconds": {"forward": forward, "backward": backward, "master only": 0.0,
                                       "optimizer": other}}
