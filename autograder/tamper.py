"""Compare a submission with the release it came from, report tampering, and repair what nbgrader cannot.

nbgrader 0.9.6 silently restores edited read-only cells (nothing is recorded), and its ``add_missing_cells`` crashes
when a deleted test cell follows a read-only cell (the usual layout here: answer, visible test, hidden test). So
before nbgrader sees a submission we:

* restore every read-only cell (visible tests, hidden-test cells, other locked cells) to its release source and
  nbgrader metadata, and record the ones whose source or metadata differed;
* put back read-only cells that were deleted, right after the nearest earlier cell that survived;
* recognise cells whose nbgrader metadata was stripped (e.g. copied into a new notebook): a read-only cell by its
  exact source, an answer cell by sitting just before its exercise's first test cell;
* drop nbgrader metadata that names no cell of the release, and duplicate ids (the last copy wins, as in nbgrader).

Answer cells are never put back: a student may have defined the function elsewhere, and a re-inserted stub would
overwrite it.

A read-only cell as a translated release has it (``notebooks-zh/``: translated comments, and a set-up cell that
switches the course's messages to Chinese) is not an edit: it is restored to the English like any other, and the
report records the submission's language (``language``, from its set-up cell) so that grading speaks it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from .execute import nbgrader_meta

_FLAGS = ("grade", "solution", "locked", "points", "grade_id", "task")


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _norm(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def is_readonly(meta: dict) -> bool:
    return bool(meta) and not meta.get("solution") and bool(meta.get("grade") or meta.get("locked"))


def is_answer(meta: dict) -> bool:
    return bool(meta.get("solution"))


@dataclass
class TamperReport:
    edited: list[str] = field(default_factory=list)             # read-only cells whose source was changed
    deleted: list[str] = field(default_factory=list)            # read-only cells missing (put back)
    stripped: list[str] = field(default_factory=list)           # read-only cells found without nbgrader metadata
    metadata_changed: list[str] = field(default_factory=list)   # read-only cells with changed nbgrader flags
    answers_stripped: list[str] = field(default_factory=list)   # answer cells found without nbgrader metadata
    answers_missing: list[str] = field(default_factory=list)    # answer cells not found at all
    answers_metadata_changed: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    unknown_ids: list[str] = field(default_factory=list)
    language: str = "en"                                        # the language of the set-up cell handed in

    @property
    def tampered_cells(self) -> list[str]:
        """grade_ids of read-only or test cells that were edited, deleted or had their metadata changed/stripped."""
        ids = self.edited + self.deleted + self.stripped + self.metadata_changed
        return sorted(set(ids))

    def notes(self) -> list[str]:
        """One phrase per kind of problem, for the CSV reason and the feedback."""
        parts = []

        def add(ids, text):
            if ids:
                parts.append(f"{text}: {', '.join(ids)}")

        add(self.edited, "edited read-only cells (restored before grading)")
        add(self.deleted, "deleted read-only cells (put back before grading)")
        add(self.stripped, "read-only cells without nbgrader metadata (recognised by content)")
        add(self.metadata_changed, "read-only cells with changed nbgrader metadata (restored)")
        add(self.answers_stripped, "answer cells without nbgrader metadata (recognised by position)")
        add(self.answers_metadata_changed, "answer cells with changed nbgrader metadata (restored)")
        add(self.answers_missing, "answer cells not found")
        add(self.duplicates, "duplicated cells (the last copy was graded)")
        add(self.unknown_ids, "cells with unknown grade_ids (treated as ordinary cells)")
        return parts


def repair(submission, release, source=None, translations=None):
    """A copy of ``submission`` fit for nbgrader, and the ``TamperReport`` describing what was wrong.

    All arguments are nbformat v4 notebooks (``NotebookNode``); ``release`` is the notebook students received and
    ``source`` (optional) the instructor's notebook it was generated from: a read-only cell that matches the
    source version (hidden tests included) is not counted as edited, so grading the solutions reports nothing.
    ``translations`` (optional), {language: [its source and release notebooks]}: a read-only cell as one of them
    has it is not counted as edited either.
    """
    nb = copy.deepcopy(submission)
    report = TamperReport()
    rel_cells = [c for c in release.cells if nbgrader_meta(c).get("grade_id")]
    rel_by_id = {nbgrader_meta(c)["grade_id"]: c for c in rel_cells}
    rel_order = [nbgrader_meta(c)["grade_id"] for c in rel_cells]
    accepted = {gid: {_norm(_source(c)): "en"} for gid, c in rel_by_id.items()}   # {normalised source: language}
    versions = [("en", source)] + [(lang, nb) for lang, nbs in (translations or {}).items() for nb in nbs]
    for lang, other in versions:
        for cell in (other.cells if other is not None else []):
            gid = nbgrader_meta(cell).get("grade_id")
            if gid in accepted:
                accepted[gid].setdefault(_norm(_source(cell)), lang)

    # 1. ids: drop unknown ones and all but the last copy of duplicated ones
    seen = set()
    for cell in reversed(nb.cells):
        meta = nbgrader_meta(cell)
        gid = meta.get("grade_id")
        if not meta:
            continue
        if gid not in rel_by_id:
            report.unknown_ids.append(str(gid))
            cell.metadata.pop("nbgrader", None)
        elif gid in seen:
            report.duplicates.append(gid)
            cell.metadata.pop("nbgrader", None)
        else:
            seen.add(gid)
    report.unknown_ids.reverse()
    report.duplicates = sorted(set(report.duplicates))

    def position(gid):
        for i, cell in enumerate(nb.cells):
            if nbgrader_meta(cell).get("grade_id") == gid:
                return i
        return None

    # 2. cells that lost their metadata: read-only ones by exact source, answers by position
    for gid in rel_order:
        rel = rel_by_id[gid]
        if gid in seen or not is_readonly(nbgrader_meta(rel)):
            continue
        for cell in nb.cells:
            if not nbgrader_meta(cell) and cell.cell_type == rel.cell_type and _norm(_source(cell)) in accepted[gid]:
                cell.metadata["nbgrader"] = copy.deepcopy(nbgrader_meta(rel))
                report.stripped.append(gid)
                seen.add(gid)
                break
    for k, gid in enumerate(rel_order):
        if gid in seen or not is_answer(nbgrader_meta(rel_by_id[gid])):
            continue
        following = next((g for g in rel_order[k + 1:] if g in seen), None)
        at = position(following) if following else None
        if at and not nbgrader_meta(nb.cells[at - 1]) and nb.cells[at - 1].cell_type == rel_by_id[gid].cell_type:
            nb.cells[at - 1].metadata["nbgrader"] = copy.deepcopy(nbgrader_meta(rel_by_id[gid]))
            report.answers_stripped.append(gid)
            seen.add(gid)
        else:
            report.answers_missing.append(gid)

    # 3. restore read-only cells and everybody's nbgrader flags
    for cell in nb.cells:
        gid = nbgrader_meta(cell).get("grade_id")
        if gid is None:
            continue
        rel = rel_by_id[gid]
        rel_meta = nbgrader_meta(rel)
        flags_differ = any(nbgrader_meta(cell).get(k) != rel_meta.get(k) for k in _FLAGS)
        type_differs = cell.cell_type != rel.cell_type
        if is_readonly(rel_meta):
            if (flags_differ or type_differs) and gid not in report.stripped:
                report.metadata_changed.append(gid)
            if _norm(_source(cell)) not in accepted[gid] and gid not in report.stripped:
                report.edited.append(gid)
            elif gid == "setup":
                report.language = accepted[gid].get(_norm(_source(cell)), "en")
            _reset_cell(cell, rel, keep_source=False)
        else:
            if flags_differ and gid not in report.answers_stripped:
                report.answers_metadata_changed.append(gid)
            _reset_cell(cell, rel, keep_source=True)

    # 4. put back deleted read-only cells after the nearest earlier surviving cell
    for k, gid in enumerate(rel_order):
        if position(gid) is not None or not is_readonly(nbgrader_meta(rel_by_id[gid])):
            continue
        report.deleted.append(gid)
        before = [position(g) for g in rel_order[:k]]
        before = [p for p in before if p is not None]
        after = [position(g) for g in rel_order[k + 1:]]
        after = [p for p in after if p is not None]
        index = before[-1] + 1 if before else (after[0] if after else len(nb.cells))
        nb.cells.insert(index, _fresh_copy(rel_by_id[gid]))
    return nb, report


def _reset_cell(cell, rel, keep_source: bool) -> None:
    cell.metadata["nbgrader"] = copy.deepcopy(nbgrader_meta(rel))
    if not keep_source:
        cell.source = rel.source
    if cell.cell_type != rel.cell_type:
        cell.cell_type = rel.cell_type
        if rel.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        else:
            cell.pop("outputs", None)
            cell.pop("execution_count", None)
    for key in ("editable", "deletable"):
        if key in rel.metadata:
            cell.metadata[key] = rel.metadata[key]


def _fresh_copy(rel):
    cell = copy.deepcopy(rel)
    if cell.cell_type == "code":
        cell.outputs, cell.execution_count = [], None
    return cell
