"""labsupport.lessons.pipeline_parallel: the demo model and oracle, the live-bytes meter, checkpointing, the
interleaved schedule, the timed pipeline harness on real workers, and every plot."""

import math

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import labsupport  # noqa: E402
from autograder.checks import pipeline_parallel as ref  # noqa: E402
from labsupport.lessons import pipeline_parallel as lesson  # noqa: E402
from labsupport.lessons.pipeline_parallel import interleaved  # noqa: E402


def test_demo_model_keeps_the_shape_and_stages_share_its_blocks():
    model = lesson.make_model(5, 8)
    assert model(torch.randn(3, 8)).shape == (3, 8)
    stage = lesson.build_stage(model, range(2, 4))
    assert stage[0] is model[2] and len(stage) == 2
    assert [p.data_ptr() for p in lesson.make_model(5, 8).parameters()] != [p.data_ptr() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(lesson.make_model(5, 8).parameters(), model.parameters()))


def test_one_process_step_is_the_mean_over_micro_batches():
    loss, grads = lesson.one_process_step(3, num_layers=3, width=8, rows=2)
    model = lesson.make_model(3, 8)
    xs, ys = lesson.demo_batch(3, 2, 8)
    whole = lesson.mse(model(torch.cat(xs)), torch.cat(ys))  # equal micro-batches: the mean of means
    whole.backward()
    assert math.isclose(loss, whole.item(), rel_tol=1e-6)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_live_bytes_counts_new_storages_not_views_and_sees_frees():
    a = torch.randn(100)
    with lesson.LiveBytes() as meter:
        b = a * 2              # 400 new bytes
        v = b.view(10, 10)     # a view: nothing new
        c = a.t()              # a view of a tensor from outside: nothing new
        assert meter.live == 400
        d = torch.ones(50)     # 200 more
        del b, v
        e = d + 1              # the op after the free notices it
        assert meter.live == 400
    assert meter.peak == 600
    assert c is not None and e is not None


def test_live_bytes_sees_backward():
    model = lesson.make_model(4, 16)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randn(8, 16)
    with lesson.LiveBytes() as meter:
        loss = model(x).pow(2).mean()
        kept = meter.live
        loss.backward()
        del loss
    assert kept >= 4 * 8 * 16 * 4           # at least one (8, 16) activation per block
    assert meter.peak > kept                # backward allocates gradients of activations
    assert meter.live < kept                # and frees the saved activations


def test_checkpoint_sweep_keeps_segment_inputs():
    rows = lesson.checkpoint_sweep(num_layers=16, width=32, rows=32, every=(0, 4, 16), repeats=1)
    kept = {r["k"]: r["kept"] / r["unit"] for r in rows}
    peak = {r["k"]: r["peak"] / r["unit"] for r in rows}
    assert round(kept[0]) == 17 and round(kept[4]) == 5 and round(kept[16]) == 2
    assert peak[4] < peak[0] and peak[4] < peak[16]  # sqrt(n) is the sweet spot
    model = lesson.make_model(6, 8)
    x = torch.randn(4, 8)
    torch.testing.assert_close(lesson.CheckpointedStage(model, every=4)(x), model(x))


def test_interleaved_schedule_runs_each_unit_once_and_refuses_v1():
    for p, m, v in [(2, 4, 2), (4, 8, 2), (4, 4, 4), (3, 6, 3)]:
        sched = interleaved.interleaved_schedule(p, m, v)
        for ops in sched:
            assert sorted(ops) == sorted((op, mb, c) for op in "FB" for mb in range(m) for c in range(v))
        sim = interleaved.simulate_interleaved(p, m, v, 1.0, 2.0)
        assert math.isclose(sim["bubble_fraction"], (p - 1) / (v * m + p - 1), rel_tol=1e-9)
        assert math.isclose(sim["makespan"], (m + (p - 1) / v) * 3.0, rel_tol=1e-9)
    with pytest.raises(ValueError, match="v must be at least 2"):
        interleaved.interleaved_schedule(4, 8, 1)
    with pytest.raises(ValueError, match="multiple of p"):
        interleaved.interleaved_schedule(4, 6, 2)


def gpipe_run(stage_module, schedule, microbatches, targets, loss_fn):
    """A small correct run_pipeline (GPipe-safe with blocking sends) for the harness tests."""
    rank, p = dist.get_rank(), dist.get_world_size()
    m = len(microbatches)
    kept, total = {}, 0.0
    for op, mb in schedule[rank]:
        if op == "F":
            x = microbatches[mb]
            if rank > 0:
                x = torch.empty_like(x)
                dist.recv(x, src=rank - 1)
                x.requires_grad_()
            y = stage_module(x)
            if rank == p - 1:
                y = loss_fn(y, targets[mb]) / m
                total += y.item()
            else:
                dist.send(y.detach(), dst=rank + 1)
            kept[mb] = (x, y)
        else:
            x, y = kept.pop(mb)
            g = None
            if rank < p - 1:
                g = torch.empty_like(y)
                dist.recv(g, src=rank + 1)
            y.backward(g)
            if rank > 0:
                dist.send(x.grad, dst=rank - 1)
    return total if rank == p - 1 else None


def test_pipeline_run_records_real_spans_and_matches_one_process():
    p, m = 2, 3
    schedule = ref.reference_gpipe(p, m)
    results = labsupport.run(lesson.pipeline_run, gpipe_run, schedule, ref.reference_partition(5, p), num_layers=5,
                             width=16, rows=4, t_fwd=0.01, t_bwd=0.02, measure_memory=True, world_size=p, timeout=60)
    loss, grads = lesson.one_process_step(m, num_layers=5, width=16, rows=4)
    assert results[0]["loss"] is None and math.isclose(results[1]["loss"], loss, rel_tol=1e-5)
    for got, want in zip(results[0]["grads"] + results[1]["grads"], grads):
        torch.testing.assert_close(got, want)
    for rank, r in enumerate(results):
        spans = lesson.spans_of(r["events"])
        assert [(op, mb) for _, _, op, mb in spans] == schedule[rank]
        for start, end, op, _ in spans:  # padded to at least the requested duration
            assert end - start >= (0.01 if op == "F" else 0.02) - 1e-3
        assert r["peak_bytes"] > 0
    events = [r["events"] for r in results]
    bubble = lesson.measured_bubble(events)
    assert (p - 1) / (m + p - 1) - 0.05 < bubble < 0.9
    sim = ref.reference_simulate(schedule, 1.0, 2.0)
    figs = [lesson.plot_schedules({"simulated": sim["busy"], "measured": events}),
            lesson.plot_bubble([1, 2], {"measured": [0.5, 0.3]}, [0.5, 1 / 3]),
            lesson.plot_memory({"GPipe": [4096, 2048], "1F1B": [2048, 1024]}, {"1F1B": [2000, 1000]}),
            lesson.plot_partition(ref.reference_partition(5, 2)),
            lesson.plot_checkpointing(lesson.checkpoint_sweep(num_layers=4, width=8, rows=8, every=(0, 2),
                                                              repeats=1), 4),
            lesson.plot_interleaved({"v=2": interleaved.simulate_interleaved(2, 4, 2)["busy"]})]
    import matplotlib.pyplot as plt

    for fig in figs:
        assert fig.axes
        plt.close(fig)
