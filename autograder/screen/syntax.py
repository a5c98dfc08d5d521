"""Reading a cell's syntax tree: the cell as plain Python (``python_source``: IPython magics and shell escapes
become ``get_ipython()`` calls), a dotted name as its parts (``_dotted``), what the cell imports (``_imports``) and
which underscore attributes it defines itself (``_own_private``).

The judge (``judging.py``) and what it runs of a cell (``definitions.py``) read cells with the same helpers.
"""

from __future__ import annotations

import ast

from .rules import _private


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


def _shown(node, limit: int = 60) -> str:
    try:
        text = ast.unparse(node)
    except Exception:
        return "..."
    return text if len(text) <= limit else text[:limit - 3] + "..."



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
    """Underscore attributes the code defines itself: assigned as an attribute (``self._cache = {}``, also by
    ``setattr(self, "_cache", ...)``), or methods and class attributes of its own classes. A parameter, a local or
    a function of that name defines no attribute."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    own.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    own.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            own.add(node.args[1].value)
    return {n for n in own if _private(n)}
