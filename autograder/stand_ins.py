"""What the judge (``autograder.judge``) puts in the place of a student's functions, and what guards its process.

A stand-in runs the student's function on a one-rank ``labsupport`` worker and brings back plain data only, so a
check in the judge's own process never executes a line the student wrote; the guard stops (and records) any
frame of student code that would still start there, such as a method of a student's class.
"""

from __future__ import annotations

import functools

_PLAIN = (int, float, complex, str, bytes, bool, type(None))


def _plain(value, depth: int = 0):
    """``value`` if it is plain data (builtins, containers of them, plain tensors); else raise TypeError."""
    if depth > 20:
        raise TypeError("the value is nested too deeply")
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind in (list, tuple, set, frozenset):
        return kind(_plain(v, depth + 1) for v in value)
    if kind is dict:
        return {_plain(k, depth + 1): _plain(v, depth + 1) for k, v in value.items()}
    if kind is range or kind is slice:
        return value
    if kind.__name__ == "Unplain" and kind.__module__ == "labsupport._plain":  # described by the sandbox
        raise TypeError(f"an object of type {value.kind}")
    mod = kind.__module__.split(".")[0]
    if mod in ("torch", "numpy") and kind.__name__ in ("Tensor", "ndarray", "dtype", "device", "Size", "float64",
                                                       "float32", "int64", "int32", "bool_", "bool"):
        if kind.__name__ == "Tensor" and kind.__module__ != "torch":
            raise TypeError("a tensor subclass")
        return value
    raise TypeError(f"an object of type {kind.__module__}.{kind.__qualname__}")


def _call_in_worker(fn, args, kwargs):
    try:
        result = fn(*args, **kwargs)
        return "ok", result, args, kwargs
    except BaseException as exc:  # noqa: BLE001: brought back and raised in the judge
        return "raise", (type(exc).__module__, type(exc).__name__, str(exc)), args, kwargs


def _copy_back(original, returned) -> None:
    """Mutations the student's function made to its arguments, applied to the judge's objects."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        torch = None
    for old, new in zip(original, returned):
        try:
            if type(old) is list and type(new) is list:
                old[:] = _plain(new)
            elif type(old) is dict and type(new) is dict:
                old.clear()
                old.update(_plain(new))
            elif torch is not None and type(old) is torch.Tensor and type(new) is torch.Tensor \
                    and old.shape == new.shape:
                with torch.no_grad():
                    old.copy_(new)
        except Exception:
            pass


class _StandIn:
    """``fn`` as the judge calls it: on a one-rank worker from this process, in that worker's sandbox
    (``labsupport._sandbox``: the grader's modules are not there, and what comes back is plain data). Pickled, it
    is the student's function itself: a check that sends it to workers sends nothing of the grader's."""

    __judge_stand_in__ = True

    def __init__(self, fn, timeout: float):
        functools.update_wrapper(self, fn)
        self._fn, self._timeout, self._boxed = fn, timeout, None

    def __reduce__(self):
        from labsupport._pickling import identity

        return identity, (self._fn,)

    def __call__(self, *args, **kwargs):
        import builtins

        import labsupport
        from labsupport._sandbox import sandboxed

        from .checks._common import BUILT_INS

        fn = self._fn
        if labsupport.in_worker():
            return fn(*args, **kwargs)
        if self._boxed is None:  # at the first call, when every other function of the student's has its stand-in
            self._boxed = sandboxed(fn, fn.__name__, forbid=BUILT_INS.get(fn.__name__))
        status, value, new_args, new_kwargs = labsupport.run(_call_in_worker, self._boxed, args, kwargs,
                                                             world_size=1, timeout=self._timeout, backend="gloo")[0]
        _copy_back(args, new_args)
        _copy_back(list(kwargs.values()), list(new_kwargs.values()))
        if status == "raise":
            module, name, message = value
            kind = getattr(builtins, name, None) if module == "builtins" else None
            if isinstance(kind, type) and issubclass(kind, BaseException) and kind not in (SystemExit,
                                                                                           KeyboardInterrupt):
                raise kind(message)
            raise RuntimeError(f"{name}: {message}")
        try:
            return _plain(value)
        except TypeError as exc:
            raise TypeError(f"{fn.__name__} returned {exc}; the grader accepts plain values (numbers, strings, "
                            "lists, tuples, dicts, tensors)") from None


def _stand_in(fn, timeout: float):
    """``fn`` as the judge calls it (``_StandIn``)."""
    return _StandIn(fn, timeout)


STUDENT_FILE = "<student code: "


class StudentCodeInJudge(RuntimeError):
    """Raised where the judge's own process was about to run a line a student wrote."""


class _Guard:
    """A trace function for the judge's process while hidden tests run: any frame of student code (a method of a
    student's class called by a check, an object's ``__eq__`` or ``__setstate__``) is stopped before its first line,
    and recorded. Student functions never get here: their stand-ins run them on a worker."""

    def __init__(self, record: list):
        self.record = record

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(STUDENT_FILE):
            where = f"{frame.f_code.co_name} ({frame.f_code.co_filename[len(STUDENT_FILE):-1]})"
            if where not in self.record:
                self.record.append(where)
            raise StudentCodeInJudge(f"the check called {where}, student code, in the grader's own process; "
                                     "student code runs only on workers there")
        return None
