"""The set-up promises: one dependency list in two formats, and a README whose quick start CI really runs."""

import re

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


def test_environment_yml_lists_the_same_packages_as_pyproject():
    project = _pyproject()["project"]
    wanted = {str(Requirement(r)) for r in project["dependencies"] + project["optional-dependencies"]["test"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = {str(Requirement(r)) for r in pip_section if not r.startswith("-")}
    assert listed == wanted, f"only in environment.yml: {listed - wanted}; only in pyproject: {wanted - listed}"
    assert "-e ." in pip_section


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
