"""labsupport.run seen from outside: a real Jupyter kernel, interrupts, a killed kernel, the fork/OpenMP trap,
and the same script under torchrun.

How soon an interrupt gives control back is load-dependent: ``benchmarks/latency.py`` prints it. The tests here check
that the interrupt, not a time-out, ended the call; their waits for processes to go end as soon as they are gone.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import nbformat
import psutil
import pytest
from jupyter_client import KernelManager
from nbclient import NotebookClient



def _script(tmp_path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended). One look: a process can end between two."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids, timeout=60.0):
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.1)
    return alive


def test_kernel_ran_parallel_matmuls_before_launching(tmp_path):
    """The fork/OpenMP trap: the parent's OpenMP pool is live; workers still run parallel regions (no hang).

    Each worker uses two threads, so its matmuls and tanh run OpenMP parallel regions: in a process forked from
    this parent (rather than from the fork server) the first of them would wait forever for the parent's threads.
    """
    script = _script(
        tmp_path,
        """
        import torch, torch.distributed as dist, labsupport
        torch.set_num_threads(2)
        a = torch.randn(1000, 1000)
        for _ in range(3):
            a = (a @ a).tanh()          # GNU OpenMP's pool is now running in this process
        def work():
            torch.set_num_threads(2)
            assert torch.get_num_threads() == 2
            b = torch.randn(1000, 1000)
            for _ in range(2):
                b = (b @ b).tanh()      # parallel regions in the worker
            x = torch.tensor([b.sum().item() * 0 + 1.0])
            dist.all_reduce(x)
            return x.item(), torch.get_num_threads()
        print("RESULT", labsupport.run(work, world_size=2, timeout=30))
        print("ALONE", labsupport.run(work, world_size=1, timeout=30))
        """,
    )
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "RESULT [(2.0, 2), (2.0, 2)]" in out.stdout
    assert "ALONE [(1.0, 2)]" in out.stdout


@pytest.mark.timing
def test_interrupt_stops_every_worker_and_the_next_call_works(tmp_path):
    """Ctrl-C while both ranks are blocked in recv: a KeyboardInterrupt (not the WorkerTimeout that the call's 120 s
    would give), every worker gone, and the next call works."""
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
            print("INTERRUPTED", flush=True)
        print("NEXT", labsupport.run(lambda: dist.get_rank() * 10, world_size=2), flush=True)
        """,
    )
    proc = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), line + proc.stderr.read()
        pids = [int(p) for p in line.split()[1:]]
        _wait_blocked(pids)  # both ranks are now blocked in recv
        proc.send_signal(signal.SIGINT)
        line = proc.stdout.readline()
        assert line.startswith("INTERRUPTED"), line + proc.stderr.read()
        assert _wait_gone(pids) == []
        assert proc.stdout.readline().strip() == "NEXT [0, 10]"
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def _workers_of(pids: list[int]) -> list[int]:
    """The labsupport workers among a kernel's descendants (multiprocessing's helpers are not blocked in a call)."""
    import psutil

    found = []
    for pid in pids:
        try:
            if "forkserver" in " ".join(psutil.Process(pid).cmdline()) and \
                    "forkserver" in " ".join(psutil.Process(pid).parent().cmdline()):
                found.append(pid)
        except psutil.Error:
            pass
    return found


def _wait_blocked(pids: list[int], timeout: float = 60.0) -> None:
    """Until every process in ``pids`` has used no CPU for half a second (blocked, e.g. in a recv)."""
    import psutil

    procs = [psutil.Process(pid) for pid in pids]
    deadline = time.monotonic() + timeout
    before = [sum(p.cpu_times()[:2]) for p in procs]
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = [sum(p.cpu_times()[:2]) for p in procs]
        if now == before:
            return
        before = now
    raise AssertionError(f"processes {pids} still busy after {timeout:g} s")


def test_nothing_survives_a_killed_kernel(tmp_path):
    """SIGKILL of the kernel while its workers are deadlocked: they go, and the next kernel removes the folder."""
    script = _script(
        tmp_path,
        """
        import psutil, torch, torch.distributed as dist, labsupport
        from labsupport import launch
        def deadlock():
            t = torch.zeros(1)
            dist.recv(t, src=(dist.get_rank() + 1) % dist.get_world_size())
        labsupport.run(lambda: dist.get_rank(), world_size=3)
        print("PIDS", *[p.pid for p in psutil.Process().children(recursive=True)], flush=True)
        print("DIR", launch._POOL.tmpdir, flush=True)
        labsupport.run(deadlock, world_size=3, timeout=300)
        """,
    )
    # this test's own temporary folder (short: the fork server's socket lives there): in the machine's, any other
    # process's pool that starts meanwhile removes the dead kernel's folder before the next kernel is asked to
    tmp = tempfile.mkdtemp(prefix="lk-")
    try:
        env = dict(os.environ, TMPDIR=tmp)
        proc = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)
        try:
            line = proc.stdout.readline()
            assert line.startswith("PIDS"), line + proc.stderr.read()
            pids = [int(p) for p in line.split()[1:]]
            assert len(pids) >= 4  # three workers, multiprocessing's fork server and its resource tracker
            tmpdir = proc.stdout.readline().split(None, 1)[1].strip()
            _wait_blocked(_workers_of(pids))  # every rank is in its recv
            proc.kill()
            assert proc.wait(timeout=10) == -signal.SIGKILL
            assert _wait_gone(pids) == []
            assert os.path.isdir(tmpdir)  # nobody could clean up...
        finally:
            proc.kill()
        # what the next kernel's pool does first when it starts (run() calls it; without torch, this takes a moment)
        again = _script(tmp_path, "import shutil\nfrom labsupport import _pool\nshutil.rmtree(_pool._make_tmpdir())\n")
        out = subprocess.run([sys.executable, again], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        assert not os.path.exists(tmpdir)  # ...until the next kernel started its pool
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
    (tmp_path / "tmp").mkdir()   # the agent's log folders (torchelastic_*), removed with the test's folder
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path / "tmp"))
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


@pytest.mark.timing
def test_stray_torchrun_variables_fail_within_the_timeout(tmp_path):
    """RANK & co. left in the environment by mistake: run gives up after its timeout, not torch's 30 minutes.

    The process group is asked to wait the call's 1 s (torch's default, 30 minutes, would outlast this test's 120 s
    and fail it), and it did wait for the other rank that long: no earlier than 1 s, a bound load cannot break."""
    from labsupport._ports import free_port

    script = _script(
        tmp_path,
        """
        import time, torch.distributed as dist, labsupport
        asked = []
        init = dist.init_process_group
        dist.init_process_group = lambda *a, **k: asked.append(k.get("timeout")) or init(*a, **k)
        start = time.monotonic()
        try:
            labsupport.run(lambda: dist.get_rank(), world_size=2, timeout=1)
        except RuntimeError as exc:
            print("ERROR", time.monotonic() - start, asked, exc, flush=True)
        """,
    )
    port = free_port()
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.pop("TORCHELASTIC_RUN_ID", None)
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120, env=env)
    assert "ERROR" in out.stdout, out.stdout + out.stderr[-3000:]
    elapsed = float(out.stdout.split("ERROR", 1)[1].split()[0])
    assert elapsed >= 1
    assert "[datetime.timedelta(seconds=1)]" in out.stdout
    assert "took this process for rank 0 of a job started by torchrun" in out.stdout
    assert "the other ranks did not join within 1 s" in out.stdout and "del os.environ['RANK']" in out.stdout


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
    # 8: a failure in a %%distributed cell: its traceback names the cell as IPython does, with the cell's lines
    "%%distributed -n 2 --backend gloo\nx = rank\nif rank == 1:\n    raise ValueError('failed in a cell')",
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


@pytest.mark.timing
def test_run_and_magic_from_a_real_jupyter_kernel(tmp_path):
    """The deadlock cell's time-out reports once both ranks are blocked (``patience``, installed in the kernel by
    its first cell): the report is under test, not how fast a loaded machine gets the ranks to their recv."""
    import patience

    nb = nbformat.v4.new_notebook()
    cells = [patience.KERNEL_LINES + NOTEBOOK_CELLS[0]] + NOTEBOOK_CELLS[1:]
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
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
    # named like every cell (In[6] is the sixth cell run), line 3 of the cell as the notebook shows it
    assert "rank 0: blocked in recv(src=1) of 1 float32 at Cell In[6], line 3: dist.recv(t, src=1 - rank)" in timeout
    assert "rank 1: blocked in recv(src=0) of 1 float32 at Cell In[6], line 3: dist.recv(t, src=1 - rank)" in timeout
    assert "recovered [1.0, 1.0]" in _text(c[6])
    assert "UsageError" in _text(c[7]) and "Usage: %%distributed -n N" in _text(c[7])
    failed = _text(c[8])
    assert "rank 1 raised ValueError: failed in a cell" in failed
    assert 'File "Cell In[9]", line 4, in <module>' in failed and "raise ValueError('failed in a cell')" in failed
    assert "distributed cell" not in timeout + failed


def _plain(traceback_lines) -> list:
    """The lines a notebook shows for an error, without colours."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(traceback_lines)).splitlines()


FIRST_LINES_CELLS = [
    "import torch, torch.distributed as dist, labsupport\n%load_ext labsupport",
    "def bad():\n    if dist.get_rank() == 1:\n        x = 1 / 0\n    dist.barrier()\n"
    "labsupport.run(bad, world_size=2)",
    "%%distributed -n 2 --timeout 2\nt = torch.zeros(1)\ndist.recv(t, src=1 - rank)",
    "%%distributed -n 2\nif rank == 1:\n    raise ValueError('failed in a cell')",
]


@pytest.mark.timing
def test_errors_in_a_notebook_start_at_what_the_student_can_act_on(tmp_path):
    """No chained header, no launcher frame: the rank, its exception, the student's own line come first. (The
    deadlock cell reports once both ranks are blocked: ``patience``, installed by the first cell.)"""
    import patience

    nb = nbformat.v4.new_notebook()
    cells = [patience.KERNEL_LINES + FIRST_LINES_CELLS[0]] + FIRST_LINES_CELLS[1:]
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    NotebookClient(nb, timeout=120, allow_errors=True, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [[o for o in cell.outputs if o["output_type"] == "error"] for cell in nb.cells[1:]]
    assert [len(e) for e in errors] == [1, 1, 1]
    failed, deadlock, in_cell = (_plain(e[0]["traceback"]) for e in errors)
    assert failed[:5] == [
        "WorkerError: rank 1 raised ZeroDivisionError: division by zero",
        "",
        "Traceback on rank 1 (most recent call last):",
        '  File "Cell In[2]", line 3, in bad',
        "    x = 1 / 0",
    ], failed
    assert failed[-1] == "(labsupport.run was called at Cell In[2], line 5: labsupport.run(bad, world_size=2))"
    assert deadlock[0].startswith("WorkerTimeout: 2 of 2 ranks were still running after 2 s")
    assert deadlock[1] == ("  rank 0: blocked in recv(src=1) of 1 float32 at Cell In[3], line 3: "
                           "dist.recv(t, src=1 - rank)")
    assert in_cell[:5] == ["WorkerError: rank 1 raised ValueError: failed in a cell", "",
                           "Traceback on rank 1 (most recent call last):", '  File "Cell In[4]", line 3, in <module>',
                           "    raise ValueError('failed in a cell')"], in_cell
    for shown in (failed, deadlock, in_cell):
        text = "\n".join(shown)
        assert "labsupport/" not in text and "direct cause" not in text and "During handling" not in text


@pytest.mark.timing
def test_kernel_interrupt_during_a_run(tmp_path):
    """Interrupting the kernel in a call with a 300 s time-out: the reply is the one-line KeyboardInterrupt (not a
    WorkerTimeout), control is back in the kernel, and the next call works."""
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        setup = (
            "import torch, torch.distributed as dist, labsupport\n"
            "def stuck():\n    t = torch.zeros(1)\n    print('waiting', flush=True)\n"
            "    dist.recv(t, src=1 - dist.get_rank())\n"
            "labsupport.run(lambda: 0, world_size=2)"
        )
        assert kc.execute_interactive(setup, timeout=120)["content"]["status"] == "ok"
        msg_id = kc.execute(
            "try:\n    labsupport.run(stuck, world_size=2, timeout=300)\n"
            "except KeyboardInterrupt:\n    returned = True\n    raise"
        )
        shown = ""
        while "[rank 0] waiting" not in shown or "[rank 1] waiting" not in shown:  # the kernel is inside run
            msg = kc.get_iopub_msg(timeout=120)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                shown += msg["content"]["text"]
        km.interrupt_kernel()
        while True:
            reply = kc.get_shell_msg(timeout=120)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        # one line saying what happened, not a traceback through multiprocessing and selectors
        assert reply["content"]["evalue"] == "interrupted: all 2 ranks stopped"
        shown = _plain(reply["content"]["traceback"])
        assert shown == ["KeyboardInterrupt: interrupted: all 2 ranks stopped"], shown
        # control came back to the cell's own except clause: its name is set. The printed line is waited for as
        # such, not up to the cell's end: on a loaded machine the kernel's output thread may send it after "idle"
        check_id, printed = kc.execute("print('RETURNED', returned)"), ""
        while "RETURNED" not in printed:
            msg = kc.get_iopub_msg(timeout=120)
            if msg["parent_header"].get("msg_id") != check_id:
                continue
            assert msg["msg_type"] != "error", msg["content"]  # a NameError: the except clause never ran
            if msg["msg_type"] == "stream":
                printed += msg["content"]["text"]
        assert "RETURNED True" in printed
        while kc.get_shell_msg(timeout=120)["parent_header"].get("msg_id") != check_id:
            pass
        again = kc.execute_interactive("assert labsupport.run(lambda: 5, world_size=2) == [5, 5]", timeout=120)
        assert again["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_same_script_runs_under_srun_environment(tmp_path):
    """What srun sets (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID) is turned into RANK & co."""
    from labsupport._ports import free_port

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
    port = free_port()
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


EARLY_START = """
    import sys, time
    if {kernel}:
        import ipykernel  # what a notebook kernel has loaded
    import labsupport
    from multiprocessing import forkserver
    deadline = time.monotonic() + (60 if {expect} else 1)  # a server that must not start: load only delays it
    while forkserver._forkserver._forkserver_pid is None and time.monotonic() < deadline:
        time.sleep(0.05)
    print("SERVER", forkserver._forkserver._forkserver_pid)
    if {expect}:
        assert labsupport.run(sum, [1, 2], world_size=2) == [3, 3]
"""


@pytest.mark.parametrize("case", ["kernel", "kernel, early start off", "plain python", "torchrun rank",
                                  "plain python, early start on"])
def test_fork_server_starts_early_in_a_notebook_kernel_only(tmp_path, case):
    env = {k: v for k, v in os.environ.items() if k not in ("LABSUPPORT_EARLY_START", "RANK", "TORCHELASTIC_RUN_ID")}
    if case == "kernel, early start off":
        env["LABSUPPORT_EARLY_START"] = "0"
    if case == "torchrun rank":
        env["TORCHELASTIC_RUN_ID"] = "test"
    if case == "plain python, early start on":  # inherited by the fork server, which must not start one of its own
        env["LABSUPPORT_EARLY_START"] = "1"
    expect = case in ("kernel", "plain python, early start on")
    script = EARLY_START.format(kernel=not case.startswith("plain python"), expect=expect)
    proc = subprocess.run([sys.executable, _script(tmp_path, script)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    server = proc.stdout.split("SERVER ")[1].split()[0]
    if expect:
        assert server != "None", proc.stdout
        assert not _wait_gone([int(server)]), "the fork server outlived the kernel"
    else:
        assert server == "None", proc.stdout


#: Imported by the fork server at a chosen point of its start: interrupts the server's process group once, as
#: jupyter_client does before it shuts a kernel down or restarts it. The server's own interrupt is delivered
#: before ``killpg`` returns, so the point is exact.
INTERRUPT_HERE = """
    import os, signal
    _done = os.path.join(os.environ["INTERRUPT_DIR"], "interrupted")
    if not os.path.exists(_done):
        open(_done, "w").close()
        os.killpg(0, signal.SIGINT)
"""
#: Imported by every Python that starts (site): the fork server interrupts before it has imported anything.
INTERRUPT_AT_START_UP = """
    import sys
    if any("multiprocessing.forkserver import main" in a for a in getattr(sys, "orig_argv", ())):
        import interrupt_here
"""
#: A notebook kernel as the fork server sees it: labsupport imported (the server starts in the background), an
#: interrupt of its process group lived through, a first run, a shutdown.
INTERRUPTED_START = """
    import os, signal
    signal.signal(signal.SIGINT, lambda *a: None)  # a kernel lives on after an interrupt
    import labsupport._forkserver as fs  # LABSUPPORT_EARLY_START=0: nothing starts before the preload is patched
    preload = fs._preload
    if {where!r} == "before the preload":
        fs._preload = lambda: ["interrupt_here"] + preload()
    elif {where!r} == "after torch":
        fs._preload = lambda: preload() + ["interrupt_here"]
    import labsupport
    os.environ["LABSUPPORT_EARLY_START"] = "1"
    labsupport._pool.start_early()  # what importing labsupport does in a kernel: the server starts in the background
    blocked = labsupport.run(lambda: signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []), world_size=1)
    labsupport.shutdown()
    print("SIGINT blocked in the worker:", blocked)
"""


@pytest.mark.parametrize("where", ["in the interpreter's start-up", "before the preload", "after torch"])
def test_fork_server_interrupted_while_it_starts_prints_nothing(tmp_path, where):
    """A kernel shut down (or interrupted) while its fork server starts interrupts the server too: the server goes
    on without a word on stderr (it used to die of a KeyboardInterrupt, traceback and all, and the next run with an
    EOFError), and the workers forked from it can be interrupted as before."""
    folder = tmp_path / "interrupt"
    folder.mkdir()
    (folder / "interrupt_here.py").write_text(textwrap.dedent(INTERRUPT_HERE))
    if where == "in the interpreter's start-up":
        (folder / "sitecustomize.py").write_text(textwrap.dedent(INTERRUPT_AT_START_UP))
    env = dict(os.environ, LABSUPPORT_EARLY_START="0", INTERRUPT_DIR=str(folder),
               PYTHONPATH=os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, _script(tmp_path, INTERRUPTED_START.format(where=where))], env=env,
                          capture_output=True, text=True, timeout=240, start_new_session=True)
    assert (folder / "interrupted").exists(), "the fork server was not interrupted: the test tests nothing"
    assert proc.stderr == "", proc.stderr
    assert proc.returncode == 0 and "SIGINT blocked in the worker: [False]" in proc.stdout, proc.stdout


def _kernel(tmp_path, env):
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(tmp_path), env=env)
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return km, kc


def _run_in(kc, code: str) -> str:
    printed = []
    reply = kc.execute_interactive(code, timeout=120,
                                   output_hook=lambda msg: printed.append(msg["content"].get("text", "")))
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(printed)


def _listing(folder) -> list[str]:
    """A folder's names, without torch's compile cache (``torchinductor_<user>``: made once by importing
    torch._dynamo, shared by every later process on purpose)."""
    return sorted(n for n in os.listdir(folder) if not n.startswith("torchinductor_"))


def test_nothing_left_in_tmp_after_a_killed_kernel_or_a_shutdown(tmp_path):
    """multiprocessing's files (the fork server's listener) live in the pool's folder: a SIGKILLed kernel's folder
    is removed by the next kernel that starts a pool, and a kernel shut down normally leaves nothing.

    A normal shutdown (closing the notebook, restarting the kernel, nbclient's end of a run) ends the kernel by
    itself: it is not terminated or killed by jupyter_client, which would happen if its workers, fork server and
    resource tracker were left for ipykernel to chase (about 30 s) and skip the kernel's own clean-up."""
    from pathlib import Path

    # this test's own /tmp (short: the fork server's socket lives there), so that other processes' files cannot
    # disturb the count
    tmp = Path(tempfile.mkdtemp(prefix="ls-"))
    env = {k: v for k, v in os.environ.items() if k != "LABSUPPORT_EARLY_START"}
    env["TMPDIR"] = str(tmp)
    use = "import os, labsupport\nassert labsupport.run(lambda: 1, world_size=2) == [1, 1]\nprint('PID', os.getpid())"
    before = _listing(tmp)
    km, kc = _kernel(tmp_path, env)
    try:
        pid = int(_run_in(kc, use).split("PID")[1])
        during = _listing(tmp)
        assert [name for name in during if name.startswith("pymp-")] == []
        assert during == [n for n in during if n.startswith(f"labsupport-{pid}-")] and len(during) == 1, during
        os.kill(pid, signal.SIGKILL)
        assert _wait_gone([pid]) == []
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert _listing(tmp) == during  # nobody could clean up...
    km, kc = _kernel(tmp_path, env)
    try:
        pid2 = int(_run_in(kc, use).split("PID")[1])
        after = _listing(tmp)
        assert len(after) == 1 and after[0].startswith(f"labsupport-{pid2}-"), after  # ...until the next kernel did
    finally:
        kc.stop_channels()
        kernel = km.provisioner.process
        # a loaded machine: more time than jupyter_client's 5 s, less than ipykernel's chase of left children
        km.shutdown_wait_time = 20.0
        km.shutdown_kernel(now=False)  # a normal shutdown, as when the notebook is closed
    assert kernel.returncode == 0, f"the kernel did not end by itself (exit code {kernel.returncode})"
    assert _listing(tmp) == before
    shutil.rmtree(tmp)


@pytest.mark.parametrize("setting, preloaded", [("1", True), ("0", False)])
def test_fork_server_preloads_dynamo_where_asked(setting, preloaded):
    """In a notebook kernel the fork server also imports torch._dynamo (the first optimizer's 3 s), so that every
    worker inherits it; LABSUPPORT_PRELOAD_DYNAMO decides elsewhere."""
    code = (
        "import sys, labsupport\n"
        "print('PRELOADED', labsupport.run(lambda: 'torch._dynamo' in sys.modules, world_size=1)[0])\n"
    )
    env = dict(os.environ, LABSUPPORT_PRELOAD_DYNAMO=setting)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"PRELOADED {preloaded}" in proc.stdout, proc.stdout + proc.stderr
