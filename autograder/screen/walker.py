"""The walk over one cell's syntax tree: ``screen_source`` parses a cell (IPython magics made plain Python by
``python_source``), learns what it imports (``_imports``), which names stand for a module or a constant string
(``_Bindings``) and which underscore attributes it defines (``_own_private``), and ``_Screen`` visits every node,
collecting the reasons to flag it with the lines where each was found.

What syntax hides is screened like the syntax itself: ``getattr``/``setattr``/``hasattr``/``delattr``,
``object.__getattribute__``, ``vars(x)[...]``, ``x.__dict__[...]`` and ``operator.attrgetter`` with a constant
name (or one folded from constants: ``"tb_" + "frame"``, an f-string of constants, a name bound to constants) are
screened as the attribute they spell, and a name bound to a module (``c10d = dist.distributed_c10d``, or a
parameter's default) as that module.
"""

from __future__ import annotations

import ast
import itertools

from .rules import (COMPUTED_NAMES_ALLOWED, FILE_CALLS, FLAGGED_ATTRIBUTES, FLAGGED_NAMES, SHARED_MEMORY_ATTRIBUTES,
                    _local_path, _private, allowed_private_path, path_reason, private_internals,
                    shared_memory_reason, string_reason, torch_internals)

_MAX_VALUES = 64  # a folded expression with more possible values is left unknown
_MAX_LENGTH = 4096  # and one that spells a longer string


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


class _Bindings:
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

    def fold(self, node) -> set[str] | None:
        """Every string ``node`` may evaluate to, folded from constants; None when it is not known."""
        values = self._fold(node)
        return values if values and len(values) <= _MAX_VALUES else None

    def _fold(self, node):
        try:
            values = self._fold_node(node)
            return values if values is None or all(len(v) <= _MAX_LENGTH for v in values) else None
        except (ArithmeticError, AttributeError, IndexError, KeyError, TypeError, ValueError, MemoryError):
            return None  # "{0.x}".format("a"), "abc"[::0]: not a string the cell could spell

    def _fold_node(self, node):
        if isinstance(node, ast.Constant):
            return {node.value} if isinstance(node.value, str) else None
        if isinstance(node, ast.Name):
            return set(self.strings[node.id]) if node.id in self.strings else None
        if isinstance(node, ast.IfExp):
            body, orelse = self._fold(node.body), self._fold(node.orelse)
            return body | orelse if body is not None and orelse is not None else None
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Add):
                return self._product([node.left, node.right], "".join)
            if isinstance(node.op, ast.Mult):
                text, times = (node.left, node.right) if isinstance(node.right, ast.Constant) else (node.right,
                                                                                                    node.left)
                values = self._fold(text)
                if values is not None and isinstance(times, ast.Constant) and isinstance(times.value, int) \
                        and 0 <= times.value <= 8:
                    return {v * times.value for v in values}
            if isinstance(node.op, ast.Mod):
                return self._percent(node)
            return None
        if isinstance(node, ast.JoinedStr):
            folded = []
            for v in node.values:
                if isinstance(v, ast.FormattedValue):
                    if v.format_spec is not None or v.conversion not in (-1, ord("s"), ord("r"), ord("a")):
                        return None
                    values = self._fold(v.value)
                    if values is None:
                        return None
                    folded.append(values if v.conversion in (-1, ord("s")) else {repr(x) for x in values})
                else:
                    folded.append(self._fold(v))
            if any(f is None for f in folded):
                return None
            return {"".join(combo) for combo in self._combos(folded)} or None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice):
            values = self._fold(node.value)
            bounds = [self._int(b) for b in (node.slice.lower, node.slice.upper, node.slice.step)]
            if values is None or any(b is False for b in bounds):
                return None
            return {v[slice(*bounds)] for v in values}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.keywords:
            method, base = node.func.attr, node.func.value
            if method == "join" and len(node.args) == 1:
                items = self._items(node.args[0])
                seps = self._fold(base)
                if items is None or seps is None:
                    return None
                return {sep.join(combo) for sep in seps for combo in self._combos(items)}
            if method == "format":
                templates = self._fold(base)
                args = [self._fold(a) for a in node.args]
                if templates is None or any(a is None for a in args):
                    return None
                return {t.format(*combo) for t in templates for combo in self._combos(args)}
            if method in ("lower", "upper", "strip", "lstrip", "rstrip", "title", "casefold") and not node.args:
                values = self._fold(base)
                return {getattr(v, method)() for v in values} if values is not None else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str" \
                and len(node.args) == 1:
            return self._fold(node.args[0])
        return None

    @staticmethod
    def _int(node):
        if node is None:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
                and isinstance(node.operand.value, int):
            return -node.operand.value
        return False

    def _items(self, node) -> list[set[str]] | None:
        """The possible strings of each element of a literal tuple, list or set (``reversed``/``list`` of one)."""
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = [self._fold(e) for e in node.elts]
            return None if any(i is None for i in items) else items
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("reversed", "list",
                                                                                                "tuple", "sorted") \
                and len(node.args) == 1:
            inner = self._items(node.args[0])
            if inner is None:
                values = self._fold(node.args[0])  # reversed("emarf_bt"): the characters
                if values is None:
                    return None
                inner = [{c} for c in next(iter(values))] if len(values) == 1 else None
            if inner is not None and node.func.id == "reversed":
                inner = inner[::-1]
            return inner if node.func.id != "sorted" else None
        return None  # a name bound to a sequence gives its members to a loop (``members``), not an order

    def _combos(self, items):
        count = 1
        for i in items:
            count *= len(i)
            if count > _MAX_VALUES:
                return []
        return itertools.product(*items)

    def _product(self, parts, join):
        folded = [self._fold(p) for p in parts]
        if any(f is None for f in folded):
            return None
        return {join(combo) for combo in self._combos(folded)} or None

    def _percent(self, node):
        templates = self._fold(node.left)
        right = node.right
        args = [self._fold(e) for e in right.elts] if isinstance(right, ast.Tuple) else [self._fold(right)]
        if templates is None or any(a is None for a in args):
            return None
        return {t % tuple(combo) for t in templates for combo in self._combos(args)}

    def members(self, node) -> set[str] | None:
        """The strings a loop over ``node`` may give (a literal of constants, or a name bound to one)."""
        items = self._items(node)
        if items is not None:
            return set().union(*items) if items else set()
        if isinstance(node, ast.Name) and node.id in self.sequences:
            return set(self.sequences[node.id])
        return None

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


#: Builtins that reach an attribute by name: (its argument holding the object, the one holding the name).
_BY_NAME = {"getattr": (0, 1), "hasattr": (0, 1), "setattr": (0, 1), "delattr": (0, 1)}
#: Dunder methods that do the same when called on a type (``object.__getattribute__(x, "n")``) or on the object.
_DUNDER_BY_NAME = {"__getattribute__", "__getattr__", "__setattr__", "__delattr__"}
#: Mapping methods on ``vars(x)`` or ``x.__dict__`` whose first argument is an attribute's name.
_MAPPING_BY_NAME = {"get", "pop", "setdefault", "__getitem__", "__setitem__", "__delitem__", "__contains__"}


#: File calls whose second argument is a path too (where the file goes).
_TWO_PATHS = {"rename", "replace", "symlink", "link", "copy", "copyfile", "copytree", "move"}


class _Screen(ast.NodeVisitor):
    def __init__(self, modules: dict[str, str], own_private: set[str], bindings: _Bindings):
        self.modules = modules          # local name -> dotted module (or module.attribute) it was imported as
        self.own_private = own_private  # underscore attributes this cell (or another of the student's) defines
        self.bindings = bindings        # constant strings and module aliases the cell's names stand for
        self.found: dict[str, list[int]] = {}
        self.private_copies: set[int] = set()  # from_file attributes of calls that map a file privately
        self.called: set[int] = set()          # names called directly (getattr(x, "n"), not map(getattr, ...))

    @property
    def reasons(self) -> list[str]:
        """Each reason with the line(s) of the cell where it was found."""
        out = []
        for reason, lines in self.found.items():
            lines = sorted(set(lines))
            if not lines:
                out.append(reason)
            elif len(lines) == 1:
                out.append(f"{reason} on line {lines[0]}")
            else:
                out.append(f"{reason} on lines {', '.join(map(str, lines[:-1]))} and {lines[-1]}")
        return out

    def add(self, reason: str | None, node=None) -> None:
        if not reason:
            return
        lines = self.found.setdefault(reason, [])
        line = getattr(node, "lineno", None)
        if line is not None:
            lines.append(line)

    def _module_path(self, parts: list[str] | None) -> str | None:
        """The dotted path ``parts`` stands for when its root is an imported name (or a name bound to a module)."""
        if not parts:
            return None
        root = self.modules.get(parts[0]) or self.bindings.aliases.get(parts[0])
        return ".".join([root] + parts[1:]) if root else None

    def _check_path(self, dotted: str, node) -> None:
        self.add(path_reason(dotted), node)

    def _check_module(self, dotted: str, node) -> None:
        self._check_path(dotted, node)
        if any(_private(p) for p in dotted.split(".")) and not allowed_private_path(dotted):
            self.add(f"imports a private module or name ({dotted})", node)

    # imports ------------------------------------------------------------------------------------------------
    def visit_Import(self, node):
        for alias in node.names:
            self._check_module(alias.name, node)
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        base = "." * node.level + (node.module or "")
        if node.level:
            self.add(f"relative import ({base})", node)
        self._check_module(node.module or "", node)
        for alias in node.names:
            if alias.name == "*":
                continue
            self._check_module(f"{node.module}.{alias.name}" if node.module else alias.name, node)
        self.generic_visit(node)

    # names and attributes -----------------------------------------------------------------------------------
    def visit_Name(self, node):
        self.add(FLAGGED_NAMES.get(node.id), node)
        if node.id in _BY_NAME and id(node) not in self.called and node.id not in self.modules:
            self.add(f"passes {node.id} around as a value (the names it reaches are not seen)", node)
        path = self.modules.get(node.id)
        if path:
            self._check_module(path, node)
        elif node.id in self.bindings.aliases and isinstance(node.ctx, ast.Load):
            self._check_path(self.bindings.aliases[node.id], node)

    def visit_Attribute(self, node):
        self._attribute(node.value, node.attr, node)
        self.generic_visit(node)

    def _attribute(self, base, attr: str, node, spelled: str | None = None) -> None:
        """Screen ``base.attr``, written as such or spelled by a constant name (``spelled``: how, for the flag)."""
        parts = _dotted(base) if base is not None else None
        parts = parts + [attr] if parts else None
        path = self._module_path(parts)
        shown = ".".join(parts) if parts else f"{_shown(base, 30)}.{attr}" if base is not None else attr

        def add(reason):
            if reason and spelled:
                reason = f"{reason}, written as {spelled}"
            self.add(reason, node)

        if attr == "from_file" and id(node) in self.private_copies:
            return  # a private copy of a file under the folder it was given: reading a file, not sharing memory
        if attr in FLAGGED_ATTRIBUTES and attr != "modules":
            add(FLAGGED_ATTRIBUTES[attr])
        if attr in SHARED_MEMORY_ATTRIBUTES:
            add(shared_memory_reason(attr, shown))
        if attr == "modules" and path == "sys.modules":
            add("uses sys.modules")
        if _private(attr) and attr not in SHARED_MEMORY_ATTRIBUTES and (path or self._internal(base, attr)) \
                and not (path and allowed_private_path(path)):
            add(f"uses a private name ({shown})")
        if path:
            add(path_reason(path))

    def _internal(self, base, attr: str) -> bool:
        """A private name of the communication stack or of labsupport, unless it is an attribute the student's
        code defines itself, read from ``self``/``cls`` (or, for a name only labsupport uses, from any object).
        Binding the name as a parameter, a local or a function defines no attribute and hides nothing."""
        if attr not in private_internals() or attr not in self.own_private:
            return attr in private_internals()
        on_self = isinstance(base, ast.Name) and base.id in ("self", "cls")
        return not on_self and attr in torch_internals()

    def visit_Subscript(self, node):
        # vars(x)["name"], x.__dict__["name"]: the attribute they spell
        base = self._namespace_of(node.value)
        if base is not None:
            self._by_name(base, node.slice, node)
        self.generic_visit(node)

    def _namespace_of(self, node):
        """``x`` when ``node`` is ``vars(x)`` or ``x.__dict__`` (an object's attributes as a mapping), else None."""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" \
                and len(node.args) == 1:
            return node.args[0]
        if isinstance(node, ast.Attribute) and node.attr == "__dict__":
            return node.value
        return None

    def _by_name(self, base, name_node, node) -> None:
        names = self.bindings.fold(name_node)
        spelled = _shown(node)
        module = self.bindings.module_of(base)
        if module and module not in COMPUTED_NAMES_ALLOWED and not isinstance(name_node, ast.Constant):
            self.add(f"looks up a module attribute by a computed name ({spelled})", node)
        if isinstance(name_node, ast.Name) and name_node.id in self.bindings.listed:
            self.add(f"reaches attributes by the names dir() or __dict__ lists ({spelled})", node)
        if names is None:
            return
        for name in sorted(names):
            if name and "." not in name:
                self._attribute(base, name, node, spelled)

    def visit_Constant(self, node):
        if isinstance(node.value, str):
            for reason in string_reason(node.value):
                self.add(reason, node)

    def _folded_string(self, node) -> None:
        values = self.bindings.fold(node)
        for value in sorted(values or ()):
            for reason in string_reason(value):
                self.add(reason, node)

    def visit_BinOp(self, node):
        self._folded_string(node)
        self.generic_visit(node)

    def visit_JoinedStr(self, node):
        self._folded_string(node)
        self.generic_visit(node)

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
                module = path.rsplit('.', 1)[0] if isinstance(target, ast.Attribute) else path
                self.add(f"rebinds an attribute of module {module}", target)

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
        self.called.add(id(node.func))
        if isinstance(node.func, ast.Attribute) and node.func.attr == "from_file" and node.args \
                and self.bindings.is_rooted(node.args[0]):
            shared = [k.value for k in node.keywords if k.arg == "shared"]
            if len(node.args) < 2 and all(isinstance(v, ast.Constant) and not v.value for v in shared):
                self.private_copies.add(id(node.func))
        self._folded_string(node)
        self._attribute_calls(node)
        parts = _dotted(node.func)
        if parts:
            if len(parts) == 1:
                module, name = None, parts[0]
                if name in self.modules:  # from os import open
                    full = self.modules[name].rsplit(".", 1)
                    module, name = (full[0], full[1]) if len(full) == 2 else (None, full[0])
            else:
                path = self._module_path(parts[:-1])
                module, name = (path, parts[-1]) if path else ("?", parts[-1])
            if name in ("setattr", "delattr") and module is None and node.args:
                target = self.bindings.module_of(node.args[0])
                if target:
                    self.add(f"calls {name} on module {target}", node)
                elif not _dotted(node.args[0]) and isinstance(node.args[0], ast.Call):
                    self.add(f"calls {name} on an object it looks up", node)
            if (module, name) in FILE_CALLS or (module is None and name == "open"):
                self._file_call(node, f"{module + '.' if module else ''}{name}")
        self.generic_visit(node)

    def _attribute_calls(self, node) -> None:
        """Calls that reach an attribute by its name: screened as the attribute they spell."""
        func, args = node.func, node.args
        if isinstance(func, ast.Name) and func.id in _BY_NAME and len(args) >= 2:
            obj, name = _BY_NAME[func.id]
            self._by_name(args[obj], args[name], node)
        elif isinstance(func, ast.Attribute) and func.attr in _DUNDER_BY_NAME:
            if isinstance(func.value, ast.Name) and func.value.id in ("object", "type") and len(args) >= 2:
                self._by_name(args[0], args[1], node)          # object.__getattribute__(x, "name")
            elif isinstance(func.value, ast.Call) and len(args) >= 2:
                self._by_name(args[0], args[1], node)          # super().__getattribute__ ... on an explicit object
            elif args:
                self._by_name(func.value, args[0], node)       # x.__getattribute__("name")
        elif isinstance(func, ast.Attribute) and func.attr in _MAPPING_BY_NAME and args:
            base = self._namespace_of(func.value)
            if base is not None:
                self._by_name(base, args[0], node)             # vars(x).get("name"), x.__dict__.pop("name")
        path = self.bindings.module_of(func) or ""
        if path in ("operator.attrgetter", "operator.methodcaller"):
            for arg in args[:1] if path.endswith("methodcaller") else args:
                for text in sorted(self.bindings.fold(arg) or ()):
                    for attr in text.split("."):
                        if attr:
                            self._attribute(None, attr, node, _shown(node))

    def _file_call(self, node, what: str) -> None:
        name = what.rsplit(".", 1)[-1]
        position, keyword = (1, "f") if what == "torch.save" else (0, "f" if what == "torch.load" else "file")
        paths = list(node.args[position:position + (2 if name in _TWO_PATHS else 1)])
        paths += [k.value for k in node.keywords if k.arg in (keyword, "path", "src", "dst")]
        if not paths:
            if what.endswith("Path"):
                return  # Path() is the working directory
            self.add(f"opens or changes files ({what} with no plain path)", node)
            return
        if any(not self.bindings.is_rooted(p) for p in paths):
            self.add(f"opens or changes files outside the notebook's folder ({what})", node)


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


def screen_source(source: str, known_modules: dict[str, str] | None = None,
                  own_private: set[str] | None = None) -> list[str]:
    """Reasons to flag one cell's code (empty for honest code), each with the line(s) it was found on; a cell that
    does not parse gets none."""
    deep = "nests its code too deeply for the screen to read ({})"
    try:
        tree = ast.parse(python_source(source))
    except (SyntaxError, ValueError):
        return []
    except (RecursionError, MemoryError) as error:
        return [deep.format(type(error).__name__)]
    try:
        modules = dict(known_modules or {})
        modules.update(_imports(tree))
        screen = _Screen(modules, set(own_private or ()) | _own_private(tree), _Bindings(tree, modules))
        screen.visit(tree)
        return screen.reasons
    except (RecursionError, MemoryError) as error:  # nested past what a walk can follow: itself worth a look
        return [deep.format(type(error).__name__)]
