"""Recognising a wrong answer and wording its message: parameters, buffers and gradients that differ from the
oracle's, all-reduces of the wrong number or sizes, all-reduces launched late (from the order of the host's record)."""

from __future__ import annotations

import math
from collections import Counter

import torch

from .._common import close, short
from .drivers import INSIDE, UNUSED, _names
from .reference import _bucket_bytes, _layout, backward_events


def _close(a, b) -> bool:
    return close(a, b)


def _state_mismatch(got, expected: dict, buffers, what: str, hint: str):
    """The first parameter or buffer in ``expected`` (name -> tensor) that ``got`` (what the driver returned) does
    not hold, as a message (or None). ``buffers``: the names that are buffers (for the message)."""
    got = got if type(got) is dict else {}
    for name, want in expected.items():
        value = got.get(name)
        if not (isinstance(value, torch.Tensor) and value.dtype == want.dtype and _close(value, want)):
            kind = "buffer" if name in buffers else "parameter"
            return f"{what}: {kind} '{name}' is {short(value)}, expected {short(want)}. {hint}"
    return None


def _grad_mismatch(got, oracle, local_grads, world: int, what: str):
    """Compare every gradient (``got``: parameter name -> gradient or None, as the driver read them) with the
    oracle's; a message with a likely cause, or None."""
    got = got if type(got) is dict else {}
    for name, p in oracle.named_parameters():
        expected, grad = p.grad, got.get(name)
        if not p.requires_grad:
            if grad is not None:
                return (f"{what}: '{name}' does not require grad, yet has a gradient {short(grad)}: leave "
                        "parameters with requires_grad=False alone.")
            continue
        if expected is None:  # never used in forward: None, or zeros if it was reduced as zero
            if grad is not None and not (isinstance(grad, torch.Tensor) and not bool(grad.abs().max() > 0)):
                return (f"{what}: '{name}' is never used in forward, so its gradient must stay None (or zero), "
                        f"got {short(grad)}.")
            continue
        if grad is None:
            return (f"{what}: '{name}' has no gradient after synchronisation (.grad is None), expected "
                    f"{short(expected)}.")
        if _close(grad, expected):
            continue
        cause = "check the average over ranks (all-reduce, then divide by the world size)"
        local = local_grads.get(name)
        if _close(grad, expected * world):
            cause = (f"it equals {world} x the expected gradient: the gradients were summed over ranks but not "
                     f"divided by the world size ({world})")
        elif local is not None and _close(grad, local):
            cause = ("it equals this rank's own local gradient: it was never averaged with the other ranks "
                     "(or the average was overwritten afterwards)")
        elif local is not None and _close(grad, local / world):
            cause = "it equals this rank's local gradient divided by the world size: the all-reduce result was lost"
        return f"{what}: gradient of '{name}' is {short(grad)}, expected {short(expected)}: {cause}."
    return None


def _describe(buckets, names) -> str:
    return "; ".join(
        "[" + ", ".join(names[p] for p in b) + f"] {sum(p.numel() * p.element_size() for p in b)} B" for b in buckets
    )


def _launch_failure(calls, buckets, names, total: int, label: str, where: str):
    """Whether each bucket's all-reduce was posted as soon as its gradients were ready, from the host's record of
    one synchronised step (``calls``: forward and backward, the driver's marks inside backward among them, in the
    order the host carried them; ``total``: the step's all-reduces, finish's included). At each mark, the buckets
    whose gradients had all become ready before it (``reference.backward_events``) must have been posted; at the
    end of backward, every bucket complete by then, in the order they became complete."""
    events = backward_events()
    ready = {name: i for i, (kind, name) in enumerate(events) if kind == "ready"}
    done_at = {}  # bucket index -> the event that completed it
    for j, b in enumerate(buckets):
        idx = [ready.get(names[p]) for p in b]
        if all(i is not None for i in idx):
            done_at[j] = max(idx)
    order = sorted(done_at, key=done_at.get)
    points = [(i, f"when backward reached layer '{layer}'") for i, (kind, layer) in enumerate(events)
              if kind == "mark"]
    if order and not any(c.kind == "all_reduce" for c in calls):
        return (f"{label}, {where}: no all-reduce was issued while backward ran; all {total} came after "
                "loss.backward() returned (in finish_gradient_synchronization). That is the blocking version: "
                "launch each all-reduce (async_op=True) from a gradient hook as soon as its gradient(s) are "
                "ready, and only wait in finish_gradient_synchronization.")
    passed, posted = 0, []

    def late(at: int, moment: str):
        due = [j for j in order if done_at[j] < at]
        if len(posted) >= len(due):
            return None
        bucket = buckets[due[len(posted)]]
        return (f"{label}, {where}: {moment}, {len(due)} all-reduce(s) were due (their gradients were all ready "
                f"earlier, e.g. [{', '.join(names[p] for p in bucket)}]) but only {len(posted)} had been issued. "
                "Launch each all-reduce from the hook of the last gradient it needs, right away; do not wait for "
                "later gradients or for the end of backward.")

    for c in calls:
        if c.kind == "all_reduce":
            posted.append(c.nbytes)
        elif c.kind == "all_gather" and c.nbytes == INSIDE:
            failure = late(*points[passed]) if passed < len(points) else None
            if failure:
                return failure
            passed += 1
    if passed != len(points):
        return (f"{label}, {where}: backward passed {passed} of the check's {len(points)} marks inside the model's "
                "layers: forward must run the wrapped model once per call, and backward must go through it.")
    failure = late(len(events), "when backward finished")
    if failure:
        return failure
    want = [sum(p.numel() * p.element_size() for p in buckets[j]) for j in order]
    if posted[:len(want)] != want:
        return (f"{label}, {where}: during backward the all-reduces carried {posted[:len(want)]} B, in that order, "
                f"while the buckets became complete in the order {want} B "
                f"({_describe([buckets[j] for j in order], names)}): launch each bucket when its last gradient "
                "is ready.")
    return None


def _calls_failure(calls, buckets, model, cap_bytes, label, where: str, overlap: bool):
    """Compare this step's all-reduces (count and sizes) with the expected buckets; a message with a likely cause."""
    names = _names(model)
    got = sorted(c.nbytes for c in calls if c.kind == "all_reduce")
    want = _bucket_bytes(buckets)
    unused = [p for p in model.parameters() if p.requires_grad and names[p] in UNUSED]
    if overlap:  # one per trainable parameter; the unused ones may be skipped or reduced as zeros
        skipped = list(want)
        for p in unused:
            skipped.remove(p.numel() * p.element_size())
        if got in (want, skipped):
            return None
        frozen = Counter(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
        have, cause = Counter(got), ""
        extras = [have - base for base in (Counter(want), Counter(skipped)) if have >= base and have != base]
        if any(extra == frozen for extra in extras):
            cause = (" You also reduced the parameters with requires_grad=False (frozen): they have no gradient to "
                     "average; hook and reduce only parameters that require grad.")
        elif extras:
            cause = (" Some gradient was reduced more than once: register one hook per Parameter object "
                     "(module.parameters() lists a tied weight once) and reduce each gradient once per step.")
        elif have <= Counter(want):
            cause = " Some trainable parameters' gradients were never reduced."
        return (f"{label}, {where}: expected one all-reduce per trainable parameter that got a gradient "
                f"({len(skipped)} calls, sizes {skipped} B), got {len(got)} call(s) of {got} B." + cause)
    if got == want:
        return None
    trainable = [p for p in model.parameters() if p.requires_grad]
    candidates = [
        (_bucket_bytes([[p] for p in trainable]),
         "that is one all-reduce per parameter: flatten each bucket's gradients into one tensor and all-reduce it "
         "once (all-reducing the bucket's views one by one is still one call per parameter)"),
        (_bucket_bytes([[p] for p in trainable if names[p] not in UNUSED]),
         "that is one all-reduce per parameter: flatten each bucket's gradients into one tensor and all-reduce it "
         "once (all-reducing the bucket's views one by one is still one call per parameter)"),
        (_bucket_bytes(_layout(trainable, cap_bytes)),
         "those are the buckets of forward (registration) order: gradients become ready from the last layer to the "
         "first, so fill buckets from the LAST registered parameter (reversed(list(module.parameters())))"),
        (_bucket_bytes(_layout(list(reversed(list(model.parameters()))), cap_bytes)),
         "those buckets include parameters with requires_grad=False (frozen): bucket only trainable parameters"),
        (_bucket_bytes([[q for q in b if names[q] not in UNUSED] for b in buckets
                        if any(names[q] not in UNUSED for q in b)]),
         f"the parameters that got no gradient (never used in forward: {', '.join(UNUSED)}) are missing from "
         "their buckets: a missing gradient counts as zero, and its bucket is still all-reduced "
         "(finish_gradient_synchronization launches the buckets still pending)"),
        (_bucket_bytes(_layout_reaching(list(reversed(trainable)), cap_bytes)),
         "a bucket closed only once it reached the cap, so it went past it: start a new bucket when the next "
         "parameter would push the bucket PAST bucket_size_mb * 2**20 bytes"),
    ]
    cause = next((text for sizes, text in candidates if got == sizes), "")
    have, need = Counter(got), Counter(want)
    if not cause and have >= need and have != need and (have - need) <= need:
        cause = ("some bucket was all-reduced twice in one step: launch each bucket exactly once per step (from its "
                 "last gradient's hook, or from finish_gradient_synchronization if it is still pending), and reset "
                 "the bookkeeping when the step is finished")
    cap = "none" if math.isinf(cap_bytes) else f"{cap_bytes:.0f} B"
    return (f"{label}, {where}: expected {len(want)} all-reduce(s), one per bucket (reverse registration order, "
            f"cap {cap}): {_describe(buckets, names)}; got {len(got)} call(s) of {got} B"
            + (f": {cause}." if cause else "."))


def _layout_reaching(params, cap_bytes):
    """The other common rule (PyTorch's): close a bucket once it has reached the cap."""
    buckets, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
