"""What a grader's driver uses in the sandbox (``labsupport._sandbox``): a driver travels by value with its own
module and may import only the standard library, torch and labsupport there, so its shared helpers live here."""

from __future__ import annotations

import gc


def settle() -> None:
    """Free what is garbage and give the free heap back to the system: the resident size is then what is alive."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except Exception:  # not glibc: the reading keeps what the allocator holds
        pass


def call_answer(what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` for a student's function: ``NotImplementedError`` and ``AssertionError`` pass through,
    any other exception becomes an ``AssertionError`` naming ``what`` (so nbgrader takes the points, with a reason)."""
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, AssertionError):
        raise
    except Exception as exc:
        raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}") from None


def call_answer_hinted(what: str, hint: str, fn, *args, **kwargs):
    """``call_answer`` whose message ends with ``hint``, a sentence on the likely cause."""
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, AssertionError):
        raise
    except Exception as exc:
        raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}. {hint}".strip()) from None
