"""The sandbox's side of ``torch.distributed`` in grading: a process group whose every call is a request to the host.

In a sandbox (``labsupport._sandbox``) the default process group is a ``Relay``: ``dist.send``, ``dist.recv``,
their ``i`` forms, the collectives, the functional collectives and DTensor's redistribution all end in one of its
methods, which sends the request over the sandbox's only link to its host, with its tensors' bytes (a large one's
in the memory the two share, ``labsupport._arena``), and waits for the answer. The host performs the call on the real gloo group and records it; the sandbox has no other way to the other
ranks (no socket, no store). Nothing here decides points: it is the student's side of the boundary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.futures import Future

#: The backend's name in ``init_process_group``.
NAME = "labsupport_relay"


def raw(t: torch.Tensor) -> tuple:
    """A tensor as (dtype name, shape, bytes): how tensors cross the link, whatever their class."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return str(t.dtype).replace("torch.", ""), tuple(t.shape), data


def unraw(item) -> torch.Tensor:
    dtype, shape, data = item
    dtype = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _nbytes(item) -> int:
    """The bytes of a tensor as it crosses: carried in the message, or at a place in the arena."""
    from ._arena import _nbytes as of_shape

    dtype, shape, data = item
    return len(data) if isinstance(data, (bytes, bytearray)) else of_shape(getattr(torch, dtype), shape)


def put(arena, t: torch.Tensor) -> tuple:
    """A tensor as it crosses from the sandbox: in the arena (its place) when it is large and fits, else its bytes."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    offset = arena.take(t.numel() * t.element_size()) if arena is not None else None
    if offset is None:
        return raw(t)
    shape = tuple(t.shape)
    arena.view(offset, t.dtype, shape).copy_(t)
    return str(t.dtype).replace("torch.", ""), shape, offset


def tensor(arena, item) -> torch.Tensor:
    """What ``put`` or the host handed over, as a tensor: a view of the arena, or made from the bytes."""
    dtype, shape, data = item
    if isinstance(data, int) and arena is not None:
        return arena.view(data, getattr(torch, dtype), tuple(shape))
    return unraw(item)


def _fill(tensor_: torch.Tensor, item) -> None:
    with torch.no_grad():
        tensor_.copy_(tensor(_ARENA[0], item).to(tensor_.device).reshape(tensor_.shape))


class RelayWork(dist.Work):
    """What a relayed call returns: ``wait()`` asks the host to wait for the real request, then fills the outputs."""

    def __init__(self, relay, handle, outputs=(), then=None, sent=None):
        super().__init__()
        self._relay, self._handle, self._outputs, self._then = relay, handle, list(outputs), then
        self._sent = sent  # what an in-place all-reduce handed over: its tensors must hold it until wait()
        self._done = handle is None

    def wait(self, timeout=None):
        if not self._done:
            self._done = True
            try:
                data = self._relay.request("wait", self._handle)
                if self._sent is not None and any(raw(t)[2] != b for t, b in zip(self._outputs, self._sent)):
                    raise RuntimeError(
                        "the tensor of an all_reduce(..., async_op=True) was changed before its wait(): the "
                        "all-reduce writes its result into that tensor while it runs, so a change made before wait() "
                        "returns is mixed with the result or lost. Change it only after wait() (or before the "
                        "all_reduce call).")
                self.fill(data)
            finally:
                _arena_end()
        return True

    def fill(self, data) -> None:
        """The outputs from what the host answered."""
        for tensor, item in zip(self._outputs, data or ()):
            _fill(tensor, item)
        if self._then is not None:
            self._then(data)

    def is_completed(self):
        return self._done

    def get_future(self):
        self.wait()
        fut = Future()
        fut.set_result(self._outputs)
        return fut


def _blocking() -> bool:
    """Whether the ``torch.distributed`` call being made waits for its result (``dist.send``, ``dist.all_reduce``
    without ``async_op=True``): the host then makes the same blocking call, so that a deadlock report says
    "blocked in send(dst=1)" as it does on a worker."""
    from . import tap

    call, outermost = tap.current(), None
    while call is not None:  # the student's own call: torch's dist.recv itself calls dist.irecv
        if call.level == "api":
            outermost = call
        call = call.outer
    if outermost is None:
        return False
    call = outermost
    if call.name in ("send", "recv"):
        return True
    if call.name in ("isend", "irecv", "batch_isend_irecv"):
        return False
    return not call.kwargs.get("async_op", False)


def _op_name(op) -> str:
    for name in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"):
        if op == getattr(dist.ReduceOp, name):
            return name
    return "SUM"


class Relay(dist.ProcessGroup):
    """A process group of the sandbox; ``link`` sends requests to the host. ``ranks`` are the group's global ranks."""

    def __init__(self, link, rank: int, size: int, ranks: list[int], name: str):
        super().__init__(rank, size)
        self._link, self._ranks, self._size, self._name = link, list(ranks), size, name

    # -- plumbing
    def request(self, kind: str, *args):
        return self._link(kind, self._name, *args)

    def _async(self, kind, args, outputs=(), then=None, out_nbytes=None):
        """Send one request: ``args`` hold its tensors as ``put`` made them; the host creates the outputs in a
        place of the arena taken here (``out_nbytes``: their size, the outputs' own by default; 0 for a call that
        answers in its inputs' place)."""
        blocking = _blocking()
        if out_nbytes is None:
            out_nbytes = sum(t.numel() * t.element_size() for t in outputs)
        arena = _ARENA[0]
        start = arena.take(out_nbytes) if arena is not None and out_nbytes else None
        region = None if start is None else (start, start + out_nbytes)
        if arena is not None:
            arena.begin()
        try:
            answer = self.request(kind, blocking, region, *args)
        except BaseException:
            _arena_end()
            raise
        if not blocking:
            sent = [raw(t)[2] for t in outputs] if kind == "all_reduce" else None
            return RelayWork(self, answer, outputs, then, sent)
        work = RelayWork(self, None, outputs, then)
        try:
            work.fill(answer)
        finally:
            _arena_end()
        return work

    def _put(self, t):
        return put(_ARENA[0], t)

    def size(self):
        return self._size

    def getBackendName(self):
        return NAME

    @property
    def group_name(self):
        return self._name

    def __repr__(self):
        return f"labsupport relay group {self._name} of ranks {self._ranks}"

    # -- point to point (peers are group ranks)
    def send(self, tensors, dst, tag=0):
        return self._async("isend", (dst, tag, self._put(tensors[0])))

    def recv(self, tensors, src, tag=0):
        t = tensors[0]
        return self._async("irecv", (src, tag, str(t.dtype).replace("torch.", ""), tuple(t.shape)), [t])

    def recv_anysource(self, tensors, tag=0):
        raise RuntimeError("recv without src is not available in grading: name the rank you receive from")

    # -- collectives
    def allreduce(self, tensors, opts=None):
        op = _op_name(opts.reduceOp) if opts is not None else "SUM"
        return self._async("all_reduce", ([self._put(t) for t in tensors], op), tensors, out_nbytes=0)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        return self._async("broadcast", ([self._put(t) for t in tensors], root), tensors, out_nbytes=0)

    def reduce(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        op = _op_name(opts.reduceOp) if opts is not None else "SUM"
        return self._async("reduce", ([self._put(t) for t in tensors], root, op), tensors, out_nbytes=0)

    def allgather(self, output_lists, inputs, opts=None):
        outs = output_lists[0]
        return self._async("all_gather", (self._put(inputs[0]),), outs)

    def _allgather_base(self, output, input, opts=None):
        def fill(data):  # every rank's input, in rank order, one after the other
            with torch.no_grad():
                whole = torch.cat([tensor(_ARENA[0], d).reshape(-1) for d in data])
                output.copy_(whole.to(output.device).reshape(output.shape))

        nbytes = input.numel() * input.element_size() * self._size
        return self._async("all_gather", (self._put(input),), (), fill, out_nbytes=nbytes)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._allgather_base(o, i) for o, i in zip(outputs, inputs)]
        for w in works[:-1]:
            w.wait()
        return works[-1]

    def all_gather_single(self, output, input, opts=None):  # torch 2.13's name (all_gather_into_tensor)
        return self._allgather_base(output, input, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def gather(self, output_lists, inputs, opts=None):
        root = opts.rootRank if opts is not None else 0
        outs = output_lists[0] if output_lists else []
        return self._async("gather", (self._put(inputs[0]), root), outs)

    def scatter(self, outputs, input_lists, opts=None):
        root = opts.rootRank if opts is not None else 0
        chunks = [self._put(t) for t in input_lists[0]] if input_lists else None
        return self._async("scatter", (chunks, root, str(outputs[0].dtype).replace("torch.", ""),
                                       tuple(outputs[0].shape)), outputs)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op = _op_name(opts.reduceOp) if opts is not None else "SUM"
        sizes = [t.numel() for t in input_lists[0]]
        if len(sizes) != self._size or any(n != outputs[0].numel() for n in sizes):  # as gloo says it, on every rank
            raise ValueError(f"reduce_scatter: the output has {outputs[0].numel()} elements and the {len(sizes)} "
                             f"input chunks have {sizes}: give one chunk per rank, each the output's size")
        return self._async("reduce_scatter", ([self._put(t) for t in input_lists[0]], op), outputs)

    def _reduce_scatter_base(self, output, input, opts=None):
        op = _op_name(opts.reduceOp) if opts is not None else "SUM"
        if input.numel() != output.numel() * self._size:
            raise ValueError(f"reduce_scatter_tensor: the input has {input.numel()} elements, not the output's "
                             f"{output.numel()} times the group's {self._size} ranks")
        chunks = [self._put(t) for t in input.reshape(-1).tensor_split(self._size)]
        flat = output.reshape(-1)
        return self._async("reduce_scatter", (chunks, op), (), lambda data: _fill(flat, data[0]),
                           out_nbytes=output.numel() * output.element_size())

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        for w in works[:-1]:
            w.wait()
        return works[-1]

    def reduce_scatter_single(self, output, input, opts=None):  # torch 2.13's name (reduce_scatter_tensor)
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def alltoall(self, outputs, inputs, opts=None):
        return self._async("all_to_all", ([self._put(t) for t in inputs], [t.numel() for t in outputs]), outputs)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        n = self._size
        ins = (input.split(list(input_split_sizes)) if input_split_sizes else input.chunk(n))
        outs = (output.split(list(output_split_sizes)) if output_split_sizes else output.chunk(n))
        return self._async("all_to_all", ([self._put(t) for t in ins], [t.numel() for t in outs]), list(outs))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        # torch 2.13's ProcessGroup.all_to_all_single: defined here, or the tap's wrapper of the base class's method
        # is taken for an override and calls itself
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def barrier(self, opts=None):
        return self._async("barrier", ())


#: The sandbox's arena (``labsupport._arena``), shared with its host; None where tensors travel in messages only.
_ARENA: list = [None]


def _arena_end() -> None:
    if _ARENA[0] is not None:
        _ARENA[0].end()


def register(link, arena=None) -> None:
    """Make ``NAME`` a backend whose groups talk through ``link`` (called once, in the sandbox), its large tensors
    through ``arena``."""
    _ARENA[0] = arena
    def create(opts, _options=None):
        ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
        name = str(opts.group_id)
        if dist.is_initialized():  # a new group (the default one exists): the host makes the same one
            link("new_group", name, ranks)
        return Relay(link, opts.group_rank, opts.group_size, ranks, name)

    dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu"])
