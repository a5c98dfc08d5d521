"""The GPU suite: what a GPU changes, on a real one. ``./course test -m gpu`` runs it; each of its tests skips,
saying why, where torch has no CUDA or sees no GPU (README, "For maintainers", says what it needs and how to run it
on a machine without a package index). It needs one GPU; what it checks:

* ``labsupport.run`` with NCCL on one rank: the rank on ``cuda:0``, ``labsupport.device()``, results back in the
  notebook as CPU tensors wherever they sit, the one-rank all-reduce timed with CUDA events (its figures printed);
* the tap's device check: a CPU tensor given to an NCCL call is stopped with the course's message;
* gloo on CUDA tensors, 2 to 4 ranks sharing the one GPU: which collectives take them (below), and that
  point-to-point messages do not;
* the notebook's own process (this one) never initialises CUDA, and never loads the CUDA driver;
* the demos in ``demos/`` and the lesson notebooks that pick a device, top to bottom in a kernel, on this machine;
* grading a class: the checks run on gloo on the CPU and no process of the grading run touches the GPU.

Which gloo collectives take CUDA tensors (ProcessGroupGloo in torch 2.x, ``torch/csrc/distributed/c10d``): broadcast,
all_reduce, reduce, all_gather, all_gather_into_tensor, gather, scatter, all_to_all_single, and reduce_scatter_tensor
(an all-reduce of a copy underneath, so SUM only); each copies the tensors to pinned host memory on a side stream,
runs the CPU algorithm, and copies back. Not send, recv, isend, irecv or batch_isend_irecv: gloo's transport is
given the tensor's memory as it is, which must be host memory. The course relies on none of them with CUDA tensors:
under gloo, ``labsupport.device()`` is the CPU, and the demos keep their gloo runs on the CPU.

Figures for a closing note (the GPU's name, the one-rank NCCL all-reduce bandwidth, the demos' step times) are
printed: run with ``-rA`` (or ``-s``) to see them.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import labsupport
from labsupport import tap

ROOT = Path(__file__).resolve().parents[1]
DEMOS = ROOT / "demos"
CUDA_0 = torch.device("cuda", 0)

# ----------------------------------------------------------------------------------------------------------------
# is there a GPU? asked of another process: this one stands for the notebook, which must never load CUDA


def _probe_gpus() -> dict:
    """``torch.cuda.is_available()``, the GPU count and names, from a short-lived Python: asking here would load the
    CUDA driver into this process, which the tests below check stays free of it. ``reason`` says why not, if not."""
    if not torch.backends.cuda.is_built():
        return {"reason": f"torch {torch.__version__} is a build without CUDA. The GPU suite needs the Python that has "
                          "your CUDA build of torch: COURSE_VENV=none ./course test -m gpu, run in that environment"}
    code = ("import json, torch; ok = torch.cuda.is_available(); n = torch.cuda.device_count() if ok else 0; "
            "print(json.dumps({'count': n, 'names': [torch.cuda.get_device_name(i) for i in range(n)], "
            "'cuda': torch.version.cuda, 'torch': torch.__version__}))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
        found = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"reason": f"could not ask torch about the GPUs ({type(exc).__name__}: {exc})"}
    if not found["count"]:
        return {"reason": f"torch.cuda.is_available() is False (torch {found['torch']}, CUDA {found['cuda']}, "
                          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): no GPU to test on"}
    return found


_GPUS: dict = {}


@pytest.fixture(scope="session")
def gpus():
    """The GPUs of this machine ({count, names, cuda, torch}); skips the test, saying why, where there are none."""
    if not _GPUS:
        _GPUS.update(_probe_gpus())
        if "reason" not in _GPUS:
            labsupport.shutdown()  # workers that served tests run without GPUs (conftest.py) start afresh
            print(f"GPU suite on {_GPUS['count']} x {_GPUS['names'][0]} (torch {_GPUS['torch']}, "
                  f"CUDA {_GPUS['cuda']})")
    if "reason" in _GPUS:
        pytest.skip(_GPUS["reason"])
    return _GPUS


def on_the_gpu(test):
    """A test of the GPU suite: selected by ``-m gpu``, skipped with the reason where there is no GPU."""
    return pytest.mark.gpu(pytest.mark.usefixtures("gpus", "notebook_stays_off_cuda")(test))


def _loads_cuda(pid="self") -> bool:
    """Whether a process has loaded the CUDA driver (libcuda), which any use of CUDA does, even a device count."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return "libcuda.so" in maps.read()
    except OSError:
        return False


_DRIVER_AT_START = _loads_cuda()


@pytest.fixture
def notebook_stays_off_cuda():
    """After each test: this process, which stands for the notebook, has not initialised CUDA, nor loaded its
    driver (unless something had already before the suite started)."""
    yield
    assert not torch.cuda.is_initialized(), "CUDA was initialised in the notebook's own process"
    if not _DRIVER_AT_START:
        assert not _loads_cuda(), "the CUDA driver was loaded into the notebook's own process"


# ----------------------------------------------------------------------------------------------------------------
# NCCL on one rank


class Box:
    """An object of the notebook's own class holding a tensor: results need not be plain containers."""

    def __init__(self, tensor):
        self.tensor = tensor


def _nccl_rank():
    dev = labsupport.device()
    x = torch.arange(4.0, device=dev)
    dist.all_reduce(x)  # one rank: the sum is x itself
    layer = torch.nn.Linear(3, 2).to(dev)
    return {
        "device": str(dev), "backend": dist.get_backend(), "local rank": os.environ["LOCAL_RANK"],
        "cuda initialised here": torch.cuda.is_initialized(), "current device": torch.cuda.current_device(),
        "x": x, "in a list": [x, (x * 2,)], "state_dict": layer.state_dict(), "max": x.max(dim=0),
        "box": Box(x + 1), "parameter": layer.weight,
    }


@on_the_gpu
def test_nccl_on_one_rank_runs_on_cuda_0_and_results_come_back_as_cpu_tensors():
    [out] = labsupport.run(_nccl_rank, world_size=1, backend="nccl", timeout=120)
    assert (out["device"], out["backend"], out["local rank"]) == ("cuda:0", "nccl", "0"), out
    assert out["cuda initialised here"] and out["current device"] == 0
    tensors = [out["x"], *out["in a list"][:1], out["in a list"][1][0], *out["state_dict"].values(),
               out["max"].values, out["max"].indices, out["box"].tensor, out["parameter"]]
    for t in tensors:
        assert t.device.type == "cpu", f"a result came back on {t.device}"
    assert torch.equal(out["x"], torch.arange(4.0)) and torch.equal(out["in a list"][1][0], torch.arange(4.0) * 2)
    assert type(out["state_dict"]).__name__ == "OrderedDict" and list(out["state_dict"]) == ["weight", "bias"]
    assert (out["max"].values.item(), out["max"].indices.item()) == (3.0, 3)
    assert torch.equal(out["box"].tensor, torch.arange(4.0) + 1) and out["parameter"].shape == (2, 3)


def _all_reduce_times(sizes, warmup, iters):
    from labsupport import gpu_demos

    seconds = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, device=labsupport.device())
        seconds.append(gpu_demos.timed(lambda x=x: dist.all_reduce(x), warmup=warmup, iters=iters))
    return torch.cuda.get_device_name(labsupport.device()), seconds


@on_the_gpu
def test_one_rank_nccl_all_reduce_is_timed_with_cuda_events():
    """The figures of a one-rank all-reduce. nccl-tests' bus bandwidth is algbw * 2(n-1)/n: zero on one rank, where
    no byte crosses a link; algbw then measures NCCL's own local pass over the buffer on the GPU."""
    from labsupport import gpu_demos

    sizes = [1 << k for k in (20, 24, 28)]  # 1 MiB, 16 MiB, 256 MiB
    [(name, seconds)] = labsupport.run(_all_reduce_times, sizes, 5, 20, world_size=1, backend="nccl", timeout=300)
    print(f"one-rank NCCL all-reduce on {name} (median of 20, CUDA events):")
    for nbytes, t in zip(sizes, seconds):
        assert math.isfinite(t) and 0 <= t < 10, seconds
        if t == 0:  # NCCL may skip an in-place all-reduce of one rank entirely
            print(f"  {nbytes / 2**20:6.0f} MiB: no time between the CUDA events, busbw 0 GB/s")
            continue
        algbw, busbw = gpu_demos.bus_bandwidth(nbytes, t, 1)
        print(f"  {nbytes / 2**20:6.0f} MiB: {t * 1e6:9.1f} us, algbw {algbw / 1e9:8.1f} GB/s, busbw {busbw:.0f} GB/s")
        assert busbw == 0


# ----------------------------------------------------------------------------------------------------------------
# the device check, and which backend and device labsupport picks here


def _cpu_tensor_to_nccl(level):
    x = torch.ones(4)  # on the CPU, in an NCCL run
    if level == "api":
        dist.all_reduce(x)
    else:
        dist.group.WORLD.broadcast(x, 0)


@on_the_gpu
@pytest.mark.parametrize("level", ["api", "pg"])
def test_a_cpu_tensor_given_to_an_nccl_call_is_stopped_with_the_course_message(level):
    with pytest.raises(labsupport.WorkerError) as err:
        labsupport.run(_cpu_tensor_to_nccl, level, world_size=1, backend="nccl", timeout=120)
    kind = "all_reduce" if level == "api" else r"\w+"
    expected = tap.wrong_device_message(0, "KIND", torch.device("cpu"), CUDA_0)
    assert re.search(re.escape(expected).replace("KIND", kind), err.value.exc_message), err.value.exc_message
    assert err.value.exc_type == "RuntimeError"
    assert labsupport.run(lambda: str(labsupport.device()), world_size=1, backend="nccl") == ["cuda:0"]


def _where():
    return str(labsupport.device()), dist.get_backend()


@on_the_gpu
def test_auto_picks_nccl_only_with_a_gpu_per_rank_and_device_follows(gpus):
    assert labsupport.device() == torch.device("cpu")  # the notebook itself
    for world in (1, 2, 3):
        got = labsupport.run(_where, world_size=world, timeout=120)
        if world <= gpus["count"]:
            assert got == [(f"cuda:{r}", "nccl") for r in range(world)], (world, got)
        else:
            assert got == [("cpu", "gloo")] * world, (world, got)
    assert labsupport.run(_where, world_size=1, backend="gloo") == [("cpu", "gloo")]


# ----------------------------------------------------------------------------------------------------------------
# gloo on CUDA tensors: 2-4 ranks sharing the one GPU


def _gloo_collectives_on_cuda():
    import warnings

    warnings.simplefilter("ignore", FutureWarning)  # newer torch renames two of the collectives below
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = CUDA_0  # gloo's labsupport.device() is the CPU: this rank chooses the GPU itself
    mine = torch.full((2,), float(rank + 1), device=dev)
    out = {}

    def attempt(name, fn):
        try:
            result = fn()
            ok = all(t.device == dev for t in (result if isinstance(result, list) else [result]))
            out[name] = ("ok" if ok else "moved", result)
        except Exception as exc:  # noqa: BLE001 - what is refused is the finding
            out[name] = ("refused", f"{type(exc).__name__}: {str(exc).splitlines()[0]}")

    def broadcast():
        t = mine.clone()
        dist.broadcast(t, src=n - 1)
        return t

    def all_reduce_sum():
        t = mine.clone()
        dist.all_reduce(t)
        return t

    def all_reduce_max():
        t = mine.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def reduce():
        t = mine.clone()
        dist.reduce(t, dst=0)
        return t

    def all_gather():
        parts = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(parts, mine)
        return parts

    def all_gather_into_tensor():
        t = torch.empty(2 * n, device=dev)
        dist.all_gather_into_tensor(t, mine)
        return t

    def gather():
        parts = [torch.empty_like(mine) for _ in range(n)] if rank == 0 else None
        dist.gather(mine, parts, dst=0)
        return parts if rank == 0 else mine

    def scatter():
        t = torch.empty_like(mine)
        chunks = [torch.full((2,), 10.0 * (i + 1), device=dev) for i in range(n)] if rank == 0 else None
        dist.scatter(t, chunks, src=0)
        return t

    def all_to_all_single():
        t = torch.empty(n, device=dev)
        dist.all_to_all_single(t, torch.arange(n, device=dev, dtype=torch.float32) + 100 * rank)
        return t

    def reduce_scatter_tensor():
        t = torch.empty(2, device=dev)
        dist.reduce_scatter_tensor(t, torch.arange(2.0 * n, device=dev) * (rank + 1))
        return t

    for fn in (broadcast, all_reduce_sum, all_reduce_max, reduce, all_gather, all_gather_into_tensor, gather,
               scatter, all_to_all_single, reduce_scatter_tensor):
        attempt(fn.__name__, fn)
        dist.barrier()
    return out


TAKE_CUDA = ["broadcast", "all_reduce_sum", "all_reduce_max", "reduce", "all_gather", "all_gather_into_tensor",
             "gather", "scatter", "all_to_all_single", "reduce_scatter_tensor"]


@on_the_gpu
@pytest.mark.parametrize("n", [2, 3, 4])
def test_gloo_collectives_take_cuda_tensors_on_ranks_sharing_one_gpu(n):
    per_rank = labsupport.run(_gloo_collectives_on_cuda, world_size=n, backend="gloo", timeout=180)
    outcome = {name: per_rank[0][name][0] for name in TAKE_CUDA}
    print(f"gloo on cuda:0, {n} ranks: " + ", ".join(f"{k} {v}" for k, v in outcome.items()))
    refused = {k: per_rank[0][k][1] for k, v in outcome.items() if v != "ok"}
    assert not refused, f"gloo did not take CUDA tensors for: {refused} (correct the list in this file's docstring)"
    total = sum(range(1, n + 1))
    for rank, got in enumerate(per_rank):
        value = {k: v[1] for k, v in got.items()}
        assert torch.equal(value["broadcast"], torch.full((2,), float(n)))
        assert torch.equal(value["all_reduce_sum"], torch.full((2,), float(total)))
        assert torch.equal(value["all_reduce_max"], torch.full((2,), float(n)))
        if rank == 0:
            assert torch.equal(value["reduce"], torch.full((2,), float(total)))
            assert [p.tolist() for p in value["gather"]] == [[i + 1.0] * 2 for i in range(n)]
        assert [p.tolist() for p in value["all_gather"]] == [[i + 1.0] * 2 for i in range(n)]
        assert value["all_gather_into_tensor"].tolist() == [float(i // 2 + 1) for i in range(2 * n)]
        assert torch.equal(value["scatter"], torch.full((2,), 10.0 * (rank + 1)))
        assert value["all_to_all_single"].tolist() == [rank + 100.0 * i for i in range(n)]
        assert value["reduce_scatter_tensor"].tolist() == [float(total * (2 * rank + j)) for j in range(2)]


def _gloo_send_recv_on_cuda():
    t = torch.full((4,), float(dist.get_rank()), device=CUDA_0)
    if dist.get_rank() == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    return t


@on_the_gpu
def test_gloo_point_to_point_does_not_take_cuda_tensors():
    """What a from-scratch collective written with send/recv would meet with CUDA tensors under gloo: an error or a
    rank that never returns, reported by labsupport either way; the next call works."""
    with pytest.raises((labsupport.WorkerError, labsupport.WorkerTimeout)) as err:
        labsupport.run(_gloo_send_recv_on_cuda, world_size=2, backend="gloo", timeout=30)
    print(f"gloo send/recv of a CUDA tensor: {type(err.value).__name__}: {str(err.value).splitlines()[0]}")
    assert labsupport.run(_where, world_size=2, backend="gloo") == [("cpu", "gloo")] * 2


@on_the_gpu
def test_workers_kept_between_calls_go_from_nccl_to_gloo_on_cuda_and_back():
    for _ in range(2):
        assert labsupport.run(_where, world_size=1, backend="nccl") == [("cuda:0", "nccl")]
        got = labsupport.run(_gloo_collectives_on_cuda, world_size=2, backend="gloo", timeout=180)
        status, value = got[1]["all_reduce_sum"]
        assert status == "ok" and torch.equal(value, torch.full((2,), 3.0)), got[1]["all_reduce_sum"]
    labsupport.shutdown()
    assert labsupport.run(_where, world_size=1, backend="nccl") == [("cuda:0", "nccl")]


@on_the_gpu
def test_the_judges_fork_server_with_dynamo_preloaded_still_forks_nccl_workers():
    """A grading judge's fork server imports torch._dynamo too (``LABSUPPORT_PRELOAD_DYNAMO=1``): nothing it imports
    may initialise CUDA, or every rank forked from it would fail to use the GPU."""
    code = ("import labsupport; print(labsupport.run(lambda: str(labsupport.device()), world_size=1, "
            "backend='nccl', timeout=120))")
    env = dict(os.environ, LABSUPPORT_PRELOAD_DYNAMO="1", LABSUPPORT_EARLY_START="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "['cuda:0']" in proc.stdout, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------------------------------------
# notebooks in a kernel, on this machine

PROBE_CELL = """\
import torch as _torch
with open("/proc/self/maps") as _maps:
    print("CUDA in this kernel:", _torch.cuda.is_initialized(), "libcuda.so" in _maps.read())
"""


def _execute(path: Path, monkeypatch, timeout: float = 600) -> tuple[str, float]:
    """Run a notebook top to bottom in a fresh kernel (its folder as working directory), with a last cell that says
    whether the kernel itself used CUDA; returns the text of its outputs and the seconds it took."""
    nbformat = pytest.importorskip("nbformat", reason="the notebooks are run with nbformat, nbclient and ipykernel")
    nbclient = pytest.importorskip("nbclient", reason="the notebooks are run with nbformat, nbclient and ipykernel")
    pytest.importorskip("ipykernel", reason="the notebooks are run with nbformat, nbclient and ipykernel")
    # the kernel imports this checkout's labsupport, however the suite was installed (PYTHONPATH=. works too)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE_CELL))
    start = time.monotonic()
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds = time.monotonic() - start
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    # the driver's library counts only where importing torch does not load it already (as in this process)
    assert ("CUDA in this kernel: False" if _DRIVER_AT_START else "CUDA in this kernel: False False") in text, \
        text[-2000:]
    return text, seconds


@on_the_gpu
@pytest.mark.slow
@pytest.mark.parametrize("name", ["nccl_vs_gloo", "ddp_on_gpus", "fsdp_memory"])
def test_demo_notebook_runs_top_to_bottom_on_this_gpu_machine(name, gpus, monkeypatch):
    text, seconds = _execute(DEMOS / f"{name}.ipynb", monkeypatch)
    print(f"--- demos/{name}.ipynb on {gpus['count']} x {gpus['names'][0]}, {seconds:.0f} s ---\n{text}")
    if gpus["count"] >= 2:
        assert "the workers run NCCL" in text
    elif name == "ddp_on_gpus":
        # the one-GPU branch: a step timed with CUDA events on the GPU, the all-reduce modelled and said to be
        assert "one GPU found" in text and "measured on cuda:0 alone" in text, text
        assert "compute ms (measured)" in text and "all-reduce ms (model)" in text and "not measured" in text
        step = re.search(r"forward ([\d.]+) ms, backward ([\d.]+) ms, optimizer step ([\d.]+) ms", text)
        assert step and all(float(v) > 0 for v in step.groups()), text
    else:
        assert "only one GPU (NCCL needs one GPU per rank)" in text and "CPU only:" in text, text


def _picks_a_device(source: str) -> bool:
    """A cell whose work lands on a GPU on a one-GPU machine: a one-rank run (backend "auto" is NCCL there), an
    explicit NCCL backend, or CUDA named."""
    return bool(re.search(r"world_size=1\b|-n 1\b|nccl|cuda|labsupport\.device\(", source))


def _lessons_that_pick_a_device() -> list[str]:
    found = []
    for path in sorted((ROOT / "solutions").glob("*/*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        if any(c["cell_type"] == "code" and _picks_a_device("".join(c["source"])) for c in cells):
            found.append(path.parent.name)
    return found


@on_the_gpu
@pytest.mark.slow
@pytest.mark.parametrize("aid", _lessons_that_pick_a_device())
def test_lesson_notebook_that_picks_a_device_runs_top_to_bottom_on_this_gpu_machine(aid, monkeypatch):
    """With one GPU, a lesson's one-rank runs go to NCCL on cuda:0 (``backend="auto"``); its other runs stay on gloo.
    With two GPUs or more, every run of as many ranks would be NCCL's: that needs a machine this suite does not
    assume."""
    _, seconds = _execute(ROOT / "solutions" / aid / f"{aid}.ipynb", monkeypatch)
    print(f"solutions/{aid} top to bottom on this GPU machine: {seconds:.0f} s")


# ----------------------------------------------------------------------------------------------------------------
# grading on a GPU machine


def _cuda_users(root: int) -> set:
    """Processes of the tree under ``root`` that have loaded the CUDA driver."""
    import psutil

    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return set()
    found = set()
    for p in procs:
        if _loads_cuda(p.pid):
            try:
                found.add((p.pid, " ".join(p.cmdline())[:120]))
            except psutil.Error:
                found.add((p.pid, "?"))
    return found


@on_the_gpu
@pytest.mark.slow
def test_grading_on_a_gpu_machine_runs_the_checks_on_gloo_and_leaves_the_gpu_alone(tmp_path):
    """01's checks run every collective on one rank too: on a GPU machine backend "auto" would make that rank NCCL's
    on cuda:0, where the checks' CPU tensors are refused. The checks ask for gloo, and grading hides the GPUs from
    its kernels, judges and their workers: no process of the run loads the CUDA driver (sampled while it runs)."""
    pytest.importorskip("nbgrader", reason="grading needs nbgrader (the wheelhouse of tests/gpu_wheelhouse.py has it)")
    import nbformat

    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    import demo_submissions as demo

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    aid, subs, out = "01_collectives", tmp_path / "subs", tmp_path / "out"  # its checks use 1 to 5 ranks
    (subs / "ada" / aid).mkdir(parents=True)
    nbformat.write(demo.good(aid, ROOT), subs / "ada" / aid / f"{aid}.ipynb")
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "autograder", "grade", str(subs), "--out", str(out), "--course",
                             str(ROOT)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, done = set(), threading.Event()

    def watch():
        while not done.is_set():
            seen.update(_cuda_users(proc.pid))
            done.wait(0.5)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        output, _ = proc.communicate(timeout=600)
    finally:
        done.set()
        watcher.join()
    assert proc.returncode == 0, output
    print(f"graded {aid} on this GPU machine: {time.monotonic() - start:.0f} s")
    if _DRIVER_AT_START:  # importing torch loads the driver here: its library says nothing about its use
        print("the CUDA driver is loaded with torch on this machine: no process is checked for it")
    else:
        assert not seen, f"processes of the grading run loaded the CUDA driver: {sorted(seen)}"
    row = demo.read_grades(out / "grades.csv")[("ada", aid)]
    assert row["status"] == "ok" and float(row["points"]) == float(row["max_points"]) > 0, row


# ----------------------------------------------------------------------------------------------------------------
# without a GPU: grading keeps to the CPU by construction


def test_grading_hides_the_gpus_from_its_kernels_and_judges():
    from autograder.execute import kernel_env
    from autograder.judge import judge_env

    for env in (kernel_env(), judge_env(ROOT)):
        assert env["CUDA_VISIBLE_DEVICES"] == ""


def test_the_checks_ask_for_gloo_whatever_the_machine(monkeypatch):
    """The checks' tensors are CPU tensors: their runs name gloo rather than leave "auto" to pick NCCL."""
    from autograder import stand_ins
    from autograder.checks import _common
    from autograder.checks import launch as launch_checks

    asked = []

    def fake_run(fn, *args, world_size=4, backend="auto", timeout=60.0, **kwargs):
        asked.append(backend)
        return [("return", 3, args[1] if len(args) > 1 else (), {})] * world_size

    monkeypatch.setattr(labsupport, "run", fake_run)
    _common.run_on_workers(print, world_size=1, what="x")
    launch_checks._run_one(print, what="x", timeout=1)
    assert stand_ins._stand_in(lambda: 3, timeout=1)() == 3
    assert asked == ["gloo"] * 3
