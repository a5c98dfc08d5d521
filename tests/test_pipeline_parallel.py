"""labsupport.lessons.pipeline_parallel: the demo model and oracle, the live-bytes meter, checkpointing, the
interleaved schedule, the timed pipeline harness on real workers, and every plot."""

import math
from pathlib import Path
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import labsupport  # noqa: E402
from autograder.checks import pipeline_parallel as ref  # noqa: E402
from labsupport.lessons import pipeline_parallel as lesson  # noqa: E402
from labsupport.lessons.pipeline_parallel import interleaved  # noqa: E402
from autograder.checks.pipeline_parallel import interleaved as ref_interleaved  # noqa: E402


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


def test_interleaved_reference_runs_each_unit_once_and_refuses_v1():
    for p, m, v in [(2, 4, 2), (4, 8, 2), (4, 4, 4), (3, 6, 3)]:
        sched = ref_interleaved.interleaved_schedule(p, m, v)
        for ops in sched:
            assert sorted(ops) == sorted((op, mb, c) for op in "FB" for mb in range(m) for c in range(v))
        sim = ref_interleaved.simulate_interleaved(p, m, v, 1.0, 2.0)
        assert math.isclose(sim["bubble_fraction"], (p - 1) / (v * m + p - 1), rel_tol=1e-9)
        assert math.isclose(sim["makespan"], (m + (p - 1) / v) * 3.0, rel_tol=1e-9)
    with pytest.raises(ValueError, match="v must be at least 2"):
        ref_interleaved.interleaved_schedule(4, 8, 1)
    with pytest.raises(ValueError, match="multiple of p"):
        ref_interleaved.interleaved_schedule(4, 6, 2)


def test_the_lesson_holds_the_references_interleaved_runs_as_data_only():
    """Notebook 05 draws interleaving from stored spans: they equal the reference simulation (kept in the checks,
    which students do not receive), and the lesson module ships no function but the one that reads them."""
    import inspect

    for key in ref_interleaved.STORED_SIZES:
        assert interleaved.simulated(*key) == ref_interleaved.simulate_interleaved(*key), key
    assert sorted(interleaved.SIZES) == sorted(ref_interleaved.STORED_SIZES)
    functions = [name for name, obj in vars(interleaved).items() if inspect.isfunction(obj)]
    assert functions == ["simulated"], functions
    with pytest.raises(ValueError, match="only these"):
        interleaved.simulated(4, 12, 2)


NOTEBOOK = Path(__file__).resolve().parent.parent / "solutions/05_pipeline_parallel/05_pipeline_parallel.ipynb"


def _visible_test_error(answer_id: str, answer: str) -> str:
    """Run notebook 05's setup, the solutions before ``answer_id``, ``answer`` in its place and the visible test of
    ``answer_id``, in a real kernel; the visible test's error ("" when it passes)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    ids = [c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells]
    cells = []
    for cell, gid in zip(nb.cells, ids):
        if gid == answer_id:
            cells += [answer, next(c.source for c, g in zip(nb.cells, ids) if g == f"test_{answer_id}_visible")]
            break
        if gid == "setup" or (cell.metadata.get("nbgrader", {}).get("solution")):
            cells.append(cell.source)
    run = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    run.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(run, timeout=240, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return "".join(f"{o.ename}: {o.evalue}" for o in run.cells[-1].outputs if o.output_type == "error")


def _solution(grade_id: str) -> str:
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    return next(c.source for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


RECEIVE = ("x = torch.empty_like(microbatches[mb])\n                dist.recv(x, src=rank - 1)\n"
           "                x.requires_grad_()")


@pytest.mark.usefixtures("kernels_share_a_fork_server")
@pytest.mark.slow
@pytest.mark.parametrize("reused", [
    # one buffer, a new leaf of it for every micro-batch: 1F1B on 2 ranks hides it (stage 1 runs each backward
    # right after its forward), GPipe does not
    "buf = buf if 'buf' in locals() else torch.empty_like(microbatches[mb])\n"
    "                dist.recv(buf, src=rank - 1)\n                x = buf.detach().requires_grad_()",
    # the buffer itself made the leaf
    "buf = buf if 'buf' in locals() else torch.empty_like(microbatches[mb])\n"
    "                dist.recv(buf, src=rank - 1)\n                x = buf.requires_grad_()",
])
def test_the_visible_test_catches_a_reused_receive_buffer(reused):
    solution = _solution("run_pipeline")
    assert RECEIVE in solution
    error = _visible_test_error("run_pipeline", solution.replace(RECEIVE, reused))
    assert "differs from one-process training" in error, error
    if "detach" in reused:
        assert "A buffer received into for every micro-batch is overwritten" in error, error


@pytest.mark.usefixtures("kernels_share_a_fork_server")
@pytest.mark.slow
def test_the_visible_test_of_run_pipeline_passes_on_the_solution():
    assert _visible_test_error("run_pipeline", _solution("run_pipeline")) == ""


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


@pytest.mark.timing
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
    assert 0 <= lesson.measured_bubble(events) < 1  # how close to (p-1)/(m+p-1) depends on the machine's load
    sim = ref.reference_simulate(schedule, 1.0, 2.0)
    # the bubble of spans laid out exactly as scheduled (controlled inputs) is GPipe's (p-1)/(m+p-1)
    ideal = [[SimpleNamespace(name=f"{op} {mb}", start=start, end=end) for start, end, op, mb in stage]
             for stage in sim["busy"]]
    assert math.isclose(lesson.measured_bubble(ideal), (p - 1) / (m + p - 1))
    figs = [lesson.plot_schedules({"simulated": sim["busy"], "measured": events}),
            lesson.plot_bubble([1, 2], {"measured": [0.5, 0.3]}, [0.5, 1 / 3]),
            lesson.plot_memory({"GPipe": [4096, 2048], "1F1B": [2048, 1024]}, {"1F1B": [2000, 1000]}),
            lesson.plot_partition(ref.reference_partition(5, 2)),
            lesson.plot_checkpointing(lesson.checkpoint_sweep(num_layers=4, width=8, rows=8, every=(0, 2),
                                                              repeats=1), 4),
            lesson.plot_interleaved({"v=2": interleaved.simulated(4, 8, 2)["busy"]})]
    import matplotlib.pyplot as plt

    for fig in figs:
        assert fig.axes
        plt.close(fig)


# Communication volume: what a stage boundary carries, counted on real workers against 2 m b s h.

@pytest.mark.parametrize("m, shape, p, dtype", [(4, (2, 16, 32), 2, torch.float32),
                                                (3, (1, 8, 24), 4, torch.float32),
                                                (5, (2, 3, 8), 3, torch.float64)])
def test_gpipe_traffic_equals_the_formula(m, shape, p, dtype):
    summaries = labsupport.run(lesson.gpipe_traffic, m, shape, dtype, world_size=p, timeout=60)
    size = torch.empty((), dtype=dtype).element_size()
    report = lesson.traffic_report(summaries, m, shape, element_size=size)
    assert report["mismatches"] == []
    b, s, h = shape
    assert [row["measured"] for row in report["boundaries"]] == [2 * m * b * s * h * size] * (p - 1)
    for rank, summary in enumerate(summaries):  # m messages to each neighbour, nothing else
        assert summary.kinds == {"send", "recv"} and summary.peers == {rank - 1, rank + 1} & set(range(p))
        assert summary.messages_sent == m * len(summary.peers)
        assert summary.bytes_sent == summary.bytes_received <= 2 * m * b * s * h * size


def test_pipeline_run_counts_what_run_pipeline_sends():
    p, m, rows, width = 3, 4, 4, 16
    results = labsupport.run(lesson.pipeline_run, gpipe_run, ref.reference_gpipe(p, m), ref.reference_partition(5, p),
                             num_layers=5, width=width, rows=rows, count_comm=True, world_size=p, timeout=60)
    report = lesson.traffic_report([r["comm"] for r in results], m, (rows, width))
    assert report["mismatches"] == []
    assert [row["measured"] for row in report["boundaries"]] == [2 * m * rows * width * 4] * (p - 1)
    assert labsupport.run(lesson.pipeline_run, gpipe_run, ref.reference_gpipe(2, 1), ref.reference_partition(2, 2),
                          num_layers=2, width=8, rows=2, world_size=2, timeout=60)[0]["comm"] is None


def test_volume_table_pp_stays_flat_with_depth_while_dp_grows():
    small, deeper, wider = lesson.volume_table([("small", 12, 768), ("deeper", 120, 768), ("wider", 12, 7680)],
                                               m=8, b=4, s=1024, n=8, t=8, element_size=2)
    assert small["params"] == lesson.gpt_params(12, 768) == 124_439_808  # GPT-2 small
    assert deeper["pp"] == small["pp"] == 2 * 8 * 4 * 1024 * 768 * 2
    assert deeper["dp"] > 7 * small["dp"]
    assert math.isclose(deeper["dp"] / small["dp"], deeper["params"] / small["params"])
    assert math.isclose(small["dp"], 2 * small["params"] * 7 / 8 * 2)
    assert math.isclose(deeper["tp"], 10 * small["tp"])
    assert wider["pp"] == 10 * small["pp"] and wider["dp"] > 70 * small["dp"]  # PP grows like h, DP like h^2
    from labsupport.lessons import tensor_parallel

    assert lesson.tp_bytes_per_rank(3, 8, 48, 4, layers=1, m=1) == tensor_parallel.narayanan_layer_bytes(3, 8, 48, 4)
    assert lesson.pp_stage_bytes(0, 1, 4, (2, 3)) == (0, 0)  # one stage: nothing to send
    with pytest.raises(ValueError, match="positive sizes"):
        lesson.activation_numel((4, 0))


def test_traffic_report_catches_a_wrong_formula():
    m, shape = 3, (2, 4, 8)
    summaries = labsupport.run(lesson.gpipe_traffic, m, shape, world_size=3, timeout=60)
    forgets_the_gradients = lambda m, shape, element_size: m * lesson.activation_numel(shape) * element_size  # noqa
    report = lesson.traffic_report(summaries, m, shape, boundary_formula=forgets_the_gradients)
    assert len(report["mismatches"]) == 2
    assert report["mismatches"][0] == ("boundary 0|1 carried 768 B forward + 768 B back = 1536 B; "
                                       "the formula says 768 B")
    assert lesson.traffic_report(summaries, m + 1, shape)["mismatches"]  # the right formula, the wrong m


def gpipe_with_a_flaw(m, shape, flaw):
    """GPipe's messages with one planted waste: an extra activation, a message past a neighbour, a collective."""
    rank, p = dist.get_rank(), dist.get_world_size()
    with labsupport.CommCounter() as cc:
        sends = []
        for mb in range(m):
            if rank > 0:
                dist.recv(torch.empty(shape), src=rank - 1)
            if rank < p - 1:
                sends.append(dist.isend(torch.ones(shape), dst=rank + 1))
        for mb in range(m):
            if rank < p - 1:
                dist.recv(torch.empty(shape), src=rank + 1)
            if rank > 0:
                sends.append(dist.isend(torch.ones(shape), dst=rank - 1))
        if flaw == "extra tensor" and rank < 2:  # stage 0 sends its last activation twice
            (dist.send if rank == 0 else dist.recv)(torch.ones(shape), 1 - rank)
        if flaw == "past a neighbour" and rank in (0, p - 1):  # the input sent straight to the last stage
            (dist.send if rank == 0 else dist.recv)(torch.ones(shape), p - 1 - rank)
        if flaw == "collective":
            dist.all_reduce(torch.ones(1))
        for w in sends:
            w.wait()
    return cc.summary


@pytest.mark.parametrize("flaw, expected", [
    ("extra tensor", ["boundary 0|1 carried 1024 B forward + 768 B back = 1792 B; the formula says 1536 B",
                      "stage 0 sent 1024 B, expected 768 B", "stage 1 received 1792 B, expected 1536 B"]),
    ("past a neighbour", ["stage 0 made a send with rank 2, not a neighbouring stage",
                          "stage 2 made a recv with rank 0, not a neighbouring stage",
                          "stage 0 sent 1024 B, expected 768 B", "stage 2 received 1024 B, expected 768 B"]),
    ("collective", [f"stage {r} called all_reduce: a pipeline only sends to and receives from its neighbours"
                    for r in range(3)]),
])
def test_traffic_report_catches_a_pipeline_that_sends_more(flaw, expected):
    m, shape = 3, (2, 4, 8)  # one activation: 64 elements, 256 B
    summaries = labsupport.run(gpipe_with_a_flaw, m, shape, flaw, world_size=3, timeout=60)
    assert lesson.traffic_report(summaries, m, shape)["mismatches"] == expected
