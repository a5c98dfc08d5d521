"""What the checks of ``save_sharded`` / ``load_resharded`` share: the values of a checkpoint they save, a rank's
shard of them in notebook 07's layout (flat, padded with zeros to N·c, c = ceil(Ψ/N)), and how they call the
student's functions."""

from __future__ import annotations

import torch


def _values(numel: int, dtype, tag: int):
    """The whole parameter of checkpoint ``tag``: element i holds i + tag (exact in float32 up to 2^24), or in a
    16-bit dtype (i mod 200) + tag, which float16 and bfloat16 hold exactly."""
    values = torch.arange(numel, dtype=torch.float64)
    if torch.empty((), dtype=dtype).element_size() == 2:
        values.remainder_(200)
    return values.add_(tag).to(dtype)


def _padded_shard(full, rank: int, world: int):
    c = -(-full.numel() // world)
    out = torch.zeros(c, dtype=full.dtype)
    piece = full[rank * c:(rank + 1) * c]
    out[:piece.numel()] = piece
    return out


def only_shared(exc_name: str) -> str:
    """What a message adds when the sandbox refused the answer a file (``PermissionError``): the folders it may use."""
    if exc_name != "PermissionError":
        return ""
    return (" While grading, the ranks share one folder, the one the checkpoint directory lies in: save and load "
            "there (and in the working folder, which is each rank's own), nowhere else.")


def call_disk(what: str, fn, *args):
    """``call_student`` for the checkpoint's functions, with ``only_shared``'s hint."""
    try:
        return fn(*args)
    except (NotImplementedError, AssertionError):
        raise
    except Exception as exc:
        raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}{only_shared(type(exc).__name__)}") from None
