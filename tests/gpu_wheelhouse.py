"""The wheels the GPU suite (tests/test_gpu.py) needs on a GPU machine that reaches no package index.

Such a machine has Python with a CUDA build of torch, pytest, pytest-timeout, cloudpickle, psutil and matplotlib
(``MACHINE``). What the suite adds runs notebooks (nbformat, nbclient, ipykernel) and grades a class (nbgrader).
This script, run where PyPI can be reached, downloads those packages and everything they require for the target
Python and platform, leaves out what the machine has and what grading and notebooks never import (``LEFT_OUT``),
then checks from the wheels' own metadata that every requirement of what is kept is met, and prints the command
that installs the folder and runs the suite::

    python tests/gpu_wheelhouse.py                   # .whl/ for Python 3.12 on manylinux x86_64
    python tests/gpu_wheelhouse.py --python 3.11 --dest /tmp/w311

``.whl/`` is ignored by git; a run of the suite on a borrowed machine carries it with the working tree.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]

#: what the GPU machine has; with everything these require (found by pip, for the target Python)
MACHINE = ["torch", "pytest", "pytest-timeout", "cloudpickle", "psutil", "matplotlib"]

#: what the suite runs: notebooks in a kernel, and ``python -m autograder grade`` (pinned as in pyproject.toml)
ROOTS = ["nbformat>=5.9", "nbclient>=0.10", "ipykernel>=6.0", "nbgrader==0.9.6"]

#: required by the packages above, but imported by nothing the suite runs (the lab and its server extensions,
#: a kernel's debugger and completion, widgets); left out to keep the folder small
LEFT_OUT = {
    "jupyterlab": "the lab itself (nbgrader's lab extension)",
    "jupyterlab-server": "the lab's server",
    "jupyter-lsp": "the lab's language servers",
    "babel": "the lab server's translations",
    "json5": "the lab server's settings",
    "async-lru": "the lab",
    "notebook": "the classic notebook's interface (nbgrader's formgrader pages)",
    "notebook-shim": "the notebook interface's server shim",
    "jupyter-builder": "building lab extensions",
    "debugpy": "a kernel's debugger (ipykernel runs without it)",
    "jedi": "IPython's tab completion",
    "parso": "IPython's tab completion (jedi)",
    "ipywidgets": "widgets",
    "widgetsnbextension": "widgets",
    "jupyterlab-widgets": "widgets",
}

#: install the folder without an index, then run the suite (the README gives the same line)
COMMAND = ("python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:$PWD "
           "JUPYTER_PATH=/tmp/site/share/jupyter python3 -m pytest -m gpu -rA -p no:cacheprovider tests/test_gpu.py")

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64", "any"]


def pip_target(python: str) -> list[str]:
    abi = "cp" + python.replace(".", "")
    return ["--only-binary=:all:", "--python-version", python, "--implementation", "cp", "--abi", abi,
            "--abi", "abi3", "--abi", "none", *(a for p in PLATFORMS for a in ("--platform", p))]


def machine_packages(python: str) -> dict[str, str]:
    """{name: version} of MACHINE and what it requires, as pip would resolve them for ``python``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--target", str(Path(tmp) / "t"), "--report", str(report), *pip_target(python), *MACHINE],
                       check=True)
        items = json.loads(report.read_text())["install"]
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def download(dest: Path, python: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest), *pip_target(python),
                    *ROOTS], check=True)


def metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(name).decode("utf-8"))


def environment(python: str) -> dict:
    major, minor = python.split(".")[:2]
    return {"python_version": f"{major}.{minor}", "python_full_version": f"{major}.{minor}.0", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def unmet(wheels: list[Path], machine: dict[str, str], python: str) -> list[str]:
    """Each requirement of a kept wheel (for ``python`` on Linux x86_64, no extras) that neither a kept wheel nor
    the machine meets, and that is not left out on purpose."""
    kept = {canonicalize_name(parse_wheel_filename(w.name)[0]): str(parse_wheel_filename(w.name)[1]) for w in wheels}
    env, problems = environment(python), []
    for wheel in wheels:
        for text in metadata(wheel).get_all("Requires-Dist") or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            name = canonicalize_name(req.name)
            if name in LEFT_OUT:
                continue
            have = kept.get(name) or machine.get(name)
            if have is None:
                problems.append(f"{wheel.name} requires {text}: in neither the folder nor the machine")
            elif not req.specifier.contains(have, prereleases=True):
                problems.append(f"{wheel.name} requires {text}, but {name} {have} is there")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl", help="the folder to fill (emptied first)")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python version (default 3.12)")
    args = parser.parse_args(argv)
    machine = machine_packages(args.python)
    with tempfile.TemporaryDirectory() as tmp:
        download(Path(tmp), args.python)
        shutil.rmtree(args.dest, ignore_errors=True)
        args.dest.mkdir(parents=True)
        for wheel in sorted(Path(tmp).glob("*.whl")):
            name = canonicalize_name(parse_wheel_filename(wheel.name)[0])
            if name not in machine and name not in LEFT_OUT:
                shutil.copy2(wheel, args.dest / wheel.name)
    wheels = sorted(args.dest.glob("*.whl"))
    problems = unmet(wheels, machine, args.python)
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB, in {args.dest}")
    for problem in problems:
        print("  unmet:", problem)
    if problems:
        return 1
    print("On the GPU machine, from the repository root (nbconvert's templates are data files: JUPYTER_PATH):\n"
          f"  {COMMAND}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
