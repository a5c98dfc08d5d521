"""autograder.checks._memory: the census finds what an answer keeps wherever it keeps it, and nothing else.

Each test takes a baseline, then keeps some data the way an answer could without any attribute leading to it (a
closure, an untracked dict, a function's defaults, an autograd graph, a gradient autograd made, a buffer that
existed before), and checks the census counts exactly those bytes beyond what the check declares its own.
"""

import gc

import numpy as np
import torch

from autograder.checks._memory import MemoryWatch, census, fmt_bytes


def _sizes(kept):
    return sorted(n for n, _ in kept.storages.values())


def _closure(value):
    return lambda: value


def test_nothing_new_nothing_kept():
    model = torch.nn.Linear(5, 4)
    watch = MemoryWatch()
    kept = watch.kept()
    watch.close()
    assert kept.total == 0, kept.largest()
    assert model.weight.numel() == 20


def test_tensor_in_a_closure_is_found_and_known_tensors_are_not():
    watch = MemoryWatch()
    mine = torch.zeros(100)          # the check's own
    keep = _closure(torch.ones(250))
    kept = watch.kept(known=[mine])
    watch.close()
    assert _sizes(kept) == [1000], kept.largest()
    assert "float32 tensor (250,)" in kept.largest()
    assert keep().numel() == 250


def test_python_buffers_behind_untracked_containers():
    watch = MemoryWatch()
    state = torch.randn(300)
    as_numpy = {"exp_avg": state.numpy().copy()}           # a dict of atoms: not tracked by the collector

    def f(x, _spare=(state.numpy().tobytes(),)):            # bytes in a tuple of defaults: untracked too
        return x

    blob = bytearray(512)
    holder = [as_numpy, blob]
    del state
    kept = watch.kept()
    watch.close()
    assert _sizes(kept) == [512, 1200, 1200], kept.largest(5)
    text = kept.largest(5)
    assert "numpy array (300,) of float32" in text and "bytes of 1200 B" in text and "bytearray" in text
    assert f(1) == 1 and len(holder) == 2


def test_a_numpy_view_of_a_tensor_counts_once():
    watch = MemoryWatch()
    t = torch.zeros(64)
    view = t.numpy()
    kept = watch.kept()
    watch.close()
    assert kept.total == 256, kept.largest()
    assert view.shape == (64,)


def test_tensor_saved_only_by_autograd_is_found():
    watch = MemoryWatch()
    w = torch.zeros(1, requires_grad=True)
    node = (w * torch.ones(400)).exp().grad_fn     # exp saves its output, mul the ones: only the graph holds them
    kept = watch.kept(known=[w])
    watch.close()
    assert _sizes(kept) == [1600, 1600], kept.largest()
    assert node is not None


def test_gradient_made_by_autograd_is_found():
    p = torch.nn.Parameter(torch.zeros(128))
    watch = MemoryWatch()
    (p * 2).sum().backward()                        # p.grad lives in C++ until Python reads it
    kept = watch.kept(known=[p])
    watch.close()
    assert _sizes(kept) == [512], kept.largest()
    kept = MemoryWatch().kept(known=[p, p.grad])
    assert kept.total == 0


def test_buffer_allocated_before_and_filled_since_counts():
    spare = torch.zeros(200)
    untouched = torch.zeros(50)
    watch = MemoryWatch()
    spare.copy_(torch.arange(200.0))                # the baseline saw it empty
    kept = watch.kept()
    watch.close()
    assert _sizes(kept) == [800], kept.largest()
    assert "overwritten since" in kept.largest()
    assert untouched.sum() == 0


def test_a_known_view_does_not_cover_the_rest_of_its_storage():
    watch = MemoryWatch()
    big = torch.zeros(1000)
    shard = big[:100]                               # the check knows only the shard it handed out
    del big
    kept = watch.kept(known=[shard])
    watch.close()
    assert kept.total == 3600, kept.largest()


def test_explain_takes_off_at_most_the_cap():
    watch = MemoryWatch()
    a, b = torch.zeros(100), torch.zeros(100)
    kept = watch.kept()
    watch.close()
    assert kept.total == 800
    assert kept.explain([a], cap=1000) == 400
    assert kept.explain([b], cap=100) == 100
    assert kept.total == 300


def test_census_sees_storage_objects_and_sparse_tensors():
    watch = MemoryWatch()
    storage = torch.ones(32).untyped_storage()
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.tensor([1.0, 2.0]), (10,),
                                     check_invariants=True)
    kept = watch.kept()
    watch.close()
    assert 128 in _sizes(kept), kept.largest()
    assert kept.total >= 128 + 8 + 16, kept.largest(5)
    assert storage.nbytes() == 128 and sparse.is_sparse


def test_census_counts_every_storage_once():
    t = torch.zeros(10)
    views = [t[:5], t[5:], t.view(2, 5)]
    found = census()
    key = ("cpu", None, t.untyped_storage().data_ptr())
    assert found.entries[key][0] == 40
    assert len(views) == 3
    gc.collect()


def test_fmt_bytes():
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(3 * 1024 + 100) == "3.1 KiB"
    assert fmt_bytes(3.1 * 1024 ** 2) == "3.1 MiB"


def test_buffer_put_in_a_frozen_module_is_found():
    """As in a worker, where what the fork server imported is frozen out of gc.get_objects()."""
    import json

    gc.freeze()
    try:
        watch = MemoryWatch()
        json._census_test_copy = np.ones(100)
        kept = watch.kept()
        watch.close()
    finally:
        json.__dict__.pop("_census_test_copy", None)
        gc.unfreeze()
    assert _sizes(kept) == [800], kept.largest()
