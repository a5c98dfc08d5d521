"""nbgrader configuration for the course.

Two ways in:

* ``make_config(root)`` returns the configuration the ``python -m autograder`` commands use (they build temporary
  course directories and point ``root`` at them);
* nbgrader itself loads this file as a config file (``nbgrader <command> --config autograder/nbgrader_config.py``
  from the repository root), in which case ``c`` is filled with the same settings for the repository.

Layout: nbgrader's source directory is ``solutions/`` and its release directory is ``notebooks/``; an assignment
``ID`` is the single notebook ``solutions/ID/ID.ipynb``.
"""

from __future__ import annotations

import os

#: Per-cell execution limit in seconds. nbgrader 0.9.6 reads ``Execute.timeout`` (``ExecutePreprocessor.timeout`` is
#: shadowed by it and has no effect). Hidden checks start workers that time out on their own after 20-30 s, so this
#: is a last line of defence against an answer cell that never returns.
CELL_TIMEOUT = 180

#: Kept output per cell: lines of stream output and lines of a traceback.
MAX_OUTPUT_LINES = 1000
MAX_TRACEBACK_LINES = 100

SOURCE_DIRECTORY = "solutions"
RELEASE_DIRECTORY = "notebooks"

#: What an answer cell of the release holds (code) and an answer of a written question (text), per language.
CODE_STUB = {"en": "# YOUR CODE HERE\nraise NotImplementedError()", "zh": "# 在此处填写你的代码\nraise NotImplementedError()"}
TEXT_STUB = {"en": "YOUR ANSWER HERE", "zh": "在此处填写你的答案"}


def stub_config(lang: str) -> dict:
    """nbgrader settings (``nbgrader_api``'s keywords) that give a release in ``lang`` its own stubs."""
    if lang == "en":
        return {}
    return {"ClearSolutions__code_stub": {"python": CODE_STUB[lang]}, "ClearSolutions__text_stub": TEXT_STUB[lang]}


def make_config(root: str, *, cell_timeout: float = CELL_TIMEOUT, db_url: str | None = None):
    """The nbgrader configuration for a course rooted at ``root``."""
    from traitlets.config import Config

    c = Config()
    root = os.path.abspath(root)
    c.CourseDirectory.root = root
    c.CourseDirectory.source_directory = SOURCE_DIRECTORY
    c.CourseDirectory.release_directory = RELEASE_DIRECTORY
    c.CourseDirectory.submitted_directory = "submitted"
    c.CourseDirectory.autograded_directory = "autograded"
    c.CourseDirectory.feedback_directory = "feedback"
    c.CourseDirectory.db_url = db_url or "sqlite:///" + os.path.join(root, "gradebook.db")
    c.CourseDirectory.course_id = "distributed-training-course"
    # Timeouts: see CELL_TIMEOUT. Interrupt a cell that runs too long and go on with the next one.
    c.Execute.timeout = int(cell_timeout)
    c.Execute.interrupt_on_timeout = True
    c.Execute.startup_timeout = 120
    # A deleted test cell must be put back (and fail), not silently score zero.
    c.OverwriteCells.add_missing_cells = True
    c.LimitOutput.max_lines = MAX_OUTPUT_LINES
    c.LimitOutput.max_traceback = MAX_TRACEBACK_LINES
    # Students get their own notebooks back untouched apart from the solution stubs.
    c.ClearSolutions.code_stub = {"python": CODE_STUB["en"]}
    c.ClearSolutions.text_stub = TEXT_STUB["en"]
    c.Exchange.root = os.path.join(root, "exchange")
    return c


def _repository_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


if "get_config" in globals():  # loaded by nbgrader as a config file
    c = get_config()  # noqa: F821 (provided by traitlets when it runs this file)
    c.merge(make_config(_repository_root()))
