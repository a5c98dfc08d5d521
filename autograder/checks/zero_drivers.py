"""What runs in the sandbox for 06's optimizer checks (``autograder.checks.zero``): the models and the scenarios that
exercise a student's ``ShardedOptimizer`` / ``Zero2Optimizer`` there.

A driver travels by value to the sandbox and runs beside the student's code, so it imports only the standard library,
torch and labsupport, and what it returns is read as the student's answer: the host compares the weights with its
own unsharded optimizer, reads the communication from its own record and the memory from ``/proc``. The driver marks
the points of its scenario with ``dist.barrier()`` (``autograder.checks._host``); before a mark that the host reads
memory at, it frees what is garbage and gives free heap pages back to the system (``settle``), so that the reading
is what is alive.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn as nn

from labsupport._driving import settle

ROWS = 12  # divisible by 2, 3 and 4
D_IN, D_OUT = 10, 3
#: The memory scenario's model: BIG_LAYERS square layers of BIG_WIDTH (a few MiB each), so that a full copy of the
#: optimizer state stands far above what a process's allocations move by themselves.
BIG_WIDTH, BIG_LAYERS = 512, 16


class ZeroProbeNet(nn.Module):
    """Parameters of uneven sizes (an odd-sized gain vector among them) and a frozen layer. Trainable elements:
    10*20+20 + 20*14+14 + 14*24+24 + 24*3+3 + 7 (gain, used on a slice) = 956; frozen: 14*14+14."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, 20)
        self.mid = nn.Linear(20, 14)
        self.frozen = nn.Linear(14, 14)
        self.frozen.requires_grad_(False)
        self.wide = nn.Linear(14, 24)
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(7))
        self.out = nn.Linear(24, D_OUT)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.frozen(torch.tanh(self.mid(h))))
        h = torch.tanh(self.wide(h))
        h = torch.cat([h[:, :7] * self.gain, h[:, 7:]], dim=1)
        return self.out(h)


class BigNet(nn.Module):
    """The memory scenario's model: a stack of equal square layers (Ψ = BIG_LAYERS * (BIG_WIDTH² + BIG_WIDTH))."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(BIG_WIDTH, BIG_WIDTH) for _ in range(BIG_LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def make_model(seed: int, big: bool = False) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return BigNet() if big else ZeroProbeNet()


def data(seed: int, steps: int, big: bool = False):
    gen = torch.Generator().manual_seed(seed + 11)
    d_in, d_out = (BIG_WIDTH, BIG_WIDTH) if big else (D_IN, D_OUT)
    return torch.randn(steps, ROWS, d_in, generator=gen), torch.randn(steps, ROWS, d_out, generator=gen)


def loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _mark() -> None:
    dist.barrier()


class _Raised(Exception):
    pass


def _call(where, fn, *args):
    """A student's call: NotImplementedError and AssertionError go on to the host as they are; any other error
    ends the scenario and is reported with where it happened."""
    try:
        return fn(*args)
    except (NotImplementedError, AssertionError):
        raise
    except Exception as exc:
        raise _Raised((where, type(exc).__name__, str(exc))) from None


def _optimizer_facts(opt, model) -> dict:
    """What the student's object shows of its optimizers (only for messages about honest mistakes: the host
    never grants anything from it)."""
    from labsupport.lessons.zero import find_optimizers

    opts = find_optimizers(opt)
    own = {id(p) for p in model.parameters()}
    state = [v for o in opts for s in o.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    updated = [t for o in opts for g in o.param_groups for t in g["params"] if isinstance(t, torch.Tensor)]
    storages = {}
    for t in updated:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // max(t.element_size(), 1)
    grads = {id(t.grad): t.grad for t in updated if t.grad is not None}
    copies = [t for t in updated if id(t) not in own]  # a flat shard, a master copy: and their gradients
    nbytes = sum(v.numel() * v.element_size() for v in state)
    nbytes += sum(t.numel() * t.element_size() + (0 if t.grad is None else t.grad.numel() * t.grad.element_size())
                  for t in copies)
    return {"optimizers": len(opts),
            "state_elements": sum(v.numel() for v in state if v.dim() > 0),
            "storage_elements": sum(storages.values()),
            "grad_elements": sum(g.numel() for g in grads.values()),
            "held_bytes": nbytes}


def drive_training(cls, opt_name, kwargs, seed, steps):
    """``steps`` steps of the student's optimizer on this rank's slice of each batch. Marks: after the constructor,
    and around every ``step()``. Returns, per step, the gradients zero_grad left, the weights after the step, the
    parameters that still hold a gradient, and what the object shows of its optimizers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    X, Y = data(seed, steps)
    model = make_model(seed)
    names = {id(p): n for n, p in model.named_parameters()}
    report = {"steps": [], "error": None}
    try:
        optimizer_cls = getattr(torch.optim, opt_name)
        opt = _call(f"(...) with torch.optim.{opt_name}", lambda: cls(model.parameters(), optimizer_cls, **kwargs))
        _mark()
        for step in range(steps):
            x, y = X[step].chunk(world)[rank], Y[step].chunk(world)[rank]
            _call(".zero_grad()", opt.zero_grad)
            left = [names[id(p)] for p in model.parameters() if p.grad is not None and p.grad.abs().sum() > 0]
            loss(model, x, y).backward()
            _mark()
            _call(f".step() (step {step})", opt.step)
            _mark()
            report["steps"].append({
                "left": left,
                "weights": [p.detach().clone() for p in model.parameters()],
                "held": [names[id(p)] for p in model.parameters() if p.grad is not None],
                "facts": _optimizer_facts(opt, model),
            })
    except _Raised as exc:
        report["error"] = exc.args[0]
    return report


def drive_memory(cls, kwargs, seed, steps, sample):
    """The memory scenario: the big model, its gradients made; marks before the constructor (the baseline) and
    after each step, each after ``settle()``. Returns, per step, what the object shows of its optimizers and the
    weights at the ``sample`` positions (flat indices of each parameter) for the host to compare."""
    rank, world = dist.get_rank(), dist.get_world_size()
    X, Y = data(seed, steps, big=True)
    model = make_model(seed, big=True)
    report = {"steps": [], "error": None}
    loss(model, X[0].chunk(world)[rank], Y[0].chunk(world)[rank]).backward()
    settle()
    _mark()
    try:
        opt = _call("(...) with torch.optim.AdamW", lambda: cls(model.parameters(), torch.optim.AdamW, **kwargs))
        for step in range(steps):
            if step:
                _call(".zero_grad()", opt.zero_grad)
                loss(model, X[step].chunk(world)[rank], Y[step].chunk(world)[rank]).backward()
            _call(f".step() (step {step})", opt.step)
            facts = _optimizer_facts(opt, model)
            settle()
            _mark()
            report["steps"].append({
                "facts": facts,
                "weights": [p.detach().reshape(-1)[idx].clone() for p, idx in zip(model.parameters(), sample)],
            })
    except _Raised as exc:
        report["error"] = exc.args[0]
    return report
