"""``python -m autograder student-edition DIR``: the tree an instructor hands out.

The course repository holds the answers (``solutions/``, the reference implementations and hidden checks in
``autograder/checks/``, tests that plant and fix bugs). The student edition is a separate, git-ready folder with
only what a student needs:

* ``notebooks/`` (the release: answer cells replaced by stubs, hidden tests cut out), ``labsupport/``, and
  ``demos/``, the notebooks for runtimes with GPUs;
* ``autograder/`` without ``checks/``: ``python -m autograder check NOTEBOOK`` runs the visible tests there, and its
  command line offers ``check`` only (the instructor's commands say that they need the course repository);
* ``course``, ``pyproject.toml``, ``environment.yml``, a ``.gitignore`` and a README written for students;
* ``nbgrader_config.py`` (the course's settings for the Validate button) and ``.jupyter/``, the Jupyter config
  folder ``./course lab`` adds to ``JUPYTER_CONFIG_PATH``: it turns off nbgrader's instructor tools (formgrader,
  "Create Assignment", the course and assignment lists, which need an exchange the course does not use) and keeps
  Validate. The instructor's lab, started from the repository, keeps them all. It also holds the course's lab
  defaults, the repository's ``jupyter-config/labconfig/default_setting_overrides.json`` (no pop-up asking about
  Jupyter's news feed), which ``./course lab`` gives the instructor's lab from ``jupyter-config/``.

The edition's ``./course`` has no ``test`` command (it finds no ``tests/``): a student checks a notebook with
``python -m autograder check``, and ``./course lab`` installs the lab's packages only, no test tools.

Nothing else is copied, so whatever is added to the repository later stays out unless it is listed here.

With ``url`` (``--url``, where the edition will be hosted), the README's Colab line, the demos' install lines and
``autograder/_hosted_at.py`` (the install line of ``check``'s errors) name it, and a GitHub address also gives each
demo its "Open in Colab" link; without it they keep a placeholder.
With ``branch`` (``--branch``) they name that branch (``git+URL@BRANCH``, and the links open its demos); without
it pip installs the repository's default branch and the links name ``main``. A GitHub address also gives each
notebook of the README's list its "Open in Colab" link.

With ``lang`` (``--lang zh``) the edition is the Chinese one: its ``notebooks/`` holds the Chinese release
(``notebooks-zh/``, whose set-up cells switch the course's messages to Chinese), its README is the translated
template (``edition_readme``, translated in ``i18n/zh/edition.po``), and its lab's defaults also select JupyterLab's
Chinese interface (the repository's ``jupyter-config/zh/``, which ``./course lab --lang zh`` uses there). The demos
stay in English.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from .course import Course, CourseError
from .edition_readme import DEMOS_INTRO, README
from .nbgrader_config import CODE_STUB

#: Files and folders of the course root copied as they are.
TOP_FILES = ["course", "pyproject.toml", "environment.yml", "nbgrader_config.py", "LICENSE"]
PACKAGES = ["labsupport", "autograder"]
#: Notebooks copied as they are, but for the address they install the course from (``_fill_url``).
DEMOS = "demos"
#: What the repository's demos install from until the course has an address, and the line that says so.
DEMO_URL_PLACEHOLDER = "https://github.com/OWNER/REPO"
DEMO_URL_NOTE = "# Replace OWNER/REPO by the address of the course's repository.\n"
#: What the edition's README says until it has an address.
URL_PLACEHOLDER = "<URL of this repository>"
#: The module of the edition's ``autograder`` that records its address (``--url``), for the install line that
#: ``python -m autograder check`` gives when the lab extras are missing.
HOSTED_AT = "_hosted_at.py"
#: Never copied (below a package): the hidden checks and their reference implementations.
EXCLUDED = {"autograder/checks"}
#: nbgrader's lab plugins and server extensions a student's lab leaves out (Validate stays).
INSTRUCTOR_LAB_PLUGINS = ["@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment",
                          "@jupyter/nbgrader:course-list", "@jupyter/nbgrader:assignment-list",
                          "@jupyter/nbgrader:menu"]
INSTRUCTOR_SERVER_EXTENSIONS = ["nbgrader.server_extensions.formgrader", "nbgrader.server_extensions.course_list",
                                "nbgrader.server_extensions.assignment_list"]
#: The Jupyter config folder of the edition (``./course lab`` puts it first on ``JUPYTER_CONFIG_PATH``).
JUPYTER_DIR = ".jupyter"
#: The repository's Jupyter config folder (``./course lab`` puts it on ``JUPYTER_CONFIG_PATH`` too) and its lab
#: defaults, which the edition's folder gets as well.
REPO_JUPYTER_DIR = "jupyter-config"
LAB_DEFAULTS = "labconfig/default_setting_overrides.json"
_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", ".DS_Store", "*.egg-info")

GITIGNORE = """.venv/
__pycache__/
*.pyc
.ipynb_checkpoints/
*.egg-info/
build/
"""

def _colab(url: str | None, branch: str | None, path: str) -> str:
    """": [Open in Colab](...)" for the notebook at ``path`` when the edition lives on GitHub, else nothing."""
    repo = _github(url)
    if not repo:
        return ""
    return f": [Open in Colab](https://colab.research.google.com/github/{repo}/blob/{branch or 'main'}/{path})"


def _table(ids: list[str], url: str | None = None, branch: str | None = None) -> str:
    return "\n".join(f"- [`{aid}`](notebooks/{aid}/{aid}.ipynb)" + _colab(url, branch, f"notebooks/{aid}/{aid}.ipynb")
                     for aid in ids)


def check_url(url: str) -> str:
    """``url`` without a trailing slash, or CourseError when pip could not install from it."""
    url = url.strip().rstrip("/")
    if not re.fullmatch(r"(https?|ssh|file)://[^\s\"'\\]+", url):
        raise CourseError(f"--url {url!r} is not an address pip can install from (git+URL): give the repository's "
                          "https:// address, e.g. https://github.com/you/course")
    return url


def _github(url: str | None) -> str | None:
    """``owner/repo`` when ``url`` is a GitHub repository's address."""
    match = re.fullmatch(r"https://github\.com/([\w.-]+/[\w.-]+?)(?:\.git)?", url or "")
    return match.group(1) if match else None


def check_branch(branch: str) -> str:
    """``branch``, or CourseError when it cannot be a git branch named in a pip address or a Colab link."""
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)*", branch) or ".." in branch or branch.endswith((".", ".lock")):
        raise CourseError(f"--branch {branch!r} is not a branch name that can go into an address: use letters, "
                          "digits, '.', '-', '_' and '/', e.g. --branch spring-2027")
    return branch


def _install_address(url: str, branch: str | None) -> str:
    """What ``pip install git+...`` is given: the repository, at ``branch`` when one is named."""
    return f"{url}@{branch}" if branch else url


def _demos_section(demos: list[str], url: str | None, branch: str | None = None, intro: str = DEMOS_INTRO) -> str:
    """The README's list of the demos, with "Open in Colab" links when the edition lives on GitHub."""
    if not demos:
        return ""
    lines = ["", intro, ""]
    lines += [f"- [`{name}`]({DEMOS}/{name}.ipynb)" + _colab(url, branch, f"{DEMOS}/{name}.ipynb") for name in demos]
    return "\n".join(lines) + "\n"


def readme_templates(course: Course, lang: str) -> tuple[str, str]:
    """The README and the demos' lead-in in ``lang``: the catalog's translations where they are current, else the
    English (``edition_readme``)."""
    if lang == "en":
        return README, DEMOS_INTRO
    from .translation import EDITION, _by_context, read_catalog, usable

    path = course.root / "i18n" / lang / f"{EDITION}.po"
    catalog = read_catalog(path) if path.is_file() else None
    out = []
    for context, english in (("README.md", README), ("README.md: demos", DEMOS_INTRO)):
        message = _by_context(catalog, context) if catalog is not None else None
        out.append(message.string if usable(message, "markdown", english) else english)
    return out[0], out[1]


def _fill_url(path: Path, url: str | None) -> None:
    """The demo ``path`` installs the course from ``url`` (or says to put the address in)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and DEMO_URL_PLACEHOLDER in cell.source:
            if url is not None:
                cell.source = cell.source.replace(DEMO_URL_NOTE, "").replace(DEMO_URL_PLACEHOLDER, url)
            else:
                cell.source = cell.source.replace(DEMO_URL_PLACEHOLDER, URL_PLACEHOLDER).replace(
                    DEMO_URL_NOTE, "# Replace <URL of this repository> by its address.\n")
    nbformat.write(nb, path)


def _write_jupyter_config(dest: Path, root: Path, lang: str = "en") -> None:
    folder = dest / JUPYTER_DIR
    (folder / "labconfig").mkdir(parents=True, exist_ok=True)
    defaults = root / REPO_JUPYTER_DIR / LAB_DEFAULTS
    if defaults.is_file():
        shutil.copyfile(defaults, folder / LAB_DEFAULTS)
    language = root / REPO_JUPYTER_DIR / lang / LAB_DEFAULTS   # a translation's: the lab's interface language
    if lang != "en" and language.is_file():
        merged = json.loads(defaults.read_text(encoding="utf-8")) if defaults.is_file() else {}
        for plugin, settings in json.loads(language.read_text(encoding="utf-8")).items():
            merged.setdefault(plugin, {}).update(settings)
        (folder / LAB_DEFAULTS).write_text(json.dumps(merged, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    page = {"disabledExtensions": {name: True for name in INSTRUCTOR_LAB_PLUGINS}}
    server = {"ServerApp": {"jpserver_extensions": {name: False for name in INSTRUCTOR_SERVER_EXTENSIONS}}}
    (folder / "labconfig" / "page_config.json").write_text(json.dumps(page, indent=2) + "\n", encoding="utf-8")
    (folder / "jupyter_server_config.json").write_text(json.dumps(server, indent=2) + "\n", encoding="utf-8")


def write_edition(course: Course, dest, force: bool = False, url: str | None = None,
                  branch: str | None = None, lang: str = "en") -> Path:
    """Write the student edition of ``course`` into ``dest``, to be hosted at ``url`` (on ``branch``) if given, in
    ``lang`` (its release notebooks in ``notebooks/``, its README and its lab's interface); returns its path."""
    if lang not in course.languages():
        raise CourseError(f"--lang {lang}: the course has no catalogs for it (i18n/{lang}/notebooks/); its languages "
                          f"are {', '.join(course.languages())}")
    url = check_url(url) if url is not None else None
    branch = check_branch(branch) if branch is not None else None
    if branch is not None and url is None:
        raise CourseError("--branch names a branch of the repository given by --url: give --url too")
    dest = Path(dest).resolve()
    if dest == course.root or course.root in dest.parents and dest.parent == course.root and dest.name in (
            "notebooks", "solutions", "autograder", "labsupport"):
        raise CourseError(f"{dest} is inside the course itself")
    if dest.exists():
        if not dest.is_dir():
            raise CourseError(f"{dest} exists and is not a directory")
        if any(dest.iterdir()):
            if not force:
                raise CourseError(f"{dest} is not empty (use --force to replace it)")
            shutil.rmtree(dest)
    released = course.release_dir(lang)
    ids = [aid for aid in course.assignments() if (released / aid / f"{aid}.ipynb").is_file()]
    if not ids:
        raise CourseError(f"no release notebooks in {released} (run `python -m autograder release`)")
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOP_FILES:
        src = course.root / name
        if src.is_file():
            shutil.copy2(src, dest / name)
    for aid in ids:
        shutil.copytree(released / aid, dest / "notebooks" / aid, ignore=_IGNORED)
    for package in PACKAGES:
        src = course.root / package
        if not src.is_dir():
            raise CourseError(f"{src} is missing")

        def ignore(folder, names, _src=src):
            skipped = set(_IGNORED(folder, names))
            rel = Path(folder).resolve().relative_to(course.root).as_posix()
            return skipped | {n for n in names if f"{rel}/{n}" in EXCLUDED}

        shutil.copytree(src, dest / package, ignore=ignore)
    demos = sorted(p.stem for p in (course.root / DEMOS).glob("*.ipynb"))
    for name in demos:
        (dest / DEMOS).mkdir(exist_ok=True)
        shutil.copyfile(course.root / DEMOS / f"{name}.ipynb", dest / DEMOS / f"{name}.ipynb")
        _fill_url(dest / DEMOS / f"{name}.ipynb", url and _install_address(url, branch))
    if url is not None:     # for the install line of `check`'s errors, where pip did not record the address
        (dest / "autograder" / HOSTED_AT).write_text(
            f'"""Where this student edition is hosted (written by python -m autograder student-edition --url)."""\n\n'
            f"URL = {_install_address(url, branch)!r}\n", encoding="utf-8")
    readme, intro = readme_templates(course, lang)
    readme = (readme.replace("{table}", _table(ids, url, branch)).replace("{stub}", CODE_STUB[lang].split("\n")[0])
              .replace("{demos}", _demos_section(demos, url, branch, intro)))
    if url is not None:
        readme = readme.replace(URL_PLACEHOLDER, _install_address(url, branch))
    (dest / "README.md").write_text(readme, encoding="utf-8")
    (dest / ".gitignore").write_text(GITIGNORE, encoding="utf-8")
    _write_jupyter_config(dest, course.root, lang)
    for path in dest.rglob("*"):
        if path.is_file():
            os.chmod(path, 0o755 if path.name == "course" else 0o644)
    return dest
