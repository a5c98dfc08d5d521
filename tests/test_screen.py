"""The static screen (autograder/screen/) flags what honest answers never need, and no honest answer.

No kernels: every solution cell of every notebook in solutions/, and every correct alternative of the checks'
mutation tests (tests/test_*_checks.py), must come out without a flag; each kind of cheat must be flagged.
"""

import ast
import re
import sys
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import demo_submissions as demo  # noqa: E402

from autograder.screen import _imports, python_source, screen_notebook, screen_source  # noqa: E402

REPO = demo.REPO
SOLUTIONS = sorted((REPO / "solutions").glob("*/*.ipynb"))
CHECK_TESTS = sorted((REPO / "tests").glob("test_*_checks.py"))
SETUP_MODULES = {"torch": "torch", "dist": "torch.distributed", "labsupport": "labsupport", "os": "os",
                 "time": "time"}


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_no_solution_cell_is_flagged(path):
    nb = nbformat.read(path, as_version=4)
    answers = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")]
    assert answers, path
    empty_release = nbformat.v4.new_notebook()
    empty_release.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("locked")]
    flags = screen_notebook(nb, empty_release)   # every answer cell and every instructor cell counts as written
    answer_ids = {c.metadata["nbgrader"]["grade_id"] for c in answers}
    answer_flags = [str(f) for f in flags if f.cell in answer_ids]
    assert not answer_flags, answer_flags


def _correct_alternatives(path: Path) -> dict[str, str]:
    """name -> source of each module-level def/class the file's "correct" tests use (with the helpers they call)."""
    source = path.read_text()
    tree = ast.parse(source)
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    lists = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Name)}
    wanted, queue = set(), []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and \
                re.search(r"correct|alternative|accept", node.name):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name):
                    queue.append(sub.id)
    while queue:
        name = queue.pop()
        if name in wanted:
            continue
        if name in lists:
            wanted.add(name)
            queue += [s.id for s in ast.walk(lists[name]) if isinstance(s, ast.Name)]
        elif name in defs and not name.startswith("test_"):
            wanted.add(name)
            queue += [s.id for s in ast.walk(defs[name]) if isinstance(s, ast.Name)]
    return {n: ast.get_source_segment(source, defs[n]) for n in sorted(wanted) if n in defs}


@pytest.mark.parametrize("path", CHECK_TESTS, ids=[p.stem for p in CHECK_TESTS])
def test_no_correct_alternative_is_flagged(path):
    alternatives = _correct_alternatives(path)
    assert alternatives, f"found no correct alternative in {path.name}"
    modules = dict(SETUP_MODULES)
    modules.update(_imports(ast.parse(path.read_text())))
    flagged = {}
    for name, code in alternatives.items():
        if name.startswith("_") or name.isupper():
            continue  # the test's own helpers and tables are not answers
        graders = {n for n, p in modules.items() if p.split(".")[0] == "autograder"}
        if "autograder" in code or graders & {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)}:
            continue  # built on the checks' reference code: not something a student could hand in
        reasons = screen_source(code, modules)
        if reasons:
            flagged[name] = reasons
    assert not flagged, flagged


# ---------------------------------------------------------------------------------------------------------------
# each kind of cheat is flagged

MODULES = {"torch": "torch", "dist": "torch.distributed", "labsupport": "labsupport"}

CHEATS = {
    "patched check": ("import autograder.checks.collectives as c\nc.check_broadcast = lambda *a, **k: None",
                      "imports the grader"),
    "patched check, from-import": ("from autograder.checks import collectives\ncollectives.check_reduce = print",
                                   "rebinds an attribute of module autograder.checks.collectives"),
    "sys.modules loop": ("import sys\nfor m in list(sys.modules.values()):\n    pass", "uses sys.modules"),
    "sys.modules, aliased": ("import sys as s\nmods = s.modules", "uses sys.modules"),
    "__import__": ("m = __import__('auto' + 'grader')", "calls __import__"),
    "__code__ swap": ("def f():\n    pass\nf.__code__ = (lambda: 1).__code__", "touches __code__"),
    "__globals__": ("def f():\n    return f.__globals__", "touches __globals__"),
    "builtins": ("import builtins\nbuiltins.print = None", "imports builtins"),
    "__builtins__": ("x = __builtins__", "uses __builtins__"),
    "exec": ("exec('x = 1')", "calls exec"),
    "eval": ("y = eval('1')", "calls eval"),
    "compile": ("c = compile('1', 'f', 'eval')", "calls compile"),
    "importlib": ("import importlib\nm = importlib.import_module('os')", "uses importlib"),
    "ctypes": ("import ctypes", "uses ctypes"),
    "gc": ("import gc\nobjs = gc.get_objects()", "uses gc"),
    "inspect": ("import inspect\nframe = inspect.currentframe()", "uses inspect"),
    "frames": ("import sys\nframe = sys._getframe(1).f_globals", "private name"),
    "get_ipython": ("ip = get_ipython()", "uses get_ipython"),
    "magic": ("%load_ext something", "uses get_ipython"),
    "shell escape": ("!rm -rf /", "uses get_ipython"),
    "setattr on a module": ("setattr(dist, 'all_reduce', None)", "setattr"),
    "private name of a process group": ("def f(pg, t):\n    pg._get_backend(t.device).allreduce([t])",
                                        "private name (pg._get_backend)"),
    "rebinding torch.distributed": ("dist.all_reduce = lambda t: None", "rebinds an attribute of module torch"),
    "private backend object": ("def f(t):\n    dist.group.WORLD._get_backend(torch.device('cpu')).allreduce([t])",
                               "private name (dist.group.WORLD._get_backend)"),
    "functional collective": ("from torch.distributed._functional_collectives import all_to_all_single",
                              "private module"),
    "functional collective, attribute": ("def f(x):\n    return torch.distributed._functional_collectives.a(x)",
                                         "private name"),
    "torch._C": ("x = torch._C._distributed_c10d.ProcessGroup", "private name (torch._C"),
    "private labsupport": ("from labsupport import _pool", "private module or name (labsupport._pool)"),
    "captured original": ("f = getattr(dist, 'all_' + 'reduce')", "computed name"),
    "file outside the folder": ("open('/home/x/answers.txt').read()", "outside the notebook's folder"),
    "parent folder": ("open('../../solutions/x.ipynb')", "outside the notebook's folder"),
    "pathlib outside": ("from pathlib import Path\nPath('/etc').read_text()", "outside the notebook's folder"),
    "subprocess": ("import subprocess\nsubprocess.run(['ls'])", "starts processes"),
    "os.system": ("import os\nos.system('ls')", "shell command"),
    "kill the grader": ("import os\nos.kill(os.getppid(), 9)", "sends a signal"),
    "socket": ("import socket\nsocket.socket(socket.AF_UNIX).connect('/tmp/x')", "opens sockets"),
    "globals": ("g = globals()", "uses globals()"),
}


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheat_is_flagged(name):
    source, words = CHEATS[name]
    reasons = screen_source(source, MODULES)
    assert any(words in r for r in reasons), (name, reasons)


@pytest.mark.parametrize("source", [
    "def broadcast(tensor, src):\n    rank = dist.get_rank()\n    if rank == src:\n        dist.send(tensor, 1)\n",
    "class Layer(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n        self._cache = {}\n"
    "    def _shard(self, x):\n        return self._cache.get(x)\n",
    "import math\nfrom collections import defaultdict\nx = math.ceil(3 / 2)",
    "with open('results.txt', 'w') as f:\n    f.write('1')",
    "import os\nrank = int(os.environ.get('RANK', 0))",
    "def f(self):\n    setattr(self, 'x', 1)",
    "def swap(module, name, p):\n    module._parameters[name] = p\n    setattr(module, name, p)",
    "import sys\nprint('x', file=sys.stderr)",
])
def test_honest_code_is_not_flagged(source):
    assert screen_source(source, MODULES) == []


def test_unchanged_instructor_cells_are_not_screened():
    """A release cell without nbgrader metadata (a measurement) counts only once the student changed it."""
    release = nbformat.v4.new_notebook()
    release.cells = [nbformat.v4.new_code_cell("import gc\ngc.collect()")]
    sub = nbformat.v4.new_notebook()
    sub.cells = [nbformat.v4.new_code_cell("import gc\ngc.collect()"),
                 nbformat.v4.new_code_cell("import gc\ngc.collect()  # mine")]
    flags = screen_notebook(sub, release)
    assert [f.cell for f in flags] == ["cell 2 ('import gc')"], flags


def test_python_source_turns_magics_into_calls():
    assert "get_ipython()" in python_source("%time x = 1")
