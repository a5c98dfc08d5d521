"""Diagrams and measurement plots drawn with matplotlib, one module per topic.

Every function returns the matplotlib ``Figure`` it drew, so a notebook cell shows it and a test can inspect it.
The public functions of every module in this package are also available here: ``labsupport.plots.NAME``.
"""

import importlib as _importlib
import pkgutil as _pkgutil

__all__ = []
for _info in _pkgutil.iter_modules(__path__):
    if _info.name.startswith("_"):
        continue
    _mod = _importlib.import_module(f"{__name__}.{_info.name}")
    for _name in getattr(_mod, "__all__", ()):
        globals()[_name] = getattr(_mod, _name)
        __all__.append(_name)
