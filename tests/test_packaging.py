"""The set-up promises: one dependency list in two formats, a light install for a running Colab or Kaggle kernel
(the lab and the test tools in extras), a wheel with every package in it, and a README whose quick start CI really
runs."""

import os
import re
import shutil
import subprocess
import sys
import zipfile

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# conda packages in environment.yml that stand for a PyPI requirement of pyproject.toml. torch is taken from
# conda-forge as "pytorch >=2.4 cpu*" (conda's NAME VERSION BUILD: its CPU build) rather than through pip, where
# it would be PyPI's torch, on Linux x86_64 a multi-GB CUDA build.
CONDA_FOR_PYPI = {"pytorch": "torch"}
CONDA_BUILD = {"pytorch": "cpu*"}


def test_environment_yml_lists_the_same_packages_as_pyproject():
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    wanted = [str(Requirement(r)) for r in project["dependencies"] + extras["lab"] + extras["test"]]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = [str(Requirement(r)) for r in pip_section if not r.startswith("-")]
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    for spec in conda:
        name, version, build = (spec.split() + ["", ""])[:3]
        if name in CONDA_FOR_PYPI:
            assert build == CONDA_BUILD[name], f"{spec}: the build should be {CONDA_BUILD[name]}"
            listed.append(str(Requirement(CONDA_FOR_PYPI[name] + version)))
        elif name.startswith("python"):
            assert Requirement(spec).specifier == Requirement(f"python{project['requires-python']}").specifier
    assert len(listed) == len(set(listed)), f"listed twice in environment.yml: {listed}"
    assert set(listed) == set(wanted), (f"only in environment.yml: {set(listed) - set(wanted)}; "
                                        f"only in pyproject: {set(wanted) - set(listed)}")
    assert "-e ." in pip_section


# what a Colab or Kaggle runtime already has under its own kernel, or only the lab, the grader and the tests use
LAB_PACKAGES = {"jupyterlab", "notebook", "jupyter-server", "jupyterlab-server", "jupyter-client", "jupyter-core",
                "ipykernel", "ipython", "ipywidgets", "traitlets", "nbgrader", "nbclient", "nbformat", "nbconvert",
                "pytest", "pytest-timeout", "playwright", "pyyaml", "setuptools", "packaging", "tomli", "ruff"}


def _names(requirements) -> set[str]:
    return {Requirement(r).name.lower().replace("_", "-") for r in requirements}


def test_the_package_itself_needs_only_what_notebooks_run_with():
    """`%pip install git+URL` into a running Colab or Kaggle kernel adds what the notebooks need and none of the
    lab's packages, which would replace the versions the runtime pins under its own kernel. ./course lab installs
    the lab extras, ./course test the test extras too."""
    project = _pyproject()["project"]
    light = _names(project["dependencies"])
    assert light == {"torch", "numpy", "matplotlib", "cloudpickle", "psutil"}, light
    assert not light & LAB_PACKAGES
    extras = project["optional-dependencies"]
    assert {"jupyterlab", "nbgrader", "ipykernel", "nbclient", "nbformat"} <= _names(extras["lab"])
    assert {"pytest", "playwright"} <= _names(extras["test"]) and not _names(extras["test"]) & _names(extras["lab"])
    assert "distributed-training-course[lab,test]" in extras["dev"]
    script = (ROOT / "course").read_text()
    assert 'setup lab\n' in script and 'setup lab,test\n' in script and '-e ".[$1]"' in script


def test_labsupport_imports_without_the_lab(tmp_path):
    """Every module of labsupport (the lessons, the plots, the GPU demos' helpers) imports with Jupyter, IPython,
    nbgrader and the rest of the lab unimportable: at import time it needs only the light install."""
    blocked = ["IPython", "ipykernel", "jupyter_client", "jupyter_core", "jupyterlab", "jupyter_server", "notebook",
               "nbgrader", "nbclient", "nbformat", "nbconvert", "traitlets", "yaml", "pytest", "packaging"]
    code = f"""
import importlib, importlib.abc, pkgutil, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
sys.meta_path.insert(0, Block())
import labsupport
names = [m.name for m in pkgutil.walk_packages(labsupport.__path__, "labsupport.")]
for name in names:
    importlib.import_module(name)
print(len(names), "modules")
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert int(proc.stdout.split()[-2]) > 20, proc.stdout


def test_the_grading_tools_without_the_lab_say_what_to_install(tmp_path):
    """In a light install ``python -m autograder`` cannot run nbgrader: it says which extras bring it."""
    code = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("nbformat", "nbgrader", "nbclient"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from autograder.__main__ import main
sys.exit(main(sys.argv[1:]))
"""
    proc = subprocess.run([sys.executable, "-c", code, "release", "--out", str(tmp_path / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "comes with the course's lab extras" in proc.stderr and "./course setup" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def _packages():
    """Every package of the project: a folder under labsupport/ or autograder/ with an __init__.py."""
    return sorted(p.parent.relative_to(ROOT).as_posix() for top in ("labsupport", "autograder")
                  for p in (ROOT / top).rglob("__init__.py") if "__pycache__" not in p.parts)


def test_a_built_wheel_has_every_package(tmp_path):
    """A non-editable install (the README's `%pip install git+URL` on Colab) gets every subpackage."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "grading-out"))
    out = tmp_path / "dist"
    build = ("import sys\nfrom setuptools import build_meta\n"
             "print(build_meta.build_wheel(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", build, str(out)], cwd=src, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheel = out / proc.stdout.strip().splitlines()[-1]
    names = set(zipfile.ZipFile(wheel).namelist())

    packages = _packages()
    assert {"labsupport", "labsupport/plots", "autograder", "autograder/checks"} <= set(packages)
    missing = [f"{p}/__init__.py" for p in packages if f"{p}/__init__.py" not in names]
    assert not missing, f"packages missing from the wheel: {missing}"
    modules = sorted(m.relative_to(ROOT).as_posix() for p in packages for m in (ROOT / p).glob("*.py"))
    missing = [m for m in modules if m not in names]
    assert not missing, f"modules missing from the wheel: {missing}"
    assert "autograder/nbgrader_config.py" in names
    # the messages' catalogs: labsupport.i18n reads the compiled .mo with Python's gettext
    catalogs = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "labsupport" / "locale").rglob("*.[mp]o"))
    assert "labsupport/locale/zh_CN/LC_MESSAGES/labsupport.mo" in catalogs
    missing = [c for c in catalogs if c not in names]
    assert not missing, f"catalogs missing from the wheel: {missing}"
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"labsupport", "autograder"}, f"the wheel holds more than the two packages: {tops}"


def test_the_torch_that_setup_installs_satisfies_the_package_range():
    script = (ROOT / "course").read_text()
    pinned = re.search(r'TORCH_VERSION="\$\{COURSE_TORCH_VERSION:-([0-9.]+)\}"', script).group(1)
    torch_req = next(Requirement(r) for r in _pyproject()["project"]["dependencies"] if r.startswith("torch"))
    assert Version(pinned) in torch_req.specifier
    assert torch_req.specifier.filter([Version("99.0")]), "keep torch an open range: a user's torch is kept"


def test_readme_quick_start_is_two_commands_and_ci_runs_the_second():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:bash)?\n(.*?)```", section, re.S)
    assert len(blocks) == 1
    commands = [line.split("#")[0].strip() for line in blocks[0].strip().splitlines()]
    assert len(commands) == 2
    lab, test = commands
    assert lab == "./course lab"
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"exec {test}" in ci
