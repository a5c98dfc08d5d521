"""A static screen of the code a student wrote, for what honest answers never need.

``screen_notebook(submission, release)`` parses (AST, never regex) every code cell the student could write (answer
cells, cells they added, unlocked cells they changed) and returns ``Flag(cell, reason)`` for each use of:

* the grader itself (``autograder``, in an import, a name or a string) or IPython's machinery (``get_ipython``,
  magics and shell escapes, which become ``get_ipython()`` calls);
* private names of other code (an underscore-prefixed attribute of a module, or a private name of
  ``torch.distributed``, c10d or ``labsupport`` on any object but the cell's own ``self``: ``_get_backend``,
  ``torch._C``, ``torch.distributed._functional_collectives``), however the cell binds that name itself;
* what records or carries communication beside the collectives: ``labsupport.tap``, c10d's operators
  (``torch.ops.c10d``, ``torch.ops._c10d_functional``), the rendezvous store (``TCPStore``, ``FileStore``,
  ``HashStore``, ``PrefixStore``, ``_get_default_store``, ``_store_based_barrier``, ``dist.rendezvous``), sockets,
  ``mmap``, ``multiprocessing`` (its shared memory too), a tensor's shared storage (``share_memory_``,
  ``untyped_storage()._share_*``, ``torch.from_file`` outside the folder it was given);
* the interpreter's internals: ``sys.modules`` (all but ``name in sys.modules``), ``builtins``/``__builtins__``,
  ``__code__``, ``__globals__``, ``__closure__``/``cell_contents``, ``__wrapped__``, ``__defaults__``, frames
  (``sys._getframe``, ``inspect.currentframe``/``stack``/``trace``, ``tb_frame``, ``f_back``, ``f_locals``,
  ``gi_frame``, ``traceback.walk_stack``/``walk_tb``, ``capture_locals=True``, ...), trace and profile hooks
  (``sys.settrace``, ``threading.settrace``), ``exec``/``eval``/``compile``/``__import__``, ``importlib``,
  ``ctypes``, ``gc``, ``marshal``, unpickling, ``globals()``/``vars()``;
* rebinding what a module holds: assigning, deleting or ``setattr``-ing an attribute of an imported module;
* processes and files: ``subprocess``, ``os.system``, ``os.kill``, signals, raw file descriptors, ``/proc`` and
  ``/dev/shm`` paths, and any file opened, written or removed outside the notebook's folder (a path that is not a
  plain relative constant, nor under a folder one of the cell's functions is handed).

Never a flag by itself: what honest answers do every day, ``inspect`` (``signature``, ``getsource``), tracebacks
printed or formatted in an ``except`` (``traceback.print_exc``, ``format_exc``, ``sys.exc_info``, ``__traceback__``),
``sys.stdout``/``sys.stderr`` (printed to, or rebound), ``sys.argv``, reading ``os.environ``, ``os.path``, decorators of
``functools``, ``warnings``, ``logging``, ``typing``, ``dataclasses``, ``itertools``, ``collections``, ``math``,
``time`` (``tests/test_screen.py`` holds a corpus of them).

What syntax hides counts as the syntax: ``getattr``/``setattr``/``hasattr``/``delattr``, ``vars(x)[...]``,
``x.__dict__[...]``, ``object.__getattribute__``, ``inspect.getattr_static`` and ``operator.attrgetter`` with a
constant name, or one folded from constants (``"tb_" + "frame"``, an f-string, a name bound to constants), are
screened as the attribute they spell. Each reason says what was found and on which line(s) of the cell.

A flag asks a person to look; it never changes points by itself. Points come from the judge (``judge.py``).

The package: ``rules`` (what is a flag), ``walker`` (the walk over one cell's syntax tree, ``screen_source``),
``bindings`` and ``folding`` (what the cell's names stand for, and the constant strings an expression spells),
``syntax`` (reading a cell: ``python_source``, ``_imports``, ``_dotted``); here, which cells a student wrote and
the flags of a whole notebook (``screen_notebook``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from ..execute import cell_label, nbgrader_meta
from .rules import (ALLOWED_PRIVATE, FILE_CALLS, FLAGGED_ATTRIBUTES, FLAGGED_MODULES, FLAGGED_NAMES, FLAGGED_PATHS,
                    SHARED_MEMORY_ATTRIBUTES, STORE_NAMES, private_internals, torch_c10d)
# _dotted and _imports too: the judge and the definitions import them from here
from .syntax import _dotted, _imports, _own_private, python_source  # noqa: F401
from .walker import screen_source

__all__ = ["Flag", "screen_notebook", "screen_source", "student_cells", "python_source", "private_internals",
           "torch_c10d", "ALLOWED_PRIVATE", "FILE_CALLS", "FLAGGED_ATTRIBUTES", "FLAGGED_MODULES", "FLAGGED_NAMES",
           "FLAGGED_PATHS", "SHARED_MEMORY_ATTRIBUTES", "STORE_NAMES"]


@dataclass(frozen=True)
class Flag:
    cell: str        # how a person names the cell (`grade_id` or "cell N ('first line')")
    reason: str

    def __str__(self) -> str:
        return f"{self.cell}: {self.reason}"



def student_cells(submission, release) -> list[tuple[int, object]]:
    """(index, cell) of every code cell of ``submission`` a student wrote or could change: answer cells, cells
    without nbgrader metadata that are not an unchanged copy of a release cell."""
    from ..feedback import source_text

    untouched = {_norm(source_text(c)) for c in release.cells if c.cell_type == "code"}
    found = []
    for i, cell in enumerate(submission.cells):
        if cell.cell_type != "code":
            continue
        meta = nbgrader_meta(cell)
        if meta.get("grade") or (meta.get("locked") and not meta.get("solution")):
            continue  # read-only: restored from the release before grading
        if not meta.get("solution") and _norm(source_text(cell)) in untouched:
            continue
        found.append((i, cell))
    return found


def _norm(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def screen_notebook(submission, release) -> list[Flag]:
    """Flags for every student-written code cell of ``submission`` (see the module docstring).

    Imports made by the notebook's read-only cells (``import torch.distributed as dist`` in the set-up cell) are
    known to every cell, so ``dist._something`` is recognised as a module path wherever it is written.
    """
    from ..feedback import source_text

    modules: dict[str, str] = {}
    own: set[str] = set()
    cells = student_cells(submission, release)
    for cell in release.cells:
        if cell.cell_type == "code":
            try:
                modules.update(_imports(ast.parse(python_source(source_text(cell)))))
            except (SyntaxError, ValueError):
                pass
    for _i, cell in cells:  # names one cell defines may be used in another
        try:
            own |= _own_private(ast.parse(python_source(source_text(cell))))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            pass
    flags = []
    for i, cell in cells:
        for reason in screen_source(source_text(cell), modules, own):
            flags.append(Flag(cell_label(cell, i).strip("`"), reason))
    return flags
