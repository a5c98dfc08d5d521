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

from . import _pickling
from ._call import _Call
from ._env import _launched_by_torchrun, _local_cuda_index, _resolve_backend, _run_under_torchrun
from ._output import MAX_LINES_PER_RANK, MAX_PARTIAL_LINE  # noqa: F401  (their documented home)
from ._pool import _POOL, shutdown
from .errors import KeyboardInterrupt as Interrupted
from .errors import WorkerError, WorkerTimeout, interrupted_message, unpicklable_message
from .i18n import _

__all__ = ["run", "shutdown", "device", "WorkerError", "WorkerTimeout", "in_worker"]

MAX_WORLD_SIZE = 64


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


def _check_args(fn, world_size, timeout):
    if not callable(fn):
        raise TypeError(_("labsupport.run needs a function to run on every rank, got {type}").format(
            type=type(fn).__name__))
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(_("world_size must be an int, got {value}").format(value=repr(world_size)))
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(_("world_size must be between 1 and {most}, got {value}").format(most=MAX_WORLD_SIZE,
                                                                                          value=world_size))
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(_("timeout must be a positive number of seconds, got {value}").format(value=repr(timeout)))


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
        payload = _pickling.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(unpicklable_message(fn, exc)) from exc
    with _POOL.lock:
        call = _Call(_POOL, world_size, backend, timeout)
        try:
            return call.run(payload)
        except KeyboardInterrupt:
            # one line instead of a traceback through multiprocessing and selectors
            raise Interrupted(interrupted_message(world_size, call.stopped)) from None
