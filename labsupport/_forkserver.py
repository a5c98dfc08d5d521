"""multiprocessing's fork server, as labsupport uses it: what it preloads, where its socket lives, how a server
started by someone else (the grader's) is shared, and how it is stopped.

The server imports torch once, before any thread pool exists, and forks every worker (``labsupport._pool``).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys

_MAX_SOCKET_PATH = 104  # bytes of a Unix socket's path, on Linux (108) and macOS (104)


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _mp_tempdir_inside(tmpdir: str) -> None:
    """Make multiprocessing keep its temporary files (the fork server's listener socket) inside the pool's folder.

    Left to itself, it makes a ``pymp-*`` folder in /tmp, which a kernel that is killed (or shut down by force)
    never removes. Inside the pool's folder, ``shutdown`` removes it, and so does the next pool once this kernel is
    gone. Files multiprocessing made before stay where they are. A folder whose path is too long for a Unix socket
    (a long TMPDIR) is not used for this.
    """
    from multiprocessing import process

    if len(os.fsencode(tmpdir)) + len("/listener-12345678") < _MAX_SOCKET_PATH:
        process.current_process()._config["tempdir"] = tmpdir


def _forget_mp_tempdir(tmpdir: str) -> None:
    """After the pool's folder is gone: multiprocessing makes a new temporary folder when it next needs one."""
    from multiprocessing import process

    config = process.current_process()._config
    if config.get("tempdir") == tmpdir:
        config["tempdir"] = None


def _preload() -> list:
    """What the fork server imports before it forks anyone: labsupport's worker (and torch with it) and, in a
    notebook kernel, ``torch._dynamo``. The first optimizer, DTensor or FSDP a worker builds imports the latter
    (about 800 modules, 3 s of CPU); imported once in the server, every worker inherits it. A notebook starts the
    server in the background when it imports labsupport, so nobody waits for it there; a script's first call does
    not pay for it. ``LABSUPPORT_PRELOAD_DYNAMO=0/1`` overrides."""
    setting = os.environ.get("LABSUPPORT_PRELOAD_DYNAMO", "")
    heavy = setting == "1" if setting in ("0", "1") else "ipykernel" in sys.modules
    return ["labsupport._worker"] + (["torch._dynamo"] if heavy else [])


#: ``"<pid>:<socket path>"`` of a running fork server to fork workers from instead of starting one (the grader
#: starts one per grading process and shares it between the kernel and the judge of each notebook).
SHARED_SERVER_ENV = "LABSUPPORT_FORK_SERVER"


def _shared_server() -> tuple[int, str] | None:
    pid, sep, path = os.environ.get(SHARED_SERVER_ENV, "").partition(":")
    if not sep or not pid.isdigit() or not os.path.exists(path) or not _owner_alive(int(pid)):
        return None
    try:  # a server that died but was not reaped yet still answers kill(pid, 0)
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                return None
    except (OSError, IndexError):
        pass
    return int(pid), path


def _adopt_shared_server() -> None:
    """Fork workers from the server named by ``LABSUPPORT_FORK_SERVER`` while it runs.

    multiprocessing only talks to a fork server it started itself: its ``ForkServer`` keeps the server's address,
    its pid (to notice that it died) and the write end of the pipe that keeps it alive, which every worker
    inherits. Adopting a server means setting the address, giving the workers a harmless descriptor instead of
    that pipe (the server's owner holds the real one), and checking before each start that the server still
    runs. Once it has gone, this process starts a server of its own, as without the variable. Nothing here
    runs in the server: a worker's task still comes from this process only.
    """
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    shared = _shared_server()
    if shared is None or server._forkserver_pid is not None or getattr(server, "_labsupport_shared", False):
        return
    own_ensure_running = type(server).ensure_running

    def ensure_running():
        if server._forkserver_address == shared[1] and _shared_server() == shared:
            resource_tracker.ensure_running()
            return
        with server._lock:  # the shared server is gone: back to a server of our own
            if server._forkserver_address == shared[1]:
                server._forkserver_address = None
                os.close(server._forkserver_alive_fd)
                server._forkserver_alive_fd = None
        server.ensure_running = lambda: own_ensure_running(server)
        own_ensure_running(server)

    with server._lock:
        server._forkserver_address = shared[1]
        server._forkserver_alive_fd = os.open(os.devnull, os.O_WRONLY)
        server.ensure_running = ensure_running
        server._labsupport_shared = True


def forget_inherited_server() -> None:
    """In a process made by a plain fork of a shared server's owner: treat the server as shared, not as its own.

    multiprocessing copied the owner's record of the server, so it would take the server for its own child (and
    fail waiting for it). Forgetting that record makes ``_mp_context`` adopt the server through
    ``LABSUPPORT_FORK_SERVER``, as a kernel does. The copy of the owner's "alive" pipe stays open: the server runs
    as long as this process does.
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_pid is not None:
        server._forkserver_pid = None
        server._forkserver_address = None
        server._forkserver_alive_fd = None


def start_quietly() -> None:
    """Start multiprocessing's fork server (unless it runs) where no interrupt reaches it before it ignores them.

    jupyter_client interrupts a kernel's whole process group (the fork server is in it) before it shuts the kernel
    down or restarts it, and Ctrl-C interrupts a script's. The server ignores SIGINT once it serves, but first it
    starts an interpreter and imports its preload (torch: seconds); interrupted then, it ended with a
    KeyboardInterrupt traceback on the kernel's stderr, and the next ``run`` with an EOFError. So it is started as
    multiprocessing starts its resource tracker, with SIGINT blocked in the starting thread: the block survives
    exec, and an interrupt sent meanwhile waits until the server ignores SIGINT, which discards it. Processes forked
    from the server inherit the block (a worker ignores SIGINT and lifts it: ``_worker.main``).
    """
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - Windows
        server.ensure_running()
        return
    resource_tracker.ensure_running()  # first: starting the tracker unblocks SIGINT in this thread on its way out
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        server.ensure_running()  # (the instance's: it may be a shared server's)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def start_shared_server(folder: str, extra_preload=()) -> str:
    """Start a fork server in this process for others to share; returns the ``LABSUPPORT_FORK_SERVER`` value.

    It preloads torch._dynamo too (every kernel and judge that uses it may need it) and the modules named in
    ``extra_preload`` (what the processes forked from it besides workers import), keeps its listener socket in
    ``folder``, and stops when this process (and every process forked from it since) ends, or calls
    ``_stop_forkserver``.
    """
    from multiprocessing import forkserver, process

    process.current_process()._config["tempdir"] = folder
    saved = os.environ.get("LABSUPPORT_PRELOAD_DYNAMO")
    os.environ["LABSUPPORT_PRELOAD_DYNAMO"] = "1"
    try:
        with _NoMainImport():
            _mp_context().set_forkserver_preload(_preload() + list(extra_preload))
            server = forkserver._forkserver
            start_quietly()  # a Ctrl-C of the grading command during its start: no traceback from the server
    finally:
        if saved is None:
            os.environ.pop("LABSUPPORT_PRELOAD_DYNAMO", None)
        else:
            os.environ["LABSUPPORT_PRELOAD_DYNAMO"] = saved
    return f"{server._forkserver_pid}:{server._forkserver_address}"


def _mp_context():
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_preload())
        if os.environ.get(SHARED_SERVER_ENV):
            _adopt_shared_server()
        return ctx
    return multiprocessing.get_context("spawn")  # pragma: no cover - Windows


class _NoMainImport:
    """While starting a worker, keep multiprocessing from re-importing the notebook's or script's main module.

    Functions travel by value, so workers never need ``__main__``; importing it again would run a script's
    top-level code (and its ``labsupport.run`` calls) once more inside every worker.
    """

    def __enter__(self):
        import multiprocessing.spawn as spawn

        self._spawn = spawn
        self._orig = spawn.get_preparation_data

        def prep(name, _orig=self._orig):
            data = _orig(name)
            for key in ("init_main_from_name", "init_main_from_path", "main_path"):
                data.pop(key, None)
            return data

        spawn.get_preparation_data = prep
        return self

    def __exit__(self, *exc):
        self._spawn.get_preparation_data = self._orig


def _stop_forkserver(wait: float = 5.0) -> None:
    """Stop multiprocessing's fork server (it holds a copy of torch in memory) and its resource tracker.

    Both restart by themselves when needed. The server is killed (see below). The tracker ends once every process
    holding its pipe has closed it, and a process forked from the server keeps the copy it was given; a tracker
    still running after ``wait`` seconds would make this wait forever, so it is killed then.
    """
    try:
        from multiprocessing import forkserver, resource_tracker

        # the server has nothing to save (its socket goes with the pool's folder), and letting it end by itself
        # means tearing down its torch, up to a second: it is killed at once
        _stop_within(forkserver._forkserver, getattr(forkserver._forkserver, "_forkserver_pid", None), 0.0)
        tracker = resource_tracker._resource_tracker
        _stop_within(tracker, getattr(tracker, "_pid", None), wait)
    except Exception:
        pass


def _stop_within(helper, pid, wait: float) -> None:
    """``helper._stop()`` (it closes the helper's pipe and waits for the process ``pid``), killing it after ``wait``
    seconds (at once for 0). The process is our child and is not reaped before ``_stop`` returns, so its pid is no
    one else's."""
    import threading

    if pid is None or not hasattr(helper, "_stop"):
        return

    def kill():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass

    if wait <= 0:
        kill()
        helper._stop()
        return
    timer = threading.Timer(wait, kill)
    timer.daemon = True
    timer.start()
    try:
        helper._stop()
    finally:
        timer.cancel()


def _inside_fork_server() -> bool:
    """True while multiprocessing's fork server imports labsupport (its preload): it must not start another one."""
    main = getattr(sys.modules.get("multiprocessing.forkserver"), "main", None)
    code = getattr(main, "__code__", None)
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _wants_early_start() -> bool:
    """``LABSUPPORT_EARLY_START``: "1" always, "0" never; unset: only in a notebook kernel that no launcher started
    (under torchrun every rank imports labsupport, and none of them needs a fork server). Never inside the fork
    server itself, which inherits the setting and imports labsupport to preload it."""
    if _inside_fork_server():
        return False
    setting = os.environ.get("LABSUPPORT_EARLY_START", "")
    if setting in ("0", "1"):
        return setting == "1"
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_PROCID" in os.environ or "RANK" in os.environ
    return "ipykernel" in sys.modules and not launched
