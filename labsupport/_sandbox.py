"""Grading's boundary: a student's function runs in a sandbox, a child of its rank's worker (the *host*).

A check wraps the student's function with ``sandboxed(fn, what=..., allow=...)`` in the grader's process; what
travels to the workers is the function's pickled bytes, which a host never unpickles. When the check, on a worker,
calls it, the host forks a sandbox (once per task, before any student code exists in it) and sends it the call:

* **The sandbox** closes every file it inherited but its link to the host, forgets the host's process group and
  makes a ``labsupport._relay`` group its default one, cannot import the grader, writes only its private folder
  (and the folders a check shares with every rank for one exercise, such as a checkpoint's) and reads no other
  rank's (Landlock, ``_landlock``), and (on Linux) installs a seccomp filter: no new sockets, processes or
  programs, no signal or memory access to another process. It unpickles the function, runs it, and its prints and
  warnings go to the host as the rank's output. Nothing of the grader lives there: whatever it patches, reads or
  fakes is its own.
* **The host** carries every message: each relayed request (kind, peer, tensors' bytes) is performed on the real
  gloo group by the host's own ``torch.distributed`` calls, which the tap records as usual, so a check's
  ``CommCounter`` in the host sees exactly what crossed to the other ranks. Requests an exercise forbids (``allow``)
  are refused with a message that names the rule. The host also logs when each request was posted and waited.
* **Results as plain data.** Right after the function returns the sandbox says so; the host then refuses any
  request (a result that communicates when it is read). Tensors, of any class, come back as dtype, shape and bytes;
  other objects as a description. The arguments come back too and are copied into the check's own tensors, so an
  in-place answer works as it does on a worker.

Where ``os.fork`` is missing (Windows) the function runs in the worker itself, as in a notebook.

This module is what checks use; the host's side is ``_sandbox_host``, the sandbox's own ``_sandbox_child``, and
how values cross between them ``_plain``.
"""

from __future__ import annotations

import os
import sys

from ._plain import SandboxRefused, Unplain  # noqa: F401  (what checks and tests name)


class Sandboxed:
    """A student's function as the check on a worker sees it (see the module docstring)."""

    def __init__(self, blob: bytes, name: str, what: str, allow=None, forbid=None, shared=(), arena=True):
        self.blob, self.__name__, self.what, self.arena = blob, name, what, bool(arena)
        self.allow = None if allow is None else frozenset(allow)
        self.forbid = dict(forbid or {})  # "module:name" -> why, for the exercise's own built-in
        self.shared = tuple(shared)  # folders the sandbox reads and writes besides its own (a checkpoint's)

    def __reduce__(self):
        return (Sandboxed, (self.blob, self.__name__, self.what, self.allow, self.forbid, self.shared, self.arena))

    def __repr__(self) -> str:
        return f"<{self.__name__}, run in a sandbox>"

    def __call__(self, *args, **kwargs):
        from ._worker import CURRENT

        if (not CURRENT or not hasattr(os, "fork") or os.environ.get("LABSUPPORT_SANDBOX") == "0"
                or CURRENT.get("backend") == "nccl"):
            # not on a worker, no fork (Windows), CUDA in the worker (a forked child cannot use it), or turned off
            # (benchmarks/sandbox.py): run it here
            from . import _pickling

            return _pickling.loads(self.blob)(*args, **kwargs)
        return _host(self.shared).call(self, args, kwargs)


def sandboxed(fn, what: str = "", allow=None, forbid=None, driver=None, shared=(), arena=True) -> Sandboxed:
    """``fn`` wrapped for a check (called in the grader's process): ``what`` names the exercise in messages,
    ``allow`` is the set of ``torch.distributed`` calls it may make (``{"send", "recv"}``), None for any;
    ``forbid`` maps ``"module:name"`` of a built-in the exercise re-implements (a function or a class) to the
    message it raises if the function uses it (``{"torch.utils.data:DistributedSampler": "shard_indices must not
    ..."}``). ``shared`` names folders that every rank's sandbox reads and writes for this function (the folder a
    checkpoint is saved in): a sandbox is started afresh with them, since its file rules can only be narrowed.
    ``arena=False``: every tensor crosses in the link's messages, none through the memory the host shares with the
    sandbox (``labsupport._arena``), for a check that reads the sandbox's memory while a request is in flight.

    ``driver``, for an exercise that is a class or a set of functions, is a function of the grader's that exercises
    ``fn`` in the sandbox: the call is then ``driver(fn, *args, **kwargs)``. It travels by value with its module (so
    that module may import only the standard library, torch and labsupport); it runs beside the student's code, so
    what it returns is read as the student's own answer: plain data that the host checks."""
    import functools

    from . import _pickling

    if isinstance(fn, Sandboxed):
        return fn
    name = getattr(fn, "__name__", type(fn).__name__)
    modules = []
    if driver is not None:
        modules.append(sys.modules[driver.__module__])
        fn = functools.partial(driver, fn)
    module = sys.modules.get(getattr(fn if driver is None else fn.args[0], "__module__", None) or "")
    if module is not None and module.__name__ != "__main__" and _own_file(module):
        modules.append(module)  # a module of the course's users (a test, a script): by value, since the sandbox
    import cloudpickle          # may not import what that module imports

    modules = list({id(m): m for m in modules}.values())
    for mod in modules:
        cloudpickle.register_pickle_by_value(mod)
    try:
        return Sandboxed(_pickling.dumps(fn), name, what or name, allow, forbid,
                         tuple(os.path.realpath(f) for f in shared), arena)
    finally:
        for mod in modules:
            cloudpickle.unregister_pickle_by_value(mod)


def _own_file(module) -> bool:
    """Whether ``module`` is a file of the user's (not the standard library, an installed package or the course's
    own packages)."""
    import sysconfig

    file = getattr(module, "__file__", None)
    if not file:  # built-in modules (``builtins``: what code exec'd without a __name__ says it comes from)
        return False
    path = os.path.realpath(file)
    here = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    libraries = {os.path.realpath(p) for p in sysconfig.get_paths().values()}
    ours = (os.path.join(here, "labsupport", ""), os.path.join(here, "autograder", ""))
    return not path.startswith(ours) and not any(path.startswith(os.path.join(p, "")) for p in libraries)


# ---------------------------------------------------------------------------------------------------------------
# the host


_HOST = []


def _host(shared=()):
    """This worker's sandbox: forked at its first use and kept, like the worker, from task to task (a fork costs
    tens of milliseconds of CPU); at each new task it starts afresh as a task does in a worker (its process group,
    random state, environment and rank are the task's). A function with other ``shared`` folders than the kept
    sandbox's gets a new sandbox (Landlock's rules, once applied, can only be narrowed)."""
    from ._worker import CURRENT

    if _HOST and (not _HOST[0].alive() or _HOST[0].shared != tuple(shared)):
        close()
    if not _HOST:
        from ._sandbox_host import _Host

        _HOST.append(_Host(tuple(shared)))
    host = _HOST[0]
    if host.call_id != CURRENT.get("call_id"):
        host.new_task()
    return host


def close() -> None:
    """End this worker's sandbox and remove its folder."""
    while _HOST:
        _HOST.pop().stop()


def end_task() -> None:
    """At the end of each task: whatever the sandbox still holds of it (its process group) goes now."""
    if _HOST and _HOST[0].alive():
        _HOST[0].task_over()


def pid() -> int | None:
    """This worker's sandbox, while it lives (it is kept from task to task): its process id."""
    return _HOST[0].pid if _HOST and _HOST[0].alive() else None


def record() -> list:
    """This task's relayed requests so far, as the host saw them: ``(kind, peer, nbytes, posted, waited,
    cpu_posted, cpu_waited)`` each, times from ``time.perf_counter`` and the sandbox's CPU time in seconds (read from
    ``/proc``, outside the sandbox: work that really ran between a post and its wait shows there). Empty without a
    sandbox."""
    return [tuple(entry) for entry in _HOST[0].log] if _HOST else []


def cpu_seconds() -> float | None:
    """The CPU time this worker's sandbox has used so far (every thread), read from ``/proc``; None without one."""
    return _HOST[0].cpu() if _HOST and _HOST[0].alive() else None


def memory() -> dict | None:
    """This worker's sandbox's memory as the kernel counts it, read from ``/proc`` (bytes): ``rss`` now, ``peak``
    (the high-water mark since the last ``reset_peak``) and ``data`` (resident anonymous and shared memory: what
    tensors and objects hold, without the code pages loaded on first use); None without one. Transfers that are
    over are not counted: their pages in the memory the host shares with the sandbox go back to the kernel first."""
    return _HOST[0].memory() if _HOST and _HOST[0].alive() else None


def reset_peak() -> bool:
    """Start the sandbox's high-water mark again from its present resident size; False where that failed."""
    if _HOST and _HOST[0].alive():
        _HOST[0].trim()
        try:
            with open(f"/proc/{_HOST[0].pid}/clear_refs", "w") as fh:
                fh.write("5")
            return True
        except OSError:
            pass
    return False


def io() -> dict | None:
    """This worker's sandbox's input and output as the kernel counts them (``/proc/<pid>/io``: ``rchar``, every
    byte passed through ``read`` and its kind, files and its link to the host alike; ``wchar``...); None without
    one, or where the kernel keeps them from the host."""
    if not (_HOST and _HOST[0].alive()):
        return None
    try:
        with open(f"/proc/{_HOST[0].pid}/io") as fh:
            return {k: int(v) for k, v in (line.split(":") for line in fh if ":" in line)}
    except (OSError, ValueError):
        return None


def refusals() -> list:
    """What this task's sandbox was refused so far (read by the host, for a check that wants the list)."""
    return list(_HOST[0].refused) if _HOST else []
