"""What the grader's processes leave out of their start, at no cost to what they do."""

from __future__ import annotations

import sys


def skip_iri_grammars() -> None:
    """Let jsonschema start without ``rfc3987_syntax``.

    nbformat validates notebooks with jsonschema. jsonschema imports ``rfc3987_syntax`` at its own import, when it is
    installed (Jupyter brings it, with ``jsonschema[format-nongpl]``), to check the ``iri`` and ``iri-reference``
    formats. That module builds some forty parsers as it is imported: about two seconds of every process that reads a
    notebook. nbformat validates without any format checker, so the grader's processes tell jsonschema that the
    module is not there (``None`` in ``sys.modules``: its import fails, and jsonschema goes on without those two
    checks). Only for a process whose jsonschema is not loaded yet, and only in the grader's command line and the
    test suite: never in a student's kernel.
    """
    if "jsonschema" not in sys.modules:
        sys.modules.setdefault("rfc3987_syntax", None)
