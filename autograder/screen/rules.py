"""What the screen looks for: the modules, dotted paths, names and attributes that are flags by themselves, the
private names of the communication stack and of the course's packages (``private_internals``), and which paths
count as inside the notebook's folder.

A path, a name or an attribute counts however it is spelled: ``getattr(x, "tb_" + "frame")`` is screened as
``x.tb_frame`` (``folding.py`` folds constant strings), so each table here says what is flagged, not how it is
written.
"""

from __future__ import annotations

import ast

#: Modules whose import alone is a flag (and every use of them: ``import multiprocessing.shared_memory``).
FLAGGED_MODULES = {
    "autograder": "imports the grader (autograder)",
    "builtins": "imports builtins",
    "importlib": "uses importlib",
    "ctypes": "uses ctypes",
    "cffi": "uses cffi (native code and memory)",
    "gc": "uses gc (the garbage collector's view of every object)",
    "subprocess": "starts processes (subprocess)",
    "signal": "handles signals",
    "socket": "opens sockets (socket)",
    "socketserver": "opens sockets (socketserver)",
    "mmap": "maps memory (mmap)",
    "multiprocessing": "uses multiprocessing (other processes, shared memory)",
    "marshal": "turns code into bytes and back (marshal)",
    "copyreg": "changes how objects are pickled (copyreg)",
    "dill": "pickles code (dill)",
    "cloudpickle": "pickles code (cloudpickle)",
    "dis": "reads compiled code (dis)",
    "code": "runs an interactive interpreter (code)",
    "codeop": "compiles code (codeop)",
    "runpy": "runs other modules (runpy)",
    "pdb": "uses a debugger (pdb)",
    "bdb": "uses a debugger (bdb)",
    "trace": "traces execution (trace)",
    "posix": "uses the posix module (what os is built on)",
    "IPython": "uses IPython's machinery",
    "ipykernel": "uses the kernel's machinery",
    "nbgrader": "imports nbgrader",
    "nbclient": "imports nbclient",
    "jupyter_client": "imports jupyter_client",
}
_SIGNAL = "sends a signal ({})"
_SHELL = "runs a shell command ({})"
_PROCESS = "starts or replaces a process ({})"
_TRACE = "installs a trace or profile hook ({})"
_STACK = "reads the stack's frames ({})"
_RAW_FD = "reads or writes a raw file descriptor ({})"
_CODE = "builds or reads code, frames or closures directly ({})"
_UNPICKLE = "unpickles bytes, which can run any code ({})"
#: Dotted paths (a module, or a name in one) whose use is a flag, with everything under them: what the path
#: stands for however it is reached (``from os import kill``, ``os.kill``, ``getattr(os, "kill")``).
FLAGGED_PATHS = {
    "labsupport.tap": "reaches the communication recording (labsupport.tap)",
    "multiprocessing.shared_memory": "uses shared memory (multiprocessing.shared_memory)",
    "torch.multiprocessing": "uses torch.multiprocessing (other processes, shared memory)",
    "concurrent.futures.ProcessPoolExecutor": "starts processes (concurrent.futures.ProcessPoolExecutor)",
    "concurrent.futures.process": "starts processes (concurrent.futures.process)",
    "torch.distributed.rpc": "uses RPC (torch.distributed.rpc)",
    "torch.distributed.rendezvous": "reaches the rendezvous store (torch.distributed.rendezvous)",
    "torch.distributed.Store": "reaches the rendezvous store (torch.distributed.Store)",
    "torch.from_file": "maps a file into a tensor (torch.from_file)",
    "urllib.request": "opens network connections (urllib.request)",
    "http.client": "opens network connections (http.client)",
    "xmlrpc": "opens network connections (xmlrpc)",
    "asyncio.open_connection": "opens network connections (asyncio.open_connection)",
    "asyncio.open_unix_connection": "opens network connections (asyncio.open_unix_connection)",
    "asyncio.start_server": "opens network connections (asyncio.start_server)",
    "asyncio.start_unix_server": "opens network connections (asyncio.start_unix_server)",
    "os.system": _SHELL.format("os.system"), "os.popen": _SHELL.format("os.popen"),
    "os.kill": _SIGNAL.format("os.kill"), "os.killpg": _SIGNAL.format("os.killpg"),
    "os.pidfd_open": _SIGNAL.format("os.pidfd_open"), "os.abort": "aborts the process (os.abort)",
    "os.chdir": "changes the working directory (os.chdir)",
    "sys.modules": "uses sys.modules",
    "sys.meta_path": "changes how modules are imported (sys.meta_path)",
    "sys.path_hooks": "changes how modules are imported (sys.path_hooks)",
    "sys.path_importer_cache": "changes how modules are imported (sys.path_importer_cache)",
    "sys._getframe": "reads the stack's frames (sys._getframe)",
    "sys._current_frames": "reads the stack's frames (sys._current_frames)",
    "sys.settrace": _TRACE.format("sys.settrace"), "sys.setprofile": _TRACE.format("sys.setprofile"),
    "sys.monitoring": _TRACE.format("sys.monitoring"), "sys.addaudithook": "installs an audit hook (sys.addaudithook)",
    "threading.settrace": _TRACE.format("threading.settrace"),
    "threading.setprofile": _TRACE.format("threading.setprofile"),
    "threading.settrace_all_threads": _TRACE.format("threading.settrace_all_threads"),
    "threading.setprofile_all_threads": _TRACE.format("threading.setprofile_all_threads"),
    "sys.last_traceback": "reaches the session's last uncaught error (sys.last_traceback)",
    "sys.last_exc": "reaches the session's last uncaught error (sys.last_exc)",
    "sys.last_value": "reaches the session's last uncaught error (sys.last_value)",
    "inspect.getclosurevars": _CODE.format("inspect.getclosurevars"),
    "inspect.unwrap": "reaches the original function behind a wrapper (inspect.unwrap)",
    "inspect.getmembers": "reaches every attribute by the names dir() lists (inspect.getmembers)",
    "inspect.getmembers_static": "reaches every attribute by the names dir() lists (inspect.getmembers_static)",
    "torch.ops.c10d": "calls c10d's operators directly, beside torch.distributed (torch.ops.c10d)",
    "torch.ops.c10d_functional": "calls functional collectives' operators (torch.ops.c10d_functional)",
    "torch.ops._c10d_functional": "calls functional collectives' operators (torch.ops._c10d_functional)",
    "torch.ops._c10d_functional_autograd": "calls functional collectives' operators "
                                           "(torch.ops._c10d_functional_autograd)",
    "pickle.loads": _UNPICKLE.format("pickle.loads"), "pickle.load": _UNPICKLE.format("pickle.load"),
    "pickle.Unpickler": _UNPICKLE.format("pickle.Unpickler"),
    "types.CodeType": _CODE.format("types.CodeType"), "types.FunctionType": _CODE.format("types.FunctionType"),
    "types.CellType": _CODE.format("types.CellType"), "types.FrameType": _CODE.format("types.FrameType"),
    "types.TracebackType": _CODE.format("types.TracebackType"),
}
for _name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve", "execl", "execle", "execlp",
              "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp", "spawnvp"):
    FLAGGED_PATHS[f"os.{_name}"] = _PROCESS.format(f"os.{_name}")
for _name in ("read", "write", "pread", "pwrite", "readv", "writev", "sendfile", "fdopen", "dup", "dup2", "pipe",
              "pipe2", "memfd_create", "mkfifo", "openpty", "splice", "copy_file_range"):
    FLAGGED_PATHS[f"os.{_name}"] = _RAW_FD.format(f"os.{_name}")
# a stack or a traceback printed, formatted or summarised (print_exc, format_exc, extract_tb, print_stack) is text:
# what reaches frames is flagged (walk_stack, walk_tb, clear_frames; capture_locals in FLAGGED_KEYWORDS)
for _name in ("walk_stack", "walk_tb", "clear_frames"):
    FLAGGED_PATHS[f"traceback.{_name}"] = _STACK.format(f"traceback.{_name}")
for _name in ("currentframe", "stack", "trace", "getouterframes", "getinnerframes", "getgeneratorlocals",
              "getcoroutinelocals", "getasyncgenlocals"):
    FLAGGED_PATHS[f"inspect.{_name}"] = _STACK.format(f"inspect.{_name}")
_STORE = "reaches the rendezvous store ({})"
#: The rendezvous store's classes and functions: a flag wherever they are named (attribute, import or name).
STORE_NAMES = {name: _STORE.format(name) for name in (
    "TCPStore", "FileStore", "HashStore", "PrefixStore", "_get_default_store", "_store_based_barrier",
    "_get_process_group_store", "_create_store_from_options", "_CLIENT_STORE")}
#: Names whose mere use is a flag.
FLAGGED_NAMES = {
    "exec": "calls exec", "eval": "calls eval", "compile": "calls compile", "__import__": "calls __import__",
    "get_ipython": "uses get_ipython", "__builtins__": "uses __builtins__", "globals": "uses globals()",
    "vars": "uses vars()", "breakpoint": "calls breakpoint", "autograder": "names the grader (autograder)",
    **STORE_NAMES,
}
_FRAME = "reads a frame ({})"
#: Attributes whose use is a flag wherever they appear (on any object, by syntax or by a constant name).
FLAGGED_ATTRIBUTES = {
    "__code__": "touches __code__", "__globals__": "touches __globals__", "__builtins__": "touches __builtins__",
    "__closure__": "touches __closure__ (a function's captured variables)",
    "cell_contents": "reads a closure cell (cell_contents)",
    "__wrapped__": "touches __wrapped__ (the original function behind a wrapper)",
    "__defaults__": "touches __defaults__", "__kwdefaults__": "touches __kwdefaults__",
    "__subclasses__": "touches __subclasses__", "__import__": "calls __import__",
    "__loader__": "touches __loader__", "__spec__": "touches __spec__",
    **{name: _FRAME.format(name) for name in (
        "f_globals", "f_locals", "f_back", "f_builtins", "f_code", "f_trace", "f_lasti", "tb_frame", "tb_next",
        "gi_frame", "gi_code", "gi_yieldfrom", "cr_frame", "cr_code", "cr_await", "ag_frame", "ag_code")},
    **STORE_NAMES,
    "modules": None,  # sys.modules: see the walker
}
#: Keyword arguments that are a flag in any call unless they are a false constant: what they ask for has no honest
#: use (``traceback.TracebackException(..., capture_locals=True)`` keeps the repr of every frame's variables).
FLAGGED_KEYWORDS = {"capture_locals": "reads the variables of the stack's frames (capture_locals)"}
#: Paths that may be rebound although they are a module's attributes: where prints go.
REBINDABLE = {"sys.stdout", "sys.stderr"}
#: Attributes of tensors and storages that share memory with other processes or map files: a flag on any object.
SHARED_MEMORY_ATTRIBUTES = {"share_memory_", "share_memory", "_share_memory_", "from_file", "_share_fd_cpu_",
                            "_share_filename_cpu_", "_share_cuda_", "_new_shared", "_new_shared_cuda",
                            "_new_shared_fd_cpu", "_new_shared_filename_cpu", "_new_using_fd_cpu",
                            "_new_using_filename_cpu", "_new_with_file", "_set_from_file", "_get_shared_fd",
                            "_shared_incref", "_shared_decref", "_release_ipc_counter", "_release_ipc_counter_cuda",
                            "_get_filename", "_write_file", "_cdata", "_set_cdata", "_weak_ref", "_new_with_weak_ptr",
                            "_free_weak_ref", "_resize_with_addr_", "_swap_data_ptr_"}


def shared_memory_reason(attr: str, shown: str) -> str:
    if attr in ("from_file", "_new_with_file", "_set_from_file", "_write_file", "_get_filename"):
        return f"maps a file into a tensor ({shown})"
    if attr in ("_cdata", "_set_cdata", "_weak_ref", "_new_with_weak_ptr", "_free_weak_ref", "_resize_with_addr_",
                "_swap_data_ptr_"):
        return f"handles a tensor's memory by address ({shown})"
    return f"shares a tensor's memory with other processes ({shown})"


def path_reason(dotted: str) -> str | None:
    """Why the dotted path (``os.kill``, ``labsupport.tap.observers``) is a flag, None if it is not."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):  # the most precise first: multiprocessing.shared_memory, then multiprocessing
        reason = FLAGGED_PATHS.get(".".join(parts[:i]))
        if reason:
            return reason
    if parts[0] in FLAGGED_MODULES:
        return FLAGGED_MODULES[parts[0]]
    if parts[0] == "labsupport" and "tap" in parts:
        return FLAGGED_PATHS["labsupport.tap"]
    for part in parts[1:]:
        if part in STORE_NAMES:
            return STORE_NAMES[part]
    return None


#: Calls that open, write or remove files: (module or None for a builtin, name).
FILE_CALLS = {
    (None, "open"), ("io", "open"), ("io", "FileIO"), ("os", "open"), ("os", "remove"), ("os", "unlink"),
    ("os", "rename"), ("os", "replace"), ("os", "rmdir"), ("os", "removedirs"), ("os", "makedirs"), ("os", "mkdir"),
    ("os", "symlink"), ("os", "link"), ("os", "truncate"), ("os", "chmod"), ("os", "listdir"), ("os", "scandir"),
    ("shutil", "copy"), ("shutil", "copyfile"), ("shutil", "copytree"), ("shutil", "rmtree"), ("shutil", "move"),
    ("pathlib", "Path"), (None, "Path"), ("torch", "save"), ("torch", "load"),
}
#: Words in a string (constant, or folded from constants) that are a flag.
FLAGGED_STRINGS = {
    "autograder": "names the grader (autograder) in a string",
    "labsupport.tap": "names the communication recording (labsupport.tap) in a string",
}


def string_reason(text: str) -> list[str]:
    """Why a string the cell spells is a flag: it names the grader or the tap, or a path under /proc or /dev/shm."""
    found = [reason for word, reason in FLAGGED_STRINGS.items() if word in text]
    for root in ("/proc", "/dev/shm", "/dev/mem"):
        at = text.find(root)
        if at >= 0 and text[at + len(root):at + len(root) + 1] in ("", "/"):
            shown = text if len(text) <= 40 else text[:37] + "..."
            found.append(f"names a path under {root} ({shown!r})")
    return found


#: Modules whose attributes honest answers look up by a computed name (``getattr(torch, meta["dtype"])``).
COMPUTED_NAMES_ALLOWED = {"torch"}


def allowed_private_path(dotted: str) -> bool:
    """Private in name only: torch's ``_foreach_`` operations (what optimizers and gradient scalers use)."""
    parts = dotted.split(".")
    return parts[0] == "torch" and len(parts) == 2 and parts[1].startswith("_foreach_")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


#: Private attributes of torch.nn / autograd objects that honest parallelism code uses (FSDP swaps parameters).
ALLOWED_PRIVATE = {"_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks",
                   "_backward_hooks", "_backward_pre_hooks", "_version", "_non_persistent_buffers_set"}
_INTERNALS: set[str] | None = None
_TORCH_INTERNALS: set[str] = set()


def private_internals() -> set[str]:
    """Underscore names of the communication stack and of the course's own packages: the private attributes of
    ``torch.distributed`` (its modules, process groups, backends, work objects), of ``torch._C._distributed_c10d``
    and of ``labsupport``'s modules (the tap among them). Reaching one from any object (``pg._get_backend(...)``)
    is a flag."""
    global _INTERNALS, _TORCH_INTERNALS
    if _INTERNALS is None:
        names: set[str] = set()
        torch_names: set[str] = set()
        try:
            import importlib

            import torch.distributed as dist

            objects = [dist, getattr(dist, "distributed_c10d", None), getattr(dist, "ProcessGroup", None),
                       getattr(dist, "Work", None), getattr(torch_c10d(), "Backend", None), torch_c10d(),
                       getattr(dist, "Backend", None)]
            for name in ("ProcessGroupGloo", "ProcessGroupNCCL", "ProcessGroupMPI"):
                objects.append(getattr(dist, name, None) or getattr(torch_c10d(), name, None))
            for obj in objects:
                if obj is not None:
                    torch_names.update(n for n in dir(obj) if _private(n))
            names |= torch_names
            for module in ("labsupport", "labsupport.launch", "labsupport.comm", "labsupport.tap", "labsupport._pool",
                           "labsupport._worker", "labsupport._callboard", "labsupport.timeline"):
                try:
                    names.update(n for n in dir(importlib.import_module(module)) if _private(n))
                except Exception:
                    pass
        except Exception:
            torch_names = names = {"_get_backend", "_functional_collectives", "_C", "_distributed_c10d",
                                   "_default_pg", "_world", "_allgather_base", "_reduce_scatter_base"}
        _TORCH_INTERNALS = torch_names - ALLOWED_PRIVATE
        _INTERNALS = names - ALLOWED_PRIVATE
    return _INTERNALS


def torch_internals() -> set[str]:
    """The private names of ``private_internals`` that belong to ``torch.distributed`` and c10d."""
    private_internals()
    return _TORCH_INTERNALS


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
