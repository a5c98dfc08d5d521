"""The judge: hidden tests run where the submission's top-level code never ran.

The kernel runs a submission top to bottom (for the feedback page), so anything an answer cell does at top level
(patch a check, hook IPython, rebind ``torch.distributed``) happens in the process that runs the hidden tests there.
The points therefore come from here instead:

* The grader starts the judge itself (the kernel never learns of it): forked from the grading run's shared fork
  server, which has torch and IPython imported and never runs a submission's code, or else as
  ``python -m autograder.judging``. On a pipe only the grader holds, it sends the instructor's set-up cells and
  hidden-test cells (from ``solutions/``), the submission's student-written cells (read by the grader from the
  notebook file before any kernel started) and a nonce.
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
  as one line ``nonce + JSON`` on a pipe to the grader (a copy of its original stdout when started as a
  command); while student code may run, fd 1 and 2 go to a log, and the nonce lives only in this process's
  memory.

The grader compares the judge's verdicts with the kernel's and flags a submission where they differ.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

from .definitions import BLOCKED_IMPORTS, SAFE_BUILTINS, SAFE_MODULES, definitions  # noqa: F401


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

    import tempfile

    for base in {judge_tmp() or tempfile.gettempdir(), _SHORT_TMP or tempfile.gettempdir()}:
        for path in glob.glob(os.path.join(base, f"judge-{tag}-*")):
            shutil.rmtree(path, ignore_errors=True)


#: what a fork server shared by a grading run imports for the judges forked from it (see ``Judge``)
JUDGE_PRELOAD = ("IPython.core.interactiveshell", "autograder.judging")


def _fork_context():
    """labsupport's multiprocessing context when ``LABSUPPORT_FORK_SERVER`` names a running server, else None."""
    try:
        from labsupport import _forkserver
    except ImportError:
        return None
    if _forkserver._shared_server() is None:
        return None
    return _forkserver._mp_context()


class Judge:
    """One judge process, started ahead of time (it waits for a submission). ``start`` gives it the submission,
    ``result`` waits for its verdicts.

    Where a grading run shares a fork server (``LABSUPPORT_FORK_SERVER``), the judge is forked from it: torch and
    IPython are already imported there, which saves the two seconds of CPU a new Python spends importing them.
    Otherwise it is ``python -m autograder.judging``. Either way it runs in a session of its own, in a folder of its
    own, with its output going to ``log_dir``, and talks to this process only.
    """

    def __init__(self, course_root: str, log_dir: Path, tag: str = ""):
        import tempfile

        # not below the grader's own (deep) temporary directory: sockets made in it need a short path; the grading
        # run removes what a killed grading process leaves (``remove_leftovers``)
        self.cwd = Path(tempfile.mkdtemp(prefix=f"judge-{tag}-", dir=judge_tmp()))
        self.log_path = Path(log_dir) / f"judge-{os.getpid()}-{time.monotonic_ns()}.log"
        self.nonce = secrets.token_hex(16)
        env = judge_env(course_root)
        (self.cwd / "t").mkdir()
        env["TMPDIR"] = str(self.cwd / "t")  # its temporary files go when it is closed, even after a SIGKILL
        self.started = None
        self.spec_sent: dict = {}
        self.proc = self._spec = self._report = self._alive = None
        self.log = None
        self._closed = False
        ctx = _fork_context()
        if ctx is not None:
            try:
                self._fork(ctx, env)
            except Exception:  # the shared server is gone or refused: a judge of the usual kind
                self.proc = None
        if self.proc is None:
            self.log = open(self.log_path, "wb")
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "autograder.judging"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=self.log, cwd=self.cwd, env=env, start_new_session=True)

    @property
    def forked(self) -> bool:
        return self._report is not None

    def _fork(self, ctx, env: dict) -> None:
        from labsupport._forkserver import _NoMainImport

        from .judging import serve

        spec_r, spec_w = ctx.Pipe(duplex=False)
        report_r, report_w = ctx.Pipe(duplex=False)
        alive_r, alive_w = ctx.Pipe(duplex=False)   # the judge's "is my grader still there" (see judging.serve)
        proc = ctx.Process(target=serve, name="judge", args=(spec_r, report_w, alive_r, str(self.cwd), env,
                                                             str(self.log_path)))
        try:
            with _NoMainImport():
                proc.start()
        except BaseException:
            for end in (spec_w, report_r, alive_w):
                end.close()
            raise
        finally:
            for end in (spec_r, report_w, alive_r):
                end.close()
        self.proc, self._spec, self._report, self._alive = proc, spec_w, report_r, alive_w

    def alive(self) -> bool:
        if self._closed:
            return False
        if self.forked:
            return self.proc.is_alive()
        return self.proc.poll() is None

    def exit_status(self):
        return self.proc.exitcode if self.forked else self.proc.returncode

    def start(self, spec: dict) -> None:
        import shutil

        for name in spec.pop("files", []):  # the assignment's other files (data), from the release
            src = Path(name)
            if src.is_file():
                shutil.copyfile(src, self.cwd / src.name)
        self.spec_sent = dict(spec)
        data = json.dumps(dict(spec, nonce=self.nonce)).encode()
        self.started = time.monotonic()
        if self.forked:
            try:
                self._spec.send_bytes(data)
            except OSError:
                pass
            self._spec.close()
            return
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.stdin = None  # closed: communicate() must not flush it

    def _read(self, timeout: float) -> bytes | None:
        """Everything the judge reported (None when it did not finish within ``timeout``)."""
        if not self.forked:
            try:
                out, _ = self.proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                return None
            return out
        try:
            if not self._report.poll(timeout):
                return None
            out = self._report.recv_bytes()
        except (EOFError, OSError):
            out = b""
        self.proc.join(5)
        return out

    def result(self, timeout: float) -> dict:
        """The judge's report: {"tests": {grade_id: {"passed", "message"}}, "skipped": [...], ...}, or
        {"error": why} when it did not report in time or its report is not valid."""
        try:
            out = self._read(timeout)
            if out is None:
                self.kill()
                return {"error": f"the judge did not finish within {timeout:g} s"}
            status = self.exit_status()
        finally:
            self.close()
        for line in out.decode(errors="replace").splitlines():
            if line.startswith(self.nonce):
                try:
                    return json.loads(line[len(self.nonce):])
                except ValueError:
                    break
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-3:] if self.log_path.exists() else []
        return {"error": f"the judge gave no report (exit status {status}"
                         + (f"; its log ends: {' | '.join(tail)[:300]}" if tail else "") + ")"}

    def kill(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.forked:
            self.proc.join(10)
        else:
            self.proc.wait()

    def close(self) -> None:
        import shutil

        if self._closed:
            return
        if self.alive():
            self.kill()
        for handle in (self.log, self._spec, self._report, self._alive):
            try:
                if handle is not None:
                    handle.close()
            except OSError:
                pass
        if self.forked:
            try:
                self.proc.close()  # its pipe from the fork server
            except ValueError:  # still running after SIGKILL and 10 s: left to the garbage collector
                pass
        self._closed = True
        shutil.rmtree(self.cwd, ignore_errors=True)


#: set to 1 by a caller of a grading command whose ``LABSUPPORT_FORK_SERVER`` is a ``SharedServer`` it started
INHERIT_ENV = "AUTOGRADER_INHERIT_FORK_SERVER"


class SharedServer:
    """A fork server for the kernels and judges started by this process and the processes it forks
    (``LABSUPPORT_FORK_SERVER``), in a folder of its own, stopped and removed on exit; judges are forked from it.

    Each kernel and judge would otherwise start a server of its own, which imports torch and torch._dynamo:
    about 3 s of CPU each. The server never runs a submission's code (a worker forked from it gets its task from
    the kernel or the judge that asked for it, and a judge gets its submission from the grader). When it cannot
    start, everyone starts a server of their own, as before. A process that already runs a fork server of its own
    (it used labsupport itself) shares that one and leaves it running.

    A server named by the caller's ``LABSUPPORT_FORK_SERVER`` is not used: the judges are forked from this server,
    which must be one that never ran a submission's code. The one exception is a caller that vouches for its own
    server with ``AUTOGRADER_INHERIT_FORK_SERVER=1`` (``INHERIT_ENV``): a program that started that server with a
    ``SharedServer`` and runs many grading commands (a test suite), each of which would import torch again.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix

    def __enter__(self):
        import tempfile
        from multiprocessing import forkserver

        from labsupport import _forkserver

        self.folder, self.saved = None, os.environ.get(_forkserver.SHARED_SERVER_ENV)
        if self.saved and os.environ.get(INHERIT_ENV) == "1" and _forkserver._shared_server() is not None:
            return self  # the caller's own server, which it vouches for (see above)
        own = forkserver._forkserver
        if own._forkserver_pid is not None and not getattr(own, "_labsupport_shared", False):
            # this process already runs a fork server (it used labsupport itself): share that one and leave it be
            os.environ[_forkserver.SHARED_SERVER_ENV] = f"{own._forkserver_pid}:{own._forkserver_address}"
            return self
        base = judge_tmp() or tempfile.gettempdir()
        if len(os.fsencode(os.path.join(base, self.prefix + "12345678", "listener-12345678"))) >= 104:
            base = _SHORT_TMP or base  # a Unix socket's path must be short
        self.folder = tempfile.mkdtemp(prefix=self.prefix, dir=base)
        self.saved = os.environ.pop(_forkserver.SHARED_SERVER_ENV, None)  # not one inherited from our caller
        # the server's own temporary files (torch's compile cache, whose path the processes forked from it keep)
        # go with its folder
        tmpdir, saved_tmpdir = os.path.join(self.folder, "t"), os.environ.get("TMPDIR")
        os.mkdir(tmpdir)
        os.environ["TMPDIR"] = tmpdir
        try:
            os.environ[_forkserver.SHARED_SERVER_ENV] = _forkserver.start_shared_server(self.folder, JUDGE_PRELOAD)
        except Exception:
            os.environ.pop(_forkserver.SHARED_SERVER_ENV, None)
        finally:
            if saved_tmpdir is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = saved_tmpdir
        return self

    def __exit__(self, *exc):
        import shutil

        from labsupport import _forkserver

        if self.folder is not None:  # a server this started
            _forkserver._stop_forkserver()
            _forkserver._forget_mp_tempdir(self.folder)
            shutil.rmtree(self.folder, ignore_errors=True)
        if self.saved is None:
            os.environ.pop(_forkserver.SHARED_SERVER_ENV, None)
        else:
            os.environ[_forkserver.SHARED_SERVER_ENV] = self.saved


def judge_spec(repaired, source_nb, release_nb, cell_timeout: float, language: str = "en") -> dict:
    """What the judge needs for one submission (see the module docstring); ``language``: the one its messages are
    in (the submission's)."""
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
    return {"setup": setup, "student": student, "tests": tests, "timeout": cell_timeout, "language": language}


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
            out[gid] = (0.0, _skipped_hint(verdict.get("message") or "failed", report.get("skipped") or []))
    return out


def _skipped_hint(message: str, skipped: list[str]) -> str:
    """``message``, led by what the judge skipped when the failure is a name that skipped statement would define."""
    found = re.search(r"name '(\w+)' is not defined", message)
    if not found:
        return message
    name = found.group(1)
    cause = next((s for s in skipped if re.search(rf"\b{re.escape(name)}\b", s)), None)
    if cause is None:
        return message
    label, _, what = cause.partition(": ")
    return (f"{name} is not defined when the grader runs your answers: it skipped {what or label}"
            f"{' in ' + label if what else ''}; answer cells are run as definitions only. {message}")
