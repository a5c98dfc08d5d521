"""labsupport.lessons.production: the restart script, its log and figure, the peak-memory measure, the sampling figure."""

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
