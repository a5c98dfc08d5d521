"""Pickling by value for what a notebook sends to its workers, with the names of code kept.

cloudpickle sends functions and classes defined in a notebook by value. Since cloudpickle 3.1.3 it renames the
file of every code object it sends to ``<dynamic-code>``, so that a payload does not depend on where it was made.
The launcher needs that name: a traceback from a worker points at the student's own cell (``Cell In[5]``, see
``_frames``) only if the worker's code still says which cell it came from. So code objects travel here through
``marshal``, which keeps every field; the notebook and its workers run the same interpreter, which is all that
``marshal`` asks.
"""

from __future__ import annotations

import io
import marshal
import pickle
import types
from collections import ChainMap

import cloudpickle

loads = pickle.loads


def _code_reduce(code: types.CodeType):
    return marshal.loads, (marshal.dumps(code),)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)


def dumps(obj, protocol: int = pickle.HIGHEST_PROTOCOL) -> bytes:
    """cloudpickle.dumps, keeping each code object's file name and line numbers."""
    with io.BytesIO() as file:
        _Pickler(file, protocol=protocol).dump(obj)
        return file.getvalue()
