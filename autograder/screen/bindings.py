"""What the names of a cell stand for, whatever their scope: constant strings (folded by ``_Folding``), the module
(or module attribute) a name is bound to, the names a loop takes from ``dir(x)`` or ``x.__dict__``, and the names
that hold a path under a folder one of the cell's functions is handed (``is_rooted``).
"""

from __future__ import annotations

import ast

from .folding import _MAX_VALUES, _Folding
from .rules import _local_path
from .syntax import _dotted


class _Bindings(_Folding):
    """What the cell's names stand for, whatever their scope: the constant strings a name may hold
    (``name = "tb_" + "frame"``, ``for name in ("a", "b")``), the constant strings a name's tuple or list holds,
    and the module (or module attribute) a name is bound to (``c = dist.distributed_c10d``,
    ``def f(x, c=dist.distributed_c10d)``)."""

    def __init__(self, tree, modules: dict[str, str]):
        self.strings: dict[str, set[str]] = {}
        self.sequences: dict[str, set[str]] = {}
        self.modules = modules
        self.aliases: dict[str, str] = {}
        self.listed: set[str] = set()  # names a loop takes from dir(x) or x.__dict__: any attribute at all
        for _ in range(3):  # chains: a = "tb_"; b = a + "frame"
            self._collect(tree)
        self.rooted = self._rooted_names(tree)

    # what the names are bound to --------------------------------------------------------------------------------
    def _bind(self, target, value) -> None:
        if isinstance(target, ast.Name):
            values = self._fold(value)
            if values:
                self.strings.setdefault(target.id, set()).update(values)
            items = self._items(value)
            if items:
                self.sequences.setdefault(target.id, set()).update(set().union(*items))
            path = self.module_of(value)
            if path:
                self.aliases[target.id] = path
        elif isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
                and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self._bind(t, v)

    def _bind_each(self, target, iterable) -> None:
        if any(self._lists_attributes(n) for n in ast.walk(iterable)):
            self.listed.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        if isinstance(target, ast.Name):
            found = self.members(iterable)
            if found:
                self.strings.setdefault(target.id, set()).update(found)

    def _lists_attributes(self, node) -> bool:
        """``dir(x)``, ``x.__dict__``, ``x.__dir__``, ``getattr(x, "__dict__")``: every attribute's name."""
        if isinstance(node, ast.Attribute):
            return node.attr in ("__dict__", "__dir__")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "dir":
                return True
            if node.func.id == "getattr" and len(node.args) >= 2:
                return bool({"__dict__", "__dir__"} & (self.fold(node.args[1]) or set()))
        return False

    def module_of(self, node) -> str | None:
        """The module path ``node`` stands for: a dotted name rooted at an import or an alias, or
        ``getattr(module, "constant")``."""
        parts = _dotted(node)
        if parts:
            root = self.modules.get(parts[0]) or self.aliases.get(parts[0])
            return ".".join([root] + parts[1:]) if root else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) >= 2:
            base = self.module_of(node.args[0])
            names = self.fold(node.args[1])
            if base and names and len(names) == 1:
                return f"{base}.{next(iter(names))}"
        return None

    def _collect(self, tree) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    self._bind(t, node.value)
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                self._bind(node.target, node.value)
            elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) \
                    and isinstance(node.target, ast.Name) and node.target.id in self.strings:
                extra = self._fold(node.value)
                if extra:
                    base = self.strings[node.target.id]
                    if len(base) * len(extra) <= _MAX_VALUES:
                        base.update(a + b for a in list(base) for b in extra)
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                self._bind_each(node.target, node.iter)
            elif isinstance(node, ast.arguments):
                positional = node.posonlyargs + node.args
                for arg, default in zip(positional[len(positional) - len(node.defaults):], node.defaults):
                    self._bind(ast.Name(id=arg.arg, ctx=ast.Store()), default)
                for arg, default in zip(node.kwonlyargs, node.kw_defaults):
                    if default is not None:
                        self._bind(ast.Name(id=arg.arg, ctx=ast.Store()), default)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if item.optional_vars is not None:
                        self._bind(item.optional_vars, item.context_expr)

    # paths under a folder the caller hands over ------------------------------------------------------------------
    def _rooted_names(self, tree) -> set[str]:
        """Names (and ``self.x`` attributes) that always hold a path under a parameter of the cell's functions
        (``directory``, ``os.path.join(directory, "meta.json")``): the folder the check hands to the answer."""
        assigned: dict[str, list] = {}
        params: set[str] = set()

        def key(target):
            if isinstance(target, ast.Name):
                return target.id
            parts = _dotted(target)
            return ".".join(parts) if parts and len(parts) == 2 and parts[0] == "self" else None

        for node in ast.walk(tree):
            if isinstance(node, ast.arguments):
                positional = node.posonlyargs + node.args
                defaults = [None] * (len(positional) - len(node.defaults)) + list(node.defaults)
                for arg, default in list(zip(positional, defaults)) + list(zip(node.kwonlyargs, node.kw_defaults)):
                    if default is None or (isinstance(default, ast.Constant) and default.value is None) \
                            or _local_path(default):
                        params.add(arg.arg)
                    else:
                        assigned.setdefault(arg.arg, []).append(default)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                value = node.value
                if isinstance(node, ast.AugAssign):
                    value = ast.BinOp(left=node.target, op=node.op, right=node.value)
                for t in targets:
                    k = key(t)
                    if k:
                        assigned.setdefault(k, []).append(value)
                    elif isinstance(t, (ast.Tuple, ast.List)):
                        for e in t.elts:  # unpacked: not known to be a path
                            if key(e):
                                assigned.setdefault(key(e), []).append(None)
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension, ast.With, ast.AsyncWith)):
                targets = [node.target] if not isinstance(node, (ast.With, ast.AsyncWith)) else \
                    [i.optional_vars for i in node.items if i.optional_vars is not None]
                for t in targets:
                    for sub in ast.walk(t):
                        if key(sub):
                            assigned.setdefault(key(sub), []).append(None)
        rooted = {p for p in params if p not in assigned}
        self.rooted = rooted
        changed = True
        while changed:  # a = os.path.join(directory, "x"); b = a + ".tmp"
            changed = False
            for name, values in assigned.items():
                if name not in rooted and all(v is not None and self.is_rooted(v) for v in values):
                    rooted.add(name)
                    changed = True
        return rooted

    def _component(self, node) -> bool:
        """A path component that stays below what it is joined to: no absolute start, no ``..``."""
        if isinstance(node, ast.JoinedStr):
            constants = [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
            first = node.values[0] if node.values else None
            if isinstance(first, ast.Constant) and str(first.value).startswith(("/", "~")):
                return False
            return not any(".." in c for c in constants)
        values = self.fold(node)
        if values is None:
            return not isinstance(node, ast.Constant)
        return all(not v.startswith(("/", "~")) and ".." not in v.replace("\\", "/").split("/") for v in values)

    def is_rooted(self, node) -> bool:
        """Whether ``node`` is a path under a folder a parameter names (or a plain relative one)."""
        if _local_path(node):
            return True
        if isinstance(node, ast.Name):
            return node.id in self.rooted
        if isinstance(node, ast.Attribute):
            parts = _dotted(node)
            return bool(parts) and ".".join(parts) in self.rooted
        if isinstance(node, ast.IfExp):
            return self.is_rooted(node.body) and self.is_rooted(node.orelse)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Div)):
            return self.is_rooted(node.left) and self._component(node.right)
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.FormattedValue):
            rest = ast.JoinedStr(values=node.values[1:])
            return self.is_rooted(node.values[0].value) and self._component(rest)
        if isinstance(node, ast.Call) and node.args:
            func = _dotted(node.func) or []
            path = self.module_of(node.func) or ".".join(func)
            name = func[-1] if func else (node.func.attr if isinstance(node.func, ast.Attribute) else "")
            if path in ("os.path.join", "posixpath.join") or name == "joinpath":
                base = node.args[0] if path.endswith("path.join") else node.func.value
                rest = node.args[1:] if path.endswith("path.join") else node.args
                return self.is_rooted(base) and all(self._component(a) for a in rest)
            if path in ("os.path.realpath", "os.path.abspath", "os.path.normpath", "os.path.basename",
                        "os.fspath", "pathlib.Path", "Path", "str") or name in ("resolve", "absolute"):
                return len(node.args) == 1 and self.is_rooted(node.args[0])
        if isinstance(node, ast.Call) and not node.args and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("resolve", "absolute"):
            return self.is_rooted(node.func.value)
        return False
