"""The course as a student meets it: JupyterLab started as the README says, driven in headless Chromium.

Notebook 00 (a temporary copy of its release, with four cells a student might add at the end): the setup cell and
a ``%%distributed`` cell run, the ranks' ``[rank N]`` lines appear while a cell is still running, a worker's crash
shows the rank, the exception and the student's own line first, an interrupt stops every rank and says so in one
line, and the next cell works. Then nbgrader's Validate button: an untouched release fails and names its exercise,
the solved notebook passes, and notebook 04 with one exercise solved gets a checklist (one line per exercise, no
traceback) instead of a traceback per exercise. The server runs from the repository root, so Validate reads its
``nbgrader_config.py``. In Chinese: a second lab started as ``./course lab --lang zh`` starts it (``jupyter-config/zh``
on ``JUPYTER_CONFIG_PATH``) shows JupyterLab's Chinese interface, and notebook 04 of the Chinese release with one
exercise solved gets the same checklist from Validate.

The browser is Debian's ``chromium`` (``.ci/run`` installs it when apt can), used by Playwright through
``executable_path``: the test never downloads a browser and skips when there is none. Set ``BROWSER_TEST_SHOTS`` to
a folder to keep a screenshot of every step.
"""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from labsupport._ports import free_port

ROOT = Path(__file__).resolve().parents[1]
RELEASE = ROOT / "notebooks" / "00_launch" / "00_launch.ipynb"
SOLUTION = ROOT / "solutions" / "00_launch" / "00_launch.ipynb"
TP_RELEASE = ROOT / "notebooks" / "04_tensor_parallel" / "04_tensor_parallel.ipynb"
TP_SOLUTION = ROOT / "solutions" / "04_tensor_parallel" / "04_tensor_parallel.ipynb"
TP_RELEASE_ZH = ROOT / "notebooks-zh" / "04_tensor_parallel" / "04_tensor_parallel.ipynb"
CHROMIUM = os.environ.get("COURSE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = os.environ.get("BROWSER_TEST_SHOTS")

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[lab,test]')")
expect = sync_api.expect

pytestmark = pytest.mark.timeout(300)

#: Cells a student adds at the end of notebook 00: live prints then a long wait (interrupted), a crash, a recovery.
LIVE_THEN_WAIT = (
    "def wait_a_minute():\n"
    "    print(f'waiting on rank {dist.get_rank()}', flush=True)\n"
    "    time.sleep(60)\n"
    "\n"
    "labsupport.run(wait_a_minute, world_size=2)"
)
CRASH = (
    "def broken_step():\n"
    "    rank = dist.get_rank()\n"
    "    return 1 / (rank - 1)   # rank 1 divides by zero\n"
    "\n"
    "labsupport.run(broken_step, world_size=2)"
)
RECOVERY = "labsupport.run(lambda: 10 * dist.get_rank(), world_size=2)"


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _one_exercise_solved(release=TP_RELEASE) -> nbformat.NotebookNode:
    """Notebook 04's release (``release``) with its first exercise (copy_to_tp) answered as the solution answers it."""
    def grade_id(cell):
        return cell.metadata.get("nbgrader", {}).get("grade_id")

    solution = next(c for c in nbformat.read(TP_SOLUTION, as_version=4).cells if grade_id(c) == "copy_to_tp")
    answer = "\n".join(line for line in solution.source.splitlines()
                        if "### BEGIN SOLUTION" not in line and "### END SOLUTION" not in line)
    nb = nbformat.read(release, as_version=4)
    cell = next(c for c in nb.cells if grade_id(c) == "copy_to_tp")
    cell.source = answer
    return nb


def _no_chromium():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM}: install Debian's package (apt-get install chromium; .ci/run does it "
                    "when apt can). This test never downloads a browser.")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a temporary folder holding the notebooks; stopped with everything it started."""
    _no_chromium()
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "root"
    (root / "untouched").mkdir(parents=True)
    (root / "solved").mkdir()
    nb = nbformat.read(RELEASE, as_version=4)
    nb.cells += [nbformat.v4.new_code_cell(src) for src in (LIVE_THEN_WAIT, CRASH, RECOVERY)]
    nbformat.write(nb, root / "00_launch.ipynb")
    shutil.copy(RELEASE, root / "untouched" / "00_launch.ipynb")
    shutil.copy(SOLUTION, root / "solved" / "00_launch.ipynb")
    (root / "partly").mkdir()
    nbformat.write(_one_exercise_solved(), root / "partly" / "04_tensor_parallel.ipynb")
    yield from _serve(tmp, root)


@pytest.fixture(scope="module")
def lab_zh(tmp_path_factory):
    """A JupyterLab server as ``./course lab --lang zh`` starts it, on a folder holding the Chinese release of 04
    with one exercise solved."""
    _no_chromium()
    tmp = tmp_path_factory.mktemp("lab-zh")
    root = tmp / "root"
    (root / "partly").mkdir(parents=True)
    nbformat.write(_one_exercise_solved(TP_RELEASE_ZH), root / "partly" / "04_tensor_parallel.ipynb")
    yield from _serve(tmp, root, [ROOT / "jupyter-config" / "zh", ROOT / "jupyter-config"])


def _serve(tmp: Path, root: Path, config_path=()):
    """Serve ``root`` (the lab's dict) until the generator is closed; ``config_path``: JUPYTER_CONFIG_PATH."""
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), IPYTHONDIR=str(tmp / "ipython"))
    env.pop("NBGRADER_VALIDATING", None)
    if config_path:
        env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(map(str, config_path))
    jupyter = Path(sys.executable).parent / "jupyter"   # .venv/bin/jupyter lab, as the README says
    start = [str(jupyter), "lab"] if jupyter.exists() else [sys.executable, "-m", "jupyterlab"]
    cmd = start + ["--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--allow-root",
           f"--LabApp.workspaces_dir={tmp / 'workspaces'}", f"--LabApp.user_settings_dir={tmp / 'settings'}",
           "--ServerApp.open_browser=False"]
    log = open(tmp / "server.log", "w")
    # from the repository root, as ./course lab: Validate reads ./nbgrader_config.py from the server's folder
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240   # ends once the lab answers; a loaded machine starts it slowly
    while True:
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                json.load(r)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                log.close()
                pytest.fail("JupyterLab did not start:\n" + (tmp / "server.log").read_text()[-3000:])
            time.sleep(0.5)
    try:
        yield {"base": base, "token": token, "log": tmp / "server.log", "root": root}
    finally:
        children = _descendants(server.pid)
        os.killpg(server.pid, signal.SIGTERM)   # the server shuts its kernels down on SIGTERM
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
        for child in children:                  # kernels and their workers, if any outlived the server
            try:
                child.kill()
            except Exception:
                pass
        log.close()


@pytest.fixture(scope="module")
def browser():
    _no_chromium()
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


class Lab:
    """One browser tab on one notebook."""

    def __init__(self, browser, lab, path):
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.page.set_default_timeout(30_000)
        self.page.goto(f"{lab['base']}/lab/tree/{path}?reset&token={lab['token']}")
        self.cells = self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell")
        cells = len(nbformat.read(lab["root"] / path, as_version=4).cells)
        expect(self.cells).to_have_count(cells, timeout=60_000)
        expect(self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Spinner")).to_have_count(0, timeout=60_000)
        self.shot("opened " + path.replace("/", "_"))

    def shot(self, name):
        if SHOTS:
            Path(SHOTS).mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(Path(SHOTS) / f"{time.monotonic():.0f}-{name}.png"))

    def run(self, index):
        """Run cell ``index`` (negative: from the end) in place; its locator."""
        n = self.cells.count()
        cell = self.cells.nth(index % n)
        cell.locator(".jp-InputArea-editor").click()
        self.page.keyboard.press("Control+Enter")
        return cell

    def output(self, cell) -> str:
        return cell.locator(".jp-OutputArea").inner_text()

    def close(self):
        self.page.close()


def test_notebook_00_live_output_crash_interrupt_recovery(browser, lab):
    t = Lab(browser, lab, "00_launch.ipynb")
    try:
        setup = t.run(1)
        expect(setup.locator(".jp-OutputArea")).to_contain_text("torch ", timeout=90_000)
        t.shot("setup")

        allreduce = t.run(6)   # %%distributed -n 4: every rank prints its line
        out = allreduce.locator(".jp-OutputArea")
        for rank in range(4):
            expect(out).to_contain_text(f"[rank {rank}] rank {rank} of 4: the sum of all ranks is 6", timeout=60_000)
        t.shot("distributed")

        waiting = t.run(-3)    # prints, then sleeps a minute: the lines show while the cell still runs
        out = waiting.locator(".jp-OutputArea")
        for rank in range(2):
            expect(out).to_contain_text(f"[rank {rank}] waiting on rank {rank}", timeout=60_000)
        expect(waiting.locator(".jp-InputPrompt")).to_contain_text("*")
        t.shot("live")
        t.page.keyboard.press("Escape")
        t.page.keyboard.press("i")
        t.page.keyboard.press("i")
        expect(out).to_contain_text("interrupted: all 2 ranks stopped", timeout=30_000)
        t.shot("interrupted")
        assert "selectors.py" not in t.output(waiting) and "connection.py" not in t.output(waiting)

        crash = t.run(-2)
        err = crash.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
        expect(err.first).to_be_visible(timeout=60_000)
        t.shot("crash")
        head = "\n".join(t.output(crash).strip().splitlines()[:6])
        assert "rank 1" in head and "ZeroDivisionError" in head, head
        assert "Cell In[" in head and "1 / (rank - 1)" in head, head   # the student's own cell and line
        assert "launch.py" not in head, head

        recovery = t.run(-1)
        expect(recovery.locator(".jp-OutputArea")).to_contain_text("[0, 10]", timeout=60_000)
        t.shot("recovered")
    finally:
        t.close()


def _validate(browser, lab, path) -> str:
    t = Lab(browser, lab, path)
    try:
        toolbar = t.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-NotebookPanel-toolbar")
        toolbar.get_by_text("Validate", exact=True).click()
        dialog = t.page.locator(".jp-Dialog")
        expect(dialog).to_be_visible(timeout=150_000)
        expect(dialog.locator(".jp-Dialog-body")).not_to_be_empty(timeout=150_000)
        t.shot("validated " + path.replace("/", "_"))
        return dialog.inner_text()
    finally:
        t.close()


def test_validate_fails_untouched_and_names_the_exercise(browser, lab):
    text = _validate(browser, lab, "untouched/00_launch.ipynb")
    assert "Success" not in text, text
    assert "rank_table" in text, text


def test_validate_passes_the_solved_notebook(browser, lab):
    text = _validate(browser, lab, "solved/00_launch.ipynb")
    assert "Success! Your notebook passes all the tests." in text, text
    log = Path(lab["log"]).read_text()
    assert "No nbgrader_config.py file found" not in log, log[-3000:]


def test_validate_reads_the_course_config_from_the_server_folder(monkeypatch):
    """The Validate handler loads ``nbgrader_config.py`` from the server's working folder (the repository root, where
    ``./course lab`` starts it): the course's three-minute cells, not nbgrader's 30 s."""
    from nbgrader.server_extensions.validate_assignment.handlers import ValidateAssignmentHandler

    from autograder.nbgrader_config import CELL_TIMEOUT

    monkeypatch.chdir(ROOT)
    config = ValidateAssignmentHandler.load_config(None)   # it uses nothing of the handler but the folder
    assert config.Execute.timeout == CELL_TIMEOUT
    assert config.CourseDirectory.source_directory == "solutions"


def test_validate_a_partly_solved_notebook_reads_like_a_checklist(browser, lab):
    """04 with copy_to_tp solved: one report with a line per exercise, the five not written yet said to be not
    started, and none of the library's frames; the checklist is the first thing under nbgrader's heading (not the
    source of the last exercise's hidden-test cell)."""
    text = _validate(browser, lab, "partly/04_tensor_parallel.ipynb")
    assert "Success" not in text, text
    assert text.count("The following cell failed") == 1, text
    lines = [line.strip() for line in text.splitlines()]
    after = [line for line in lines[lines.index("The following cell failed:") + 1:] if line]
    assert after[0].startswith("1 of 6 exercises pass their visible tests"), text
    assert "require_passed" not in text and "hidden tests" not in text, text
    assert "copy_to_tp            passes" in lines, text
    for name in ("reduce_from_tp", "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelAttention"):
        assert f"{name:<20}  not started: it still raises NotImplementedError" in lines, (name, text)
    for ours in ("Traceback", "visible.py", "labsupport/", "File "):
        assert ours not in text, (ours, text)
    assert len(text.splitlines()) < 25, text


TP_EXERCISES = ("copy_to_tp", "reduce_from_tp", "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP",
                "ParallelAttention")


def test_the_chinese_lab_and_validate_on_a_chinese_notebook(browser, lab_zh):
    """The lab of ``./course lab --lang zh``: JupyterLab's menus in Chinese, the Chinese release's stub in the answer
    cells, the set-up cell's switch to Chinese; Validate on 04 with one exercise solved gives the checklist, one line
    per exercise (the solved one's status differs from the five others', which read alike), no traceback. The
    words of the checklist and of the messages are labsupport's: Chinese where its message catalog has them."""
    t = Lab(browser, lab_zh, "partly/04_tensor_parallel.ipynb")
    try:
        menus = t.page.locator("#jp-MainMenu .lm-MenuBar-itemLabel")
        expect(menus.first).to_have_text("文件", timeout=60_000)      # "File", from the zh_CN language pack
        stubs = t.page.locator(".jp-InputArea-editor", has_text="在此处填写你的代码")
        expect(stubs).to_have_count(len(TP_EXERCISES) - 1)
        setup = t.page.locator(".jp-InputArea-editor", has_text='labsupport.use_language("zh")')
        expect(setup).to_have_count(1)
        t.shot("chinese lab")
    finally:
        t.close()
    text = _validate(browser, lab_zh, "partly/04_tensor_parallel.ipynb")
    assert "Success" not in text, text
    assert text.count("The following cell failed") == 1, text        # nbgrader's own words
    lines = [line.strip() for line in text.splitlines()]
    status = {}
    for name in TP_EXERCISES:
        found = [line for line in lines if line.split() and line.split()[0] == name]
        assert len(found) == 1, (name, text)
        status[name] = found[0][len(name):].strip()
    assert len({status[name] for name in TP_EXERCISES[1:]}) == 1 and status["copy_to_tp"] != status["ParallelMLP"], \
        status
    for ours in ("Traceback", "visible.py", "labsupport/", "File "):
        assert ours not in text, (ours, text)
    assert len(text.splitlines()) < 25, text
