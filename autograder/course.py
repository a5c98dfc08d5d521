"""The course on disk, and nbgrader course directories built from it.

A course root holds ``solutions/ID/ID.ipynb`` (nbgrader source notebooks) and ``notebooks/ID/ID.ipynb`` (the
student release generated from them); a translated course also has ``i18n/LANG/notebooks/ID.po`` (one catalog per
notebook, see ``translation.py``) and the release in that language, ``notebooks-LANG/ID/ID.ipynb``, generated from
the same source notebooks with their translated cells. Grading never runs nbgrader on the repository itself: it
copies the needed assignments into a temporary nbgrader course directory (``build_course_dir``), generates the
release and the gradebook there, and works on copies of that.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import nbgrader_config

SOURCE = nbgrader_config.SOURCE_DIRECTORY
RELEASE = nbgrader_config.RELEASE_DIRECTORY
_IGNORED = shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", "*.pyc", ".DS_Store")


class CourseError(Exception):
    """Bad input the user can fix (a missing directory, an unknown assignment). The CLI prints it and exits 2."""


def repository_root() -> Path:
    """The repository this package lives in (the default course root)."""
    return Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Course:
    root: Path

    @classmethod
    def at(cls, root: str | os.PathLike | None) -> Course:
        """The course at ``root``; by default this repository, or the current directory if only it has
        ``solutions/`` (the package installed elsewhere, run from a clone)."""
        if root is None:
            root = repository_root()
            if not (root / SOURCE).is_dir() and (Path.cwd() / SOURCE).is_dir():
                root = Path.cwd()
        path = Path(root).resolve()
        if not path.is_dir():
            raise CourseError(f"course directory {path} does not exist")
        return cls(path)

    @property
    def solutions(self) -> Path:
        return self.root / SOURCE

    @property
    def notebooks(self) -> Path:
        return self.root / RELEASE

    def assignments(self) -> list[str]:
        """Assignment ids: folders ``solutions/ID`` that hold ``ID.ipynb``."""
        if not self.solutions.is_dir():
            return []
        return sorted(
            d.name for d in self.solutions.iterdir()
            if d.is_dir() and not d.name.startswith((".", "_")) and (d / f"{d.name}.ipynb").is_file()
        )

    def select(self, assignment: str | None) -> list[str]:
        """The assignments a command works on: ``[assignment]`` after checking it exists, or all of them."""
        known = self.assignments()
        if not known:
            raise CourseError(f"no assignments in {self.solutions} (expected {SOURCE}/ID/ID.ipynb)")
        if assignment is None:
            return known
        if assignment not in known:
            raise CourseError(f"unknown assignment '{assignment}': the course has {', '.join(known)}")
        return [assignment]

    def source_notebook(self, assignment: str) -> Path:
        return self.solutions / assignment / f"{assignment}.ipynb"

    def languages(self) -> list[str]:
        """``"en"`` and each language the course has notebook catalogs for (``i18n/LANG/notebooks/``)."""
        i18n = self.root / "i18n"
        found = sorted(d.name for d in i18n.iterdir() if (d / "notebooks").is_dir()) if i18n.is_dir() else []
        return ["en", *found]

    def release_dir(self, lang: str = "en") -> Path:
        """Where the release in ``lang`` lives: ``notebooks/`` in English, ``notebooks-LANG/`` in a translation."""
        return self.root / release_directory(lang)


def release_directory(lang: str) -> str:
    return RELEASE if lang == "en" else f"{RELEASE}-{lang}"


# ---------------------------------------------------------------------------------------------------------------
# nbgrader


def _alembic_head() -> str:
    """The gradebook schema revision, computed in-process.

    nbgrader asks for it through an ``alembic`` subprocess every time it creates a gradebook, which costs several
    seconds here (the subprocess imports nbgrader again). The answer is a constant of the installed nbgrader; this
    reads it from the same migration scripts without the subprocess.
    """
    import nbgrader
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", os.path.join(os.path.dirname(nbgrader.__file__), "alembic"))
    return ScriptDirectory.from_config(cfg).get_current_head()


_SCRATCH_ROOTS: list[str] = []


def scratch_databases(root: str | os.PathLike) -> None:
    """Make nbgrader's SQLite gradebooks below ``root`` (temporary course directories) skip fsync and keep their
    journal in memory: nbgrader commits after nearly every row it writes, and on a busy disk those flushes add up
    (several per cell, in the template and in every grading process). Gradebooks elsewhere, such as the merged
    ``gradebook.db`` of ``grade --out``, keep SQLite's defaults."""
    root = os.path.realpath(root)
    if root in _SCRATCH_ROOTS:
        return
    _SCRATCH_ROOTS.append(root)
    if len(_SCRATCH_ROOTS) > 1:
        return
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    @event.listens_for(Engine, "connect")
    def _scratch_pragmas(dbapi_connection, _record):
        try:
            cursor = dbapi_connection.cursor()
            rows = cursor.execute("PRAGMA database_list").fetchall()
            path = os.path.realpath(rows[0][2]) if rows and rows[0][2] else ""
            if path and any(path.startswith(r + os.sep) for r in _SCRATCH_ROOTS):
                cursor.execute("PRAGMA synchronous=OFF")
                cursor.execute("PRAGMA journal_mode=MEMORY")
            cursor.close()
        except Exception:  # not SQLite, or an older driver: leave the defaults
            pass


def nbgrader_api(root: str | os.PathLike, *, cell_timeout: float = nbgrader_config.CELL_TIMEOUT, **config):
    """An ``NbGraderAPI`` for the nbgrader course directory at ``root`` configured by ``nbgrader_config``."""
    import nbgrader.api
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    if getattr(nbgrader.api.get_alembic_version, "__module__", "") != __name__:
        original = nbgrader.api.get_alembic_version

        def get_alembic_version() -> str:
            try:
                return _alembic_head()
            except Exception:  # an unexpected alembic layout: fall back to nbgrader's own way
                return original()

        get_alembic_version.__module__ = __name__
        nbgrader.api.get_alembic_version = get_alembic_version

    cfg = nbgrader_config.make_config(str(root), cell_timeout=cell_timeout)
    for dotted, value in config.items():  # e.g. Autograde__autograde_preprocessors=[...]
        section, name = dotted.split("__")
        setattr(getattr(cfg, section), name, value)
    coursedir = CourseDirectory(config=cfg)
    return NbGraderAPI(coursedir=coursedir, config=cfg)


def _last_error_line(result: dict) -> str:
    text = (result.get("error") or "") + "\n" + (result.get("log") or "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "Exception" in ln]
    return (errors or lines or ["unknown error"])[-1]


def build_course_dir(course: Course, assignments: list[str], dest: Path, lang: str = "en") -> Path:
    """An nbgrader course directory at ``dest`` with the release and gradebook of ``assignments``, in ``lang``:
    a translation's source notebooks are the English ones with their translated cells (``translation.py``), and
    its answer cells get that language's stub.

    The release notebooks there are normalised exactly as ``release`` writes them (see ``normalise_release``).
    """
    dest.mkdir(parents=True, exist_ok=True)
    for aid in assignments:
        shutil.copytree(course.solutions / aid, dest / SOURCE / aid, ignore=_IGNORED)
        if lang != "en":
            from .translation import translated_source

            source = dest / SOURCE / aid / f"{aid}.ipynb"
            source.write_bytes(dumps_notebook(translated_source(course, aid, lang)))
    api = nbgrader_api(dest, **nbgrader_config.stub_config(lang))
    for aid in assignments:
        result = api.generate_assignment(aid, force=True, create=True)
        if not result.get("success"):
            raise CourseError(f"nbgrader could not generate the release of {aid}: {_last_error_line(result)}")
        released = dest / RELEASE / aid / f"{aid}.ipynb"
        released.write_bytes(normalise_release(released, dest / SOURCE / aid / f"{aid}.ipynb"))
    return dest


def normalise_release(released: Path, source: Path) -> bytes:
    """The bytes of a release notebook as committed: no outputs, no execution counts, stable cell ids, stable JSON.

    nbgrader already clears outputs; this makes sure of it and fixes the serialisation so that the same source
    always gives the same file.
    """
    nb = json.loads(released.read_text(encoding="utf-8"))
    src_cells = json.loads(source.read_text(encoding="utf-8")).get("cells", [])
    uses_ids = (nb.get("nbformat", 4), nb.get("nbformat_minor", 0)) >= (4, 5)
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        cell.get("metadata", {}).pop("execution", None)
        if uses_ids:
            src_id = src_cells[i].get("id") if i < len(src_cells) else None
            cell["id"] = src_id or hashlib.sha1(f"{source.stem}:{i}".encode()).hexdigest()[:12]
        else:
            cell.pop("id", None)
    return dumps_notebook(nb)


def dumps_notebook(nb: dict) -> bytes:
    """Jupyter's own on-disk layout (one-space indent, sorted keys, multi-line strings as lists)."""

    def split(text):
        return text.splitlines(keepends=True) if isinstance(text, str) else text

    for cell in nb.get("cells", []):
        cell["source"] = split(cell.get("source", ""))
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = split(out["text"])
    return (json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False, separators=(",", ": ")) + "\n").encode()


def release(course: Course, assignments: list[str], out: Path | None = None, progress=None, lang: str = "en",
            done: int = 0) -> list[Path]:
    """Regenerate ``notebooks/ID`` (``notebooks-LANG/ID`` for a translation, or ``out/ID``) from ``solutions/ID``
    for each assignment; returns the notebooks. ``done``: steps ``progress`` has already counted.

    Each target folder is replaced by nbgrader's release folder (the notebook plus any other files of the source
    folder), so a file removed from ``solutions/ID`` also disappears from the release.
    """
    target_root = Path(out) if out is not None else course.release_dir(lang)
    written = []
    with tempfile.TemporaryDirectory(prefix="autograder-release-") as tmp:
        for i, aid in enumerate(assignments):
            built = build_course_dir(course, [aid], Path(tmp) / aid, lang)
            target = target_root / aid
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(built / RELEASE / aid, target, ignore=_IGNORED)
            for path in target.rglob("*"):
                if path.is_file():
                    os.chmod(path, 0o644)
            written.append(target / f"{aid}.ipynb")
            if progress is not None:
                progress.update(done + i + 1, aid if lang == "en" else f"{aid} ({lang})")
    return written
