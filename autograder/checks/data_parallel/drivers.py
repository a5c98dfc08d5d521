"""What runs in the grading sandbox for 03's checks: ``ProbeNet`` and the scenarios that exercise the student's
``broadcast_parameters``, ``average_gradients``, ``OverlapDDP`` and ``BucketedDDP`` there.

A driver travels by value to the sandbox (``in_sandbox``'s ``driver``) and runs beside the student's code, so it
imports only the standard library and torch, and what it returns is read as the student's answer: the host
(``probes``) compares the gradients and weights with its own one-process training and reads the communication from
its own record. Each rank's sandbox gets only that rank's starting weights and data shards, never a seed: what the
other ranks hold reaches it in messages or not at all.

The DDP scenario marks its points with a small ``all_gather`` (``mark``): of ``PHASE`` bytes after construction and
after each forward and backward, finish, optimizer step and backward under ``no_sync()`` (it also tells every rank
whether one of them failed, so all stop together), and of ``INSIDE`` bytes inside backward, when the gradient of a
layer's output is about to be computed (a tensor hook on it: ``watch_backward``). The host splits its record at the
marks and, from the order of the requests it carried, sees which all-reduces were posted before backward reached
each layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

D, H = 8, 24  # ProbeNet sizes: d x d and d x h weights (256 B and 768 B in fp32)
PHASE, INSIDE = 1, 2  # the bytes of a mark between phases and of a mark inside backward
#: The layers whose output carries a mark inside backward (``shared`` is applied twice: two marks).
WATCHED = ("scale", "shared", "wide", "narrow")


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
    with torch.random.fork_rng():
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


def state_of(module) -> dict:
    """Every parameter and buffer by name, as plain copies."""
    out = {n: p.detach().clone() for n, p in module.named_parameters()}
    out.update({n: b.detach().clone() for n, b in module.named_buffers()})
    return out


def _built(state: dict) -> ProbeNet:
    """A ProbeNet holding ``state`` (what the host gave this rank)."""
    model = ProbeNet()
    own = dict(model.named_parameters())
    own.update(model.named_buffers())
    with torch.no_grad():
        for name, value in state.items():
            own[name].copy_(value)
    return model


def watch_backward(model, note) -> None:
    """Call ``note(layer)`` inside backward when the gradient of a watched layer's output is about to be computed
    (a tensor hook on the output, registered by a forward hook), once per layer and forward: ``shared``'s two
    outputs are one after the other in backward, with no gradient ready between them."""
    marked = set()
    model.embed.register_forward_pre_hook(lambda _module, _inputs: marked.clear())  # the first layer: a new forward

    def on_forward(name):
        def hook(_module, _inputs, output):
            if name not in marked and isinstance(output, torch.Tensor) and output.requires_grad:
                marked.add(name)
                output.register_hook(lambda _grad: note(name))
        return hook

    for name in WATCHED:
        getattr(model, name).register_forward_hook(on_forward(name))


def mark(nbytes: int, failed: bool = False) -> bool:
    """A point of the scenario the host sees in its record (an ``all_gather`` of ``nbytes`` bytes); whether any rank
    failed."""
    mine = torch.full((nbytes,), int(bool(failed)), dtype=torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return any(bool(t.any()) for t in everyone)


def _error(stage: str, exc: BaseException) -> tuple:
    return (stage, type(exc).__name__, str(exc))


def _grads(module) -> dict:
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in module.named_parameters()}


def broadcast(fn, state: dict, src):
    """``fn(model)`` (or ``fn(model, src=src)``) on a ProbeNet holding this rank's ``state``: the state after, and
    whether the model still holds the same Parameter objects."""
    model = _built(state)
    before = list(model.parameters())
    fn(model) if src is None else fn(model, src=src)
    after = list(model.parameters())
    return {"state": state_of(model),
            "same_objects": len(after) == len(before) and all(a is b for a, b in zip(after, before))}


def average(fn, state: dict, x, y):
    """Backward on this rank's shard, then ``fn(model)``: the gradients and the state after."""
    model = _built(state)
    _loss(model, x, y).backward()
    fn(model)
    return {"grads": _grads(model), "state": state_of(model)}


def ddp(cls, args: tuple, state: dict, batches: list, steps: int, micro: int, cycles: int, lr: float,
        momentum: float) -> dict:
    """The DDP scenario on a ProbeNet holding this rank's ``state``: ``cls(model, *args)``, ``steps`` synchronised
    steps, then ``cycles`` accumulation cycles (``micro`` backward passes under ``no_sync()``, then a synchronised
    one whose loss is scaled by ``1 / (micro + 1)``), on ``batches`` (this rank's shards, one per backward, in
    order), with SGD(lr, momentum) on the wrapper's parameters. Returns the state after construction, the gradients
    each synchronised step left after ``finish_gradient_synchronization()`` and the state after its optimizer step,
    and the first error (stage, type, message), or ``stopped`` when another rank's error stopped every rank."""
    seen = {"built": None, "state": None, "steps": [], "error": None, "stopped": False}
    model = _built(state)
    inside = [False]

    def note(_layer):
        if inside[0]:
            mark(INSIDE)

    watch_backward(model, note)
    wrapped, failed = _stage(seen, "build", cls, model, *args)
    if not failed:
        seen["built"] = {"module": isinstance(wrapped, nn.Module), "type": type(wrapped).__name__,
                         "finish": callable(getattr(wrapped, "finish_gradient_synchronization", None)),
                         "no_sync": callable(getattr(wrapped, "no_sync", None))}
        failed = not all(seen["built"][k] for k in ("module", "finish") + (("no_sync",) if cycles else ()))
    seen["state"] = state_of(model)
    if _stop(seen, failed):
        return seen
    opt = SGD(list(wrapped.parameters()), lr, momentum)
    batches = iter(batches)
    for _ in range(steps):
        if not _synced(seen, wrapped, model, opt, next(batches), 1.0, inside):
            return seen
    for _ in range(cycles):
        for _ in range(micro):
            if not _accumulated(seen, wrapped, next(batches), 1.0 / (micro + 1)):
                return seen
        if not _synced(seen, wrapped, model, opt, next(batches), 1.0 / (micro + 1), inside):
            return seen
    return seen


class SGD:
    """SGD with momentum as ``torch.optim.SGD`` computes it, for the scenario and the host's oracle: building a torch
    optimizer imports some 800 modules (its compiler), seconds of CPU in each sandbox and each worker."""

    def __init__(self, params, lr: float, momentum: float):
        self.params, self.lr, self.momentum, self.buffers = params, lr, momentum, {}

    @torch.no_grad()
    def step(self):
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            buf = self.buffers.get(i)
            if buf is None:
                buf = self.buffers[i] = p.grad.detach().clone()
            else:
                buf.mul_(self.momentum).add_(p.grad)
            p.add_(buf, alpha=-self.lr)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def _stage(seen: dict, stage: str, fn, *args):
    """``(fn(*args), False)``, or ``(None, True)`` with the error noted: every rank then stops at the next mark."""
    try:
        return fn(*args), False
    except Exception as exc:  # the student's error, reported by the host with the stage's name
        seen["error"] = _error(stage, exc)
        return None, True


def _stop(seen: dict, failed: bool) -> bool:
    """The mark at the end of a phase: True when some rank failed (so every rank stops here)."""
    if mark(PHASE, failed):
        seen["stopped"] = not failed
        return True
    return False


def _synced(seen, wrapped, model, opt, batch, scale, inside) -> bool:
    """One synchronised step: forward and backward (marks inside backward), finish, then the gradients are read and
    the optimizer steps. A mark after each of the three; False when every rank stops."""
    x, y = batch
    loss, failed = _stage(seen, "forward", lambda: ((wrapped(x) - y) ** 2).mean() * scale)
    if not failed:
        inside[0] = True
        try:
            _, failed = _stage(seen, "backward", loss.backward)
        finally:
            inside[0] = False
    if _stop(seen, failed):
        return False
    _, failed = _stage(seen, "finish", wrapped.finish_gradient_synchronization)
    if _stop(seen, failed):
        return False

    def read_and_step():
        grads = _grads(model)
        opt.step()
        opt.zero_grad()
        return grads

    grads, failed = _stage(seen, "after", read_and_step)
    if not failed:
        seen["steps"].append({"grads": grads, "state": state_of(model)})
    return not _stop(seen, failed)


def _accumulated(seen, wrapped, batch, scale) -> bool:
    """One backward under ``no_sync()`` (no marks inside), then a mark; False when every rank stops."""
    x, y = batch

    def run():
        with wrapped.no_sync():
            (((wrapped(x) - y) ** 2).mean() * scale).backward()

    _, failed = _stage(seen, "no_sync", run)
    return not _stop(seen, failed)
