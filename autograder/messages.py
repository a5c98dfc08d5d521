"""The catalogs of the course's messages: ``labsupport/locale/LANG/LC_MESSAGES/labsupport.po`` and its ``.mo``.

The messages a student reads (a rank's error, a deadlock report, a visible test's verdict, Validate's checklist,
``check``'s report, the feedback page) are marked in the code with ``_()`` (or ``N_()`` for a text translated where it
is shown) from ``labsupport.i18n``. Babel extracts them with the mapping ``i18n/messages.cfg``; each entry's extracted
comment ``en-sha256: HASH`` is the hash of the English its translation was made from (the convention of the
notebooks' catalogs, ``autograder/translation.py``): a translation whose hash is not its msgid's is stale. The
package ships the compiled ``.mo`` (read by Python's own ``gettext``, so the light install needs no Babel); it holds
only the translations that are up to date, so a stale one shows the English until it is revised.

    python -m autograder.messages update [--lang zh]    # in step with the code: new messages, changed ones, .mo
    python -m autograder.messages revised [--lang zh]   # after revising the stale translations: take their English
    python -m autograder.messages check [--lang zh]     # what the tests check: in step, translated, placeholders,
                                                        # glossary
"""

from __future__ import annotations

import argparse
import difflib
import re
import string
import struct
import sys
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from babel.messages.catalog import Catalog, Message
from babel.messages.extract import extract_from_dir
from babel.messages.frontend import parse_mapping_cfg

from labsupport.i18n import DOMAIN, LOCALES

from .translation import HASH_PREFIX, english_hash, read_catalog, recorded_hash, write_catalog

ROOT = Path(__file__).resolve().parents[1]
MAPPING = Path("i18n") / "messages.cfg"
KEYWORDS = {"_": None, "N_": None}
CODE_PREFIX = "code: "


def catalog_path(root: Path, lang: str) -> Path:
    return root / "labsupport" / "locale" / LOCALES[lang] / "LC_MESSAGES" / f"{DOMAIN}.po"


def extract(root: Path = ROOT) -> dict[str, list[str]]:
    """Every marked message of the code, in order of first appearance: msgid -> the files that use it."""
    with (root / MAPPING).open(encoding="utf-8") as f:
        method_map, options_map = parse_mapping_cfg(f)
    found: dict[str, list[str]] = {}
    for filename, _lineno, message, _comments, _context in extract_from_dir(
            root, method_map, options_map, keywords=KEYWORDS,
            directory_filter=lambda d: not Path(d).name.startswith((".", "__pycache__"))):
        if isinstance(message, str) and message:
            files = found.setdefault(message, [])
            if filename not in files:
                files.append(filename)
    return found


def messages(catalog: Catalog) -> list[Message]:
    return [m for m in catalog if m.id and isinstance(m.id, str)]


def current(message: Message) -> bool:
    """A translation made from the English the code says now."""
    return bool(message.string) and recorded_hash(message) == english_hash(message.id)


def update(root: Path, lang: str) -> Path:
    """Bring the catalog in step with the code: a new message gets an empty entry, a changed one the translation of
    the closest message that is gone (with that one's hash, so it is stale until revised), a removed one is dropped;
    then compile the ``.mo``."""
    path = catalog_path(root, lang)
    old = read_catalog(path) if path.exists() else None
    made = old.creation_date if old is not None else datetime.now(timezone.utc).replace(second=0, microsecond=0)
    catalog = Catalog(locale=LOCALES[lang], project=DOMAIN, version="1", creation_date=made, revision_date=made,
                      header_comment=f"# The {lang} text of the course's messages (see autograder/messages.py).",
                      fuzzy=False, last_translator="", language_team="", msgid_bugs_address="")
    found = extract(root)
    before = {m.id: m for m in messages(old)} if old is not None else {}
    gone = [m for m in before if m not in found and before[m].string]
    for msgid, files in found.items():
        was = before.get(msgid)
        if was is None or not was.string:
            near = difflib.get_close_matches(msgid, gone, n=1, cutoff=0.6)
            was = before[near[0]] if near else None
        if was is not None and was.string:
            string_, hashed, notes = was.string, recorded_hash(was) or "", was.user_comments
        else:
            string_, hashed, notes = "", english_hash(msgid), []
        catalog.add(msgid, string_, locations=[(f, None) for f in files], auto_comments=[HASH_PREFIX + hashed],
                    user_comments=notes)
    write_catalog(catalog, path)
    path.with_suffix(".mo").write_bytes(compile_catalog(catalog))
    return path


def revised(root: Path, lang: str) -> list[str]:
    """Record that each stale translation was revised against the English it has now (its hash); recompile."""
    path = catalog_path(root, lang)
    catalog = read_catalog(path)
    done = []
    for m in messages(catalog):
        if m.string and not current(m):
            m.auto_comments = [c for c in m.auto_comments if not c.startswith(HASH_PREFIX)] + \
                [HASH_PREFIX + english_hash(m.id)]
            done.append(m.id)
    write_catalog(catalog, path)
    path.with_suffix(".mo").write_bytes(compile_catalog(catalog))
    return done


def compile_catalog(catalog: Catalog) -> bytes:
    """The ``.mo`` of ``catalog``: its current translations, sorted, with a fixed header (so the same ``.po`` always
    gives the same bytes, whatever Babel's version), in GNU gettext's format as Python's ``gettext`` reads it."""
    header = f"Content-Type: text/plain; charset=UTF-8\nLanguage: {catalog.locale_identifier}\n"
    entries = [("", header)] + sorted((m.id, m.string) for m in messages(catalog) if current(m))
    ids = [k.encode("utf-8") for k, _v in entries]
    strs = [v.encode("utf-8") for _k, v in entries]
    n = len(entries)
    start = 7 * 4 + 16 * n                      # header, then the two tables of (length, offset)
    offsets, data = [], b""
    for blob in ids + strs:
        offsets.append((len(blob), start + len(data)))
        data += blob + b"\0"
    out = struct.pack("<7I", 0x950412DE, 0, n, 7 * 4, 7 * 4 + 8 * n, 0, start)
    out += b"".join(struct.pack("<2I", *o) for o in offsets)
    return out + data


def out_of_step(catalog: Catalog, found: dict[str, list[str]]) -> list[str]:
    """The messages the code and the catalog disagree on, each named."""
    have = {m.id for m in messages(catalog)}
    problems = [f"in the code ({', '.join(found[m])}) but not in the catalog: {m!r}" for m in found if m not in have]
    problems += [f"in the catalog but not in the code: {m!r}" for m in sorted(have - set(found))]
    return problems


def not_current(catalog: Catalog) -> list[str]:
    """Messages without a translation, or whose translation was made from other English (stale)."""
    problems = []
    for m in messages(catalog):
        if not m.string.strip():
            problems.append(f"not translated: {m.id!r}")
        elif recorded_hash(m) != english_hash(m.id):
            problems.append(f"stale (its English changed since it was translated; revise it, then run "
                            f"`python -m autograder.messages revised`): {m.id!r}")
    return problems


def placeholders(text: str) -> Counter:
    """The ``{...}`` fields of a ``str.format`` template, as written (name, conversion and format)."""
    fields = Counter()
    for _literal, name, spec, conversion in string.Formatter().parse(text):
        if name is not None:
            fields["{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"] += 1
    return fields


def placeholder_mismatches(catalog: Catalog) -> list[str]:
    problems = []
    for m in messages(catalog):
        if not m.string:
            continue
        try:
            want, got = placeholders(m.id), placeholders(m.string)
        except ValueError as exc:
            problems.append(f"not a valid template ({exc}): {m.string!r} for {m.id!r}")
            continue
        if want != got:
            problems.append(f"placeholders {sorted(got.elements())} instead of {sorted(want.elements())}: "
                            f"{m.string!r} for {m.id!r}")
    return problems


def load_glossary(path: Path) -> list[tuple[str, str]]:
    """(English form, Chinese form) of every term of the glossary, longest English first."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    terms = tomllib.loads(path.read_text(encoding="utf-8"))["term"]
    return sorted(((form, t["zh"]) for t in terms for form in t["en"]), key=lambda p: -len(p[0]))


def code_words(message: Message) -> set[str]:
    """The words the translator noted as code in this message (a comment ``# code: backend, broadcast``): an
    argument's or an exercise's name, written as it is, not the term."""
    words = set()
    for comment in message.user_comments:
        if comment.startswith(CODE_PREFIX):
            words |= {w.strip().lower() for w in comment[len(CODE_PREFIX):].split(",") if w.strip()}
    return words


def glossary_misses(catalog: Catalog, glossary: list[tuple[str, str]]) -> list[str]:
    """Translations that do not use the glossary's form of a term their English uses (whole words, any case, the
    longest term first). Not English: a placeholder, a `code span`, and the words of the entry's ``code:`` note."""
    zh_of = {form.lower(): zh for form, zh in glossary}
    pattern = re.compile(r"\b(" + "|".join(re.escape(form) for form, _zh in glossary) + r")\b", re.IGNORECASE)
    problems = []
    for m in messages(catalog):
        if not m.string:
            continue
        english = re.sub(r"\{[^{}]*\}|`[^`]*`", " ", m.id)
        code = code_words(m)
        for term in dict.fromkeys(t.lower() for t in pattern.findall(english) if t.lower() not in code):
            if zh_of[term].lower() not in m.string.lower():
                problems.append(f"{term!r} should be {zh_of[term]!r}: {m.string!r} for {m.id!r}")
    return problems


def check(root: Path, lang: str, found: dict[str, list[str]] | None = None) -> list[str]:
    catalog = read_catalog(catalog_path(root, lang))
    glossary = load_glossary(root / "i18n" / lang / "glossary.toml")
    found = extract(root) if found is None else found
    return (out_of_step(catalog, found) + not_current(catalog) + placeholder_mismatches(catalog)
            + glossary_misses(catalog, glossary))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograder.messages", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["update", "revised", "check"])
    parser.add_argument("--lang", default="zh", choices=sorted(LOCALES))
    args = parser.parse_args(argv)
    if args.command == "update":
        path = update(ROOT, args.lang)
        print(path.relative_to(ROOT))
        problems = not_current(read_catalog(path))
    elif args.command == "revised":
        for msgid in revised(ROOT, args.lang):
            print(f"revised: {msgid!r}")
        return 0
    else:
        problems = check(ROOT, args.lang)
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
