"""The judge: hidden tests run where the submission's top-level code never ran.

The kernel runs a submission top to bottom (for the feedback page), so anything an answer cell does at top level
(patch a check, hook IPython, rebind ``torch.distributed``) happens in the process that runs the hidden tests there.
The points therefore come from here instead:

* The grader starts ``python -m autograder.judge`` itself (the kernel never learns of it) and writes, on the
  judge's stdin, the instructor's set-up cells and hidden-test cells (from ``solutions/``), the submission's
  student-written cells (read by the grader from the notebook file before any kernel started) and a nonce.
* The judge runs the set-up cells in a plain IPython shell, then only the *definitions* of the student's cells:
  imports, ``def``, ``class`` and assignments of simple values. Everything that would run at definition time is
  restricted (``definitions``): decorators, default values, annotations, class bodies and assigned values may only
  be constants, names, attributes and calls of a few harmless builtins or of imported library modules; other
  statements are skipped and reported.
* Every function the student defined is replaced by a stand-in that, called in the judge's own process, runs the
  call on a one-rank ``labsupport`` worker and brings back plain data only (no object of the student's classes,
  whose methods would run here); inside a worker it calls the function directly. So a check's own code, in this
  process, never executes a line the student wrote.
* It runs each exercise's hidden-test cell from ``solutions/`` and reports per test passed/failed with the message,
  as one line ``nonce + JSON`` on a copy of its original stdout; while student code may run, fd 1 and 2 go to a
  log, and the nonce lives only in this process's memory.

The grader compares the judge's verdicts with the kernel's and flags a submission where they differ.
"""

from __future__ import annotations

import ast
import json
import linecache
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from .definitions import BLOCKED_IMPORTS, SAFE_BUILTINS, SAFE_MODULES, definitions  # noqa: F401
from .stand_ins import STUDENT_FILE, _Guard, _stand_in


# ---------------------------------------------------------------------------------------------------------------
# the grader's side: start a judge, give it a submission, read its verdicts


def judge_env(course_root: str | os.PathLike) -> dict:
    from .execute import kernel_env

    env = kernel_env([course_root])
    env["LABSUPPORT_EARLY_START"] = "1"   # its fork server imports torch while the kernel runs
    env["LABSUPPORT_PRELOAD_DYNAMO"] = "1"  # and torch._dynamo, which every worker building an optimizer needs
    env["MPLBACKEND"] = "Agg"
    env.pop("JPY_PARENT_PID", None)
    return env


_SHORT_TMP = "/tmp" if os.path.isdir("/tmp") else None


def judge_tmp() -> str | None:
    return os.environ.get("TMPDIR") or _SHORT_TMP


def remove_leftovers(tag: str) -> None:
    """Remove the folders of this grading run's judges that a killed grading process could not remove."""
    import glob
    import shutil

    base = judge_tmp()
    import tempfile

    for path in glob.glob(os.path.join(base or tempfile.gettempdir(), f"judge-{tag}-*")):
        shutil.rmtree(path, ignore_errors=True)


class Judge:
    """One judge process, started ahead of time (it imports IPython and starts labsupport's fork server while it
    waits for a submission). ``start`` gives it the submission, ``result`` waits for its verdicts."""

    def __init__(self, course_root: str, log_dir: Path, tag: str = ""):
        import tempfile

        # not below the grader's own (deep) temporary directory: sockets made in it need a short path; the grading
        # run removes what a killed grading process leaves (``remove_leftovers``)
        self.cwd = Path(tempfile.mkdtemp(prefix=f"judge-{tag}-", dir=judge_tmp()))
        self.log_path = Path(log_dir) / f"judge-{os.getpid()}-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "wb")
        self.nonce = secrets.token_hex(16)
        env = judge_env(course_root)
        (self.cwd / "t").mkdir()
        env["TMPDIR"] = str(self.cwd / "t")  # its temporary files go when it is closed, even after a SIGKILL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "autograder.judge"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, cwd=self.cwd, env=env, start_new_session=True)
        self.started = None
        self.spec_sent: dict = {}

    def start(self, spec: dict) -> None:
        import shutil

        for name in spec.pop("files", []):  # the assignment's other files (data), from the release
            src = Path(name)
            if src.is_file():
                shutil.copyfile(src, self.cwd / src.name)
        self.spec_sent = dict(spec)
        spec = dict(spec, nonce=self.nonce)
        self.started = time.monotonic()
        try:
            self.proc.stdin.write(json.dumps(spec).encode())
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.stdin = None  # closed: communicate() must not flush it

    def result(self, timeout: float) -> dict:
        """The judge's report: {"tests": {grade_id: {"passed", "message"}}, "skipped": [...], ...}, or
        {"error": why} when it did not report in time or its report is not valid."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return {"error": f"the judge did not finish within {timeout:g} s"}
        finally:
            self.close()
        for line in out.decode(errors="replace").splitlines():
            if line.startswith(self.nonce):
                try:
                    return json.loads(line[len(self.nonce):])
                except ValueError:
                    break
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-3:] if self.log_path.exists() else []
        return {"error": f"the judge gave no report (exit status {self.proc.returncode}"
                         + (f"; its log ends: {' | '.join(tail)[:300]}" if tail else "") + ")"}

    def kill(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

    def close(self) -> None:
        import shutil

        if self.proc.poll() is None:
            self.kill()
        try:
            self.log.close()
        except OSError:
            pass
        shutil.rmtree(self.cwd, ignore_errors=True)


def judge_spec(repaired, source_nb, release_nb, cell_timeout: float) -> dict:
    """What the judge needs for one submission (see the module docstring)."""
    from .execute import nbgrader_meta
    from .feedback import source_text
    setup, tests = [], []
    for cell in source_nb.cells:
        meta = nbgrader_meta(cell)
        if cell.cell_type != "code" or not meta:
            continue
        gid = meta.get("grade_id", "")
        if meta.get("grade"):
            tests.append({"grade_id": gid, "source": source_text(cell)})
        elif meta.get("locked") and not meta.get("solution") and not gid.startswith("test_"):
            setup.append(source_text(cell))
    student = []  # every code cell a student could write or change, in order (unchanged helpers included)
    for i, cell in enumerate(repaired.cells):
        meta = nbgrader_meta(cell)
        if cell.cell_type != "code" or meta.get("grade") or (meta.get("locked") and not meta.get("solution")):
            continue
        student.append({"label": meta.get("grade_id") or f"cell {i + 1}", "source": source_text(cell)})
    return {"setup": setup, "student": student, "tests": tests, "timeout": cell_timeout}


def verdicts_to_points(report: dict, max_points: dict[str, float]) -> dict[str, tuple[float, str | None]]:
    """grade_id -> (points, message or None) from a judge report; a test it did not report gets no points."""
    tests = report.get("tests") or {}
    out = {}
    for gid, full in max_points.items():
        verdict = tests.get(gid)
        if verdict is None:
            out[gid] = (0.0, f"not judged: {report.get('error') or 'no verdict'}")
        elif verdict.get("passed"):
            out[gid] = (full, None)
        else:
            out[gid] = (0.0, verdict.get("message") or "failed")
    return out


# ---------------------------------------------------------------------------------------------------------------
# the judge's side


def _message(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _follow_parent() -> None:
    """End this judge, its fork server and its workers (its own process group) when the grading process that
    started it is gone (killed by a submission, or interrupted)."""
    import signal
    import threading

    parent = os.getppid()

    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="judge-follows-parent").start()


def main() -> int:
    """Read a spec from stdin, judge, write ``nonce + JSON`` on the saved stdout (see the module docstring)."""
    _follow_parent()
    report_fd = os.dup(1)
    os.dup2(2, 1)                                   # anything printed from here on goes to the log
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    from IPython.core.interactiveshell import InteractiveShell

    try:
        import labsupport  # noqa: F401  (starts its fork server early: LABSUPPORT_EARLY_START=1)
    except ImportError:
        labsupport = None
    shell = InteractiveShell.instance(colors="NoColor")
    shell.enable_gui = lambda gui=None: None   # %matplotlib inline without a kernel: nothing to hook
    try:
        import torch  # noqa: F401  (while waiting for the submission)
    except ImportError:
        pass
    try:
        spec = json.loads(sys.stdin.buffer.read().decode())
        nonce = spec.pop("nonce")
    except (ValueError, KeyError, AttributeError):  # the grader closed the pipe: this spare is not needed
        if labsupport is not None:
            labsupport.shutdown()
        os._exit(3)
    started = time.monotonic()
    report = {"tests": {}, "skipped": [], "setup_errors": [], "seconds": 0.0}

    def run(source: str):
        result = shell.run_cell(source, silent=True, store_history=False)
        return result.error_before_exec or result.error_in_exec

    for source in spec["setup"]:
        err = run(source)
        if err is not None:
            report["setup_errors"].append(_message(err))
    modules: dict[str, str] = {}
    from .screen import _imports, python_source

    for source in spec["setup"]:
        try:
            modules.update(_imports(ast.parse(python_source(source))))
        except (SyntaxError, ValueError):
            pass
    defined: set[str] = set()
    for cell in spec["student"]:
        code, skipped = definitions(cell["source"], modules)
        report["skipped"] += [f"{cell['label']}: {s}" for s in skipped]
        if not code.strip():
            continue
        try:
            tree = ast.parse(code)
            for stmt in tree.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defined.add(stmt.name)
                elif isinstance(stmt, (ast.ClassDef, ast.Assign)):
                    defined.discard(getattr(stmt, "name", None))
            filename = f"{STUDENT_FILE}{cell['label']}>"
            linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
            exec(compile(tree, filename, "exec"), shell.user_ns)  # definitions only (see above)
        except BaseException as exc:  # noqa: BLE001
            report["skipped"].append(f"{cell['label']}: its definitions raised {_message(exc)}")
    if labsupport is not None:
        for name in defined:
            fn = shell.user_ns.get(name)
            if callable(fn) and getattr(fn, "__module__", None) == shell.user_ns.get("__name__"):
                shell.user_ns[name] = _stand_in(fn, float(spec.get("timeout", 60)))
    report["in_process"] = []
    guard = _Guard(report["in_process"])
    for test in spec["tests"]:
        sys.settrace(guard)
        try:
            err = run(test["source"])
        finally:
            sys.settrace(None)
        report["tests"][test["grade_id"]] = {"passed": err is None,
                                             "message": None if err is None else _message(err)[:1000]}
    report["seconds"] = round(time.monotonic() - started, 2)
    try:
        if labsupport is not None:
            labsupport.shutdown()
    except Exception:
        pass
    os.write(report_fd, (nonce + json.dumps(report) + "\n").encode())
    os.close(report_fd)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
