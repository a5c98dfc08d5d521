"""One tap on ``torch.distributed``: every communication call a rank makes, for whoever subscribes.

The observers are the call board (deadlock reports), ``CommCounter``, ``Timeline.collectives`` and any later one
(a memory recorder). Each subscribes an object with ``enter(call)`` and ``exit(call)``; the tap calls them around
every intercepted call, in the calling thread. ``enter`` runs before the call goes out, so an observer may stop a
call by raising (a check refusing a collective); an exception in ``exit`` is the observer's own business.

What is intercepted, at five levels (``Call.level``):

* ``"api"``: the ``torch.distributed`` functions students call (``dist.send``, ``dist.all_reduce``, ...), in both
  modules that hold them, with their own argument names (``src=1``): what a deadlock report should name.
* ``"wait"``: ``Work.wait()``, for the asynchronous forms (``isend``, ``async_op=True``, ``batch_isend_irecv``).
* ``"pg"``: the methods of the ``ProcessGroup`` object, where every ``dist.*`` call ends (object collectives,
  names imported before the tap, ``dist.group.WORLD.allreduce(...)``).
* ``"backend"``: the same methods on the backend objects below it (``pg._get_backend(device).allreduce(...)``).
* ``"functional"``: the functional collectives (``torch.distributed._functional_collectives``, the
  ``_c10d_functional`` ops that DTensor, ``parallelize_module`` and compiled code use), wrapped where every Python
  caller goes through: the function pointer (``_op``) of each op packet and of its overloads. The op objects
  themselves stay the same, so ``CommDebugMode`` and dispatch modes still recognise them.

Calls nest (``dist.all_reduce`` -> ``ProcessGroup.allreduce`` -> ``Work.wait``): ``Call.outer`` is what
encloses this one on the same thread (``None`` for an outermost call), ``Call.in_comm`` says whether a
communication-level call (pg, backend, functional) encloses it. A counter records the outermost communication call (``is_comm and not in_comm``); the
call board posts the outermost call of all. ``Call.kind``, ``peer``, ``group`` and ``nbytes`` describe a
communication call as ``CommCounter`` reports it (computed on first use).

Installed once per worker (and by the first subscriber in any other process); with nobody subscribed a wrapped
call costs one extra Python call. Not seen: calls made by C++ code that bypasses Python (DistributedDataParallel's
reducer, the backward of the functional collectives' autograd ops), and compiled graphs.

One observer is always there once the tap is installed: ``DEVICE_CHECK``, which in an NCCL run stops a call given a
tensor that is not on this rank's GPU, with a message naming the rank and both devices (NCCL's own error does not).
"""

from __future__ import annotations

import functools
import sys
import threading

from ._kinds import API_CALLS, FUNCTIONAL_KINDS, PG_KINDS, POINT_TO_POINT, describe as _describe

__all__ = ["Call", "subscribe", "unsubscribe", "observers", "install", "POINT_TO_POINT"]

COMM_LEVELS = frozenset({"pg", "backend", "functional"})

_OBSERVERS: tuple = ()
_NESTED_OBSERVERS: tuple = ()  # the observers that look at calls made inside another intercepted call
_LOCK = threading.RLock()
_local = threading.local()
_installed = False


class Call:
    """One intercepted call. ``args``/``kwargs`` are as the caller passed them (without the ``self`` of a method);
    ``target`` is the process group or backend of a method call; ``result`` is set before ``exit`` (``None`` if
    the call raised)."""

    __slots__ = ("level", "name", "args", "kwargs", "target", "outer", "in_comm", "result", "_record", "_memo")

    def __init__(self, level, name, args, kwargs, target, outer):
        self.level = level
        self.name = name
        self.args = args
        self.kwargs = kwargs
        self.target = target
        self.outer = outer
        self.in_comm = outer is not None and (outer.level in COMM_LEVELS or outer.in_comm)
        self.result = None
        self._record = None
        self._memo = None

    @property
    def memo(self) -> dict:
        """A dict where observers keep what they derived from this call, for the other observers."""
        if self._memo is None:
            self._memo = {}
        return self._memo

    @property
    def is_comm(self) -> bool:
        return self.level in COMM_LEVELS

    def _described(self):
        if self._record is None:
            self._record = _describe(self)
        return self._record

    @property
    def kind(self) -> str | None:
        """The torch.distributed name of what this call does (``"send"``, ``"all_reduce"``, ...)."""
        return self._described()[0]

    @property
    def peer(self) -> int | None:
        """The global rank at the other end of a send or recv (None for collectives and any-source receives)."""
        return self._described()[1]

    @property
    def group(self) -> tuple:
        """The global ranks of the group the call runs in."""
        return self._described()[2]

    @property
    def nbytes(self) -> int:
        """The bytes of this rank's data in the call (see ``labsupport.CommCall``)."""
        return self._described()[3]

    def __repr__(self) -> str:
        return f"<tap.Call {self.level}:{self.name}>"


# ----------------------------------------------------------------------------------------------------------------
# subscribing


def subscribe(observer) -> None:
    """Start calling ``observer.enter(call)`` and ``observer.exit(call)`` around every intercepted call.

    An observer with ``nested = False`` only looks at outermost calls (``call.outer is None``): the tap then skips
    the calls made inside another one for it, which keeps a rank with only such observers fast.
    """
    install()
    with _LOCK:
        _set(_OBSERVERS + (observer,))


def unsubscribe(observer) -> None:
    """Stop notifying ``observer`` (calls already entered still get their ``exit``)."""
    with _LOCK:
        rest = list(_OBSERVERS)
        if observer in rest:
            rest.remove(observer)
        _set(tuple(rest))


def _set(everyone: tuple) -> None:
    global _OBSERVERS, _NESTED_OBSERVERS
    _NESTED_OBSERVERS = tuple(o for o in everyone if getattr(o, "nested", True))
    _OBSERVERS = everyone


def observers() -> tuple:
    return _OBSERVERS


def current() -> Call | None:
    """The innermost intercepted call this thread is inside, if any."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


# ----------------------------------------------------------------------------------------------------------------
# the wrappers


def _intercept(level: str, name: str, fn, args, kwargs, target=None):
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    outer = stack[-1] if stack else None
    watching = _OBSERVERS if outer is None else _NESTED_OBSERVERS
    call = Call(level, name, args if target is None else args[1:], kwargs, target, outer)
    # On the stack before anything reads the arguments: Python code that reading them runs (an ``__index__``) and
    # that communicates makes a call nested in this one.
    stack.append(call)
    entered = []
    try:
        for obs in watching:
            obs.enter(call)
            entered.append(obs)
    except BaseException:  # an observer stopped the call before it went out
        stack.pop()
        _notify_exit(entered, call)
        raise
    try:
        call.result = fn(*args, **kwargs)
        return call.result
    finally:
        stack.pop()
        _notify_exit(entered, call)


def _notify_exit(entered, call) -> None:
    for obs in entered:
        try:
            obs.exit(call)
        except Exception:
            pass


# The wrappers keep no ``__wrapped__`` (code that called the original through it would go unrecorded) and always go
# through ``_intercept``.
_ORIGINALS: list = []


def _originals() -> list:
    """Every original the wrappers call (``benchmarks/tap.py`` times a wrapper against its original)."""
    return list(_ORIGINALS)


def _wrap_function(level: str, name: str, fn):
    _ORIGINALS.append(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return _intercept(level, name, fn, args, kwargs)

    del wrapper.__wrapped__
    wrapper._labsupport_tap = level
    return wrapper


def _wrap_method(level: str, name: str, fn):
    _ORIGINALS.append(fn)

    def wrapper(self, *args, **kwargs):
        return _intercept(level, name, fn, (self, *args), kwargs, target=self)

    wrapper.__name__ = name
    wrapper.__qualname__ = getattr(fn, "__qualname__", name)
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    wrapper._labsupport_tap = level
    return wrapper


def _wrap_op(name: str, fn):
    """A functional op's ``_op`` (a C++ builtin), called by the packet's and the overload's ``__call__``."""

    _ORIGINALS.append(fn)

    def wrapper(*args, **kwargs):
        return _intercept("functional", name, fn, args, kwargs)

    wrapper._labsupport_tap = "functional"
    return wrapper


def install() -> None:
    """Install the wrappers (once per process; later calls do nothing)."""
    global _installed
    with _LOCK:
        if _installed:
            return
        import torch.distributed as dist

        if not dist.is_available():  # pragma: no cover - a torch without distributed support
            _installed = True
            return
        _install_api(dist)
        _install_methods()
        _install_functional()
        _installed = True
        _set(_OBSERVERS + (DEVICE_CHECK,))


def _install_api(dist) -> None:
    """``distributed_c10d`` gets the same wrappers as ``torch.distributed``: ``P2POp`` checks that its ``op`` is that
    module's ``isend`` or ``irecv``, and pickle finds functions there."""
    from torch.distributed import distributed_c10d as c10d

    for name in API_CALLS:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "_labsupport_tap", None):
            continue
        wrapper = _wrap_function("api", name, original)
        for module in (c10d, dist):
            if getattr(module, name, None) is original:
                setattr(module, name, wrapper)


def _install_methods() -> None:
    from torch._C import _distributed_c10d as C

    classes = [("pg", getattr(C, "ProcessGroup", None)), ("backend", getattr(C, "Backend", None))]
    for level, cls in classes:
        if cls is None:
            continue
        for method in PG_KINDS:
            original = cls.__dict__.get(method)
            if original is None or getattr(original, "_labsupport_tap", None):
                continue
            try:
                setattr(cls, method, _wrap_method(level, method, original))
            except (AttributeError, TypeError):  # pragma: no cover
                pass
    work = getattr(C, "Work", None)
    wait = getattr(work, "wait", None)
    if wait is not None and not getattr(wait, "_labsupport_tap", None):
        try:
            work.wait = _wrap_method("wait", "wait", wait)
        except (AttributeError, TypeError):  # pragma: no cover - a torch whose Work cannot be patched
            pass


_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")


def _install_functional() -> None:
    import torch

    try:
        import torch.distributed._functional_collectives  # noqa: F401  (registers the ops' Python parts)
    except Exception:  # pragma: no cover
        pass
    for namespace in _FUNCTIONAL_NAMESPACES:
        try:
            ops = getattr(torch.ops, namespace)
        except Exception:  # pragma: no cover
            continue
        for name in FUNCTIONAL_KINDS:
            try:
                packet = getattr(ops, name)
            except (AttributeError, RuntimeError):
                continue
            targets = [packet] + [getattr(packet, o, None) for o in packet.overloads()]
            for target in targets:
                op = getattr(target, "_op", None)
                if op is None or getattr(op, "_labsupport_tap", None):
                    continue
                try:
                    target._op = _wrap_op(name, op)
                except (AttributeError, TypeError):  # pragma: no cover
                    pass


# ----------------------------------------------------------------------------------------------------------------
# the device check


def _tensors(values):
    """The tensors among a call's arguments, and in the lists and tuples it was given (one level deep)."""
    import torch

    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def wrong_device_message(rank, kind, got, expected) -> str:
    return (
        f"rank {rank}: {kind} was given a tensor on {got}, but this rank's device in this NCCL run is {expected}. "
        f"NCCL only moves tensors on the rank's own GPU: create it with device=labsupport.device() "
        f"(cuda:LOCAL_RANK) or move it there with .to(labsupport.device())."
    )


def _nccl_device(call):
    """This rank's GPU when ``call`` goes through an NCCL process group, else ``None`` (cheap for gloo runs)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    import torch.distributed as dist

    if call.level == "pg":
        group = call.target
    else:  # a group passed by position counts too (dist.all_reduce(t, op, group))
        group = call.kwargs.get("group")
        if group is None:
            group = next((a for a in call.args if isinstance(a, dist.ProcessGroup)), None)
    try:
        if dist.get_backend(group) != "nccl":
            return None
    except Exception:  # no process group, or a backend object rather than a group: nothing to check
        return None
    return torch.device("cuda", torch.cuda.current_device())


class _DeviceCheck:
    """Stops a communication call in an NCCL run when a tensor it was given is not on this rank's GPU."""

    nested = False

    def enter(self, call):
        if call.level not in ("api", "pg") or "object" in call.name:  # objects are pickled: any device will do
            return
        expected = _nccl_device(call)
        if expected is None:
            return
        for t in _tensors((*call.args, *call.kwargs.values())):
            if t.device != expected:
                import torch.distributed as dist

                raise RuntimeError(wrong_device_message(dist.get_rank(), call.kind or call.name, t.device, expected))

    def exit(self, call):
        pass


DEVICE_CHECK = _DeviceCheck()
