"""Stopping a grading run midway: Ctrl-C in a terminal (SIGINT to the whole foreground process group) or SIGTERM to
the grading command alone (what ``kill``, ``scancel`` and a SLURM job's time limit send) ends it within seconds,
with no process and no temporary file left behind: no kernel, worker, judge or fork server, no course directory,
no worker's folder."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import demo_submissions as demo  # noqa: E402

NAP = ("\n\ndef _nap():\n    import time\n    time.sleep(120)\n\n"
       "labsupport.run(_nap, world_size=2, timeout=300)\n")


def _workers_running(scratch: Path) -> bool:
    """A kernel's workers are running: processes forked by the fork server that work in a kernel's folder (below
    ``scratch``) and are not judges (a judge leads a session of its own, in a folder of its own)."""
    count = 0
    for proc in psutil.process_iter(["cwd", "cmdline"]):
        try:
            cwd = proc.info["cwd"] or ""
            if (str(scratch) in cwd and "/judge-" not in cwd and os.getsid(proc.pid) != proc.pid
                    and "forkserver" in " ".join(proc.info["cmdline"] or [])):
                count += 1
        except (psutil.Error, TypeError, OSError):
            continue
    return count >= 2


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _still_running(procs) -> str:
    lines = []
    for proc in procs:
        try:
            lines.append(f"  {proc.pid} {proc.status()}: {' '.join(proc.cmdline())[:200]}")
        except psutil.Error:
            pass
    return "\n".join(lines) or "  nothing"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_grading_leaves_nothing(tmp_path, how):
    nb = demo._append(demo.good(demo.WORKERS), "pass_to_next", NAP)
    for student in ("alice", "bob"):
        folder = tmp_path / "subs" / student / demo.WORKERS
        folder.mkdir(parents=True)
        import nbformat

        nbformat.write(nb, folder / f"{demo.WORKERS}.ipynb")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch),
               PYTHONPATH=os.pathsep.join(filter(None, [str(demo.REPO), os.environ.get("PYTHONPATH")])))
    # its output goes to files: a pipe would also wait for every process that inherited it, and so could not tell
    # a grader that does not end from one that left something running
    out_file, err_file = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out_file, "w") as out_fh, open(err_file, "w") as err_fh:
        grader = subprocess.Popen(
            [sys.executable, "-m", "autograder", "grade", str(tmp_path / "subs"), "--out", str(tmp_path / "out"),
             "--course", str(demo.COURSE), "--jobs", "2"],
            cwd=demo.REPO, env=env, stdout=out_fh, stderr=err_fh,
            # its own process group, as a command typed in a terminal, which takes Ctrl-C (a suite started in the
            # background by a shell has SIGINT ignored, and Python keeps an ignored SIGINT ignored)
            start_new_session=True, preexec_fn=_default_sigint)
    try:
        deadline = time.monotonic() + 180
        while not _workers_running(scratch) and time.monotonic() < deadline and grader.poll() is None:
            time.sleep(0.2)
        assert _workers_running(scratch), "the notebooks' workers never started"
        tree = psutil.Process(grader.pid).children(recursive=True)
        assert len(tree) >= 6  # grading processes, kernels, the fork server, judges, workers
        if how == "ctrl-c":
            os.killpg(grader.pid, signal.SIGINT)
        else:
            grader.send_signal(signal.SIGTERM)
        try:
            grader.wait(timeout=60)
        except subprocess.TimeoutExpired:
            grader.send_signal(signal.SIGUSR1)  # the grader writes where each of its threads is
            time.sleep(2)
            pytest.fail(f"the grader had not ended 60 s after {how}: where it was, then what ran below it:\n"
                        f"{err_file.read_text()}\n{_still_running(tree)}")
    finally:
        if grader.poll() is None:
            os.killpg(grader.pid, signal.SIGKILL)
            grader.wait()
    out, err = out_file.read_text(), err_file.read_text()
    assert grader.returncode == (130 if how == "ctrl-c" else 143), (grader.returncode, out, err)
    assert "interrupted" in err
    gone, alive = psutil.wait_procs(tree, timeout=60)  # returns as soon as they are gone
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    deadline = time.monotonic() + 60
    while list(scratch.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(scratch.iterdir()) == []
