"""The walk over one cell's syntax tree: ``screen_source`` parses a cell (IPython magics made plain Python by
``python_source``), learns what it imports (``_imports``), which names stand for a module or a constant string
(``_Bindings``, in ``bindings.py``) and which underscore attributes it defines (``_own_private``), and ``_Screen``
visits every node, collecting the reasons to flag it with the lines where each was found.

What syntax hides is screened like the syntax itself: ``getattr``/``setattr``/``hasattr``/``delattr``,
``object.__getattribute__``, ``vars(x)[...]``, ``x.__dict__[...]`` and ``operator.attrgetter`` with a constant
name (or one folded from constants: ``"tb_" + "frame"``, an f-string of constants, a name bound to constants; see
``folding.py``) are screened as the attribute they spell, and a name bound to a module (``c10d =
dist.distributed_c10d``, or a parameter's default) as that module.
"""

from __future__ import annotations

import ast

from .bindings import _Bindings
from .rules import (COMPUTED_NAMES_ALLOWED, FILE_CALLS, FLAGGED_ATTRIBUTES, FLAGGED_KEYWORDS, FLAGGED_NAMES,
                    REBINDABLE, SHARED_MEMORY_ATTRIBUTES, _private, allowed_private_path, path_reason,
                    private_internals, shared_memory_reason, string_reason, torch_internals)
from .syntax import _dotted, _imports, _own_private, _shown, python_source

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
        self.membership: set[int] = set()      # sys.modules on the right of `in`: whether a module is imported

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
    def visit_Compare(self, node):
        # `"torch" in sys.modules` asks whether a module is imported and reaches none: the one use that is no flag
        if all(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            for right in node.comparators:
                if self._module_path(_dotted(right)) == "sys.modules":
                    self.membership.add(id(right))
        self.generic_visit(node)

    def visit_Name(self, node):
        if id(node) in self.membership:
            return
        self.add(FLAGGED_NAMES.get(node.id), node)
        if node.id in _BY_NAME and id(node) not in self.called and node.id not in self.modules:
            self.add(f"passes {node.id} around as a value (the names it reaches are not seen)", node)
        path = self.modules.get(node.id)
        if path:
            self._check_module(path, node)
        elif node.id in self.bindings.aliases and isinstance(node.ctx, ast.Load):
            self._check_path(self.bindings.aliases[node.id], node)

    def visit_Attribute(self, node):
        if id(node) not in self.membership:
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
            if path and path not in REBINDABLE:
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
        for keyword in node.keywords:
            if keyword.arg in FLAGGED_KEYWORDS and not (isinstance(keyword.value, ast.Constant)
                                                        and not keyword.value.value):
                self.add(FLAGGED_KEYWORDS[keyword.arg], node)
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
        if path == "inspect.getattr_static" and len(args) >= 2:
            self._by_name(args[0], args[1], node)              # inspect.getattr_static(x, "name")
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
