"""What a rank keeps alive, measured from the whole worker process, never from the answer's attributes.

A census lists every tensor storage alive in this process: every tensor, parameter, storage object and autograd
node (with the tensors it saved for backward) in the garbage collector's list of live objects, plus the Python
buffers that could hold a copy of the data without being a tensor (``bytes``, ``bytearray``, ``array.array``,
numpy arrays), found as referents of the live objects (those buffers are not tracked by the collector themselves).
Each storage counts once, at its full size, whatever views point at it.

``MemoryWatch`` takes a census before the student's code runs (the baseline), keeps the baseline's storages and
buffers alive until it is done (so that no new storage can reuse an old address or id and pass for an old one), and
remembers a checksum of each baseline CPU storage. ``watch.kept(known=...)`` takes a second census once the student's
call has returned and gives what is new: storages created since the baseline, and baseline storages whose bytes
changed (a buffer allocated before and filled since), less what the check itself holds (``known``: its inputs, the
model it built, its oracle), counted by the bytes those tensors actually cover, so that a storage of the check's
that is bigger than the tensor the check gave out counts its excess.

Call it only from the check's own code, never while a student's function is on the stack.

A tensor that C++ holds without a Python object is found through the tensor that owns it: the ``.grad`` autograd
made (read for every tensor found), the tensors saved in an autograd graph (walked from every tensor's ``grad_fn``
and every live autograd node). In a worker, what the fork server imported is frozen out of the collector's sight (``gc.freeze``): a tensor is
always new enough to be seen, and so is a Python buffer in the globals of a module that gained a name since the
baseline, but not one hidden inside another object that existed before the freeze (a list or dict of a library's,
an existing global rebound). What a census cannot see: memory that no Python object reaches, such as C++ state outside autograd (a
``TCPStore``'s server, a process group's buffers), memory obtained through ``ctypes``, ``mmap`` or shared memory,
files, other processes; copies encoded into ``str`` objects (strings are left out: importing a module creates many);
tensors kept alive only by C++ objects other than autograd nodes (a DLPack capsule, a pending ``Work``).
"""

from __future__ import annotations

import array
import gc
import itertools
import sys
import types
import zlib

import torch

__all__ = ["MemoryWatch", "Kept", "census", "fmt_bytes"]

#: Python buffers smaller than this are left out (many small ``bytes`` live in any process).
MIN_BUFFER = 64
_CONTAINERS = (tuple, dict, frozenset, set, list)
_NODE = torch.autograd.graph.Node
_FUNCTIONS = {types.FunctionType}
#: Objects whose referents are fixed when they are made: no buffer can be attached to them later.
_FIXED = {types.ModuleType, types.CodeType, types.BuiltinFunctionType, types.MethodDescriptorType,
          types.WrapperDescriptorType, types.GetSetDescriptorType, types.MemberDescriptorType,
          types.ClassMethodDescriptorType, types.GenericAlias, types.UnionType, types.MethodWrapperType,
          torch._ops.OpOverload, torch._ops.OpOverloadPacket}


def fmt_bytes(n: float) -> str:
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    if abs(n) < 1024 ** 2:
        return f"{n / 1024:.1f} KiB"
    if abs(n) < 1024 ** 3:
        return f"{n / 1024 ** 2:.1f} MiB"
    return f"{n / 1024 ** 3:.2f} GiB"


def _storage_of(t):
    """The storage behind a tensor (a DTensor's local shard; a sparse tensor's values and indices), or None."""
    try:
        if t.__class__.__name__ == "DTensor":
            t = t.to_local()
        if t.is_sparse:
            return [_storage_of(t._values()), _storage_of(t._indices())]
        return t.untyped_storage()
    except Exception:  # a tensor without storage (meta, a wrapper subclass)
        return None


def _key(storage):
    try:
        ptr, n = storage.data_ptr(), storage.nbytes()
    except Exception:
        return None, 0
    if not ptr or not n:
        return None, 0
    device = storage.device
    return (device.type, device.index, ptr), n


def _describe(t) -> str:
    return f"a {str(t.dtype).replace('torch.', '')} tensor {tuple(t.shape)}"


def _saved_tensors(node):
    """The tensors an autograd node saved for backward (unpacked; a freed one is skipped)."""
    names = [a for a in dir(type(node)) if a.startswith("_saved_")]
    if hasattr(type(node), "saved_tensors"):
        names.append("saved_tensors")
    for name in names:
        try:
            value = getattr(node, name)
        except Exception:  # freed after backward, or not unpackable
            continue
        for v in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(v, torch.Tensor):
                yield v


class _Census:
    """``entries``: {key: [nbytes, description, holder]}; ``holders``: what keeps each storage alive."""

    def __init__(self):
        self.entries: dict = {}

    def add_storage(self, storage, what: str):
        if storage is None:
            return
        if isinstance(storage, list):
            for s in storage:
                self.add_storage(s, what)
            return
        key, n = _key(storage)
        if key is not None:
            entry = self.entries.get(key)
            if entry is None or entry[0] < n:
                self.entries[key] = [n, what, storage]

    def add_tensor(self, t):
        self.add_storage(_storage_of(t), _describe(t))

    def add_buffer(self, obj):
        np = sys.modules.get("numpy")
        if np is not None and isinstance(obj, np.ndarray):
            owner = obj
            while isinstance(owner.base, np.ndarray):
                owner = owner.base
            if owner.nbytes < MIN_BUFFER:
                return
            try:
                ptr = owner.__array_interface__["data"][0]
            except Exception:
                return
            key = ("cpu", None, ptr)
            if key not in self.entries:
                self.entries[key] = [owner.nbytes, f"a numpy array {owner.shape} of {owner.dtype}", owner]
            return
        if isinstance(obj, memoryview):
            try:
                self.add_buffer(obj.obj)
            except Exception:
                pass
            return
        try:
            n = len(obj) * (obj.itemsize if isinstance(obj, array.array) else 1)
        except Exception:
            return
        if n >= MIN_BUFFER:
            self.entries.setdefault(("py", None, id(obj)), [n, f"a {type(obj).__name__} of {n} B", obj])


def _buffer_types():
    kinds = {bytes, bytearray, array.array, memoryview}
    np = sys.modules.get("numpy")
    if np is not None:
        kinds.add(np.ndarray)
    return kinds


def _module_dicts():
    return [vars(m) for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)]


def module_sizes() -> dict:
    """{id: (globals, how many)} of every module's globals now: what ``census`` compares with."""
    return {id(d): (d, len(d)) for d in _module_dicts()}


def census(modules: dict | None = None) -> _Census:
    """Every storage and Python buffer alive in this process now (see the module's docstring). ``modules``: the
    modules' globals at the baseline (``module_sizes``); those of a module that gained names since are looked at too."""
    found = _Census()
    objs = gc.get_objects()
    kinds = set(map(type, objs))
    tensors = {t for t in kinds if issubclass(t, torch._C.TensorBase)}
    storages = {t for t in kinds if issubclass(t, (torch.UntypedStorage, torch.TypedStorage))}
    nodes = {t for t in kinds if t not in tensors and t not in storages and _is_node(t)}
    wanted = tensors | storages | nodes
    graph_roots = []
    for obj in itertools.compress(objs, map(wanted.__contains__, map(type, objs))):
        kind = type(obj)
        if kind in tensors:
            found.add_tensor(obj)
            try:
                # a gradient that autograd made lives in C++ until Python reads it: no object of its own yet
                grad = obj.grad if obj.is_leaf or obj.retains_grad else None
                fn = obj.grad_fn
            except Exception:
                continue
            if grad is not None:
                found.add_tensor(grad)
            if fn is not None:
                graph_roots.append(fn)
        elif kind in storages:
            storage = obj if isinstance(obj, torch.UntypedStorage) else obj._untyped_storage
            found.add_storage(storage, f"a storage object of {storage.nbytes()} B")
        else:
            graph_roots.append(obj)
    _walk_graphs(graph_roots, found)
    # Python buffers are not tracked by the collector: look at what the tracked objects refer to, and inside the
    # untracked containers among those (a tuple or dict of atoms stops being tracked). Objects whose referents are
    # fixed when they are made (classes, modules, code, descriptors, torch's operator objects) are left out, and a
    # function is looked at through its defaults and its __dict__ (its code, globals and closure cells are tracked).
    scanned = {t for t in kinds if t not in _FIXED and t not in _FUNCTIONS and not issubclass(t, type)}
    functions = list(itertools.compress(objs, map(_FUNCTIONS.__contains__, map(type, objs))))
    scan = list(itertools.compress(objs, map(scanned.__contains__, map(type, objs))))
    del objs
    extra = [x for f in functions for x in (f.__defaults__, f.__kwdefaults__, getattr(f, "__dict__", None))
             if x is not None]
    # A worker freezes what it imported (gc.freeze): those objects are not in gc.get_objects(). A module's globals
    # are where a buffer could be put: the globals of a module that gained names since ``modules`` (see
    # ``module_sizes``) are looked at. (Only their sizes are compared: reading every name would write to every
    # name's reference count, and so copy every page the worker shares with the fork server.)
    if modules is not None:
        for d in _module_dicts():
            before = modules.get(id(d))
            if before is None or before[0] is not d or len(d) != before[1]:
                scan.append(d)
    buffers, containers = _buffer_types(), set(_CONTAINERS)
    interesting = buffers | containers
    level = gc.get_referents(*scan) + extra
    del scan, functions, extra
    for _ in range(4):
        picked = list(itertools.compress(level, map(interesting.__contains__, map(type, level))))
        deeper = []
        for obj in picked:
            if type(obj) in buffers:
                found.add_buffer(obj)
            elif not gc.is_tracked(obj):
                deeper.append(obj)
        if not deeper:
            break
        level = gc.get_referents(*deeper)
    return found


_NODE_TYPES: dict = {}


def _is_node(kind) -> bool:
    known = _NODE_TYPES.get(kind)
    if known is None:
        try:
            known = _NODE_TYPES[kind] = issubclass(kind, _NODE)
        except Exception:
            known = _NODE_TYPES[kind] = False
    return known


def _walk_graphs(roots, found: _Census, limit: int = 10_000):
    """Autograd graphs from ``roots`` (nodes): every node's saved tensors (held by C++ only, they may have no
    Python object of their own until unpacked)."""
    seen, stack = set(), list(roots)
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for t in _saved_tensors(node):
            found.add_tensor(t)
        try:
            stack.extend(fn for fn, _ in node.next_functions)
        except Exception:
            pass


def _checksum(storage):
    try:
        if storage.device.type != "cpu":
            return None
        flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        return zlib.crc32(flat.numpy())
    except Exception:
        return None


def _span(t):
    """(storage key, first byte, end byte) of what tensor ``t`` covers in its storage."""
    storage = _storage_of(t)
    if storage is None or isinstance(storage, list):
        return None
    key, n = _key(storage)
    if key is None:
        return None
    es = t.element_size()
    if t.numel() == 0:
        return key, 0, 0
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    start = t.storage_offset() * es
    return key, start, min(n, start + extent * es)


def _coverage(tensors) -> dict:
    """{storage key: bytes covered by the union of the tensors' spans}."""
    spans: dict = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            found = _span(t)
            if found is not None and found[2] > found[1]:
                spans.setdefault(found[0], []).append(found[1:])
    covered = {}
    for key, parts in spans.items():
        parts.sort()
        total, end = 0, -1
        for a, b in parts:
            if b > end:
                total += b - max(a, end)
                end = b
        covered[key] = total
    return covered


class Kept:
    """What a census found beyond the baseline and the check's own tensors: ``storages`` {key: [bytes, what]}."""

    def __init__(self, storages: dict):
        self.storages = storages

    @property
    def total(self) -> int:
        return sum(n for n, _ in self.storages.values())

    def explain(self, tensors, cap: float) -> int:
        """Take off the bytes that ``tensors`` cover (what the rank may keep), at most ``cap`` bytes in all;
        returns the bytes taken off."""
        left = cap
        for key, covered in _coverage(tensors).items():
            entry = self.storages.get(key)
            if entry is None or left <= 0:
                continue
            off = min(entry[0], covered, left)
            entry[0] -= off
            left -= off
        return int(cap - left)

    def largest(self, n: int = 3) -> str:
        rows = sorted((v for v in self.storages.values() if v[0] > 0), key=lambda v: -v[0])[:n]
        return ", ".join(f"{what} ({fmt_bytes(nbytes)})" for nbytes, what in rows)


class MemoryWatch:
    """A baseline census now; ``kept(known)`` later gives what is alive beyond it and beyond ``known``."""

    def __init__(self):
        self._modules = module_sizes()
        base = census()
        self._base = {k: v[0] for k, v in base.entries.items()}
        self._hold = [v[2] for v in base.entries.values()]  # no new storage reuses a baseline address or id
        self._sums = {k: _checksum(v[2]) for k, v in base.entries.items()
                      if isinstance(v[2], torch.UntypedStorage)}

    def kept(self, known=()) -> Kept:
        now = census(self._modules)
        covered = _coverage(known)
        out = {}
        for key, (n, what, holder) in now.entries.items():
            if key in covered:
                n -= min(n, covered[key])
            elif key in self._base and self._base[key] == n:
                before = self._sums.get(key)
                if before is None or _checksum(holder) == before:
                    continue
                what = f"{what}, created before and overwritten since"
            if n > 0:
                out[key] = [n, what]
        del now
        return Kept(out)

    def close(self):
        self._hold = []
        self._modules = None
