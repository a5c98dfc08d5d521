"""Checks for notebook 03_data_parallel: ``check_broadcast_parameters``, ``check_average_gradients``,
``check_OverlapDDP``, ``check_BucketedDDP``.

Every check builds the same awkward little model on each rank (``ProbeNet``): a frozen layer, a parameter created
with ``requires_grad=False``, a layer applied twice, two layers that share one weight (tied), a parameter the
forward never uses, a float buffer and an integer buffer. Each rank starts from a different seed, so a wrapper that
forgets the initial broadcast is seen at once.

The oracle is the same model trained in one process on the whole batch: N ranks, each on 1/N of the batch, must end
with the same gradients and the same weights (fp32, tight tolerance).

How the result was obtained is checked with ``CommCounter`` and with gradient hooks the checker registers on the
parameters after the student's wrapper is built (they fire right after the student's own post-accumulate hooks, or
right before ``AccumulateGrad`` node hooks): for each gradient that becomes ready, the checker notes how many
all-reduces had been issued so far. That is enough to tell "launched from the hook, during backward" from
"launched after backward" or "launched late", whichever hook style the student used.

"One all-reduce per bucket" means one call whose tensor(s) cover the whole bucket: a flat buffer (``torch.cat``, or
a preallocated buffer the gradients are views of), or the deprecated ``all_reduce_coalesced`` on the bucket's list
of gradients. All-reducing the views of a bucket one by one is one call per parameter, and is counted as such.

Probes keep all ranks in step: after each phase every rank reports whether it found a problem (one small
all-reduce, outside the counted region) and all stop together, so a wrong answer never turns into a deadlock.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
import torch.nn as nn

from ._common import close, draw_seed, run_on_workers, short

__all__ = [
    "check_broadcast_parameters",
    "check_average_gradients",
    "check_OverlapDDP",
    "check_BucketedDDP",
    "ProbeNet",
    "expected_buckets",
]

D, H = 8, 24  # ProbeNet sizes: d x d and d x h weights (256 B and 768 B in fp32)
LR, MOMENTUM = 0.05, 0.9


class _Scale(nn.Module):
    """Multiplies by a fixed gain: a parameter created with ``requires_grad=False``."""

    def __init__(self, d: int):
        super().__init__()
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(d), requires_grad=False)

    def forward(self, x):
        return x * self.gain


class ProbeNet(nn.Module):
    """The model every check uses. Parameters in registration order (what ``parameters()`` yields):

    ``embed.weight`` (tied: ``readout.weight`` is the same Parameter), ``embed.bias``, ``frozen.weight``,
    ``frozen.bias`` (frozen with ``requires_grad_(False)``), ``scale.gain`` (created with ``requires_grad=False``),
    ``shared.weight``, ``shared.bias`` (a layer applied twice), ``spare.weight``, ``spare.bias`` (never used in
    forward), ``wide.weight``, ``wide.bias``, ``narrow.weight``, ``narrow.bias``, ``readout.bias``.
    Buffers: ``shift`` (float) and ``seen`` (int64).
    """

    def __init__(self, d: int = D, h: int = H):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.scale = _Scale(d)
        self.shared = nn.Linear(d, d)
        self.spare = nn.Linear(d, d)  # never used in forward
        self.wide = nn.Linear(d, h)
        self.narrow = nn.Linear(h, d)
        self.readout = nn.Linear(d, d)
        self.readout.weight = self.embed.weight  # tied: one Parameter, used by two layers
        self.register_buffer("shift", 0.1 * torch.randn(d))
        self.register_buffer("seen", torch.randint(0, 1000, (2,)))

    def forward(self, x):
        h = torch.tanh(self.embed(x + self.shift))  # (B, d)
        h = self.scale(self.frozen(h))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))  # the same layer again
        h = torch.tanh(self.narrow(torch.tanh(self.wide(h))))
        return self.readout(h)  # (B, d)


#: Parameters of ProbeNet that never get a gradient although they require one.
UNUSED = ("spare.weight", "spare.bias")


def _make_model(seed: int) -> ProbeNet:
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(seed)
        return ProbeNet()


def _data(seed: int, rows: int):
    gen = torch.Generator().manual_seed(seed + 7)
    return torch.randn(rows, D, generator=gen), torch.randn(rows, D, generator=gen)


def _loss(model, x, y, scale: float = 1.0):
    return ((model(x) - y) ** 2).mean() * scale


def _names(module) -> dict:
    """Parameter object -> name (tied parameters keep their first name, as ``named_parameters`` does)."""
    return {p: n for n, p in module.named_parameters()}


def _layout(params, cap_bytes: float):
    """Greedy fill in the given order: a new bucket starts when the next parameter would push it past the cap."""
    buckets, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def expected_buckets(module: nn.Module, bucket_size_mb: float | None) -> list:
    """The bucket layout of notebook 03: trainable parameters in reverse registration order, filled greedily up to
    ``bucket_size_mb * 2**20`` bytes (a parameter larger than the cap gets a bucket of its own; ``None``: no cap,
    one bucket). Returns a list of buckets, each a list of ``(name, nbytes)``."""
    if bucket_size_mb is None:
        bucket_size_mb = math.inf
    names = _names(module)
    trainable = [p for p in module.parameters() if p.requires_grad]
    return [
        [(names[p], p.numel() * p.element_size()) for p in b]
        for b in _layout(list(reversed(trainable)), bucket_size_mb * 2**20)
    ]


def _bucket_bytes(buckets) -> list:
    return sorted(sum(p.numel() * p.element_size() for p in b) for b in buckets)


def _describe(buckets, names) -> str:
    return "; ".join(
        "[" + ", ".join(names[p] for p in b) + f"] {sum(p.numel() * p.element_size() for p in b)} B" for b in buckets
    )


# ---------------------------------------------------------------------------------------------------------------
# helpers that run on the workers


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


# ---------------------------------------------------------------------------------------------------------------
# broadcast_parameters


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


def check_broadcast_parameters(broadcast_parameters) -> None:
    """Every rank ends with rank ``src``'s parameters and buffers (frozen ones, integer buffers included)."""
    seed = draw_seed()
    for world_size, src in ((2, None), (4, 3)):
        _run(_probe_broadcast, broadcast_parameters, seed, src, world_size=world_size,
             what="broadcast_parameters", seed=seed)


def _guarded(body, *args):
    """Run a probe body; an AssertionError (a wrong answer, or the student's code raising) becomes the rank's
    failure message, agreed on with the other ranks, so the workers survive for the next check."""
    try:
        return body(*args)
    except AssertionError as exc:
        failure = str(exc)
    _agree(failure)
    return failure


def _run(probe, *args, world_size: int, what: str, seed: int):
    results = run_on_workers(_guarded, probe, *args, world_size=world_size, what=what)
    for rank, failure in enumerate(results):
        if failure:
            raise AssertionError(f"{failure} (world_size={world_size}, seed {seed})")


# ---------------------------------------------------------------------------------------------------------------
# average_gradients


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


def check_average_gradients(average_gradients) -> None:
    """Gradients equal the full-batch gradient of one process (the average over ranks); parameters without a
    gradient are skipped."""
    seed = draw_seed()
    for world_size in (2, 4):
        _run(_probe_average, average_gradients, seed, 3, world_size=world_size, what="average_gradients", seed=seed)


# ---------------------------------------------------------------------------------------------------------------
# OverlapDDP and BucketedDDP


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
        return 0 if self.counter is None else self.counter.count("all_reduce")

    def _ready(self, name):
        self.events.append((name, self.issued()))


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
            after_backward = cc.count("all_reduce")
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


_CONFIGS_OVERLAP = ((2, 3), (4, 2))  # (world_size, steps)
# (world_size, cap in bytes, steps, accumulation cycles): a cap between the sizes (forward order differs), one
# smaller than the largest parameters (they get a bucket of their own), one smaller than every parameter, and
# bucket_size_mb=None (no cap: one bucket, as for torch DDP).
_CONFIGS_BUCKETED = ((2, 1000, 2, 2), (4, 700, 2, 1), (2, 16, 1, 1), (4, None, 1, 1))


def check_OverlapDDP(OverlapDDP) -> None:
    """Broadcast at construction; one async all-reduce per trainable parameter, issued from its gradient hook during
    backward; gradients and weights equal one-process training on the whole batch."""
    seed = draw_seed()
    for world_size, steps in _CONFIGS_OVERLAP:
        _run(_probe_ddp, OverlapDDP, "OverlapDDP", seed, 2, None, steps, 0, 0, world_size=world_size,
             what="OverlapDDP", seed=seed)


def check_BucketedDDP(BucketedDDP) -> None:
    """Broadcast at construction; buckets in reverse registration order up to the cap, one all-reduce per bucket
    launched during backward as soon as the bucket is complete; no_sync accumulates without communicating; gradients
    and weights equal one-process training on the whole batch."""
    seed = draw_seed()
    for world_size, cap, steps, cycles in _CONFIGS_BUCKETED:
        cap_mb = math.inf if cap is None else cap / 2**20  # None: bucket_size_mb=None, one bucket
        _run(_probe_ddp, BucketedDDP, "BucketedDDP", seed, 2, cap_mb, steps, 2, cycles, world_size=world_size,
             what="BucketedDDP", seed=seed)
