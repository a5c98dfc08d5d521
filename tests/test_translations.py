"""Every translated text is current and keeps what a translation must keep (``autograder/translation_lint.py``): the
Chinese catalogs ``i18n/zh/notebooks/ID.po`` (one per notebook) and ``i18n/zh/edition.po`` (the student edition's
README).

The first tests read the course's own catalogs; the ones after them show, on a tiny course in a temporary folder,
that each check fails on the fault it is there for and names the cell. The coverage test fails, listing the cells
left, until every readable cell has its translation.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import translations as tr  # noqa: E402

from autograder import translation_lint as lint  # noqa: E402
from autograder.course import Course  # noqa: E402
from autograder.translation import catalog_path, documents, english_hash, read_catalog, update  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
COURSE = Course.at(REPO)
GLOSSARY = lint.load_glossary(lint.glossary_path(COURSE, "zh"))


@pytest.fixture(scope="module")
def docs():
    return documents(COURSE, "zh")


def _report(problems: list[str]) -> str:
    return f"{len(problems)} problems:\n" + "\n".join(problems)


def test_every_notebook_and_the_edition_has_a_catalog(docs):
    assert [d.name for d in docs] == COURSE.assignments() + ["edition"]
    assert all(d.path.is_file() for d in docs), [str(d.path) for d in docs if not d.path.is_file()]


def test_no_translation_is_stale(docs):
    """Each translation was made from the English its cell has now, and each catalog is in step with the English
    (``python -m autograder.translation update``)."""
    problems = lint.stale(docs)
    assert not problems, _report(problems)


def test_every_readable_cell_is_translated(docs):
    """Every cell a reader reads has a translation; the message gives translated/total per catalog and the cells
    left."""
    counts, missing = lint.coverage(docs)
    done = ", ".join(f"{name} {d}/{t}" for name, (d, t) in counts.items())
    assert not missing, f"translated: {done}\nleft to translate:\n" + "\n".join(missing)


def test_code_translations_change_only_comments_and_docstrings(docs):
    problems = lint.code_changed(docs)
    assert not problems, _report(problems)


def test_markdown_translations_keep_their_structure(docs):
    problems = lint.structure_changed(docs)
    assert not problems, _report(problems)


def test_translations_use_the_glossary(docs):
    problems = lint.terms_missing(docs, GLOSSARY)
    assert not problems, _report(problems)


# ---------------------------------------------------------------------------------------------------------------
# each check fails on its fault


def _tiny(tmp_path):
    course = tr.tiny_course(tmp_path)
    return course, documents(course, "zh", [tr.TINY])


def _all_placeholders(course):
    tr.fill_with_placeholders(course, tr.TINY)
    return documents(course, "zh", [tr.TINY])


def test_a_faithful_translation_passes_every_check(tmp_path):
    course, docs = _tiny(tmp_path)
    docs = _all_placeholders(course)
    assert lint.stale(docs) == [] and lint.code_changed(docs) == [] and lint.structure_changed(docs) == []
    assert lint.coverage(docs) == ({tr.TINY: (4, 4)}, [])


def test_stale_names_the_cell_whose_english_changed(tmp_path):
    """The English of a translated cell changes: stale says the catalog is behind; after ``update`` (which takes the
    new English but keeps the old hash) it says the translation was made from another English, until it is
    translated again with the new hash."""
    course, docs = _tiny(tmp_path)
    docs = _all_placeholders(course)
    path = course.source_notebook(tr.TINY)
    path.write_text(path.read_text().replace("A tiny notebook", "A small notebook"))
    docs = documents(course, "zh", [tr.TINY])
    assert [p for p in lint.stale(docs) if "tiny-intro" in p and "older English" in p], lint.stale(docs)
    assert [p for p in lint.stale(docs) if "changed since it was translated" in p]
    update(course, "zh", [tr.TINY])
    problems = lint.stale(docs)
    assert len(problems) == 1 and "99_tiny cell tiny-intro: the English changed" in problems[0], problems
    catalog = read_catalog(catalog_path(course.root, "zh", tr.TINY))
    message = next(m for m in catalog if m.context == "tiny-intro")
    message.auto_comments = ["markdown cell", "en-sha256: " + english_hash(message.id)]
    message.string = tr.placeholder("markdown", message.id)
    from autograder.translation import write_catalog

    write_catalog(catalog, catalog_path(course.root, "zh", tr.TINY))
    assert lint.stale(docs) == []


def test_stale_names_a_cell_gone_from_the_english(tmp_path):
    course, docs = _tiny(tmp_path)
    path = course.source_notebook(tr.TINY)
    path.write_text(path.read_text().replace('"id": "tiny-test"', '"id": "tiny-test-2"'))
    problems = lint.stale(documents(course, "zh", [tr.TINY]))
    assert any("cell tiny-test: the English has no such cell" in p for p in problems), problems


def test_coverage_lists_the_cells_left_and_counts_per_notebook(tmp_path):
    course, docs = _tiny(tmp_path)
    tr.translate(course, {"tiny-intro": tr.placeholder("markdown", tr.INTRO)})
    counts, missing = lint.coverage(docs)
    assert counts == {tr.TINY: (1, 4)}
    assert missing == [f"{tr.TINY}: tiny-setup, tiny-add, tiny-test"]


@pytest.mark.parametrize("old, new, changed", [
    ("return a + b", "return b + a", True),                 # the code
    ("### BEGIN SOLUTION", "### 开始", True),                 # an nbgrader marker
    ("# 中文注释", "# 另一种说法", False),                      # only a comment
])
def test_code_changed_names_a_translation_that_changes_the_code(tmp_path, old, new, changed):
    course, docs = _tiny(tmp_path)
    good = tr.placeholder("code", tr.ANSWER)
    assert old in good
    tr.translate(course, {"tiny-add": good.replace(old, new)})
    problems = lint.code_changed(docs)
    if not changed:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith("99_tiny cell tiny-add: the code differs"), problems


@pytest.mark.parametrize("old, new", [
    ('"""add adds."""\nassert add(1, 2) == 3', '"""add adds."""\nassert add(1, 2) == "3"'),   # a literal
    ("%%visible_test add", "%%visible_test ad"),                                               # a magic
    ("  # three", "  # noqa: E501"),                                                           # a pragma added
])
def test_code_changed_sees_literals_magics_and_pragmas(tmp_path, old, new):
    course, docs = _tiny(tmp_path)
    tr.translate(course, {"tiny-test": tr.TEST.replace(old, new)})
    assert [p for p in lint.code_changed(docs) if "tiny-test" in p]


@pytest.mark.parametrize("old, new, what", [
    ("# 99 · A tiny notebook", "## 99 · 一个小笔记本", "headings"),
    ("## 1. The exercise", "## 2. 练习", "headings"),
    ("`dist.send`", "`dist.recv`", "inline code"),
    ("`dist.send`", "dist.send", "inline code"),
    ("$x^2 + 1$", "$x^2+2$", "math"),
    ("(https://pytorch.org/docs)", "(https://pytorch.org/zh)", "link targets"),
    ("![the ring](ring.png)", "![环](ring2.png)", "images"),
    ("| 0 | `x` |", "| 0 | `x` | 1 |", "table rows"),
    ("## 1. The exercise\n", "## 1. The exercise\n\n```python\nx = 1\n```\n", "fenced code blocks"),
])
def test_structure_changed_names_each_kind_of_change(tmp_path, old, new, what):
    course, docs = _tiny(tmp_path)
    assert old in tr.INTRO
    tr.translate(course, {"tiny-intro": "（中文）\n\n" + tr.INTRO.replace(old, new)})
    problems = lint.structure_changed(docs)
    assert problems and all(p.startswith("99_tiny cell tiny-intro: ") for p in problems), problems
    assert any(f": {what}" in p for p in problems), problems


def test_structure_accepts_reordered_inline_code_and_translated_words(tmp_path):
    course, docs = _tiny(tmp_path)
    text = tr.INTRO.replace("We split the model with **tensor parallelism** and send with `dist.send`",
                            "用 `dist.send` 发送，并用**张量并行**切分模型")
    tr.translate(course, {"tiny-intro": text})
    assert lint.structure_changed(docs) == []


def test_the_glossary_wants_its_form_longest_term_first(tmp_path):
    """The English says "tensor parallelism": the translation must say 张量并行 (the longer term wins over any
    shorter one); a keep-term (rank) must stay in English; a translator's note can exempt a term, saying why."""
    course, docs = _tiny(tmp_path)
    text = "（中文）\n\n" + tr.INTRO
    tr.translate(course, {"tiny-intro": text.replace("tensor parallelism", "张量的并行")})
    problems = lint.terms_missing(docs, GLOSSARY)
    assert any("tiny-intro: the English says 'tensor parallelism'" in p and "张量并行" in p for p in problems), problems
    assert not any("'rank'" in p for p in problems), problems   # the table's header kept "rank", as it should
    tr.translate(course, {"tiny-intro": text.replace("tensor parallelism", "张量并行")})
    problems = lint.terms_missing(docs, GLOSSARY)
    assert not any("tensor parallelism" in p for p in problems), problems
    assert not any("'rank'" in p for p in problems), problems
    tr.translate(course, {"tiny-intro": text.replace("tensor parallelism", "张量切分").replace("rank", "进程号")},
                 notes={"tiny-intro": ["glossary-exempt: tensor parallelism: a test of the exemption"]})
    problems = lint.terms_missing(docs, GLOSSARY)
    assert not any("tensor parallelism" in p for p in problems) and any("'rank'" in p for p in problems), problems


def test_the_glossary_reads_comments_and_keeps_the_case_of_names(tmp_path):
    """In a code cell only comments and docstrings count; "zero" in a sentence is not ZeRO, "ZeRO" is."""
    course, docs = _tiny(tmp_path)
    answer = tr.ANSWER.replace("# the sum", "# the sum is zero for ZeRO ranks")
    path = course.source_notebook(tr.TINY)
    path.write_text(path.read_text().replace("# the sum", "# the sum is zero for ZeRO ranks"))
    update(course, "zh", [tr.TINY])
    docs = documents(course, "zh", [tr.TINY])
    tr.translate(course, {"tiny-add": answer.replace("# the sum is zero for ZeRO ranks", "# 和为零（各 rank）")})
    problems = lint.terms_missing(docs, GLOSSARY)
    assert len(problems) == 1 and "'ZeRO'" in problems[0], problems
    used = lint.terms_used("the score is zero and zero-bubble, not ZeRO", GLOSSARY)
    assert [t.zh for t in used] == ["ZeRO"]


def test_the_editions_readme_is_checked_like_a_notebook(monkeypatch):
    """The student edition's README template has its own entry and hash: changing the English makes its
    translation stale."""
    from autograder import edition_readme

    docs = documents(COURSE, "zh")
    catalog = read_catalog(docs[-1].path)
    assert {m.context for m in catalog if m.id} == {"README.md", "README.md: demos"}
    monkeypatch.setattr(edition_readme, "README", edition_readme.README.replace("## Work", "## Working"))
    problems = lint.stale(documents(COURSE, "zh"))
    assert any(p.startswith("edition cell README.md: ") for p in problems), problems
