"""The feedback page's HTML: the grader's exporter, which remembers highlighted code and sanitised HTML between the
notebooks a grading process renders, gives exactly the page nbconvert's own exporter gives, notebook after
notebook, whatever each notebook's language and cells."""

import copy
from pathlib import Path

import nbformat
import pytest

from autograder import feedback

REPO = Path(__file__).resolve().parent.parent


def _plain_html(nb) -> str:
    from nbconvert import HTMLExporter

    return HTMLExporter(template_name="basic").from_notebook_node(nb)[0]


def _variants():
    base = nbformat.read(REPO / "solutions" / "00_launch" / "00_launch.ipynb", as_version=4)
    edited = copy.deepcopy(base)
    edited.cells[1].source += "\nanswer = 42  # a student's own line"
    edited.cells.append(nbformat.v4.new_markdown_cell("Some <b>bold</b> words <script>alert(1)</script>"))
    magics = copy.deepcopy(base)
    magics.cells[1].metadata["magics_language"] = "bash"
    no_language = copy.deepcopy(base)
    no_language.metadata.pop("language_info", None)
    ipython = copy.deepcopy(base)
    ipython.metadata["language_info"] = {"name": "python", "pygments_lexer": "ipython3"}
    return [base, edited, magics, no_language, ipython, base]


def test_the_remembering_exporter_gives_nbconvert_s_page():
    exporter, _ = feedback._exporter()
    for nb in _variants():
        assert exporter.from_notebook_node(copy.deepcopy(nb))[0] == _plain_html(copy.deepcopy(nb))


@pytest.mark.parametrize("lexer", ["python", "ipython3"])
def test_each_notebook_is_highlighted_with_its_own_lexer(lexer):
    nb = _variants()[0]
    nb.metadata["language_info"] = {"name": "python", "pygments_lexer": lexer}
    assert f"hl-{lexer}" in feedback._exporter()[0].from_notebook_node(nb)[0]


def test_a_kernel_that_fails_to_start_is_started_again(tmp_path):
    """A kernel whose start fails before any cell ran (under load, a port chosen free can be taken before the kernel
    binds it) is started once more, and the notebook runs."""
    import nbformat
    from nbclient import NotebookClient

    from autograder.execute import run_notebook

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    real, failed, registered = NotebookClient.async_start_new_kernel, [], []

    async def flaky_start(self, **kwargs):
        registered.append(self._cleanup_kernel)
        if not failed:
            failed.append(1)
            raise RuntimeError("Address already in use")   # what zmq says when the port was taken meanwhile
        return await real(self, **kwargs)

    NotebookClient.async_start_new_kernel = flaky_start
    try:
        record = run_notebook(nb, tmp_path, timeout=60)
    finally:
        NotebookClient.async_start_new_kernel = real
    assert record.failure is None, (record.failure, record.failure_cell)
    assert "42" in nb.cells[0].outputs[0]["text"]
    assert len(registered) == 2
