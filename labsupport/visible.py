"""Visible tests that let a fresh notebook run to its end, and a Validate button that tells the truth.

A visible-test cell starts with ``%%visible_test NAME`` (registered by ``%load_ext labsupport``):

* the exercise works: the cell runs as written, and ``NAME`` is recorded as passing;
* the exercise is not written yet (``NotImplementedError``, in this kernel or on a rank): one line says so and
  the cell ends without an error, so *Run All* goes on through the explanations, demos and plots below it;
* anything else (a wrong answer, a crash, a deadlock): the error is shown as usual and *Run All* stops there.

The hidden-test cell of the exercise starts with ``labsupport.require_passed("NAME")``. It does nothing while you
work, nor while the autograder grades (the hidden tests decide then). Under nbgrader's *Validate* it fails unless
every visible test of ``NAME`` passed in that run, so Validate says "not done" for an untouched notebook.

With ``LABSUPPORT_GRADING=1`` (``python -m autograder check``, grading) nothing is swallowed: an unimplemented
exercise fails its visible test, as it should when counting points.
"""

from __future__ import annotations

import hashlib
import linecache
import os

__all__ = ["require_passed", "require_visible", "register"]

#: exercise name -> {cell hash: whether that visible-test cell passed in its latest run}
_RESULTS: dict[str, dict[str, bool]] = {}
_counter = [0]


def _strict() -> bool:
    """True while grading or checking: visible tests must fail for real then."""
    return (os.environ.get("LABSUPPORT_GRADING", "") not in ("", "0")
            or os.environ.get("NBGRADER_EXECUTION", "") == "autograde")


def _not_implemented(exc: BaseException) -> bool:
    if isinstance(exc, NotImplementedError):
        return True
    return getattr(exc, "exc_type", None) == "NotImplementedError"  # raised on a rank: a WorkerError


def require_passed(name: str) -> None:
    """Under nbgrader's Validate: fail unless every visible test of exercise ``name`` passed. Otherwise nothing."""
    if os.environ.get("NBGRADER_VALIDATING", "") != "1":
        return
    results = _RESULTS.get(name, {})
    if not results:
        raise AssertionError(f"{name}: its visible tests did not run, or it is not implemented yet.")
    if not all(results.values()):
        raise AssertionError(f"{name}: its visible tests do not pass yet.")


def require_visible(name: str) -> None:
    """For a demo that runs exercise ``name``: raise ``NotImplementedError`` unless its visible tests passed in this
    kernel. A demo that catches it says "skipped" at once, where an exercise that deadlocks would make it wait for
    its time limit (and every demo after it too)."""
    results = _RESULTS.get(name, {})
    if not results or not all(results.values()):
        raise NotImplementedError(f"{name} has not passed its visible test in this kernel yet (run that cell after "
                                  "changing it); this demo uses it")


def _visible_test(line: str, cell: str) -> None:
    __tracebackhide__ = True
    from IPython import get_ipython

    name = line.strip()
    if not name.isidentifier():
        raise ValueError(f"%%visible_test takes the exercise's name, e.g. %%visible_test broadcast (got {line!r})")
    shell = get_ipython()
    key = hashlib.sha1(cell.encode()).hexdigest()
    _counter[0] += 1
    filename = f"<visible test {name} #{_counter[0]}>"
    linecache.cache[filename] = (len(cell), None, cell.splitlines(keepends=True), filename)
    _RESULTS.setdefault(name, {})[key] = False
    try:
        exec(compile(cell, filename, "exec"), shell.user_ns)
    except BaseException as exc:
        if _strict() or not _not_implemented(exc):
            raise
        print(f"{name} is not implemented yet: this visible test is skipped and the notebook goes on. "
              "Validate and the grader count it as not done.")
        return
    _RESULTS[name][key] = True


def register(ipython) -> None:
    """Register ``%%visible_test`` (called by ``%load_ext labsupport``)."""
    ipython.register_magic_function(_visible_test, magic_kind="cell", magic_name="visible_test")
