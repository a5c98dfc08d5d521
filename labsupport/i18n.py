"""The language of what the course says to a student: English by default, Chinese in the Chinese edition.

``use_language("zh")`` (the set-up cell of each Chinese notebook calls it) switches every student-facing message of
``labsupport`` and of the grader's feedback to Chinese, in this process and in the workers it starts (through
``LABSUPPORT_LANG``). Messages are marked with ``_()`` where they are written and translated in the gettext catalog
``labsupport/locale/LANG/LC_MESSAGES/labsupport.po``; a message without a translation is shown in English.
"""

from __future__ import annotations

import os

LANGUAGES = ("en", "zh")
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


def _(message: str) -> str:
    """``message`` in the language in use (the English text itself until its catalog has a translation)."""
    return message
