"""Test selection: ``./course test -m "not slow"`` is the quick loop (the launcher, the lesson modules, the screen,
the layout); the slow tests run real kernels, grade notebooks through nbgrader, or run every check on workers.
``./course test -m gpu`` is the GPU suite (``test_gpu.py``): on a machine with a GPU, every other test runs as on one
without (``CUDA_VISIBLE_DEVICES=""``), as the CPU tests it is."""

import os
import sys
import tempfile
from pathlib import Path

import pytest

from autograder._quick_start import skip_iri_grammars

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))

# the suite's own process reads notebooks too: it starts as the grader's command line does
skip_iri_grammars()

# The check-level tests plant bugs that call the grader's own references (a rotated reference all-gather); in a
# grading sandbox the grader cannot be imported, so these tests allow it. tests/test_sandbox.py checks the rule
# without this variable, and no grading run sets it.
os.environ.setdefault("LABSUPPORT_TEST_GRADER_IN_SANDBOX", "1")

#: Modules whose tests are slow: real notebook kernels, nbgrader grading, every check on real workers, or fork servers
#: of their own (each imports torch).
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
    "test_shared_fork_server",
}


#: the time allowed to a test that needs the class's grading run (which the first such test waits for)
CLASS_GRADING_TIMEOUT = 1800


#: Test files that share what is made once, run on one pytest-xdist worker each (``./course test`` runs the suite on
#: two workers where there are two cores or more): {file: its group}. Files that share a session's fixture are in one
#: group (the class's grading run, the demo course's mixed class); a file with a module's fixture (a lab server, an
#: installed environment) is a group of its own, as is the GPU suite (one GPU). The other tests go to whichever worker
#: is free. Collection checks this table against the fixtures the tests use (``_groups``), so a new shared fixture
#: cannot be made twice.
FILE_GROUPS = {
    "test_course_notebooks.py": "class", "test_judge.py": "class",
    "test_grading_parallel.py": "demo-mix", "test_shards.py": "demo-mix",
    **{name: name for name in ("test_browser.py", "test_data_parallel_torch_ddp.py", "test_gpu.py",
                               "test_grading_matrix.py", "test_light_install.py", "test_message_catalog.py",
                               "test_setup_script.py", "test_student_edition.py", "test_translations.py")},
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in SLOW_MODULES or module.endswith("_checks"):
            item.add_marker(pytest.mark.slow)
        if "class_graded" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(CLASS_GRADING_TIMEOUT), append=False)
    for shared, tests in _groups(items).items():
        files = {Path(str(t.fspath)).name for t in tests}
        groups = {FILE_GROUPS.get(f) for f in files}
        if len(groups) != 1 or None in groups:
            raise pytest.UsageError(
                f"tests/conftest.py: the tests of {sorted(files)} share {shared}, made once per run: put these files "
                f"in one group of FILE_GROUPS (now {sorted(map(str, groups))}), so that one pytest-xdist worker runs "
                "them all")


def _groups(items) -> dict:
    """{what is shared: the tests that share it}: tests that use one of this suite's session fixtures, or a module's
    fixture, or the GPU; a test that shares two such things joins both groups into one."""
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
            code = getattr(d.func, "__code__", None)
            if d.scope not in ("session", "module") or code is None or not code.co_filename.startswith(here):
                continue  # pytest's own (tmp_path_factory) and function-scoped fixtures are no one's to share
            keys.append(f"the session fixture {name}" if d.scope == "session" else
                        f"the module fixture {name} of {item.module.__name__}")
        if item.get_closest_marker("gpu") is not None:
            keys.append("the GPU")
        for key in keys[1:]:
            parent[find(key)] = find(keys[0])
        if keys:
            keys_of[item] = keys[0]
    groups: dict[str, list] = {}
    for item, key in keys_of.items():
        groups.setdefault(find(key), []).append(item)
    return groups


try:
    from xdist.scheduler import LoadGroupScheduling
except ImportError:  # the GPU suite's wheelhouse runs without pytest-xdist
    LoadGroupScheduling = None

if LoadGroupScheduling is not None:
    class _FileGroups(LoadGroupScheduling):
        """``--dist loadgroup`` with FILE_GROUPS as the groups: each group's tests on one worker, every other test
        a unit of its own. (pytest-xdist's own ``xdist_group`` marks name a group by rewriting the test's id, which
        pytest 9.2's ids no longer take.) The groups with the most tests are handed out first."""

        def _split_scope(self, nodeid: str) -> str:
            return FILE_GROUPS.get(nodeid.split("::", 1)[0].rsplit("/", 1)[-1]) or super()._split_scope(nodeid)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") == "loadgroup":
            return _FileGroups(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """``-n N`` (``./course test -n 2``) splits the run over N pytest-xdist workers with ``--dist loadgroup``, so that
    each group of FILE_GROUPS stays on one worker (pytest-xdist's own default, ``--dist load``, would make what the
    group shares once per worker). Before pytest-xdist's own hook, which turns ``-n`` into its workers.
    ``./course test`` gives ``-n 2`` where there are two cores or more, unless its arguments say otherwise."""
    if (LoadGroupScheduling is not None and getattr(config.option, "numprocesses", None)
            and config.option.dist == "no" and not getattr(config.option, "distload", False)):
        config.option.dist = "loadgroup"


def pytest_addoption(parser):
    parser.addoption("--no-kernels-server", action="store_true",
                     help="split over workers, start no fork server for the kernels (a run of a few tests that "
                          "start none)")


def pytest_configure(config):
    """Split over pytest-xdist workers, the run's own process starts one fork server for the kernels the tests start
    (``kernels_share_a_fork_server``); each worker keeps its address out of its own environment."""
    global _KERNEL_FORK_SERVER
    from labsupport._forkserver import SHARED_SERVER_ENV

    if hasattr(config, "workerinput"):
        _KERNEL_FORK_SERVER = os.environ.pop(SHARED_SERVER_ENV, None)
    elif getattr(config.option, "numprocesses", None) and config.option.dist != "no" and \
            "not slow" not in (config.option.markexpr or "") and \
            not config.getoption("no_kernels_server"):  # (the quick loop starts no kernel)
        from contextlib import ExitStack

        from autograder.judge import SharedServer

        config.stash[_KERNELS_SERVER] = stack = ExitStack()
        stack.enter_context(SharedServer("course-test-kernels-"))  # before the workers start: they inherit it


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the run's own process, not a pytest-xdist worker
        session.config.stash[_TMP_BEFORE] = set(os.listdir(tempfile.gettempdir()))


def pytest_sessionfinish(session):
    """The kernels' fork server stops with the run, before the summary lists what the run left in /tmp."""
    stack = session.config.stash.get(_KERNELS_SERVER, None)
    if stack is not None:
        stack.close()


def pytest_terminal_summary(terminalreporter, config):
    """What the run left in the temporary folder, by name: a test's files belong in its own folder (``tmp_path``),
    and the course's own leave none behind. pytest's own folder of past runs is kept by design."""
    before = config.stash.get(_TMP_BEFORE, None)
    if before is None:
        return
    tmp = tempfile.gettempdir()
    from labsupport._pool import _TMP_PREFIX

    own = f"{_TMP_PREFIX}{os.getpid()}-"  # this process's own workers' folder (one process: -n 0), removed at its exit
    left = sorted(name for name in set(os.listdir(tmp)) - before if not name.startswith(("pytest-of-", own)))
    if left:
        terminalreporter.write_sep("=", f"left in {tmp} by this run (or by another process meanwhile)", yellow=True)
        terminalreporter.write_line(", ".join(left))


_TMP_BEFORE = pytest.StashKey[set]()
_KERNELS_SERVER = pytest.StashKey[object]()  # an ExitStack holding the server
#: in a pytest-xdist worker: ``LABSUPPORT_FORK_SERVER`` of the run's fork server for kernels (None: there is none)
_KERNEL_FORK_SERVER = None


def _graders_env() -> dict:
    from autograder.judge import INHERIT_ENV
    from labsupport._forkserver import SHARED_SERVER_ENV

    return {SHARED_SERVER_ENV: _KERNEL_FORK_SERVER, INHERIT_ENV: "1"} if _KERNEL_FORK_SERVER else {}


@pytest.fixture
def graders_env():
    """The environment for grading commands (``demo.cli(..., env=graders_env)``) that fork their kernels' workers
    and their judges from the run's fork server for kernels, which this run started and vouches for
    (``autograder.judge.INHERIT_ENV``), instead of importing torch and torch._dynamo into a server of their own. For
    tests that do not look at the grader's own server, its processes or its temporary files. Empty where there is
    no such server (``-n 0``)."""
    return _graders_env()


@pytest.fixture
def kernels_share_a_fork_server(monkeypatch):
    """The kernels this test starts share the run's fork server (``LABSUPPORT_FORK_SERVER``), as the kernels of a
    grading run share the grader's: none of them imports torch and torch._dynamo into a server of its own, which
    costs seconds of CPU per kernel, most of them for kernels that never start a worker. For tests whose kernels use
    this checkout's labsupport and whose own process starts no worker meanwhile (it would adopt the server too, and
    its workers would no longer be its children): checked after the test. Run in one process (``-n 0``), there is
    no such server and each kernel starts its own."""
    from multiprocessing import forkserver

    from labsupport._forkserver import SHARED_SERVER_ENV

    if _KERNEL_FORK_SERVER:
        monkeypatch.setenv(SHARED_SERVER_ENV, _KERNEL_FORK_SERVER)
    yield
    assert not getattr(forkserver._forkserver, "_labsupport_shared", False), \
        "the test's own process forked workers from the kernels' fork server"


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
            proc = demo.cli("grade", self.subs, "--jobs", jobs, "--out", out, "--course", demo.COURSE,
                            env=_graders_env())
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
    removed). A worker keeps its sandbox (and the environment it started with) from call to call, so the workers
    start afresh before the test and after; the fork server they come from stays (it never runs a sandbox)."""
    from labsupport._pool import stop_workers

    monkeypatch.delenv("LABSUPPORT_TEST_GRADER_IN_SANDBOX", raising=False)
    stop_workers()
    yield
    stop_workers()
