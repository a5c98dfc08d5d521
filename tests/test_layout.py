"""One name per lesson: every assignment ``NN_name`` has its checks in ``autograder/checks/name.py`` (or a package
``autograder/checks/name/``) and, where it has helpers, its lesson module ``labsupport.lessons.name``; a notebook
never defines again what its lesson module (or ``labsupport`` itself) already provides."""

import ast
import importlib
import json
import pkgutil

import pytest

import labsupport
import labsupport.lessons
from autograder.course import Course, repository_root

COURSE = Course.at(repository_root())
ASSIGNMENTS = COURSE.assignments()


def _lesson(aid: str) -> str:
    return aid.split("_", 1)[1]


def _code_cells(aid: str) -> list[str]:
    nb = json.loads(COURSE.source_notebook(aid).read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def _defined(source: str) -> set[str]:
    """Names a cell defines at its top level with ``def`` or ``class`` (IPython magic lines dropped)."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    return {node.name for node in ast.parse(code).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def _provided(module) -> set[str]:
    """The public names a module (and, for a package, its submodules) offers."""
    names = {n for n in getattr(module, "__all__", dir(module)) if not n.startswith("_")}
    for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
        if not info.name.startswith("_"):
            sub = importlib.import_module(f"{module.__name__}.{info.name}")
            names |= {n for n in getattr(sub, "__all__", ()) if not n.startswith("_")}
    return names


def test_every_lesson_module_is_named_after_an_assignment():
    lessons = {_lesson(aid) for aid in ASSIGNMENTS}
    for info in pkgutil.iter_modules(labsupport.lessons.__path__):
        assert info.name in lessons, f"labsupport/lessons/{info.name} is named after no notebook in solutions/"


@pytest.mark.parametrize("aid", ASSIGNMENTS)
def test_checks_are_named_after_the_lesson(aid):
    checks = COURSE.root / "autograder" / "checks"
    name = _lesson(aid)
    assert (checks / f"{name}.py").is_file() or (checks / name / "__init__.py").is_file(), (
        f"the checks of {aid} belong in autograder/checks/{name}.py or the package autograder/checks/{name}/")
    for source in _code_cells(aid):
        for line in source.splitlines():
            if line.startswith("from autograder.checks."):
                module = line.split()[1].rsplit(".", 1)[1]
                assert module == _lesson(aid), f"{aid} imports checks from {module}: {line}"


@pytest.mark.parametrize("aid", ASSIGNMENTS)
def test_notebook_does_not_define_what_its_lesson_module_provides(aid):
    provided = set(labsupport.__all__)
    try:
        provided |= _provided(importlib.import_module(f"labsupport.lessons.{_lesson(aid)}"))
    except ModuleNotFoundError:
        pass
    for i, source in enumerate(_code_cells(aid)):
        again = _defined(source) & provided
        assert not again, (f"{aid}: code cell {i} defines {sorted(again)}, which labsupport or "
                           f"labsupport.lessons.{_lesson(aid)} already provides: import it instead")


def test_the_check_can_fail():
    """The check above sees a copied helper: show_table defined in a cell is caught."""
    cell = "def show_table(header, rows):\n    print(header)\n\n%matplotlib inline\nx = 1"
    assert _defined(cell) & set(labsupport.__all__) == {"show_table"}
