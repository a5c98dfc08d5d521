"""The Chinese edition (中文版): its notebooks are generated from ``solutions/`` and the catalogs ``i18n/zh/`` as the
English release is from ``solutions/``, with the same code, cells and ``grade_id``s (one grader grades both, and a
Chinese submission is no edit of the English release), its set-up cells switch the course's messages to Chinese,
and a student gets it with ``./course lab --lang zh`` or a Chinese student edition, with JupyterLab in Chinese.

That ``notebooks-zh/`` is what generation gives, and that a Chinese solution and release score as the English ones
through ``grade``, are tested with the English (``test_course_notebooks.py``); that they run top to bottom in a
student's kernel, with the light install (``test_light_install.py``); that JupyterLab shows them in Chinese and
Validate's checklist works, in the browser (``test_browser.py``).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import demo_submissions as demo  # noqa: E402
import translations as tr  # noqa: E402

from autograder.course import Course, release  # noqa: E402
from autograder.nbgrader_config import CODE_STUB  # noqa: E402
from autograder.translation import (  # noqa: E402
    LANGUAGE_LINE,
    catalog_path,
    code_skeleton,
    read_catalog,
    translated_source,
    translated_versions,
    write_catalog,
)

REPO = Path(__file__).resolve().parents[1]
COURSE = Course.at(REPO)
ZH_LINE = LANGUAGE_LINE.format(lang="zh")


def _source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


@pytest.mark.parametrize("aid", COURSE.assignments())
def test_the_chinese_release_has_the_english_releases_cells_and_code(aid):
    """Cell for cell: the same ids, types and nbgrader metadata (but for checksums); code cells whose code differs
    at most in comments and docstrings, but for the set-up cell's one line that switches the messages to Chinese;
    answer cells with the Chinese stub."""
    en = json.loads((COURSE.release_dir("en") / aid / f"{aid}.ipynb").read_text(encoding="utf-8"))
    zh = json.loads((COURSE.release_dir("zh") / aid / f"{aid}.ipynb").read_text(encoding="utf-8"))
    assert [c["id"] for c in zh["cells"]] == [c["id"] for c in en["cells"]]
    for a, b in zip(en["cells"], zh["cells"]):
        for cell in (a, b):   # nbgrader's checksum of a read-only cell is its own release's (Validate checks it)
            cell["metadata"].get("nbgrader", {}).pop("checksum", None)
        assert (a["cell_type"], a["metadata"]) == (b["cell_type"], b["metadata"]), a["id"]
        if a["cell_type"] != "code":
            continue
        grade_id = a["metadata"].get("nbgrader", {}).get("grade_id")
        english, chinese = _source(a), _source(b)
        if grade_id == "setup":
            assert ZH_LINE not in english and chinese.count(ZH_LINE) == 1, chinese
            chinese = chinese.replace(ZH_LINE + "\n", "")
        if a["metadata"].get("nbgrader", {}).get("solution"):
            stub_en, stub_zh = CODE_STUB["en"].split("\n")[0], CODE_STUB["zh"].split("\n")[0]
            assert stub_en in english and stub_zh in chinese, a["id"]
            chinese = chinese.replace(stub_zh, stub_en)   # the stub's comment is a marker
        assert code_skeleton(chinese) == code_skeleton(english), a["id"]


def test_generation_takes_only_current_translations_that_keep_the_code(tmp_path):
    """A translation stands in for its cell when it is current and keeps the code; a stale one, or one that changes
    the code, leaves the English cell; the set-up cell gets the line that switches the language after
    ``import labsupport``."""
    course = tr.tiny_course(tmp_path)
    intro = tr.placeholder("markdown", tr.INTRO)
    setup = tr.placeholder("code", tr.SETUP)
    tr.translate(course, {"tiny-intro": intro, "tiny-setup": setup,
                          "tiny-add": tr.placeholder("code", tr.ANSWER).replace("a + b", "b + a"),
                          "tiny-test": tr.placeholder("code", tr.TEST)})
    path = catalog_path(course.root, "zh", tr.TINY)
    catalog = read_catalog(path)
    stale = next(m for m in catalog if m.context == "tiny-test")
    stale.auto_comments = ["code cell", "en-sha256: 0000000000000000"]
    write_catalog(catalog, path)
    cells = {c["id"]: c["source"] for c in translated_source(course, tr.TINY, "zh")["cells"]}
    assert cells["tiny-intro"] == intro
    assert cells["tiny-add"] == tr.ANSWER and cells["tiny-test"] == tr.TEST
    assert cells["tiny-setup"] == setup.replace("import labsupport\n", f"import labsupport\n{ZH_LINE}\n")


@pytest.mark.slow   # nbgrader, or JupyterLab's server
def test_the_chinese_release_of_a_translated_notebook(tmp_path):
    """``release --lang zh`` writes ``notebooks-zh/``: the translated cells, the Chinese stub, no solution or hidden
    test; the English release beside it is untouched by the catalogs."""
    course = tr.tiny_course(tmp_path)
    tr.fill_with_placeholders(course, tr.TINY)
    (zh,) = release(course, [tr.TINY], lang="zh")
    (en,) = release(course, [tr.TINY])
    assert zh == course.root / "notebooks-zh" / tr.TINY / f"{tr.TINY}.ipynb"
    text = zh.read_text(encoding="utf-8")
    nb = nbformat.read(zh, as_version=4)
    assert "BEGIN SOLUTION" not in text and "return a + b" not in text
    assert CODE_STUB["zh"].split("\n")[0] in nb.cells[2].source and "中文说明" in nb.cells[2].source
    assert nb.cells[0].source.startswith("（中文）") and "# 中文注释" in nb.cells[3].source
    assert ZH_LINE in nb.cells[1].source
    english = en.read_text(encoding="utf-8")
    assert "中文" not in english and CODE_STUB["en"].split("\n")[0] in english and ZH_LINE not in english


def test_a_notebooks_language_is_its_set_up_cells(monkeypatch):
    """What ``check`` and the grader tell a notebook's language from; ``speaking`` sets it for a while."""
    from autograder.execute import LANGUAGE_ENV, notebook_language, speaking

    aid = "00_launch"
    assert notebook_language(nbformat.read(COURSE.release_dir("zh") / aid / f"{aid}.ipynb", as_version=4)) == "zh"
    assert notebook_language(nbformat.read(COURSE.release_dir("en") / aid / f"{aid}.ipynb", as_version=4)) == "en"
    monkeypatch.delenv(LANGUAGE_ENV, raising=False)
    with speaking("zh"):
        assert os.environ[LANGUAGE_ENV] == "zh"
    assert LANGUAGE_ENV not in os.environ


def test_release_and_edition_refuse_a_language_without_catalogs(tmp_path):
    proc = demo.cli("release", "--lang", "fr", "--course", REPO)
    assert proc.returncode == 2 and "--lang fr: the course has no catalogs for it" in proc.stderr, proc.stderr
    proc = demo.cli("student-edition", tmp_path / "ed", "--lang", "fr", "--course", REPO)
    assert proc.returncode == 2 and "--lang fr" in proc.stderr and not (tmp_path / "ed").exists(), proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# grading: a Chinese submission is no edit of the English release


@pytest.mark.slow   # nbgrader, or JupyterLab's server
def test_a_chinese_submissions_read_only_cells_are_not_edits(tmp_path):
    """With every cell of notebook 01 translated (placeholders), its Chinese source and release keep every read-only
    cell as the grader accepts it and give the language; a changed line of code in a Chinese visible test is still an
    edit; the English release is English."""
    from autograder.tamper import repair

    aid = "01_collectives"
    course = tr.copy_of(REPO, tmp_path, [aid])
    tr.fill_with_placeholders(course, aid)
    release(course, [aid], lang="zh")
    source = nbformat.read(course.source_notebook(aid), as_version=4)
    english = nbformat.read(course.release_dir("en") / aid / f"{aid}.ipynb", as_version=4)
    versions = translated_versions(course, aid)
    chinese_source, chinese = versions["zh"]
    assert any("中文注释" in c.source for c in chinese.cells if c.metadata.get("nbgrader", {}).get("locked"))
    for nb in (chinese_source, chinese):
        fixed, report = repair(nb, english, source, versions)
        assert report.tampered_cells == [] and report.notes() == [] and report.language == "zh"
        assert [c.source for c in fixed.cells if c.metadata.get("nbgrader", {}).get("locked")] == \
            [c.source for c in english.cells if c.metadata.get("nbgrader", {}).get("locked")]
    _, report = repair(english, english, source, versions)
    assert report.language == "en" and report.tampered_cells == []
    edited = nbformat.from_dict(json.loads(json.dumps(chinese)))
    cell = next(c for c in edited.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "test_broadcast_visible")
    assert "中文" in cell.source and "def try_broadcast" in cell.source
    cell.source = cell.source.replace("def try_broadcast", "def try_it", 1)
    _, report = repair(edited, english, source, versions)
    assert report.tampered_cells == ["test_broadcast_visible"], report


# ---------------------------------------------------------------------------------------------------------------
# what a student gets


def test_the_chinese_student_edition(tmp_path):
    """``student-edition --lang zh``: the Chinese release in ``notebooks/``, the Chinese README (its stub, its
    notebooks with Open-in-Colab links), and a lab whose defaults select the Chinese interface."""
    from autograder.edition import JUPYTER_DIR, LAB_DEFAULTS, write_edition

    url = "https://github.com/you/course"
    dest = write_edition(COURSE, tmp_path / "zh", url=url, lang="zh")
    for aid in COURSE.assignments():
        assert (dest / "notebooks" / aid / f"{aid}.ipynb").read_bytes() == \
            (COURSE.release_dir("zh") / aid / f"{aid}.ipynb").read_bytes()
    readme = (dest / "README.md").read_text(encoding="utf-8")
    assert readme.startswith("# 分布式训练") and f"`{CODE_STUB['zh'].splitlines()[0]}`" in readme
    assert "{table}" not in readme and "{demos}" not in readme and "{stub}" not in readme
    assert f'%pip install -q "git+{url}"' in readme
    assert "https://colab.research.google.com/github/you/course/blob/main/notebooks/00_launch/00_launch.ipynb" in readme
    settings = json.loads((dest / JUPYTER_DIR / LAB_DEFAULTS).read_text(encoding="utf-8"))
    assert settings["@jupyterlab/translation-extension:plugin"] == {"locale": "zh_CN"}
    assert settings["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"
    english = write_edition(COURSE, tmp_path / "en")
    assert f"`{CODE_STUB['en'].splitlines()[0]}`" in (english / "README.md").read_text()
    assert "translation-extension" not in (english / JUPYTER_DIR / LAB_DEFAULTS).read_text()


def test_a_stale_readme_translation_gives_the_english_readme(tmp_path, monkeypatch):
    from autograder import edition

    monkeypatch.setattr(edition, "README", edition.README.replace("## Work", "## Working"))
    readme = (edition.write_edition(COURSE, tmp_path / "zh", lang="zh") / "README.md").read_text(encoding="utf-8")
    assert "## Working" in readme and "分布式训练" not in readme.split("\n")[0]


#: The virtual environment's python in ``_lab``: set-up's check that the course imports passes at once (the real
#: import of torch takes seconds), JupyterLab prints what it was given, anything else is this Python.
FAKE_PYTHON = """#!/bin/bash
if [ "$1" = -m ] && [ "$2" = jupyterlab ]; then
  shift 2; echo "JUPYTER_CONFIG_PATH=$JUPYTER_CONFIG_PATH"; for a in "$@"; do echo "ARG $a"; done; exit 0
fi
[ "$1" = -c ] && [ "$2" = "import torch, labsupport, autograder" ] && exit 0
exec {python} "$@"
"""


def _lab(tmp_path: Path, *args: str, folders=("notebooks",), lab_settings=None):
    """``./course lab ARGS`` in a course folder holding ``folders`` (and, with ``lab_settings``, an edition's
    ``.jupyter/``), whose virtual environment's python prints what JupyterLab would be given."""
    project = tmp_path / "course"
    project.mkdir(parents=True)
    for name in ("course", "pyproject.toml"):
        shutil.copy2(REPO / name, project / name)
    for name in folders:
        (project / name / "00_launch").mkdir(parents=True)
    if "jupyter-config" in folders:
        shutil.copytree(REPO / "jupyter-config", project / "jupyter-config", dirs_exist_ok=True)
    if lab_settings is not None:
        (project / ".jupyter" / "labconfig").mkdir(parents=True)
        (project / ".jupyter" / "labconfig" / "default_setting_overrides.json").write_text(json.dumps(lab_settings))
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON.format(python=sys.executable))
    (venv / "bin" / "python").chmod(0o755)
    import hashlib

    stamp = hashlib.sha256((project / "pyproject.toml").read_bytes()).hexdigest()
    (venv / ".course-installed").write_text(f"{stamp} lab\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "COURSE_"))}
    env["COURSE_VENV"] = str(venv)
    return subprocess.run(["bash", str(project / "course"), "lab", *args], cwd=project, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("bash") is None or os.name == "nt", reason="./course is a bash script")
def test_course_lab_lang_zh_opens_the_chinese_notebooks_in_a_chinese_lab(tmp_path):
    proc = _lab(tmp_path / "repo", "--lang", "zh", "--port=9999", folders=("notebooks", "notebooks-zh",
                                                                           "jupyter-config"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "ARG --LabApp.default_url=/lab/tree/notebooks-zh/00_launch/00_launch.ipynb" in lines, lines
    assert "ARG --port=9999" in lines and not any("--lang" in line for line in lines), lines
    config = next(line for line in lines if line.startswith("JUPYTER_CONFIG_PATH=")).split("=", 1)[1].split(":")
    assert config[:2] == [str(tmp_path / "repo" / "course" / "jupyter-config" / "zh"),
                          str(tmp_path / "repo" / "course" / "jupyter-config")], config

    proc = _lab(tmp_path / "plain", folders=("notebooks", "notebooks-zh", "jupyter-config"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ARG --LabApp.default_url=/lab/tree/notebooks/00_launch/00_launch.ipynb" in proc.stdout
    assert "jupyter-config/zh" not in proc.stdout

    edition = {"@jupyterlab/translation-extension:plugin": {"locale": "zh_CN"}}
    proc = _lab(tmp_path / "zh-edition", "--lang=zh", lab_settings=edition)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ARG --LabApp.default_url=/lab/tree/notebooks/00_launch/00_launch.ipynb" in proc.stdout

    proc = _lab(tmp_path / "en-edition", "--lang", "zh", lab_settings={})
    assert proc.returncode == 1 and "no Chinese notebooks" in proc.stderr, proc.stdout + proc.stderr
    proc = _lab(tmp_path / "unknown", "--lang", "fr")
    assert proc.returncode == 1 and "unknown language 'fr'" in proc.stderr, proc.stderr
    help_text = subprocess.run(["bash", str(REPO / "course"), "help"], capture_output=True, text=True).stdout
    assert "./course lab --lang zh" in help_text


@pytest.mark.slow   # nbgrader, or JupyterLab's server
def test_the_chinese_labs_settings_select_the_installed_language_pack(tmp_path):
    """JupyterLab started as ``./course lab --lang zh`` starts it (``jupyter-config/zh`` before ``jupyter-config``)
    defaults to the zh_CN interface, keeps the course's other defaults, and has that language pack."""
    code = ("import json\n"
            "from jupyterlab_server.settings_utils import _get_overrides\n"
            "from jupyterlab_server.translation_utils import get_language_packs\n"
            f"overrides, _ = _get_overrides({str(tmp_path)!r})\n"
            "print(json.dumps({'overrides': overrides, 'packs': sorted(get_language_packs('en')[0])}))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
    env["JUPYTER_CONFIG_PATH"] = f"{REPO / 'jupyter-config' / 'zh'}:{REPO / 'jupyter-config'}"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["overrides"]["@jupyterlab/translation-extension:plugin"] == {"locale": "zh_CN"}, found
    assert found["overrides"]["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false", found
    assert "zh_CN" in found["packs"], found
