"""Smoke tests of the benchmark scripts: they import internals of the checks (the reference ring, the bucket layout),
so a change there must not break them silently. Each runs its ``--quick`` configuration in a fresh interpreter, as a
person would, and must print its table; no speed is asserted (a shared machine makes every ratio noise).
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run_script(name: str, *args: str, timeout: float = 120, env: dict | None = None) -> str:
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("LABSUPPORT_GRADING", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / name), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{name} {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    print(f"{name} {' '.join(args)}: {time.monotonic() - start:.1f} s\n{proc.stdout}")
    return proc.stdout


@pytest.mark.slow
def test_ring_benchmark_quick():
    out = _run_script("ring.py", "--quick")
    # one row per (world size, size): times of both all-reduces, then the paired and median ratios
    rows = re.findall(r"^\s*(\d+)\s+([\d.]+)Mi \|.*\|\s*([\d.]+)x\s+([\d.]+)x \|", out, flags=re.M)
    assert [(n, size) for n, size, _, _ in rows] == [("2", "0.0625"), ("2", "4"), ("3", "0.0625"), ("3", "4")], out
    assert all(float(paired) > 0 and float(medians) > 0 for _, _, paired, medians in rows), out
    assert re.search(r"loopback point-to-point bandwidth: [\d.]+ GB/s", out), out
    assert "ring/builtin (> 1: the ring is faster)" in out


@pytest.mark.slow
def test_ddp_benchmark_quick():
    out = _run_script("ddp.py", "--quick")
    rows = re.findall(r"^\s*2 (naive|overlapped|bucketed)\s+([\d.]+)\s+(\d+)%", out, flags=re.M)
    assert [variant for variant, _, _ in rows] == ["naive", "overlapped", "bucketed"], out
    assert all(0 <= int(hidden) <= 100 for _, _, hidden in rows), out
    assert "bucket cap 0.02 MB" in out


@pytest.mark.slow
def test_sandbox_benchmark_runs_a_notebooks_checks_both_ways():
    """One round of 00's hidden checks with the sandbox and without (``LABSUPPORT_SANDBOX=0``): each run's time and
    load, then the ratio; the script stops with the checks' error if either kind of run fails them."""
    out = _run_script("sandbox.py", "--assignment", "00_launch", "--rounds", "1", timeout=300)
    runs = re.findall(r"^round 1: (with|without) the sandbox: checks [\d.]+ s \(process [\d.]+ s; load average "
                      r"[\d. ]+\)$", out, flags=re.M)
    assert runs == ["with", "without"], out
    assert re.search(r"^00_launch: the hidden checks take [\d.]+x as long with the sandbox \(median of 1; target at "
                     r"most 1\.3x\)$", out, flags=re.M), out


def test_ddp_benchmark_buckets_are_the_notebooks():
    """The quick configuration really has several buckets, so the bucketed variant differs from the others."""
    from autograder.checks.data_parallel import expected_buckets
    from labsupport.lessons.data_parallel import make_mlp  # the model the benchmark records (record_steps)

    buckets = expected_buckets(make_mlp(64, 3, seed=0), 0.02)
    assert [len(b) for b in buckets] == [3, 2, 1], buckets


@pytest.mark.slow
def test_grading_benchmark_rounds_on_the_demo_course(graders_env):
    """Two rounds of serial and parallel grading of the small demo course: each run, the median speed-up with the
    ratio of each round, and the bound a serial run's own use of the cores sets. (What it prints, not its numbers:
    its grading commands share the run's fork server, as ``graders_env`` says.)"""
    out = _run_script("grading.py", "--course", "tests/fixtures/course", "--assignment", "99_demo", "-n", "1",
                      "--rounds", "2", "--no-ceiling", timeout=300, env=graders_env)
    runs = re.findall(r"^  --jobs (\d+): +[\d.]+ s", out, flags=re.M)
    assert runs == ["1", "2", "1", "2"], out
    assert re.search(r"speed-up with --jobs 2: [\d.]+x \(rounds: [\d.]+x, [\d.]+x\)", out), out
    assert re.search(r"a serial run keeps [\d.]+ cores busy: with no overhead at all, \d+ cores give at most [\d.]+x",
                     out), out
    assert re.search(r"it waits with no core busy \d+% of the time .* keeps [\d.]+ cores busy the rest .* in step "
                     r"wait together, which gives at most [\d.]+x", out, flags=re.S), out
    assert "warning" not in out, out


def test_the_in_step_bound():
    """A quarter of the time waiting, 1.5 cores the rest: two jobs in step need 0.25 + 0.75 * 1.5 of a serial run's
    time for two notebooks; a run that never waits and uses one core allows 2x."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import grading

    idle, busy = grading.waits([(1.0, 0.02), (1.0, 1.5), (2.0, 1.5)])
    assert (round(idle, 6), round(busy, 6)) == (0.25, 1.5)
    assert round(grading.in_step_bound(idle, busy, 2), 4) == round(2 / 1.375, 4)
    assert grading.in_step_bound(0.0, 1.0, 2) == 2.0
    assert grading.waits([]) is None


@pytest.mark.slow
def test_machine_benchmark_prints_each_workload():
    out = _run_script("machine.py", "--seconds", "0.2", "--repeat", "1")
    rows = re.findall(r"^\s+(interpreter|objects|import torch)\s+alone\s+[\d.]+ s, two at once\s+[\d.]+ s: ([\d.]+)x",
                      out, flags=re.M)
    assert [name for name, _ in rows] == ["interpreter", "objects", "import torch"], out
    assert all(float(ratio) > 0 for _, ratio in rows), out


@pytest.mark.slow
def test_overlap_trace_benchmark_prints_each_rank():
    out = _run_script("overlap_trace.py", "--steps", "1")
    rows = re.findall(r"^\s+0\s+(\d)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, flags=re.M)
    assert [rank for rank, *_ in rows] == ["0", "1"], out
    assert all(0 <= float(a) <= 1 and 0 <= float(b) <= 1 for _, a, b, _ in rows), out
    assert re.search(r"largest difference: [\d.]+", out), out


@pytest.mark.slow
@pytest.mark.timing
def test_latency_benchmark_prints_each_event():
    out = _run_script("latency.py", "--world-size", "2", "--repeats", "1")
    rows = re.findall(r"^  (a rank raises|a rank exits|the time-out passes|Ctrl-C)[^\d]*([\d.]+)\s+([\d.]+)x$", out,
                      flags=re.M)
    assert [event for event, _, _ in rows] == ["a rank raises", "a rank exits", "the time-out passes", "Ctrl-C"], out
    assert all(float(ms) >= 0 and float(ratio) >= 0 for _, ms, ratio in rows), out


def test_netsim_benchmark_prints_each_algorithm():
    out = _run_script("netsim.py", "--ranks", "64", "--repeats", "1")
    rows = re.findall(r"^  (\w+)\s+(\d+)\s+([\d.]+)(?:\s+[\d.]+ ms,\s+([\d.]+)x)?$", out, flags=re.M)
    assert [name for name, *_ in rows] == ["ring", "naive", "recursive_doubling", "parameter_server"], out
    assert [bool(ratio) for *_, ratio in rows] == [True, False, True, False], out  # the one-to-one ones, walked too
