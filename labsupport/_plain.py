"""How values cross between grading's sandbox and its host (``labsupport._sandbox``): as plain data.

Tensors of any class travel as dtype, shape and bytes; other objects that are not plain Python data as a description
(``Unplain``), which the host shows and never compares. The host copies the arguments as the function left them
back onto its own objects, so an in-place answer works as on a worker.
"""

from __future__ import annotations

_RESULT_MARK = "__tensor__"


class Unplain:
    """Stands, in the host, for a value the function returned that is not plain data (shown, never compared)."""

    def __init__(self, kind: str, text: str = ""):
        self.kind, self.text = kind, text  # the value's class name, and its repr

    def __repr__(self) -> str:
        return self.text or f"<{self.kind}>"


class SandboxRefused(AssertionError):
    """Raised in the host when the function did what its exercise forbids (the check fails with this message)."""


def _plain(obj, depth: int = 0):
    """In the sandbox: ``obj`` as plain data the host can unpickle without running anything of the student's."""
    import torch

    from ._relay import raw

    if depth > 20:
        return Unplain("value", "a value nested too deeply")
    if isinstance(obj, torch.Tensor):
        return (_RESULT_MARK, raw(obj), bool(obj.requires_grad))
    kind = type(obj)
    if obj is None or kind in (bool, int, float, complex, str, bytes):
        return obj
    if isinstance(obj, bool) or isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, str):
        return str(obj)
    if kind in (range, slice, torch.dtype, torch.device, torch.Size):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [_plain(x, depth + 1) for x in obj]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, dict):
        return {_plain(k, depth + 1): _plain(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return set(_plain(x, depth + 1) for x in obj)
    try:
        return Unplain(kind.__name__, repr(obj)[:200])
    except Exception:
        return Unplain(kind.__name__)


def _unplain(obj):
    """In the host: the plain data back as tensors and containers."""
    from ._relay import unraw

    if isinstance(obj, tuple) and len(obj) == 3 and obj[0] == _RESULT_MARK:
        t = unraw(obj[1])
        return t.requires_grad_(True) if obj[2] and t.is_floating_point() else t
    if isinstance(obj, list):
        return [_unplain(x) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_unplain(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _unplain(v) for k, v in obj.items()}
    if isinstance(obj, set):
        return {_unplain(x) for x in obj}
    return obj


def _copy_back(old, new) -> None:
    """The arguments as the function left them, applied to the host's own objects."""
    import torch

    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        with torch.no_grad():
            if old.shape == new.shape and old.dtype == new.dtype:
                old.copy_(new)
            else:  # the function gave its argument another shape or dtype (tensor.data = ...): so does the host
                old.data = new
    elif type(old) is list and type(new) is list:
        if len(old) == len(new):
            for i, (a, b) in enumerate(zip(old, new)):
                if isinstance(a, torch.Tensor) or type(a) in (list, dict):
                    _copy_back(a, b)
                else:
                    old[i] = b
        else:
            old[:] = new
    elif type(old) is dict and type(new) is dict:
        for key in list(old):
            if key in new:
                _copy_back(old[key], new[key])
        for key in new:
            old.setdefault(key, new[key])
