"""./course's torch step, offline and in seconds: a copy of the script sets up a fake project in a bare virtual
environment (this Python's own pip and setuptools linked in), with fake torch wheels in a local folder
(PIP_FIND_LINKS) and a local folder standing for PyTorch's CPU index (COURSE_TORCH_INDEX).

The promises: an installed torch is kept, never replaced (the package install pins it); where there is none,
a CPU build is installed, from the configured indexes when they offer one, else from PyTorch's CPU index, and
never a CUDA build; when that fails, set-up stops and says how to go on.
"""

import base64
import hashlib
import importlib.machinery
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(shutil.which("bash") is None or os.name == "nt", reason="./course is a bash script"),
    pytest.mark.timeout(120),
]

PYPROJECT = """\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "fake-course"
version = "0.1"
dependencies = [
    "torch>=2.4",{extra}
]

[project.optional-dependencies]
lab = [{lab}]
test = [{test}]

[tool.setuptools]
py-modules = []
"""

CUDA_DEPENDENCY = "nvidia-cudnn-cu12==9.1.0.70"  # what a CUDA build of torch on PyPI depends on


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _metadata(name, version, requires):
    return (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            + "".join(f"Requires-Dist: {r}\n" for r in requires))


def make_wheel(folder: Path, name: str, version: str, requires=()) -> Path:
    """A pure-Python wheel NAME-VERSION whose package NAME has __version__ = VERSION."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"__version__ = {version!r}\n",
             f"{info}/METADATA": _metadata(name, version, requires),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},{_record_hash(text.encode())},{len(text.encode())}\n" for path, text in files.items())
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name_in_zip, text in files.items():
            zf.writestr(name_in_zip, text)
        zf.writestr(f"{info}/RECORD", record + f"{info}/RECORD,,\n")
    return path


class Env:
    """A bare virtual environment, a fake project with a copy of ./course, and the folders pip may look in."""

    def __init__(self, tmp_path: Path, extra_deps=(), lab=(), test=()):
        self.root = tmp_path
        self.venv = tmp_path / "env"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(self.venv)], check=True)
        self.python = self.venv / "bin" / "python"
        self.env = {}
        self.site = Path(self.run("import sysconfig; print(sysconfig.get_paths()['purelib'])"))
        for module in ("pip", "setuptools", "_distutils_hack", "pkg_resources"):
            # found on sys.path, past setuptools' hook for "pip", which would drop an imported distutils (warning)
            spec = importlib.machinery.PathFinder.find_spec(module)
            if spec is None or not spec.submodule_search_locations:
                assert module not in ("pip", "setuptools"), f"the tests need {module}"
                continue
            package = Path(list(spec.submodule_search_locations)[0])
            (self.site / module).symlink_to(package)
            for info in package.parent.glob(f"{module}-*.dist-info"):
                (self.site / info.name).symlink_to(info)
        self.project = tmp_path / "project"
        self.project.mkdir()
        shutil.copy2(ROOT / "course", self.project / "course")
        extra = "".join(f'\n    "{d}",' for d in extra_deps)
        (self.project / "pyproject.toml").write_text(PYPROJECT.format(
            extra=extra, lab=", ".join(f'"{d}"' for d in lab), test=", ".join(f'"{d}"' for d in test)))
        self.wheels = tmp_path / "wheels"  # what the configured indexes offer (PIP_FIND_LINKS, no index)
        self.wheels.mkdir()
        self.cpu_index = tmp_path / "cpu-index" / "simple"  # stands for PyTorch's CPU index
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("PIP_", "COURSE_", "PYTHON", "VIRTUAL_ENV", "CONDA"))}
        self.env.update({
            "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(self.wheels),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_CACHE_DIR": str(tmp_path / "pip-cache"),
            "PIP_NO_BUILD_ISOLATION": "0",  # sic: pip reads this as build_isolation=0, i.e. off
            "COURSE_VENV": "none", "PYTHON": str(self.python),
            "COURSE_TORCH_INDEX": self.cpu_index.as_uri(), "TMPDIR": str(tmp_path),
        })

    def offer(self, name, version, requires=()):
        return make_wheel(self.wheels, name, version, requires)

    def publish_on_cpu_index(self, version, requires=()):
        """A PEP 503 index in a folder: simple/torch/index.html linking the wheel; pip reads file:// indexes."""
        wheel = make_wheel(self.cpu_index / "torch", "torch", version, requires)
        (self.cpu_index / "torch" / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>\n')
        self.use_indexes()

    def use_indexes(self):
        """Let pip use indexes (no PIP_NO_INDEX), the configured one an empty local folder: nothing remote."""
        empty = self.root / "empty-index"
        empty.mkdir(exist_ok=True)
        self.env.pop("PIP_NO_INDEX", None)
        self.env["PIP_INDEX_URL"] = empty.as_uri()

    def install_torch(self, version):
        """Put a torch in the environment as pip would (with its dist-info), without pip."""
        info = self.site / f"torch-{version}.dist-info"
        info.mkdir()
        (self.site / "torch").mkdir()
        files = {"torch/__init__.py": f"__version__ = {version!r}\n",
                 f"{info.name}/METADATA": _metadata("torch", version, ()), f"{info.name}/INSTALLER": "pip\n"}
        for path, text in files.items():
            (self.site / path).write_text(text)
        record = "".join(f"{p},{_record_hash(t.encode())},{len(t.encode())}\n" for p, t in files.items())
        (info / "RECORD").write_text(record + f"{info.name}/RECORD,,\n")

    def course(self, command, **env):
        return subprocess.run(["bash", str(self.project / "course"), command], env={**self.env, **env},
                              capture_output=True, text=True, timeout=110, check=False)

    def run(self, code):
        """Run Python code in the environment; its output, stripped."""
        return subprocess.run([str(self.python), "-c", code], capture_output=True, text=True, check=True,
                              env=self.env or None).stdout.strip()

    def torch_version(self):
        """(the version pip sees installed, torch.__version__), or None when there is no torch."""
        out = self.run("import importlib.metadata as md\ntry:\n    import torch\nexcept ImportError:\n    pass\n"
                       "else:\n    print(md.version('torch'), torch.__version__)")
        return tuple(out.split()) or None

    def installed(self, name):
        """The version of the distribution NAME installed in the environment, or ''."""
        return self.run(f"import importlib.metadata as md\ntry:\n    print(md.version({name!r}))\n"
                        "except md.PackageNotFoundError:\n    pass")


def _ok(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _failed(proc):
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


# ---------------------------------------------------------------------------------------------------------------
# ./course plan: the decision, without installing


def test_help_lists_every_command():
    proc = _ok(subprocess.run(["bash", str(ROOT / "course"), "help"], capture_output=True, text=True, timeout=30))
    for command in ("lab", "test", "setup", "plan"):
        assert re.search(rf"^\s*\./course {command}\b", proc.stdout, re.M), proc.stdout
    assert "COURSE_TORCH_SPEC" in proc.stdout
    assert "./course test also installs the test extras" in proc.stdout, proc.stdout   # the edition leaves it out


@pytest.fixture(scope="module")
def edition(tmp_path_factory):
    from autograder.course import Course
    from autograder.edition import write_edition

    return write_edition(Course.at(ROOT), tmp_path_factory.mktemp("edition") / "course")


def test_a_student_edition_has_no_test_command(edition):
    """The edition has no tests/: its ./course neither offers `test` nor installs the test tools (Playwright...) to
    run nothing, and its help does not speak of them; asked for `test`, it says how to check a notebook instead,
    before setting anything up."""
    assert not (edition / "tests").exists()
    proc = _ok(subprocess.run(["bash", str(edition / "course"), "help"], capture_output=True, text=True, timeout=30))
    for command in ("lab", "setup", "plan"):
        assert re.search(rf"^\s*\./course {command}\b", proc.stdout, re.M), proc.stdout
    assert "./course test" not in proc.stdout, proc.stdout
    for word in ("test extras", "test suite", "pytest", "Playwright"):   # nothing about tools it has no use for
        assert word not in proc.stdout, (word, proc.stdout)
    proc = _failed(subprocess.run(["bash", str(edition / "course"), "test"], capture_output=True, text=True,
                                  timeout=30))
    assert "no test suite" in proc.stderr and ".venv/bin/python -m autograder check notebooks/ID/ID.ipynb" in \
        proc.stderr, proc.stderr
    assert not (edition / ".venv").exists()
    proc = _failed(subprocess.run(["bash", str(edition / "course"), "tset"], capture_output=True, text=True,
                                  timeout=30))
    assert "(use: lab, setup, plan, help)" in proc.stderr, proc.stderr


def test_setup_installs_the_lab_extras_and_the_test_tools_only_for_a_test_suite(tmp_path):
    """./course lab needs the lab extras (JupyterLab, nbgrader), ./course test the test extras too; the stamp in
    the virtual environment records both, so set-up runs again only for what is missing."""
    env = Env(tmp_path, lab=["fake-lab"], test=["fake-test"])
    env.install_torch("2.13.0+cpu")
    env.offer("fake_lab", "1.0")
    env.offer("fake_test", "1.0")
    for module in ("labsupport", "autograder"):  # what set-up imports to see that the course is installed
        (env.project / f"{module}.py").write_text("")
    venv = {"COURSE_VENV": str(env.venv)}       # an existing environment: set-up keeps a stamp in it
    proc = _ok(env.course("setup", **venv))      # a student edition: no tests/
    assert "with its lab extras" in proc.stderr, proc.stderr
    assert (env.installed("fake-lab"), env.installed("fake-test")) == ("1.0", "")
    stamp = (env.venv / ".course-installed").read_text().split()
    assert stamp[1:] == ["lab"]
    proc = _ok(env.course("setup", **venv))
    assert "installing" not in proc.stderr, proc.stderr  # nothing missing
    (env.project / "tests").mkdir()              # the repository: setup is for the lab and the tests
    proc = _ok(env.course("setup", **venv))
    assert "with its lab,test extras" in proc.stderr, proc.stderr
    assert (env.installed("fake-lab"), env.installed("fake-test")) == ("1.0", "1.0")
    assert (env.venv / ".course-installed").read_text().split() == [stamp[0], "lab,test"]
    proc = _ok(env.course("plan", **venv))
    assert "with its lab,test extras" in proc.stdout, proc.stdout


def test_plan_keeps_an_installed_torch(tmp_path):
    env = Env(tmp_path)
    env.install_torch("2.13.0+cpu")
    env.offer("torch", "2.14.0+cpu")
    proc = _ok(env.course("plan"))
    assert "torch: keep the installed torch 2.13.0+cpu" in proc.stdout, proc.stdout
    assert env.torch_version() == ("2.13.0+cpu", "2.13.0+cpu")


@pytest.mark.parametrize("offered, expected", [
    (("2.13.0+cpu", ()), "would install torch==2.13.0+cpu (CPU build) from the configured package indexes: file:"),
    # no local label and no CUDA dependencies: a CPU-only wheel, as PyPI's for macOS
    (("2.13.0", ()), "would install torch==2.13.0 (CPU build) from the configured package indexes: file:"),
    (("2.13.0", (CUDA_DEPENDENCY,)), "would install torch==2.13.0 from PyTorch's CPU index"),
    (None, "would install torch==2.13.0 from PyTorch's CPU index"),
], ids=["local-cpu-wheel", "cpu-only-wheel", "cuda-wheel", "no-wheel"])
def test_plan_without_torch(tmp_path, offered, expected):
    env = Env(tmp_path)
    if offered:
        env.offer("torch", *offered)
    proc = _ok(env.course("plan"))
    assert expected in proc.stdout, proc.stdout
    if "CPU index" in expected:
        assert env.env["COURSE_TORCH_INDEX"] in proc.stdout
        assert ("a GPU build" if offered else "offer no torch==2.13.0") in proc.stdout, proc.stdout
    assert env.torch_version() is None


def test_plan_takes_course_torch_spec(tmp_path):
    env = Env(tmp_path)
    proc = _ok(env.course("plan", COURSE_TORCH_SPEC="/somewhere/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"))
    assert "would install torch with: pip install /somewhere/torch-2.13.0+cpu" in proc.stdout, proc.stdout


# ---------------------------------------------------------------------------------------------------------------
# ./course setup with COURSE_VENV=none


def test_setup_keeps_the_installed_torch(tmp_path):
    env = Env(tmp_path)
    env.install_torch("2.13.0+cpu")
    env.offer("torch", "2.14.0+cpu")
    proc = _ok(env.course("setup"))
    assert "keeping the installed torch 2.13.0+cpu" in proc.stderr, proc.stderr
    assert env.torch_version() == ("2.13.0+cpu", "2.13.0+cpu")
    assert env.installed("fake-course") == "0.1"


def test_setup_never_replaces_torch_for_a_dependency(tmp_path):
    """A dependency that wants a newer torch: pip would upgrade it; with the pin it fails, and set-up says why."""
    env = Env(tmp_path, extra_deps=["wants-new-torch"])
    env.install_torch("2.13.0+cpu")
    env.offer("torch", "2.14.0+cpu")
    env.offer("wants_new_torch", "1.0", requires=["torch>=2.14"])
    unpinned = subprocess.run([str(env.python), "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-",
                               "-e", str(env.project)], env=env.env, capture_output=True, text=True, check=True)
    assert '"version": "2.14.0+cpu"' in unpinned.stdout, "without the pin pip would replace torch"
    proc = _failed(env.course("setup"))
    assert "keeping the installed torch 2.13.0+cpu" in proc.stderr
    assert "never replaces an installed torch" in proc.stderr and "torch>=2.4" in proc.stderr, proc.stderr
    assert env.torch_version() == ("2.13.0+cpu", "2.13.0+cpu")


def test_setup_stops_on_a_torch_older_than_the_course_needs(tmp_path):
    env = Env(tmp_path)
    env.install_torch("2.1.0")
    env.offer("torch", "2.13.0+cpu")
    proc = _failed(env.course("setup"))
    assert "the course needs torch>=2.4" in proc.stderr and "torch 2.1.0" in proc.stderr, proc.stderr
    assert env.torch_version() == ("2.1.0", "2.1.0")


def test_setup_installs_a_local_cpu_wheel(tmp_path):
    env = Env(tmp_path)
    env.offer("torch", "2.13.0+cpu")
    proc = _ok(env.course("setup"))
    assert "installing torch 2.13.0+cpu (CPU build) from file:" in proc.stderr, proc.stderr
    assert env.torch_version() == ("2.13.0+cpu", "2.13.0+cpu")
    assert env.installed("fake-course") == "0.1"


def test_setup_takes_torch_from_the_cpu_index_not_a_cuda_build(tmp_path):
    """The configured indexes offer a CUDA torch (as PyPI does): torch comes from the CPU index, its
    dependencies from the configured indexes."""
    env = Env(tmp_path)
    env.offer("torch", "2.13.0", requires=[CUDA_DEPENDENCY])
    env.offer("torchdep", "1.0")
    env.publish_on_cpu_index("2.13.0+cpu", requires=["torchdep"])
    proc = _ok(env.course("setup"))
    assert "from PyTorch's CPU index" in proc.stderr, proc.stderr
    assert env.torch_version() == ("2.13.0+cpu", "2.13.0+cpu")
    assert env.installed("torchdep") == "1.0"
    assert env.installed("nvidia-cudnn-cu12") == ""


def test_setup_stops_when_the_cpu_index_fails(tmp_path):
    """No CPU build anywhere (the CPU index unreachable, a CUDA torch offered): stop, say how to go on."""
    env = Env(tmp_path)
    env.offer("torch", "2.13.0", requires=[CUDA_DEPENDENCY])
    env.use_indexes()
    proc = _failed(env.course("setup", COURSE_TORCH_INDEX="http://127.0.0.1:9/simple", PIP_RETRIES="1",
                              PIP_TIMEOUT="5"))
    err = proc.stderr
    assert "pip failed: pip install --no-deps --index-url http://127.0.0.1:9/simple torch==2.13.0" in err, err
    assert "Connection refused" in err and "ERROR: No matching distribution found for torch==2.13.0" in err, \
        "pip's own error is shown"
    assert "could not install torch 2.13.0 (CPU build) from http://127.0.0.1:9/simple" in err, err
    assert "does not fall back to PyPI's torch" in err and "COURSE_TORCH_SPEC=" in err, err
    kept = re.search(r"all of its output is in (\S+)\)", err).group(1)
    assert Path(kept).is_file() and Path(kept).is_relative_to(tmp_path)
    assert env.torch_version() is None


def test_the_torch_floor_is_where_the_script_reads_it():
    """./course reads the course's lowest torch from a line `"torch>=X",` of pyproject.toml."""
    assert re.search(r'^\s*"torch>=[0-9][0-9.]*"', (ROOT / "pyproject.toml").read_text(), re.M)


# ---------------------------------------------------------------------------------------------------------------
# the lab's settings: no pop-up asking about Jupyter's news feed


NOTIFICATION = "@jupyterlab/apputils-extension:notification"


def _lab_defaults(tmp_path: Path, config_path) -> dict:
    """The defaults of JupyterLab's notification settings as a lab started with ``JUPYTER_CONFIG_PATH=config_path``
    (None: unset) serves them through its settings API, with no user settings: what the page acts on. The news
    pop-up shows when ``fetchNews`` is "none"."""
    import json
    import urllib.request

    from labsupport._ports import free_port

    port = free_port()
    home = tmp_path / f"lab-{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
    env.update(JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"))
    if config_path is not None:
        env["JUPYTER_CONFIG_PATH"] = str(config_path)
    home.mkdir()
    log = home / "lab.log"
    with open(log, "w") as out:
        lab = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
                                "--ServerApp.port_retries=0", "--IdentityProvider.token=course",
                                f"--ServerApp.root_dir={home}", "--allow-root"],
                               env=env, stdout=out, stderr=subprocess.STDOUT, cwd=home)
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/lab/api/settings/{NOTIFICATION}",
                                         headers={"Authorization": "token course"})
        deadline = time.monotonic() + 300   # a loaded machine starts a lab slowly; a broken one exits
        while True:
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    answer = json.load(response)
                break
            except OSError:
                assert lab.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the lab did not answer: " + log.read_text()[-3000:]
                time.sleep(0.5)
    finally:
        lab.terminate()
        try:
            lab.wait(30)
        except subprocess.TimeoutExpired:
            lab.kill()
            lab.wait()
    assert not answer["settings"], answer["settings"]  # no user settings: the defaults are what counts
    return {name: spec.get("default") for name, spec in answer["schema"]["properties"].items()}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_lab_never_asks_about_jupyters_news(tmp_path, edition):
    """JupyterLab's first start asks "Would you like to get notified about official Jupyter news?" while the
    setting fetchNews is "none". The repository's jupyter-config/ and the edition's .jupyter/, which ./course lab
    puts on JUPYTER_CONFIG_PATH, make it "false" in the running lab's settings (and leave the rest as it was)."""
    from autograder.edition import JUPYTER_DIR, LAB_DEFAULTS, REPO_JUPYTER_DIR

    script = (ROOT / "course").read_text()
    assert 'JUPYTER_CONFIG_PATH="$here/jupyter-config' in script and 'JUPYTER_CONFIG_PATH="$here/.jupyter' in script
    assert (edition / JUPYTER_DIR / LAB_DEFAULTS).read_text() == (ROOT / REPO_JUPYTER_DIR / LAB_DEFAULTS).read_text()
    from concurrent.futures import ThreadPoolExecutor

    folders = (None, ROOT / REPO_JUPYTER_DIR, edition / JUPYTER_DIR)
    with ThreadPoolExecutor(len(folders)) as pool:   # three labs at once: each waits mostly for its own start
        plain, *courses = pool.map(lambda folder: _lab_defaults(tmp_path, folder), folders)
    assert plain["fetchNews"] == "none", plain  # what a lab without the course's settings would ask
    for folder, course in zip(folders[1:], courses):
        assert course == dict(plain, fetchNews="false", checkForUpdates=False), (folder, course)
