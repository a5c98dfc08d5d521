"""The light install is enough: what `%pip install git+URL` puts into a Colab or Kaggle kernel (the package without
extras: labsupport and its lessons, matplotlib, cloudpickle, psutil, numpy) runs every release notebook and every
demo from top to bottom.

One fresh virtual environment for the session, without this Python's site-packages: torch (a CPU build, the torch a
runtime already has), then the course package built from this tree as pip builds it from a git address, then only
ipykernel and nbclient, to execute the notebooks the way a runtime's own kernel would. Each notebook runs as *Run
All* runs it, in a copy of its folder: an exercise not written yet says so at its visible test and the notebook goes
on; any error (a missing module above all) fails the test.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

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
start = time.monotonic()
error = None
try:
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": sys.argv[2]}}).execute()
except CellExecutionError as exc:
    error = str(exc)[-4000:]
text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
print(json.dumps({"error": error, "seconds": time.monotonic() - start, "text": text[-20000:],
                  "skipped": text.count("Its visible test is skipped and the notebook goes on")}))
"""


def _pip_names(python: Path, env: dict) -> set[str]:
    out = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], env=env, capture_output=True, text=True,
                         check=True).stdout
    return {p["name"].lower().replace("_", "-") for p in json.loads(out)}


def _pip(python: Path, env: dict, *args: str, timeout: float = 900) -> None:
    proc = subprocess.run([str(python), "-m", "pip", "install", "--quiet", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
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


@pytest.fixture(scope="session")
def light():
    """(python, env, root, counts, names added by the light install) of the fresh environment with torch, the light
    install, ipykernel and nbclient. Its folder is its own, not pytest's temporary folders, which another pytest
    run on the machine may remove meanwhile."""
    root = Path(tempfile.mkdtemp(prefix="course-light-"))
    try:
        yield _light_env(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _light_env(root: Path):
    import torch

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
        pytest.skip(f"the configured package indexes offer no CPU build for {torch_spec} (it would be a multi-GB CUDA "
                    "download)")
    _pip(python, env, torch_spec)
    with_torch = _pip_names(python, env)

    src = root / "src"  # the tree as `pip install git+URL` sees it: what git tracks, built into a wheel
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "grading-out"))
    _pip(python, env, "-c", str(_pin(root, python, env)), str(src))
    light_names = _pip_names(python, env)
    report = root / "full.json"  # what the lab and test extras would add on top
    _pip(python, env, "--dry-run", "--report", str(report), "-c", str(root / "torch-pin.txt"), f"{src}[lab,test]")
    full = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    _pip(python, env, "ipykernel", "nbclient")
    counts = {"torch alone": len(with_torch), "light install": len(light_names),
              "added by the light install": sorted(light_names - with_torch),
              "with ipykernel and nbclient": len(_pip_names(python, env)),
              "with the lab and test extras": len(light_names | full)}
    print(f"\nlight install: {counts}")
    return python, env, root, counts, light_names - with_torch


def _pin(root: Path, python: Path, env: dict) -> Path:
    """A pip constraints file that keeps the torch just installed, as ./course and a runtime keep theirs."""
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                             env=env, capture_output=True, text=True, check=True).stdout.strip()
    pin = root / "torch-pin.txt"
    pin.write_text(f"torch=={version}\n")
    return pin


def test_the_light_install_brings_none_of_the_labs_packages(light):
    python, env, root, counts, added = light
    assert "distributed-training-course" in added and "matplotlib" in added and "torch" not in added, counts
    assert not added & LAB_PACKAGES, sorted(added & LAB_PACKAGES)
    assert len(added) < 25, counts  # the package, matplotlib and their few dependencies
    probe = subprocess.run([str(python), "-c", "import labsupport, labsupport.gpu_demos, labsupport.plots; "
                            "print(labsupport.__file__)"], env=env, cwd=root, capture_output=True, text=True)
    assert probe.returncode == 0 and str(root / "venv") in probe.stdout, probe.stdout + probe.stderr


@pytest.mark.parametrize("path", NOTEBOOKS + DEMOS, ids=lambda p: p.stem)
@pytest.mark.timeout(1800)
def test_notebook_runs_with_the_light_install_alone(light, path):
    python, env, root, counts, added = light
    work = root / "run" / path.parent.name
    shutil.copytree(path.parent, work, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"),
                    dirs_exist_ok=True)
    proc = subprocess.run([str(python), "-c", DRIVER, str(work / path.name), str(work)], env=env, cwd=work,
                          capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["error"] is None, f"{path.name} stopped with the light install:\n{result['error']}"
    if path.parent.name == "demos":
        assert "the workers run gloo on the CPU" in result["text"] or "GPU" in result["text"]
    else:  # went past its unwritten exercises as Run All does, to the end
        assert result["skipped"] > 0, result["text"][-3000:]
    print(f"{path.stem}: {result['seconds']:.0f} s, {result['skipped']} visible tests skipped")
