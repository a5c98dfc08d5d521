"""Notebook 00's two torchrun agents on one machine (``lesson.torchrun_two_fake_nodes``): the port they meet on, a
job whose start fails once, a job that always fails; nothing is left running."""

import socket

import psutil
import pytest

from labsupport import _ports
from labsupport.lessons import launch as lesson

#: what every worker runs instead of TORCHRUN_SCRIPT: rank 0 fails while the marker file is missing (and makes it,
#: so that a second job passes) or always ("always" in the marker's name)
FAILING_SCRIPT = """
import os, sys
marker = os.environ["DEMO_MARKER"]
if os.environ["RANK"] == "0" and ("always" in marker or not os.path.exists(marker)):
    open(marker, "w").close()
    sys.exit("planted failure of rank 0")
""" + lesson.TORCHRUN_SCRIPT.split("if __name__", 1)[0].replace("import json, os, sys", "import json") + \
    "if __name__" + lesson.TORCHRUN_SCRIPT.split("if __name__", 1)[1]


def _left(marker) -> list:
    """The job's agents and workers still running (found by the marker in their environment: a worker whose agent
    was killed is nobody's child)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("DEMO_MARKER") == str(marker) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(found, timeout=10)  # returns as soon as they are gone
    return alive


def test_the_port_is_free_and_outside_the_systems_ephemeral_range():
    low, high = _ports.ephemeral_range()
    for _ in range(20):
        port = _ports.free_port()
        assert not low <= port <= high, (port, low, high)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.slow
def test_a_job_whose_start_fails_is_started_once_more(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lesson, "TORCHRUN_SCRIPT", FAILING_SCRIPT)
    marker = tmp_path / "failed-once"
    monkeypatch.setenv("DEMO_MARKER", str(marker))
    seen = lesson.torchrun_two_fake_nodes(timeout=120)
    assert [e["RANK"] for e in seen] == ["0", "1", "2", "3"]
    out = capsys.readouterr().out
    assert "planted failure of rank 0; starting it once more" in out, out
    assert out.count("$ torchrun") == 4, out    # two agents, twice
    assert _left(marker) == []


@pytest.mark.slow
def test_a_job_that_fails_twice_raises_what_the_worker_wrote(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lesson, "TORCHRUN_SCRIPT", FAILING_SCRIPT)
    marker = tmp_path / "always"
    monkeypatch.setenv("DEMO_MARKER", str(marker))
    with pytest.raises(RuntimeError) as info:
        lesson.torchrun_two_fake_nodes(timeout=120)
    text = str(info.value)
    # the failing agent ended the job: the other one did not keep it waiting until the time limit
    assert text.startswith("torchrun exited with 1:") and "planted failure of rank 0" in text, text
    assert capsys.readouterr().out.count("starting it once more") == 1
    assert _left(marker) == []
