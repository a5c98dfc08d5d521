"""Feedback pages that show a student their graded notebook without leaking hidden tests.

nbgrader's own feedback shows hidden tests, in the test cells and in traceback context lines (nbgrader issues #917
and #1363). Ours is built from a cleaned copy of the autograded notebook:

* read-only cells show the source the student received (the release), answer cells the student's own code with
  the solution markers removed, and any hidden-test region left anywhere is cut out;
* a graded test cell's output is replaced by one line, "passed" or "failed: <ExceptionType>: <message>", never a
  traceback;
* other outputs are kept but bounded, and any output line that quotes a hidden-test line is dropped;
* the score per test and the total are at the top.
"""

from __future__ import annotations

import copy
import html
import re
from dataclasses import dataclass, field

from labsupport.i18n import _, language

from .execute import nbgrader_meta

BEGIN_HIDDEN, END_HIDDEN = "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"
BEGIN_SOLUTION, END_SOLUTION = "BEGIN SOLUTION", "END SOLUTION"
MAX_TEXT_LINES = 200
MAX_TEXT_CHARS = 20_000
MAX_TRACEBACK_LINES = 40
MAX_MESSAGE_CHARS = 400
MIN_HIDDEN_LINE = 8   # shorter hidden lines ("pass", "try:") say nothing and occur in anyone's code
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_SAFE_MIME = ("text/plain", "image/png", "image/jpeg", "image/gif")
_HTML_LANG = {"zh": "zh-CN"}


@dataclass
class TestOutcome:
    grade_id: str
    points: float
    max_points: float
    message: str | None = None    # None: passed


@dataclass
class Summary:
    student: str
    assignment: str
    points: float
    max_points: float
    status: str
    reason: str
    tests: list[TestOutcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)


def source_text(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def strip_hidden(source: str) -> str:
    """``source`` without hidden-test regions (markers included) and without solution marker lines."""
    out, hidden = [], False
    for line in source.split("\n"):
        if BEGIN_HIDDEN in line:
            hidden = True
        elif END_HIDDEN in line:
            hidden = False
        elif not hidden and BEGIN_SOLUTION not in line and END_SOLUTION not in line:
            out.append(line)
    return "\n".join(out)


def hidden_lines(source_nb, release_nb=None) -> set[str]:
    """Distinctive lines of the hidden-test regions of ``source_nb`` (those not also visible in the release)."""
    visible = set()
    if release_nb is not None:
        for cell in release_nb.cells:
            visible.update(ln.strip() for ln in source_text(cell).splitlines())
    lines, hidden = set(), False
    for cell in source_nb.cells:
        for line in source_text(cell).splitlines():
            if BEGIN_HIDDEN in line:
                hidden = True
            elif END_HIDDEN in line:
                hidden = False
            elif hidden and len(line.strip()) >= MIN_HIDDEN_LINE and line.strip() not in visible:
                lines.add(line.strip())
    return lines


def scrub(text: str, secret: set[str]) -> str:
    """``text`` without the lines that quote a secret line."""
    if not secret:
        return text
    return "\n".join(ln for ln in text.split("\n") if not any(s in _ANSI.sub("", ln) for s in secret))


def clean_value(evalue: str, secret: set[str]) -> str:
    """An exception message fit to show: no colour codes, bounded, withheld if it quotes a hidden-test line."""
    evalue = _ANSI.sub("", evalue or "").strip()
    if any(s in evalue for s in secret):
        evalue = _("(details withheld)")
    if len(evalue) > MAX_MESSAGE_CHARS:
        evalue = evalue[:MAX_MESSAGE_CHARS - 3] + "..."
    return evalue


def short_message(ename: str, evalue: str, secret: set[str]) -> str:
    evalue = clean_value(evalue, secret)
    return f"{ename}: {evalue}" if evalue else ename


def _bounded(text: str) -> str:
    lines = text.split("\n")
    if len(lines) > MAX_TEXT_LINES:
        lines = lines[:MAX_TEXT_LINES] + [_("... ({count} more lines not shown)").format(
            count=len(lines) - MAX_TEXT_LINES)]
    text = "\n".join(lines)
    if len(text) > MAX_TEXT_CHARS:
        text = text[:MAX_TEXT_CHARS] + "\n" + _("... (output cut)")
    return text


def _clean_outputs(outputs, secret):
    cleaned = []
    for out in outputs:
        kind = out.get("output_type")
        if kind == "stream":
            out["text"] = _bounded(scrub(source_text({"source": out.get("text", "")}), secret))
        elif kind == "error":
            tb = [scrub(line, secret) for line in out.get("traceback", [])]
            tb = [line for line in tb if line.strip()]
            if len(tb) > MAX_TRACEBACK_LINES:
                tb = [_("... (traceback shortened)")] + tb[-MAX_TRACEBACK_LINES:]
            out["traceback"] = tb
            out["evalue"] = clean_value(out.get("evalue", ""), secret)
        elif kind in ("display_data", "execute_result"):
            # plain text and bitmaps only: HTML, JavaScript, SVG or Markdown output could run code in the
            # browser of whoever opens the page (the student, or the instructor)
            data = {mime: value for mime, value in out.get("data", {}).items() if mime in _SAFE_MIME}
            if "text/plain" in data:
                data["text/plain"] = _bounded(scrub(source_text({"source": data["text/plain"]}), secret))
            data = {mime: value for mime, value in data.items() if len(value) < 3_000_000}
            if not data:
                continue
            out["data"] = data
        cleaned.append(out)
    return cleaned


def clean_notebook(graded_nb, release_nb, outcomes: dict[str, TestOutcome], secret: set[str]):
    """The notebook a student may see: see the module docstring."""
    nb = copy.deepcopy(graded_nb)
    release_by_id = {nbgrader_meta(c).get("grade_id"): c for c in release_nb.cells if nbgrader_meta(c)}
    trusted_markdown = {source_text(c).strip() for c in release_nb.cells if c.cell_type == "markdown"}
    for cell in nb.cells:
        meta = nbgrader_meta(cell)
        gid = meta.get("grade_id")
        rel = release_by_id.get(gid)
        if rel is not None and not meta.get("solution"):
            cell.source = source_text(rel)
        cell.source = strip_hidden(source_text(cell))
        if cell.cell_type == "markdown" and cell.source.strip() not in trusted_markdown:
            # a student's own Markdown: formatting yes, raw HTML no (it would be shown as text)
            cell.source = html.escape(cell.source, quote=False)
        elif cell.cell_type == "raw":
            cell.metadata.pop("format", None)
            cell.metadata.pop("raw_mimetype", None)
        if cell.cell_type != "code":
            continue
        if gid in outcomes and meta.get("grade"):
            o = outcomes[gid]
            if o.message is None:
                line = _("passed: {points} / {max_points} points").format(points=f"{o.points:g}",
                                                                          max_points=f"{o.max_points:g}") + "\n"
            else:
                line = _("failed ({points} / {max_points} points): {message}").format(
                    points=f"{o.points:g}", max_points=f"{o.max_points:g}", message=o.message) + "\n"
            cell.outputs = [{"output_type": "stream", "name": "stdout", "text": line}]
        else:
            cell.outputs = _clean_outputs(cell.get("outputs", []), secret)
        cell.metadata.pop("nbgrader", None)
    return nb


_CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif; max-width: 980px;
       margin: 2em auto; padding: 0 1em; color: #222; line-height: 1.45; }
header { border-bottom: 2px solid #ddd; margin-bottom: 1.5em; }
table.scores { border-collapse: collapse; margin: 1em 0; }
table.scores td, table.scores th { border: 1px solid #ccc; padding: .25em .7em; text-align: left; }
.ok { color: #1a7f37; } .bad { color: #b42318; }
.status-failed { background: #fdecea; border: 1px solid #f5c2c0; padding: .6em 1em; }
.jp-Cell { margin: .8em 0; } .jp-InputPrompt, .jp-OutputPrompt { display: none; }
.jp-InputArea-editor, .highlight { background: #f6f8fa; border: 1px solid #e1e4e8; border-radius: 4px; }
pre { margin: 0; padding: .5em .7em; overflow-x: auto; white-space: pre-wrap; }
.jp-OutputArea-output pre { background: #fff; border-left: 3px solid #ddd; }
.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"] pre { background: #fff5f5; }
"""


_EXPORTER = None


def _exporter():
    """One HTML exporter per process (building one compiles its templates, a good part of a second).

    Its two costliest filters, highlighting a cell's code and sanitising HTML, are pure functions of their input,
    and most of a notebook's cells (explanations, set-up, tests) are the same in every submission: a grading
    process computes each of those once instead of once per notebook.
    """
    global _EXPORTER
    if _EXPORTER is None:
        from functools import lru_cache, partial

        from nbconvert import HTMLExporter
        from nbconvert.filters.highlight import Highlight2HTML
        from nbconvert.filters.strings import clean_html
        from pygments.formatters import HtmlFormatter

        @lru_cache(maxsize=4096)
        def highlight(lexer, source, language, magics):
            return Highlight2HTML(pygments_lexer=lexer)(source, language, {"magics_language": magics} if magics
                                                        else None)

        def highlight_code(lexer, source, language=None, metadata=None):
            return highlight(lexer, source, language, (metadata or {}).get("magics_language"))

        class Exporter(HTMLExporter):
            def from_notebook_node(self, nb, resources=None, **kw):
                info = nb.metadata.get("language_info", {})  # the lexer, as HTMLExporter picks it
                self.filters["highlight_code"] = partial(highlight_code, info.get("pygments_lexer", info.get("name")))
                return super().from_notebook_node(nb, resources, **kw)

        exporter = Exporter(template_name="basic", filters={"clean_html": lru_cache(maxsize=4096)(clean_html)})
        _EXPORTER = exporter, HtmlFormatter().get_style_defs(".highlight")
    return _EXPORTER


def render(summary: Summary, nb=None) -> str:
    """The feedback page: a header with the scores and notes, then the cleaned notebook (if any)."""
    esc = html.escape

    def say(text: str) -> str:   # a translated text of the page's own (placed as it is in English: no quotes)
        return esc(text, quote=False)

    rows = []
    passed, failed = say(_("passed")), say(_("failed"))
    for t in summary.tests:
        result = f'<span class="ok">{passed}</span>' if t.message is None else \
            f'<span class="bad">{failed}</span>: {esc(t.message)}'
        rows.append(f"<tr><td><code>{esc(t.grade_id)}</code></td><td>{t.points:g} / {t.max_points:g}</td>"
                    f"<td>{result}</td></tr>")
    head = "".join(f"<th>{say(h)}</th>" for h in (_("test"), _("points"), _("result")))
    table = f"<table class=\"scores\"><tr>{head}</tr>" + "".join(rows) + "</table>" if rows else ""
    status = ""
    if summary.status != "ok":
        not_graded = say(_("Not graded automatically."))
        status = f'<p class="status-failed"><strong>{not_graded}</strong> {esc(summary.reason)}</p>'
    notes = "".join(f"<li>{esc(n)}</li>" for n in summary.notes)
    from_grader = say(_("Notes from the grader:"))
    notes = f"<p>{from_grader}</p><ul>{notes}</ul>" if notes else ""
    if summary.flags:
        items = "".join(f"<li>{esc(f)}</li>" for f in summary.flags)
        flagged = say(_("Flagged for review."))
        why = say(_("Your instructor will look at these parts of your notebook (code an answer never needs, or "
                    "hidden tests whose outcome differed between your notebook's run and the grader's own):"))
        notes += f'<div class="status-failed"><p><strong>{flagged}</strong> {why}</p><ul>{items}</ul></div>'
    body = ""
    if nb is not None:
        exporter, style = _exporter()
        body = exporter.from_notebook_node(nb)[0]
        body = f"<style>{style}</style>\n{body}"
    title = esc(_("Feedback: {assignment}").format(assignment=summary.assignment))
    student, score = say(_("Student:")), say(_("Score:"))
    return (
        f"<!DOCTYPE html>\n<html lang=\"{_HTML_LANG.get(language(), 'en')}\"><head><meta charset=\"utf-8\">"
        f"<title>{title} ({esc(summary.student)})</title><style>{_CSS}</style></head>"
        f"<body><header><h1>{title}</h1>"
        f"<p>{student} <strong>{esc(summary.student)}</strong> &middot; "
        f"{score} <strong>{summary.points:g} / {summary.max_points:g}</strong></p>"
        f"{status}{table}{notes}</header>\n<main>{body}</main></body></html>\n"
    )
