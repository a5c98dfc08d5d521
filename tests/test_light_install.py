"""The light install is enough: what `%pip install git+URL` of the student edition puts into a Colab or Kaggle
kernel (the package without extras: labsupport and its lessons, matplotlib, cloudpickle, psutil, numpy) runs every
release notebook and every demo of the edition from top to bottom, with only the edition's own packages importable
(the demos' one run in the suite: on this CPU they say what a GPU runtime would show, and draw their figures).

One fresh virtual environment for the session, without this Python's site-packages: torch (a CPU build, the torch a
runtime already has), then the course package built from this tree as pip builds it from a git address, then only
ipykernel and nbclient, to execute the notebooks the way a runtime's own kernel would. The installed package holds
every module and file of the tree's packages, and each of its modules imports there.

The notebooks are those of a student edition (``python -m autograder student-edition``), run with its folder first
on the path, as a student's clone or install of it gives: a first cell proves that ``labsupport`` and
``autograder`` come from the edition and that the edition has no grader's checks. Each notebook runs as *Run All*
runs it, in a copy of its folder, two at a time (one per core): an exercise not written yet says so at its visible
test and the notebook goes on; any error (a missing module above all) fails the test. Where no CPU build of torch
can be installed into a fresh environment, the notebooks run with this Python instead, still in the edition.

The release notebooks run are the Chinese edition's (``student-edition --lang zh``), the demos the English
edition's. A Chinese release notebook is the English one with comments, docstrings and markdown translated, the
stub's comment in Chinese and one line more in its set-up cell, ``labsupport.use_language("zh")``
(``test_chinese_edition.py`` compares them cell by cell): one run covers the English release's code and the Chinese
path as well, and a last cell reports the language the notebook ended in and its exercises not started.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import demo_submissions as demo  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").glob("*/*.ipynb") if p.parent.name == p.stem)
DEMOS = sorted((ROOT / "demos").glob("*.ipynb"))

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.name == "nt", reason="a POSIX virtual environment")]

# the lab's packages (and the grader's and the tests'): none of them may come with the light install
LAB_PACKAGES = {"jupyterlab", "notebook", "jupyter-server", "jupyterlab-server", "nbgrader", "nbconvert", "pytest",
                "playwright", "ipykernel", "ipython", "nbclient", "nbformat", "jupyter-client", "traitlets"}

DRIVER = """
import json, sys, time
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

path = sys.argv[1]
nb = nbformat.read(path, as_version=4)
nb.cells.insert(0, nbformat.v4.new_code_cell(sys.argv[3]))
nb.cells.append(nbformat.v4.new_code_cell(REPORT))
start = time.monotonic()
error = None
try:
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": sys.argv[2]}}).execute()
except CellExecutionError as exc:
    error = str(exc)[-4000:]
outputs = [o for c in nb.cells[1:] if c.cell_type == "code" for o in c.outputs]
text = "".join(o.get("text", "") for o in outputs)
found = [line[len("@@course "):] for line in text.splitlines() if line.startswith("@@course ")]
print(json.dumps({"error": error, "seconds": time.monotonic() - start, "text": text[-20000:],
                  "images": sum("image/png" in o.get("data", {}) for o in outputs),
                  "course": json.loads(found[-1]) if found else None}))
"""
#: The last cell of a run: the language the notebook's messages ended in, and the exercises whose visible test found
#: them not started (Run All went past them), in words that do not depend on the language.
REPORT = """
import json as _json, labsupport.i18n as _i18n, labsupport.visible as _visible
print("@@course " + _json.dumps({"language": _i18n.language(), "not_started": sorted(
    name for name, outcomes in _visible._RESULTS.items()
    if any(o.status == _visible.NOT_STARTED for o in outcomes.values()))}))
"""
DRIVER = DRIVER.replace("REPORT", repr(REPORT), 1)


def _pip_names(python: Path, env: dict) -> set[str]:
    out = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], env=env, capture_output=True, text=True,
                         check=True).stdout
    return {p["name"].lower().replace("_", "-") for p in json.loads(out)}


def _pip(python: Path, env: dict, *args: str, timeout: float = 900) -> None:
    # --no-compile: pip would compile every module of torch and its dependencies (half a minute); the notebooks'
    # processes compile the few they import, as Python always does where there is no bytecode yet
    proc = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-compile", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"pip install {' '.join(args)}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"


def _torch_wheel_is_cpu(python: Path, env: dict, spec: str) -> bool:
    """Whether the torch the configured indexes offer for ``spec`` is a CPU build (no CUDA download)."""
    proc = subprocess.run([str(python), "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
                           "--only-binary", "torch", "--quiet", "--report", "-", spec], env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        return False
    meta = json.loads(proc.stdout)["install"][0]["metadata"]
    if "+" in meta["version"]:
        return meta["version"].split("+", 1)[1].startswith("cpu")
    return not any(r.lower().startswith(("nvidia-", "cuda-")) for r in meta.get("requires_dist") or [])


class Light:
    """The session's environment: ``python`` and ``env`` of the fresh virtual environment (None where no CPU build of
    torch could go into it: ``why``), ``counts`` and ``added`` (what the light install brought), and ``edition`` and
    ``edition_zh``, the English and the Chinese student editions, written in the same folder."""

    def __init__(self, root: Path):
        self.root, self.python, self.env, self.counts, self.added, self.why = root, None, None, {}, set(), ""
        self.edition, self.edition_zh = root / "edition", root / "edition-zh"
        for dest, lang in ((self.edition, "en"), (self.edition_zh, "zh")):
            proc = demo.cli("student-edition", dest, "--lang", lang)
            assert proc.returncode == 0, proc.stdout + proc.stderr

    def need_venv(self):
        if self.python is None:
            pytest.skip(self.why)


@pytest.fixture(scope="session")
def light():
    """The ``Light`` of this session. Its folder is its own, not pytest's temporary folders, which another pytest
    run on the machine may remove meanwhile."""
    root = Path(tempfile.mkdtemp(prefix="course-light-"))
    try:
        found = Light(root)
        _light_env(found)
        yield found
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _light_env(found: Light) -> None:
    import torch

    root = found.root
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith(("JUPYTER", "LABSUPPORT",
                                                                                          "NBGRADER", "CONDA"))}
    env.update(JUPYTER_CONFIG_DIR=str(root / "jupyter" / "config"), JUPYTER_DATA_DIR=str(root / "jupyter" / "data"),
               JUPYTER_RUNTIME_DIR=str(root / "jupyter" / "runtime"), MPLBACKEND="Agg", TMPDIR=str(root))
    torch_spec = "torch==" + torch.__version__.split("+")[0]
    if not _torch_wheel_is_cpu(python, env, torch_spec):
        found.why = (f"the configured package indexes offer no CPU build for {torch_spec} (it would be a multi-GB CUDA "
                     "download)")
        return
    _pip(python, env, torch_spec)
    with_torch = _pip_names(python, env)

    src = root / "src"  # the tree as `pip install git+URL` sees it: what git tracks, built into a wheel
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "grading-out"))
    _pip(python, env, "-c", str(_pin(root, python, env)), str(src))
    light_names = _pip_names(python, env)
    _pip(python, env, "ipykernel", "nbclient")
    found.counts = {"torch alone": len(with_torch), "light install": len(light_names),
                    "added by the light install": sorted(light_names - with_torch),
                    "with ipykernel and nbclient": len(_pip_names(python, env))}
    print(f"\nlight install: {found.counts}")
    found.python, found.env, found.added = python, env, light_names - with_torch


def _pin(root: Path, python: Path, env: dict) -> Path:
    """A pip constraints file that keeps the torch just installed, as ./course and a runtime keep theirs."""
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                             env=env, capture_output=True, text=True, check=True).stdout.strip()
    pin = root / "torch-pin.txt"
    pin.write_text(f"torch=={version}\n")
    return pin


def test_the_light_install_brings_none_of_the_labs_packages(light):
    light.need_venv()
    python, env, root, counts, added = light.python, light.env, light.root, light.counts, light.added
    assert "distributed-training-course" in added and "matplotlib" in added and "torch" not in added, counts
    assert not added & LAB_PACKAGES, sorted(added & LAB_PACKAGES)
    assert len(added) < 25, counts  # the package, matplotlib and their few dependencies
    probe = subprocess.run([str(python), "-c", "import labsupport, labsupport.gpu_demos, labsupport.plots; "
                            "print(labsupport.__file__)"], env=env, cwd=root, capture_output=True, text=True)
    assert probe.returncode == 0 and str(root / "venv") in probe.stdout, probe.stdout + probe.stderr


MODULES = """
import importlib, importlib.metadata, json, pkgutil, labsupport
files = sorted(str(f) for f in importlib.metadata.files("distributed-training-course")
               if str(f).startswith(("labsupport/", "autograder/")) and str(f).endswith(".py"))
failed = {}
for info in pkgutil.walk_packages(labsupport.__path__, "labsupport."):
    try:
        importlib.import_module(info.name)
    except Exception as exc:
        failed[info.name] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"files": files, "failed": failed, "at": labsupport.__file__}))
"""


def test_the_installed_package_holds_every_module_and_each_imports(light):
    """What pip built from the tree holds every Python file git tracks in ``labsupport`` and ``autograder``, and every
    module of ``labsupport`` imports with the light install's packages alone (the notebooks below run from the
    edition's copy of the same files)."""
    light.need_venv()
    proc = subprocess.run([str(light.python), "-c", MODULES], env=light.env, cwd=light.root, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert str(light.root / "venv") in found["at"], found["at"]
    tracked = subprocess.run(["git", "ls-files", "labsupport", "autograder"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    want = sorted(f for f in tracked if f.endswith(".py"))
    assert found["files"] == want, sorted(set(want) ^ set(found["files"]))
    assert not found["failed"], found["failed"]


NO_EDITABLE_FINDER = ("import sys\n"
                      "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]\n")


def _probe(edition: Path) -> str:
    """The first cell of every run: only the edition's packages are importable, and it has no grader's checks."""
    return (NO_EDITABLE_FINDER + "import importlib.util, labsupport, autograder\n"
            f"assert labsupport.__file__.startswith({str(edition)!r}), labsupport.__file__\n"
            f"assert autograder.__file__.startswith({str(edition)!r}), autograder.__file__\n"
            "assert importlib.util.find_spec('autograder.checks') is None\n")


def _in_edition(edition: Path, path: Path) -> Path:
    return edition / ("demos" if path.parent.name == "demos" else "notebooks") / (
        path.name if path.parent.name == "demos" else f"{path.stem}/{path.name}")


#: A fork server of the light install, started from the Chinese edition and shared by its release notebooks'
#: kernels (``LABSUPPORT_FORK_SERVER``, as a grading run's kernels share the grader's); it ends when its input does.
HOLD_SERVER = """
import sys
from labsupport import _forkserver
print(_forkserver.start_shared_server(sys.argv[1]), flush=True)
sys.stdin.read()
_forkserver._stop_forkserver()
"""


@pytest.fixture(scope="module")
def runs(light):
    """{notebook stem: what the driver printed, or the reason it failed}: every release notebook of the Chinese
    edition and every demo of the English one, run two at a time, each in a copy of its folder.

    The release notebooks' kernels share one fork server, started with the light install's Python from the Chinese
    edition: each would otherwise import torch and torch._dynamo into a server of its own, a few seconds of CPU
    each. The demos' kernels start their own, as a kernel on a runtime does."""
    python = light.python or Path(sys.executable)
    if light.python is not None:
        env = dict(light.env)
    else:  # this Python, as a student's own environment with the lab extras would run them
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LABSUPPORT", "NBGRADER"))}
        env.update(MPLBACKEND="Agg")
    folder = Path(tempfile.mkdtemp(prefix="srv-", dir=light.root))
    holder = subprocess.Popen([str(python), "-c", HOLD_SERVER, str(folder)], env=dict(env, PYTHONPATH=str(
        light.edition_zh)), cwd=folder, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        server = holder.stdout.readline().strip()
        assert server, "the light install's shared fork server did not start"
        return _run_all(light, python, env, server)
    finally:
        holder.stdin.close()
        try:
            holder.wait(timeout=60)
        except subprocess.TimeoutExpired:  # never left running: the server ends with it
            holder.kill()
            holder.wait()
        holder.stdout.close()


def _run_all(light, python: Path, env: dict, server: str) -> dict:
    def run(path: Path):
        edition = light.edition if path.parent.name == "demos" else light.edition_zh
        src = _in_edition(edition, path)
        work = light.root / "run" / path.stem
        if path.parent.name == "demos":
            work.mkdir(parents=True)
            shutil.copyfile(src, work / src.name)
        else:
            shutil.copytree(src.parent, work, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
        run_env = dict(env, PYTHONPATH=str(edition))
        if path.parent.name == "demos":  # a runtime's own figures: matplotlib's inline backend, as the kernel sets it
            run_env.pop("MPLBACKEND", None)
        else:
            run_env["LABSUPPORT_FORK_SERVER"] = server
        proc = subprocess.run([str(python), "-c", DRIVER, str(work / src.name), str(work), _probe(edition)],
                              env=run_env, cwd=work, capture_output=True, text=True, timeout=1700)
        if proc.returncode != 0:
            return proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    paths = NOTEBOOKS + DEMOS
    with ThreadPoolExecutor(2) as pool:
        return dict(zip((p.stem for p in paths), pool.map(run, paths)))


@pytest.mark.parametrize("path", NOTEBOOKS + DEMOS, ids=lambda p: p.stem)
@pytest.mark.timeout(2400)   # the first one waits for all the runs
def test_notebook_runs_with_the_light_install_alone(runs, path):
    result = runs[path.stem]
    assert isinstance(result, dict), result
    assert result["error"] is None, f"{path.name} stopped with the light install:\n{result['error']}"
    if path.parent.name == "demos":  # test_gpu_demos.py reads the demos; here they run, once for the suite
        assert "the workers run gloo on the CPU" in result["text"] or "GPU" in result["text"]
        if "the workers run gloo on the CPU" in result["text"]:  # the plain statement of what a GPU would show
            assert "CPU only:" in result["text"] and "On " in result["text"], result["text"][-3000:]
        assert result["images"], f"{path.name}: no figure"
        assert result["course"]["language"] == "en", result["course"]
    else:  # the Chinese release, which went past its unwritten exercises as Run All does, to the end
        assert result["course"]["language"] == "zh", result["course"]
        assert result["course"]["not_started"], result["text"][-3000:]
    print(f"{path.stem}: {result['seconds']:.0f} s, exercises not started: {result['course']['not_started']}")
