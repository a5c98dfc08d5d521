"""autograder.checks.tensor_parallel: correct implementations pass; planted bugs lose the points with the right message.

The implementations are written the way a student might write them. The bugs are the ones a tensor-parallel layer
is known for (f and g swapped, an all-reduce in both directions, the row-parallel bias added on every rank,
interleaved shards, a gather that cuts the gradient, the full weight kept and sliced in forward, one f per
projection), the dense weight kept where the module's attributes do not lead (an attribute starting with '_', a
module in a plain list, a numpy copy in a closure), plus the ones each of the checker's messages is there for; the
correct alternatives (a hook instead of an autograd Function, all_gather_into_tensor instead of a list, fused
q/k/v, a hand-written MLP) must pass.
"""

import copy
import functools
import sys
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autograder.checks.tensor_parallel import (
    check_ColumnParallelLinear,
    check_copy_to_tp,
    check_ParallelAttention,
    check_ParallelMLP,
    check_reduce_from_tp,
    check_RowParallelLinear,
)

# ---------------------------------------------------------------------------------------------------------------
# a correct implementation, written as a student would


def tp(group):
    return dist.get_world_size(group), dist.get_rank(group)


def divisible(size, t, what):
    if size % t:
        raise ValueError(f"{what}={size} does not split over t={t} ranks")



@pytest.fixture(autouse=True)
def _fresh_failures():
    """Each test starts as a fresh judge does: no earlier exercise has failed."""
    import autograder.checks.tensor_parallel as tp_checks

    tp_checks._FAILED.clear()
    yield
    tp_checks._FAILED.clear()


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_ok(x, group=None):
    return _Copy.apply(x, group)


def reduce_ok(x, group=None):
    return _Reduce.apply(x, group)


def copy_with_hook(x, group=None):
    """Correct alternative: a gradient hook instead of an autograd Function."""
    y = x * 1.0

    def hook(g):
        g = g.clone()
        dist.all_reduce(g, group=group)
        return g
    y.register_hook(hook)
    return y


def gather_last(x, group):
    t, _ = tp(group)
    pieces = [torch.empty_like(x) for _ in range(t)]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return torch.cat(pieces, -1)


def gather_last_into_tensor(x, group):
    t, _ = tp(group)
    out = torch.empty((t * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype)   # ranks stacked along dim 0
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return torch.cat(out.chunk(t, 0), -1)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, how):
        ctx.t, ctx.r = tp(group)
        return how(x, group)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(ctx.t, -1)[ctx.r].contiguous(), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, how):
        ctx.group, ctx.how = group, how
        t, r = tp(group)
        return x.chunk(t, -1)[r].contiguous()

    @staticmethod
    def backward(ctx, g):
        return ctx.how(g, ctx.group), None, None


class Column(nn.Module):
    gather = staticmethod(gather_last)
    copy = staticmethod(copy_ok)

    def __init__(self, w, b, group, gather_output):
        super().__init__()
        self.weight = nn.Parameter(w)
        self.bias = None if b is None else nn.Parameter(b)
        self.group, self.gather_output = group, gather_output

    @classmethod
    def shard(cls, linear, t, r):
        w = linear.weight.detach().chunk(t, 0)[r].clone()
        return w, None if linear.bias is None else linear.bias.detach().chunk(t)[r].clone()

    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False):
        t, r = tp(group)
        divisible(linear.out_features, t, "out_features")
        return cls(*cls.shard(linear, t, r), group, gather_output)

    def forward(self, x):
        y = F.linear(type(self).copy(x, self.group), self.weight, self.bias)
        return _Gather.apply(y, self.group, type(self).gather) if self.gather_output else y


class Row(nn.Module):
    gather = staticmethod(gather_last)
    reduce = staticmethod(reduce_ok)

    def __init__(self, w, b, group, input_is_parallel):
        super().__init__()
        self.weight = nn.Parameter(w)
        self.bias = None if b is None else nn.Parameter(b)
        self.group, self.input_is_parallel = group, input_is_parallel

    @classmethod
    def shard(cls, linear, t, r):
        w = linear.weight.detach().chunk(t, 1)[r].clone()
        return w, None if linear.bias is None else linear.bias.detach().clone()

    @classmethod
    def from_dense(cls, linear, group=None, input_is_parallel=True):
        t, r = tp(group)
        divisible(linear.in_features, t, "in_features")
        return cls(*cls.shard(linear, t, r), group, input_is_parallel)

    def forward(self, x):
        if not self.input_is_parallel:
            x = _Scatter.apply(x, self.group, type(self).gather)
        y = type(self).reduce(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class MLPok(nn.Module):
    col, row = Column, Row

    def __init__(self, fc1, fc2):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    @classmethod
    def from_dense(cls, mlp, group=None):
        return cls(cls.col.from_dense(mlp.fc1, group), cls.row.from_dense(mlp.fc2, group))

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class AttentionOK(nn.Module):
    """Separate q, k, v shards, one f for all three."""

    def __init__(self, attn, group):
        super().__init__()
        t, r = tp(group)
        divisible(attn.num_heads, t, "num_heads")
        for name in ("q", "k", "v"):
            w, b = Column.shard(getattr(attn, f"{name}_proj"), t, r)
            setattr(self, f"{name}_w", nn.Parameter(w))
            setattr(self, f"{name}_b", nn.Parameter(b))
        self.out = Row.from_dense(attn.out_proj, group)
        self.d, self.group = attn.head_dim, group

    @classmethod
    def from_dense(cls, attn, group=None):
        return cls(attn, group)

    def project(self, x):
        return [F.linear(x, getattr(self, f"{n}_w"), getattr(self, f"{n}_b")) for n in ("q", "k", "v")]

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (z.view(b, s, -1, self.d).transpose(1, 2) for z in self.project(copy_ok(x, self.group)))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


class AttentionFused(AttentionOK):
    """Correct alternative: one fused qkv weight and bias (q, k, v shards stacked)."""

    def __init__(self, attn, group):
        super().__init__(attn, group)
        self.qkv_w = nn.Parameter(torch.cat([self.q_w.detach(), self.k_w.detach(), self.v_w.detach()]))
        self.qkv_b = nn.Parameter(torch.cat([self.q_b.detach(), self.k_b.detach(), self.v_b.detach()]))
        for n in ("q_w", "k_w", "v_w", "q_b", "k_b", "v_b"):
            delattr(self, n)

    def project(self, x):
        return F.linear(x, self.qkv_w, self.qkv_b).chunk(3, -1)


class MLPbyHand(nn.Module):
    """Correct alternative: no layer classes, f and g called directly."""

    def __init__(self, mlp, group):
        super().__init__()
        t, r = tp(group)
        divisible(mlp.fc1.out_features, t, "ffn_hidden")
        self.w1, self.b1 = (nn.Parameter(v) for v in Column.shard(mlp.fc1, t, r))
        self.w2, self.b2 = (nn.Parameter(v) for v in Row.shard(mlp.fc2, t, r))
        self.group = group

    @classmethod
    def from_dense(cls, mlp, group=None):
        return cls(mlp, group)

    def forward(self, x):
        h = F.gelu(F.linear(copy_ok(x, self.group), self.w1, self.b1))
        return reduce_ok(F.linear(h, self.w2), self.group) + self.b2


# ---------------------------------------------------------------------------------------------------------------
# f and g


def copy_is_g(x, group=None):               # f and g swapped
    return reduce_ok(x, group)


def reduce_is_f(x, group=None):
    return copy_ok(x, group)


class _ReduceBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def reduce_both_ways(x, group=None):        # an all-reduce in both directions
    return _ReduceBoth.apply(x, group)


def reduce_in_place(x, group=None):
    class InPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            dist.all_reduce(x, group=group)
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g, None
    return InPlace.apply(x, group)


def copy_plain(x, group=None):              # no autograd function: nothing happens in backward
    return x


def copy_world_group(x, group=None):        # ignores group
    return copy_ok(x, None)


class _CopyInPlace(_Copy):
    @staticmethod
    def backward(ctx, g):                   # all-reduces the caller's gradient tensor itself
        dist.all_reduce(g, group=ctx.group)
        return g, None


def copy_grad_in_place(x, group=None):
    return _CopyInPlace.apply(x, group)


class _CopyMean(_Copy):
    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g / dist.get_world_size(ctx.group), None


def copy_averages(x, group=None):
    return _CopyMean.apply(x, group)


class _ReduceMean(_Reduce):
    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y / dist.get_world_size(group)


def reduce_averages(x, group=None):
    return _ReduceMean.apply(x, group)


def todo(*args, **kwargs):
    raise NotImplementedError()


def test_f_and_g_correct_pass():
    check_copy_to_tp(copy_ok)
    check_copy_to_tp(copy_with_hook)
    check_reduce_from_tp(reduce_ok)


@pytest.mark.parametrize("impl, expected", [
    (copy_is_g, "f is the identity in forward"),
    (copy_plain, "f's backward all-reduces"),
    (copy_world_group, "pass group="),
    (copy_grad_in_place, "changed in place: all-reduce a copy"),
    (copy_averages, "It is 1/t of the sum"),
    (todo, "not started: it still raises NotImplementedError"),
])
def test_copy_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_copy_to_tp(impl)
    assert expected in str(info.value), str(info.value)


@pytest.mark.parametrize("impl, expected", [
    (reduce_is_f, "g all-reduces (sums) x over the group in forward"),
    (reduce_both_ways, "g is the identity in backward"),
    (reduce_in_place, "changed its input x in place"),
    (reduce_averages, "It is 1/t of the sum"),
])
def test_reduce_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_reduce_from_tp(impl)
    assert expected in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# ColumnParallelLinear


class ColumnIntoTensor(Column):
    gather = staticmethod(gather_last_into_tensor)


class ColumnInterleaved(Column):
    @classmethod
    def shard(cls, linear, t, r):
        b = None if linear.bias is None else linear.bias.detach()[r::t].clone()
        return linear.weight.detach()[r::t].clone(), b


class ColumnView(Column):                   # no clone: the shard is a view that keeps the whole weight alive
    @classmethod
    def shard(cls, linear, t, r):
        return linear.weight.detach().chunk(t, 0)[r], None if linear.bias is None else linear.bias.detach().chunk(t)[r]


class ColumnKeepsFull(Column):              # the full weight kept, sliced in forward
    def __init__(self, w, b, group, gather_output):
        super().__init__(w, b, group, gather_output)

    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False):
        m = super().from_dense(linear, group, gather_output)
        m.register_buffer("full", linear.weight.detach().clone())
        return m


class ColumnUnderscoreFull(Column):         # the dense weight kept under an attribute starting with '_'
    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False):
        m = super().from_dense(linear, group, gather_output)
        m._dense_weight = linear.weight.detach()
        return m


class ColumnNumpyClosure(Column):           # a copy of the dense weight as a numpy array, in a closure
    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False):
        m = super().from_dense(linear, group, gather_output)
        full = linear.weight.detach().numpy().copy()
        m.extra_repr = lambda: f"dense {full.shape}"
        return m


class ColumnCutGather(Column):              # dist.all_gather is not differentiable
    @staticmethod
    def gather(x, group):
        return gather_last(x.detach(), group)

    def forward(self, x):
        y = F.linear(copy_ok(x, self.group), self.weight, self.bias)
        return gather_last(y, self.group) if self.gather_output else y


class ColumnNoF(Column):
    copy = staticmethod(lambda x, group=None: x)


class ColumnWorldGroup(Column):
    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False):
        return super().from_dense(linear, None, gather_output)


class ColumnNoCheck(Column):
    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False):
        t, r = tp(group)
        return cls(*cls.shard(linear, t, r), group, gather_output)


class ColumnVagueError(Column):
    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False):
        t, r = tp(group)
        if linear.out_features % t:
            raise ValueError("bad size")
        return cls(*cls.shard(linear, t, r), group, gather_output)


class ColumnWrongRank(Column):
    @classmethod
    def shard(cls, linear, t, r):
        return super().shard(linear, t, (r + 1) % t)


class ColumnBiasNotParameter(Column):
    def __init__(self, w, b, group, gather_output):
        super().__init__(w, None, group, gather_output)
        self.bias = b                                  # a plain tensor: no gradient, not trained


class ColumnScalesDense(Column):                       # writes into the dense layer
    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False):
        with torch.no_grad():
            linear.weight.mul_(1.0)
            linear.weight[0, 0] += 1.0
        return super().from_dense(linear, group, gather_output)


class ColumnInPlaceInput(Column):
    def forward(self, x):
        with torch.no_grad():
            x.mul_(1.0).add_(0.0 if x.numel() == 0 else 1e-3)
        return super().forward(x)


class ColumnReturnsList(Column):
    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False):
        return [super().from_dense(linear, group, gather_output)]


def test_column_correct_pass():
    check_ColumnParallelLinear(Column)
    check_ColumnParallelLinear(ColumnIntoTensor)


@pytest.mark.parametrize("impl, expected", [
    (ColumnInterleaved, "(interleaved)"),
    (ColumnView, ".clone() the chunk"),
    (ColumnKeepsFull, "Largest: full"),
    (ColumnUnderscoreFull, "beyond its shards"),
    (ColumnNumpyClosure, "beyond its shards"),
    (ColumnCutGather, "graph was cut"),
    (ColumnNoF, "exactly one all-reduce, f's"),
    (ColumnWorldGroup, ("is not a shard", "not from the whole world")),  # which one: the drawn sizes decide
    (ColumnNoCheck, "did not raise"),
    (ColumnVagueError, "should name the size"),
    (ColumnWrongRank, "rank 1's rows"),
    (ColumnBiasNotParameter, "no parameter holds linear.bias"),
    (ColumnScalesDense, "changed the dense module's weight"),
    (ColumnInPlaceInput, "changed its input in place"),
    (ColumnReturnsList, "expected an nn.Module"),
])
def test_column_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_ColumnParallelLinear(impl)
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert any(e in str(info.value) for e in expected), str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# RowParallelLinear


class RowIntoTensor(Row):
    gather = staticmethod(gather_last_into_tensor)


class RowDenseInList(Row):                  # the dense module kept inside a plain list (not a submodule)
    @classmethod
    def from_dense(cls, linear, group=None, input_is_parallel=True):
        m = super().from_dense(linear, group, input_is_parallel)
        m.keep = [linear]
        return m


class RowBiasEverywhere(Row):               # the bias added on every rank, before the sum
    def forward(self, x):
        if not self.input_is_parallel:
            x = _Scatter.apply(x, self.group, gather_last)
        return reduce_ok(F.linear(x, self.weight, self.bias), self.group)


class RowBiasOnRankZero(Row):               # the right output, but the other ranks' bias gets no gradient
    def forward(self, x):
        if not self.input_is_parallel:
            x = _Scatter.apply(x, self.group, gather_last)
        y = F.linear(x, self.weight)
        if tp(self.group)[1] == 0 and self.bias is not None:
            y = y + self.bias
        return reduce_ok(y, self.group)


class RowReduceBoth(Row):
    reduce = staticmethod(reduce_both_ways)


class RowInterleaved(Row):
    @classmethod
    def shard(cls, linear, t, r):
        w, b = super().shard(linear, t, r)
        return linear.weight.detach()[:, r::t].clone(), b


class RowPlainSlice(Row):                   # input_is_parallel=False without the all-gather in backward
    def forward(self, x):
        if not self.input_is_parallel:
            t, r = tp(self.group)
            x = x.chunk(t, -1)[r]
        if self.input_is_parallel:
            return super().forward(x)
        y = reduce_ok(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


def test_row_correct_pass():
    check_RowParallelLinear(Row)
    check_RowParallelLinear(RowIntoTensor)


@pytest.mark.parametrize("impl, expected", [
    (RowBiasEverywhere, "of the bias: every rank added the bias before the sum"),
    (RowBiasOnRankZero, "not used on this rank"),
    (RowReduceBoth, "g is the identity"),
    (RowInterleaved, "(interleaved)"),
    (RowPlainSlice, "the slice's backward all-gathers"),
    (RowDenseInList, "beyond its shards"),
])
def test_row_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_RowParallelLinear(impl)
    assert expected in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# ParallelMLP and ParallelAttention


class MLPswapped(MLPbyHand):                # f and g swapped
    def forward(self, x):
        h = F.gelu(F.linear(reduce_ok(x, self.group), self.w1, self.b1))
        return copy_ok(F.linear(h, self.w2), self.group) + self.b2


class MLPbiasEverywhere(MLPok):
    row = RowBiasEverywhere


class MLPkeepsFull(MLPbyHand):              # the full weights kept (as parameters), sliced in forward
    def __init__(self, mlp, group):
        super().__init__(mlp, group)
        self.full1 = nn.Parameter(mlp.fc1.weight.detach().clone())

    def forward(self, x):
        t, r = tp(self.group)
        h = F.gelu(F.linear(copy_ok(x, self.group), self.full1.chunk(t, 0)[r], self.b1))
        return reduce_ok(F.linear(h, self.w2), self.group) + self.b2


class MLPdenseCopyHidden(MLPok):            # a copy of the dense MLP under an attribute starting with '_'
    @classmethod
    def from_dense(cls, mlp, group=None):
        m = super().from_dense(mlp, group)
        m._spare = [copy.deepcopy(mlp.fc2)]
        return m


class MLPreduceBoth(MLPbyHand):
    def forward(self, x):
        h = F.gelu(F.linear(copy_ok(x, self.group), self.w1, self.b1))
        return reduce_both_ways(F.linear(h, self.w2), self.group) + self.b2


def test_mlp_correct_pass():
    check_ParallelMLP(MLPok)
    check_ParallelMLP(MLPbyHand)


@pytest.mark.parametrize("impl, expected", [
    (MLPswapped, "f and g swapped"),
    (MLPbiasEverywhere, "of the output bias: add the row-parallel bias once"),
    (MLPkeepsFull, "holds the full weight"),
    (MLPreduceBoth, "Backward of the MLP block"),
    (MLPdenseCopyHidden, "beyond its shards"),
])
def test_mlp_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_ParallelMLP(impl)
    assert expected in str(info.value), str(info.value)


class AttentionThreeF(AttentionOK):         # one f per projection: three all-reduces in backward
    def forward(self, x):
        b, s, _ = x.shape
        qkv = [F.linear(copy_ok(x, self.group), getattr(self, f"{n}_w"), getattr(self, f"{n}_b")) for n in "qkv"]
        q, k, v = (z.view(b, s, -1, self.d).transpose(1, 2) for z in qkv)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


class AttentionInterleavedHeads(AttentionOK):
    def __init__(self, attn, group):
        super().__init__(attn, group)
        t, r = tp(group)
        H, d = attn.num_heads, attn.head_dim
        with torch.no_grad():
            for n in "qkv":
                lin = getattr(attn, f"{n}_proj")
                getattr(self, f"{n}_w").copy_(lin.weight.view(H, d, -1)[r::t].reshape(-1, lin.in_features))
                getattr(self, f"{n}_b").copy_(lin.bias.view(H, d)[r::t].reshape(-1))


class AttentionNoCheck(AttentionOK):
    def __init__(self, attn, group):
        global divisible
        saved, divisible = divisible, lambda *a: None
        try:
            super().__init__(attn, group)
        finally:
            divisible = saved


class AttentionDenseInList(AttentionOK):     # two dense projections kept inside a plain list
    def __init__(self, attn, group):            # (half the dense module: well past the check's quarter allowance)
        super().__init__(attn, group)
        self._spare = [attn.q_proj, attn.k_proj]


class AttentionWholeWorld(AttentionOK):       # ignores group: shards over every rank
    def __init__(self, attn, group):
        super().__init__(attn, None)


def test_attention_correct_pass():
    check_ParallelAttention(AttentionOK)
    check_ParallelAttention(AttentionFused)


@pytest.mark.parametrize("impl, expected", [
    (AttentionThreeF, "apply copy_to_tp once"),
    (AttentionInterleavedHeads, "interleaved heads"),
    (AttentionWholeWorld, "tensor-parallel groups of 2"),
    (AttentionDenseInList, "beyond its shards"),
])
def test_attention_bugs_fail(impl, expected):
    with pytest.raises(AssertionError) as info:
        check_ParallelAttention(impl)
    assert expected in str(info.value), str(info.value)


class ColumnOnBadCopy(Column):
    copy = staticmethod(lambda x, group=None: copy_is_g(x, group))   # the layer is right, its f is not


def test_a_failure_names_the_earlier_exercise_it_is_built_on():
    """Messages only: after copy_to_tp failed its own check, a failing ColumnParallelLinear says it uses it; after
    copy_to_tp passed, it does not."""
    import autograder.checks.tensor_parallel as tp_checks

    tp_checks._FAILED.clear()
    with pytest.raises(AssertionError):
        check_copy_to_tp(copy_is_g)
    with pytest.raises(AssertionError, match=r"^\(copy_to_tp failed its own test above, and ColumnParallelLinear "
                                             r"uses it: fix that first\.\) "):
        check_ColumnParallelLinear(ColumnOnBadCopy)
    check_copy_to_tp(copy_ok)
    with pytest.raises(AssertionError) as info:
        check_ColumnParallelLinear(ColumnOnBadCopy)
    assert "failed its own test" not in str(info.value)
    tp_checks._FAILED.clear()


# ---------------------------------------------------------------------------------------------------------------
# what the host measures: memory read by the system, communication in its own record

#: A module-level object of the student's: it exists before any check starts.
_KEPT = {}


class ColumnBytesCopy(Column):              # the dense weight kept as bytes in a module-level dict
    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False):
        _KEPT[id(linear)] = linear.weight.detach().numpy().tobytes()
        return super().from_dense(linear, group, gather_output)


class MLPBytesCopy(MLPok):                  # the dense MLP's weights kept as bytes in a module-level dict
    @classmethod
    def from_dense(cls, mlp, group=None):
        _KEPT["mlp"] = [p.detach().numpy().tobytes() for p in mlp.parameters()]
        return super().from_dense(mlp, group)


class ColumnGathersWeight(Column):          # from_dense all-gathers every rank's shard "to check it"
    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False):
        m = super().from_dense(linear, group, gather_output)
        t, _ = tp(group)
        pieces = [torch.empty_like(m.weight) for _ in range(t)]
        dist.all_gather(pieces, m.weight.detach().contiguous(), group=group)
        return m


@functools.lru_cache(maxsize=None)
def _split(size, t):
    return size // t


class RowHonestHabits(Row):                 # correct, with habits honest code has
    @classmethod
    def from_dense(cls, linear, group=None, input_is_parallel=True):
        t, r = tp(group)
        print(f"rank {r}: {_split(linear.in_features, t)} input features each", file=sys.stderr)
        warnings.warn("from_dense: a reminder to myself (a warning on stderr)")
        try:
            divisible(linear.in_features, t, "in_features")
        except ValueError:
            traceback.print_exc()
            raise
        return cls(*cls.shard(linear, t, r), group, input_is_parallel)


def test_a_copy_kept_as_bytes_in_a_module_object_is_measured():
    with pytest.raises(AssertionError, match="beyond its shards"):
        check_ColumnParallelLinear(ColumnBytesCopy)
    with pytest.raises(AssertionError, match="beyond its shards"):
        check_ParallelMLP(MLPBytesCopy)


def test_communication_in_from_dense_is_in_the_hosts_record():
    with pytest.raises(AssertionError, match="from_dense communicated"):
        check_ColumnParallelLinear(ColumnGathersWeight)


def test_honest_habits_pass():
    check_RowParallelLinear(RowHonestHabits)
