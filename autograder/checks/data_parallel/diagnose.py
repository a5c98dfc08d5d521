"""Recognising a wrong answer and wording its message: parameters, buffers and gradients that differ from the
oracle's, all-reduces of the wrong number or sizes, all-reduces launched late."""

from __future__ import annotations

import math
from collections import Counter

from .._common import close, short
from .model import UNUSED, _names
from .reference import _bucket_bytes, _layout


def _close(a, b) -> bool:
    return close(a, b)


def _state_mismatch(model, reference, what: str, hint: str):
    """The first parameter or buffer of ``model`` that differs from ``reference``'s, as a message (or None)."""
    ref_buffers = dict(reference.named_buffers())
    ref = dict(reference.named_parameters())
    ref.update(ref_buffers)
    got = dict(model.named_parameters())
    got.update(dict(model.named_buffers()))
    for name, expected in ref.items():
        value = got.get(name)
        same = value is not None and value.dtype == expected.dtype and (
            _close(value, expected)
        )
        if not same:
            kind = "buffer" if name in ref_buffers else "parameter"
            return f"{what}: {kind} '{name}' is {short(value)}, expected {short(expected)}. {hint}"
    return None


def _grad_mismatch(model, oracle, local_grads, world: int, what: str):
    """Compare every gradient with the oracle's; a message with a likely cause, or None."""
    names = _names(model)
    oracle_params = dict(oracle.named_parameters())
    for p, name in names.items():
        expected = oracle_params[name].grad
        got = p.grad
        if not p.requires_grad:
            if got is not None:
                return (f"{what}: '{name}' does not require grad, yet has a gradient {short(got)}: leave "
                        "parameters with requires_grad=False alone.")
            continue
        if expected is None:  # never used in forward: None, or zeros if it was reduced as zero
            if got is not None and bool(got.abs().max() > 0):
                return (f"{what}: '{name}' is never used in forward, so its gradient must stay None (or zero), "
                        f"got {short(got)}.")
            continue
        if got is None:
            return (f"{what}: '{name}' has no gradient after synchronisation (.grad is None), expected "
                    f"{short(expected)}.")
        if _close(got, expected):
            continue
        cause = "check the average over ranks (all-reduce, then divide by the world size)"
        local = local_grads.get(name)
        if _close(got, expected * world):
            cause = (f"it equals {world} x the expected gradient: the gradients were summed over ranks but not "
                     f"divided by the world size ({world})")
        elif local is not None and _close(got, local):
            cause = ("it equals this rank's own local gradient: it was never averaged with the other ranks "
                     "(or the average was overwritten afterwards)")
        elif local is not None and _close(got, local / world):
            cause = "it equals this rank's local gradient divided by the world size: the all-reduce result was lost"
        return f"{what}: gradient of '{name}' is {short(got)}, expected {short(expected)}: {cause}."
    return None


def _describe(buckets, names) -> str:
    return "; ".join(
        "[" + ", ".join(names[p] for p in b) + f"] {sum(p.numel() * p.element_size() for p in b)} B" for b in buckets
    )


def _overlap_failure(watch, buckets, names, issued_after_backward: int, total: int, label: str, where: str):
    """The first gradient-ready moment at which a complete bucket had still not been launched, as a message."""
    position = {name: j for j, (name, _) in enumerate(watch.events)}
    complete_at = []  # index of the event that completed each bucket whose gradients all arrived
    for b in buckets:
        idx = [position.get(names[p]) for p in b]
        if all(i is not None for i in idx):
            complete_at.append((max(idx), b))
    if not complete_at:
        return None
    if issued_after_backward == 0:
        return (f"{label}, {where}: no all-reduce was issued while backward ran; all {total} came after "
                "loss.backward() returned (in finish_gradient_synchronization). That is the blocking version: launch "
                "each all-reduce (async_op=True) from a gradient hook as soon as its gradient(s) are ready, and only "
                "wait in finish_gradient_synchronization.")
    for j, (name, issued) in enumerate(watch.events + [(None, issued_after_backward)]):
        due = [b for t, b in complete_at if t < j]
        if issued < len(due):
            late = due[-1]
            moment = "when backward finished" if name is None else f"when the gradient of '{name}' became ready"
            return (f"{label}, {where}: {moment}, {len(due)} all-reduce(s) were due (their gradients were all "
                    f"ready earlier, e.g. [{', '.join(names[p] for p in late)}]) but only {issued} had been issued. "
                    "Launch each all-reduce from the hook of the last gradient it needs, right away; do not wait "
                    "for later gradients or for the end of backward.")
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
    return (f"{label}, {where}: expected {len(want)} all-reduce(s), one per bucket (reverse registration order, "
            f"cap {'none' if math.isinf(cap_bytes) else f'{cap_bytes:.0f} B'}): {_describe(buckets, names)}; got {len(got)} call(s) of {got} B"
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
