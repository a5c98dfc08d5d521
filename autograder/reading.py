"""Reading what was handed in, and what nbgrader made of it: a submission read (and mended) or the reason it
cannot be, the test outcomes and errors of a graded notebook, and the one-line reasons of ``grades.csv``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from . import feedback as fb
from .execute import CURRENT, cell_label, nbgrader_meta

MAX_REASON = 1000  # characters of a reason in grades.csv (the feedback page has everything)


def _read_submission(path: str):
    """The submitted notebook, or the reason it cannot be read."""
    import nbformat

    try:
        raw = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        return None, f"grading failed: notebook is not UTF-8 text ({exc.reason} at byte {exc.start})"
    if not raw.strip():
        return None, "grading failed: the notebook file is empty (0 bytes of JSON)"
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        return None, f"grading failed: notebook is not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})"
    if not isinstance(data, dict) or not ("cells" in data or "worksheets" in data):
        return None, "grading failed: the file is JSON but not a Jupyter notebook (it has no cells)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nbformat's notices about missing cell ids: mended below
            nb = nbformat.reads(raw, as_version=4)
            try:
                nbformat.validate(nb)
            except nbformat.ValidationError:  # small slips (a stray key, a missing field) are mended, not fatal
                nb = nbformat.from_dict(_mend(nb))
                nbformat.validate(nb)
    except Exception as exc:  # nbformat raises several kinds
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"grading failed: not a valid Jupyter notebook ({first[:200]})"
    return nb, None


_CELL_KEYS = {"code": {"id", "cell_type", "metadata", "source", "outputs", "execution_count"},
              "markdown": {"id", "cell_type", "metadata", "source", "attachments"},
              "raw": {"id", "cell_type", "metadata", "source", "attachments"}}


def _mend(nb) -> dict:
    """A notebook dict with unknown cell keys dropped and missing required ones filled in."""
    nb = json.loads(json.dumps(nb))
    nb.setdefault("metadata", {})
    for i, cell in enumerate(nb.get("cells", [])):
        kind = cell.get("cell_type") if cell.get("cell_type") in _CELL_KEYS else "raw"
        cell["cell_type"] = kind
        for key in set(cell) - _CELL_KEYS[kind]:
            del cell[key]
        cell.setdefault("metadata", {})
        cell.setdefault("source", "")
        if kind == "code":
            cell.setdefault("outputs", [])
            cell.setdefault("execution_count", None)
        if (nb.get("nbformat"), nb.get("nbformat_minor", 0)) >= (4, 5):
            cell.setdefault("id", f"cell-{i}")
    return nb


def _unique_ids(nb) -> None:
    seen = set()
    for i, cell in enumerate(nb.cells):
        if "id" in cell:
            while cell.id in seen:
                cell.id = f"{cell.id}-{i}"
            seen.add(cell.id)


def _failure_reason(result: dict, timeout: float) -> str:
    rec = CURRENT
    if rec.failure == "dead_kernel":
        return (f"grading failed: the kernel died while running cell {rec.failure_cell} (the process was killed or "
                "exited: os._exit, os.kill, a crash in native code or running out of memory); no score was recorded")
    if rec.failure == "unresponsive":
        return (f"grading failed: cell {rec.failure_cell} was still running after the {timeout:g} s limit and "
                "ignored the interrupt (a loop that catches KeyboardInterrupt or ignores SIGINT?); the kernel was "
                "stopped and no score was recorded")
    return f"grading failed: nbgrader could not grade this notebook ({_nbgrader_error(result)[:300]})"


def _nbgrader_error(result: dict) -> str:
    """The exception behind a failed ``nbgrader autograde``: the last line of the first traceback in its log
    (nbgrader logs the real one, then raises a generic ``NbGraderException``)."""
    lines = [ln.strip() for ln in (result.get("log") or "").splitlines()]
    lines = [ln[len("[ERROR]"):].strip() if ln.startswith("[ERROR]") else ln for ln in lines]
    in_traceback, last = False, None
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            in_traceback, last = True, None
        elif in_traceback and line and not line.startswith(("File ", "^", "~")) and not line.startswith("  "):
            if ":" in line and line.split(":")[0].replace(".", "").replace("_", "").isalnum():
                last = line
        elif in_traceback and not line and last:
            break
    if last:
        return last
    errors = [ln for ln in lines if ("Error" in ln or "Exception" in ln) and "NbGraderException" not in ln]
    return errors[0] if errors else "no detail in nbgrader's log"


def _outcomes(graded, scores: dict, secret: set[str]) -> list[fb.TestOutcome]:
    outcomes = []
    for cell in graded.cells:
        meta = nbgrader_meta(cell)
        gid = meta.get("grade_id")
        if not meta.get("grade") or gid not in scores:
            continue
        points, full = scores[gid]
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        message = None
        if errors:
            message = fb.short_message(errors[-1].get("ename", "Error"), errors[-1].get("evalue", ""), secret)
        elif points < full:
            message = "no points"
        outcomes.append(fb.TestOutcome(gid, points, full, message))
    return outcomes


def _other_errors(graded) -> list[str]:
    """Errors in cells that are not test cells (answer cells, the student's own cells)."""
    found = []
    for i, cell in enumerate(graded.cells):
        meta = nbgrader_meta(cell)
        if meta.get("grade") or (meta.get("locked") and not meta.get("solution")):
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error" and out.get("ename") != "CellTimeoutError":
                found.append(f"{cell_label(cell, i)} ({out.get('ename')})")
    return found


def _one_line(text: str, limit: int = 160) -> str:
    """The first line of ``text``; when longer than ``limit``, cut after its last whole sentence that fits, else at
    a word, never inside one (the feedback page has the whole message)."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if len(line) <= limit:
        return line
    head = line[:limit - 1]
    end = max(head.rfind(". "), head.rfind(": "), head.rfind("; "))
    if end >= limit // 3:
        return head[:end + 1] + " …"
    space = head.rfind(" ")
    return (head[:space] if space > 0 else head).rstrip(",;:") + " …"


def _compose(parts: list[str]) -> str:
    reason = "; ".join(p for p in parts if p)
    return reason if len(reason) <= MAX_REASON else reason[:MAX_REASON - 3] + "..."
