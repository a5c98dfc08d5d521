"""The notebooks' translations: one gettext catalog per notebook and language, ``i18n/LANG/notebooks/NAME.po``.

Each entry is one cell of the instructor's source notebook (``solutions/NAME/NAME.ipynb``) that a reader reads: every
markdown cell, and every code cell with a comment or a docstring. ``msgctxt`` is the cell's id, ``msgid`` the cell's
English source as it is now, ``msgstr`` its translation (for a code cell: the same code, only its comments and
docstrings translated). The extracted comment ``en-sha256: HASH`` is the hash of the English text the translation was
made from: ``update`` refreshes ``msgid`` when the English changes but never the hash, so a translation whose hash is
not its ``msgid``'s is stale, and the test of translations names its cell.

    python -m autograder.translation update [--lang zh]   # add new cells, refresh the English, keep translations
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import tokenize
from datetime import datetime, timezone
from pathlib import Path

from babel.messages.catalog import Catalog, Message
from babel.messages.pofile import read_po, write_po

from .course import Course

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


def catalog_path(root: Path, lang: str, assignment: str) -> Path:
    return root / "i18n" / lang / "notebooks" / f"{assignment}.po"


def read_catalog(path: Path) -> Catalog:
    with path.open("rb") as f:
        return read_po(f)


def write_catalog(catalog: Catalog, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    write_po(buffer, catalog, width=0, omit_header=False, sort_output=False, include_previous=False)
    path.write_bytes(buffer.getvalue())


def recorded_hash(message: Message) -> str | None:
    for comment in message.auto_comments:
        if comment.startswith(HASH_PREFIX):
            return comment[len(HASH_PREFIX):].strip()
    return None


def update(course: Course, lang: str, assignments: list[str]) -> list[Path]:
    """Bring each notebook's catalog in step with its English cells: new cells get an empty entry, changed cells keep
    their (now stale) translation and hash with the new English, removed cells are dropped."""
    written = []
    for assignment in assignments:
        path = catalog_path(course.root, lang, assignment)
        old = read_catalog(path) if path.exists() else None
        made = old.creation_date if old is not None else datetime.now(timezone.utc).replace(second=0, microsecond=0)
        catalog = Catalog(locale=LANGUAGES[lang], project=f"notebook {assignment}", version="1",
                          header_comment=f"# The {lang} text of notebook {assignment} (see autograder/translation.py).",
                          creation_date=made, revision_date=made, fuzzy=False,
                          last_translator="", language_team="", msgid_bugs_address="")
        for cell_id, cell_type, source in readable_cells(course.source_notebook(assignment)):
            before = _by_context(old, cell_id) if old is not None else None
            if before is not None and before.string:
                comments = [c for c in before.auto_comments if c.startswith(HASH_PREFIX)]
                string = before.string
            else:
                comments, string = [HASH_PREFIX + english_hash(source)], ""
            catalog.add(source, string, context=cell_id, auto_comments=[f"{cell_type} cell", *comments])
        write_catalog(catalog, path)
        written.append(path)
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
    for path in update(course, args.lang, course.select(args.assignment)):
        print(path.relative_to(course.root))


if __name__ == "__main__":
    main()
