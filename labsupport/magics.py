"""``%%distributed``: run a whole notebook cell on every rank.

    %load_ext labsupport

    %%distributed -n 4
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    print(x)

The cell sees the notebook's functions, classes, imports and variables it names, plus ``rank`` and ``world_size``.
Names it assigns stay on the workers: return values to the notebook with ``labsupport.run`` instead.
"""

from __future__ import annotations

import argparse
import builtins
import linecache
import shlex
import sys
import types

from . import _pickling
from .i18n import _

_counter = [0]


class _ArgumentError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _ArgumentError(_("%%distributed: {message}. Usage: %%distributed -n N [--backend B] [--timeout S]")
                             .format(message=message))


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="%%distributed", add_help=False)
    p.add_argument("-n", "--world-size", "--nproc", dest="n", type=int, default=4)
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--timeout", type=float, default=60.0)
    return p


def _names(code: types.CodeType) -> set:
    names = set(code.co_names) | set(code.co_varnames)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _snapshot(code: types.CodeType, user_ns: dict) -> tuple[dict, dict]:
    """Pickle the notebook names the cell uses. Returns ({name: bytes}, {name: why it could not be sent})."""
    sent, skipped = {}, {}
    for name in sorted(_names(code)):
        if name in ("rank", "world_size") or name not in user_ns or hasattr(builtins, name):
            continue
        try:
            sent[name] = _pickling.dumps(user_ns[name])
        except Exception as exc:
            skipped[name] = f"{type(exc).__name__}: {exc}"
    return sent, skipped


def run_cell(source: str, filename: str, names: dict, skipped: dict):
    """What every rank runs for a ``%%distributed`` cell."""
    import torch.distributed as dist

    ns = {"__name__": "__main__", "__builtins__": builtins}
    for name, data in names.items():
        try:
            ns[name] = _pickling.loads(data)
        except Exception as exc:
            skipped[name] = f"{type(exc).__name__}: {exc}"
    ns["rank"] = dist.get_rank()
    ns["world_size"] = dist.get_world_size()
    try:
        exec(compile(source, filename, "exec"), ns)
    except NameError as exc:
        missing = getattr(exc, "name", None)
        if missing in skipped:
            raise NameError(_(
                "{error}: the notebook has {name}, but it could not be sent to the workers ({why})"
            ).format(error=exc, name=repr(missing), why=skipped[missing])) from None
        raise
    return None


def _running_cell_number(ipython) -> int:
    """N of the ``In[N]`` cell running now: the number IPython gave the code that called this magic.

    ``execution_count`` alone is not enough: IPython 9 counts the running cell before running it, IPython 8 after
    (``Cell In[N]`` would then be off by one).
    """
    numbers = getattr(ipython.compile, "_filename_map", {})
    frame = sys._getframe(1)
    while frame is not None:
        number = numbers.get(frame.f_code.co_filename)
        if number is not None:
            return number
        frame = frame.f_back
    return ipython.execution_count


def _cell_filename(cell: str, ipython=None) -> tuple[str, str]:
    """(filename, source) for the cell's code, registered so that tracebacks and deadlock reports show its lines.

    In IPython the name is made by IPython's own compiler, so it reads ``Cell In[N]`` with N the kernel's execution
    count, like every other cell. The source starts with a blank line standing for the ``%%distributed`` line:
    line numbers are then the ones the student sees in the notebook.
    """
    source = "\n" + cell
    compiler = getattr(ipython, "compile", None)
    if compiler is not None and hasattr(compiler, "cache"):
        try:
            return compiler.cache(source, _running_cell_number(ipython)), source
        except Exception:  # pragma: no cover - an IPython whose compiler cannot cache
            pass
    _counter[0] += 1
    filename = f"<distributed cell {_counter[0]}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return filename, source


def distributed(line: str, cell: str, user_ns: dict | None = None, ipython=None) -> None:
    __tracebackhide__ = True
    from .launch import run

    args = _parser().parse_args(shlex.split(line))
    filename, source = _cell_filename(cell, ipython)
    code = compile(source, filename, "exec")
    names, skipped = _snapshot(code, user_ns or {})
    run(run_cell, source, filename, names, skipped, world_size=args.n, backend=args.backend, timeout=args.timeout)


def register(ipython) -> None:
    def magic(line, cell):
        __tracebackhide__ = True
        try:
            return distributed(line, cell, ipython.user_ns, ipython)
        except _ArgumentError as exc:
            from IPython.core.error import UsageError

            raise UsageError(str(exc)) from None

    magic.__doc__ = __doc__
    ipython.register_magic_function(magic, magic_kind="cell", magic_name="distributed")
