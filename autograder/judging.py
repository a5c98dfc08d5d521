"""The judge's side of ``autograder.judge`` (read its docstring first): what runs in the judge process.

``serve`` is the judge forked from the grading run's shared fork server, ``main`` the judge started as
``python -m autograder.judging``; both read the submission from the grader, run ``judge`` and report to the grader
only.
"""

from __future__ import annotations

import ast
import json
import linecache
import os
import sys
import time

from .definitions import definitions
from .stand_ins import STUDENT_FILE, _Guard, _stand_in


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


def _follow_grader(alive) -> None:
    """Like ``_follow_parent`` for a judge forked from the shared server: ``alive`` is the read end of a pipe whose
    only write end the grading process holds, so it ends (EOF) when that process is gone, however it went."""
    import signal
    import threading

    def watch():
        try:
            alive.recv_bytes()
        except (EOFError, OSError):
            pass
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="judge-follows-grader").start()


def _shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance(colors="NoColor")
    shell.enable_gui = lambda gui=None: None   # %matplotlib inline without a kernel: nothing to hook
    return shell


def _labsupport():
    try:
        import labsupport
    except ImportError:
        return None
    return labsupport


def judge(shell, spec: dict, labsupport) -> dict:
    """Run the set-up, the student's definitions and the hidden tests (see the module docstring); the report."""
    started = time.monotonic()
    report = {"tests": {}, "skipped": [], "setup_errors": [], "seconds": 0.0}
    if labsupport is not None and spec.get("language", "en") != "en":
        from labsupport.i18n import use_language

        use_language(spec["language"])   # the messages of the hidden tests, in the submission's language

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
    return report


def serve(spec_in, report_out, alive, cwd: str, env: dict, log_path: str) -> None:
    """A judge forked from the shared fork server (see ``Judge``): the same as ``main`` with pipes for stdin and
    stdout. Everything the server's process held that is this judge's alone is set first: its session, its
    output, its folder, its environment."""
    import tempfile

    from multiprocessing import forkserver

    os.setsid()
    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:  # the requester's hold on the server: not the judge's to keep
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    _follow_grader(alive)
    shell = _shell()
    labsupport = _labsupport()
    try:
        spec = json.loads(spec_in.recv_bytes().decode())
        nonce = spec.pop("nonce")
    except (EOFError, OSError, ValueError, KeyError, AttributeError):  # not needed (a spare): nothing to do
        os._exit(3)
    spec_in.close()
    report = judge(shell, spec, labsupport)
    report_out.send_bytes((nonce + json.dumps(report) + "\n").encode())
    report_out.close()
    sys.stdout.flush()
    os._exit(0)


def main() -> int:
    """Read a spec from stdin, judge, write ``nonce + JSON`` on the saved stdout (see the module docstring)."""
    _follow_parent()
    report_fd = os.dup(1)
    os.dup2(2, 1)                                   # anything printed from here on goes to the log
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    labsupport = _labsupport()  # starts its fork server early (LABSUPPORT_EARLY_START=1) unless one is shared
    shell = _shell()
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
    report = judge(shell, spec, labsupport)
    os.write(report_fd, (nonce + json.dumps(report) + "\n").encode())
    os.close(report_fd)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
