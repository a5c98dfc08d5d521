"""The notebooks' translations: one gettext catalog per notebook and language, ``i18n/LANG/notebooks/NAME.po``.

Each entry is one cell of the instructor's source notebook (``solutions/NAME/NAME.ipynb``) that a reader reads: every
markdown cell, and every code cell with a comment or a docstring. ``msgctxt`` is the cell's id, ``msgid`` the cell's
English source as it is now, ``msgstr`` its translation (for a code cell: the same code, only its comments and
docstrings translated). The extracted comment ``en-sha256: HASH`` is the hash of the English text the translation was
made from: ``update`` refreshes ``msgid`` when the English changes but never the hash, so a translation whose hash is
not its ``msgid``'s is stale, and the test of translations names its cell.

    python -m autograder.translation update [--lang zh]   # add new cells, refresh the English, keep translations

A translated notebook (``translated_source``) is the English source with each cell whose translation is *usable*
replaced by it: not empty, made from the English as it is now (its hash), and, for a code cell, the same code
(``code_skeleton``: only comments and docstrings may differ). Any other cell stays English, so a release in another
language always has the English release's code, names and ``grade_id``s, and one grader grades both.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import tokenize
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from babel.messages.catalog import Catalog, Message
from babel.messages.pofile import read_po, write_po

from .course import Course

#: The line a translated notebook's set-up cell runs right after ``import labsupport``.
LANGUAGE_LINE = 'labsupport.use_language("{lang}")'
#: Comments that are part of the code: nbgrader's markers and the stub's line, which a translation keeps as they are.
MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION", "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS",
           "# YOUR CODE HERE")
_PRAGMA = re.compile(r"#\s*(noqa\b(?::\s*[A-Z]+\d+(?:\s*,\s*[A-Z]+\d+)*)?|type:\s*ignore\b|pragma:\s*no cover"
                     r"|fmt:\s*(?:on|off|skip))")

LANGUAGES = {"zh": "zh_CN"}
HASH_PREFIX = "en-sha256: "


def english_hash(text: str) -> str:
    """The short hash that ties a translation to the English text it was made from."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _has_prose(source: str) -> bool:
    """Whether a code cell holds a comment or a docstring (magics and shell lines are left out of the reading)."""
    code = "\n".join("pass" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code + "\n").readline))
    except (tokenize.TokenError, SyntaxError):
        return True
    for token in tokens:
        if token.type == tokenize.COMMENT and not token.string.lstrip("# ").startswith(("BEGIN ", "END ")):
            return True
        if token.type == tokenize.STRING and token.string.lstrip("rbuRBU").startswith(('"""', "'''")):
            return True
    return False


def readable_cells(notebook: Path) -> list[tuple[str, str, str]]:
    """(cell id, cell type, English source) of each cell a reader reads, in the notebook's order."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    cells = []
    for cell in nb["cells"]:
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if not source.strip():
            continue
        if cell["cell_type"] == "markdown" or (cell["cell_type"] == "code" and _has_prose(source)):
            cells.append((cell["id"], cell["cell_type"], source))
    return cells


def code_skeleton(source: str) -> list[tuple[str, str]]:
    """A code cell as the interpreter sees it: its tokens without comments, docstrings (a string standing alone as a
    statement) and line breaks; magic and shell lines, nbgrader's markers and pragma comments (``# noqa``, ...) as
    they are. Two cells with the same skeleton differ at most in comments, docstrings and blank lines."""
    lines, kept = [], []
    for line in source.splitlines():
        if line.lstrip().startswith(("%", "!")):
            kept.append(("MAGIC", line.strip()))
            line = line[:len(line) - len(line.lstrip())] + "pass"
        lines.append(line)
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline))
    except (tokenize.TokenError, SyntaxError, IndentationError) as exc:
        return [("UNREADABLE", str(exc)), *kept]
    out = list(kept)
    skip = {tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER}
    for i, token in enumerate(tokens):
        if token.type == tokenize.COMMENT:
            text = token.string.strip()
            if text in MARKERS:
                out.append(("MARKER", text))
            out.extend(("PRAGMA", p) for p in _PRAGMA.findall(text))
            continue
        if token.type in skip or (token.type == tokenize.STRING and _stands_alone(tokens, i)):
            continue
        out.append((tokenize.tok_name[token.type], token.string))
    return out


def _stands_alone(tokens, i) -> bool:
    """Whether the string token ``tokens[i]`` is a statement of its own (a docstring): only layout before it on its
    line and a line end after it (implicitly joined strings included)."""
    layout = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT}
    j = i - 1
    while j >= 0 and tokens[j].type == tokenize.STRING:
        j -= 1
    if j >= 0 and tokens[j].type not in layout:
        return False
    k = i + 1
    while k < len(tokens) and tokens[k].type in (tokenize.STRING, tokenize.NL, tokenize.COMMENT):
        k += 1
    return k >= len(tokens) or tokens[k].type in (tokenize.NEWLINE, tokenize.ENDMARKER)


def usable(message: Message | None, cell_type: str, source: str) -> bool:
    """Whether ``message`` translates ``source`` as it is now and may stand in for it (see the module docstring)."""
    if message is None or not message.string or message.id != source:
        return False
    if recorded_hash(message) != english_hash(source):
        return False
    return cell_type != "code" or code_skeleton(message.string) == code_skeleton(source)


def translated_source(course: Course, assignment: str, lang: str) -> dict:
    """The source notebook of ``assignment`` in ``lang`` (nbformat JSON): the English one with each usable translation
    in place of its cell, and the set-up cell (``grade_id`` setup) switching the course's messages to ``lang``."""
    nb = json.loads(course.source_notebook(assignment).read_text(encoding="utf-8"))
    path = catalog_path(course.root, lang, assignment)
    catalog = read_catalog(path) if path.exists() else None
    for cell in nb["cells"]:
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        message = _by_context(catalog, cell.get("id", "")) if catalog is not None else None
        if usable(message, cell["cell_type"], source):
            source = message.string
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "setup":
            source = _with_language(source, lang, assignment)
        cell["source"] = source
    return nb


def translated_versions(course: Course, assignment: str) -> dict[str, list]:
    """{language: [the translated source notebook, the committed translated release]} of ``assignment``
    (``NotebookNode``s), for each language the course has catalogs for: the cells a grader accepts as unedited."""
    import nbformat

    versions = {}
    for lang in course.languages()[1:]:
        found = [nbformat.from_dict(translated_source(course, assignment, lang))]
        released = course.release_dir(lang) / assignment / f"{assignment}.ipynb"
        if released.is_file():
            found.append(nbformat.read(released, as_version=4))
        versions[lang] = found
    return versions


def _with_language(source: str, lang: str, assignment: str) -> str:
    lines = source.split("\n")
    if "import labsupport" not in lines:
        raise ValueError(f"{assignment}: the set-up cell has no line `import labsupport` to switch the language after")
    at = lines.index("import labsupport") + 1
    return "\n".join(lines[:at] + [LANGUAGE_LINE.format(lang=lang)] + lines[at:])


def catalog_path(root: Path, lang: str, assignment: str) -> Path:
    return root / "i18n" / lang / "notebooks" / f"{assignment}.po"


def read_catalog(path: Path) -> Catalog:
    with path.open("rb") as f:
        return read_po(f)


def write_catalog(catalog: Catalog, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    # the messages' catalog names each message's files, never its lines (a line moved is no change)
    write_po(buffer, catalog, width=0, omit_header=False, sort_output=False, include_previous=False,
             include_lineno=False)
    path.write_bytes(buffer.getvalue())


def recorded_hash(message: Message) -> str | None:
    for comment in message.auto_comments:
        if comment.startswith(HASH_PREFIX):
            return comment[len(HASH_PREFIX):].strip()
    return None


@dataclass(frozen=True)
class Document:
    """What one catalog translates: ``name`` (a notebook's assignment id, or ``edition``), the catalog's ``path``,
    and its ``entries`` (context, cell type, English source) in order."""
    name: str
    path: Path
    entries: list[tuple[str, str, str]]


#: The catalog of the texts a translated course carries besides its notebooks (``i18n/LANG/edition.po``): the
#: student edition's README (``python -m autograder student-edition --lang LANG``).
EDITION = "edition"


def edition_texts() -> list[tuple[str, str, str]]:
    from .edition_readme import DEMOS_INTRO, README

    return [("README.md", "markdown", README), ("README.md: demos", "markdown", DEMOS_INTRO)]


def documents(course: Course, lang: str, assignments: list[str] | None = None) -> list[Document]:
    """Every catalog of ``lang`` with what it translates: one per notebook (``assignments``, default all), and the
    edition's texts when all are asked for."""
    ids = course.assignments() if assignments is None else assignments
    docs = [Document(aid, catalog_path(course.root, lang, aid), readable_cells(course.source_notebook(aid)))
            for aid in ids]
    if assignments is None:
        docs.append(Document(EDITION, course.root / "i18n" / lang / f"{EDITION}.po", edition_texts()))
    return docs


def update(course: Course, lang: str, assignments: list[str] | None = None) -> list[Path]:
    """Bring each catalog in step with its English (``documents``): new cells get an empty entry, changed cells keep
    their (now stale) translation and hash with the new English, removed cells are dropped."""
    written = []
    for doc in documents(course, lang, assignments):
        old = read_catalog(doc.path) if doc.path.exists() else None
        made = old.creation_date if old is not None else datetime.now(timezone.utc).replace(second=0, microsecond=0)
        what = "the student edition's texts" if doc.name == EDITION else f"notebook {doc.name}"
        catalog = Catalog(locale=LANGUAGES[lang], project=what, version="1",
                          header_comment=f"# The {lang} text of {what} (see autograder/translation.py).",
                          creation_date=made, revision_date=made, fuzzy=False,
                          last_translator="", language_team="", msgid_bugs_address="")
        for cell_id, cell_type, source in doc.entries:
            before = _by_context(old, cell_id) if old is not None else None
            notes = list(before.user_comments) if before is not None else []   # the translator's, kept
            if before is not None and before.string:
                comments = [c for c in before.auto_comments if c.startswith(HASH_PREFIX)]
                string = before.string
            else:
                comments, string = [HASH_PREFIX + english_hash(source)], ""
            catalog.add(source, string, context=cell_id, auto_comments=[f"{cell_type} cell", *comments],
                        user_comments=notes)
        write_catalog(catalog, doc.path)
        written.append(doc.path)
    return written


def _by_context(catalog: Catalog, context: str) -> Message | None:
    for message in catalog:
        if message.context == context and message.id:
            return message
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m autograder.translation", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["update"])
    parser.add_argument("--lang", default="zh", choices=sorted(LANGUAGES))
    parser.add_argument("--assignment", default=None)
    args = parser.parse_args(argv)
    course = Course.at(None)
    for path in update(course, args.lang, course.select(args.assignment) if args.assignment else None):
        print(path.relative_to(course.root))


if __name__ == "__main__":
    main()
