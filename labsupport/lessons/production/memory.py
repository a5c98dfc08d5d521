"""Measuring for notebook 09_production: the peak resident memory of a ``with`` block (``PeakMemory``), the bytes
of the tensors in a state (``tensor_bytes``) and of the files in a folder (``dir_bytes``).
"""

from __future__ import annotations

import os

import torch


class PeakMemory:
    """The peak resident memory of this process inside the ``with`` block, above where it started, in bytes, as the
    kernel counts it (``VmHWM``, reset through ``/proc/self/clear_refs``; Linux only, else ``nan``).

    Example::

        with lesson.PeakMemory() as peak:
            sd = {k: v.clone() for k, v in model.state_dict().items()}
        peak.grown     # about the bytes of the copy
    """

    def __enter__(self):
        self._ok = _reset_peak()
        self._start = _kb("VmRSS")
        return self

    def __exit__(self, *exc):
        peak = _kb("VmHWM")
        self.grown = (peak - self._start) * 1024 if self._ok and peak is not None else float("nan")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _kb(key: str):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (nested dicts, lists and tuples; a DTensor counts its local shard), each
    storage once."""
    seen, total, stack = set(), 0, [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, torch.Tensor):
            local = item.to_local() if hasattr(item, "to_local") else item
            storage = local.untyped_storage()
            if storage.data_ptr() not in seen or not storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def dir_bytes(directory: str) -> dict:
    """{file name: bytes} of every file under ``directory``."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, directory)] = os.path.getsize(path)
    return out
