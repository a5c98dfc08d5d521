"""Notebook 07_fsdp's helpers: the parameter-memory recorder (``ParamMemory``), a demo model, the ring traffic of
counted calls, and the figures (``plots``).

Example::

    from labsupport.lessons import fsdp as lesson
    mem = lesson.ParamMemory(model, units=dict(model.module.named_children()))
    with mem:
        loss_fn(model(x), y).backward()
    lesson.plot_param_memory({"rank 0": mem.samples}, bound=...)
"""

from .memory import ParamMemory, held_bytes, reachable_tensors
from .plots import plot_fsdp_schedule, plot_param_memory, plot_shards
from .demo import DemoNet, ring_bytes_sent, unit_bytes

__all__ = ["ParamMemory", "held_bytes", "reachable_tensors", "plot_fsdp_schedule", "plot_param_memory",
           "plot_shards", "DemoNet", "ring_bytes_sent", "unit_bytes", "fully_shard"]


def fully_shard(module, **kwargs):
    """PyTorch's FSDP2 ``fully_shard(module, mesh=..., ...)``: ``torch.distributed.fsdp.fully_shard`` from torch 2.6,
    and its first, private home in torch 2.4 and 2.5 (the course accepts torch 2.4)."""
    try:
        from torch.distributed.fsdp import fully_shard as shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard as shard
    return shard(module, **kwargs)
