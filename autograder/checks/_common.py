"""What every check needs: running the student's object on workers, drawing inputs, and messages a student can act on.

A check is a function called from a hidden-test cell, e.g. ``check_broadcast(broadcast)``. It runs a *probe* on
real workers (``run_on_workers``): the probe calls the student's function with inputs drawn at grading time,
compares with an oracle, and raises ``AssertionError`` with a precise message. Whatever happens on the workers
(a wrong answer, an exception, a deadlock, a crash) arrives in the notebook as one ``AssertionError``, so
nbgrader takes the points away and grading goes on.
"""

from __future__ import annotations

import os
import random

import labsupport
from labsupport._driving import call_answer as call_student  # noqa: F401  (the checks call it by this name)

_CHECKS = os.path.dirname(os.path.abspath(__file__))  # a rank blocked in a file under here has left the student's code

#: Seconds a single probe may run before it counts as a deadlock. Keep well under the grader's cell time-out.
PROBE_TIMEOUT = float(os.environ.get("AUTOGRADER_PROBE_TIMEOUT", "20"))


def draw_seed() -> int:
    """A seed drawn at grading time (so inputs differ from one grading to the next), printed in messages."""
    return random.SystemRandom().randrange(1, 2**31)


def run_on_workers(probe, *args, world_size: int, what: str, timeout: float | None = None, backend: str = "gloo",
                   **kwargs):
    """Run ``probe`` on ``world_size`` ranks; turn every failure into an ``AssertionError`` naming ``what``.

    gloo on the CPU by default, whatever the machine: the checks' tensors are CPU tensors, and ``"auto"`` would give a
    rank of its own GPU to as many ranks as there are GPUs (a one-rank check on a machine with one GPU)."""
    timeout = PROBE_TIMEOUT if timeout is None else timeout
    try:
        return labsupport.run(probe, *args, world_size=world_size, timeout=timeout, backend=backend, **kwargs)
    except (labsupport.WorkerTimeout, labsupport.WorkerError) as exc:
        return _failed(exc, world_size, what, timeout)


def _rules(exercise: str, names, doing: str, verb: str = "call", short: bool = False) -> dict:
    return {name: f"{exercise} must not {verb} {name.split(':')[1] if short else name.replace(':', '.')}: it is "
                  f"what you are building ({doing})" for name in names}


_SAMPLER = ("torch.utils.data:DistributedSampler", "torch.utils.data.distributed:DistributedSampler")
_CLIP = ("torch.nn.utils:clip_grad_norm_", "torch.nn.utils:clip_grad_norm", "torch.nn.utils:get_total_norm")
_SCALER = ("torch.amp:GradScaler", "torch:GradScaler", "torch.cuda.amp:GradScaler", "torch.cpu.amp:GradScaler")
_DCP = tuple(f"torch.distributed.checkpoint:{name}" for name in ("save", "load", "async_save", "save_state_dict",
                                                                 "load_state_dict"))
_CHECKPOINT = ("write each rank's shard to a file of its own and the metadata once, commit with an atomic rename, "
               "and read back only the byte ranges a rank needs")
#: The built-ins that an exercise, a function the judge calls, re-implements: inside its call in the sandbox each
#: raises the message, so an answer that leans on what it is building says so instead of passing.
BUILT_INS = {
    "shard_indices": _rules("shard_indices", _SAMPLER, "compute the indices from num_samples, num_replicas, rank, "
                                                       "epoch and seed", short=True),
    "clip_grad_norm_": _rules("clip_grad_norm_", _CLIP, "add up this rank's share of the norm, all-reduce that one "
                                                        "number over the group, then scale every gradient in place"),
    "DynamicLossScaler": _rules("DynamicLossScaler", _SCALER, "keep the scale yourself, unscale the gradients in "
                                                              "place and agree on one found-inf flag", "use"),
    "save_sharded": _rules("save_sharded", _DCP, _CHECKPOINT),
    "load_resharded": _rules("load_resharded", _DCP, _CHECKPOINT),
}


def in_sandbox(fn, what: str, allow=None, driver=None, forbid=None, shared=(), arena=True):
    """``fn`` as the workers will call it: in a sandbox of each rank, behind a host that carries its messages
    (``labsupport._sandbox``). ``allow`` names the ``torch.distributed`` calls the exercise may make (the others are
    refused with a message that names the rule); what the check reads (results, arguments, the ``CommCounter``'s
    record) is measured in the host, where the student's code never runs. ``driver`` (a function of a module that
    imports only the standard library, torch and labsupport) exercises a class or several functions there:
    the call is ``driver(fn, ...)``, and what it returns is the student's answer, checked by the host. ``forbid``
    maps built-ins the exercise rebuilds to their message (``BUILT_INS``); ``shared`` names folders every rank's
    sandbox may read and write besides its own (a checkpoint's). ``arena=False`` sends every tensor in the link's
    messages (``labsupport._arena``): for a check that reads the sandbox's memory inside its requests, where a
    transfer's copy in the shared memory would count as the student's."""
    from labsupport._sandbox import sandboxed

    return sandboxed(fn, what, allow, forbid=forbid, driver=driver, shared=shared, arena=arena)


#: What a check's message starts with when the sandbox refused a request after the student's function returned (a
#: result that communicates when it is read): the grader flags such a submission.
REFUSED = "grading refused"


def _failed(exc, world_size: int, what: str, timeout: float):
    """The ``AssertionError`` for a probe that failed on the workers (``run_on_workers``)."""
    if isinstance(exc, labsupport.WorkerTimeout):
        lines = [line.strip() for line in str(exc).splitlines() if line.strip().startswith("rank ")]
        where = "; ".join(lines)
        left = [line.split(":")[0] for line in lines if f"{_CHECKS}{os.sep}" in line]
        inside = [line.replace(": blocked in ", " still waited in ", 1) for line in lines
                  if f"{_CHECKS}{os.sep}" not in line]
        if left and inside:
            raise AssertionError(
                f"{what} deadlocked with world_size={world_size}: {', '.join(left)} had returned from {what} while "
                f"{'; '.join(inside)}. Every rank must make the same collective calls, even one with nothing to send."
            ) from None
        if lines and all(" in recv" in line or " in irecv" in line or "wait() for irecv" in line for line in lines):
            advice = ("Every rank was waiting to receive: a message sent with isend whose request was never waited "
                      "on may never be delivered; keep each request and wait() on it before returning.")
        else:
            advice = ("Check that every send has a matching recv on the other rank, and that blocking sends cannot "
                      "wait on each other in a cycle.")
        raise AssertionError(
            f"{what} did not finish within {timeout:g} s with world_size={world_size}: it deadlocked "
            f"(a rank waited for a message that never came). {where}. {advice}"
        ) from None
    else:
        if exc.exc_type in ("AssertionError", "SandboxRefused"):
            raise AssertionError(f"{exc.exc_message} (world_size={world_size}, seen on rank {exc.rank})") from None
        if exc.exc_type == "NotImplementedError":
            raise AssertionError(f"{what} is not started: it still raises NotImplementedError.") from None
        if exc.exc_type is None:
            mismatch = (" In a collective this usually means the ranks disagreed: every rank must make the same "
                        "collective calls in the same order with the same sizes (dist.reduce or dist.broadcast is "
                        "called by all ranks, not only by the root)." if "SIGABRT" in str(exc.exc_message) else "")
            native = getattr(exc, "native", None)
            died = str(exc.exc_message).replace(f": {native}", "") if native else exc.exc_message
            said = f" Native code said: {native}" if native else ""
            raise AssertionError(
                f"{what} crashed a worker with world_size={world_size}: rank {exc.rank} {died}.{mismatch}{said}"
            ) from None
        tb = exc.worker_traceback.strip()
        raise AssertionError(
            f"{what} raised {exc.exc_type} on rank {exc.rank} with world_size={world_size}: {exc.exc_message}"
            + (f"\n{tb}" if tb else "")
        ) from None


class _Raw:
    """A tensor as its dtype, shape and bytes: what ``share`` sends instead of the tensor."""

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype, shape, data):
        self.dtype, self.shape, self.data = dtype, shape, data


def _each_tensor(obj, change):
    """``obj`` with ``change`` applied to each tensor (or ``_Raw``) in it, inside lists, tuples and dicts."""
    import torch

    if isinstance(obj, (torch.Tensor, _Raw)):
        return change(obj)
    if type(obj) in (list, tuple):
        return type(obj)(_each_tensor(x, change) for x in obj)
    if type(obj) is dict:
        return {k: _each_tensor(v, change) for k, v in obj.items()}
    return obj


def _to_raw(t):
    import torch

    try:
        t = t.detach().cpu().contiguous()
        return _Raw(t.dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    except (RuntimeError, TypeError):  # a tensor numpy cannot view (sparse, quantized): pickled as it is
        return t


def _from_raw(raw):
    import torch

    if not isinstance(raw, _Raw):
        return raw
    if not raw.data:
        return torch.empty(raw.shape, dtype=raw.dtype)
    return torch.frombuffer(bytearray(raw.data), dtype=torch.uint8).view(raw.dtype).reshape(raw.shape)


def share(report) -> list:
    """Every rank's ``report`` on every rank, in rank order (``dist.all_gather_object``), called by every rank.

    The tensors in it (inside lists, tuples and dicts) travel as their dtype, shape and bytes and come back as CPU
    tensors with the same values: pickling a tensor itself goes through ``torch.save`` and ``torch.load``, which
    took most of a collectives check's time.
    """
    import torch.distributed as dist

    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, _each_tensor(report, _to_raw))
    return [_each_tensor(r, _from_raw) for r in reports]


def agree(failure) -> bool:
    """Called by every rank: whether any rank found a problem (so that all stop at the same point)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([0 if failure is None else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def stop_if_any(failure) -> bool:
    """Called by every rank: all ranks stop together when any found a problem; only those that found it raise."""
    if agree(failure):
        if failure is not None:
            raise AssertionError(failure)
        return True
    return False


def short(t, limit: int = 8) -> str:
    """A compact description of a tensor (or anything) for a message."""
    import torch

    if isinstance(t, torch.Tensor):
        flat = t.detach().flatten().tolist()
        body = ", ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in flat[:limit])
        more = f", ... ({t.numel()} values)" if t.numel() > limit else ""
        return f"tensor([{body}{more}], shape={tuple(t.shape)}, dtype={str(t.dtype).replace('torch.', '')})"
    text = repr(t)
    return text if len(text) < 200 else text[:200] + "..."


#: The one tolerance rule of every check, per floating dtype: what summing the same values in another order (ranks
#: added in another sequence, a sum split into chunks) can change, and no more. Integer tensors compare exactly.
TOLERANCE = {
    "float64": {"rtol": 1e-9, "atol": 1e-9},
    "float32": {"rtol": 1e-4, "atol": 1e-5},
    "bfloat16": {"rtol": 2e-2, "atol": 2e-2},
    "float16": {"rtol": 2e-3, "atol": 2e-3},
}


def tolerance(dtype) -> dict:
    """``rtol``/``atol`` for comparing tensors of ``dtype`` (a ``torch.dtype`` or its name, e.g. ``"float32"``)."""
    name = str(dtype).replace("torch.", "")
    return TOLERANCE.get(name, TOLERANCE["float32"])


def close(got, expected) -> bool:
    """True when ``got`` is a tensor with ``expected``'s shape and dtype and equal values: exactly for integers, within
    ``tolerance(dtype)`` for floating point."""
    import torch

    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    if expected.dtype.is_floating_point or expected.dtype.is_complex:
        return torch.allclose(got, expected, **tolerance(expected.dtype))
    return torch.equal(got, expected)


def expect_tensor(got, expected, what: str, hint: str = "") -> None:
    """Assert ``got`` is a tensor equal to ``expected`` (same shape and dtype, ``close`` values), layered messages."""
    import torch

    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor, got {type(got).__name__} {short(got)}. {hint}".strip())
    if tuple(got.shape) != tuple(expected.shape):
        raise AssertionError(
            f"{what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}. {hint}".strip()
        )
    if got.dtype != expected.dtype:
        raise AssertionError(f"{what}: expected dtype {expected.dtype}, got {got.dtype}. {hint}".strip())
    if not close(got, expected):
        raise AssertionError(f"{what}: got {short(got)}, expected {short(expected)}. {hint}".strip())


def only_point_to_point(summary, what: str) -> None:
    """Assert a ``CommSummary`` shows send/recv only (no built-in collective)."""
    used = sorted({c.kind for c in summary.calls} - {"send", "recv"})
    if used:
        raise AssertionError(
            f"{what} called torch.distributed.{used[0]} on rank {summary.rank}: build it from send/recv "
            "(or isend/irecv) only; the built-in collectives are what you are re-implementing."
        )
