"""Start ``torch.distributed`` workers from a notebook cell: ``labsupport.run``.

Design, in short:

* Workers are forked from a fork server that imported torch once, before any OpenMP thread pool existed, so a
  kernel that already ran parallel torch ops, or initialised CUDA, cannot poison them (forking the kernel itself
  can hang on GNU OpenMP). The same path works on Linux, macOS and Python 3.14.
* Workers live on between calls (a small pool owned by the launcher), so a call costs milliseconds, not the
  seconds of importing torch again. Each call gets a fresh process group, so a stale message from an earlier
  call can never be received by a later one.
* Functions travel by value (cloudpickle), so functions and classes defined in the notebook work.
* Each call starts like a fresh process where that is cheap: the notebook's current environment variables,
  torch's default random seed, float32 as the default dtype.
* Any failure (an exception, a dead rank, a time-out, an interrupt) kills every worker of that call: a process
  group with a rank stuck in ``recv`` cannot be repaired, only replaced. The next call starts fresh workers.
* A deadlock report says what each rank waits for, with the values of its arguments ("blocked in recv(src=1)"):
  every worker posts the torch.distributed call it is inside on a small shared "call board" (see ``_callboard``).
"""

from __future__ import annotations

import atexit
import multiprocessing.connection as mpc
import os
import pickle
import signal
import subprocess
import sys
import time
from datetime import timedelta

try:
    import cloudpickle
except ImportError:  # pragma: no cover
    cloudpickle = pickle

from ._output import MAX_LINES_PER_RANK, MAX_PARTIAL_LINE, RankOutput
from ._pool import _POOL, _cores, _loopback_ifname, _Pool, _Worker, shutdown
from .errors import KeyboardInterrupt as Interrupted
from .errors import (
    WorkerError,
    WorkerTimeout,
    _death_message,
    _dump_complete,
    _format_frames,
    _is_consequence,
    _parse_faulthandler,
)

__all__ = ["run", "shutdown", "device", "WorkerError", "WorkerTimeout", "in_worker"]

MAX_WORLD_SIZE = 64
_FAILURE_GRACE = 0.4  # seconds to collect the other ranks' errors after the first failure
_STACK_WAIT = 2.0  # at most this long for the stack dumps of deadlocked ranks
_GPU_PROBE_TIMEOUT = 60.0  # seconds for a separate Python process to count the GPUs


# ----------------------------------------------------------------------------------------------------------------
# Inside a worker


def in_worker() -> bool:
    """True inside a rank started by ``labsupport.run``.

    Example::

        def work():
            return labsupport.in_worker()

        labsupport.in_worker()                  # False: this is the notebook
        labsupport.run(work, world_size=2)      # [True, True]
    """
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
            return torch.device("cuda", _local_cuda_index())
    except Exception:
        pass
    return torch.device("cpu")


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


#: GPUs counted without initialising CUDA in this process, per value of CUDA_VISIBLE_DEVICES.
_GPU_COUNTS: dict = {}


def _cuda_compiled() -> bool:
    import torch

    is_compiled = getattr(torch.cuda, "_is_compiled", None)
    return bool(is_compiled()) if is_compiled is not None else torch.backends.cuda.is_built()


def _gpu_count() -> int:
    """How many GPUs the workers could use, found without initialising CUDA in the notebook's kernel.

    ``torch.cuda.is_available()`` and ``torch.cuda.device_count()`` call ``cudaGetDeviceCount``, which initialises
    the CUDA driver in the calling process (unless PYTORCH_NVML_BASED_CUDA_CHECK=1 is set): the kernel would hold
    a driver state it never uses, which is not safe to fork and may take memory on every GPU. So: no CUDA in this
    torch build, no GPU; CUDA already initialised here (the notebook used it), ask it; else count with NVML (which
    honours CUDA_VISIBLE_DEVICES); and when NVML cannot tell, let a short-lived Python process count. The answer is
    kept, so the separate process runs at most once per value of CUDA_VISIBLE_DEVICES.
    """
    import torch

    if not _cuda_compiled():
        return 0
    if torch.cuda.is_initialized():
        return torch.cuda.device_count()
    key = os.environ.get("CUDA_VISIBLE_DEVICES")
    if key not in _GPU_COUNTS:
        count = _nvml_gpu_count()
        _GPU_COUNTS[key] = count if count >= 0 else _gpu_count_in_subprocess()
    return _GPU_COUNTS[key]


def _nvml_gpu_count() -> int:
    """GPUs visible to this process according to NVML, without initialising CUDA; -1 when NVML cannot tell."""
    import torch

    try:
        return int(torch.cuda._device_count_nvml())
    except Exception:
        return -1


def _gpu_count_in_subprocess() -> int:
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True,
            text=True,
            timeout=_GPU_PROBE_TIMEOUT,
        )
        return max(0, int(out.stdout.split()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0  # no answer: gloo on the CPU always works


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


def _local_cuda_index() -> int | None:
    """The GPU of this process under a launcher: ``LOCAL_RANK``, or the only visible one when the launcher binds
    one GPU per task (SLURM's ``--gpus-per-task=1``); ``None`` when there is no GPU for it.

    Only called in a process that took itself for a rank started by torchrun or srun (``_run_under_torchrun``, or
    ``device()`` once an NCCL group exists), where CUDA may be used. Counting with ``_gpu_count`` still leaves CUDA
    alone until ``set_device``: RANK & co. may be in the environment of a notebook by mistake, and that kernel
    should not end up with CUDA initialised merely because the call failed.
    """
    count, local = _gpu_count(), int(os.environ.get("LOCAL_RANK", "0"))
    if count == 0:
        return None
    if local < count:
        return local
    return 0 if count == 1 else None


def _run_under_torchrun(fn, args, kwargs, timeout: float):
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        index = _local_cuda_index()
        if index is not None:
            torch.cuda.set_device(index)
        try:
            # torch's default is 30 minutes: variables left in the environment by mistake would hang the cell
            dist.init_process_group("nccl" if index is not None else "gloo", timeout=timedelta(seconds=timeout))
        except Exception as exc:
            raise RuntimeError(_torchrun_failed_message(timeout, exc)) from exc
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return [fn(*args, **kwargs)]


def _torchrun_failed_message(timeout: float, exc: Exception) -> str:
    env = os.environ
    found = ", ".join(f"{k}={env[k]}" for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k in env)
    return (
        f"labsupport.run found {found} in the environment, so it took this process for rank {env.get('RANK', '?')} "
        f"of a job started by torchrun (or srun), but the other ranks did not join within {timeout:g} s "
        f"({type(exc).__name__}: {exc}). If you did not start this script with torchrun, remove these variables "
        "from the environment (for example `del os.environ['RANK']`) and run it again: labsupport.run then starts "
        "its own workers."
    )


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
    ``[rank N]``. Every call starts as a freshly started process would: it sees the notebook's environment
    variables as they are now, ``torch.randn`` draws the same numbers as in a new process, the default dtype is
    float32.

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
    __tracebackhide__ = True  # IPython shows the student's cell, not the launcher's frames
    import torch.distributed as dist

    _check_args(fn, world_size, timeout)
    if dist.is_available() and dist.is_initialized():
        return [fn(*args, **kwargs)]
    if _launched_by_torchrun():
        return _run_under_torchrun(fn, args, kwargs, timeout)
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
        call = _Call(_POOL, world_size, backend, timeout)
        try:
            return call.run(payload)
        except KeyboardInterrupt:
            # one line instead of a traceback through multiprocessing and selectors
            raise Interrupted(_interrupted_message(world_size, call.stopped)) from None


def _interrupted_message(world_size: int, stopped: bool) -> str:
    if stopped:
        return f"interrupted: all {world_size} ranks stopped" if world_size > 1 else "interrupted: the rank was stopped"
    return "interrupted after the ranks had finished"


class _Call:
    """One call of ``run``: send the task, relay output, collect results or failures."""

    def __init__(self, pool: _Pool, world_size: int, backend: str, timeout: float):
        self.pool = pool
        self.n = world_size
        self.backend = backend
        self.timeout = float(timeout)
        self.results: dict[int, object] = {}
        self.failures: dict[int, dict] = {}
        self.output = RankOutput(world_size)
        self.stopped = False  # this call's workers were killed (a failure, a time-out, an interrupt)

    # output ---------------------------------------------------------------------------------------------------
    def _emit(self, rank: int, stream: str, text: str) -> None:
        self.output.emit(rank, stream, text)

    def _flush_output(self) -> None:
        self.output.flush()

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
    def _spec(self) -> dict:
        extra_env = {}
        ifname = _loopback_ifname()
        if ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
            extra_env["GLOO_SOCKET_IFNAME"] = ifname
        return {
            "world_size": self.n,
            "backend": self.backend,
            "master_addr": "127.0.0.1",
            "master_port": self.pool.port(),
            "pg_timeout": self.timeout + 60.0,
            "threads": max(1, _cores() // self.n),
            "call_id": self.call_id,
            "cwd": os.getcwd(),
            "sys_path": list(sys.path),
            "environ": dict(os.environ),  # as a freshly started process would see it now
            "extra_env": extra_env,
        }

    def run(self, payload: bytes):
        __tracebackhide__ = True
        pool = self.pool
        workers = pool.ensure(self.n)
        pool.calls += 1
        self.call_id = pool.calls
        spec = self._spec()
        done = False
        try:
            for w in workers:
                w.conn.send_bytes(
                    pickle.dumps(("task", self.call_id, dict(spec, rank=w.index), payload), protocol=5)
                )
            self._wait(workers)
            self._send_finish(workers)
            done = True
        finally:
            # not done: an interrupt, a failure or a time-out; these workers cannot be trusted any more. Once done,
            # every worker has its "finish", so an interrupt from here on leaves nothing behind.
            if not done:
                self._kill(workers)
                self.stopped = True
            self._flush_output()
        return [self.results[r] for r in range(self.n)]

    def _send_finish(self, workers) -> None:
        """Tell every worker to destroy this call's process group (it then waits for the next task)."""
        for w in workers:
            try:
                w.conn.send_bytes(pickle.dumps(("finish", self.call_id)))
            except OSError:  # it died after sending its result: the next call starts a new one
                self.pool.kill([w])

    def _kill(self, workers) -> None:
        """Kill this call's workers, even when a second Ctrl-C arrives while they are being killed."""
        try:
            self.pool.kill(workers)
        except KeyboardInterrupt:
            self.pool.kill(workers)
            raise

    def _wait(self, workers) -> None:
        __tracebackhide__ = True
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
            wait_until = deadline if first_failure is None else min(deadline, first_failure + _FAILURE_GRACE)
            waitables = [w.conn for w in running] + [w.process.sentinel for w in running]
            ready = mpc.wait(waitables, timeout=min(0.1, max(0.0, wait_until - now)))
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
        __tracebackhide__ = True
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
        if first.get("exception"):
            try:
                err.exception = pickle.loads(first["exception"])
            except Exception:
                pass
        # no chained header: the rank's exception has no traceback here, its text and frames are in the message
        raise err from None

    def _dump_stacks(self, running) -> dict[int, str]:
        """Every running rank's stacks: SIGUSR1 makes faulthandler write them to the rank's stack file.

        Waits until each dump is complete (its main thread reaches the outermost frame, or the file stopped
        growing), at most ``_STACK_WAIT`` seconds: eight ranks on a loaded machine can take longer than any fixed
        pause, and a half-written dump would lose the frames that matter most (the outer ones, the student's).
        """
        for w in running:
            try:
                open(w.stack_file, "w").close()
                os.kill(w.process.pid, signal.SIGUSR1)
            except (OSError, TypeError, ValueError):
                pass
        texts = {w.index: "" for w in running}
        unchanged = {w.index: 0 for w in running}
        pending = list(running)
        deadline = time.monotonic() + _STACK_WAIT
        while pending and time.monotonic() < deadline:
            time.sleep(0.02)
            for w in list(pending):
                try:
                    with open(w.stack_file) as fh:
                        text = fh.read()
                except OSError:
                    text = ""
                unchanged[w.index] = unchanged[w.index] + 1 if text and text == texts[w.index] else 0
                texts[w.index] = text
                if text and (_dump_complete(text, w.main_ident) or unchanged[w.index] >= 3):
                    pending.remove(w)
        return texts

    def _timeout(self, running, workers) -> None:
        __tracebackhide__ = True
        calls = {w.index: w.current_call() for w in running}
        texts = self._dump_stacks(running)
        stacks: dict[int, str] = {}
        summaries: dict[int, str] = {}
        for w in running:
            call = calls[w.index] or w.current_call()
            frames = _parse_faulthandler(texts[w.index], w.main_ident)
            if frames:
                stacks[w.index], summaries[w.index] = _format_frames(frames, call)
            else:
                stacks[w.index] = ""
                summaries[w.index] = f"blocked in {call} (its stack could not be read)" if call else (
                    "(its stack could not be read)"
                )
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
        self._kill(workers)
        self.stopped = True
        raise WorkerTimeout("\n".join(lines), ranks, stacks, self.timeout) from None
