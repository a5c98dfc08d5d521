"""Where the method is the point of an exercise (overlap in 10, traffic in 01 and 02, buckets and overlap in 03,
shards in 04, 06 and 07), its visible test checks the method as the hidden checks do, with what a student can see
(``CommCounter``, the lesson modules' recorders), so that what passes the visible test is not taken away in grading
for how it was done. For each such check: a planted wrong method that the visible test now rejects, with a message
that names the likely cause, and the solution that it accepts.

The notebook's own cells run in this process, as in ``test_notebook_measurements.py``: the setup cell, every answer
cell (the solution; the planted method is defined after it, in its place), the cells that define what the visible
test uses, then the visible-test cell itself.
"""

from pathlib import Path

import matplotlib
import nbformat
import pytest

matplotlib.use("Agg")

SOLUTIONS = Path(__file__).resolve().parent.parent / "solutions"


def _python(source: str) -> str:
    """A cell's source without IPython's magic lines."""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("%"))


def _grade_id(cell) -> str:
    return cell.metadata.get("nbgrader", {}).get("grade_id", "")


def _cells(aid: str) -> list:
    return nbformat.read(SOLUTIONS / aid / f"{aid}.ipynb", as_version=4).cells


def solution(aid: str, name: str) -> str:
    """The solution's answer cell of exercise ``name``."""
    return next(c.source for c in _cells(aid) if _grade_id(c) == name)


def plant(source: str, old: str, new: str) -> str:
    """``source`` with its one ``old`` replaced by ``new``: a wrong method one change away from the solution."""
    assert source.count(old) == 1, old
    return source.replace(old, new)


def visible(aid: str, test: str, planted: str | None = None, uses: tuple = ()) -> str | None:
    """Run the visible-test cell ``test`` of ``aid`` after the setup, every solution, ``planted`` (if given) and the
    cells holding each string of ``uses``; None when it passes, else its AssertionError's message."""
    cells = _cells(aid)
    ns = {"__name__": "__main__"}   # functions defined here travel to the workers by value, as from a notebook
    exec(_python(next(c.source for c in cells if _grade_id(c) == "setup")), ns)
    for c in cells:
        if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution"):
            exec(c.source, ns)
    for marker in uses:
        exec(_python(next(c.source for c in cells if c.cell_type == "code" and marker in c.source)), ns)
    if planted is not None:
        exec(planted, ns)
    try:
        exec(_python(next(c.source for c in cells if _grade_id(c) == test)), ns)
    except AssertionError as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------------------------------------------------------
# 10_overlap: each ring step's transfer posted before the product it hides behind, waited for after it

OVERLAP = "10_overlap"
AGM = solution(OVERLAP, "allgather_matmul")
MRS = solution(OVERLAP, "matmul_reduce_scatter")
ZZ = solution(OVERLAP, "zigzag_ring_attention")

#: the transfer waited for right after it is posted, before the product it should hide behind
AGM_WAITS = plant(AGM, "            in_flight = [dist.isend(here.contiguous(), to, group=group), "
                       "dist.irecv(incoming, frm, group=group)]\n",
                  "            in_flight = [dist.isend(here.contiguous(), to, group=group), "
                  "dist.irecv(incoming, frm, group=group)]\n"
                  "            for transfer in in_flight:\n                transfer.wait()\n"
                  "            in_flight = []\n")       # (waiting twice on a gloo send never returns)
#: the chunk multiplied first, the next transfer posted (and waited for) after it: the fixture's mutant
AGM_LATE = """def allgather_matmul(x_shard, weight, group=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    n, here = x_shard.shape[0], x_shard
    out = x_shard.new_empty(world * n, weight.shape[0])
    for step in range(world):
        src = (rank - step) % world
        out[src * n:(src + 1) * n] = here @ weight.T
        if step < world - 1:
            incoming = torch.empty_like(x_shard)
            reqs = [dist.isend(here, (rank + 1) % world), dist.irecv(incoming, (rank - 1) % world)]
            for r in reqs:
                r.wait()
            here = incoming
    return out
"""
#: the ring gathers every chunk first, then one product of the whole input
AGM_ONE_PRODUCT = """def allgather_matmul(x_shard, weight, group=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    parts, here = [None] * world, x_shard
    for step in range(world):
        parts[(rank - step) % world] = here
        if step < world - 1:
            incoming = torch.empty_like(x_shard)
            reqs = [dist.isend(here, (rank + 1) % world), dist.irecv(incoming, (rank - 1) % world)]
            for r in reqs:
                r.wait()
            here = incoming
    return torch.cat(parts) @ weight.T
"""


def _waits_at_once(source: str, post: str, indent: str) -> str:
    """``source`` with each step's transfer waited for right after ``post`` posts it (and not again later: waiting
    twice on a gloo send never returns)."""
    return plant(source, post, post + f"{indent}for transfer in in_flight:\n{indent}    transfer.wait()\n"
                                      f"{indent}in_flight = []\n")


MRS_WAITS = _waits_at_once(MRS, "        in_flight = [dist.isend(acc, to, group=group), "
                                "dist.irecv(incoming, frm, group=group)]\n", "        ")
ZZ_WAITS = _waits_at_once(ZZ, "            in_flight = [dist.isend(kv, to, group=group), "
                              "dist.irecv(incoming, frm, group=group)]\n", "            ")
#: every rank's k and v gathered by the built-in all_gather, then causal attention at this rank's positions
ZZ_GATHERED = """def zigzag_ring_attention(q, k, v, group=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    c = q.shape[1] // 2
    ks, vs = [torch.empty_like(k) for _ in range(world)], [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(ks, k.contiguous())
    dist.all_gather(vs, v.contiguous())
    pos = [torch.tensor(lesson.zigzag_positions(world, r, c)) for r in range(world)]
    mask = pos[rank][:, None] >= torch.cat(pos)[None, :]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), torch.cat(ks, 1).transpose(1, 2), torch.cat(vs, 1).transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)
"""


@pytest.mark.parametrize("test, planted, says", [
    ("test_allgather_matmul_visible", AGM_WAITS,
     "rank 0 waited for the send of ring step 1 before matrix product 1: post the next isend/irecv before the "
     "product and wait after it."),
    ("test_allgather_matmul_visible", AGM_LATE,
     "rank 0 ran matrix product 1 before posting the send of ring step 1: post the next isend/irecv first"),
    ("test_allgather_matmul_visible", AGM_ONE_PRODUCT, "rank 0 ran 1 matrix product(s): one per chunk (3 of 2 rows)"),
    ("test_matmul_reduce_scatter_visible", MRS_WAITS,
     "rank 0 waited for the send of ring step 1 before matrix product 2: post the next isend/irecv before the "
     "product and wait after it."),
    ("test_zigzag_ring_attention_visible", ZZ_WAITS,
     "rank 0's send of ring step 1 had no block product running while it was in flight"),
    ("test_zigzag_ring_attention_visible", ZZ_GATHERED,
     "rank 0 sent 0 bytes: the ring passes its k and v (256 bytes) on to the next rank twice"),
], ids=["agm-waits-first", "agm-posts-late", "agm-one-product", "mrs-waits-first", "zz-waits-first",
        "zz-all-gather"])
def test_10_visible_tests_see_the_overlap(test, planted, says):
    said = visible(OVERLAP, test, planted)
    assert said is not None and said.startswith(says), said


@pytest.mark.parametrize("test", ["test_allgather_matmul_visible", "test_matmul_reduce_scatter_visible",
                                  "test_zigzag_ring_attention_visible"])
def test_10_visible_tests_accept_the_solution(test):
    assert visible(OVERLAP, test) is None


# ---------------------------------------------------------------------------------------------------------------
# 01_collectives: the data travels in send/recv messages

COLLECTIVES = "01_collectives"
#: right for the visible test's inputs (rank r holds r), with nothing sent: the data never travelled
BROADCAST_NO_MESSAGE = """def broadcast(tensor, src):
    tensor.fill_(float(src))
"""
ALL_TO_ALL_NO_MESSAGE = """def all_to_all(chunks):
    rank = dist.get_rank()
    return [torch.tensor([10 * i + rank]) for i in range(dist.get_world_size())]
"""


@pytest.mark.parametrize("test, planted, says", [
    ("test_broadcast_visible", BROADCAST_NO_MESSAGE,
     "rank 0 received 0 bytes in send/recv, but rank 1's tensor is 24 bytes: the data got there some other way"),
    ("test_all_to_all_visible", ALL_TO_ALL_NO_MESSAGE,
     "rank 0 received 0 bytes in send/recv, but the chunks the 2 other ranks send it are 8 bytes each"),
], ids=["broadcast", "all_to_all"])
def test_01_visible_tests_see_the_traffic(test, planted, says):
    said = visible(COLLECTIVES, test, planted)
    assert said is not None and said.startswith(says), said


# ---------------------------------------------------------------------------------------------------------------
# 02_ring_allreduce: neighbours only, one chunk per step

RING = "02_ring_allreduce"
#: the whole tensor goes round the ring: the right sums, N times a chunk's traffic per step
RS_WHOLE = """def ring_reduce_scatter(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    total = tensor.reshape(-1).clone()
    passing = total.clone()
    for _ in range(world - 1):
        incoming = torch.empty_like(passing)
        ops = [dist.P2POp(dist.isend, passing, (rank + 1) % world),
               dist.P2POp(dist.irecv, incoming, (rank - 1) % world)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        total += incoming
        passing = incoming
    return total.tensor_split(world)[rank].clone()
"""
#: every rank sends chunk j straight to rank j: right, but not a ring (rank 0 talks to rank 2 of 4)
RS_DIRECT = """def ring_reduce_scatter(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = tensor.reshape(-1).tensor_split(world)
    mine = chunks[rank].clone()
    others = {j: torch.empty_like(mine) for j in range(world) if j != rank}
    requests = [dist.isend(chunks[j].contiguous(), j) for j in others]
    requests += [dist.irecv(others[j], j) for j in others]
    for request in requests:
        request.wait()
    for received in others.values():
        mine += received
    return mine
"""
#: each step sends everything gathered so far instead of the chunk received last
AG_SO_FAR = """def ring_all_gather(chunk):
    rank, world = dist.get_rank(), dist.get_world_size()
    have = {rank: chunk.clone()}
    for step in range(world - 1):
        out = torch.stack([have[(rank - s) % world] for s in range(step + 1)])
        incoming = torch.empty_like(out)
        ops = [dist.P2POp(dist.isend, out, (rank + 1) % world),
               dist.P2POp(dist.irecv, incoming, (rank - 1) % world)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        for s in range(step + 1):
            have[(rank - 1 - s) % world] = incoming[s]
    return [have[i] for i in range(world)]
"""
#: a star: every rank sends to rank 0, which sums and sends the result back
AR_STAR = """def ring_all_reduce(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        for r in range(1, world):
            incoming = torch.empty_like(tensor)
            dist.recv(incoming, r)
            tensor += incoming
        for r in range(1, world):
            dist.send(tensor, r)
    else:
        dist.send(tensor, 0)
        dist.recv(tensor, 0)
    return tensor
"""


@pytest.mark.parametrize("test, planted, says", [
    ("test_ring_reduce_scatter_visible", RS_WHOLE, "rank 0 sent 80 bytes; a ring of 3 sends one chunk per step"),
    ("test_ring_reduce_scatter_visible_2", RS_DIRECT, "4 ranks: rank 0 exchanged messages with ranks [1, 2, 3]"),
    ("test_ring_all_gather_visible", AG_SO_FAR, "rank 0 sent 144 bytes; a ring of 4 passes one chunk (24 bytes)"),
    ("test_ring_all_reduce_visible_2", AR_STAR, "4 ranks: rank 0 exchanged messages with ranks [1, 2, 3]"),
], ids=["rs-whole-tensor", "rs-not-a-ring", "ag-everything-so-far", "ar-star"])
def test_02_visible_tests_see_the_ring(test, planted, says):
    said = visible(RING, test, planted)
    assert said is not None and said.startswith(says), said


# ---------------------------------------------------------------------------------------------------------------
# 03_data_parallel: each all-reduce launched as soon as its gradients are ready, buckets in reverse order

DDP = "03_data_parallel"
#: holds every all-reduce back until the last gradient is ready, then launches them all
OVERLAP_AT_END = """class OverlapDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        broadcast_parameters(module)
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._ready, self._pending = [], []

        def on_ready(p):
            self._ready.append(p)
            if len(self._ready) == len(self._params):
                self._pending = [(q, dist.all_reduce(q.grad, async_op=True)) for q in self._ready]
                self._ready = []

        for p in self._params:
            p.register_post_accumulate_grad_hook(on_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for p, work in self._pending:
            work.wait()
            p.grad /= dist.get_world_size()
        self._pending = []
"""
BUCKETED = solution(DDP, "BucketedDDP")
BUCKETED_FORWARD = plant(BUCKETED, "for p in reversed([p for p in module.parameters() if p.requires_grad]):",
                         "for p in [p for p in module.parameters() if p.requires_grad]:")
BUCKETED_AT_END = plant(BUCKETED, """            if self._ready[i] == len(self.buckets[i]):
                self._launch(i)
""", """            if sum(self._ready) == sum(map(len, self.buckets)):     # every gradient, then every bucket
                for j in range(len(self.buckets)):
                    self._launch(j)
""")


LATE = ("rank 0: when the gradient of '", "' was ready, 0 all-reduce(s) had been issued, but 1 bucket(s) were "
        "complete before it")


@pytest.mark.parametrize("test, planted, uses, says", [
    ("test_OverlapDDP_visible", OVERLAP_AT_END, ("def make_small",), LATE),
    ("test_BucketedDDP_visible", BUCKETED_FORWARD, ("def make_mlp3",),
     ("rank 0, a 5000-byte cap: all-reduce sizes in the order issued [1040, 4352, 1088] B, expected "
      "[1296, 4160, 1024] B",)),
    ("test_BucketedDDP_visible", BUCKETED_AT_END, ("def make_mlp3",), LATE),
], ids=["overlap-at-the-end", "buckets-forward-order", "buckets-at-the-end"])
def test_03_visible_tests_see_when_and_in_what_order(test, planted, uses, says):
    said = visible(DDP, test, planted, uses)
    assert said is not None and said.startswith(says[0]) and all(part in said for part in says), said


# ---------------------------------------------------------------------------------------------------------------
# 04_tensor_parallel: each rank keeps its shards, nothing of the dense weights

TP = "04_tensor_parallel"
COLUMN_VIEW = plant(solution(TP, "ColumnParallelLinear"),
                    "weight = linear.weight.detach().chunk(t, 0)[r].clone()",
                    "weight = linear.weight.detach().chunk(t, 0)[r]")
MLP_KEEPS_DENSE = """class ParallelMLP(ParallelMLP):
    @classmethod
    def from_dense(cls, mlp, group=None):
        block = super().from_dense(mlp, group)
        block.dense = mlp                       # kept "for reference": its weights stay in memory
        return block
"""


@pytest.mark.parametrize("test, planted, says", [
    ("test_ColumnParallelLinear_visible", COLUMN_VIEW,
     "rank 0: the layer keeps 208 bytes of tensors (weight (4, 6) (storage 192 B)"),
    ("test_ParallelMLP_visible", MLP_KEEPS_DENSE, "rank 0: the block keeps 3328 bytes of tensors"),
], ids=["column-view", "mlp-keeps-the-dense-block"])
def test_04_visible_tests_see_the_shards(test, planted, says):
    said = visible(TP, test, planted)
    assert said is not None and said.startswith(says), said


# ---------------------------------------------------------------------------------------------------------------
# 06_zero: a step costs data parallelism's 2Ψ; ZeRO-2 reduce-scatters

ZERO = "06_zero"
ZERO1_ALL_REDUCE = plant(solution(ZERO, "ShardedOptimizer"), "dist.reduce(p.grad, dst=self.owner[p])",
                         "dist.all_reduce(p.grad)")
ZERO2_ALL_REDUCE = plant(solution(ZERO, "Zero2Optimizer"),
                         "dist.reduce_scatter(grad, list(flat.chunk(self.world_size)))",
                         "dist.all_reduce(flat)\n        grad.copy_(flat.chunk(self.world_size)[self.rank])")


@pytest.mark.parametrize("test, planted, uses, says", [
    ("test_ShardedOptimizer_visible", ZERO1_ALL_REDUCE, (), "rank 0: one step() moved 3.00Ψ"),
    ("test_Zero2Optimizer_visible", ZERO2_ALL_REDUCE, ("def try_zero",), "rank 0: step() all-reduced 1.00Ψ"),
], ids=["zero1-all-reduce", "zero2-all-reduce"])
def test_06_visible_tests_see_the_traffic(test, planted, uses, says):
    said = visible(ZERO, test, planted, uses)
    assert said is not None and said.startswith(says), said


# ---------------------------------------------------------------------------------------------------------------
# 07_fsdp: at most the shards and the largest gathered unit at once

FSDP = "07_fsdp"
NEVER_FREES = plant(solution(FSDP, "MiniFSDP"), 'unit["full"].untyped_storage().resize_(0)',
                    "pass                                                # the gathered unit stays")


def test_07_visible_test_sees_the_memory():
    said = visible(FSDP, "test_MiniFSDP_visible", NEVER_FREES)
    assert said is not None and said.startswith("step 0: rank 0 held"), said
    assert "free each unit's gathered parameters right after its forward" in said


# ---------------------------------------------------------------------------------------------------------------
# the solutions pass every visible test whose method check is new

CHANGED = [
    (COLLECTIVES, f"test_{name}_visible", ()) for name in
    ("broadcast", "reduce", "all_reduce", "gather", "all_gather", "scatter", "reduce_scatter", "all_to_all")
] + [
    (RING, "test_ring_reduce_scatter_visible", ()), (RING, "test_ring_reduce_scatter_visible_2", ()),
    (RING, "test_ring_all_gather_visible", ()), (RING, "test_ring_all_reduce_visible_2", ()),
    (DDP, "test_OverlapDDP_visible", ("def make_small",)), (DDP, "test_BucketedDDP_visible", ("def make_mlp3",)),
    (TP, "test_ColumnParallelLinear_visible", ()), (TP, "test_RowParallelLinear_visible", ()),
    (TP, "test_ParallelMLP_visible", ()), (TP, "test_ParallelAttention_visible", ()),
    (ZERO, "test_ShardedOptimizer_visible", ()), (ZERO, "test_Zero2Optimizer_visible", ("def try_zero",)),
    (FSDP, "test_MiniFSDP_visible", ()),
]


@pytest.mark.parametrize("aid, test, uses", CHANGED, ids=[f"{a[:2]}-{t}" for a, t, _ in CHANGED])
def test_the_solutions_pass_the_visible_tests(aid, test, uses):
    assert visible(aid, test, uses=uses) is None
