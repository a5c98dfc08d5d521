"""Visible tests that let a fresh notebook run to its end, and a Validate button that reads like a checklist.

A visible-test cell starts with ``%%visible_test NAME`` (registered by ``%load_ext labsupport``):

* the exercise works: the cell runs as written, and ``NAME`` is recorded as passing;
* the exercise is not written yet (``NotImplementedError``, in this kernel or on a rank): one line says so and
  the cell ends without an error, so *Run All* goes on through the explanations, demos and plots below it;
* anything else (a wrong answer, a crash, a deadlock): the error is shown as usual and *Run All* stops there.

The hidden-test cell of the exercise starts with ``labsupport.require_passed("NAME")``. It does nothing while you
work, nor while the autograder grades (the hidden tests decide then). Under nbgrader's *Validate* (which runs the
notebook in a fresh kernel, every cell even after an error, and lists the graded cells that failed) the last
exercise's cell fails unless every exercise passed, with one report: a line per exercise (passes / not started /
fails and the first line of its message), then the details of the first failure. The other exercises' cells stay
quiet, so the dialog shows that report once instead of a traceback per exercise, and ``checklist_first`` (run by
Validate's executor) makes the checklist the first thing under nbgrader's "The following cell failed:" instead of
that hidden-test cell's source. (The order of the exercises comes from the notebook Validate runs, in the kernel's
folder; when it cannot be told, each exercise's cell fails on its own, with its own line.)

With ``LABSUPPORT_GRADING=1`` (``python -m autograder check``, grading) nothing is swallowed: an unimplemented
exercise fails its visible test, as it should when counting points.
"""

from __future__ import annotations

import glob
import hashlib
import json
import linecache
import os
import re
import traceback
from dataclasses import dataclass

from .i18n import N_, _

__all__ = ["require_passed", "require_visible", "register"]

PASSES, NOT_STARTED, FAILS = "passes", "not started", "fails"
#: The one wording of an exercise that still raises ``NotImplementedError``: Validate's checklist, the visible
#: test's line, ``python -m autograder check`` and the demos' ``labsupport.skipped`` all say it (in the language in
#: use: ``_(NOT_STARTED_LINE)``).
NOT_STARTED_LINE = N_("not started: it still raises NotImplementedError")


@dataclass
class _Outcome:
    status: str             # PASSES, NOT_STARTED or FAILS (FAILS too while the cell is still running)
    summary: str = ""       # FAILS: the first line of the message
    details: str = ""       # FAILS: the whole message, and where in the notebook it was raised


#: exercise name -> {cell hash: the outcome of that visible-test cell in its latest run}
_RESULTS: dict[str, dict[str, _Outcome]] = {}
_counter = [0]

_REQUIRE = re.compile(r"""require_passed\(\s*["'](\w+)["']\s*\)""")


def _strict() -> bool:
    """True while grading or checking: visible tests must fail for real then."""
    return (os.environ.get("LABSUPPORT_GRADING", "") not in ("", "0")
            or os.environ.get("NBGRADER_EXECUTION", "") == "autograde")


def _not_implemented(exc: BaseException) -> bool:
    if isinstance(exc, NotImplementedError):
        return True
    return getattr(exc, "exc_type", None) == "NotImplementedError"  # raised on a rank: a WorkerError


def _passed(name: str) -> bool:
    results = _RESULTS.get(name, {})
    return bool(results) and all(o.status == PASSES for o in results.values())


def _outcome(name: str) -> _Outcome | None:
    """The exercise's outcome over its visible tests: the first failure, else not started, else passes; None when
    none of them ran."""
    results = list(_RESULTS.get(name, {}).values())
    if not results:
        return None
    for status in (FAILS, NOT_STARTED):
        for o in results:
            if o.status == status:
                return o
    return results[0]


def _line(name: str, width: int) -> str:
    o = _outcome(name)
    if o is None:
        state = _("not run: its visible test did not run in this kernel (was its cell removed or interrupted?)")
    elif o.status == FAILS:
        state = _("fails: {summary}").format(summary=o.summary)
    elif o.status == NOT_STARTED:
        state = _(NOT_STARTED_LINE)
    else:
        state = _("passes")
    return f"  {name:<{width}}  {state}"


def _report(names: list[str]) -> list[str]:
    """The checklist of ``names``, then the details of the first failure (or what to do about the rest)."""
    passing = sum(_passed(n) for n in names)
    width = max(map(len, names))
    lines = [_("{passing} of {total} exercises pass their visible tests (Validate ran this notebook from the top "
               "in a fresh kernel):").format(passing=passing, total=len(names))]
    lines += [_line(n, width) for n in names]
    first = next((n for n in names if (o := _outcome(n)) is not None and o.status == FAILS), None)
    if first is not None:
        lines += ["", _("The first failure, {name}:").format(name=first), *_outcome(first).details.splitlines()]
    else:
        lines += ["", _("Write the exercises not started yet and run their visible tests, then Validate again.")]
    return lines


class ValidationReport(AssertionError):
    """What Validate shows for a notebook whose exercises do not all pass: the report, no traceback."""

    def _render_traceback_(self) -> list[str]:
        return str(self).splitlines()


#: The ``grade_id`` that ``checklist_first`` gives the cell it turns into the checklist.
CHECKLIST_ID = "validate_checklist"


def checklist_first(cell=None, **_kwargs) -> None:
    """Validate's dialog, made to open with the checklist.

    nbgrader's Validate lists every failed graded cell as "The following cell failed:", the cell's source, then its
    error. The cell that raises the checklist is an exercise's hidden-test cell, whose source (the description of
    that exercise's hidden tests) says nothing about the others. Called by Validate's executor on each cell that
    raised (``Execute.on_cell_error``, set in the course's ``nbgrader_config.py``), this turns a cell that raised the
    checklist, in the copy of the notebook Validate runs (never the file), into a cell of the course's own: its source
    is the checklist (a line per exercise), its error the details of the first failure, its points 0. So the first
    thing under nbgrader's heading is the checklist.

    It does nothing outside Validate (``NBGRADER_VALIDATING``, which nbgrader's Validator sets in its own process),
    so grading never sees it, and nothing to a cell whose source no longer matches its checksum, so Validate still
    reports an edited test cell as edited."""
    if cell is None or os.environ.get("NBGRADER_VALIDATING", "") != "1" or cell.get("cell_type") != "code":
        return
    reports = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"
               and o.get("ename") == ValidationReport.__name__]
    meta = cell.get("metadata", {}).get("nbgrader", {})
    if not reports or not meta.get("grade"):
        return
    if "checksum" in meta:
        from nbgrader.utils import compute_checksum

        if compute_checksum(cell) != meta["checksum"]:
            return
    lines = list(reports[0].get("traceback") or str(reports[0].get("evalue", "")).splitlines())
    blank = lines.index("") if "" in lines else len(lines)
    checklist, details = lines[:blank], lines[blank + 1:] or [_("Validate again once every exercise passes.")]
    from nbformat import from_dict

    cell["source"] = "\n".join(checklist)
    cell["metadata"]["nbgrader"] = from_dict({"grade": True, "grade_id": CHECKLIST_ID, "points": 0, "locked": False,
                                              "solution": False, "schema_version": meta.get("schema_version", 3)})
    reports[0]["evalue"], reports[0]["traceback"] = details[0], details


def _exercise_order(name: str) -> list[str] | None:
    """The exercises of the notebook being validated, in order (from its ``require_passed`` calls), or None when it
    cannot be told. Validate starts the kernel in the notebook's folder; several notebooks there that hold
    ``name`` must agree."""
    orders = set()
    for path in sorted(glob.glob("*.ipynb")):
        try:
            with open(path, encoding="utf-8") as f:
                cells = json.load(f).get("cells", [])
        except (OSError, ValueError):
            continue
        found = []
        for cell in cells:
            if cell.get("cell_type") != "code":
                continue
            source = cell.get("source", "")
            source = "".join(source) if isinstance(source, list) else source
            found += [n for n in _REQUIRE.findall(source) if n not in found]
        if name in found:
            orders.add(tuple(found))
    return list(orders.pop()) if len(orders) == 1 else None


def require_passed(name: str) -> None:
    """Under nbgrader's Validate: the checklist (see the module's help) once the last exercise is reached, if any
    exercise does not pass. Otherwise nothing."""
    if os.environ.get("NBGRADER_VALIDATING", "") != "1":
        return
    order = _exercise_order(name)
    if order is None:                      # cannot tell which cell comes last: this exercise's own line
        if not _passed(name):
            raise ValidationReport("\n".join(_report([name])))
        return
    if name != order[-1]:
        return
    if not all(_passed(n) for n in order):
        raise ValidationReport("\n".join(_report(order)))


class NotPassed(NotImplementedError):
    """What ``require_visible`` raises: a ``NotImplementedError``, so that a demo's ``except`` catches it with the
    exercise's own; ``labsupport.skipped`` prints its message as it is."""

    not_passed = True


def require_visible(name: str) -> None:
    """For a demo that runs exercise ``name``: raise ``NotImplementedError`` (``NotPassed``) unless its visible tests
    passed in this kernel, saying why (not started, the first line of its failure, or not run). A demo that catches
    it says "skipped" at once, where an exercise that deadlocks would make it wait for its time limit (and every demo
    after it too)."""
    if _passed(name):
        return
    o = _outcome(name)
    if o is not None and o.status == NOT_STARTED:
        raise NotPassed(_("{name} is {state}").format(name=name, state=_(NOT_STARTED_LINE)))
    if o is not None and o.status == FAILS and o.summary:
        raise NotPassed(_("{name} fails its visible test ({summary}); this demo uses it").format(name=name,
                                                                                                summary=o.summary))
    raise NotPassed(_("{name} has not passed its visible test in this kernel yet (run that cell after changing it); "
                      "this demo uses it").format(name=name))


def _where(exc: BaseException, name: str) -> list[str]:
    """The frames of the notebook (its cells, the visible test) in ``exc``'s traceback: none of the library's."""
    try:
        from ._frames import display_name
    except Exception:  # pragma: no cover
        display_name = str
    lines = []
    for frame in traceback.extract_tb(exc.__traceback__):
        filename = frame.filename
        if filename.startswith("<visible test "):
            place = _("its visible test, line {line}").format(line=frame.lineno)
        elif display_name(filename) != filename:
            place = _("{file}, line {line}, in {function}").format(file=display_name(filename), line=frame.lineno,
                                                                  function=frame.name)
        else:
            continue
        src = (frame.line or linecache.getline(filename, frame.lineno)).strip()
        at = _("at {place}: {source}").format(place=place, source=src) if src else _("at {place}").format(place=place)
        lines.append("  " + at)
    return lines


def _failure(exc: BaseException, name: str) -> _Outcome:
    """A failing visible test: its message as the notebook showed it, without the library's frames."""
    text = str(exc).strip()
    if hasattr(exc, "_render_traceback_") or (isinstance(exc, AssertionError) and text):
        body = text                        # a WorkerError says which rank raised what; an assert says what is wrong
    else:
        body = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    where = _where(exc, name)
    summary = body.splitlines()[0] if body else type(exc).__name__
    if not text and where:
        summary += " " + where[0].lstrip()
    return _Outcome(FAILS, summary, "\n".join([body, *where]))


def _visible_test(line: str, cell: str) -> None:
    __tracebackhide__ = True
    from IPython import get_ipython

    name = line.strip()
    if not name.isidentifier():
        raise ValueError(_("%%visible_test takes the exercise's name, e.g. %%visible_test broadcast (got {line})")
                         .format(line=repr(line)))
    shell = get_ipython()
    key = hashlib.sha1(cell.encode()).hexdigest()
    _counter[0] += 1
    filename = f"<visible test {name} #{_counter[0]}>"
    linecache.cache[filename] = (len(cell), None, cell.splitlines(keepends=True), filename)
    unfinished = _("its visible test did not finish (interrupted?)")
    _RESULTS.setdefault(name, {})[key] = _Outcome(FAILS, unfinished, unfinished)
    try:
        exec(compile(cell, filename, "exec"), shell.user_ns)
    except BaseException as exc:
        if _not_implemented(exc):
            _RESULTS[name][key] = _Outcome(NOT_STARTED)
        else:
            _RESULTS[name][key] = _failure(exc, name)
        if _strict() or not _not_implemented(exc):
            raise
        print(_("{name} is {state}. Its visible test is skipped and the notebook goes on; Validate and "
                "the grader count it as not done.").format(name=name, state=_(NOT_STARTED_LINE)))
        return
    _RESULTS[name][key] = _Outcome(PASSES)


def register(ipython) -> None:
    """Register ``%%visible_test`` (called by ``%load_ext labsupport``)."""
    ipython.register_magic_function(_visible_test, magic_kind="cell", magic_name="visible_test")
