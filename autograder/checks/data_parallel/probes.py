"""What runs on the workers (each rank's host): one probe per exercise. A probe draws its inputs, runs the student's
code in its rank's sandbox through a driver (``drivers``), giving it only this rank's starting weights and data,
and compares what comes back, and its own record of the calls it carried, with one-process training on ProbeNet.

Every rank reaches one verdict, then all agree on whether any failed (``_agree``: one small all-reduce of the host's,
outside any record), so all return together; inside the DDP scenario the driver's marks stop every rank at the same
point when the student's code raises on one.
"""

from __future__ import annotations

import math

import torch

import labsupport
from labsupport._driving import call_answer_hinted

from .diagnose import _calls_failure, _grad_mismatch, _launch_failure, _state_mismatch
from .drivers import INSIDE, PHASE, SGD, _data, _loss, _make_model, _names, state_of
from .reference import _layout

LR, MOMENTUM = 0.05, 0.9
#: The verdict of a rank whose scenario stopped because another rank's failed: that rank's message is shown.
STOPPED = "the scenario stopped early because another rank failed"
RETURNED = ("what the scenario returned is not what it returns (something in the sandbox changed it); graded as a "
            "failure.")
#: How each stage of the DDP scenario is named in a message about an error raised there.
STAGES = {"build": "", "forward": ": forward", "backward": ": loss.backward()",
          "finish": ".finish_gradient_synchronization()",
          "after": ": reading .grad after finish_gradient_synchronization(), or the optimizer step",
          "no_sync": ": forward and backward inside no_sync()"}


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
    return call_answer_hinted(what, hint, fn, *args, **kwargs)


def _guarded(body, *args):
    """Run a probe body; an AssertionError (a wrong answer, or the student's code raising) becomes the rank's
    failure message, agreed on with the other ranks, so the workers survive for the next check."""
    try:
        return body(*args)
    except AssertionError as exc:
        failure = str(exc)
    _agree(failure)
    return failure


def _start(seed: int, rank: int):
    """Rank ``rank``'s starting model: its own weights, and its rank in the integer buffer."""
    model = _make_model(seed + 1000 * rank)
    model.seen.fill_(rank)
    return model


def _buffers(model) -> set:
    return {n for n, _ in model.named_buffers()}


def _probe_broadcast(fn, seed: int, src):
    rank, _ = _rank_world()
    actual_src = 0 if src is None else src
    expected = _start(seed, actual_src)
    call = "broadcast_parameters(model)" if src is None else f"broadcast_parameters(model, src={src})"
    seen = _student_call(call, fn, state_of(_start(seed, rank)), src)
    failure = RETURNED if type(seen) is not dict else _state_mismatch(
        seen.get("state"), state_of(expected), _buffers(expected), f"after {call}, on rank {rank}",
        f"Every parameter and every buffer (module.buffers(), integer ones included) of every rank must equal "
        f"rank {actual_src}'s, in place.",
    )
    if failure is None and seen.get("same_objects") is not True:
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
    local = _local_grads(oracle, x[shard], y[shard])
    start = state_of(_make_model(seed))
    seen = _student_call(
        "average_gradients(model)", fn, start, x[shard].clone(), y[shard].clone(),
        hint="Some parameters have no gradient (.grad is None: frozen, requires_grad=False, or unused in forward): "
             "skip them.",
    )
    what = f"after average_gradients(model), on rank {rank}"
    failure = RETURNED if type(seen) is not dict else _grad_mismatch(seen.get("grads"), oracle, local, world, what)
    if failure is None:
        after = seen.get("state") if type(seen.get("state")) is dict else {}
        for n, _ in oracle.named_parameters():
            value = after.get(n)
            if not (isinstance(value, torch.Tensor) and torch.equal(value, start[n])):
                failure = (f"{what}: parameter '{n}' changed; only the .grad tensors may change (the optimizer "
                           "updates the weights).")
                break
    _agree(failure)
    return failure


def _local_grads(model, x, y) -> dict:
    """The gradients this rank's shard alone gives at ``model``'s weights (only to word a message)."""
    copy = _make_model(0)
    copy.load_state_dict(model.state_dict())
    _loss(copy, x, y).backward()
    return {n: p.grad for n, p in copy.named_parameters() if p.grad is not None}


def _label(name: str, cap_mb):
    """``cls(model)`` (OverlapDDP: ``cap_mb`` None), ``cls(model, cap_mb)``, or ``cls(model, None)`` for an
    infinite cap (one bucket): the call as messages show it, and its arguments after the model."""
    if cap_mb is None:
        return f"{name}(model)", ()
    if math.isinf(cap_mb):
        return f"{name}(model, bucket_size_mb=None)", (None,)
    return f"{name}(model, bucket_size_mb={cap_mb:.6g})", (cap_mb,)


def _probe_ddp(fn, name: str, seed: int, rows: int, cap_mb, steps: int, micro: int, cycles: int):
    rank, world = _rank_world()
    label, args = _label(name, cap_mb)
    n = rows * world
    x_all, y_all = _data(seed, n * (steps + cycles * (micro + 1)))
    blocks = [(x_all[i:i + n], y_all[i:i + n]) for i in range(0, len(x_all), n)]
    shard = slice(rank * rows, (rank + 1) * rows)
    with labsupport.CommCounter() as cc:
        seen = fn(args, state_of(_start(seed, rank)), [(x[shard].clone(), y[shard].clone()) for x, y in blocks],
                  steps, micro, cycles, LR, MOMENTUM)
    judge = _Judge(name, label, seen, list(cc.calls), seed, blocks, shard, cap_mb)
    failure = judge.verdict(steps, micro, cycles)
    _agree(failure)
    return failure


def _is_mark(call) -> bool:
    return call.kind == "all_gather" and call.nbytes in (PHASE, INSIDE)


class _Judge:
    """The DDP scenario as the host saw it: its record split at the driver's phase marks, walked phase by phase
    against one-process training (the oracle: rank 0's starting model, trained on the whole batch)."""

    def __init__(self, what, label, seen, calls, seed, blocks, shard, cap_mb):
        self.what, self.label, self.seen, self.blocks, self.shard = what, label, seen, iter(blocks), shard
        self.rank, self.world = _rank_world()
        self.phases, current = [], []
        for c in calls:
            if c.kind == "all_gather" and c.nbytes == PHASE:
                self.phases.append(current)
                current = []
            else:
                current.append(c)
        self.trailing = current
        self.oracle = _start(seed, 0)
        self.opt = SGD(list(self.oracle.parameters()), LR, MOMENTUM)
        self.names = _names(self.oracle)
        self.overlap = cap_mb is None
        self.cap_bytes = None if self.overlap else cap_mb * 2**20
        trainable = [p for p in self.oracle.parameters() if p.requires_grad]
        self.buckets = ([[p] for p in reversed(trainable)] if self.overlap
                        else _layout(list(reversed(trainable)), self.cap_bytes))
        self.steps = seen.get("steps") if type(seen) is dict and type(seen.get("steps")) is list else []

    def _take(self, n: int) -> list:
        """The next ``n`` phases of the record (fewer where the scenario stopped)."""
        got, self.phases = self.phases[:n], self.phases[n:]
        return got

    def _ended(self, where: str = "") -> str:
        """Why the scenario ended at the phase being judged: the student's error, or another rank's."""
        error = self.seen.get("error")
        if type(error) is tuple and len(error) == 3 and all(type(e) is str for e in error):
            stage, kind, message = error
            if kind == "NotImplementedError":
                return f"{self.what} is not started: it still raises NotImplementedError."
            if kind == "AssertionError" and message:
                return message
            return f"{self.label}{STAGES.get(stage, '')} raised {kind}{f' ({where})' if where else ''}: {message}"
        if self.seen.get("stopped") is True:
            return STOPPED
        return f"{self.label}: the scenario ended before its last step (its record is incomplete)."

    def verdict(self, steps: int, micro: int, cycles: int):
        if type(self.seen) is not dict:
            return RETURNED
        failure = self._construction(cycles)
        for step in range(1, steps + 1):
            failure = failure or self._synced(f"step {step}", f"optimizer step {step}", 1.0, [next(self.blocks)])
        for cycle in range(1, cycles + 1):
            blocks = [next(self.blocks) for _ in range(micro + 1)]
            for i in range(1, micro + 1):
                failure = failure or self._accumulated(cycle, i)
            if failure is None:
                failure = self._synced(
                    f"accumulation cycle {cycle}, the synchronised backward after {micro} micro-batches under "
                    "no_sync()", f"the optimizer step of accumulation cycle {cycle}", 1.0 / (micro + 1), blocks,
                    after=(" Check that nothing the hooks did under no_sync() (such as counting gradients as ready) "
                           "carries over into this step."),
                    grads_where=(f"{self.label}, after {micro} micro-batches under no_sync() and one synchronised "
                                 f"(accumulation cycle {cycle}), on rank {self.rank}"),
                    grads_after=(" The synchronised backward must average the gradient ACCUMULATED over all the "
                                 "micro-batches (no_sync must not drop or overwrite what accumulated)."))
        if failure is None and ([c for c in self.trailing if not _is_mark(c)] or self.phases):
            failure = f"{self.label}: communication after the scenario's last step ({len(self.trailing)} call(s))."
        return failure

    def _construction(self, cycles: int):
        phase, built = self._take(1), self.seen.get("built")
        if type(built) is not dict:
            return self._ended()
        if built.get("module") is not True:
            return f"{self.label} should be an nn.Module (subclass nn.Module), got {built.get('type')}."
        if built.get("finish") is not True:
            return f"{self.label} has no finish_gradient_synchronization() method."
        if cycles and built.get("no_sync") is not True:
            return f"{self.label} has no no_sync() method (a context manager)."
        if not phase:
            return self._ended()
        hint = "The wrapper must broadcast rank 0's parameters and buffers when it is built."
        want = state_of(self.oracle)
        failure = _state_mismatch(self.seen.get("state"), want, _buffers(self.oracle),
                                  f"after {self.label}, on rank {self.rank}", hint)
        sent = sum(c.nbytes for c in phase[0] if c.kind == "broadcast")
        need = sum(t.numel() * t.element_size() for t in want.values())
        if failure is None and sent < need:
            failure = (f"after {self.label}, on rank {self.rank}: its broadcasts carried {sent} B, but the "
                       f"parameters and buffers hold {need} B. {hint}")
        return failure

    def _accumulated(self, cycle: int, i: int):
        phase, where = self._take(1), f"accumulation cycle {cycle}, micro-batch {i} inside no_sync()"
        kinds = [c.kind for c in phase[0] if not _is_mark(c)] if phase else []
        if kinds:
            return (f"{self.label}, {where}: {len(kinds)} communication call(s) ({', '.join(sorted(set(kinds)))}); "
                    "forward and backward inside no_sync() must not communicate at all: let the gradients "
                    "accumulate locally.")
        return self._ended(where) if not phase or (not self.phases and self.seen.get("error")) else None

    def _synced(self, where, step_name, scale, blocks, after="", grads_where=None, grads_after=""):
        phases = self._take(3)
        data = self.steps.pop(0) if self.steps else None
        if len(phases) < 2:  # stopped before finish: what it raised
            return self._ended(where)
        backward, finish, later = phases + [[]] * (3 - len(phases))
        late = [c.kind for c in later if not _is_mark(c)]
        if late:
            return (f"{self.label}, {where}: {len(late)} communication call(s) ({', '.join(sorted(set(late)))}) "
                    "after finish_gradient_synchronization() returned, while .grad was read and the optimizer "
                    "stepped: launch every all-reduce during backward, wait for them in "
                    "finish_gradient_synchronization(), and leave plain tensors holding the averages in .grad.")
        calls = backward + finish
        total = sum(1 for c in calls if c.kind == "all_reduce")
        failure = (_calls_failure(calls, self.buckets, self.oracle, self.cap_bytes, self.label, where, self.overlap)
                   or _launch_failure(backward, self.buckets, self.names, total, self.label, where))
        if failure:
            return failure + after
        if len(phases) < 3 or type(data) is not dict:
            return self._ended(where)
        x, y = blocks[-1]
        local = {} if grads_where else _local_grads(self.oracle, x[self.shard], y[self.shard])
        for x, y in blocks:
            _loss(self.oracle, x, y, scale).backward()
        failure = _grad_mismatch(data.get("grads"), self.oracle, local, self.world, grads_where or (
            f"{self.label}, {where}, after finish_gradient_synchronization(), on rank {self.rank}"))
        if failure:
            return failure + grads_after
        self.opt.step()
        self.opt.zero_grad()
        return _state_mismatch(data.get("state"), state_of(self.oracle), _buffers(self.oracle),
                               f"{self.label}, after {step_name}, on rank {self.rank}",
                               "The weights drifted from one-process training on the whole batch.")
