"""A submission cannot raise its own grade: each kind of cheat (``CHEATS`` of ``fixtures/class_of_submissions.py``),
graded with the class by the real ``python -m autograder grade`` on notebook 01, ends with no points for the cheated
exercise and/or a flag for review. Plus the judge's rules for what of a student's cell it runs (no kernels needed for
those)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import demo_submissions as demo  # noqa: E402
from class_of_submissions import CHEATED as AID, CHEATER_OF, CHEATERS, CHEATS  # noqa: E402

from autograder.judge import definitions  # noqa: E402
from autograder.stand_ins import _plain  # noqa: E402

REPO = demo.REPO


def test_honest_submission_full_marks_no_flag(class_graded):
    """``habits``: the solution's answers handed in as a student would, and ``all_reduce`` with prints to stderr, a
    traceback printed in an ``except``, ``warnings.warn``, ``sys``/``os``/``inspect``/``itertools``/``typing``
    imports, an ``lru_cache`` helper and a class: graded as they run. (The solution's own ``all_reduce`` gets the
    same in ``test_course_notebooks.py::test_solution_gets_full_marks``.)"""
    row = class_graded.grades[("habits", AID)]
    assert (row["points"], row["max_points"], row["status"], row["flags"]) == ("13", "13", "ok", ""), row


@pytest.mark.parametrize("kind", sorted(CHEATS))
def test_cheat(class_graded, kind):
    """Each kind's flag words, and its own test (no other kind of its cheater's notebook has that test) fails."""
    _cell, _source, test, words = CHEATS[kind]
    student = CHEATER_OF[kind]
    row = class_graded.grades[(student, AID)]
    assert row["status"] == "ok", row
    assert row["flags"], row
    for word in words:
        assert word in row["flags"], (word, row["flags"])
    if test is not None:
        lost = {"test_broadcast": 1, "test_reduce": 2, "test_all_reduce": 2, "test_gather": 1, "test_all_gather": 2}
        tests = {CHEATS[k][2] for k in CHEATERS[student]} - {None}
        assert float(row["points"]) <= 13 - sum(lost[t] for t in tests), row
        assert f"{test} (" in row["reason"], row["reason"]
    page = demo.html_text(class_graded.feedback(student, AID).read_text())
    assert "Flagged for review" in page
    assert words[0] in page


def test_summary_lists_flagged_students(class_graded):
    """The summary lists exactly the cheats: no other student of the class (solutions, untouched releases, planted
    bugs, honest answers) is flagged."""
    out = class_graded.proc.stdout
    assert f"Flagged for review ({len(CHEATERS)})" in out, out
    for student in CHEATERS:
        assert f"  {student}/{AID}: " in out


# ---------------------------------------------------------------------------------------------------------------
# what the judge runs of a student's cell (no processes)

MODULES = {"torch": "torch", "dist": "torch.distributed", "labsupport": "labsupport"}


def _kept(source):
    code, skipped = definitions(source, dict(MODULES))
    return code, skipped


@pytest.mark.parametrize("source", [
    "@torch.no_grad()\ndef f(x, dtype=torch.float32, sizes=(1, 2), opts={'a': -1.5}):\n    return x",
    "import dataclasses\n@dataclasses.dataclass\nclass P:\n    x: int = 0\n    ys: tuple = ()\n",
    "import torch.nn as nn\nclass M(nn.Module):\n    '''doc'''\n    SCALE = 2.0\n    def forward(self, x):\n"
    "        return x * self.SCALE\n    @property\n    def n(self):\n        return 1\n    @n.setter\n"
    "    def n(self, v):\n        pass\n",
    "N, DTYPE = 4, torch.float32\nWORLD: int = 4\nSHAPE = torch.Size([2, 3])\n",
    "from functools import lru_cache\n@lru_cache(maxsize=None)\ndef g(n):\n    return n\n",
    "import sys, os, inspect, traceback, types, itertools, typing, warnings\nfrom typing import Optional\n",
    "import sys\ndef f(x):\n    print('rank', x, file=sys.stderr)\n    return x\n",
])
def test_judge_runs_honest_definitions(source):
    code, skipped = _kept(source)
    assert skipped == [], skipped
    assert code.strip()


@pytest.mark.parametrize("source, why", [
    ("def patch(f):\n    import autograder\n    return f\n@patch\ndef broadcast(t, src):\n    pass\n", "decorator"),
    ("def broadcast(t, src, _=__import__('autograder')):\n    pass\n", "default value"),
    ("def broadcast(t, src, _=evil()):\n    pass\n", "default value"),
    ("class A:\n    import sys\n    sys.modules.clear()\n", "statement in its body"),
    ("class A:\n    x = patch_everything()\n", "statement in its body"),
    ("class A(metaclass=Evil):\n    pass\n", "keywords"),
    ("class A(make_base()):\n    pass\n", "base class"),
    ("x = evil()\n", "assignment"),
    ("x = functools.reduce(exec, ['code'])\n", "assignment"),
    ("import autograder.checks.collectives as c\n", "does not import autograder"),
    ("from torch.distributed import _functional_collectives\n", "private"),
    ("c.check_broadcast = None\n", "assignment"),
    ("get_ipython().run_cell = None\n", "assignment"),
    ("for m in []:\n    pass\n", "top-level for"),
    ("X = Evil[1]\n", "assignment"),
])
def test_judge_skips_what_would_run_student_code(source, why):
    code, skipped = _kept(source)
    assert any(why in s for s in skipped), (skipped, why)
    for bad in ("@patch", "__import__", "evil()", "exec", "Evil", "sys.modules", "_functional", "run_cell ="):
        assert bad not in code, (bad, code)
    assert not any(line.startswith(("import autograder", "c.check")) for line in code.splitlines()), code


def test_a_skipped_import_is_named_in_the_message_of_the_name_it_would_define():
    from autograder.judge import verdicts_to_points

    code, skipped = _kept("from types import SimpleNamespace\nfrom autograder import checks\n")
    assert "SimpleNamespace" in code and "checks" not in code, code
    report = {"tests": {"t": {"passed": False, "message": "f raised NameError: name 'checks' is not defined"},
                        "u": {"passed": False, "message": "name 'other' is not defined"}},
              "skipped": [f"cell 3: {s}" for s in skipped]}
    verdicts = verdicts_to_points(report, {"t": 1.0, "u": 1.0})
    assert verdicts["t"][1].startswith("checks is not defined when the grader runs your answers: it skipped "
                                       "`from autograder import checks` on line 2"), verdicts["t"]
    assert " in cell 3; answer cells are run as definitions only. f raised NameError" in verdicts["t"][1]
    assert verdicts["u"] == (0.0, "name 'other' is not defined")


def test_values_from_student_code_must_be_plain():
    """What a student's function returns to the judge's own process is plain data, never an object whose methods
    (an ``__eq__`` that always says yes) would run there."""
    import torch

    value = [1, 2.5, "a", None, (True,), {"k": torch.ones(2)}, range(3)]
    assert _plain(value) == value[:5] + [value[5]] + [range(3)] or True
    assert _plain(value)[5]["k"] is value[5]["k"]
    import numpy as np

    numbers = [np.float64(1.5), np.float32(2), np.int64(3), np.float64(1) <= np.float64(2), np.zeros(2)]
    assert [type(v) for v in _plain(numbers)] == [type(v) for v in numbers]   # a numpy verdict is data too

    class AlwaysEqual(list):
        def __eq__(self, other):
            return True

    class Sneaky(torch.Tensor):
        pass

    for value in (AlwaysEqual([1]), [AlwaysEqual()], {"x": AlwaysEqual()}, torch.ones(1).as_subclass(Sneaky)):
        with pytest.raises(TypeError):
            _plain(value)


@pytest.fixture
def shared_server():
    """A fork server shared as the grader shares one (``judge.SharedServer``); yields its pid."""
    import os

    from autograder.judge import SharedServer

    with SharedServer("judge-test-fork-"):
        yield int(os.environ["LABSUPPORT_FORK_SERVER"].split(":")[0])


@pytest.fixture(params=["forked", "command"])
def how(request):
    """How the judge is started: forked from a shared fork server (a grading run) or as a new Python."""
    if request.param == "forked":
        request.getfixturevalue("shared_server")
    return request.param


def test_student_code_never_runs_in_the_judges_process(tmp_path, how):
    """A check that would call a student's method in the judge's process (here: a hidden test comparing with the
    student's object, whose ``__eq__`` always says yes) is stopped there; a student function called from the test
    runs on a worker and only plain data comes back. The same for a judge forked from the shared server."""
    from autograder.judge import Judge

    student = [{"label": "answer", "source": (
        "class Always:\n    def __eq__(self, other):\n        return True\n\n"
        "def make():\n    return Always()\n\n"
        "def where():\n    import os\n    return os.getpid()\n\n"
        "def ok(xs):\n    xs.append(3)\n    return sum(xs)\n")}]
    tests = [
        {"grade_id": "t_eq", "source": "assert Always() == 42"},
        {"grade_id": "t_make", "source": "assert make() == 42"},
        {"grade_id": "t_where", "source": "import os\nassert where() != os.getpid()"},
        {"grade_id": "t_ok", "source": "v = [1, 2]\nassert ok(v) == 6 and v == [1, 2, 3], v"},
    ]
    judge = Judge(str(REPO), tmp_path)
    assert judge.forked == (how == "forked")
    judge.start({"setup": ["import labsupport"], "student": student, "tests": tests, "timeout": 60})
    report = judge.result(300)
    verdicts = {gid: v["passed"] for gid, v in report["tests"].items()}
    assert verdicts == {"t_eq": False, "t_make": False, "t_where": True, "t_ok": True}, report
    assert "student code" in report["tests"]["t_eq"]["message"]
    assert "plain values" in report["tests"]["t_make"]["message"]
    assert report["in_process"] == ["__eq__ (answer)"], report


JUDGE_CLIENT = """
import sys, time
from pathlib import Path
from autograder.judge import Judge
judge = Judge(sys.argv[1], Path(sys.argv[2]))
print(judge.proc.pid, judge.forked, judge.cwd, flush=True)
time.sleep(600)
"""


def test_a_forked_judge_runs_in_a_session_of_its_own_and_ends_with_its_grader(shared_server, tmp_path):
    """A judge forked from the shared server: its parent is the server, it leads a session of its own (so it can be
    killed with everything it started), and it ends when the grading process that asked for it is killed, even
    though the server it was forked from runs on."""
    import os
    import signal
    import subprocess
    import time

    import psutil

    grader = subprocess.Popen([sys.executable, "-c", JUDGE_CLIENT, str(REPO), str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    folder = None
    try:
        pid, forked, folder = grader.stdout.readline().split()
        pid = int(pid)
        assert forked == "True"
        judge = psutil.Process(pid)
        assert judge.ppid() == shared_server
        deadline = time.monotonic() + 120   # ends as soon as the judge has its own session
        while os.getsid(pid) != pid and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.getsid(pid) == pid
        grader.send_signal(signal.SIGKILL)
        grader.wait()
        judge.wait(timeout=60)  # returns once the judge is gone; raises psutil.TimeoutExpired if it outlives its grader
    finally:
        grader.kill()
        grader.wait()
        import shutil

        if folder:  # what a grading run's remove_leftovers does for a killed grader
            shutil.rmtree(folder, ignore_errors=True)
    assert psutil.pid_exists(shared_server)


def test_a_function_the_judge_calls_runs_in_a_sandbox_with_its_exercises_rules(tmp_path):
    """A pure function called from a hidden test runs in a one-rank sandbox: the grader's modules are not there
    (an answer that takes the reference from ``autograder.checks`` fails), and the built-in an exercise rebuilds
    raises inside its call (09: ``DistributedSampler`` in ``shard_indices``); an honest answer with ordinary habits
    passes."""
    from autograder.judge import Judge

    student = [{"label": "answer", "source": (
        "import sys, functools\n"
        "from torch.utils.data import DistributedSampler\n\n"
        "@functools.lru_cache(maxsize=None)\n"
        "def _half(n):\n    return n // 2\n\n"
        "def shard_indices(n):\n    return list(DistributedSampler(range(n), num_replicas=2, rank=0, "
        "shuffle=False))\n\n"
        "def reference(p, m):\n"
        "    import importlib\n"
        "    return importlib.import_module('autograder.checks.overlap.reference').reference_zero_bubble(p, m)\n\n"
        "def halves(n):\n    print('halving', n, file=sys.stderr)\n    return [_half(n), n - _half(n)]\n")}]
    tests = [
        {"grade_id": "t_sampler", "source": "shard_indices(6)"},
        {"grade_id": "t_reference", "source": "reference(2, 2)"},
        {"grade_id": "t_honest", "source": "assert halves(5) == [2, 3]"},
    ]
    judge = Judge(str(REPO), tmp_path)
    judge.start({"setup": ["import labsupport"], "student": student, "tests": tests, "timeout": 60})
    report = judge.result(300)
    verdicts = {gid: v["passed"] for gid, v in report["tests"].items()}
    assert verdicts == {"t_sampler": False, "t_reference": False, "t_honest": True}, report
    assert "shard_indices must not call DistributedSampler" in report["tests"]["t_sampler"]["message"], report
    assert "grader's modules are not available" in report["tests"]["t_reference"]["message"], report
