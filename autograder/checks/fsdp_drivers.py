"""What runs beside a student's ``MiniFSDP`` in grading's sandbox (``autograder.checks.fsdp`` decides).

``scene`` is the driver the check wraps the student's class with (``in_sandbox(MiniFSDP, driver=scene)``): one
call per phase of a scenario, so that the host measures each phase on its own and reads the sandbox's memory from
``/proc`` between phases, while the sandbox waits idle:

* ``scene(MiniFSDP, "build", seed, sizes, rows, steps, kwargs)``: the probe model made from the seed, wrapped,
  its ``parameters()`` returned (the shards, as plain tensors); the wrapper, its optimizer (SGD with momentum) and
  the data are kept for the next calls.
* ``scene(MiniFSDP, "step", step)``: one training step on this rank's slice of the step's batch; returns the shards.
* ``scene(MiniFSDP, "end")``: forgets the scenario.

Nothing here decides anything: what the calls return is read as the student's answer, and the host compares it
with its own oracle, its own record of the traffic and the memory the kernel counts. This module travels to the
sandbox by value, so it imports only the standard library and torch at top level (never the grader).
"""

from __future__ import annotations

import math
import random
import sys
import types

import torch
import torch.nn as nn

from labsupport._driving import call_answer as _call

LR, MOMENTUM = 0.05, 0.9
_STASH = "_labsupport_grading_scene"  # where a scenario lives from call to call (see _scene)


class ProbeNet(nn.Module):
    """Units (direct children with parameters, in order): ``embed``, ``body`` (a nested Sequential, the largest),
    ``norm`` (its bias frozen), ``head``; ``act`` has no parameters; the root's own parameter is ``scale``."""

    def __init__(self, d_in: int, h1: int, h2: int, d_out: int):
        super().__init__()
        self.embed = nn.Linear(d_in, h1)
        self.body = nn.Sequential(nn.Linear(h1, h2), nn.Tanh(), nn.Linear(h2, h1))
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(h1)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.normal_()
        self.norm.bias.requires_grad_(False)
        self.head = nn.Linear(h1, d_out)
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(d_out))

    def forward(self, x):
        h = torch.tanh(self.embed(x))  # (B, h1)
        h = h + self.body(h)           # a residual: embed's output is used twice
        return self.head(self.norm(self.act(h))) * self.scale  # (B, d_out)


def unit_layout(module: nn.Module):
    """``[(unit name, numel, [(param name, Parameter), ...]), ...]``: each direct child with parameters in order,
    then the root's own parameters (unit name ``""``); every parameter in ``named_parameters`` order."""
    units = []
    for cname, child in module.named_children():
        params = [(f"{cname}.{n}", p) for n, p in child.named_parameters()]
        if params:
            units.append((cname, sum(p.numel() for _, p in params), params))
    own = [(n, p) for n, p in module._parameters.items() if p is not None]
    if own:
        units.append(("", sum(p.numel() for _, p in own), own))
    return units


def _numels(sizes) -> list:
    d_in, h1, h2, d_out = sizes
    return [d_in * h1 + h1, 2 * h1 * h2 + h1 + h2, 2 * h1, h1 * d_out + d_out, d_out]


def draw_sizes(seed: int, big: bool = False):
    """Layer sizes for which several units do not divide by 2, 3 and 4 (the padding path for every N). ``big``:
    some 12 MiB of float32 parameters in units of comparable size (embed, body and head each 25-45% of them), so
    that a unit kept, or a copy of the model, stands far above what a process's memory varies by."""
    rng = random.Random(seed)
    while True:
        if big:
            sizes = (rng.randint(1100, 1300), rng.randint(900, 1100), rng.randint(450, 600), rng.randint(700, 900))
        else:
            sizes = (rng.randint(3, 7), rng.randint(5, 11), rng.randint(9, 17), rng.randint(2, 5))
        if all(sum(n % w != 0 for n in _numels(sizes)) >= 2 for w in (2, 3, 4)):
            return sizes


def make_model(seed: int, sizes) -> ProbeNet:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return ProbeNet(*sizes)


def make_data(seed: int, sizes, steps: int, rows: int):
    gen = torch.Generator().manual_seed(seed + 11)
    return (torch.randn(steps, rows, sizes[0], generator=gen), torch.randn(steps, rows, sizes[3], generator=gen))


def ping(_nothing=None):
    """A call without any student code: what the scenario's own code needs is loaded and used once (a tiny model
    trained a step: modules torch imports on first use, the allocator's settings), so that the sandbox's resident
    size afterwards is the baseline of what the student's code adds."""
    import gc

    _release_freed_memory()
    model = make_model(0, (3, 5, 9, 2))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(2):
        ((model(torch.randn(4, 3)) - torch.randn(4, 2)) ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model = opt = None
    gc.collect()
    _release_freed_memory()


def _scene() -> dict:
    """The scenario, kept from call to call in a module of its own in ``sys.modules`` (the driver itself may be
    loaded afresh for each call, where no sandbox is used)."""
    stash = sys.modules.get(_STASH)
    if stash is None:
        stash = sys.modules[_STASH] = types.ModuleType(_STASH)
        stash.scene = {}
    return stash.scene


_HELD: list = []  # blocks of the inherited heap, taken so that nothing reuses them (never touched: not resident)


def _release_freed_memory() -> None:
    """Make the sandbox's resident memory follow the tensors it holds (glibc): blocks of 64 KiB and more straight
    from the kernel and back to it when freed, the heap of smaller objects never trimmed (fixed thresholds), and
    the free blocks of the heap it inherited from the host given back and taken, so that no tensor lands in memory
    that was already counted (nor stays counted once freed)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)    # M_TRIM_THRESHOLD
        libc.malloc_trim(0)
        libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], \
            [ctypes.c_void_p]
        size = 1 << 28
        while size >= 64 * 1024:
            block = libc.malloc(size)
            if block and not ctypes.c_size_t.from_address(block - ctypes.sizeof(ctypes.c_size_t)).value & 2:
                _HELD.append(block)  # from the heap, not mapped afresh: a free block that was there
                continue
            if block:
                libc.free(block)
            size //= 2
    except Exception:  # not glibc: the check's margins still hold, with less room
        pass


def scene(MiniFSDP, op: str, *args):
    import gc

    import torch.distributed as dist

    state = _scene()
    if op == "build":
        seed, sizes, rows, steps, kwargs = args
        state.clear()
        label = "MiniFSDP" + (f"(..., {', '.join(f'{k}={v!r}' for k, v in kwargs.items())})" if kwargs else "")
        model = make_model(seed, sizes)
        wrapped = _call(f"{label} (the constructor)", MiniFSDP, model, **kwargs)
        model = None
        shards = list(_call(f"{label}.parameters()", wrapped.parameters))
        state.update(label=label, wrapped=wrapped, shards=shards, data=make_data(seed, sizes, steps, rows))
        world = dist.get_world_size()
        chunks = [math.ceil(n / world) for n in _numels(sizes)]
        usable = (len(shards) == len(chunks) and all(isinstance(s, torch.Tensor) and s.dim() == 1 for s in shards)
                  and [s.numel() for s in shards] == chunks)
        if usable:  # (the host decides from the shards themselves: this only spares a step that cannot work)
            state["opt"] = torch.optim.SGD(shards, lr=LR, momentum=MOMENTUM)
        gc.collect()
        return shards  # as plain tensors, requires_grad kept
    if op == "step":
        (step,) = args
        wrapped, label, opt = state["wrapped"], state["label"], state["opt"]
        rank, world = dist.get_rank(), dist.get_world_size()
        X, Y = state["data"]
        x, y = X[step].chunk(world)[rank], Y[step].chunk(world)[rank]
        out = _call(f"{label}: forward", wrapped, x)
        loss = ((out - y) ** 2).mean()
        out = None
        _call(f"{label}: backward", loss.backward)
        loss = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        gc.collect()
        return list(state["shards"])
    state.clear()
    gc.collect()
    return None
