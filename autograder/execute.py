"""Running notebooks safely: bounded output, per-cell timeouts, and a record of what went wrong where.

Used twice: by the grader (``guarded_execute_class()`` replaces nbgrader's ``Execute`` preprocessor) and by
``python -m autograder check`` (``run_notebook``). Both keep at most ``MAX_OUTPUT_LINES`` lines of stream output per
cell while the cell runs, so a cell that prints 100k lines costs neither memory nor feedback space, and both note
which cell was running when the kernel died or stopped answering, so the reason given to a person names the cell.
"""

from __future__ import annotations

import ast
import atexit
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from labsupport.i18n import LANGUAGES

from . import nbgrader_config

MAX_OUTPUT_LINES = nbgrader_config.MAX_OUTPUT_LINES
MAX_OUTPUT_CHARS = 200_000
MAX_OUTPUTS_PER_CELL = 100
TRUNCATED_NOTE = "\n... output truncated by the grader (more than {} lines) ...\n"
TIMEOUT_ENAME = "CellTimeoutError"


def nbgrader_meta(cell) -> dict:
    return (cell.get("metadata") or {}).get("nbgrader") or {}


def cell_label(cell, index: int) -> str:
    """How to name a cell to a person: its grade_id, else its position and first line."""
    gid = nbgrader_meta(cell).get("grade_id")
    if gid:
        return f"`{gid}`"
    source = cell.get("source", "")
    if isinstance(source, list):
        source = "".join(source)
    first = next((ln.strip() for ln in source.splitlines() if ln.strip()), "")
    if len(first) > 40:
        first = first[:37] + "..."
    return f"cell {index + 1} ({first!r})" if first else f"cell {index + 1}"


@dataclass
class RunRecord:
    """What happened while a notebook ran (one per notebook run)."""

    running: str | None = None              # label of the cell being executed
    timed_out: list[str] = field(default_factory=list)   # cells interrupted after the time limit
    truncated: list[str] = field(default_factory=list)   # cells whose output was cut
    failure: str | None = None              # "dead_kernel" or "unresponsive": the run was abandoned
    failure_cell: str | None = None
    ran_cells: int = 0                      # cells whose execution was started
    started: float = field(default_factory=time.monotonic)


#: The record of the notebook being executed in this process (a grader process runs one notebook at a time).
CURRENT = RunRecord()


def reset_record() -> RunRecord:
    """Start a new record (the same object, reset, so that ``from .execute import CURRENT`` stays valid)."""
    CURRENT.__init__()
    return CURRENT


#: Seconds to wait, after a cell's reply, for the rest of its output. nbclient's 4 s default is too short on a
#: busy machine for a cell that printed a lot (its messages are still queued), and then the whole notebook fails;
#: after an interrupt that we sent, 4 s stays the limit (a kernel that ignores it is not coming back).
IOPUB_TIMEOUT = 30
IOPUB_TIMEOUT_AFTER_INTERRUPT = 4


class _BoundedOutput:
    """Mixin for an nbclient ``NotebookClient``: cut stream output per cell while it arrives, and wait patiently
    for the output of a cell that finished (see ``IOPUB_TIMEOUT``)."""

    async def _async_handle_timeout(self, timeout, cell=None):
        self.iopub_timeout = IOPUB_TIMEOUT_AFTER_INTERRUPT
        return await super()._async_handle_timeout(timeout, cell)

    def output(self, outs, msg, display_id, cell_index):
        budget = self.__dict__.setdefault("_output_budget", {})
        used = budget.setdefault(cell_index, {"lines": 0, "chars": 0, "cut": False})
        if msg.get("msg_type") == "stream":
            if used["cut"]:
                return None
            text = msg["content"].get("text", "")
            lines_left = MAX_OUTPUT_LINES - used["lines"]
            chars_left = MAX_OUTPUT_CHARS - used["chars"]
            n_lines = text.count("\n")
            if n_lines > lines_left or len(text) > chars_left:
                kept = "".join(text.splitlines(keepends=True)[:max(lines_left, 0)])[:max(chars_left, 0)]
                text = kept + TRUNCATED_NOTE.format(MAX_OUTPUT_LINES)
                used["cut"] = True
                label = cell_label(self.nb.cells[cell_index], cell_index)
                if label not in CURRENT.truncated:
                    CURRENT.truncated.append(label)
                msg = {**msg, "content": {**msg["content"], "text": text}}
            used["lines"] += n_lines
            used["chars"] += len(text)
        elif len(outs) >= MAX_OUTPUTS_PER_CELL:
            return None
        return super().output(outs, msg, display_id, cell_index)


def _note_outcome(cell, label: str) -> None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error" and out.get("ename") == TIMEOUT_ENAME and label not in CURRENT.timed_out:
            CURRENT.timed_out.append(label)


def _note_failure(exc: BaseException, label: str) -> None:
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    if isinstance(exc, DeadKernelError):
        CURRENT.failure, CURRENT.failure_cell = "dead_kernel", label
    elif isinstance(exc, CellTimeoutError):
        # nbclient interrupted the kernel after the cell's time limit and the kernel never came back
        CURRENT.failure, CURRENT.failure_cell = "unresponsive", label


def timeout_error(seconds: float) -> dict:
    """The error output a cell gets when it is interrupted after ``seconds``."""
    return {
        "ename": TIMEOUT_ENAME,
        "evalue": f"the cell was still running after {seconds:g} s and was interrupted",
        "traceback": [f"{TIMEOUT_ENAME}: the cell was still running after {seconds:g} s and was interrupted"],
    }


_GUARDED = None


def guarded_execute_class():
    """nbgrader's ``Execute`` preprocessor with bounded output and a ``RunRecord`` (built on first use)."""
    global _GUARDED
    if _GUARDED is None:
        from nbgrader.preprocessors import Execute

        class GuardedExecute(_BoundedOutput, Execute):
            def preprocess(self, nb, resources=None, km=None):
                self.error_on_timeout = timeout_error(self.timeout)
                return super().preprocess(nb, resources, km=km)

            def preprocess_cell(self, cell, resources, index):
                label = cell_label(cell, index)
                CURRENT.running = label
                CURRENT.ran_cells += 1
                self.iopub_timeout = IOPUB_TIMEOUT
                try:
                    cell, resources = super().preprocess_cell(cell, resources, index)
                except BaseException as exc:
                    _note_failure(exc, label)
                    raise
                _note_outcome(cell, label)
                CURRENT.running = None
                return cell, resources

        _GUARDED = GuardedExecute
    return _GUARDED


_LAUNCHER_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
                       "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID",
                       "SLURM_NTASKS_PER_NODE"}


#: What ``labsupport.use_language`` sets: the language of the course's messages in a process and those it starts.
LANGUAGE_ENV = "LABSUPPORT_LANG"
_USE_LANGUAGE = re.compile(r"""^[ \t]*(?:labsupport\.(?:i18n\.)?)?use_language\(\s*["'](\w+)["']\s*\)""", re.M)


def notebook_language(nb) -> str:
    """The language a notebook switches the course's messages to (a Chinese notebook's set-up cell calls
    ``labsupport.use_language("zh")``): the first such call of its code cells, else ``"en"``."""
    for cell in nb.cells:
        if cell.get("cell_type") == "code":
            found = _USE_LANGUAGE.search(cell.get("source", ""))
            if found and found.group(1) in LANGUAGES:
                return found.group(1)
    return "en"


@contextmanager
def speaking(lang: str):
    """The course's messages in ``lang`` in this process and the kernels and processes it starts, meanwhile."""
    saved = os.environ.get(LANGUAGE_ENV)
    os.environ[LANGUAGE_ENV] = lang
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(LANGUAGE_ENV, None)
        else:
            os.environ[LANGUAGE_ENV] = saved


def kernel_env(extra_paths=()) -> dict:
    """Environment of a grading/checking kernel: ``LABSUPPORT_GRADING=1`` and the course packages importable."""
    env = dict(os.environ)
    # graded as on a workstation even inside a SLURM job (an array task of `grade --shard`) or under torchrun:
    # labsupport would otherwise take the kernel for a rank of that launch
    for key in list(env):
        if key in _LAUNCHER_VARIABLES or key.startswith("TORCHELASTIC_"):
            del env[key]
    env["LABSUPPORT_GRADING"] = "1"
    env.pop("LABSUPPORT_TEST_GRADER_IN_SANDBOX", None)  # the test suite's own; never in a kernel or a judge
    # grading runs on gloo on the CPU: no GPU is visible to its kernels, judges and their workers, so that backend
    # "auto" never hands a rank a GPU (a notebook's CPU tensors would be refused under NCCL) and no process of the
    # run holds a CUDA context on a grading machine's GPUs
    env["CUDA_VISIBLE_DEVICES"] = ""
    paths = [str(p) for p in extra_paths] + [str(Path(__file__).resolve().parent.parent)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def run_notebook(nb, cwd: Path, timeout: float, env: dict | None = None, progress=None):
    """Execute ``nb`` in place in a fresh kernel (``cwd`` as working directory); returns the ``RunRecord``.

    Errors in cells do not stop the run; a cell past ``timeout`` seconds is interrupted and the run goes on. The
    run stops early only when the kernel dies or ignores the interrupt (``record.failure`` says which).
    """
    from nbclient import NotebookClient

    class _Client(_BoundedOutput, NotebookClient):
        async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
            label = cell_label(cell, cell_index)
            CURRENT.running = label
            self.iopub_timeout = IOPUB_TIMEOUT
            if progress is not None:
                progress.update(cell_index, label)
            try:
                cell = await super().async_execute_cell(cell, cell_index, execution_count, store_history)
            except BaseException as exc:
                _note_failure(exc, label)
                raise
            _note_outcome(cell, label)
            CURRENT.running = None
            return cell

    record = reset_record()
    # The Python of this command, whatever kernel the notebook was last saved with (a student's own kernel name
    # may not exist here); jupyter_client maps "python3" to the running interpreter.
    kernel = "python3"
    started = []   # cells that began to run: a failure before the first is the kernel's start

    class _Counting(_Client):
        async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
            started.append(cell_index)
            return await super().async_execute_cell(cell, cell_index, execution_count, store_history)

    for attempt in (1, 2):
        client = _Counting(
            nb, timeout=int(timeout), allow_errors=True, interrupt_on_timeout=True,
            error_on_timeout=timeout_error(timeout), kernel_name=kernel, startup_timeout=120,
            extra_arguments=["--IPKernelApp.log_level=ERROR"],
            resources={"metadata": {"path": str(cwd)}},
        )
        try:
            client.execute(env=env if env is not None else kernel_env())
        except Exception as exc:
            if not started and attempt == 1:   # e.g. a port taken by another process between choosing and binding
                continue
            if record.failure is None:
                record.failure, record.failure_cell = "error", f"{type(exc).__name__}: {exc}"
        finally:
            atexit.unregister(client._cleanup_kernel)   # nbclient's own exit hook, left behind by a failed start
            _remove_kernel_leftovers(env)
        break
    return record


def _remove_kernel_leftovers(env: dict | None) -> None:
    """A kernel normally removes the folder its workers used as it shuts down; one that was killed (a time-out, a
    crash, a cell that ignored the interrupt) could not: its folder goes now."""
    import tempfile

    from labsupport._pool import remove_stale_dirs

    base = (env or {}).get("TMPDIR") or os.environ.get("TMPDIR") or tempfile.gettempdir()
    remove_stale_dirs(base)


def has_visible_code(source: str) -> bool:
    """Whether a test cell runs anything beyond its docstring (a hidden-test cell in a student's copy may not)."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return True
    return any(not (isinstance(s, ast.Expr) and isinstance(getattr(s, "value", None), ast.Constant)) for s in body)
