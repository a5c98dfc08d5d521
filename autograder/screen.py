"""A static screen of the code a student wrote, for what honest answers never need.

``screen_notebook(submission, release)`` parses (AST, never regex) every code cell the student could write (answer
cells, cells they added, unlocked cells they changed) and returns ``Flag(cell, reason)`` for each use of:

* the grader itself (``autograder``, in an import, a name or a string) or IPython's machinery (``get_ipython``,
  magics and shell escapes, which become ``get_ipython()`` calls);
* private names of other code (an underscore-prefixed attribute the cell did not define itself, or a module path
  with an underscore component: ``_get_backend``, ``torch._C``, ``torch.distributed._functional_collectives``);
* the interpreter's internals: ``sys.modules``, ``builtins``/``__builtins__``, ``__code__``, ``__globals__``,
  frames, ``exec``/``eval``/``compile``/``__import__``, ``importlib``, ``ctypes``, ``gc``, ``inspect``,
  ``globals()``/``vars()``;
* rebinding what a module holds: assigning, deleting or ``setattr``-ing an attribute of an imported module;
* processes and files: ``subprocess``, ``os.system``, ``os.kill``, signals, and any file opened, written or removed
  outside the notebook's folder (a path that is not a plain relative constant).

A flag asks a person to look; it never changes points by itself. Points come from the judge (``judge.py``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .execute import cell_label, nbgrader_meta

#: Modules whose import alone is a flag.
FLAGGED_MODULES = {
    "autograder": "imports the grader (autograder)",
    "builtins": "imports builtins",
    "importlib": "uses importlib",
    "ctypes": "uses ctypes",
    "gc": "uses gc (the garbage collector's view of every object)",
    "inspect": "uses inspect",
    "subprocess": "starts processes (subprocess)",
    "signal": "handles signals",
    "IPython": "uses IPython's machinery",
    "ipykernel": "uses the kernel's machinery",
    "nbgrader": "imports nbgrader",
    "nbclient": "imports nbclient",
    "jupyter_client": "imports jupyter_client",
}
#: Names whose mere use is a flag.
FLAGGED_NAMES = {
    "exec": "calls exec", "eval": "calls eval", "compile": "calls compile", "__import__": "calls __import__",
    "get_ipython": "uses get_ipython", "__builtins__": "uses __builtins__", "globals": "uses globals()",
    "vars": "uses vars()", "breakpoint": "calls breakpoint", "autograder": "names the grader (autograder)",
}
#: Attributes whose use is a flag wherever they appear.
FLAGGED_ATTRIBUTES = {
    "__code__": "touches __code__", "__globals__": "touches __globals__", "__builtins__": "touches __builtins__",
    "__closure__": "touches __closure__", "__subclasses__": "touches __subclasses__", "__import__": "calls __import__",
    "__loader__": "touches __loader__", "__spec__": "touches __spec__", "f_globals": "reads a frame (f_globals)",
    "f_locals": "reads a frame (f_locals)", "f_back": "reads a frame (f_back)", "f_builtins": "reads a frame",
    "f_code": "reads a frame (f_code)", "tb_frame": "reads a frame (tb_frame)", "gi_frame": "reads a frame",
    "cr_frame": "reads a frame", "modules": None,  # sys.modules: see _attribute
}
#: Calls on a module that are flags: (module, attribute).
FLAGGED_CALLS = {
    ("os", "system"): "runs a shell command (os.system)", ("os", "popen"): "runs a shell command (os.popen)",
    ("os", "kill"): "sends a signal (os.kill)", ("os", "killpg"): "sends a signal (os.killpg)",
    ("os", "fork"): "forks the process", ("os", "execv"): "replaces the process", ("os", "execl"): "replaces the process",
    ("os", "execvp"): "replaces the process", ("os", "chdir"): "changes the working directory",
    ("sys", "setprofile"): "installs a profiler hook", ("sys", "settrace"): "installs a trace hook",
    ("sys", "addaudithook"): "installs an audit hook", ("sys", "exit"): None,
}
#: Calls that open, write or remove files: (module or None for a builtin, name).
FILE_CALLS = {
    (None, "open"), ("io", "open"), ("os", "open"), ("os", "remove"), ("os", "unlink"), ("os", "rename"),
    ("os", "replace"), ("os", "rmdir"), ("os", "removedirs"), ("os", "makedirs"), ("os", "mkdir"),
    ("os", "symlink"), ("os", "link"), ("os", "truncate"), ("os", "chmod"), ("shutil", "copy"),
    ("shutil", "copyfile"), ("shutil", "copytree"), ("shutil", "rmtree"), ("shutil", "move"),
    ("pathlib", "Path"), (None, "Path"), ("torch", "save"), ("torch", "load"),
}


@dataclass(frozen=True)
class Flag:
    cell: str        # how a person names the cell (`grade_id` or "cell N ('first line')")
    reason: str

    def __str__(self) -> str:
        return f"{self.cell}: {self.reason}"


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


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


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


#: Private attributes of torch.nn / autograd objects that honest parallelism code uses (FSDP swaps parameters).
ALLOWED_PRIVATE = {"_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks",
                   "_backward_hooks", "_backward_pre_hooks", "_version", "_non_persistent_buffers_set"}
_INTERNALS: set[str] | None = None


def private_internals() -> set[str]:
    """Underscore names of the communication stack and of the course's own packages: the private attributes of
    ``torch.distributed`` (its modules, process groups, backends, work objects), of ``torch._C._distributed_c10d``
    and of ``labsupport``'s modules. Reaching one from any object (``pg._get_backend(...)``) is a flag."""
    global _INTERNALS
    if _INTERNALS is None:
        names: set[str] = set()
        try:
            import importlib

            import torch.distributed as dist

            objects = [dist, getattr(dist, "distributed_c10d", None), getattr(dist, "ProcessGroup", None),
                       getattr(dist, "Work", None), getattr(torch_c10d(), "Backend", None), torch_c10d(),
                       getattr(dist, "Backend", None)]
            for name in ("ProcessGroupGloo", "ProcessGroupNCCL", "ProcessGroupMPI"):
                objects.append(getattr(dist, name, None) or getattr(torch_c10d(), name, None))
            for module in ("labsupport", "labsupport.launch", "labsupport.comm", "labsupport._pool",
                           "labsupport._worker", "labsupport._callboard", "labsupport.timeline"):
                try:
                    objects.append(importlib.import_module(module))
                except Exception:
                    pass
            for obj in objects:
                if obj is not None:
                    names.update(n for n in dir(obj) if _private(n))
        except Exception:
            names = {"_get_backend", "_functional_collectives", "_C", "_distributed_c10d", "_default_pg",
                     "_world", "_allgather_base", "_reduce_scatter_base"}
        _INTERNALS = names - ALLOWED_PRIVATE
    return _INTERNALS


def torch_c10d():
    try:
        import torch._C._distributed_c10d as c10d  # noqa: PLC2701 (read-only: names to look for)

        return c10d
    except Exception:
        return None


def _local_path(node) -> bool:
    """A plain relative path constant inside the working directory (no ``..``, not absolute, no ``~``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value.replace("\\", "/")
        return bool(text) and not text.startswith(("/", "~")) and ".." not in text.split("/")
    if isinstance(node, ast.JoinedStr):
        first = node.values[0] if node.values else None
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            text = first.value
            return bool(text) and not text.startswith(("/", "~")) and ".." not in str(ast.unparse(node))
    return False


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


def student_cells(submission, release) -> list[tuple[int, object]]:
    """(index, cell) of every code cell of ``submission`` a student wrote or could change: answer cells, cells
    without nbgrader metadata that are not an unchanged copy of a release cell."""
    from .feedback import source_text

    untouched = {_norm(source_text(c)) for c in release.cells if c.cell_type == "code"}
    found = []
    for i, cell in enumerate(submission.cells):
        if cell.cell_type != "code":
            continue
        meta = nbgrader_meta(cell)
        if meta.get("grade") or (meta.get("locked") and not meta.get("solution")):
            continue  # read-only: restored from the release before grading
        if not meta.get("solution") and _norm(source_text(cell)) in untouched:
            continue
        found.append((i, cell))
    return found


def _norm(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def screen_notebook(submission, release) -> list[Flag]:
    """Flags for every student-written code cell of ``submission`` (see the module docstring).

    Imports made by the notebook's read-only cells (``import torch.distributed as dist`` in the set-up cell) are
    known to every cell, so ``dist._something`` is recognised as a module path wherever it is written.
    """
    from .feedback import source_text

    modules: dict[str, str] = {}
    own: set[str] = set()
    cells = student_cells(submission, release)
    for cell in release.cells:
        if cell.cell_type == "code":
            try:
                modules.update(_imports(ast.parse(python_source(source_text(cell)))))
            except (SyntaxError, ValueError):
                pass
    for _i, cell in cells:  # names one cell defines may be used in another
        try:
            own |= _own_private(ast.parse(python_source(source_text(cell))))
        except (SyntaxError, ValueError):
            pass
    flags = []
    for i, cell in cells:
        for reason in screen_source(source_text(cell), modules, own):
            flags.append(Flag(cell_label(cell, i).strip("`"), reason))
    return flags
