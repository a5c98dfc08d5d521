"""The suite split over pytest-xdist workers (``-n 2 --dist loadgroup``) keeps each group of ``FILE_GROUPS``
(``tests/conftest.py``) on one worker, so what its tests share is made once; the other tests go to either."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FILE_GROUPS

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_each_group_runs_on_one_worker():
    pytest.importorskip("xdist")
    # two files of one group (the class's: its grading run is made once and read by both; only tests that do not
    # read it are selected here) and a file of no group, whose tests go to whichever worker is free
    files = ["tests/test_course_notebooks.py", "tests/test_judge.py", "tests/test_tap.py"]
    assert FILE_GROUPS["test_course_notebooks.py"] == FILE_GROUPS["test_judge.py"]
    assert "test_tap.py" not in FILE_GROUPS
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                           "--no-kernels-server", "-v", "-k", "release_has_no_solution or no_notebook_in_git or judge_runs_honest or "
                           "judge_skips or values_from or test_tap", *files],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = re.findall(r"^\[(gw\d)\] \[[ \d]+%\] PASSED (tests/\w+\.py)::", proc.stdout, flags=re.M)
    workers: dict[str, set] = {}
    for worker, file in ran:
        workers.setdefault(file, set()).add(worker)
    assert set(workers) == set(files), proc.stdout[-3000:]
    assert len(workers["tests/test_course_notebooks.py"] | workers["tests/test_judge.py"]) == 1, workers
    assert {w for _, w in ((f, w) for f, ws in workers.items() for w in ws)} == {"gw0", "gw1"}, workers


def test_a_shared_fixture_outside_the_groups_stops_the_collection(tmp_path):
    """A file whose tests share a module's fixture, but which FILE_GROUPS leaves out, is refused at collection:
    split over workers, its fixture would be made on each."""
    folder = tmp_path / "tests"
    folder.mkdir()
    (folder / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (folder / "test_new_lab.py").write_text(
        "import pytest\n\n\n@pytest.fixture(scope='module')\ndef server():\n    return 1\n\n\n"
        "def test_a(server):\n    assert server\n\n\ndef test_b(server):\n    assert server\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-c", "/dev/null", "--rootdir", str(tmp_path), str(folder)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "test_new_lab.py" in proc.stdout + proc.stderr and "FILE_GROUPS" in proc.stdout + proc.stderr, \
        proc.stdout + proc.stderr


@pytest.mark.skipif(Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
                    reason="runs ./course test, which uses the course's .venv: this suite runs in another Python")
def test_course_test_splits_over_two_processes_unless_told_otherwise():
    """``./course test`` runs the suite in two pytest processes on two cores or more; ``-n 0`` runs it in one."""
    pytest.importorskip("xdist")

    def run(*args):
        proc = subprocess.run(["bash", str(ROOT / "course"), "test", "-p", "no:cacheprovider", "--no-kernels-server",
                               *args, "tests/test_tap.py", "-k", "needs_no_process_group"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    split = (os.cpu_count() or 1) >= 2
    assert ("created: 2/2 workers" in run()) == split
    assert "workers" not in run("-n", "0")
