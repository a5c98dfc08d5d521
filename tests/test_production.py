"""labsupport.lessons.production: the restart script, its log and figure, the peak-memory measure, the sampling figure,
and the demos around the exercises (resuming on another world size, loader seeds, evaluation under padding, gradient
accumulation, async_save, the checkpoint interval, the random state)."""

import json
import os
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from labsupport.lessons import production as lesson


def test_restart_script_is_valid_python_and_names_its_arguments(tmp_path):
    path = lesson.write_restart_script(str(tmp_path))
    source = open(path).read()
    compile(source, path, "exec")
    for word in ("--kill-at", "--every", "TORCHELASTIC_RESTART_COUNT", "PrefixStore", "train_run"):
        assert word in source, word
    proc = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--kill-at" in proc.stdout, proc.stdout + proc.stderr


def test_read_log_and_seconds_lost(tmp_path):
    assert lesson.read_log(str(tmp_path)) == []
    lines = [{"attempt": 0, "step": s, "loss": 1.0 / (s + 1), "time": 100.0 + s} for s in range(5)]
    lines += [{"attempt": 1, "step": s, "loss": 1.0 / (s + 1), "time": 110.0 + s} for s in range(3, 8)]
    with open(tmp_path / "log.jsonl", "w") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))
    records = lesson.read_log(str(tmp_path))
    assert records == lines
    # the first attempt's last step ran at 104; the second reached step 4 (kill_at - 1) again at 114
    assert lesson.seconds_lost(records, kill_at=5) == pytest.approx(10.0)
    assert lesson.seconds_lost(records[:5], kill_at=5) != lesson.seconds_lost(records[:5], kill_at=5)  # nan
    fig = lesson.plot_restart({s: 1.0 / (s + 1) for s in range(8)}, records, kill_at=5, every=3)
    assert len(fig.axes[0].lines) >= 3 and "10.0 s lost" in fig.axes[0].get_title()
    matplotlib.pyplot.close("all")


def test_peak_memory_sees_a_large_allocation():
    with lesson.PeakMemory() as peak:
        # 64 MiB, touched: above glibc's largest mmap threshold (32 MiB), so new pages, never reused heap ones
        big = torch.ones(64 << 20, dtype=torch.uint8)
        del big
    if peak.grown != peak.grown:  # nan: no /proc/self/clear_refs here
        pytest.skip("the kernel's peak memory cannot be reset on this system")
    assert peak.grown >= 60 << 20, peak.grown
    with lesson.PeakMemory() as small:
        torch.ones(16)
    assert small.grown < 4 << 20, small.grown


def test_dir_bytes(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(b"12345")
    (tmp_path / "y").write_bytes(b"1")
    assert lesson.dir_bytes(str(tmp_path)) == {os.path.join("a", "x.bin"): 5, "y": 1}


def test_plot_sampling_draws_each_row():
    rows = {"epoch 0": [[0, 2], [1, 3]], "epoch 1": [[3, 1], [0, 2]]}
    fig = lesson.plot_sampling(rows, 4)
    image = fig.axes[0].images[0].get_array()
    assert image.shape == (2, 4)
    assert [int(v) for v in image[0]] == [0, 1, 0, 1] and [int(v) for v in image[1]] == [1, 0, 1, 0]
    matplotlib.pyplot.close("all")


def test_train_run_resumes_to_the_same_losses(tmp_path):
    """Killed (here: stopped) after a checkpoint and run again, the run logs the uninterrupted losses."""
    import labsupport

    full = labsupport.run(lesson.train_run, str(tmp_path / "full"), 7, 3, world_size=2, timeout=120)[0]
    first = labsupport.run(lesson.train_run, str(tmp_path / "cut"), 4, 3, world_size=2, timeout=120)[0]
    assert sorted(first) == [0, 1, 2, 3]
    rest = labsupport.run(lesson.train_run, str(tmp_path / "cut"), 7, 3, world_size=2, timeout=120)[0]
    assert sorted(rest) == [3, 4, 5, 6]  # resumed from the checkpoint after step 3 (3 steps done)
    for step, loss in rest.items():
        assert loss == full[step], (step, loss, full[step])


def test_tensor_bytes_counts_each_storage_once():
    a = torch.zeros(10)
    state = {"w": a, "view": a[2:5], "nested": [torch.zeros(3, dtype=torch.float64), {"step": torch.tensor(1.0)}]}
    assert lesson.tensor_bytes(state) == 40 + 24 + 4
    assert lesson.tensor_bytes({}) == 0


# ---------------------------------------------------------------------------------------------------------------
# the demos around the exercises


def _sampler_shard(num_samples, num_replicas, rank, epoch=0):
    """A rank's indices as torch's DistributedSampler gives them (the shape of the notebook's shard_indices)."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(num_samples), num_replicas=num_replicas, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_resumed_reads_on_the_same_and_on_another_world_size():
    right_same, wrong, right_other = ("same N: each rank skips its own steps_done·batch",
                                      "other N: each rank skips its own steps_done·batch",
                                      "other N: skip the steps_done·batch·N global samples")
    for world_after, twice, never in ((3, 12, 0), (6, 0, 24)):
        counts = lesson.resumed_reads(_sampler_shard, 96, batch=4, steps_done=3, world_before=4,
                                      world_after=world_after, epoch=1)
        assert list(counts) == [right_same, wrong, right_other]
        assert counts[right_same] == [1] * 96 and counts[right_other] == [1] * 96
        assert (counts[wrong].count(2), counts[wrong].count(0)) == (twice, never), world_after
    # 10 samples on 4 ranks (padded to 12), 2 steps of 1 consumed 8 positions; the 2 left dealt to 3 ranks, one
    # of them twice (the sampler's padding): every sample read, 8 + 3 reads in all
    counts = lesson.resumed_reads(_sampler_shard, 10, batch=1, steps_done=2, world_before=4, world_after=3)
    assert min(counts[right_other]) == 1 and sum(counts[right_other]) == 11


def test_loader_draws_in_one_process():
    plain = lesson.loader_draws([0, 2, 4], num_workers=0)
    assert [i for i, _ in plain["draws"]] == [0, 2, 4] and plain["global_rng_moved"]
    assert not lesson.loader_draws([0, 2, 4], num_workers=0, generator_seed=5)["global_rng_moved"]
    # seeded per sample: a sample's draw depends on the seed, the epoch and its index, not on who reads it when
    first = dict(lesson.loader_draws([3, 1, 2], per_sample_seed=7, epoch=1, num_workers=0)["draws"])
    again = dict(lesson.loader_draws([2, 3], per_sample_seed=7, epoch=1, num_workers=0, seed=9)["draws"])
    other_epoch = dict(lesson.loader_draws([2, 3], per_sample_seed=7, epoch=2, num_workers=0)["draws"])
    assert again == {2: first[2], 3: first[3]} and other_epoch != again


@pytest.mark.slow
def test_loader_workers_draw_alike_on_every_rank_without_a_generator():
    """Two ranks seeded alike: their loaders' workers draw the same numbers for different samples, unless each
    loader has a generator of its own."""
    ranks = [lesson.loader_draws(list(range(r, 8, 2)), seed=0) for r in range(2)]
    assert [d for _, d in ranks[0]["draws"]] == [d for _, d in ranks[1]["draws"]]
    assert all(r["global_rng_moved"] for r in ranks)
    own = [lesson.loader_draws(list(range(r, 8, 2)), seed=0, generator_seed=100 + r) for r in range(2)]
    assert [d for _, d in own[0]["draws"]] != [d for _, d in own[1]["draws"]]
    assert not any(r["global_rng_moved"] for r in own)
    with_workers = dict(lesson.loader_draws(list(range(8)), per_sample_seed=3)["draws"])
    without = dict(lesson.loader_draws(list(range(8)), per_sample_seed=3, num_workers=0)["draws"])
    assert with_workers == without


def test_evaluation_on_ranks_counts_padding_once_in_the_right_ways():
    import labsupport

    # 5 samples on 2 ranks: padded to 6, sample 0 (the one answered right) read twice
    ranks = labsupport.run(lesson.evaluation_on_ranks, [1, 0, 0, 0, 0], world_size=2, timeout=120)
    assert ranks[0] == ranks[1]
    (padded, reads), (weighted, weighted_reads), (unequal, unequal_reads) = ranks[0].values()
    assert reads == 6 and padded == pytest.approx(2 / 6)
    assert (weighted_reads, unequal_reads) == (5, 5)
    assert weighted == pytest.approx(0.2) and unequal == pytest.approx(0.2)


def test_accumulation_step_each_way():
    import labsupport

    ranks = labsupport.run(lesson.accumulation_step, 3, world_size=2, timeout=120)
    got = ranks[0]
    assert list(got) == ["one process", *lesson.ACCUMULATION_WAYS]
    reference = got["one process"]["norm"]
    assert reference > 0.5, "the demo's gradient must be larger than max_norm, or clipping shows nothing"
    for way in ("no_sync, clip once after the last micro-batch", "GradScaler: unscale_, then clip"):
        assert got[way]["allreduces"] == 1 and got[way]["error"] < 1e-5, (way, got[way])
        assert got[way]["norm"] == pytest.approx(reference, rel=1e-5)
    every = got["all-reduce after every micro-batch, clip once"]
    assert every["allreduces"] == 3 and every["error"] < 1e-5
    assert got["clip after every micro-batch"]["error"] > 0.05
    scaled = got["GradScaler: clip the scaled gradients"]
    assert scaled["norm"] == pytest.approx(2.0**12 * reference, rel=1e-4) and scaled["error"] > 0.9
    for way in got:   # every rank took the same step
        assert ranks[1][way]["allreduces"] == got[way]["allreduces"]
        assert ranks[1][way]["error"] == pytest.approx(got[way]["error"], abs=1e-6)


def test_async_save_demo_keeps_the_state_at_the_call(tmp_path):
    import labsupport

    ranks = labsupport.run(lesson.async_save_demo, str(tmp_path), 1 << 12, world_size=2, timeout=120)
    assert [r["intact"] for r in ranks] == [True, True]
    assert sorted(os.listdir(tmp_path)) == ["async", "sync"]
    assert ".metadata" in os.listdir(tmp_path / "async")


def test_young_and_daly_intervals():
    assert lesson.young_interval(5, 1440) == pytest.approx(120.0)
    # Daly 2006, Figs. 3 to 5: a 5-minute dump with M = 24 h, 6 h and 15 min gives 117, 57 and 9.1 minutes
    for mtbf, expected, tolerance in ((24 * 60, 117, 0.5), (6 * 60, 57, 0.5), (15, 9.1, 0.05)):
        assert lesson.daly_interval(5, mtbf) == pytest.approx(expected, abs=tolerance)
    assert lesson.daly_interval(1e-3, 1e4) == pytest.approx(lesson.young_interval(1e-3, 1e4), rel=1e-3)
    assert lesson.daly_interval(30, 10) == 10


def test_expected_time_and_the_simulation_agree():
    # without failures: the work, and a checkpoint after every interval but the last
    assert lesson.expected_time(10, 3, 1, 1e12) == pytest.approx(13)
    assert lesson.expected_time(9, 3, 1, 1e12) == pytest.approx(11)
    assert lesson.simulate_checkpointing(10, 3, 1, 1e12, runs=1) == pytest.approx(13)
    for interval in (5, 20, 60):
        closed = lesson.expected_time(2000, interval, 2, 100, 3)
        assert lesson.simulate_checkpointing(2000, interval, 2, 100, 3, runs=200) == pytest.approx(closed, rel=0.03)
    # the closed form is smallest at Daly's interval, not at Young's (7 % longer here)
    daly = lesson.daly_interval(2, 100)
    grid = [daly * 2 ** (e / 40) for e in range(-40, 41)]
    best = min(grid, key=lambda t: lesson.expected_time(1e5, t, 2, 100, 3))
    assert best == pytest.approx(daly, rel=0.02)
    assert abs(lesson.young_interval(2, 100) / daly - 1) > 0.05


def test_plot_checkpoint_interval_draws_each_cost():
    fig = lesson.plot_checkpoint_interval({"slow save": 1.0, "fast save": 0.1}, 50.0, 1.0)
    ax = fig.axes[0]
    assert len(ax.lines) == 2 * 4    # per cost: the expected share, the simulated dots, Young's and Daly's lines
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["slow save", "fast save"]
    matplotlib.pyplot.close("all")


def test_rng_state_round_trip():
    import random

    import numpy as np

    state = lesson.rng_state()
    first = (torch.rand(3), random.random(), float(np.random.rand()))
    lesson.set_rng_state(state)
    again = (torch.rand(3), random.random(), float(np.random.rand()))
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]
    assert len(state["cuda"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_loader_draws_leaves_the_callers_random_state():
    before = torch.get_rng_state()
    lesson.loader_draws([1, 0], seed=3, num_workers=0)
    assert torch.equal(before, torch.get_rng_state())


def test_the_notebooks_workdir_goes_when_its_process_exits(tmp_path):
    code = ("import os\nfrom labsupport.lessons import production as lesson\n"
            "path = lesson.workdir()\nopen(os.path.join(path, 'ckpt.pt'), 'wb').write(b'x')\nprint(path)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    made = proc.stdout.split()[-1]
    assert made.startswith(str(tmp_path)) and "course09-" in made, made
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_torchrun_leaves_no_folder_of_its_agent(tmp_path, monkeypatch):
    """torchrun's agent makes a log folder in the temporary folder for every run (``torchelastic_*``); the lesson's
    ``torchrun`` gives it one of its own, removed afterwards."""
    script = tmp_path / "hello.py"
    # one write per line: the ranks share the agent's output, and print() may write a line in pieces that interleave
    script.write_text("import os\nos.write(1, f\"rank {os.environ['RANK']}\\n\".encode())\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)   # read TMPDIR again
    proc = lesson.torchrun(str(script), nproc=2, max_restarts=0, timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert "rank 0" in proc.stdout and "rank 1" in proc.stdout, proc.stdout
    assert list(tmp.iterdir()) == []
