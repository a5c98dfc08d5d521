"""What the screen looks for: the modules, names, attributes and calls that are flags by themselves, the private
names of the communication stack and of the course's packages (``private_internals``), and which paths count as
inside the notebook's folder.
"""

from __future__ import annotations

import ast

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
    "socket": "opens sockets (socket)",
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


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


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
