"""The multi-GPU demos in ``demos/`` run top to bottom on this CPU-only machine (gloo, shrunk sizes, saying so), and
the NCCL path's behaviour that needs no GPU is pinned with the GPU count mocked: ``device()`` is ``cuda:LOCAL_RANK``,
``torch.cuda.set_device`` comes before the process group, a tensor on the wrong device gets a clear error."""

import os
import pickle
import time
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import labsupport
from labsupport import _env, _worker, gpu_demos, tap

DEMOS = Path(__file__).resolve().parents[1] / "demos"
NAMES = ["nccl_vs_gloo", "ddp_on_gpus", "fsdp_memory"]


# ----------------------------------------------------------------------------------------------------------------
# the notebooks, executed in a fresh kernel


@pytest.mark.parametrize("name", NAMES)
def test_demo_runs_top_to_bottom_on_the_cpu_and_says_what_would_differ(name):
    import nbformat
    from nbclient import NotebookClient

    path = DEMOS / f"{name}.ipynb"
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # committed without outputs
        assert cell.cell_type != "code" or (not cell.outputs and cell.execution_count is None), f"{name}: outputs"
    first = next(c.source for c in nb.cells if c.cell_type == "code")  # install, count GPUs, say what runs where
    assert "%pip install" in first and 'find_spec("labsupport") is None' in first and "demo.runtime(" in first
    start = time.monotonic()
    NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(DEMOS)}}).execute()
    seconds = time.monotonic() - start
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "the workers run gloo on the CPU" in text
    assert "CPU only:" in text and "On " in text  # the plain statement of what a GPU runtime would show
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert seconds < 120, f"{name} took {seconds:.0f} s on the CPU"


def test_memory_demo_measures_the_formula_on_the_cpu():
    def work():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = gpu_demos.make_mlp(8, 2)
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        return gpu_demos.state_bytes(model, opt)

    psi = 2 * (8 * 8 + 8)
    for held in labsupport.run(work, world_size=2, backend="gloo"):
        assert held == gpu_demos.model_state_formula(psi, 2, stage=3)
    assert sum(gpu_demos.model_state_formula(psi, 2, stage=0).values()) == 16 * psi


def test_bus_bandwidth_follows_nccl_tests():
    algbw, busbw = gpu_demos.bus_bandwidth(1000, 0.5, 4)
    assert algbw == 2000 and busbw == pytest.approx(2000 * 2 * 3 / 4)


def test_runtime_picks_nccl_with_two_gpus_and_gloo_otherwise(monkeypatch):
    monkeypatch.setattr(gpu_demos, "_gpu_count", lambda: 8)
    rt = gpu_demos.runtime(max_ranks=2, verbose=False)
    assert (rt.backend, rt.world_size, rt.on_gpu) == ("nccl", 2, True)
    monkeypatch.setattr(gpu_demos, "_gpu_count", lambda: 1)
    rt = gpu_demos.runtime(verbose=False)
    assert (rt.backend, rt.world_size) == ("gloo", 2)
    assert "only one GPU" in gpu_demos.describe(rt)


# ----------------------------------------------------------------------------------------------------------------
# NCCL without a GPU: the GPU count and CUDA calls mocked


@pytest.fixture
def fake_gpus(monkeypatch):
    """A machine with 2 GPUs as labsupport counts them; CUDA calls recorded instead of made."""
    events = []
    monkeypatch.setattr(_env, "_gpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: events.append(("set_device", torch.device("cuda", d)
                                                                            if isinstance(d, int) else d)))
    saved_env, saved_threads = dict(os.environ), torch.get_num_threads()
    yield events
    os.environ.clear()
    os.environ.update(saved_env)
    torch.set_num_threads(saved_threads)
    _worker.CURRENT.clear()


def test_auto_backend_is_nccl_only_with_a_gpu_per_rank(fake_gpus):
    assert _env._resolve_backend("auto", 2) == "nccl"
    assert _env._resolve_backend("auto", 3) == "gloo"
    with pytest.raises(ValueError, match="one GPU per rank"):
        _env._resolve_backend("nccl", 3)


class _Conn:
    def __init__(self):
        self.sent = []

    def send_bytes(self, data):
        self.sent.append(pickle.loads(data))


def _device_in_worker():
    return str(labsupport.device())


def test_worker_sets_its_gpu_before_the_nccl_group_and_device_is_cuda_local_rank(fake_gpus, monkeypatch):
    """A labsupport.run worker: rank 1 of 2 under NCCL."""
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: fake_gpus.append(("init", backend)))
    monkeypatch.setattr(_worker, "_store", lambda addr, port, timeout: dist.HashStore())
    spec = {"rank": 1, "world_size": 2, "backend": "nccl", "master_addr": "127.0.0.1", "master_port": 1,
            "threads": torch.get_num_threads(), "pg_timeout": 5.0, "call_id": 7}
    conn = _Conn()
    _worker._run_task(conn, 7, spec, cloudpickle.dumps((_device_in_worker, (), {})), ())
    kind, call_id, data = conn.sent[-1][:3]
    assert kind == "result", conn.sent[-1]
    assert pickle.loads(data) == "cuda:1" and os.environ["LOCAL_RANK"] == "1"
    assert fake_gpus == [("set_device", torch.device("cuda", 1)), ("init", "nccl")]


def test_under_torchrun_set_device_comes_before_the_nccl_group(fake_gpus, monkeypatch):
    """A script started by torchrun: LOCAL_RANK 1 of a node with 2 GPUs."""
    os.environ.update(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: fake_gpus.append(("init", backend)))
    monkeypatch.setattr(_env.atexit, "register", lambda fn: None)
    assert _env._run_under_torchrun(lambda: "ran", (), {}, 5.0) == ["ran"]
    assert fake_gpus == [("set_device", torch.device("cuda", 1)), ("init", "nccl")]
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert labsupport.device() == torch.device("cuda", 1)


def test_one_visible_gpu_per_task_is_cuda_0_and_no_gpu_means_gloo(fake_gpus, monkeypatch):
    os.environ["LOCAL_RANK"] = "3"
    monkeypatch.setattr(_env, "_gpu_count", lambda: 1)  # SLURM's --gpus-per-task=1
    assert _env._local_cuda_index() == 0
    monkeypatch.setattr(_env, "_gpu_count", lambda: 0)
    assert _env._local_cuda_index() is None


# ----------------------------------------------------------------------------------------------------------------
# a tensor on the wrong device in an NCCL run


@pytest.fixture
def nccl_rank_1_on_cuda_0(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)


def test_a_tensor_off_the_ranks_gpu_is_refused_naming_rank_and_both_devices(nccl_rank_1_on_cuda_0):
    for t in (torch.ones(2), torch.ones(2, device="meta")):
        call = tap.Call("api", "all_reduce", (t,), {}, None, None)
        with pytest.raises(RuntimeError) as err:
            tap.DEVICE_CHECK.enter(call)
        message = str(err.value)
        assert message.startswith("rank 1: all_reduce") and f"on {t.device}" in message and "cuda:0" in message
        assert "labsupport.device()" in message
    listed = tap.Call("pg", "allgather", ([[torch.ones(1)]], [torch.ones(1)]), {}, None, None)
    with pytest.raises(RuntimeError, match="cuda:0"):
        tap.DEVICE_CHECK.enter(listed)


def test_gloo_runs_and_calls_without_tensors_are_left_alone(nccl_rank_1_on_cuda_0, monkeypatch):
    tap.DEVICE_CHECK.enter(tap.Call("api", "barrier", (), {}, None, None))
    # object collectives pickle what they are given: a CPU tensor as the object is fine under NCCL
    tap.DEVICE_CHECK.enter(tap.Call("api", "all_gather_object", ([None, None], torch.ones(2)), {}, None, None))
    tap.DEVICE_CHECK.enter(tap.Call("api", "broadcast_object_list", ([torch.ones(2)],), {}, None, None))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    tap.DEVICE_CHECK.enter(tap.Call("api", "all_reduce", (torch.ones(2),), {}, None, None))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    tap.DEVICE_CHECK.enter(tap.Call("api", "all_reduce", (torch.ones(2),), {}, None, None))


def _all_reduce_as_if_nccl():
    # what a rank of an NCCL run sees, on a machine without GPUs: CUDA in use, the group's backend NCCL
    torch.cuda.is_initialized = lambda: True
    torch.cuda.current_device = lambda: dist.get_rank()
    dist.get_backend = lambda group=None: "nccl"
    dist.all_reduce(torch.ones(4))  # on the CPU: refused before it goes out


def test_the_wrong_device_error_reaches_the_notebook_from_a_worker():
    with pytest.raises(labsupport.WorkerError) as err:
        labsupport.run(_all_reduce_as_if_nccl, world_size=2, backend="gloo", timeout=30)
    text = str(err.value)
    assert "this rank's device in this NCCL run is cuda:" in text and "tensor on cpu" in text
    assert "rank 0: all_reduce" in text or "rank 1: all_reduce" in text
