"""The language of what the course says to a student: English by default, Chinese in the Chinese edition.

``use_language("zh")`` (the set-up cell of each Chinese notebook calls it) switches every student-facing message of
``labsupport`` and of the grader's feedback to Chinese, in this process and in the workers it starts (through
``LABSUPPORT_LANG``: each call of ``labsupport.run`` hands the ranks the notebook's environment as it is then, so
workers started earlier follow too). Messages are marked with ``_()`` where they are written and translated in the
gettext catalog ``labsupport/locale/LANG/LC_MESSAGES/labsupport.po``, compiled to the ``.mo`` file next to it that
the package ships and reads with Python's own ``gettext``; a message without a translation is shown in English.
``python -m autograder.messages update`` brings the catalog in step with the code (see that module).
"""

from __future__ import annotations

import functools
import gettext
import os
from pathlib import Path

LANGUAGES = ("en", "zh")
#: The gettext locale of each language that has a catalog.
LOCALES = {"zh": "zh_CN"}
DOMAIN = "labsupport"
LOCALE_DIR = Path(__file__).resolve().parent / "locale"
_ENV = "LABSUPPORT_LANG"


def language() -> str:
    """The language now in use: ``"en"`` or ``"zh"``."""
    lang = os.environ.get(_ENV, "en")
    return lang if lang in LANGUAGES else "en"


def use_language(lang: str) -> None:
    """Show the course's messages in ``lang`` (``"en"`` or ``"zh"``) from now on, here and in workers started later."""
    if lang not in LANGUAGES:
        raise ValueError(f"use_language: {lang!r} is not one of the course's languages {LANGUAGES}")
    os.environ[_ENV] = lang


@functools.lru_cache(maxsize=None)
def translations(lang: str) -> gettext.NullTranslations:
    """The compiled catalog of ``lang``, read once per process; English (no catalog) when there is none or it cannot
    be read (a sandbox that may not read it shows English rather than failing)."""
    if lang not in LOCALES:
        return gettext.NullTranslations()
    try:
        return gettext.translation(DOMAIN, LOCALE_DIR, languages=[LOCALES[lang]], fallback=True)
    except OSError:
        return gettext.NullTranslations()


def _(message: str) -> str:
    """``message`` in the language in use (the English text itself where its catalog has no translation).

    A message with values keeps its placeholders in the marked text and is filled in after the lookup, so that its
    catalog entry is the same whatever the values: ``_("rank {rank} raised {type}").format(rank=r, type=t)``."""
    lang = language()
    if lang == "en":
        return message
    return translations(lang).gettext(message)


def N_(message: str) -> str:  # noqa: N802 - gettext's name for it
    """Mark ``message`` for the catalog without translating it now: for a text kept as a value (a constant, a word
    sent between processes) and translated with ``_()`` where it is shown."""
    return message
