"""What runs on the workers: one probe per exercise, on ``ProbeNet``, compared with one-process training.

Probes keep all ranks in step: after each phase every rank reports whether it found a problem (``_agree``: one small
all-reduce, outside the counted region) and all stop together, so a wrong answer never turns into a deadlock.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from labsupport.comm import recorded_calls

from .diagnose import _calls_failure, _grad_mismatch, _overlap_failure, _state_mismatch
from .model import _data, _loss, _make_model, _names
from .reference import _layout

LR, MOMENTUM = 0.05, 0.9


def _agree(failure) -> bool:
    """Every rank learns whether any rank found a problem (so all stop at the same point)."""
    import torch.distributed as dist

    flag = torch.tensor([0 if failure is None else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _rank_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _student_call(what: str, fn, *args, hint: str = "", **kwargs):
    """Call the student's code; an unexpected exception becomes a message naming the call."""
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, AssertionError):
        raise
    except Exception as exc:
        raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}. {hint}".strip()) from None


def _guarded(body, *args):
    """Run a probe body; an AssertionError (a wrong answer, or the student's code raising) becomes the rank's
    failure message, agreed on with the other ranks, so the workers survive for the next check."""
    try:
        return body(*args)
    except AssertionError as exc:
        failure = str(exc)
    _agree(failure)
    return failure


def _probe_broadcast(fn, seed: int, src):
    rank, _ = _rank_world()
    model = _make_model(seed + 1000 * rank)
    model.seen.fill_(rank)  # integer buffers differ too
    actual_src = 0 if src is None else src
    expected = _make_model(seed + 1000 * actual_src)
    expected.seen.fill_(actual_src)
    call = "broadcast_parameters(model)" if src is None else f"broadcast_parameters(model, src={src})"
    params_before = list(model.parameters())
    _student_call(call, fn, model) if src is None else _student_call(call, fn, model, src=src)
    failure = _state_mismatch(
        model, expected, f"after {call}, on rank {rank}",
        f"Every parameter and every buffer (module.buffers(), integer ones included) of every rank must equal "
        f"rank {actual_src}'s, in place.",
    )
    params_after = list(model.parameters())
    if failure is None and (len(params_after) != len(params_before)
                            or any(a is not b for a, b in zip(params_after, params_before))):
        failure = (f"after {call}, on rank {rank}: the model's Parameter objects were replaced; copy the values into "
                   "the existing tensors (an optimizer built before the call must still see them).")
    _agree(failure)
    return failure


def _probe_average(fn, seed: int, rows: int):
    rank, world = _rank_world()
    x, y = _data(seed, rows * world)
    shard = slice(rank * rows, (rank + 1) * rows)
    oracle = _make_model(seed)
    _loss(oracle, x, y).backward()
    model = _make_model(seed)
    _loss(model, x[shard], y[shard]).backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _student_call(
        "average_gradients(model)", fn, model,
        hint="Some parameters have no gradient (.grad is None: frozen, requires_grad=False, or unused in forward): "
             "skip them.",
    )
    failure = _grad_mismatch(model, oracle, local, world, f"after average_gradients(model), on rank {rank}")
    if failure is None:
        for n, p in model.named_parameters():
            if not torch.equal(p.detach(), before[n]):
                failure = (f"after average_gradients(model), on rank {rank}: parameter '{n}' changed; only the "
                           ".grad tensors may change (the optimizer updates the weights).")
                break
    _agree(failure)
    return failure


def _build(cls, name, model, cap_mb):
    """``cls(model)`` (OverlapDDP: ``cap_mb`` None), ``cls(model, cap_mb)``, or ``cls(model, None)`` for an
    infinite cap (one bucket)."""
    if cap_mb is None:
        label, args = f"{name}(model)", ()
    elif math.isinf(cap_mb):
        label, args = f"{name}(model, bucket_size_mb=None)", (None,)
    else:
        label, args = f"{name}(model, bucket_size_mb={cap_mb:.6g})", (cap_mb,)
    wrapped = _student_call(label, cls, model, *args)
    if not isinstance(wrapped, nn.Module):
        raise AssertionError(f"{label} should be an nn.Module (subclass nn.Module), got {type(wrapped).__name__}.")
    if not callable(getattr(wrapped, "finish_gradient_synchronization", None)):
        raise AssertionError(f"{label} has no finish_gradient_synchronization() method.")
    return label, wrapped


class _Watch:
    """The checker's own post-accumulate hooks: for each gradient that becomes ready, how many all-reduces had been
    issued by then (read from the active CommCounter)."""

    def __init__(self, model):
        self.counter = None
        self.events = []  # (param name, all-reduces issued so far)
        self.handles = []
        for p, name in _names(model).items():
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(lambda _p, name=name: self._ready(name)))

    def issued(self) -> int:
        if self.counter is None:
            return 0
        return sum(1 for kind, *_ in recorded_calls(self.counter) if kind == "all_reduce")

    def _ready(self, name):
        self.events.append((name, self.issued()))


def _probe_ddp(cls, name: str, seed: int, rows: int, cap_mb, steps: int, micro: int, cycles: int):
    import labsupport

    rank, world = _rank_world()
    overlap = cap_mb is None
    model = _make_model(seed + 1000 * rank)
    model.seen.fill_(rank)
    reference = _make_model(seed)
    reference.seen.fill_(0)
    label, wrapped = _build(cls, name, model, cap_mb)

    # 1. construction: rank 0's parameters and buffers everywhere
    failure = _state_mismatch(model, reference, f"after {label}, on rank {rank}",
                              "The wrapper must broadcast rank 0's parameters and buffers when it is built.")
    if _agree(failure):
        return failure

    names = _names(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    cap_bytes = None if overlap else cap_mb * 2**20
    buckets = [[p] for p in reversed(trainable)] if overlap else _layout(list(reversed(trainable)), cap_bytes)
    watch = _Watch(model)
    oracle = _make_model(seed)
    oracle.seen.fill_(0)
    opt = torch.optim.SGD(wrapped.parameters(), lr=LR, momentum=MOMENTUM)
    oracle_opt = torch.optim.SGD(oracle.parameters(), lr=LR, momentum=MOMENTUM)
    x_all, y_all = _data(seed, rows * world * (steps + cycles * (micro + 1)))
    cursor = 0

    def batch(n_micro):
        nonlocal cursor
        xs, ys = [], []
        for _ in range(n_micro):
            block = slice(cursor, cursor + rows * world)
            cursor += rows * world
            xs.append(x_all[block])
            ys.append(y_all[block])
        return xs, ys

    def synced_backward(x, y, scale, where):
        """forward + backward + finish with the counter on; returns (calls, message or None)."""
        watch.events.clear()
        with labsupport.CommCounter() as cc:
            watch.counter = cc
            loss = _student_call(f"{label}: forward", wrapped, x)
            loss = ((loss - y) ** 2).mean() * scale
            loss.backward()
            after_backward = sum(1 for kind, *_ in recorded_calls(cc) if kind == "all_reduce")
            _student_call(f"{label}.finish_gradient_synchronization()", wrapped.finish_gradient_synchronization)
        watch.counter = None
        calls = list(cc.calls)
        total = sum(1 for c in calls if c.kind == "all_reduce")
        fail = _calls_failure(calls, buckets, model, cap_bytes, label, where, overlap)
        if fail is None:
            fail = _overlap_failure(watch, buckets, names, after_backward, total, label, where)
        return fail

    shard = slice(rank * rows, (rank + 1) * rows)

    # 2. plain synchronised steps, compared with the single-process oracle
    for step in range(1, steps + 1):
        (xb,), (yb,) = batch(1)
        local_model = _make_model(0)
        local_model.load_state_dict(model.state_dict())
        _loss(local_model, xb[shard], yb[shard]).backward()
        local = {n: p.grad.clone() for n, p in local_model.named_parameters() if p.grad is not None}
        for p in local_model.parameters():  # the local gradient is only needed for the message
            p.grad = None
        failure = synced_backward(xb[shard], yb[shard], 1.0, f"step {step}")
        if failure is None:
            _loss(oracle, xb, yb).backward()
            failure = _grad_mismatch(model, oracle, local, world,
                                     f"{label}, step {step}, after finish_gradient_synchronization(), on rank {rank}")
        if _agree(failure):
            return failure
        opt.step()
        oracle_opt.step()
        opt.zero_grad()
        oracle_opt.zero_grad()
        failure = _state_mismatch(model, oracle, f"{label}, after optimizer step {step}, on rank {rank}",
                                  "The weights drifted from one-process training on the whole batch.")
        if _agree(failure):
            return failure

    # 3. gradient accumulation: `micro` backward passes under no_sync, then a synchronised one
    for cycle in range(1, cycles + 1):
        xs, ys = batch(micro + 1)
        scale = 1.0 / (micro + 1)
        failure = None
        if not callable(getattr(wrapped, "no_sync", None)):
            failure = f"{label} has no no_sync() method (a context manager)."
        for i in range(micro):
            if failure:
                break
            with labsupport.CommCounter() as cc:
                ctx = _student_call(f"{label}.no_sync()", wrapped.no_sync)
                with ctx:
                    out = _student_call(f"{label}: forward inside no_sync()", wrapped, xs[i][shard])
                    (((out - ys[i][shard]) ** 2).mean() * scale).backward()
            if cc.collectives or cc.count("send") or cc.count("recv"):
                kinds = [c.kind for c in cc.calls]
                failure = (f"{label}, accumulation cycle {cycle}, micro-batch {i + 1} inside no_sync(): {len(kinds)} "
                           f"communication call(s) ({', '.join(sorted(set(kinds)))}); forward and backward inside "
                           "no_sync() must not communicate at all: let the gradients accumulate locally.")
        if failure is None:
            failure = synced_backward(xs[micro][shard], ys[micro][shard], scale,
                                      f"accumulation cycle {cycle}, the synchronised backward after {micro} "
                                      "micro-batches under no_sync()")
            if failure is not None:
                failure += (" Check that nothing the hooks did under no_sync() (such as counting gradients as "
                            "ready) carries over into this step.")
        if failure is None:
            for i in range(micro + 1):
                _loss(oracle, xs[i], ys[i], scale).backward()
            failure = _grad_mismatch(model, oracle, {}, world,
                                     f"{label}, after {micro} micro-batches under no_sync() and one synchronised "
                                     f"(accumulation cycle {cycle}), on rank {rank}")
            if failure is not None:
                failure += (" The synchronised backward must average the gradient ACCUMULATED over all the "
                            "micro-batches (no_sync must not drop or overwrite what accumulated).")
        if _agree(failure):
            return failure
        opt.step()
        oracle_opt.step()
        opt.zero_grad()
        oracle_opt.zero_grad()
    return None
