"""Parallel grading gives the serial result, and submissions that run real workers (labsupport) are graded,
deadlocks included."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import demo_submissions as demo  # noqa: E402


def test_jobs_2_gives_the_serial_csv(demo_mix_graded):
    outputs = demo_mix_graded.outputs
    serial = (outputs[1] / "grades.csv").read_bytes()
    assert serial == (outputs[2] / "grades.csv").read_bytes()
    grades = demo.read_grades(outputs[1] / "grades.csv")
    assert [grades[(s, demo.DEMO)]["points"] for s in demo_mix_graded.MIX] == ["5", "0", "1", "3", "0", "0"]
    for student in demo_mix_graded.MIX:
        one = (outputs[1] / "feedback" / student / f"{demo.DEMO}.html").read_text()
        two = (outputs[2] / "feedback" / student / f"{demo.DEMO}.html").read_text()
        assert one == two, student


#: a correct submission that also prints, from a worker it starts, which process forked that worker
FORKS = ("\n\nimport os as _os\nfrom multiprocessing import forkserver as _fs\n"
         "_server = int(_os.environ['LABSUPPORT_FORK_SERVER'].split(':')[0])\n"
         "print('forked by the shared server:', labsupport.run(_os.getppid, world_size=2) == [_server] * 2,"
         " '| own server:', _fs._forkserver._forkserver_pid)\n")


@pytest.mark.timeout(400)
def test_workers_and_a_deadlocked_worker(tmp_path):
    """A hidden test that runs the student's function on 3 labsupport workers: the correct one gets full marks,
    the deadlocked one loses the points with WorkerTimeout (well before the cell time limit), and grading goes on.
    (An untouched release running workers is covered by test_course_notebooks.py on the real notebooks.)

    The kernels that run the submissions do not start a fork server of their own: their workers are forked by the
    one server of the grading process (``LABSUPPORT_FORK_SERVER``), whose pid the kernel sees (student ``forks``)."""
    pytest.importorskip("labsupport")
    subs = demo.write(tmp_path / "subs", {"good": "worker_good", "stuck": "worker_deadlock"})
    nb = demo.good(demo.WORKERS)
    nb.cells[demo.index(nb, "pass_to_next")].source += FORKS
    (subs / "forks" / demo.WORKERS).mkdir(parents=True)
    nbformat.write(nb, subs / "forks" / demo.WORKERS / f"{demo.WORKERS}.ipynb")
    out = tmp_path / "out"
    # a temporary folder of its own (short: sockets live there), to see that grading leaves nothing in it: not the
    # folders of the kernels nbgrader stops (their workers' boards), not the fork server's, not the judges'
    tmp = tempfile.mkdtemp(prefix="g-", dir="/tmp")
    try:
        proc = demo.cli("grade", subs, "--jobs", 2, "--out", out, "--course", demo.COURSE, "--cell-timeout", 120,
                        env={"TMPDIR": tmp})
        left = sorted(n for n in os.listdir(tmp) if not n.startswith("torchinductor_"))  # torch's shared cache
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert left == [], f"grading left {left} in its temporary folder"
    grades = demo.read_grades(out / "grades.csv")
    # without --assignment: every course assignment somebody handed in (98 only; nobody has 99_demo here)
    assert sorted(grades) == [("forks", demo.WORKERS), ("good", demo.WORKERS), ("stuck", demo.WORKERS)]
    good, stuck = grades[("good", demo.WORKERS)], grades[("stuck", demo.WORKERS)]
    assert (good["points"], good["status"], good["reason"]) == ("3", "ok", ""), good
    assert (stuck["points"], stuck["status"]) == ("0", "ok"), stuck
    assert "test_pass_to_next (WorkerTimeout" in stuck["reason"], stuck
    assert "cells stopped" not in stuck["reason"]  # labsupport's own time limit fired, not the cell's
    text = demo.html_text((out / "feedback" / "stuck" / f"{demo.WORKERS}.html").read_text())
    assert "failed (0 / 3 points): WorkerTimeout" in text
    assert "rank 0" in text  # where each rank was stuck, from labsupport's message
    for line in demo.hidden_test_lines(demo.WORKERS):
        assert line not in text
    assert grades[("forks", demo.WORKERS)]["points"] == "3"
    text = demo.html_text((out / "feedback" / "forks" / f"{demo.WORKERS}.html").read_text())
    assert "forked by the shared server: True | own server: None" in text, text[-2000:]
