"""labsupport.run seen from outside: a real Jupyter kernel, interrupts, a killed kernel, the fork/OpenMP trap,
and the same script under torchrun."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import nbformat
import psutil
import pytest
from jupyter_client import KernelManager
from nbclient import NotebookClient

SLACK = 3.0


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _wait_gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    return alive


def test_kernel_ran_parallel_matmuls_before_launching(tmp_path):
    """The fork/OpenMP trap: the parent's thread pool is live, workers still compute (no hang)."""
    script = _script(
        tmp_path,
        """
        import torch, torch.distributed as dist, labsupport
        torch.set_num_threads(2)
        a = torch.randn(1500, 1500)
        for _ in range(5):
            a = (a @ a).tanh()          # GNU OpenMP's pool is now running in this process
        def work():
            b = torch.randn(400, 400)
            for _ in range(5):
                b = (b @ b).tanh()
            x = torch.tensor([b.sum().item() * 0 + 1.0])
            dist.all_reduce(x)
            return x.item()
        print("RESULT", labsupport.run(work, world_size=2, timeout=60))
        """,
    )
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "RESULT [2.0, 2.0]" in out.stdout


def test_interrupt_stops_every_worker_and_the_next_call_works(tmp_path):
    script = _script(
        tmp_path,
        """
        import signal, sys, time, torch, torch.distributed as dist, labsupport
        from labsupport import launch
        # as in a Jupyter kernel, Ctrl-C raises KeyboardInterrupt, even if this process was started with SIGINT
        # ignored (as a background job of a non-interactive shell is)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        def deadlock():
            t = torch.zeros(1)
            dist.recv(t, src=1 - dist.get_rank())
        labsupport.run(lambda: dist.get_rank(), world_size=2)
        print("PIDS", *[w.process.pid for w in launch._POOL.workers.values()], flush=True)
        try:
            labsupport.run(deadlock, world_size=2, timeout=120)
        except KeyboardInterrupt:
            print("INTERRUPTED", time.monotonic(), flush=True)
        print("NEXT", labsupport.run(lambda: dist.get_rank() * 10, world_size=2), flush=True)
        """,
    )
    proc = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), line + proc.stderr.read()
        pids = [int(p) for p in line.split()[1:]]
        time.sleep(1.0)  # both ranks are now blocked in recv
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        line = proc.stdout.readline()
        assert line.startswith("INTERRUPTED"), line
        assert float(line.split()[1]) - sent < 2 + SLACK
        assert _wait_gone(pids, timeout=5) == []
        assert proc.stdout.readline().strip() == "NEXT [0, 10]"
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_nothing_survives_a_killed_kernel(tmp_path):
    script = _script(
        tmp_path,
        """
        import os, signal, psutil, torch.distributed as dist, labsupport
        labsupport.run(lambda: dist.get_rank(), world_size=3)
        kids = [p.pid for p in psutil.Process().children(recursive=True)]
        print("PIDS", *kids, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL
    pids = [int(p) for p in out.stdout.split("PIDS", 1)[1].split()]
    assert len(pids) >= 3  # three workers, and multiprocessing's fork server
    assert _wait_gone(pids, timeout=10) == []


def test_same_script_runs_under_torchrun(tmp_path):
    script = _script(
        tmp_path,
        """
        import os, torch, torch.distributed as dist, labsupport
        def work(scale):
            x = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(x)
            return x.item() * scale
        results = labsupport.run(work, 10, world_size=2)
        print(f"RANK {os.environ['RANK']} RESULTS {results} DEVICE {labsupport.device()}", flush=True)
        """,
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RANK 0 RESULTS [30.0] DEVICE cpu" in out.stdout
    assert "RANK 1 RESULTS [30.0] DEVICE cpu" in out.stdout


NOTEBOOK_CELLS = [
    "import torch, torch.distributed as dist, labsupport\n%load_ext labsupport",
    # 1: a function defined in the notebook
    "def total(k):\n    x = torch.tensor([float(dist.get_rank())])\n    dist.all_reduce(x)\n"
    "    print('partial', dist.get_rank())\n    return x.item() * k\nlabsupport.run(total, 2, world_size=3)",
    # 2: %%distributed uses the notebook's function and imports
    "def double(v):\n    return 2 * v",
    "%%distributed -n 2\nx = torch.tensor([double(float(rank))])\ndist.all_reduce(x)\n"
    "print('sum', x.item(), 'of', world_size)",
    # 4: a failure
    "def bad():\n    if dist.get_rank() == 1:\n        raise KeyError('missing key on purpose')\n"
    "    dist.barrier()\nlabsupport.run(bad, world_size=2)",
    # 5: a deadlock in a %%distributed cell
    "%%distributed -n 2 --timeout 2\nt = torch.zeros(1)\ndist.recv(t, src=1 - rank)",
    # 6: recovery
    "print('recovered', labsupport.run(total, 1, world_size=2))",
    # 7: a usage error
    "%%distributed -n two\nprint(rank)",
]


def _text(cell):
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] == "execute_result":
            parts.append(out["data"].get("text/plain", ""))
        elif out["output_type"] == "error":
            parts.append(out["ename"] + ": " + out["evalue"] + "\n" + "\n".join(out["traceback"]))
    return "".join(parts)


def test_run_and_magic_from_a_real_jupyter_kernel(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in NOTEBOOK_CELLS]
    NotebookClient(nb, timeout=120, allow_errors=True, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    c = nb.cells
    assert "[6.0, 6.0, 6.0]" in _text(c[1])
    for r in range(3):
        assert f"[rank {r}] partial {r}" in _text(c[1])
    assert "[rank 0] sum 2.0 of 2" in _text(c[3]) and "[rank 1] sum 2.0 of 2" in _text(c[3])
    err = _text(c[4])
    assert "WorkerError" in err and "rank 1 raised KeyError" in err and "missing key on purpose" in err
    assert "Cell In[" in err  # the traceback points at the notebook cell
    timeout = _text(c[5])
    assert "WorkerTimeout" in timeout
    assert "rank 0: blocked in recv, at <distributed cell" in timeout and "dist.recv(t, src=1 - rank)" in timeout
    assert "recovered [1.0, 1.0]" in _text(c[6])
    assert "UsageError" in _text(c[7]) and "Usage: %%distributed -n N" in _text(c[7])


def test_kernel_interrupt_during_a_run(tmp_path):
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        setup = (
            "import torch, torch.distributed as dist, labsupport\n"
            "def stuck():\n    t = torch.zeros(1)\n    dist.recv(t, src=1 - dist.get_rank())\n"
            "labsupport.run(lambda: 0, world_size=2)"
        )
        assert kc.execute_interactive(setup, timeout=120)["content"]["status"] == "ok"
        msg_id = kc.execute("labsupport.run(stuck, world_size=2, timeout=300)")
        time.sleep(2.0)
        sent = time.monotonic()
        km.interrupt_kernel()
        while True:
            reply = kc.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert time.monotonic() - sent < 2 + SLACK
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        again = kc.execute_interactive("assert labsupport.run(lambda: 5, world_size=2) == [5, 5]", timeout=120)
        assert again["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_same_script_runs_under_srun_environment(tmp_path):
    """What srun sets (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID) is turned into RANK & co."""
    import socket

    script = _script(
        tmp_path,
        """
        import os, torch, torch.distributed as dist, labsupport
        def work():
            x = torch.ones(1)
            dist.all_reduce(x)
            return (dist.get_rank(), os.environ["LOCAL_RANK"], os.environ["NODE_RANK"], x.item())
        print("RESULT", labsupport.run(work, world_size=2), flush=True)
        """,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODEID=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
            env.pop(key, None)
        procs.append(subprocess.Popen([sys.executable, script], env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert "RESULT [(0, '0', '0', 2.0)]" in outs[0]
    assert "RESULT [(1, '0', '1', 2.0)]" in outs[1]
