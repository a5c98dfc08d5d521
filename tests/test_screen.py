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
    "sys.modules, from-import": ("from sys import modules\nm = modules['torch']", "uses sys.modules on lines 1 and 2"),
    "sys.modules, bound to a name": ("import sys\ndef f():\n    s = sys\n    return s.modules", "uses sys.modules"),
    "sys.modules, after a membership test": ("import sys\nif 'torch' in sys.modules:\n    t = sys.modules['torch']",
                                            "uses sys.modules on line 3"),
    "sys.modules written": ("import sys\nsys.modules['torch.distributed'] = None",
                            "rebinds an attribute of module sys.modules"),
    "import hook": ("import sys\nsys.meta_path.insert(0, object())", "changes how modules are imported"),
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
    "inspect.currentframe": ("import inspect\nframe = inspect.currentframe()",
                             "reads the stack's frames (inspect.currentframe) on line 2"),
    "inspect.stack": ("import inspect\ndef f():\n    return inspect.stack()[1].frame",
                      "reads the stack's frames (inspect.stack)"),
    "inspect.trace": ("import inspect\ndef f():\n    return inspect.trace()",
                      "reads the stack's frames (inspect.trace)"),
    "inspect.getouterframes, from-import": ("from inspect import getouterframes",
                                            "reads the stack's frames (inspect.getouterframes)"),
    "inspect.currentframe, folded": ("import inspect\nf = getattr(inspect, 'current' + 'frame')()",
                                     "reads the stack's frames (inspect.currentframe), written as getattr"),
    "inspect.getgeneratorlocals": ("import inspect\ndef f(g):\n    return inspect.getgeneratorlocals(g)",
                                   "reads the stack's frames (inspect.getgeneratorlocals)"),
    "inspect.getclosurevars": ("import inspect\ndef f(g):\n    return inspect.getclosurevars(g).nonlocals",
                               "closures directly (inspect.getclosurevars)"),
    "inspect.unwrap": ("import inspect\ndef f(g):\n    return inspect.unwrap(g)",
                       "the original function behind a wrapper (inspect.unwrap)"),
    "inspect.getmembers": ("import inspect\nm = inspect.getmembers(dist)", "(inspect.getmembers)"),
    "inspect.getattr_static": ("import inspect\ndef f(e):\n    return inspect.getattr_static(e, 'tb_' + 'frame')",
                               "reads a frame (tb_frame), written as inspect.getattr_static"),
    "frames": ("import sys\nframe = sys._getframe(1).f_globals", "reads the stack's frames (sys._getframe)"),
    "frames, private name": ("import sys\nframe = sys._getframe(1)", "private name (sys._getframe)"),
    "frames of other threads": ("import sys\nframes = sys._current_frames()", "(sys._current_frames)"),
    "get_ipython": ("ip = get_ipython()", "uses get_ipython"),
    "magic": ("%load_ext something", "uses get_ipython"),
    "shell escape": ("!rm -rf /", "uses get_ipython"),
    "setattr on a module": ("setattr(dist, 'all_reduce', None)", "setattr"),
    "private name of a process group": ("def f(pg, t):\n    pg._get_backend(t.device).allreduce([t])",
                                        "private name (pg._get_backend)"),
    "rebinding torch.distributed": ("dist.all_reduce = lambda t: None", "rebinds an attribute of module torch"),
    "rebinding sys": ("import sys\nsys.excepthook = print", "rebinds an attribute of module sys"),
    "private backend object": ("def f(t):\n    dist.group.WORLD._get_backend(torch.device('cpu')).allreduce([t])",
                               "private name (dist.group.WORLD._get_backend)"),
    "functional collective": ("from torch.distributed._functional_collectives import all_to_all_single",
                              "private module"),
    "functional collective, attribute": ("def f(x):\n    return torch.distributed._functional_collectives.a(x)",
                                         "private name"),
    "torch._C": ("x = torch._C._distributed_c10d.ProcessGroup", "private name (torch._C"),
    "torch.ops.c10d": ("def f(t):\n    torch.ops.c10d.allreduce_([t], dist.group.WORLD)",
                       "calls c10d's operators directly, beside torch.distributed (torch.ops.c10d)"),
    "torch.ops.c10d, folded": ("def f(t):\n    getattr(torch.ops, 'c1' + '0d').allreduce_([t])",
                               "(torch.ops.c10d), written as getattr"),
    "torch.ops._c10d_functional": ("def f(t):\n    return torch.ops._c10d_functional.all_reduce(t, 'sum', '0')",
                                   "calls functional collectives' operators (torch.ops._c10d_functional)"),
    "private labsupport": ("from labsupport import _pool", "private module or name (labsupport._pool)"),
    "captured original": ("f = getattr(dist, 'all_' + 'reduce')", "computed name"),
    "file outside the folder": ("open('/home/x/answers.txt').read()", "outside the notebook's folder"),
    "parent folder": ("open('../../solutions/x.ipynb')", "outside the notebook's folder"),
    "torch.save outside": ("def f(t):\n    torch.save(t, '/tmp/answer.pt')",
                           "outside the notebook's folder (torch.save)"),
    "open by keyword": ("x = open(file='/etc/hosts')", "outside the notebook's folder (open)"),
    "pathlib outside": ("from pathlib import Path\nPath('/etc').read_text()", "outside the notebook's folder"),
    "subprocess": ("import subprocess\nsubprocess.run(['ls'])", "starts processes"),
    "os.system": ("import os\nos.system('ls')", "shell command"),
    "kill the grader": ("import os\nos.kill(os.getppid(), 9)", "sends a signal"),
    "socket": ("import socket\nsocket.socket(socket.AF_UNIX).connect('/tmp/x')", "opens sockets"),
    "globals": ("g = globals()", "uses globals()"),
    # what syntax hides: a constant name is screened as the attribute it spells
    "getattr, folded": ("def f(err):\n    return getattr(err, 'tb_' + 'frame').f_locals",
                        "reads a frame (tb_frame), written as getattr(err, 'tb_' + 'frame')"),
    "getattr, f-string": ("def f(err):\n    return getattr(err, f\"{'tb'}_frame\")", "reads a frame (tb_frame)"),
    "getattr, name bound to a constant": ("NAME = 'f_' + 'back'\ndef f(frame):\n    return getattr(frame, NAME)",
                                          "reads a frame (f_back), written as getattr(frame, NAME)"),
    "getattr, loop over constants": ("def f(g):\n    for n in ('gi_frame', 'x'):\n        getattr(g, n)",
                                     "reads a frame (gi_frame)"),
    "getattr, reversed": ("def f(e):\n    return getattr(e, 'emarf_bt'[::-1])", "reads a frame (tb_frame)"),
    "getattr, joined": ("def f(e):\n    return getattr(e, ''.join(['tb', '_frame']))", "reads a frame (tb_frame)"),
    "getattr, format": ("def f(e):\n    return getattr(e, '{}_{}'.format('tb', 'frame'))", "reads a frame"),
    "getattr, private": ("def f(pg, t):\n    getattr(pg, '_get_' + 'backend')(t.device).allreduce([t])",
                         "uses a private name (pg._get_backend), written as getattr"),
    "hasattr, private": ("def f(pg):\n    return hasattr(pg, '_get_backend')", "uses a private name (pg._get_backend)"),
    "setattr, code": ("def f(fn, g):\n    setattr(fn, '__co' + 'de__', g.__code__)",
                      "touches __code__, written as setattr"),
    "delattr, wrapped": ("def f(fn):\n    delattr(fn, '__wrapped__')", "touches __wrapped__"),
    "vars()[...]": ("def f(x):\n    return vars(x)['__wrapped__']", "wrapper), written as vars(x)['__wrapped__']"),
    "__dict__[...]": ("def f(e):\n    return e.__dict__['tb_frame']",
                      "reads a frame (tb_frame), written as e.__dict__"),
    "__dict__.get": ("def f(e):\n    return e.__dict__.get('f_locals')", "reads a frame (f_locals)"),
    "object.__getattribute__": ("def f(fn):\n    return object.__getattribute__(fn, '__wrapped__')",
                                "wrapper), written as object.__getattribute__(fn, '__wrapped__')"),
    "names listed by dir()": ("def f(e):\n    for n in dir(e):\n        if n.endswith('frame'):\n"
                              "            return getattr(e, n)",
                              "reaches attributes by the names dir() or __dict__ lists"),
    "names listed by __dict__": ("def f(m):\n    return [getattr(m, n) for n in m.__dict__]",
                                 "reaches attributes by the names dir() or __dict__ lists (getattr(m, n))"),
    "getattr as a value": ("import functools\ndef f(e):\n    return functools.reduce(getattr, NAMES, e)",
                           "passes getattr around as a value"),
    "getattr renamed": ("def f(e):\n    g = getattr\n    return g(e, NAME)", "passes getattr around as a value"),
    "attrgetter": ("import operator\nget = operator.attrgetter('tb_frame.f_back')", "reads a frame (f_back)"),
    "module attribute by a folded name": ("def f():\n    return getattr(labsupport, 'ta' + 'p').observers()",
                                          "reaches the communication recording (labsupport.tap)"),
    # binding a name hides nothing
    "private name bound as a parameter": (
        "def f(x, _get_default_store=None):\n    return dist.distributed_c10d._get_default_store()",
        "uses a private name (dist.distributed_c10d._get_default_store) on line 2"),
    "private name bound as a parameter, getattr": (
        "def f(x, _get_default_store=None):\n    return getattr(dist.distributed_c10d, '_get_default_store')()",
        "reaches the rendezvous store (_get_default_store)"),
    "private name bound as a local": ("def f(pg, t):\n    _get_backend = None\n    pg._get_backend(t.device)",
                                      "uses a private name (pg._get_backend) on line 3"),
    "private name defined on self, read elsewhere": (
        "class A:\n    def _get_backend(self):\n        pass\ndef f(pg):\n    return pg._get_backend()",
        "uses a private name (pg._get_backend) on line 5"),
    "module bound as a default": ("def f(x, c=dist.distributed_c10d):\n    return c._world",
                                  "uses a private name (c._world)"),
    "module bound to a local": ("def f():\n    t = torch\n    return t._C", "uses a private name (t._C)"),
    # what honest answers never reach
    "__wrapped__": ("def f(t):\n    dist.ProcessGroup.allreduce.__wrapped__(dist.group.WORLD, [t])",
                    "touches __wrapped__"),
    "__closure__": ("def f(g):\n    return g.__closure__[0].cell_contents", "touches __closure__"),
    "cell_contents": ("def f(cell):\n    return cell.cell_contents", "reads a closure cell (cell_contents)"),
    "__defaults__": ("def f(g):\n    g.__defaults__ = (1,)", "touches __defaults__"),
    "the tap": ("from labsupport import tap\nfor o in tap.observers():\n    tap.unsubscribe(o)",
                "reaches the communication recording (labsupport.tap) on lines 1, 2 and 3"),
    "the tap, imported": ("import labsupport.tap as t", "reaches the communication recording (labsupport.tap)"),
    "the tap, attribute": ("def f():\n    labsupport.tap.observers()", "reaches the communication recording"),
    "the tap, in a string": ("m = sys.modules['labsupport.tap']", "names the communication recording"),
    "TCPStore": ("def f(t):\n    s = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), "
                 "is_master=False)", "reaches the rendezvous store (TCPStore) on line 2"),
    "FileStore": ("from torch.distributed import FileStore", "reaches the rendezvous store (FileStore)"),
    "HashStore": ("s = dist.HashStore()", "reaches the rendezvous store (HashStore)"),
    "PrefixStore": ("def f(s):\n    return dist.PrefixStore('x', s)", "reaches the rendezvous store (PrefixStore)"),
    "default store": ("def f():\n    return dist.distributed_c10d._get_default_store()",
                      "reaches the rendezvous store (_get_default_store)"),
    "store based barrier": ("from torch.distributed.distributed_c10d import _store_based_barrier",
                            "reaches the rendezvous store (_store_based_barrier)"),
    "rendezvous": ("store, rank, world = next(dist.rendezvous('env://'))", "reaches the rendezvous store"),
    "asyncio connection": ("import asyncio\nasyncio.open_connection('127.0.0.1', 29500)",
                           "opens network connections (asyncio.open_connection)"),
    "socket, from-import": ("from socket import create_connection", "opens sockets (socket)"),
    "mmap": ("import mmap", "maps memory (mmap)"),
    "shared memory": ("from multiprocessing import shared_memory",
                      "uses shared memory (multiprocessing.shared_memory) on line 1"),
    "shared memory, module": ("import multiprocessing.shared_memory as shm\nm = shm.SharedMemory('x')",
                              "uses shared memory (multiprocessing.shared_memory) on lines 1 and 2"),
    "multiprocessing": ("import multiprocessing as mp\nq = mp.Queue()", "uses multiprocessing"),
    "torch.multiprocessing": ("import torch.multiprocessing as tmp", "uses torch.multiprocessing"),
    "traceback.walk_stack": ("import traceback\nfor frame, _ in traceback.walk_stack(None):\n    pass",
                             "reads the stack's frames (traceback.walk_stack) on line 2"),
    "traceback.walk_tb": ("import traceback\ndef f(e):\n    for frame, _ in traceback.walk_tb(e.__traceback__):\n"
                          "        frame.f_locals", "reads the stack's frames (traceback.walk_tb) on line 3"),
    "traceback.walk_stack, from-import": ("from traceback import walk_stack", "(traceback.walk_stack)"),
    "traceback.clear_frames": ("import traceback\ndef f(e):\n    traceback.clear_frames(e.__traceback__)",
                               "(traceback.clear_frames)"),
    "capture_locals": ("import traceback\ndef f(e):\n"
                       "    return traceback.TracebackException.from_exception(e, capture_locals=True)",
                       "reads the variables of the stack's frames (capture_locals) on line 3"),
    "a traceback's frame": ("def f(e):\n    return e.__traceback__.tb_frame", "reads a frame (tb_frame)"),
    "a traceback's next": ("def f(e):\n    return e.__traceback__.tb_next", "reads a frame (tb_next)"),
    "sys.exc_info's frame": ("import sys\ndef f():\n    return sys.exc_info()[2].tb_frame.f_back",
                             "reads a frame (tb_frame)"),
    "the session's last error": ("import sys\ntb = sys.last_traceback", "(sys.last_traceback)"),
    "frame of a generator": ("def f(g):\n    return g.gi_frame.f_locals", "reads a frame (gi_frame)"),
    "threading.settrace": ("import threading\nthreading.settrace(print)", "installs a trace or profile hook"),
    "sys.settrace": ("import sys\nsys.settrace(print)", "installs a trace or profile hook (sys.settrace)"),
    "sys.setprofile": ("import sys\nsys.setprofile(print)", "installs a trace or profile hook (sys.setprofile)"),
    "signal": ("import signal\nsignal.signal(signal.SIGALRM, print)", "handles signals"),
    "os.kill, from-import": ("from os import kill\nkill(1, 9)", "sends a signal (os.kill)"),
    "os.kill, getattr": ("import os\ngetattr(os, 'ki' + 'll')(1, 9)", "sends a signal (os.kill)"),
    "/proc": ("import os\nx = open('/proc/' + str(os.getppid()) + '/environ').read()",
              "names a path under /proc ('/proc/')"),
    "/proc, f-string": ("import os\nx = os.listdir(f'/proc/{os.getppid()}/fd')", "names a path under /proc"),
    "/dev/shm": ("p = '/dev/shm/answers'", "names a path under /dev/shm"),
    "raw file descriptor": ("import os\nos.write(5, b'x')", "reads or writes a raw file descriptor (os.write)"),
    "pickle.loads": ("import pickle\npickle.loads(b'')", "unpickles bytes, which can run any code"),
    "marshal": ("import marshal\nc = marshal.loads(b'')", "turns code into bytes and back (marshal)"),
    "types.CodeType": ("import types\nc = types.CodeType", "builds or reads code"),
    "torch.from_file": ("t = torch.from_file('x.bin', shared=True, size=4)", "maps a file into a tensor"),
    "storage sharing": ("def f(t):\n    t.untyped_storage()._share_filename_cpu_()",
                        "shares a tensor's memory with other processes (t.untyped_storage()._share_filename_cpu_)"),
    "share_memory_": ("def f(t):\n    t.share_memory_()", "shares a tensor's memory with other processes"),
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
    # attributes by a constant name, honest ones
    "import os\nCORES = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()",
    "def f(attn):\n    for name in ('q_proj', 'k_proj'):\n        setattr(attn, name, getattr(attn, name))",
    "def f(self):\n    for dim in ('tp', 'dp'):\n        setattr(self, f'{dim}_group', None)",
    "def f(p):\n    return p.grad.to_local() if hasattr(p.grad, 'to_local') else p.grad",
    "def f(meta):\n    return getattr(torch, meta['dtype'])",
    "import traceback\ntry:\n    pass\nexcept Exception:\n    traceback.print_exc()",
    # the course's own attributes, read from self
    "class Stage:\n    def __init__(self):\n        self._send = None\n    def step(self):\n        return self._send",
    "def step(grads, scale):\n    torch._foreach_div_(grads, scale)",
    # files under the folder the check hands over
    "import os, json, shutil\ndef save(shard, numel, directory):\n    os.makedirs(directory, exist_ok=True)\n"
    "    path = os.path.join(directory, f'shard_{dist.get_rank()}.bin')\n    with open(path + '.tmp', 'wb') as f:\n"
    "        f.write(shard.numpy())\n    os.replace(path + '.tmp', path)\n"
    "    shutil.rmtree(os.path.join(directory, 'old'), ignore_errors=True)",
    "import os\ndef load(directory, n):\n    return torch.from_file(os.path.join(directory, 'a.bin'), size=n)",
    "from pathlib import Path\ndef save(t, directory):\n    torch.save(t, Path(directory) / 'state.pt')",
    "def save(t, directory):\n    torch.save(t.clone(), os.path.join(directory, 'x.pt'))\n"
    "    return torch.load(f=os.path.join(directory, 'x.pt'))",
])
def test_honest_code_is_not_flagged(source):
    assert screen_source(source, MODULES) == []


#: What honest answers do every day: none of it has a flag (the screen flags only what has no honest use).
ORDINARY_HABITS = {
    "print to stdout": "def f(x):\n    print(f'x = {x!r:>10}', flush=True)\n    return x",
    "print to stderr": "import sys\ndef f(x):\n    print('warning:', x, file=sys.stderr)\n    sys.stderr.flush()",
    "sys.stdout.write": "import sys\nsys.stdout.write('done\\n')",
    "sys.stdout rebound and restored": "import io, sys\nold, sys.stdout = sys.stdout, io.StringIO()\n"
                                       "print('quiet')\nsys.stdout = old",
    "traceback.print_exc": "import traceback\ndef f(g):\n    try:\n        return g()\n    except Exception:\n"
                           "        traceback.print_exc()\n        raise",
    "traceback.format_exc": "import traceback\ndef f(g):\n    try:\n        return g()\n    except Exception:\n"
                            "        print(traceback.format_exc(), end='')",
    "traceback.print_exception": "import traceback\ndef f(g):\n    try:\n        g()\n    except Exception as e:\n"
                                 "        traceback.print_exception(type(e), e, e.__traceback__)",
    "sys.exc_info printed": "import sys, traceback\ntry:\n    x = 1 / 0\nexcept ZeroDivisionError:\n"
                            "    traceback.print_exception(*sys.exc_info())",
    "a stack printed": "import traceback\ndef f():\n    traceback.print_stack()\n"
                       "    return traceback.format_stack()[-1], traceback.extract_stack(limit=2)",
    "sys.argv and sys.version_info": "import sys\nif sys.version_info >= (3, 10) and len(sys.argv) > 0:\n    pass",
    "'torch' in sys.modules": "import sys\nhave_torch = 'torch' in sys.modules",
    "inspect.signature": "import inspect\ndef f(fn):\n    return list(inspect.signature(fn).parameters)",
    "inspect.getsource": "import inspect\ndef show(fn):\n    print(inspect.getsource(fn))",
    "from inspect import": "from inspect import signature, isfunction\ndef f(fn):\n"
                           "    return isfunction(fn) and len(signature(fn).parameters)",
    "os.environ.get and os.path": "import os\nrank = int(os.environ.get('RANK', '0'))\n"
                                  "name = os.path.join('out', os.path.basename('a/b.txt'))\nok = os.path.exists(name)",
    "@functools.lru_cache": "import functools\n@functools.lru_cache(maxsize=None)\ndef chunk_sizes(n, k):\n"
                            "    return tuple(n // k + (i < n % k) for i in range(k))",
    "@functools.cache": "from functools import cache\n@cache\ndef fib(n):\n"
                        "    return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "@functools.wraps": "import functools\ndef logged(fn):\n    @functools.wraps(fn)\n    def inner(*a, **k):\n"
                        "        return fn(*a, **k)\n    return inner",
    "functools.partial and reduce": "import functools, operator\nadd = functools.partial(operator.add, 1)\n"
                                    "total = functools.reduce(operator.mul, [1, 2, 3])",
    "@dataclass": "from dataclasses import dataclass, field\n@dataclass\nclass Plan:\n    tp: int\n"
                  "    dp: int = 1\n    groups: list = field(default_factory=list)",
    "@staticmethod, @classmethod, @property": "class Grid:\n    @staticmethod\n    def size(a, b):\n"
                                             "        return a * b\n    @classmethod\n    def make(cls):\n"
                                             "        return cls()\n    @property\n    def n(self):\n        return 1",
    "a class with __repr__": "class Bucket:\n    def __init__(self):\n        self.params = []\n"
                             "    def __repr__(self):\n        return f'Bucket({len(self.params)})'",
    "warnings.warn": "import warnings\ndef f(n):\n    if n % 2:\n        warnings.warn('odd size', RuntimeWarning)\n"
                     "    with warnings.catch_warnings():\n        warnings.simplefilter('ignore')",
    "logging": "import logging\nlog = logging.getLogger(__name__)\nlogging.basicConfig(level=logging.INFO)\n"
               "log.info('rank %d', 0)",
    "time.perf_counter": "import time\nstart = time.perf_counter()\ntime.sleep(0.01)\n"
                         "elapsed = time.perf_counter() - start",
    "itertools": "import itertools\npairs = list(itertools.product(range(2), repeat=2))\n"
                 "flat = list(itertools.chain.from_iterable([[1], [2]]))",
    "typing": "from typing import Callable, List, Optional\ndef f(x: Optional[List[int]] = None) -> Callable:\n"
              "    return print",
    "collections": "from collections import Counter, OrderedDict, defaultdict, deque\nd = defaultdict(list)\n"
                   "q = deque(maxlen=3)\nc = Counter('abc')",
    "math": "import math\nn = math.ceil(10 / 3) + math.prod([2, 3]) + int(math.log2(8))",
    "assert with a message": "def f(x, n):\n    assert x.numel() % n == 0, f'numel {x.numel()} not divisible by {n}'",
    "comprehensions": "def f(n):\n    d = {i: i * i for i in range(n)}\n    s = {i % 2 for i in range(n)}\n"
                      "    return [v for v in d.values() if v], sum(x for x in s)",
    "contextlib.redirect_stdout": "import contextlib, io\nbuf = io.StringIO()\n"
                                  "with contextlib.redirect_stdout(buf):\n    print('hidden')",
    "copy and json": "import copy, json\nstate = copy.deepcopy({'a': [1]})\ntext = json.dumps(state)",
    "random and numpy": "import random\nimport numpy as np\nrandom.seed(0)\nx = np.arange(4).reshape(2, 2)",
    "enum and abc": "import abc, enum\nclass Kind(enum.Enum):\n    F = 'F'\n    B = 'B'\n"
                    "class Base(abc.ABC):\n    @abc.abstractmethod\n    def step(self):\n        ...",
    "the collectives": "import torch.distributed as dist\ndef f(t):\n    dist.all_reduce(t, op=dist.ReduceOp.SUM)\n"
                       "    return t / dist.get_world_size()",
}


@pytest.mark.parametrize("name", sorted(ORDINARY_HABITS))
def test_ordinary_student_habits_are_not_flagged(name):
    assert screen_source(ORDINARY_HABITS[name], SETUP_MODULES) == []


def test_what_syntax_hides_is_flagged_as_the_syntax():
    """A constant name (however folded) gives the flag of the attribute it spells, and says how it was written."""
    plain = screen_source("def f(err):\n    return err.tb_frame", MODULES)
    hidden = screen_source("def f(err):\n    return getattr(err, 'tb' + '_' + 'frame')", MODULES)
    assert plain == ["reads a frame (tb_frame) on line 2"], plain
    assert hidden == ["reads a frame (tb_frame), written as getattr(err, 'tb' + '_' + 'frame') on line 2"], hidden


def test_a_flag_names_every_line():
    reasons = screen_source("import os\nx = 1\nos.kill(1, 9)\nos.kill(2, 9)\nos.kill(3, 9)", MODULES)
    assert reasons == ["sends a signal (os.kill) on lines 3, 4 and 5"], reasons


def test_binding_a_private_name_never_hides_it():
    """Whatever the cell binds under a private name of the communication stack (a parameter, a local, a method of
    its own class), that name read from anything but the cell's own ``self`` is flagged."""
    for binding in ("def f(x, {n}=None):\n    pass", "{n} = None", "def {n}():\n    pass",
                    "class A:\n    def {n}(self):\n        pass", "class A:\n    {n} = None",
                    "for {n} in range(2):\n    pass"):
        for name in ("_get_default_store", "_get_backend", "_world", "_store_based_barrier"):
            use = f"def g(pg):\n    return pg.{name}"
            reasons = screen_source(binding.format(n=name) + "\n" + use, MODULES)
            assert any(f"pg.{name}" in r for r in reasons), (binding, name, reasons)
            module = f"def g():\n    return dist.distributed_c10d.{name}"
            reasons = screen_source(binding.format(n=name) + "\n" + module, MODULES)
            assert any(f"dist.distributed_c10d.{name}" in r for r in reasons), (binding, name, reasons)


def test_own_attribute_of_a_communication_name_is_exempt_only_on_self():
    cls = "class A:\n    def __init__(self):\n        self._world = {}\n"
    assert screen_source(cls + "    def f(self):\n        return self._world", MODULES) == []
    reasons = screen_source(cls + "def f(pg):\n    return pg._world", MODULES)
    assert reasons == ["uses a private name (pg._world) on line 5"], reasons


def test_own_attribute_named_like_a_labsupport_helper_is_not_flagged():
    """A bucket of the student's own with ``self._nbytes`` (a name labsupport also uses) read by another class."""
    code = ("class Bucket:\n    def __init__(self):\n        self._nbytes = 0\n"
            "def full(bucket, cap):\n    return bucket._nbytes >= cap")
    assert screen_source(code, MODULES) == []
    reasons = screen_source("def full(bucket, cap, _nbytes=0):\n    return bucket._nbytes >= cap", MODULES)
    assert reasons == ["uses a private name (bucket._nbytes) on line 2"], reasons


def test_code_too_deep_to_walk_is_flagged():
    reasons = screen_source("x = a" + ".b" * 3000, MODULES)
    assert reasons == ["nests its code too deeply for the screen to read (RecursionError)"], reasons


def test_every_lesson_is_screened():
    """Each lesson's solution notebook (new ones too) is among those whose answers must screen clean."""
    lessons = sorted(p.name for p in (REPO / "solutions").iterdir() if p.is_dir() and p.name[:2].isdigit())
    assert lessons and [p.parent.name for p in SOLUTIONS] == lessons


def test_unchanged_instructor_cells_are_not_screened():
    """A release cell without nbgrader metadata (a measurement) counts only once the student changed it."""
    release = nbformat.v4.new_notebook()
    release.cells = [nbformat.v4.new_code_cell("import gc\ngc.collect()")]
    sub = nbformat.v4.new_notebook()
    sub.cells = [nbformat.v4.new_code_cell("import gc\ngc.collect()"),
                 nbformat.v4.new_code_cell("import gc\ngc.collect()  # mine")]
    flags = screen_notebook(sub, release)
    assert [f.cell for f in flags] == ["cell 2 ('import gc')"], flags
    assert str(flags[0]).endswith("uses gc (the garbage collector's view of every object) on lines 1 and 2"), flags


def test_python_source_turns_magics_into_calls():
    assert "get_ipython()" in python_source("%time x = 1")
