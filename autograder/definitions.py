"""Which statements of a student's cell the judge runs: definitions only, with nothing of the student's running.

``definitions(source, modules)`` keeps imports (of allowed modules), ``def``, ``class`` and assignments of simple
values, and reports every other statement as skipped. What would run at definition time is restricted: decorators,
default values, base classes, class bodies and assigned values may only be constants, names, attributes and calls
of a few harmless builtins or of imported library modules (see ``SAFE_BUILTINS``, ``SAFE_MODULES``); annotations of
functions are dropped. Used by ``judge.py``.
"""

from __future__ import annotations

import ast

#: Builtins that a definition may call at definition time (harmless, return plain values).
SAFE_BUILTINS = {"float", "int", "str", "bytes", "bool", "tuple", "list", "dict", "set", "frozenset", "range",
                 "complex", "slice", "len", "min", "max", "abs", "round", "sum", "sorted", "reversed", "enumerate",
                 "zip", "object", "property", "staticmethod", "classmethod", "isinstance", "issubclass", "repr",
                 "divmod", "pow", "hash", "type", "Exception", "ValueError", "RuntimeError", "TypeError"}
#: Modules whose functions and classes a definition may call at definition time.
SAFE_MODULES = {"torch", "math", "numpy", "functools", "dataclasses", "typing", "collections", "itertools",
                "operator", "enum", "abc", "contextlib", "fractions", "decimal", "statistics", "random", "string",
                "datetime", "time", "labsupport", "matplotlib", "copy", "heapq", "bisect", "warnings", "re"}
#: Modules a student's cell may not import in the judge (the import is skipped): the grader's own. Any other import
#: is kept (``sys``, ``os``, ``inspect``, ``traceback``, ``types``...): importing runs no student code, nothing of
#: such a module is called at definition time (``SAFE_MODULES``), and the student's functions run on workers.
BLOCKED_IMPORTS = {"autograder", "IPython", "ipykernel", "nbgrader"}


# ---------------------------------------------------------------------------------------------------------------
# which statements of a student's cell the judge runs


class _Rules:
    def __init__(self, modules: dict[str, str]):
        self.modules = modules   # name -> module it was imported as (from every cell seen so far)

    def _root_ok(self, parts: list[str]) -> bool:
        if not parts:
            return False
        if len(parts) == 1 and parts[0] in SAFE_BUILTINS:
            return True
        path = self.modules.get(parts[0])
        if path is None or path.split(".")[0] not in SAFE_MODULES:
            return False
        return not any(p.startswith("_") for p in parts[1:] + path.split("."))

    def value(self, node, allow_calls: bool = True) -> bool:
        """An expression safe to evaluate at definition time: no student code and nothing private runs."""
        if node is None:
            return True
        if isinstance(node, ast.Constant):
            return True
        if isinstance(node, ast.Name):
            return not node.id.startswith("__")
        if isinstance(node, ast.Attribute):
            return not node.attr.startswith("_") and self.value(node.value, allow_calls)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return all(self.value(e, allow_calls) for e in node.elts)
        if isinstance(node, ast.Dict):
            return all(self.value(k, allow_calls) for k in node.keys if k is not None) and \
                all(self.value(v, allow_calls) for v in node.values)
        if isinstance(node, ast.UnaryOp):
            return self.value(node.operand, allow_calls)
        if isinstance(node, (ast.BinOp,)):
            return self._data(node.left) and self._data(node.right)
        if isinstance(node, ast.Subscript):
            return self._dotted_ok(node.value) and self.value(node.slice, allow_calls)
        if isinstance(node, ast.Call) and allow_calls:
            return (self._dotted_ok(node.func) and all(self._data(a) for a in node.args)
                    and all(self._data(k.value) for k in node.keywords))
        return False

    def _dotted_ok(self, node) -> bool:
        from .screen import _dotted

        parts = _dotted(node)
        return bool(parts) and self._root_ok(parts)

    def _data(self, node) -> bool:
        """Plain data: constants, containers of them, library attributes (``torch.float32``), arithmetic."""
        if isinstance(node, ast.Constant):
            return True
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return all(self._data(e) for e in node.elts)
        if isinstance(node, ast.Dict):
            return all(self._data(k) for k in node.keys if k is not None) and all(self._data(v) for v in node.values)
        if isinstance(node, ast.UnaryOp):
            return self._data(node.operand)
        if isinstance(node, ast.BinOp):
            return self._data(node.left) and self._data(node.right)
        if isinstance(node, (ast.Attribute, ast.Name)):
            return self._dotted_ok(node)
        if isinstance(node, ast.Call):
            return self.value(node)
        return False

    def decorator(self, node) -> bool:
        from .screen import _dotted

        parts = _dotted(node.func if isinstance(node, ast.Call) else node)
        if parts and len(parts) == 2 and parts[1] in ("setter", "getter", "deleter"):
            return True   # @x.setter of a property defined in the same class body
        return self._dotted_ok(node) if not isinstance(node, ast.Call) else self.value(node)

    def arguments(self, args: ast.arguments) -> bool:
        return all(self.value(d) for d in args.defaults + [d for d in args.kw_defaults if d is not None])


def _names_only(target) -> bool:
    if isinstance(target, (ast.Tuple, ast.List)):
        return all(_names_only(t) for t in target.elts)
    return isinstance(target, ast.Name)


def _strip_annotations(node) -> None:
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
            sub.returns = None
            for a in sub.args.posonlyargs + sub.args.args + sub.args.kwonlyargs + \
                    [x for x in (sub.args.vararg, sub.args.kwarg) if x is not None]:
                a.annotation = None


def _function_ok(node, rules: _Rules) -> str | None:
    if not all(rules.decorator(d) for d in node.decorator_list):
        return f"`{node.name}` has a decorator the judge does not run"
    if not rules.arguments(node.args):
        return f"`{node.name}` has a default value the judge does not evaluate"
    return None


def _class_ok(node, rules: _Rules) -> str | None:
    if node.keywords:
        return f"class `{node.name}` has keywords (a metaclass?)"
    if not all(rules.value(b, allow_calls=False) for b in node.bases):
        return f"class `{node.name}` has a base class the judge does not evaluate"
    if not all(rules.decorator(d) for d in node.decorator_list):
        return f"class `{node.name}` has a decorator the judge does not run"
    for stmt in node.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue
        if isinstance(stmt, ast.Pass):
            continue
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            problem = _function_ok(stmt, rules)
            if problem:
                return f"class `{node.name}`: {problem}"
            continue
        if isinstance(stmt, ast.ClassDef):
            problem = _class_ok(stmt, rules)
            if problem:
                return problem
            continue
        if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets) \
                and rules.value(stmt.value):
            continue
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                and rules.value(stmt.annotation, allow_calls=False) and rules.value(stmt.value):
            continue
        return f"class `{node.name}` has a statement in its body the judge does not run (line {stmt.lineno})"
    return None


#: Names a blocked module may still give (``from types import SimpleNamespace``): plain containers, no code objects.
ALLOWED_FROM = {"types": {"SimpleNamespace"}}


def _import_ok(node) -> str | None:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    if isinstance(node, ast.ImportFrom) and node.level:
        return "a relative import"
    if isinstance(node, ast.ImportFrom) and {a.name for a in node.names} <= ALLOWED_FROM.get(node.module or "", set()):
        return None
    for name in names:
        parts = name.split(".")
        if parts[0] in BLOCKED_IMPORTS or any(p.startswith("_") for p in parts):
            return f"`{ast.unparse(node)}` on line {node.lineno} (the grader does not import {parts[0]})"
    if isinstance(node, ast.ImportFrom) and any(a.name.startswith("_") or a.name == "*" for a in node.names):
        return f"import of private names from {node.module}"
    return None


def definitions(source: str, modules: dict[str, str]) -> tuple[str, list[str]]:
    """The statements of one cell the judge runs (as source) and a description of each one it skips.

    ``modules`` (name -> module) collects the imports seen so far and is updated with this cell's.
    """
    from .screen import _imports, python_source

    try:
        tree = ast.parse(python_source(source))
    except (SyntaxError, ValueError) as exc:
        return "", [f"does not parse ({type(exc).__name__}: {exc})"]
    rules = _Rules(modules)
    kept, skipped = [], []
    for stmt in tree.body:
        problem = None
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            problem = _import_ok(stmt)
            if problem is None:
                modules.update(_imports(ast.Module(body=[stmt], type_ignores=[])))
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            problem = _function_ok(stmt, rules)
        elif isinstance(stmt, ast.ClassDef):
            problem = _class_ok(stmt, rules)
        elif isinstance(stmt, ast.Assign):
            if not all(_names_only(t) for t in stmt.targets) or not rules.value(stmt.value):
                problem = f"assignment on line {stmt.lineno} (only names bound to simple values are run)"
        elif isinstance(stmt, ast.AnnAssign):
            if not isinstance(stmt.target, ast.Name) or not rules.value(stmt.value):
                problem = f"assignment on line {stmt.lineno} (only names bound to simple values are run)"
            else:
                stmt = ast.Assign(targets=[stmt.target], value=stmt.value or ast.Constant(None), lineno=stmt.lineno)
        elif isinstance(stmt, (ast.Pass,)) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
            continue
        else:
            skipped.append(f"top-level {type(stmt).__name__.lower()} on line {stmt.lineno} (not a definition)")
            continue
        if problem:
            skipped.append(problem)
        else:
            kept.append(stmt)
    module = ast.Module(body=kept, type_ignores=[])
    for stmt in kept:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            _strip_annotations(stmt)
    return ast.unparse(ast.fix_missing_locations(module)), skipped
