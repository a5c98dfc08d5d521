"""The walk over one cell's syntax tree: ``screen_source`` parses a cell (IPython magics made plain Python by
``python_source``), learns what it imports (``_imports``) and which underscore names it defines (``_own_private``),
and ``_Screen`` visits every node, collecting the reasons to flag it.
"""

from __future__ import annotations

import ast

from .rules import (FILE_CALLS, FLAGGED_ATTRIBUTES, FLAGGED_CALLS, FLAGGED_MODULES, FLAGGED_NAMES, _local_path,
                    _private, private_internals)


def python_source(source: str) -> str:
    """IPython cell source as plain Python (magics and shell escapes become ``get_ipython()`` calls)."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        return TransformerManager().transform_cell(source)
    except Exception:
        return source


def _dotted(node) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``, None if the chain does not start at a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return None


class _Screen(ast.NodeVisitor):
    def __init__(self, modules: dict[str, str], own_private: set[str]):
        self.modules = modules          # local name -> dotted module (or module.attribute) it was imported as
        self.own_private = own_private  # underscore names this cell defines itself
        self.reasons: list[str] = []

    def add(self, reason: str | None) -> None:
        if reason and reason not in self.reasons:
            self.reasons.append(reason)

    def _module_path(self, parts: list[str]) -> str | None:
        """The dotted path ``parts`` stands for when its root is an imported name, else None."""
        if parts and parts[0] in self.modules:
            return ".".join([self.modules[parts[0]]] + parts[1:])
        return None

    def _check_module(self, dotted: str) -> None:
        top = dotted.split(".")[0]
        if top in FLAGGED_MODULES:
            self.add(FLAGGED_MODULES[top])
        if any(_private(p) for p in dotted.split(".")):
            self.add(f"imports a private module or name ({dotted})")

    # imports ------------------------------------------------------------------------------------------------
    def visit_Import(self, node):
        for alias in node.names:
            self._check_module(alias.name)
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        base = "." * node.level + (node.module or "")
        if node.level:
            self.add(f"relative import ({base})")
        self._check_module(node.module or "")
        for alias in node.names:
            if alias.name == "*":
                continue
            self._check_module(f"{node.module}.{alias.name}" if node.module else alias.name)
        self.generic_visit(node)

    # names and attributes -----------------------------------------------------------------------------------
    def visit_Name(self, node):
        self.add(FLAGGED_NAMES.get(node.id))
        path = self.modules.get(node.id)
        if path:
            self._check_module(path)

    def visit_Attribute(self, node):
        attr = node.attr
        if attr in FLAGGED_ATTRIBUTES and attr != "modules":
            self.add(FLAGGED_ATTRIBUTES[attr])
        parts = _dotted(node)
        path = self._module_path(parts) if parts else None
        if attr == "modules" and path == "sys.modules":
            self.add("uses sys.modules")
        if _private(attr) and attr not in self.own_private and (path or attr in private_internals()):
            self.add(f"uses a private name ({'.'.join(parts) if parts else '...' + '.' + attr})")
        if path and path.split(".")[0] in FLAGGED_MODULES:
            self._check_module(path)
        self.generic_visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, str) and "autograder" in node.value:
            self.add("names the grader (autograder) in a string")

    # rebinding module attributes ----------------------------------------------------------------------------
    def _target(self, target) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self._target(t)
        elif isinstance(target, ast.Starred):
            self._target(target.value)
        elif isinstance(target, (ast.Attribute, ast.Subscript)):
            parts = _dotted(target.value if isinstance(target, ast.Subscript) else target)
            path = self._module_path(parts) if parts else None
            if path:
                self.add(f"rebinds an attribute of module {path.rsplit('.', 1)[0] if isinstance(target, ast.Attribute) else path}")

    def visit_Assign(self, node):
        for t in node.targets:
            self._target(t)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._target(node.target)
        self.generic_visit(node)

    def visit_AnnAssign(self, node):
        self._target(node.target)
        self.generic_visit(node)

    def visit_Delete(self, node):
        for t in node.targets:
            self._target(t)
        self.generic_visit(node)

    # calls ----------------------------------------------------------------------------------------------------
    def visit_Call(self, node):
        parts = _dotted(node.func)
        if parts:
            if len(parts) == 1:
                module, name = None, parts[0]
                if name in self.modules:  # from os import system
                    full = self.modules[name].rsplit(".", 1)
                    module, name = (full[0], full[1]) if len(full) == 2 else (None, full[0])
            else:
                path = self._module_path(parts[:-1])
                module, name = (path, parts[-1]) if path else ("?", parts[-1])
            if name in ("setattr", "delattr") and module is None and node.args:
                first = _dotted(node.args[0])
                if first and self._module_path(first):
                    self.add(f"calls {name} on module {self._module_path(first)}")
                elif not first and isinstance(node.args[0], ast.Call):
                    self.add(f"calls {name} on an object it looks up")
            if name == "getattr" and module is None and len(node.args) >= 2:
                attr = node.args[1]
                first = _dotted(node.args[0])
                if isinstance(attr, ast.Constant) and isinstance(attr.value, str) and _private(attr.value) \
                        and attr.value not in self.own_private and (self._module_path(first or [])
                                                                    or attr.value in private_internals()):
                    self.add(f"uses a private name (getattr(..., {attr.value!r}))")
                elif not isinstance(attr, ast.Constant) and first and self._module_path(first):
                    self.add("looks up a module attribute by a computed name (getattr)")
            self.add(FLAGGED_CALLS.get((module, name)))
            if (module, name) in FILE_CALLS or (module is None and name == "open"):
                self._file_call(node, f"{module + '.' if module else ''}{name}")
            if module == "?" and name in ("write_text", "write_bytes", "unlink", "rmdir", "rename", "replace",
                                          "touch", "mkdir", "open", "read_text", "read_bytes"):
                self._path_method(node, name)
        self.generic_visit(node)

    def _file_call(self, node, what: str) -> None:
        if not node.args:
            if what.endswith("Path"):
                return  # Path() is the working directory
            self.add(f"opens or changes files ({what} with no plain path)")
            return
        if not _local_path(node.args[0]):
            self.add(f"opens or changes files outside the notebook's folder ({what})")

    def _path_method(self, node, name: str) -> None:
        base = node.func.value if isinstance(node.func, ast.Attribute) else None
        if isinstance(base, ast.Call) and _dotted(base.func) and _dotted(base.func)[-1] == "Path":
            return  # Path("x").write_text(...): judged by the Path(...) call itself
        # a method of some object: only worth a flag when the object is obviously a path built elsewhere
        return


def _imports(tree) -> dict[str, str]:
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    found[alias.asname] = alias.name
                else:
                    found[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if alias.name != "*":
                    found[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return found


def _own_private(tree) -> set[str]:
    """Underscore names the code defines itself (attributes it assigns, functions, classes, parameters)."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            own.add(node.arg)
    return {n for n in own if _private(n)}


def screen_source(source: str, known_modules: dict[str, str] | None = None,
                  own_private: set[str] | None = None) -> list[str]:
    """Reasons to flag one cell's code (empty for honest code); a cell that does not parse gets none."""
    try:
        tree = ast.parse(python_source(source))
    except (SyntaxError, ValueError):
        return []
    modules = dict(known_modules or {})
    modules.update(_imports(tree))
    screen = _Screen(modules, set(own_private or ()) | _own_private(tree))
    screen.visit(tree)
    return screen.reasons
