"""Pickling by value for what a notebook sends to its workers, with the names of code kept.

cloudpickle sends functions and classes defined in a notebook by value. Since cloudpickle 3.1.3 it renames the
file of every code object it sends to ``<dynamic-code>``, so that a payload does not depend on where it was made.
The launcher needs that name: a traceback from a worker points at the student's own cell (``Cell In[5]``, see
``_frames``) only if the worker's code still says which cell it came from. So code objects travel here through
``marshal``, which keeps every field; the notebook and its workers run the same interpreter, which is all that
``marshal`` asks.

A helper decorated with ``functools.lru_cache`` (or ``functools.cache``) in a notebook is not a function but a cache
object, which plain pickling sends by name, and a worker has no such name: it travels as the function it wraps
(by value) and is wrapped again, with the same ``maxsize`` and ``typed``, on the other side.
"""

from __future__ import annotations

import functools
import io
import marshal
import pickle
import sys
import types
from collections import ChainMap

import cloudpickle

loads = pickle.loads


def _code_reduce(code: types.CodeType):
    return marshal.loads, (marshal.dumps(code),)


def identity(obj):
    """What an object that pickles as another one (the judge's stand-in for a student's function) rebuilds with."""
    return obj


def _rebuild_cache(fn, maxsize, typed):
    return functools.update_wrapper(functools.lru_cache(maxsize=maxsize, typed=typed)(fn), fn)


def _cache_reduce(obj):
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if module is not None and module.__name__ != "__main__" and getattr(module, obj.__name__, None) is obj:
        return obj.__reduce__()  # a library's cached function: by name, as pickle does
    params = obj.cache_parameters()
    return _rebuild_cache, (obj.__wrapped__, params["maxsize"], params["typed"])


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _code_reduce, functools._lru_cache_wrapper: _cache_reduce},
                              cloudpickle.Pickler.dispatch_table)


def dumps(obj, protocol: int = pickle.HIGHEST_PROTOCOL) -> bytes:
    """cloudpickle.dumps, keeping each code object's file name and line numbers."""
    with io.BytesIO() as file:
        _Pickler(file, protocol=protocol).dump(obj)
        return file.getvalue()
