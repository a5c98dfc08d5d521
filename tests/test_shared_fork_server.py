"""A fork server shared through ``LABSUPPORT_FORK_SERVER`` (the grader's: one per grading process, used by the
kernel and the judge of every notebook it grades).

Real processes: an owner starts the server, clients with the variable fork their workers from it without
starting a server of their own; when the server is gone a client falls back to its own; the server ends with its
owner and leaves no file behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

OWNER = """
import sys
from labsupport import _forkserver
print(_forkserver.start_shared_server(sys.argv[1]), flush=True)
sys.stdin.read()   # until the test closes our stdin
"""

CLIENT = """
import os, json
from multiprocessing import forkserver
import labsupport

def parent():
    return os.getppid()

first = labsupport.run(parent, world_size=2, timeout=60)
own_after_first = forkserver._forkserver._forkserver_pid
if os.environ.get("KILL_SERVER"):
    import signal
    os.kill(int(os.environ["LABSUPPORT_FORK_SERVER"].split(":")[0]), signal.SIGKILL)
    labsupport.shutdown()
    second = labsupport.run(parent, world_size=2, timeout=60)
else:
    second = None
print(json.dumps({"first": first, "own_after_first": own_after_first, "second": second,
                  "own": forkserver._forkserver._forkserver_pid}))
labsupport.shutdown()
"""


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), LABSUPPORT_EARLY_START="0")
    env.pop("LABSUPPORT_FORK_SERVER", None)
    env.update(extra)
    return env


@pytest.fixture
def shared_server():
    folder = tempfile.mkdtemp(prefix="shared-fs-", dir="/tmp")
    owner = subprocess.Popen([sys.executable, "-c", OWNER, folder], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=_env())
    value = owner.stdout.readline().strip()
    assert ":" in value, value
    try:
        yield owner, value, folder
    finally:
        owner.stdin.close()
        owner.wait(timeout=30)
        pid = int(value.split(":")[0])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.1)
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def _client(value: str, **extra) -> dict:
    import json

    proc = subprocess.run([sys.executable, "-c", CLIENT], capture_output=True, text=True, timeout=240,
                          env=_env(LABSUPPORT_FORK_SERVER=value, **extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_workers_come_from_the_shared_server(shared_server):
    owner, value, folder = shared_server
    server_pid = int(value.split(":")[0])
    out = _client(value)
    assert out["first"] == [server_pid, server_pid], "the workers were not forked by the shared server"
    assert out["own"] is None and out["own_after_first"] is None, "the client started a fork server of its own"
    assert value.split(":", 1)[1].startswith(folder), "the server's socket is not in the folder it was given"


@pytest.mark.slow
def test_a_client_falls_back_to_its_own_server_when_the_shared_one_is_gone(shared_server):
    owner, value, folder = shared_server
    server_pid = int(value.split(":")[0])
    out = _client(value, KILL_SERVER="1")
    assert out["first"] == [server_pid, server_pid]
    assert out["second"] is not None and server_pid not in out["second"]
    assert out["own"] is not None and out["second"] == [out["own"], out["own"]], out


def test_the_server_ends_with_its_owner():
    folder = tempfile.mkdtemp(prefix="shared-fs-", dir="/tmp")
    owner = subprocess.Popen([sys.executable, "-c", OWNER, folder], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=_env())
    try:
        pid = int(owner.stdout.readline().split(":")[0])
        assert os.path.exists(f"/proc/{pid}")
        os.kill(owner.pid, signal.SIGKILL)   # no clean-up at all: the server sees its alive pipe close
        owner.wait(timeout=10)
        deadline = time.monotonic() + 60  # ends as soon as the server is gone
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.1)
        # (reparented to init, which reaps it; a zombie would still have a /proc entry with state Z)
        if os.path.exists(f"/proc/{pid}"):
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
            assert state in ("Z", "X"), f"the fork server outlived its owner (state {state})"
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def test_a_malformed_or_stale_value_is_ignored(tmp_path):
    out = _client(f"999999999:{tmp_path / 'nothing'}")
    assert out["own"] is not None and out["first"] == [out["own"], out["own"]]


PATIENT_OWNER = """
import signal, sys
signal.signal(signal.SIGINT, lambda *a: None)  # the owner hears Ctrl-C (and goes on); exec resets this for the server
from labsupport import _forkserver
print("ready", flush=True)
print(_forkserver.start_shared_server(sys.argv[1]), flush=True)
sys.stdin.read()
"""


def _hears_interrupts(pid: int) -> bool:
    """Whether process ``pid`` lives and neither ignores nor blocks SIGINT (from /proc: no timing involved)."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except OSError:
        return False
    bit = 1 << (signal.SIGINT - 1)
    return not (int(fields["SigIgn"], 16) & bit or int(fields["SigBlk"], 16) & bit)


@pytest.mark.slow
def test_an_interrupt_while_the_server_starts_leaves_no_traceback():
    """Ctrl-C reaches the whole process group (a terminal's, a kernel's): the server, still importing torch, must not
    hear it."""
    folder = tempfile.mkdtemp(prefix="shared-fs-", dir="/tmp")
    owner = subprocess.Popen([sys.executable, "-c", PATIENT_OWNER, folder], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                             start_new_session=True)
    try:
        import select

        assert owner.stdout.readline().strip() == "ready"
        value = ""
        deadline = time.monotonic() + 240
        while not value and time.monotonic() < deadline and owner.poll() is None:
            os.killpg(owner.pid, signal.SIGINT)
            if select.select([owner.stdout], [], [], 0.02)[0]:
                value = owner.stdout.readline().strip()
        assert ":" in value, owner.stderr.read() if owner.poll() is not None else "no answer"
        server = int(value.split(":")[0])
        while _hears_interrupts(server) and time.monotonic() < deadline:  # until it serves (and ignores them)
            os.killpg(owner.pid, signal.SIGINT)
            time.sleep(0.02)
        out = _client(value)
        assert out["first"] == [int(value.split(":")[0])] * 2, "the server does not serve after the interrupts"
    finally:
        owner.stdin.close()
        owner.wait(timeout=30)
        err = owner.stderr.read()
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


GRADER = """
import json, os
from autograder.judge import SharedServer
with SharedServer("inherit-test-"):
    inside = os.environ.get("LABSUPPORT_FORK_SERVER")
print(json.dumps({"inside": inside, "after": os.environ.get("LABSUPPORT_FORK_SERVER")}))
"""


def _grader(value: str, **extra) -> dict:
    import json

    proc = subprocess.run([sys.executable, "-c", GRADER], capture_output=True, text=True, timeout=240, cwd=REPO,
                          env=_env(LABSUPPORT_FORK_SERVER=value, **extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_grader_forks_its_judges_from_an_inherited_server_only_when_its_caller_vouches_for_it(shared_server):
    """``autograder.judge.SharedServer`` (a grading command's): the server its caller started and vouches for
    (``AUTOGRADER_INHERIT_FORK_SERVER=1``, as this suite's grading commands get it) is the one it shares."""
    owner, value, folder = shared_server
    assert _grader(value, AUTOGRADER_INHERIT_FORK_SERVER="1") == {"inside": value, "after": value}


@pytest.mark.slow
def test_a_grader_starts_its_own_server_rather_than_one_it_was_merely_given(shared_server, tmp_path):
    """Without the caller's word, or where the named server is gone, a grading command starts a server of its own
    for its judges (then gives its caller's value back)."""
    owner, value, folder = shared_server
    for given, extra in ((value, {}), (f"999999999:{tmp_path / 'nothing'}", {"AUTOGRADER_INHERIT_FORK_SERVER": "1"})):
        out = _grader(given, **extra)
        assert out["after"] == given, out
        assert out["inside"] and out["inside"] != given and "inherit-test-" in out["inside"], (given, extra, out)
