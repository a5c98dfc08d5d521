"""Where ``labsupport.run`` finds itself: under torchrun or srun (then it runs nothing itself), and which backend
its workers get (NCCL with one GPU per rank, else gloo), found without initialising CUDA in the notebook.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from datetime import timedelta

from .errors import torchrun_failed_message
from .i18n import _

_GPU_PROBE_TIMEOUT = 60.0  # seconds for a separate Python process to count the GPUs


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
        raise ValueError(_("backend must be 'auto', 'gloo' or 'nccl', not {backend}").format(backend=repr(backend)))
    if backend == "gloo":
        return backend
    gpus = _gpu_count()
    if backend == "nccl" and gpus < world_size:
        raise ValueError(_(
            "backend='nccl' needs one GPU per rank: world_size={world_size}, but this machine has {gpus} GPU(s). "
            "Use backend='auto' (gloo on the CPU when there are not enough GPUs) or a smaller world_size."
        ).format(world_size=world_size, gpus=gpus))
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
            raise RuntimeError(torchrun_failed_message(timeout, exc)) from exc
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return [fn(*args, **kwargs)]
