"""What a ``torch.distributed`` call is, in ``CommCounter``'s words: its kind (the name a student knows), the peer
of a send or recv (a global rank), the group's global ranks, and the bytes of this rank's data.

The tables say which calls ``labsupport.tap`` intercepts at each level; ``describe`` reads a ``tap.Call``. No torch
at import time (``labsupport.comm`` takes its names from here).
"""

from __future__ import annotations

#: The kinds a from-scratch collective may use.
POINT_TO_POINT = frozenset({"send", "recv"})

#: process-group (and backend) method -> the torch.distributed name a student knows
PG_KINDS = {
    "send": "send",
    "recv": "recv",
    "recv_anysource": "recv",
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "allgather": "all_gather",
    "_allgather_base": "all_gather_into_tensor",
    "all_gather_single": "all_gather_into_tensor",
    "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor",
    "gather": "gather",
    "scatter": "scatter",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "all_to_all_single": "all_to_all_single",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
}

# Methods whose first argument is the rank's data; every other one is called as (output, input, ...).
_DATA_FIRST = frozenset({"send", "recv", "recv_anysource", "allreduce", "allreduce_coalesced", "broadcast", "reduce",
                         "barrier", "monitored_barrier"})

#: The torch.distributed functions wrapped at the "api" level.
API_CALLS = ("send", "recv", "isend", "irecv", "broadcast", "reduce", "gather", "scatter", "all_reduce", "all_gather",
             "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
             "barrier", "batch_isend_irecv")

#: functional op (in torch.ops._c10d_functional and _c10d_functional_autograd) -> kind. Their first argument is the
#: rank's data, their last the group's name; isend/irecv take the global peer second.
FUNCTIONAL_KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather_into_tensor",
    "all_gather_into_tensor_out": "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced": "all_gather_into_tensor",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_tensor_out": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
    "all_to_all_single": "all_to_all_single",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
    "isend": "send",
    "irecv": "recv",
}




def nbytes_of(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(nbytes_of(x) for x in obj)
    return 0


_RANKS: dict = {}  # id(group) -> (group, its global ranks): asking torch costs tens of microseconds per call


def _group_ranks(pg) -> tuple:
    cached = _RANKS.get(id(pg))
    if cached is not None and cached[0] is pg:
        return cached[1]
    ranks = _find_group_ranks(pg)
    if len(_RANKS) > 64:  # each call of labsupport.run makes new groups: forget the old ones
        _RANKS.clear()
    _RANKS[id(pg)] = (pg, ranks)
    return ranks


def _find_group_ranks(pg) -> tuple:
    import torch.distributed as dist

    try:
        return tuple(dist.get_process_group_ranks(pg))
    except Exception:
        pass
    for group in _groups():  # a backend object: the ranks of the group it belongs to
        try:
            if any(group._get_backend(dev) is pg for dev in group._device_types):
                return tuple(dist.get_process_group_ranks(group))
        except Exception:
            continue
    try:
        return tuple(range(pg.size()))
    except Exception:
        return ()


def _groups() -> list:
    try:
        from torch.distributed import distributed_c10d as c10d

        return list(c10d._world.pg_map)
    except Exception:  # pragma: no cover
        return []


def _global_rank(pg, group: tuple, group_rank):
    import torch.distributed as dist

    try:
        return dist.get_global_rank(pg, int(group_rank))
    except Exception:
        pass
    try:
        return group[int(group_rank)] if group else int(group_rank)
    except (IndexError, TypeError, ValueError):
        return None


def _method_data(method: str, args: tuple, kwargs: dict):
    """The tensor(s) that are this rank's data in a process-group call (see ``CommCall.nbytes``)."""
    if method in _DATA_FIRST:
        return args[0] if args else kwargs.get("tensors")
    if len(args) >= 2:
        return args[1]
    return next((v for k, v in kwargs.items() if k.startswith("input")), None)


def describe(call) -> tuple:
    """(kind, peer, group ranks, nbytes) of a ``tap.Call``."""
    level, name, args, kwargs = call.level, call.name, call.args, call.kwargs
    if level in ("pg", "backend"):
        kind = PG_KINDS[name]
        group = _group_ranks(call.target)
        peer = None
        if kind in POINT_TO_POINT and name != "recv_anysource" and len(args) >= 2:
            peer = _global_rank(call.target, group, args[1])
        return kind, peer, group, nbytes_of(_method_data(name, args, kwargs))
    if level == "functional":
        kind = FUNCTIONAL_KINDS[name]
        group_name = kwargs.get("group_name", args[-1] if args else None)
        group = ()
        if isinstance(group_name, str):
            try:
                from torch.distributed.distributed_c10d import _resolve_process_group

                group = _group_ranks(_resolve_process_group(group_name))
            except Exception:
                group = ()
        peer = None
        if kind in POINT_TO_POINT and len(args) >= 2:
            try:
                peer = int(args[1])
            except (TypeError, ValueError):
                peer = None
        data = args[0] if args else kwargs.get("input", kwargs.get("inputs"))
        return kind, peer, group, nbytes_of(data)
    return (name if level == "api" else None), None, (), 0
