"""The course's messages in Chinese (``labsupport/locale/zh_CN``, kept by ``python -m autograder.messages``).

The catalog is in step with the code (extracting now gives exactly its msgids); every message is translated from
the English the code says now (its ``en-sha256`` hash), with the same placeholders and the glossary's terms; the
``.mo`` the package ships is what its ``.po`` compiles to, and Python's own ``gettext`` reads it. Each of these checks
also runs on a broken copy in ``tmp_path``, where it must fail naming the message. The code marks its messages so
that they are extracted (no f-string as a msgid) and looked up when shown (no ``_`` rebound where ``_()`` is called).

What a student meets with ``use_language("zh")`` is in ``test_messages_in_chinese.py``.
"""

import ast
import gettext
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autograder import messages as cat

ROOT = Path(__file__).resolve().parent.parent
PO = cat.catalog_path(ROOT, "zh")


@pytest.fixture(scope="module")
def found():
    return cat.extract(ROOT)


@pytest.fixture(scope="module")
def glossary():
    return cat.load_glossary(ROOT / "i18n" / "zh" / "glossary.toml")


def _copy(tmp_path, change=None):
    """The catalog, read back from a copy in ``tmp_path`` after ``change(catalog)``."""
    catalog = cat.read_catalog(PO)
    if change is not None:
        change(catalog)
    path = tmp_path / "labsupport.po"
    cat.write_catalog(catalog, path)
    return cat.read_catalog(path)


def _set(msgid, string=None, new_id=None):
    """A change of the entry ``msgid``: its translation, or its English (the hash stays that of the old one)."""
    def change(catalog):
        m = catalog[msgid]
        assert m is not None, msgid
        if string is not None:
            m.string = string
        if new_id is not None:
            catalog.delete(msgid)
            catalog.add(new_id, m.string, auto_comments=m.auto_comments, user_comments=m.user_comments)
    return change


# ---------------------------------------------------------------------------------------------------------------
# the catalog


def test_the_catalog_holds_exactly_the_messages_of_the_code(found):
    assert len(found) > 100
    assert cat.out_of_step(cat.read_catalog(PO), found) == []


def test_a_message_added_or_changed_in_code_without_its_entry_is_named(tmp_path, found):
    (tmp_path / "i18n").mkdir()
    shutil.copy(ROOT / cat.MAPPING, tmp_path / cat.MAPPING)
    (tmp_path / "labsupport").mkdir()
    (tmp_path / "labsupport" / "new.py").write_text(
        'from .i18n import _\n\n\ndef f(rank):\n    return _("rank {rank} is new here").format(rank=rank)\n')
    added = cat.extract(tmp_path)
    assert list(added) == ["rank {rank} is new here"]
    problems = cat.out_of_step(cat.read_catalog(PO), {**found, **added})
    assert problems == ["in the code (labsupport/new.py) but not in the catalog: 'rank {rank} is new here'"]
    changed = {("passes!" if m == "passes" else m): files for m, files in found.items()}
    problems = cat.out_of_step(cat.read_catalog(PO), changed)
    assert len(problems) == 2 and "'passes!'" in problems[0] and problems[1].endswith("not in the code: 'passes'")
    problems = cat.out_of_step(_copy(tmp_path, lambda c: c.delete("passes")), found)
    assert problems == ["in the code (labsupport/visible.py) but not in the catalog: 'passes'"]


def test_every_message_is_translated_from_the_english_the_code_says_now(tmp_path):
    catalog = cat.read_catalog(PO)
    assert all(m.string for m in cat.messages(catalog))
    assert cat.not_current(catalog) == []
    broken = _copy(tmp_path, lambda c: (_set("passes", string="")(c), _set("failed", new_id="failed!")(c)))
    problems = cat.not_current(broken)
    assert len(problems) == 2, problems
    assert problems[0] == "not translated: 'passes'" and problems[1].startswith("stale") and "'failed!'" in problems[1]


def test_placeholders_are_the_same_in_the_english_and_the_chinese(tmp_path):
    assert cat.placeholder_mismatches(cat.read_catalog(PO)) == []
    broken = _copy(tmp_path, lambda c: (_set("blocked in {call}", string="阻塞在 {calls}")(c),
                                        _set("{cell} did not run", string="没有运行")(c),
                                        _set("Feedback: {assignment}", string="反馈：{assignment")(c)))
    problems = cat.placeholder_mismatches(broken)
    assert len(problems) == 3, problems
    assert any("['{calls}'] instead of ['{call}']" in p and "'blocked in {call}'" in p for p in problems), problems
    assert any("'Feedback: {assignment}'" in p and "not a valid template" in p for p in problems), problems
    assert any("[] instead of ['{cell}']" in p and "'{cell} did not run'" in p for p in problems), problems


def test_translations_use_the_glossary_s_terms(tmp_path, glossary):
    assert cat.glossary_misses(cat.read_catalog(PO), glossary) == []
    report = next(m.id for m in cat.messages(cat.read_catalog(PO)) if "probably a deadlock" in m.id)
    broken = _copy(tmp_path, lambda c: (_set(report, string=c[report].string.replace("死锁", "锁死"))(c),
                                        _set("interrupted: the rank was stopped", string="已中断：该进程已停止")(c)))
    problems = cat.glossary_misses(broken, glossary)
    assert len(problems) == 2, problems
    assert problems[0].startswith("'deadlock' should be '死锁'") and "probably a deadlock" in problems[0]
    assert problems[1].startswith("'rank' should be 'rank'") and "'interrupted: the rank was stopped'" in problems[1]


def test_the_glossary_rule(tmp_path, glossary):
    """Whole words in any case, the longest term first; placeholders, `code` and the entry's ``code:`` note are not
    English."""
    from babel.messages.catalog import Catalog

    catalog = Catalog(locale="zh_CN")
    catalog.add("Data parallel training on each {worker}", "数据并行的训练")          # 'node' not there: fine
    catalog.add("during the `ring` step", "在这一步期间")                            # no whole word, code
    catalog.add("the process groups", "这些组")                                      # 进程组 missing
    catalog.add("%%visible_test broadcast", "%%visible_test broadcast", user_comments=["code: broadcast"])
    catalog.add("a broadcast", "一次 broadcast")                                     # 广播 missing
    problems = cat.glossary_misses(catalog, glossary)
    assert [p.split(":")[0] for p in problems] == ["'process groups' should be '进程组'", "'broadcast' should be '广播'"]


def test_update_keeps_translations_and_a_changed_message_stays_stale_until_revised(tmp_path):
    """``python -m autograder.messages update`` then ``revised``, on a tree of one module."""
    (tmp_path / "i18n").mkdir()
    shutil.copy(ROOT / cat.MAPPING, tmp_path / cat.MAPPING)
    module = tmp_path / "labsupport" / "m.py"
    module.parent.mkdir()

    def code(first):
        module.write_text(f'from .i18n import _\n\n\ndef f():\n    return _("{first}"), _("the other one")\n')

    def mo():
        with cat.catalog_path(tmp_path, "zh").with_suffix(".mo").open("rb") as f:
            return gettext.GNUTranslations(f)

    code("the first message")
    path = cat.update(tmp_path, "zh")
    assert cat.not_current(cat.read_catalog(path)) == ["not translated: 'the first message'",
                                                       "not translated: 'the other one'"]
    catalog = cat.read_catalog(path)
    catalog["the first message"].string, catalog["the other one"].string = "第一条消息", "另一条"
    cat.write_catalog(catalog, path)
    cat.update(tmp_path, "zh")
    assert cat.not_current(cat.read_catalog(path)) == [] and mo().gettext("the first message") == "第一条消息"
    code("the first message, changed")
    cat.update(tmp_path, "zh")
    catalog = cat.read_catalog(path)
    assert catalog["the first message, changed"].string == "第一条消息" and catalog["the first message"] is None
    assert [p.split(":")[0] for p in cat.not_current(catalog)] == ["stale (its English changed since it was "
                                                                  "translated; revise it, then run `python -m "
                                                                  "autograder.messages revised`)"]
    assert mo().gettext("the first message, changed") == "the first message, changed"   # English until revised
    assert cat.revised(tmp_path, "zh") == ["the first message, changed"]
    assert cat.not_current(cat.read_catalog(path)) == [] and mo().gettext("the first message, changed") == "第一条消息"


# ---------------------------------------------------------------------------------------------------------------
# the compiled catalog the package ships


def test_each_committed_mo_is_what_compiling_its_po_gives(tmp_path):
    pos = sorted((ROOT / "labsupport" / "locale").glob("*/LC_MESSAGES/*.po"))
    assert PO in pos and sorted(p.with_suffix(".po") for p in PO.parent.parent.parent.glob("*/*/*.mo")) == pos
    for po in pos:
        assert cat.compile_catalog(cat.read_catalog(po)) == po.with_suffix(".mo").read_bytes(), po
    broken = _copy(tmp_path, _set("passes", string="通过了"))
    assert cat.compile_catalog(broken) != PO.with_suffix(".mo").read_bytes()


def test_python_s_gettext_reads_the_mo_and_a_stale_translation_shows_the_english(tmp_path):
    catalog = cat.read_catalog(PO)
    with PO.with_suffix(".mo").open("rb") as f:
        mo = gettext.GNUTranslations(f)
    assert all(mo.gettext(m.id) == m.string for m in cat.messages(catalog))
    stale = _copy(tmp_path, _set("failed", new_id="failed!"))
    (tmp_path / "stale.mo").write_bytes(cat.compile_catalog(stale))
    with (tmp_path / "stale.mo").open("rb") as f:
        mo = gettext.GNUTranslations(f)
    assert mo.gettext("failed!") == "failed!" and mo.gettext("passes") == "通过"


def test_the_runtime_needs_no_babel():
    """The light install has no Babel: ``_()`` reads the shipped ``.mo`` with Python's ``gettext`` alone."""
    code = ("import importlib.abc, sys\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'babel':\n"
            "            raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "from labsupport.i18n import _, use_language\n"
            "print(_('passes'))\nuse_language('zh')\nprint(_('passes'))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["passes", "通过"]


# ---------------------------------------------------------------------------------------------------------------
# how the code marks its messages


def _sources():
    return sorted(p for top in ("labsupport", "autograder") for p in (ROOT / top).rglob("*.py"))


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _below(node, skip):
    """The nodes under ``node``, without going into those of the types ``skip``."""
    todo = list(ast.iter_child_nodes(node))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, skip):
            todo += list(ast.iter_child_nodes(n))


def _calls(node, name="_") -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


def _binds_underscore(node) -> bool:
    if isinstance(node, ast.Name) and node.id == "_" and isinstance(node.ctx, ast.Store):
        return True
    if isinstance(node, ast.arg) and node.arg == "_":
        return True
    if isinstance(node, ast.ExceptHandler) and node.name == "_":
        return True
    return isinstance(node, ast.alias) and node.asname == "_"


def _marking_problems(source: str) -> tuple[set, list]:
    """(the texts marked with a literal, what is wrong): a text built where it is marked (an f-string, a sum: Babel
    cannot extract it; a variable holds a text marked where it was written, ``N_()``), and in a module that imports
    ``_`` from ``labsupport.i18n``: a call of ``_()`` at import time (looked up once, in the language of that moment),
    ``_`` rebound in a scope that calls ``_()`` (a loop's or an argument's ``_`` would be called instead)."""
    tree = ast.parse(source)
    marked, problems = set(), []
    for node in ast.walk(tree):
        if _calls(node) or _calls(node, "N_"):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                marked.add(arg.value)
            elif arg is None or not isinstance(arg, (ast.Name, ast.Attribute, ast.Subscript)):  # a text built here
                problems.append((node.lineno, f"{node.func.id}() of {ast.unparse(arg) if arg else 'nothing'}"))
    if not any(isinstance(n, ast.ImportFrom) and (n.module or "").endswith("i18n") and
               any(a.name == "_" for a in n.names) for n in ast.walk(tree)):
        return marked, [p for _line, p in sorted(problems)]
    for node in _below(tree, _FUNCTIONS):               # what runs when the module is imported
        if _calls(node):
            problems.append((node.lineno, "_() at import time"))
    for node in _below(tree, _FUNCTIONS + _COMPREHENSIONS + (ast.ClassDef,)):
        if _binds_underscore(node):
            problems.append((node.lineno, "the module rebinds _"))
    for scope in ast.walk(tree):
        if isinstance(scope, _FUNCTIONS + _COMPREHENSIONS):
            own = list(_below(scope, _FUNCTIONS + _COMPREHENSIONS + (ast.ClassDef,)))
            if isinstance(scope, _COMPREHENSIONS):
                own = [n for g in scope.generators for n in ast.walk(g.target)] + [n for n in own if _calls(n)]
            if any(_calls(n) for n in own) and any(_binds_underscore(n) for n in own):
                problems.append((scope.lineno, f"{getattr(scope, 'name', type(scope).__name__)} calls _() and "
                                               "rebinds _"))
    return marked, [p for _line, p in sorted(problems)]


def test_every_marked_text_is_extracted_and_looked_up_when_shown(found):
    marked, problems = set(), []
    for path in _sources():
        texts, wrong = _marking_problems(path.read_text(encoding="utf-8"))
        marked |= texts
        problems += [f"{path.relative_to(ROOT)}, {p}" for p in wrong]
    assert problems == []
    assert marked == set(found)


def test_the_marking_rules_catch_what_they_are_for():
    source = ('from .i18n import _\n'
              'TITLE = _("at import")\n'
              'def f(rows, **_):\n    return _("rows")\n'
              'def g(x):\n    return f"{_(\'inside\')}" + _(f"{x} made")\n'
              'def h(pairs):\n    for a, _ in pairs:\n        pass\n    return [_ for _ in pairs], _("fine")\n'
              'def k(pairs):\n    return [_("ok") for a, b in pairs], [_(a) for a, _ in pairs], _("a" + b)\n'
              'for _ in range(3):\n    pass\n')
    marked, problems = _marking_problems(source)
    assert marked == {"at import", "rows", "inside", "fine", "ok"}
    assert problems == ["_() at import time", "f calls _() and rebinds _", "_() of f'{x} made'",
                        "h calls _() and rebinds _", "ListComp calls _() and rebinds _", "_() of 'a' + b",
                        "the module rebinds _"], problems

