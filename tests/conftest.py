"""Test selection: ``./course test -m "not slow"`` is the quick loop (the launcher, the lesson modules, the screen,
the layout); the slow tests run real kernels, grade notebooks through nbgrader, or run every check on workers.
``./course test -m gpu`` is the GPU suite (``test_gpu.py``): on a machine with a GPU, every other test runs as on one
without (``CUDA_VISIBLE_DEVICES=""``), as the CPU tests it is."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))

# The check-level tests plant bugs that call the grader's own references (a rotated reference all-gather); in a
# grading sandbox the grader cannot be imported, so these tests allow it. tests/test_sandbox.py checks the rule
# without this variable, and no grading run sets it.
os.environ.setdefault("LABSUPPORT_TEST_GRADER_IN_SANDBOX", "1")

#: Modules whose tests are slow: real notebook kernels, nbgrader grading, or every check on real workers.
SLOW_MODULES = {
    "test_course_notebooks",
    "test_grading",
    "test_grading_matrix",
    "test_grading_parallel",
    "test_judge",
    "test_student_edition",
    "test_shards",
    "test_visible",
    "test_visible_methods",
    "test_gpu_demos",
    "test_notebook_measurements",
    "test_data_parallel_torch_ddp",
    "test_packaging",
    "test_setup_script",
    "test_launch_process",
    "test_browser",
}


#: the time allowed to a test that needs the class's grading run (which the first such test waits for)
CLASS_GRADING_TIMEOUT = 1800


def pytest_configure(config):
    config.addinivalue_line("markers", "xdist_group(name): run on the same pytest-xdist worker as the group's other "
                                       "tests (set by tests/conftest.py)")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in SLOW_MODULES or module.endswith("_checks"):
            item.add_marker(pytest.mark.slow)
        if "class_graded" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(CLASS_GRADING_TIMEOUT), append=False)
    for item, group in _groups(items).items():
        item.add_marker(pytest.mark.xdist_group(group))


def _groups(items) -> dict:
    """{test: its group}: ``./course test`` runs the suite on several pytest-xdist workers (``--dist loadgroup``),
    and what a test shares with others, made once, must be made once on one worker: tests that use one of this
    suite's session fixtures (the class's grading run) run where that fixture's other tests do, tests that use a
    module's fixture (a lab server, an installed environment) where that module's do, and the GPU suite on one
    worker (one GPU). A test that shares two such things joins both groups into one."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    keys_of = {}
    here = str(Path(__file__).parent)
    for item in items:
        keys = []
        info = getattr(item, "_fixtureinfo", None)
        for name, defs in (info.name2fixturedefs.items() if info else ()):
            d = defs[-1]
            if d.scope not in ("session", "module") or not str(getattr(d.func, "__code__", None) and
                                                               d.func.__code__.co_filename).startswith(here):
                continue  # pytest's own (tmp_path_factory) and function-scoped fixtures are no one's to share
            keys.append(f"fixture-{name}" if d.scope == "session" else f"module-{item.module.__name__}")
        if item.get_closest_marker("gpu") is not None:
            keys.append("gpu")
        for key in keys[1:]:
            parent[find(key)] = find(keys[0])
        if keys:
            keys_of[item] = keys[0]
    return {item: find(key) for item, key in keys_of.items()}


@pytest.fixture(autouse=True)
def _gpus_for_the_gpu_suite_only(request, monkeypatch):
    """Outside the GPU suite, no GPU: with one, backend "auto" would give one-rank runs NCCL on cuda:0, where the
    CPU tests' tensors are refused. Workers take the notebook's environment with each call, so this holds for them."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="session")
def class_graded(tmp_path_factory):
    """Every student of ``fixtures/class_of_submissions.py`` graded in one run (see there)."""
    from class_of_submissions import Graded

    return Graded(tmp_path_factory.mktemp("class-grading"))


class DemoMix:
    """The demo course's mixed class ``MIX`` graded twice, serially and with two jobs: ``outputs`` {jobs: folder}
    (``test_grading_parallel.py`` compares them, ``test_shards.py`` merges shards into the same as one run)."""

    MIX = {"alice": "good", "bob": "release", "carol": "partial", "dave": "edited_tests", "frank": "invalid_json",
           "grace": "renamed"}

    def __init__(self, root):
        import demo_submissions as demo

        self.subs = demo.write(root / "subs", self.MIX)
        self.outputs = {}
        for jobs in (1, 2):
            out = root / f"out{jobs}"
            proc = demo.cli("grade", self.subs, "--jobs", jobs, "--out", out, "--course", demo.COURSE)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            self.outputs[jobs] = out


@pytest.fixture(scope="session")
def demo_mix_graded(tmp_path_factory):
    return DemoMix(tmp_path_factory.mktemp("demo-mix"))


@pytest.fixture
def settled_timeouts(monkeypatch):
    """labsupport.run's time-outs in this test stop deadlocks, never a busy machine: the report is taken once the
    ranks are blocked, however long a loaded machine takes to get them there (``fixtures/patience.py``)."""
    import patience

    patience.install(monkeypatch.setattr)



@pytest.fixture
def grader_out_of_reach(monkeypatch):
    """As in grading: a sandbox cannot import the grader (this suite's ``LABSUPPORT_TEST_GRADER_IN_SANDBOX`` is
    removed). A worker keeps its sandbox from call to call, so the workers start afresh before the test and after."""
    import labsupport

    monkeypatch.delenv("LABSUPPORT_TEST_GRADER_IN_SANDBOX", raising=False)
    labsupport.shutdown()
    yield
    labsupport.shutdown()
