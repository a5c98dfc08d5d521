"""Measure the bytes of parameters a rank holds, all through forward and backward: ``ParamMemory``.

Nothing here trusts the wrapper's own bookkeeping. At every sampling point the recorder walks the wrapper's
object graph (modules, their parameters and tensor attributes, lists, dicts, hook closures,
plain objects the wrapper holds) and adds up the bytes of every distinct storage it finds. A storage freed with
``untyped_storage().resize_(0)`` counts 0 bytes, however many tensors still point at it.

That walk cannot see what autograd saved for backward: ``nn.Linear`` saves its weight (a view of the gathered
flat parameter), so a wrapper that "frees" a unit by dropping its own references still holds the whole unit
through the graph. The recorder therefore also installs saved-tensor hooks around the step: a saved tensor that
shares a storage with a parameter is wrapped in a small holder, and the storage counts for as long as autograd
keeps the holder alive. (Saved-tensor hooks a wrapper installs inside a unit take precedence there; a wrapper that
uses them to save a handle instead of the tensor is exactly one that does not keep the tensor alive.)

Sampling points: before and after every submodule's forward, when the gradient of every submodule's output
arrives in backward (just before that submodule's backward), and whenever autograd saves a tensor (forward) or
takes one back (backward, as each operation's gradient is computed). That is every operation that uses a weight,
in both directions. (A ``TorchDispatchMode`` would see every operation too, but its first use imports
``torch._dynamo``, seconds in every worker process.)
"""

from __future__ import annotations

import functools
import types
import weakref

import torch
import torch.nn as nn

__all__ = ["ParamMemory", "reachable_tensors", "held_bytes"]

_MAX_OBJECTS = 20_000


def _skip(obj) -> bool:
    return getattr(obj, "_fsdp_probe", False) or isinstance(obj, (ParamMemory, type, types.ModuleType))


def reachable_tensors(root):
    """Every tensor reachable from ``root`` through modules, containers, closures and plain objects (not ``.grad``,
    not a function's globals): ``[(path, tensor), ...]``."""
    found, seen, stack = [], set(), [("", root)]
    while stack and len(seen) < _MAX_OBJECTS:
        path, obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)) or _skip(obj):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append((path, obj))
            continue
        if isinstance(obj, dict):
            stack.extend((f"{path}[{k!r}]", v) for k, v in list(obj.items()))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(list(obj)))
        elif isinstance(obj, functools.partial):
            stack.extend((f"{path}.args", v) for v in (obj.func, obj.args, obj.keywords))
        elif isinstance(obj, types.MethodType):
            stack.append((path, obj.__self__))
        elif isinstance(obj, types.FunctionType):
            for i, cell in enumerate(obj.__closure__ or ()):
                try:
                    stack.append((f"{path}<closure {obj.__code__.co_freevars[i]}>", cell.cell_contents))
                except ValueError:  # an empty cell
                    pass
            stack.append((path, obj.__defaults__))
        elif isinstance(obj, nn.Module) or not type(obj).__module__.startswith(("torch", "builtins")):
            attrs = getattr(obj, "__dict__", None)
            if attrs is not None:
                stack.extend((f"{path}.{k}" if path else k, v) for k, v in list(attrs.items()))
            for slot in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, slot):
                    stack.append((f"{path}.{slot}", getattr(obj, slot)))
    return found


def held_bytes(tensors) -> dict:
    """``{storage data_ptr: nbytes}`` of the distinct, allocated storages behind ``tensors``."""
    out = {}
    for t in tensors:
        try:
            storage = t.untyped_storage()
        except Exception:  # a tensor subclass without storage
            continue
        if storage.nbytes() and storage.data_ptr():
            out[storage.data_ptr()] = storage.nbytes()
    return out


class _Held:
    """What autograd keeps for a saved tensor that shares a parameter's storage (so its lifetime can be watched)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class ParamMemory:
    """Record, on this rank, the bytes of parameters materialised after every operation of forward and backward.

    ``model`` is the (wrapped) model; ``units`` an optional ``{name: submodule}`` whose forward and backward name
    the phases of the record. Use it around a training step::

        mem = ParamMemory(model, units=dict(model.module.named_children()))
        with mem:
            loss_fn(model(x), y).backward()
        mem.samples     # [(phase, event, bytes), ...] one per sampling point
        mem.peak        # the largest of them

    ``mem.measure()`` alone gives the bytes held right now (between steps: what a rank keeps).
    """

    def __init__(self, model, units: dict | None = None):
        self.model = model
        self.units = dict(units or {})
        self.samples: list[tuple[str, str, int]] = []
        self.phase = "start"
        self._held: list[weakref.ref] = []
        self._ptrs: set[int] = set()
        self._handles = []
        self._stack = []

    # -- measuring ---------------------------------------------------------------------------------------------
    def _storages(self) -> dict:
        tensors = [t for _, t in reachable_tensors(self.model)]
        mine = held_bytes(tensors)
        self._ptrs = set(mine)  # what backs the parameters now (an address freed since may hold an activation)
        alive = [h() for h in self._held]
        self._held = [weakref.ref(h) for h in alive if h is not None]
        mine.update(held_bytes(h.tensor for h in alive if h is not None))
        return mine

    def measure(self) -> int:
        """Bytes of the distinct storages the model holds now (reachable, or saved by autograd for backward)."""
        return sum(self._storages().values())

    def sample(self, op: str = "") -> int:
        nbytes = self.measure()
        self.samples.append((self.phase, op, nbytes))
        return nbytes

    @property
    def peak(self) -> int:
        return max((b for *_, b in self.samples), default=0)

    def where(self, path_filter=None) -> list:
        """``[(path, nbytes), ...]`` of what the model holds now, largest first (for messages)."""
        seen, rows = set(), []
        for path, t in reachable_tensors(self.model):
            for ptr, n in held_bytes([t]).items():
                if ptr not in seen:
                    seen.add(ptr)
                    rows.append((path, n))
        return sorted(rows, key=lambda r: -r[1])

    # -- saved tensors -----------------------------------------------------------------------------------------
    def _pack(self, t):
        self.sample("save")
        try:
            ptr = t.untyped_storage().data_ptr()
        except Exception:
            return t
        if ptr and ptr in self._ptrs:
            held = _Held(t)
            self._held.append(weakref.ref(held))
            return held
        return t

    def _unpack(self, x):
        self.sample("use")
        return x.tensor if isinstance(x, _Held) else x

    # -- phases ------------------------------------------------------------------------------------------------
    def _set_phase(self, phase):
        self.phase = phase

    def _hook_modules(self):
        names = {id(m): n for n, m in self.units.items()}
        modules = list(self.model.modules()) if isinstance(self.model, nn.Module) else []
        for mod in modules:
            name = names.get(id(mod))

            def pre(m, args, name=name):
                if name is not None:
                    self.phase = f"forward {name}"
                self.sample(f"{type(m).__name__} in")

            def post(m, args, out, name=name):
                self.sample(f"{type(m).__name__} out")
                if name is not None:
                    self.phase = "forward"

                def on_grad(grad, name=name, kind=type(m).__name__):
                    if name is not None:
                        self.phase = f"backward {name}"
                    self.sample(f"{kind} grad")
                on_grad._fsdp_probe = True
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(on_grad)
                        break

            pre._fsdp_probe = post._fsdp_probe = True
            # before the wrapper's own hooks: its gather then falls in the unit's phase
            self._handles.append(mod.register_forward_pre_hook(pre, prepend=True))
            self._handles.append(mod.register_forward_hook(post, prepend=True))

    def __enter__(self):
        self._hook_modules()
        saved = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        saved.__enter__()
        self._stack = [saved]
        self.sample("enter")
        return self

    def __exit__(self, *exc):
        self.phase = "end"
        for ctx in reversed(self._stack):
            ctx.__exit__(*exc)
        self._stack = []
        for h in self._handles:
            h.remove()
        self._handles = []
        self.sample("exit")
        return False
