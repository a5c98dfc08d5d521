"""The warden: in a grading worker, what a student's own function cannot reach, and a record it cannot change.

Grading runs a student's function on workers, in the same Python process as the check that watches it, so that
function could reach the check: read its frames, walk the garbage collector, rewrite the recording of its calls,
or move data past it (the rendezvous store, a socket of its own, a collective the recording did not see). The
warden is a PEP 578 audit hook, installed in a worker before any student code runs there when the caller asked for
it (``LABSUPPORT_WARDEN=1``: the judge and the checks' tests do). An audit hook cannot be removed, and nothing in
Python lists the hooks, so what this module keeps in the hook's closure is out of reach of the worker's Python:

* **Refusals.** While the innermost frame that is either the student's (compiled by the judge as
  ``<student code: ...>``) or ours is the student's, the hook refuses what honest answers never need: frames and
  tracebacks' internals (``sys._getframe``, ``tb_frame``, ``gi_frame``, ``f_code``, ``sys._current_frames``),
  tracing (``sys.settrace``/``setprofile``), the garbage collector's lists, ``ctypes``, new sockets, ``mmap``,
  processes and signals, new code objects and functions, ``exec``/``compile`` called by the student directly,
  writing files outside the working folder and the temporary folder, and ``/proc`` beyond this process. A refusal
  is a ``PermissionError`` naming what was refused, and a line in the rank's refusal file, which the grader reads
  from outside the worker (``take_refusals`` in ``_pool``): the check then fails and the submission is flagged.
  Frames that the import machinery runs, and a few standard modules that read a frame for their own bookkeeping
  (``collections``, ``typing``, ``enum``, ``dataclasses``, ``logging``, ``warnings``), are not the student's doing,
  nor is a traceback the student prints or formats (``traceback.print_exc``, ``format_exc``, ``extract_tb``...:
  text, never a frame; ``walk_stack`` and ``walk_tb``, which hand out frames, are refused).
* **The true record of communication.** The tap's wrappers report every call (outermost and nested) to the hook
  just before the original runs, and the hook accepts a report only from the tap's own code and only for an
  original it knew at installation. A ``CommCounter`` opens and closes a *window* with the hook: when it closes,
  the counter's calls must be what the hook recorded on that thread in the meantime (none deleted, none added,
  none made unseen inside another call's argument conversion, the counter never swapped); the hook then puts
  the true list in the counter.
* **Traffic the recording does not explain.** When a window closes, the hook reads from the kernel (``TCP_INFO``
  of every TCP socket the process holds) how many bytes this process sent in the window, and compares them with
  what the recorded calls can have sent: a point-to-point message its bytes and gloo's header, a collective a
  bound above what gloo's algorithms send. Bytes beyond that went through a collective the tap did not see, the
  store or a socket of the student's: a refusal. (Under NCCL the data does not cross TCP: not measured.)

What it cannot see is said in the README ("What grading trusts").
"""

from __future__ import annotations

import os
import sys

STUDENT_FILE = "<student code: "  # the file name the judge compiles a submission's cells with
EXIT_REFUSAL_LOST = 86  # a refusal that could not be written down ends the worker with this status

#: gloo's bytes on the wire around a point-to-point message: a header before the payload (sender) and a
#: notification of a posted receive (receiver), measured on gloo's TCP transport (torch 2.4 to 2.13).
SEND_OVERHEAD = 96
RECV_OVERHEAD = 48

_installed = []  # one entry once installed; nothing else of the warden lives at module level


def refusal_file(stack_file: str) -> str:
    """The file a worker's refusals go to, next to its stack file."""
    folder, name = os.path.split(stack_file)
    return os.path.join(folder, "refusals-" + name.replace("stack-", "", 1))


def installed() -> bool:
    return bool(_installed)


def allowance(kind: str, nbytes: int, group_size: int) -> int:
    """The most bytes a rank can send on the wire for one recorded call of ``kind`` with ``nbytes`` of its data."""
    n = max(int(group_size), 1)
    if kind == "send":
        return nbytes + SEND_OVERHEAD
    if kind == "recv":
        return RECV_OVERHEAD * max(n - 1, 1)
    fixed = 1024 * n
    if kind in ("all_reduce", "reduce_scatter", "reduce"):
        return 3 * nbytes + fixed
    if kind in ("broadcast", "all_gather", "gather", "scatter"):
        return 2 * n * nbytes + fixed
    if kind == "all_to_all":
        return 2 * nbytes + fixed
    return 4 * n * nbytes + fixed  # barrier and anything else: generous, never a false refusal


def install(record_path: str, trusted_dirs: tuple = (), task_code=None) -> None:
    """Install the hook in this process (once; it stays for the life of the process). ``task_code`` is the code of
    the worker's function that asks for a snapshot before a task's function runs and a sweep after it."""
    if _installed:
        return
    import _socket
    import _struct
    import threading

    from . import comm as _comm
    from . import tap as _tap

    _tap.install()
    here = os.path.dirname(os.path.abspath(__file__))
    trusted = tuple(os.path.join(d, "") for d in (here, *trusted_dirs))
    benign = tuple(os.path.join(os.path.dirname(os.__file__), f) for f in (
        "collections/__init__.py", "typing.py", "enum.py", "dataclasses.py", "logging/__init__.py", "warnings.py",
        "functools.py", "abc.py", "linecache.py"))
    tmp = os.path.join(os.path.realpath(__import__("tempfile").gettempdir()), "")
    traceback_file = os.path.join(os.path.dirname(os.__file__), "traceback.py")
    printing = frozenset({"print_exc", "format_exc", "print_exception", "format_exception", "format_exception_only",
                          "print_tb", "format_tb", "extract_tb", "print_last", "print_stack", "format_stack",
                          "extract_stack"})  # text and summaries; walk_stack and walk_tb give frames: refused

    # what the hook calls is taken now, before any student code could rebind a module's attribute
    getframe, write, exit_, getpid, listdir, readlink, realpath, getcwd, fsdecode = (
        sys._getframe, os.write, os._exit, os.getpid, os.listdir, os.readlink, os.path.realpath, os.getcwd,
        os.fsdecode)
    writes, allow, attributes, COMM = _writes, allowance, object.__getattribute__, ("pg", "backend", "functional")
    unpack_from, sock, get_ident = _struct.unpack_from, _socket.socket, threading.get_ident
    AF_INET, AF_INET6, SOCK_STREAM = _socket.AF_INET, _socket.AF_INET6, _socket.SOCK_STREAM
    IPPROTO_TCP, TCP_INFO = _socket.IPPROTO_TCP, getattr(_socket, "TCP_INFO", None)
    tap_code = _tap._intercept.__code__
    enter_code, exit_code = _comm.CommCounter.__enter__.__code__, _comm.CommCounter.__exit__.__code__
    read_code = _comm.recorded_calls.__code__
    kept = tuple(_tap._originals())  # held here too, so that no id below can be reused by another object
    originals = frozenset(id(fn) for fn in kept)
    fd = os.open(record_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    local = threading.local()
    log = []        # (thread, kind, peer, group, nbytes, level, nested) of every call the tap reported
    windows = {}    # id(counter) -> [counter, summary, calls list, log index, bytes sent, thread]

    import types

    modules = sys.modules
    watched_names = ("torch", "torch.nn.functional", "torch.testing", "torch.autograd", "torch.optim", "builtins",
                     "math", "numpy", "operator", "functools", "copy")
    kinds = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, types.ModuleType,
             classmethod, staticmethod, property, types.MethodDescriptorType, types.WrapperDescriptorType)
    snaps = {}  # name -> (module, {attribute: value}, {class: {attribute: value}})

    def watched_module(name):
        return (name in watched_names or name.startswith(("labsupport", "autograder", "torch.distributed"))
                or name.startswith("torch.optim."))

    def callables(namespace):  # type(), not isinstance(): a deprecated name warns when asked for its __class__
        return {k: v for k, v in list(namespace.items()) if issubclass(type(v), kinds)}

    torch_dir = os.path.join(os.path.dirname(os.path.abspath(modules["torch"].__file__)), "")

    def torch_wrapper_of(new, old):
        """torch's own lazy wrapping of one of its functions (torch._dynamo wraps ``torch.manual_seed`` when it is
        first imported): a function of torch's files whose ``__wrapped__`` is the one taken."""
        try:
            return (attributes(new, "__dict__").get("__wrapped__") is old
                    and attributes(new, "__code__").co_filename.startswith(torch_dir))
        except Exception:
            return False

    def snapshot():
        """Take what the grader's code calls, for every module of ours and of torch's core not yet taken."""
        for name, module in list(modules.items()):
            if module is None or name in snaps or not watched_module(name):
                continue
            try:
                namespace = attributes(module, "__dict__")
            except Exception:
                continue
            own = name.startswith(("labsupport", "autograder"))
            classes = {}
            for value in list(namespace.values()):
                if issubclass(type(value), type) and own and attributes(value, "__module__") == name:
                    classes[value] = callables(attributes(value, "__dict__"))
            taken = callables(namespace)
            if not own:  # torch rebinds some of its classes itself (set_default_dtype: torch.Storage)
                taken = {k: v for k, v in taken.items() if not issubclass(type(v), type)}
            snaps[name] = (module, taken, classes)
        import torch

        for cls in (torch.Tensor, torch.nn.Module, torch.nn.Parameter, torch.autograd.Function):
            snaps.setdefault(f"class {cls.__qualname__}", (None, {}, {cls: callables(attributes(cls, "__dict__"))}))

    def sweep():
        """Refuse when a function or class the grader's code uses was replaced (a patched module or class)."""
        for name, (module, taken, classes) in list(snaps.items()):
            if module is not None and modules.get(name) is not module:
                refuse(f"a replaced module ({name})", "the grader's modules must stay as they were imported.")
            now = attributes(module, "__dict__") if module is not None else {}
            for key, value in list(taken.items()):
                new = now.get(key)
                if new is not value:
                    if torch_wrapper_of(new, value):
                        taken[key] = new
                        continue
                    refuse(f"a changed {name}.{key}", "an answer must not replace what the grader calls.")
            for cls, kept in classes.items():
                now = attributes(cls, "__dict__")
                for key, value in kept.items():
                    if now.get(key) is not value:
                        refuse(f"a changed {cls.__qualname__}.{key}", "an answer must not replace what the "
                               "grader calls.")

    def frame_owner(frame):
        """'student', 'ours' or None: whose doing an event raised with ``frame`` innermost is. A traceback printed
        or formatted by the student (``traceback.print_exc()`` in an ``except``) is the traceback module's doing:
        those functions give text, never a frame."""
        called = None  # the outermost frame seen so far: the one the next (calling) frame called
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(STUDENT_FILE):
                if called is not None and called.f_code.co_filename == traceback_file and \
                        called.f_code.co_name in printing:
                    return "ours"
                return "student"
            if name.startswith(trusted) or name.startswith("<frozen importlib") or name in benign:
                return "ours"
            called, frame = frame, frame.f_back
        return None

    def refuse(what: str, why: str):
        text = (f"grading refused {what}: {why} Honest answers never need it: use the torch.distributed calls "
                "the exercise asks for, on the tensors you are given.")
        try:
            write(fd, (f"{getpid()}\t{text}".replace("\n", " ") + "\n").encode())
        except OSError:
            exit_(EXIT_REFUSAL_LOST)
        raise PermissionError(text)

    def sent_bytes():
        """{socket inode: bytes written} for every TCP socket of this process, from the kernel: ``tcpi_bytes_sent``
        less ``tcpi_bytes_retrans``, plus ``tcpi_notsent_bytes`` (a send that gloo has completed may still wait in
        the socket's queue when the window closes)."""
        out = {}
        if TCP_INFO is None:
            return out
        for name in listdir("/proc/self/fd"):
            try:
                link = readlink("/proc/self/fd/" + name)
            except OSError:
                continue
            if not link.startswith("socket:"):
                continue
            try:
                s = sock(fileno=int(name))
            except (OSError, ValueError):
                continue
            try:
                if s.family in (AF_INET, AF_INET6) and s.type == SOCK_STREAM:
                    info = s.getsockopt(IPPROTO_TCP, TCP_INFO, 232)
                    if len(info) >= 216:  # written to the socket: sent (less resent) and still queued
                        out[link] = (unpack_from("Q", info, 200)[0] - unpack_from("Q", info, 208)[0]
                                     + unpack_from("I", info, 144)[0])
            except OSError:
                pass
            finally:
                s.detach()
        return out

    def calls_of(summary):
        return attributes(summary, "__dict__").get("calls")

    def open_window(counter):
        if not windows:  # nothing reads the record before this point any more
            del log[:]
        summary = attributes(counter, "__dict__").get("summary")
        windows[id(counter)] = [counter, summary, calls_of(summary), len(log), sent_bytes(), get_ident()]

    def close_window(counter):
        sweep()
        entry = windows.pop(id(counter), None)
        if entry is None:
            refuse("a CommCounter closed twice or never opened", "the recording of communication calls was "
                   "changed from inside the answer.")
        _, summary, calls, start, before, thread = entry
        now = attributes(counter, "__dict__").get("summary")
        if now is not summary or calls_of(summary) is not calls:
            refuse("a replaced recording", "the CommCounter's summary or its list of calls was swapped during "
                   "the answer.")
        truth = [r for r in log[start:] if r[5] in COMM]  # every thread's: a counter hears them all
        seen = [(kind, peer, group, nbytes) for _, kind, peer, group, nbytes, _, nested in truth if not nested]
        hidden = [r for r in truth if r[6]]
        if hidden:
            refuse(f"{len(hidden)} communication call(s) made inside another one ({hidden[0][1]})",
                   "a call issued while another call's arguments were being read is still a call, and counts.")
        listed = [(c.kind, c.peer, tuple(c.group), c.nbytes) for c in list(calls)]
        if listed != seen:
            refuse("a changed recording", f"the CommCounter lists {len(calls)} call(s) but this rank made "
                   f"{len(seen)}: records were deleted, added or hidden (an observer unsubscribed, a list "
                   "edited).")
        after = sent_bytes()
        if before or after:
            sent = sum(v - before.get(k, 0) for k, v in after.items() if v >= before.get(k, 0))
            explained = sum(allow(kind, nbytes, len(group)) for _, kind, _, group, nbytes, level, _ in log[start:]
                            if level in COMM)
            slack = 512
            if sent > explained + slack:
                refuse(f"{sent - explained:,} bytes that no recorded call sent",
                       f"this rank sent {sent:,} bytes over its sockets while its recorded calls account for at "
                       f"most {explained:,}: data went through a collective the recording did not see, the "
                       "rendezvous store or a socket of its own.")

    def on_tap(args):
        caller = getframe(2)
        if caller.f_code is not tap_code:
            refuse("a forged communication record", "only the tap's own wrappers may report a call.")
        phase, level, fn, call = args
        if id(fn) not in originals:
            refuse("a communication record without a real call", "a record must come with the original "
                   "torch.distributed function.")
        if phase == "enter":
            record = attributes(call, "_record")  # described by the tap before it reported the call
            if record is None:  # a call the tap could not describe (bad arguments): torch will say what is wrong
                return
            kind, peer, group, nbytes = record[0], record[1], tuple(record[2]), int(record[3])
            log.append((get_ident(), kind, peer, group, nbytes, level, bool(call.in_comm)))

    def on_window(args):
        caller = getframe(2)
        op, counter = args[0], args[1]
        if op == "open" and caller.f_code is enter_code:
            open_window(counter)
        elif op == "close" and caller.f_code is exit_code:
            if len(args) > 2 and args[2]:  # the block raised: the check fails with that error, whatever the record
                windows.pop(id(counter), None)
            else:
                close_window(counter)
        elif op == "read" and caller.f_code is read_code:
            sweep()
            entry = windows.get(id(counter))
            if entry is not None:
                args[2][:] = [(kind, peer, group, nbytes) for _, kind, peer, group, nbytes, level, nested
                              in log[entry[3]:] if level in COMM and not nested]
        elif op == "task" and caller.f_code is task_code:
            snapshot() if counter == "start" else sweep()
        else:
            refuse("a forged CommCounter window", "only CommCounter itself opens and closes its window.")

    watched = {
        "sys._getframe": "reading a frame (sys._getframe, inspect.currentframe, traceback.walk_stack)",
        "sys._current_frames": "reading other threads' frames",
        "sys.settrace": "a trace function", "sys.setprofile": "a profile function",
        "threading.settrace": "a trace function", "sys.addaudithook": "an audit hook of its own",
        "gc.get_objects": "the garbage collector's list of objects", "gc.get_referrers": "gc.get_referrers",
        "gc.get_referents": "gc.get_referents", "socket.__new__": "a new socket", "mmap.__new__": "mmap",
        "code.__new__": "a new code object", "function.__new__": "a new function from a code object",
        "os.kill": "a signal to a process", "os.killpg": "a signal to a process group", "os.fork": "fork",
        "os.forkpty": "fork", "os.system": "a shell command", "subprocess.Popen": "a new process",
        "os.exec": "exec of a program", "os.posix_spawn": "a new process", "os.spawn": "a new process",
        "pty.spawn": "a new process", "marshal.loads": "code from marshal", "ctypes.dlopen": "ctypes",
        "ctypes.dlsym": "ctypes", "ctypes.addressof": "ctypes", "ctypes.string_at": "ctypes",
        "ctypes.cdata": "ctypes", "ctypes.call_function": "ctypes", "ctypes.create_string_buffer": "ctypes",
        "sys._current_exceptions": "other threads' exceptions", "os.chdir": "changing the working folder", "os.listdir": None, "open": None,
        "object.__getattr__": None, "object.__setattr__": None, "object.__delattr__": None,
        "exec": None, "compile": None,
    }
    internals = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_code", "gi_code", "cr_code", "ag_code",
                 "f_back", "f_locals", "f_globals", "tb_next"}

    def check(event, args, frame):
        what = watched[event]
        if what is None:
            if event == "object.__getattr__":
                if args[1] not in internals:
                    return
                what = f"the attribute {args[1]} (a frame or a traceback's internals)"
            elif event in ("object.__setattr__", "object.__delattr__"):
                if args[1] not in ("__code__", "__globals__", "__closure__", "__defaults__", "__kwdefaults__"):
                    return
                what = f"changing {args[1]} of a function"
            elif event in ("exec", "compile"):
                if not frame.f_code.co_filename.startswith(STUDENT_FILE):
                    return  # the standard library's own code generation (dataclasses, namedtuple)
                what = f"{event} of code"
            elif event in ("open", "os.listdir"):
                path = args[0]
                if isinstance(path, int) or path is None:
                    return
                try:
                    path = realpath(fsdecode(path))
                except Exception:
                    return
                if path.startswith("/proc/") and not path.startswith(("/proc/self/", f"/proc/{getpid()}/")):
                    what = f"{event} of {path} (another process)"
                elif path.startswith(("/proc/self/mem", f"/proc/{getpid()}/mem", "/proc/self/fd")):
                    what = f"{event} of {path}"
                elif event == "open" and writes(args) and not (
                        path.startswith(realpath(getcwd()).rstrip("/") + "/") or path.startswith(tmp)):
                    what = f"writing {path} (outside the working folder and the temporary folder)"
                else:
                    return
            else:
                return
        if event.startswith("ctypes") and "ctypes" not in what:
            return
        if frame_owner(frame) == "student":
            refuse(what, "the grader watches a student's function from the same process, and this would reach "
                         "past it.")

    ours = {"labsupport.tap": on_tap, "labsupport.window": on_window}  # each reads the frame two levels up

    forked = []  # set in a child forked by our own code (a grading sandbox): the student's process, not watched

    def hook(event, args):
        if forked or getattr(local, "busy", False):
            return
        handler = ours.get(event)
        base = None
        if handler is None:
            base = event if event in watched else ("os.exec" if event.startswith("os.exec") else
                                                    "os.spawn" if event.startswith("os.spawn") else None)
            if base is None:
                return
        local.busy = True
        try:
            if handler is not None:
                handler(args)
            else:
                check(base, args, getframe(1))
        finally:
            local.busy = False

    snapshot()
    os.register_at_fork(after_in_child=lambda: forked.append(True))  # only our code may fork (refused otherwise)
    sys.addaudithook(hook)
    _installed.append(True)


def _writes(args) -> bool:
    """Whether an ``open`` audit event's (path, mode, flags) opens for writing."""
    mode, flags = (args[1] if len(args) > 1 else None), (args[2] if len(args) > 2 else 0)
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    try:
        return bool(int(flags) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
    except (TypeError, ValueError):
        return False
