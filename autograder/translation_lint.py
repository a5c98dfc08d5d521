"""What keeps a translation in step with the English: the checks ``tests/test_translations.py`` runs on every catalog
of a language (``translation.documents``), each a list of problems that names the catalog and the cell.

* ``stale``: a translation made from another English than the cell's current one (its ``en-sha256`` hash), and a
  catalog that ``python -m autograder.translation update`` has not brought in step (a cell missing, gone, or with
  an older English as its ``msgid``);
* ``coverage``: cells with no translation, and translated/total per catalog;
* ``code_changed``: a code cell's translation that differs from the English in more than comments and docstrings
  (``translation.code_skeleton``: magics, nbgrader's markers and pragmas included);
* ``structure_changed``: a markdown translation whose headings (levels, count, numbers), fenced code blocks, inline
  code spans, math, link targets, images or table rows differ from the English's;
* ``terms_missing``: a translated text whose English uses a glossary term (``i18n/LANG/glossary.toml``) without the
  term's form in the language (for ``keep = true`` terms: the English name), unless a translator's comment on the
  entry exempts the term and says why (``# glossary-exempt: gather: the verb, not the collective``).

    python -m autograder.translation_lint [--lang zh]   # print every problem, and the coverage
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import tokenize
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .course import Course
from .translation import (
    MARKERS,
    Document,
    _by_context,
    _stands_alone,
    code_skeleton,
    documents,
    english_hash,
    read_catalog,
    recorded_hash,
)


def _catalog(doc: Document):
    return read_catalog(doc.path) if doc.path.exists() else None


def _translations(docs: list[Document]):
    """(document, context, cell type, current English, its message) for every entry with a translation."""
    for doc in docs:
        catalog = _catalog(doc)
        for context, kind, english in doc.entries:
            message = _by_context(catalog, context) if catalog is not None else None
            if message is not None and message.string:
                yield doc, context, kind, english, message


def stale(docs: list[Document]) -> list[str]:
    problems = []
    for doc in docs:
        catalog = _catalog(doc)
        if catalog is None:
            problems.append(f"{doc.path.name}: no catalog (run python -m autograder.translation update)")
            continue
        contexts = {context for context, _, _ in doc.entries}
        for message in catalog:
            if message.id and message.context not in contexts:
                problems.append(f"{doc.name} cell {message.context}: the English has no such cell any more "
                                "(run python -m autograder.translation update)")
        for context, _, english in doc.entries:
            message = _by_context(catalog, context)
            if message is None:
                continue  # coverage's
            if message.id != english:
                problems.append(f"{doc.name} cell {context}: the catalog holds an older English "
                                "(run python -m autograder.translation update)")
            if message.string and recorded_hash(message) != english_hash(english):
                problems.append(f"{doc.name} cell {context}: the English changed since it was translated (hash "
                                f"{recorded_hash(message)}, English now {english_hash(english)}): translate it again "
                                "and set its en-sha256 to the new hash")
    return problems


def coverage(docs: list[Document]) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """{catalog: (translated, total)} and one line per catalog with cells left to translate."""
    counts, missing = {}, []
    for doc in docs:
        catalog = _catalog(doc)
        left = [c for c, _, _ in doc.entries
                if catalog is None or not getattr(_by_context(catalog, c), "string", "")]
        counts[doc.name] = (len(doc.entries) - len(left), len(doc.entries))
        if left:
            missing.append(f"{doc.name}: {', '.join(left)}")
    return counts, missing


def code_changed(docs: list[Document]) -> list[str]:
    problems = []
    for doc, context, kind, english, message in _translations(docs):
        if kind != "code":
            continue
        want, got = code_skeleton(english), code_skeleton(message.string)
        if want != got:
            at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            problems.append(f"{doc.name} cell {context}: the code differs from the English beyond comments and "
                            f"docstrings, at token {at}: English {want[at:at + 3]}, translation {got[at:at + 3]}")
    return problems


# ---------------------------------------------------------------------------------------------------------------
# markdown

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_HEADING = re.compile(r"^(#{1,6})\s+(\d+(?:\.\d+)*\.?)?")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_DISPLAY_MATH = re.compile(r"\$\$(.+?)\$\$", re.S)
_INLINE_MATH = re.compile(r"(?<![\\$])\$(?=\S)([^$\n]+?)(?<=\S)\$")
_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?[^)]*\)|<img\b[^>]*\bsrc=[\"']([^\"']+)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?[^)]*\)|<(https?://[^>\s]+)>|^\[[^\]]+\]:\s*(\S+)", re.M)
_URL = re.compile(r"https?://[^\s)>\]\"']+")


def _blocks(text: str) -> tuple[list[str], list[str]]:
    """(fenced code blocks, the other lines)."""
    fences, lines, fence, buf = [], [], None, []
    for line in text.split("\n"):
        match = _FENCE.match(line)
        if fence is not None:
            buf.append(line)
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fences.append("\n".join(buf))
                fence, buf = None, []
        elif match:
            fence, buf = match.group(1), [line]
        else:
            lines.append(line)
    if buf:
        fences.append("\n".join(buf))
    return fences, lines


def markdown_structure(text: str) -> dict[str, list]:
    """What a translation of a markdown text keeps as it is (see the module docstring)."""
    fences, lines = _blocks(text)
    headings = [(len(m.group(1)), m.group(2) or "") for m in map(_HEADING.match, lines) if m]
    tables = [line.strip().strip("|").count("|") + 1 for line in lines if line.lstrip().startswith("|")]
    body = "\n".join(lines)
    spans = [m.group(2).strip() for m in _CODE_SPAN.finditer(body)]
    body = _CODE_SPAN.sub(" ", body)
    math = [m.group(1).strip() for m in _DISPLAY_MATH.finditer(body)]
    body = _DISPLAY_MATH.sub(" ", body)
    math += [m.group(1).strip() for m in _INLINE_MATH.finditer(body)]
    body = _INLINE_MATH.sub(" ", body)
    images = [a or b for a, b in _IMAGE.findall(body)]
    links = [next(g for g in groups if g) for groups in _LINK.findall(body)]
    return {"headings": headings, "fenced code blocks": fences, "inline code": sorted(spans), "math": sorted(math),
            "link targets": sorted(links), "images": sorted(images), "table rows (cells)": tables}


def _difference(want: list, got: list) -> str:
    if Counter(map(repr, want)) == Counter(map(repr, got)):
        return f"English order {want}, translation order {got}"
    lost = list((Counter(map(repr, want)) - Counter(map(repr, got))).elements())
    added = list((Counter(map(repr, got)) - Counter(map(repr, want))).elements())
    return "; ".join(part for part in (f"missing {', '.join(lost)}" if lost else "",
                                       f"not in the English {', '.join(added)}" if added else "") if part)


def structure_changed(docs: list[Document]) -> list[str]:
    problems = []
    for doc, context, kind, english, message in _translations(docs):
        if kind != "markdown":
            continue
        want, got = markdown_structure(english), markdown_structure(message.string)
        for what in want:
            if want[what] != got[what]:
                problems.append(f"{doc.name} cell {context}: {what} differ from the English's: "
                                f"{_difference(want[what], got[what])[:400]}")
    return problems


# ---------------------------------------------------------------------------------------------------------------
# the glossary


@dataclass(frozen=True)
class Term:
    en: tuple[str, ...]
    zh: str
    keep: bool


def load_glossary(path: Path) -> list[Term]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    return [Term(tuple(t["en"]), t["zh"], bool(t.get("keep", False))) for t in data.get("term", [])]


def _form_pattern(form: str) -> str:
    """A form as a whole word; a name with capitals inside a word (ZeRO, MoE, NCCL, 1F1B) keeps its case, so that
    "zero" or "moe" in a sentence is not taken for it."""
    exact = any(c.isupper() for word in form.split() for c in word[1:])
    body = re.escape(form).replace(r"\ ", r"\s+")
    return f"(?<![\\w-])({body if exact else '(?i:' + body + ')'})(?![\\w-])"


def terms_used(text: str, glossary: list[Term]) -> list[Term]:
    """The terms ``text`` uses, each once, matched longest form first ("tensor parallelism" before "tensor")."""
    forms = sorted(((f, t) for t in glossary for f in t.en), key=lambda ft: -len(ft[0]))
    pattern = re.compile("|".join(_form_pattern(f) for f, _ in forms))
    used = []
    for match in pattern.finditer(text):
        term = forms[next(i for i, g in enumerate(match.groups()) if g is not None)][1]
        if term not in used:
            used.append(term)
    return used


def prose(kind: str, text: str) -> str:
    """What a reader reads as words: a markdown text without code, math and addresses; a code cell's comments and
    docstrings."""
    if kind == "markdown":
        _, lines = _blocks(text)
        body = _CODE_SPAN.sub(" ", "\n".join(lines))
        body = _INLINE_MATH.sub(" ", _DISPLAY_MATH.sub(" ", body))
        return _URL.sub(" ", re.sub(r"\]\([^)]*\)", "] ", body))
    code = "\n".join("pass" if ln.lstrip().startswith(("%", "!")) else ln for ln in text.splitlines())
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code + "\n").readline))
    except (tokenize.TokenError, SyntaxError):
        return ""
    words = [t.string.lstrip("#") for i, t in enumerate(tokens)
             if (t.type == tokenize.COMMENT and t.string.strip() not in MARKERS)
             or (t.type == tokenize.STRING and _stands_alone(tokens, i))]
    return _CODE_WORD.sub(" ", _CODE_SPAN.sub(" ", "\n".join(words)))


#: A word of code inside a comment or a docstring (``linear.weight.chunk(t, 1)``, ``chunks[rank]``, ``max_norm``):
#: a name, not a term.
_CODE_WORD = re.compile(r"\w+(?:[._]\w+|\([^()\n]*\)|\[[^\[\]\n]*\])+")


#: A translator's comment on an entry (``# glossary-exempt: gather: the verb, not the collective``) that lets its
#: translation do without a term the English uses in another sense (a verb, a paper's title kept in English).
_EXEMPT = re.compile(r"\s*glossary-exempt:\s*([^:]+?)\s*:\s*\S")


def terms_missing(docs: list[Document], glossary: list[Term]) -> list[str]:
    problems = []
    for doc, context, kind, english, message in _translations(docs):
        translated = prose(kind, message.string)
        exempt = {m.group(1).strip().lower() for c in message.user_comments for m in [_EXEMPT.match(c)] if m}
        for term in terms_used(prose(kind, english), glossary):
            if {f.lower() for f in term.en} & exempt:
                continue
            if term.keep:
                ok = any(re.search(_form_pattern(f), translated) for f in (term.zh, *term.en))
                want = f"the English name {term.zh!r}"
            else:
                ok = term.zh in translated
                want = f"{term.zh!r}"
            if not ok:
                problems.append(f"{doc.name} cell {context}: the English says {term.en[0]!r}; the translation should "
                                f"use {want} (i18n glossary)")
    return problems


def glossary_path(course: Course, lang: str) -> Path:
    return course.root / "i18n" / lang / "glossary.toml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograder.translation_lint", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lang", default="zh")
    parser.add_argument("--course", metavar="DIR", default=None)
    args = parser.parse_args(argv)
    course = Course.at(args.course)
    docs = documents(course, args.lang)
    problems = stale(docs) + code_changed(docs) + structure_changed(docs)
    problems += terms_missing(docs, load_glossary(glossary_path(course, args.lang)))
    for line in problems:
        print(line)
    counts, _ = coverage(docs)
    print("translated: " + ", ".join(f"{name} {done}/{total}" for name, (done, total) in counts.items()))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
