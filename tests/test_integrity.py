"""Grading holds against code inside the student's own function on the workers.

Each cheat is written as a student would write it and compiled as the judge compiles a submission's cells (file
name ``<student code: ...>``); the real check then runs it on real workers, as the judge's workers do. Every check
runs the student's code in a sandbox behind its host (``labsupport/_sandbox.py``): there the recording, the check's
frames and objects and the grader are out of reach, a patch changes only the sandbox, and the built-in the cheat
falls back on is refused. Every cheat must lose its points, with a message that says why; the honest answer beside
it keeps them.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autograder.checks import collectives as C
from labsupport import tap

pytestmark = pytest.mark.slow

HONEST = '''
def all_reduce(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        dist.send(tensor, dst=0)
        dist.recv(tensor, src=0)
    else:
        buf = torch.empty_like(tensor)
        for r in range(1, n):
            dist.recv(buf, src=r)
            tensor += buf
        for r in range(1, n):
            dist.send(tensor, dst=r)
'''

CHEATS = {
    # the recording is reachable: delete what the built-in left in the check's counter
    "edits_the_recording": '''
def all_reduce(tensor):
    from labsupport import tap
    counters = [o for o in tap.observers() if type(o).__name__ == "CommCounter"]
    dist.all_reduce(tensor)
    for c in counters:
        c.summary.calls.clear()
''',
    # ... or stop every observer around the built-in call
    "unsubscribes_the_observers": '''
def all_reduce(tensor):
    from labsupport import tap
    everyone = tap.observers()
    for o in everyone:
        tap.unsubscribe(o)
    dist.all_reduce(tensor)
    for o in everyone:
        tap.subscribe(o)
''',
    # ... or put invented point-to-point records in place of the built-in's
    "invents_records": '''
def all_reduce(tensor):
    from labsupport import tap, CommCall
    counters = [o for o in tap.observers() if type(o).__name__ == "CommCounter"]
    dist.all_reduce(tensor)
    n, me = dist.get_world_size(), dist.get_rank()
    for c in counters:
        c.summary.calls[:] = [CommCall("send", (me + 1) % n, tuple(range(n)), tensor.numel() * 4),
                              CommCall("recv", (me - 1) % n, tuple(range(n)), tensor.numel() * 4)] * n
''',
    # the originals: the process group's own allreduce, taken from the wrapper's closure
    "calls_the_original": '''
def all_reduce(tensor):
    from torch._C._distributed_c10d import ProcessGroup, AllreduceOptions
    wrapper = ProcessGroup.allreduce
    original = getattr(wrapper, "__wrapped__", None)
    for cell in wrapper.__closure__ or ():
        if callable(cell.cell_contents) and cell.cell_contents is not wrapper:
            original = cell.cell_contents
    original(dist.group.WORLD, [tensor], AllreduceOptions()).wait()
''',
    # data through the rendezvous store, no collective at all
    "uses_the_store": '''
def all_reduce(tensor, _get_default_store=None):
    from torch.distributed import distributed_c10d as c10d
    store = getattr(c10d, "_get_default_store")()
    rank, n = dist.get_rank(), dist.get_world_size()
    store.set(f"t{rank}", tensor.numpy().tobytes())
    total = tensor.clone()
    for r in range(n):
        if r != rank:
            total += torch.frombuffer(bytearray(store.get(f"t{r}")), dtype=tensor.dtype).reshape(tensor.shape)
    tensor.copy_(total)
''',
    # the check's own inputs, read from its frames
    "reads_the_frames": '''
def all_reduce(tensor):
    import sys
    frame = sys._getframe(1)
    trial = frame.f_locals.get("trial")
    dist.all_reduce(tensor)
''',
    "reads_a_traceback": '''
def all_reduce(tensor):
    try:
        raise ValueError
    except ValueError as exc:
        frame = getattr(exc.__traceback__, "tb_frame")
    dist.all_reduce(tensor)
''',
    "walks_the_garbage_collector": '''
def all_reduce(tensor):
    import gc
    found = [o for o in gc.get_objects() if type(o).__name__ == "CommCounter"]
    dist.all_reduce(tensor)
''',
    # patch what the check compares with, then return a wrong answer
    "patches_torch": '''
def all_reduce(tensor):
    torch.allclose = lambda *args, **kwargs: True
    torch.equal = lambda *args, **kwargs: True
    tensor.zero_()
''',
    "patches_the_grader": '''
def all_reduce(tensor):
    from autograder.checks.collectives import probes
    probes._verdict = lambda *args, **kwargs: None
    tensor.zero_()
''',
    "opens_a_socket": '''
def all_reduce(tensor):
    import socket
    s = socket.socket()
    s.close()
    dist.all_reduce(tensor)
''',
}


def _student(source: str, name: str):
    namespace = {"dist": dist, "torch": torch}
    exec(compile(source, "<student code: answer>", "exec"), namespace)
    return namespace[name]


def test_the_honest_answer_keeps_its_points():
    C.check_all_reduce(_student(HONEST, "all_reduce"))


#: how each cheat ends in the sandbox: the built-in it falls back on is refused, the patch changed only the
#: sandbox (so the answer is wrong), the socket is refused, the store is the sandbox's own (nobody else writes it)
ENDS = {
    "edits_the_recording": "called torch.distributed.all_reduce", "invents_records": "called torch.distributed",
    "unsubscribes_the_observers": "called torch.distributed.all_reduce",
    "calls_the_original": "called torch.distributed.all_reduce", "uses_the_store": "did not finish",
    "reads_the_frames": "called torch.distributed.all_reduce", "reads_a_traceback": "called torch.distributed",
    "walks_the_garbage_collector": "called torch.distributed.all_reduce", "patches_torch": "rank 0's tensor: got",
    "patches_the_grader": "rank 0's tensor: got", "opens_a_socket": "PermissionError",
}


@pytest.mark.parametrize("cheat", sorted(CHEATS))
def test_each_cheat_loses_its_points(cheat):
    with pytest.raises(AssertionError) as info:
        C.check_all_reduce(_student(CHEATS[cheat], "all_reduce"), timeout=10)
    assert ENDS[cheat] in str(info.value), str(info.value)


def test_a_collective_nested_in_another_calls_argument_conversion_is_refused():
    """In the sandbox the conversion's collective is a request to the host like any other: refused by the rule."""
    with pytest.raises(AssertionError) as info:
        C.check_all_reduce(_student(NESTED, "all_reduce"), timeout=10)
    assert "called torch.distributed" in str(info.value) or " raised " in str(info.value), str(info.value)


NESTED = '''
class Sneaky:
    def __init__(self, tensor):
        self.tensor, self.done = tensor, False
    def __index__(self):  # the binding may convert an argument more than once
        if not self.done:
            self.done = True
            dist.all_reduce(self.tensor)
        return 0

def all_reduce(tensor):
    if dist.get_rank() == 1:
        dist.group.WORLD.send([torch.zeros(1)], Sneaky(tensor), 0).wait()
    if dist.get_rank() == 0:
        dist.all_reduce(tensor)
        dist.recv(torch.zeros(1), src=1)
'''


STORE_ONLY = '''
calls = []

def broadcast(tensor, src):
    import os
    calls.append(1)  # every rank calls it as often: the n-th call's key is the same everywhere
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    key = "b" + str(len(calls))
    if dist.get_rank() == src:
        store.set(key, tensor.numpy().tobytes())
    else:
        data = store.get(key)  # waits until src has set it
        tensor.copy_(torch.frombuffer(bytearray(data), dtype=tensor.dtype).reshape(tensor.shape))
    del store
'''


def test_data_moved_without_the_messages_it_needs_loses_the_points():
    """A store of its own: the sandbox has no socket to open it with (where seccomp is missing, the check still
    requires what a broadcast must receive in point-to-point messages)."""
    with pytest.raises(AssertionError) as info:
        C.check_broadcast(_student(STORE_ONLY, "broadcast"), timeout=8)
    assert "did not finish" in str(info.value) or "needs at least" in str(info.value), str(info.value)


def test_the_wrappers_hand_out_no_original():
    tap.install()
    from torch._C._distributed_c10d import ProcessGroup

    assert not hasattr(dist.all_reduce, "__wrapped__")
    assert not hasattr(dist.send, "__wrapped__")
    assert not hasattr(ProcessGroup.__dict__["allreduce"], "__wrapped__")


FAKE_OVERLAP = '''
import torch.nn as nn

class OverlapDDP(nn.Module):
    """A blocking all-reduce after backward, with invented records of all-reduces launched during backward."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.invented = []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._pretend)

    def _pretend(self, p):
        from labsupport import CommCall, tap
        for o in tap.observers():
            if type(o).__name__ == "CommCounter":
                call = CommCall("all_reduce", None, tuple(range(dist.get_world_size())), p.numel() * p.element_size())
                o.summary.calls.append(call)
                self.invented.append((o, call))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for o, call in self.invented:
            o.summary.calls.remove(call)
        self.invented.clear()
        for p in reversed(self.params):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()

    def no_sync(self):
        import contextlib
        return contextlib.nullcontext()
'''


def test_invented_records_do_not_make_a_blocking_ddp_overlap():
    """03: when each all-reduce was posted is read from the host's record, where the sandbox's invented records
    never arrive."""
    from autograder.checks import data_parallel as D

    with pytest.raises(AssertionError) as info:
        D.check_OverlapDDP(_student(FAKE_OVERLAP, "OverlapDDP"))
    assert "overlap" in str(info.value).lower() or "issued" in str(info.value), str(info.value)


def _solutions(aid: str) -> dict:
    """The notebook's set-up and solution cells, defined as the judge defines a submission's."""
    import nbformat

    from autograder.course import Course

    course = Course.at(Path(__file__).resolve().parent.parent)
    nb = nbformat.read(course.solutions / aid / f"{aid}.ipynb", as_version=4)
    namespace = {"__name__": "__main__"}  # as in the judge: the answers' module is the main one
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade_id") == "setup":
            source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith("%"))
            exec(compile(source, "<setup>", "exec"), namespace)
        elif cell.cell_type == "code" and meta.get("solution") and not meta.get("grade"):
            exec(compile(cell.source, f"<student code: {meta['grade_id']}>", "exec"), namespace)
    return namespace


def test_tensor_parallel_answer_that_patches_torch_changes_only_its_sandbox():
    """04, on the layout of two groups (the only configuration with ``group`` set): a reduce_from_tp that replaces
    torch.allclose and torch.equal and returns a wrong sum. The patch changes only its sandbox: the host compares
    with its own torch, and the answer loses its points there."""
    from autograder.checks import tensor_parallel as TP

    namespace = _solutions("04_tensor_parallel")
    exec(compile("_honest = reduce_from_tp\n"
                 "def reduce_from_tp(x, group=None):\n"
                 "    if group is None:\n"
                 "        return _honest(x, group)\n"
                 "    torch.allclose = lambda *args, **kwargs: True\n"
                 "    torch.equal = lambda *args, **kwargs: True\n"
                 "    return _honest(x, group) + 1\n", "<student code: cheat>", "exec"), namespace)
    with pytest.raises(AssertionError) as info:
        TP.check_reduce_from_tp(namespace["reduce_from_tp"])
    assert "tensor-parallel groups of 2" in str(info.value) and "expected" in str(info.value), str(info.value)
    TP.check_reduce_from_tp(_solutions("04_tensor_parallel")["reduce_from_tp"])


def test_zero_answer_that_reads_the_checks_frames_finds_only_the_driver():
    """06: the optimizer runs in the sandbox, where the frames above its step are the grader's driver's: nothing of
    the check is there. A step that peeks and keeps its answer right is graded as right; one that peeks and skips
    the update loses the points on the host's own comparison."""
    from autograder.checks import zero as Z

    peek = ("import inspect\n"
            "def _peek():\n"
            "    frame = inspect.currentframe().f_back.f_back\n"
            "    while frame is not None:\n"
            "        frame.f_locals.pop('expected', None)\n"
            "        frame = frame.f_back\n")
    namespace = _solutions("06_zero")
    exec(compile(peek + "class Peeking(ShardedOptimizer):\n"
                 "    def step(self, *args, **kwargs):\n"
                 "        _peek()\n"
                 "        return super().step(*args, **kwargs)\n"
                 "class PeekingIdle(ShardedOptimizer):\n"
                 "    def step(self, *args, **kwargs):\n"
                 "        _peek()\n", "<student code: cheat>", "exec"), namespace)
    Z.check_ShardedOptimizer(namespace["Peeking"])
    with pytest.raises(AssertionError) as info:
        Z.check_ShardedOptimizer(namespace["PeekingIdle"])
    assert "differs from the unsharded" in str(info.value) or "step" in str(info.value), str(info.value)


STORE_RING = '''
calls = []

def ring_all_gather(chunk):
    import os
    calls.append(1)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    rank, n = dist.get_rank(), dist.get_world_size()
    store.set(f"g{len(calls)}-{rank}", chunk.contiguous().numpy().tobytes())
    out = []
    for r in range(n):
        data = store.get(f"g{len(calls)}-{r}")
        out.append(torch.frombuffer(bytearray(data), dtype=chunk.dtype).reshape(chunk.shape).clone())
    del store
    return out
'''


def test_a_ring_that_moves_its_data_through_a_store_of_its_own_loses_the_points():
    """02: the ring checks require what each rank must receive in send/recv, as 01's do."""
    from autograder.checks import ring_allreduce as R

    with pytest.raises(AssertionError) as info:
        R.check_ring_all_gather(_student(STORE_RING, "ring_all_gather"), timeout=8)
    assert "did not finish" in str(info.value) or "needs at least" in str(info.value), str(info.value)
