"""Start ``torch.distributed`` workers from a notebook cell: ``labsupport.run``.

Design, in short:

* Workers are forked from a fork server that imported torch once, before any OpenMP thread pool existed, so a
  kernel that already ran parallel torch ops, or initialised CUDA, cannot poison them (forking the kernel itself
  can hang on GNU OpenMP). The same path works on Linux, macOS and Python 3.14.
* Workers live on between calls (a small pool owned by the launcher), so a call costs milliseconds, not the
  seconds of importing torch again. Each call gets a fresh process group, so a stale message from an earlier
  call can never be received by a later one.
* Functions travel by value (cloudpickle), so functions and classes defined in the notebook work.
* Any failure (an exception, a dead rank, a time-out, an interrupt) kills every worker of that call: a process
  group with a rank stuck in ``recv`` cannot be repaired, only replaced. The next call starts fresh workers.
"""

from __future__ import annotations

import atexit
import linecache
import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

try:
    import cloudpickle
except ImportError:  # pragma: no cover
    cloudpickle = pickle

__all__ = ["run", "shutdown", "device", "WorkerError", "WorkerTimeout", "in_worker"]

MAX_WORLD_SIZE = 64
#: Lines of output shown per rank and call before the rest is counted and dropped.
MAX_LINES_PER_RANK = int(os.environ.get("LABSUPPORT_MAX_LINES", "1000"))
_FAILURE_GRACE = 0.4  # seconds to collect the other ranks' errors after the first failure
_STARTUP_TIMEOUT = 180.0


class WorkerError(RuntimeError):
    """One or more ranks failed: raised an exception, or died.

    Attributes:
        rank: the first rank that failed.
        ranks: every rank that failed, in rank order.
        exc_type: name of the original exception type on ``rank`` (``None`` if the rank died without one).
        exc_message: its message.
        worker_traceback: its traceback as text, with source lines from the notebook.
        exitcode: the exit code of a rank that died (negative: killed by that signal), else ``None``.
        failures: a dict per failed rank with the same fields.

    Example::

        try:
            labsupport.run(work, world_size=4)
        except labsupport.WorkerError as err:
            print(err.rank, err.exc_type, err.exc_message)
            print(err.worker_traceback)     # points at the line of your cell that raised
    """

    def __init__(self, message: str, failures: list[dict]):
        super().__init__(message)
        self.failures = failures
        first = failures[0]
        self.rank = first["rank"]
        self.ranks = [f["rank"] for f in failures]
        self.exc_type = first.get("type")
        self.exc_message = first.get("message")
        self.worker_traceback = first.get("traceback", "")
        self.exitcode = first.get("exitcode")


class WorkerTimeout(TimeoutError):
    """Ranks were still running after ``timeout`` seconds, usually a deadlock.

    Attributes:
        ranks: the ranks that were still running.
        stacks: ``{rank: stack text}``, where each of them was blocked.
        timeout: the time limit in seconds.

    Example::

        try:
            labsupport.run(work, world_size=2, timeout=5)
        except labsupport.WorkerTimeout as err:
            print(err.ranks)                # the ranks that never finished
            print(err.stacks[0])            # where rank 0 was waiting
    """

    def __init__(self, message: str, ranks: list[int], stacks: dict[int, str], timeout: float):
        super().__init__(message)
        self.ranks = ranks
        self.stacks = stacks
        self.timeout = timeout


# ----------------------------------------------------------------------------------------------------------------
# Inside a worker


def in_worker() -> bool:
    """True inside a rank started by ``labsupport.run``."""
    from . import _worker

    return bool(_worker.CURRENT)


def device():
    """The device this rank should put its tensors on.

    ``cuda:LOCAL_RANK`` when the process group uses NCCL, else the CPU. Outside any worker, the CPU.

    Example::

        def work():
            x = torch.ones(3, device=labsupport.device())
            dist.all_reduce(x)
            return x
    """
    import torch

    from . import _worker

    if _worker.CURRENT:
        return _worker.CURRENT["device"]
    try:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    except Exception:
        pass
    return torch.device("cpu")


# ----------------------------------------------------------------------------------------------------------------
# The pool


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _loopback_ifname() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def _mp_context():
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["labsupport._worker"])
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


@dataclass
class _Worker:
    index: int
    process: object
    conn: object
    stack_file: str
    pid: int = 0
    main_ident: int = 0
    dead: bool = False

    def alive(self) -> bool:
        return not self.dead and self.process.is_alive()

    def kill(self) -> None:
        if self.dead:
            return
        self.dead = True
        try:
            os.kill(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass
        self.process.join(timeout=5)
        try:
            self.conn.close()
        except OSError:
            pass
        try:
            self.process.close()
        except ValueError:
            pass


@dataclass
class _Pool:
    workers: dict = field(default_factory=dict)  # index -> _Worker
    store: object = None
    tmpdir: str | None = None
    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def port(self) -> int:
        if self.store is None:
            import torch.distributed as dist

            self.store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
        return self.store.port

    def ensure(self, n: int) -> list[_Worker]:
        """Return workers 0..n-1, starting the missing ones (in parallel)."""
        if self.tmpdir is None:
            self.tmpdir = tempfile.mkdtemp(prefix="labsupport-")
        ctx = _mp_context()
        starting = []
        with _NoMainImport():
            for i in range(n):
                w = self.workers.get(i)
                if w is not None and w.alive():
                    continue
                if w is not None:
                    w.kill()
                from . import _worker

                parent_conn, child_conn = ctx.Pipe(duplex=True)
                stack_file = os.path.join(self.tmpdir, f"stack-{i}.txt")
                open(stack_file, "w").close()
                proc = ctx.Process(
                    target=_worker.main, args=(child_conn, stack_file), daemon=True, name=f"labsupport-worker-{i}"
                )
                proc.start()
                child_conn.close()
                w = _Worker(i, proc, parent_conn, stack_file)
                self.workers[i] = w
                starting.append(w)
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        for w in starting:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not w.alive() and not w.conn.poll(0):
                    self.kill(starting)
                    raise RuntimeError(
                        "labsupport could not start its worker processes "
                        f"(worker {w.index} {'did not answer' if left <= 0 else 'exited at start-up'}). "
                        "Check that `python -c 'import torch'` works in this environment, then run the cell again."
                    )
                if w.conn.poll(min(left, 0.5)):
                    msg = pickle.loads(w.conn.recv_bytes())
                    if msg[0] == "hello":
                        w.pid, w.main_ident = msg[1], msg[2]
                        break
        return [self.workers[i] for i in range(n)]

    def kill(self, workers) -> None:
        for w in workers:
            w.kill()
            if self.workers.get(w.index) is w:
                del self.workers[w.index]

    def shutdown(self) -> None:
        for w in list(self.workers.values()):
            try:
                w.conn.send_bytes(pickle.dumps(("exit",)))
            except OSError:
                pass
        for w in list(self.workers.values()):
            w.process.join(timeout=2)
        self.kill(list(self.workers.values()))
        self.store = None
        _stop_forkserver()
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


def _stop_forkserver() -> None:
    """Stop multiprocessing's fork server (it holds a copy of torch in memory) and its resource tracker.

    Both restart by themselves when needed.
    """
    try:
        from multiprocessing import forkserver, resource_tracker

        server = forkserver._forkserver
        if getattr(server, "_forkserver_pid", None) is not None and hasattr(server, "_stop"):
            server._stop()
        tracker = resource_tracker._resource_tracker
        if getattr(tracker, "_pid", None) is not None and hasattr(tracker, "_stop"):
            tracker._stop()
    except Exception:
        pass


_POOL = _Pool()


def shutdown() -> None:
    """Stop the idle worker processes that ``labsupport.run`` keeps between calls.

    Safe to call at any time; the next ``run`` starts new workers. Called automatically when Python exits.

    Example::

        labsupport.run(work, world_size=8)
        labsupport.shutdown()               # give the memory of the 8 idle workers back
    """
    with _POOL.lock:
        _POOL.shutdown()


atexit.register(shutdown)


# ----------------------------------------------------------------------------------------------------------------
# Formatting what went wrong


def _display_name(filename: str) -> str:
    """'Cell In[5]' for a notebook cell, the path otherwise."""
    try:
        from IPython import get_ipython

        ip = get_ipython()
        count = getattr(getattr(ip, "compile", None), "_filename_map", {}).get(filename)
        if count is not None:
            return f"Cell In[{count}]"
    except Exception:
        pass
    return filename


def _is_internal(filename: str) -> bool:
    here = os.path.dirname(os.path.abspath(__file__))
    return (
        filename.startswith(os.path.join(here, "_worker.py"))
        or f"{os.sep}multiprocessing{os.sep}" in filename
        or filename == os.path.join(here, "launch.py")
    )


def _is_torch(filename: str) -> bool:
    return f"{os.sep}torch{os.sep}" in filename


def _format_frames(frames) -> tuple[str, str]:
    """Return (traceback text, one-line summary) for frames [(filename, lineno, name, line)], outermost first."""
    frames = [f for f in frames if not _is_internal(f[0]) and f[0] != "<string>"]
    lines = []
    torch_run: list = []
    last_user = None

    def flush_torch():
        if torch_run:
            lines.append(f"  ... inside torch: {' -> '.join(fr[2] for fr in torch_run[-2:])}")
            torch_run.clear()

    for filename, lineno, name, line in frames:
        if _is_torch(filename):
            torch_run.append((filename, lineno, name))
            continue
        flush_torch()
        src = (line or linecache.getline(filename, lineno)).strip()
        lines.append(f'  File "{_display_name(filename)}", line {lineno}, in {name}')
        if src:
            lines.append(f"    {src}")
        last_user = (filename, lineno, name, src)
    innermost_torch = torch_run[-1][2] if torch_run else None
    flush_torch()
    if last_user is None:
        summary = f"in {innermost_torch}" if innermost_torch else "(no Python frame)"
    else:
        filename, lineno, name, src = last_user
        where = f"{_display_name(filename)}, line {lineno}"
        summary = (f"blocked in {innermost_torch}, at " if innermost_torch else "at ") + f"{where}: {src}"
    return "\n".join(lines), summary


_THREAD_RE = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME_RE = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def _parse_faulthandler(text: str, main_ident: int):
    """Frames of the main thread from a faulthandler dump, outermost first."""
    sections: dict[int, list] = {}
    current = None
    for line in text.splitlines():
        m = _THREAD_RE.match(line)
        if m:
            current = int(m.group(1), 16)
            sections[current] = []
            continue
        m = _FRAME_RE.match(line)
        if m and current is not None:
            sections[current].append((m.group(1), int(m.group(2)), m.group(3), None))
    frames = sections.get(main_ident)
    if frames is None and sections:
        frames = next(iter(sections.values()))
    return list(reversed(frames or []))


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _death_message(code) -> str:
    if code is None:
        return "stopped without a result"
    if code < 0:
        name = _signal_name(code)
        hint = {
            "SIGKILL": "killed from outside, often by the out-of-memory killer",
            "SIGSEGV": "a segmentation fault in native code",
            "SIGABRT": "aborted by native code (a failed C++ check)",
            "SIGBUS": "a bus error in native code",
        }.get(name, "killed by a signal")
        return f"died from {name} ({hint})"
    return f"exited with code {code} without raising an exception (os._exit or a C extension calling exit)"


_CONNECTION_ERRORS = ("Connection closed by peer", "Read error", "Connection reset", "Broken pipe", "Socket closed")


def _is_consequence(failure: dict) -> bool:
    """A gloo connection error: what a rank sees when a peer died or was stopped, not a cause."""
    msg = failure.get("message") or ""
    return failure.get("type") == "RuntimeError" and any(e in msg for e in _CONNECTION_ERRORS)


# ----------------------------------------------------------------------------------------------------------------
# run


def _adopt_slurm_environment() -> None:
    """Under ``srun``, derive torchrun's variables from SLURM's (MASTER_ADDR/MASTER_PORT must be exported)."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2:
        return
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["NODE_RANK"] = env.get("SLURM_NODEID", "0")
    if "SLURM_NTASKS_PER_NODE" in env:
        env["LOCAL_WORLD_SIZE"] = env["SLURM_NTASKS_PER_NODE"].split("(")[0]


def _launched_by_torchrun() -> bool:
    _adopt_slurm_environment()
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _gpu_count() -> int:
    import torch

    # is_available()/device_count() query the driver without initialising CUDA in this process.
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _resolve_backend(backend: str, world_size: int) -> str:
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    if backend == "gloo":
        return backend
    gpus = _gpu_count()
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size}, but this machine has {gpus} GPU(s). "
            "Use backend='auto' (gloo on the CPU when there are not enough GPUs) or a smaller world_size."
        )
    return "nccl" if gpus >= world_size else "gloo"


def _run_under_torchrun(fn, args, kwargs):
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", 0))
        use_nccl = torch.cuda.is_available() and torch.cuda.device_count() > local
        if use_nccl:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if use_nccl else "gloo")
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return [fn(*args, **kwargs)]


def _check_args(fn, world_size, timeout):
    if not callable(fn):
        raise TypeError(f"labsupport.run needs a function to run on every rank, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be between 1 and {MAX_WORLD_SIZE}, got {world_size}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def run(fn, *args, world_size: int = 4, backend: str = "auto", timeout: float = 60.0, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results in rank order.

    Each rank is a separate process with the default process group initialised and the environment torchrun
    would give it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``). ``fn`` may be defined in the notebook. Prints appear in the cell as they happen, prefixed
    ``[rank N]``.

    Args:
        fn: the function every rank runs.
        world_size: number of ranks (processes).
        backend: ``"auto"`` (NCCL with one GPU per rank when there are enough GPUs, else gloo on the CPU),
            ``"gloo"`` or ``"nccl"``.
        timeout: seconds before the ranks still running are stopped and ``WorkerTimeout`` is raised.

    Raises:
        WorkerError: a rank raised an exception (the other ranks are stopped) or died.
        WorkerTimeout: ranks still running after ``timeout`` seconds; the message shows where each was blocked.

    Warning:
        Arguments and results are copied between processes: a rank changing a tensor it received does not change
        the notebook's tensor; return what you want to see.

    Inside an initialised process group (a script started by ``torchrun``), ``run`` just calls ``fn`` and returns
    ``[result]`` for this rank, so the same code runs unchanged on a cluster.

    Example::

        import torch, torch.distributed as dist, labsupport

        def work():
            x = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(x)
            return x.item()

        labsupport.run(work, world_size=4)   # [6.0, 6.0, 6.0, 6.0]
    """
    import torch.distributed as dist

    _check_args(fn, world_size, timeout)
    if dist.is_available() and dist.is_initialized():
        return [fn(*args, **kwargs)]
    if _launched_by_torchrun():
        return _run_under_torchrun(fn, args, kwargs)
    backend = _resolve_backend(backend, world_size)
    try:
        payload = cloudpickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"labsupport.run could not send {getattr(fn, '__name__', fn)!r} and its arguments to the workers: {exc}. "
            "Arguments must be picklable (tensors, numbers, lists, modules, functions); open files, locks and "
            "generators are not."
        ) from exc
    with _POOL.lock:
        return _Call(_POOL, world_size, backend, timeout).run(payload)


class _Call:
    """One call of ``run``: send the task, relay output, collect results or failures."""

    def __init__(self, pool: _Pool, world_size: int, backend: str, timeout: float):
        self.pool = pool
        self.n = world_size
        self.backend = backend
        self.timeout = float(timeout)
        self.results: dict[int, object] = {}
        self.failures: dict[int, dict] = {}
        self.shown = [0] * world_size
        self.hidden = [0] * world_size
        self.partial = [""] * world_size

    # output ---------------------------------------------------------------------------------------------------
    def _emit(self, rank: int, stream: str, text: str) -> None:
        target = sys.stdout if stream == "stdout" else sys.stderr
        text = self.partial[rank] + text
        lines = text.split("\n")
        self.partial[rank] = lines.pop()  # '' when text ended with a newline
        out = []
        for line in lines:
            if self.shown[rank] < MAX_LINES_PER_RANK:
                self.shown[rank] += 1
                out.append(f"[rank {rank}] {line}\n")
            else:
                self.hidden[rank] += 1
        if out:
            target.write("".join(out))
            target.flush()

    def _flush_output(self) -> None:
        for rank in range(self.n):
            if self.partial[rank]:
                self._emit(rank, "stdout", "\n")
            if self.hidden[rank]:
                sys.stdout.write(
                    f"[rank {rank}] ... {self.hidden[rank]} more lines not shown "
                    f"(at most {MAX_LINES_PER_RANK} lines per rank are shown)\n"
                )
        sys.stdout.flush()

    # messages -------------------------------------------------------------------------------------------------
    def _handle(self, rank: int, msg) -> None:
        kind = msg[0]
        if len(msg) > 1 and msg[1] != self.call_id:
            return
        if kind == "out":
            self._emit(rank, msg[2], msg[3])
        elif kind == "result":
            try:
                self.results[rank] = pickle.loads(msg[2])
            except Exception as exc:
                self.failures[rank] = {
                    "rank": rank,
                    "type": type(exc).__name__,
                    "message": f"the result could not be rebuilt in the notebook: {exc}",
                    "traceback": "",
                }
        elif kind == "error":
            err = msg[2]
            text, summary = _format_frames(err["frames"])
            self.failures[rank] = {
                "rank": rank,
                "type": err["type"],
                "message": err["message"],
                "traceback": text,
                "summary": summary,
                "where": err["where"],
                "exception": err.get("exception"),
            }

    def _drain(self, w: _Worker) -> None:
        try:
            while w.conn.poll(0):
                self._handle(w.index, pickle.loads(w.conn.recv_bytes()))
        except (EOFError, OSError):
            pass

    # the call -------------------------------------------------------------------------------------------------
    def run(self, payload: bytes):
        pool = self.pool
        workers = pool.ensure(self.n)
        pool.calls += 1
        self.call_id = pool.calls
        port = pool.port()
        extra_env = {}
        ifname = _loopback_ifname()
        if ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
            extra_env["GLOO_SOCKET_IFNAME"] = ifname
        spec = {
            "world_size": self.n,
            "backend": self.backend,
            "master_addr": "127.0.0.1",
            "master_port": port,
            "pg_timeout": self.timeout + 60.0,
            "threads": max(1, _cores() // self.n),
            "call_id": self.call_id,
            "cwd": os.getcwd(),
            "sys_path": list(sys.path),
            "extra_env": extra_env,
        }
        finished = False
        try:
            for w in workers:
                w.conn.send_bytes(
                    pickle.dumps(("task", self.call_id, dict(spec, rank=w.index), payload), protocol=5)
                )
            self._wait(workers)
            finished = True
        finally:
            if not finished or self.failures:
                pool.kill(workers)  # an interrupt, a failure or a time-out: these workers cannot be trusted
            self._flush_output()
        for w in workers:
            w.conn.send_bytes(pickle.dumps(("finish", self.call_id)))
        return [self.results[r] for r in range(self.n)]

    def _wait(self, workers) -> None:
        start = time.monotonic()
        deadline = start + self.timeout
        first_failure = None
        by_conn = {w.conn: w for w in workers}
        by_sentinel = {w.process.sentinel: w for w in workers}
        while True:
            running = [w for w in workers if w.index not in self.results and w.index not in self.failures]
            if not running:
                break
            now = time.monotonic()
            if first_failure is not None and now - first_failure > _FAILURE_GRACE:
                break
            if now >= deadline:
                self._timeout(running, workers)
            waitables = [w.conn for w in running] + [w.process.sentinel for w in running]
            ready = mpc.wait(waitables, timeout=min(0.1, max(0.0, deadline - now)))
            for obj in ready:
                if obj in by_conn:
                    self._drain(by_conn[obj])
            for obj in ready:
                w = by_sentinel.get(obj)
                if w is not None and w.index not in self.results and w.index not in self.failures:
                    self._drain(w)
                    if w.index not in self.results and w.index not in self.failures:
                        w.process.join(timeout=1)
                        code = w.process.exitcode
                        self.failures[w.index] = {
                            "rank": w.index,
                            "type": None,
                            "message": _death_message(code),
                            "exitcode": code,
                            "traceback": "",
                        }
            if self.failures and first_failure is None:
                first_failure = time.monotonic()
        if self.failures:
            self._raise_failures()

    def _raise_failures(self):
        # A rank that dies makes its peers' gloo calls fail with connection errors: those are consequences.
        failures = sorted(self.failures.values(), key=lambda f: (_is_consequence(f), f["rank"]))
        first = failures[0]
        heads = []
        for f in failures:
            if f["type"] is None:
                heads.append(f"rank {f['rank']} {f['message']}")
            elif _is_consequence(f) and not _is_consequence(first):
                heads.append(f"rank {f['rank']} then lost its connection to the failed rank")
                f["traceback"] = ""
            else:
                where = f" while {f['where']}" if f.get("where") not in (None, "running your function") else ""
                heads.append(f"rank {f['rank']} raised {f['type']}: {f['message']}{where}")
        parts = ["; ".join(heads)]
        for f in failures:
            if f.get("traceback"):
                parts.append(f"\nTraceback on rank {f['rank']} (most recent call last):\n{f['traceback']}")
                parts.append(f"{f['type']}: {f['message']}")
        others = sorted(set(range(self.n)) - set(self.failures) - set(self.results))
        if others:
            parts.append(f"\nRanks {others} were stopped.")
        err = WorkerError("\n".join(parts), failures)
        cause = None
        if first.get("exception"):
            try:
                cause = pickle.loads(first["exception"])
            except Exception:
                cause = None
        raise err from cause

    def _timeout(self, running, workers) -> None:
        stacks: dict[int, str] = {}
        summaries: dict[int, str] = {}
        for w in running:
            try:
                open(w.stack_file, "w").close()
                os.kill(w.process.pid, signal.SIGUSR1)
            except (OSError, TypeError):
                pass
        time.sleep(0.3)
        for w in running:
            try:
                with open(w.stack_file) as fh:
                    text = fh.read()
            except OSError:
                text = ""
            frames = _parse_faulthandler(text, w.main_ident)
            if frames:
                stacks[w.index], summaries[w.index] = _format_frames(frames)
            else:
                stacks[w.index], summaries[w.index] = "", "(its stack could not be read)"
        # the output that arrived meanwhile still belongs in the cell
        for w in workers:
            self._drain(w)
        ranks = [w.index for w in running]
        done = sorted(self.results)
        lines = [
            f"{len(ranks)} of {self.n} ranks were still running after {self.timeout:g} s: probably a deadlock "
            "(a rank waiting for a message that never comes). Where each one was:"
        ]
        for r in ranks:
            lines.append(f"  rank {r}: {summaries[r]}")
        if done:
            lines.append(f"  ranks {done} had finished.")
        for r in ranks:
            if stacks[r]:
                lines.append(f"\nStack of rank {r} (most recent call last):\n{stacks[r]}")
        lines.append(
            "\nEvery send needs a matching recv on the peer (same size, same order), and every rank must call the "
            "same collectives in the same order. All ranks were stopped; the next call starts fresh workers."
        )
        self.pool.kill(workers)
        raise WorkerTimeout("\n".join(lines), ranks, stacks, self.timeout)
