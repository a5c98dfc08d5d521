"""Test selection: ``./course test -m "not slow"`` is the quick loop (the launcher, the lesson modules, the screen,
the layout); the slow tests run real kernels, grade notebooks through nbgrader, or run every check on workers."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))

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


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in SLOW_MODULES or module.endswith("_checks"):
            item.add_marker(pytest.mark.slow)
        if "class_graded" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(CLASS_GRADING_TIMEOUT), append=False)


@pytest.fixture(scope="session")
def class_graded(tmp_path_factory):
    """Every student of ``fixtures/class_of_submissions.py`` graded in one run (see there)."""
    from class_of_submissions import Graded

    return Graded(tmp_path_factory.mktemp("class-grading"))
