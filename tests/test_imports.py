"""labsupport's import graph: no cycle (imports inside functions count too), and `import labsupport` stays torch-free
(the fork server started at import time is what imports torch, in the background)."""

import ast
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

import labsupport

PACKAGE = Path(labsupport.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph() -> dict:
    """{module: {labsupport modules it imports}}, every import statement anywhere in the file."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module)
                # `from . import _worker` imports the submodule _worker (the package is only its parent)
                subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
                targets = subs + ([base] if node.module or len(subs) < len(node.names) else [])
            for target in targets:
                while target and target not in modules:  # `import labsupport.x.y` where y is a name
                    target = target.rpartition(".")[0]
                if target and target != module and target.startswith("labsupport"):
                    edges.add(target)
        graph[module] = edges
    return graph


def find_cycle(graph: dict):
    """One cycle as a list of modules (first == last), or None."""
    state: dict = {}
    stack: list = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_is_read_from_every_import_statement():
    graph = import_graph()
    assert "labsupport.launch" in graph["labsupport"]
    assert "labsupport._worker" in graph["labsupport._pool"]  # an import inside a function counts
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_labsupport_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_import_labsupport_does_not_import_torch():
    env = dict(os.environ, LABSUPPORT_EARLY_START="0")
    code = "import sys, labsupport; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


IRI_PROBE = """
import sys
{before}
import nbformat
nbformat.validate(nbformat.read(sys.argv[1], as_version=4))
module = sys.modules.get("rfc3987_syntax")
print("parsers built" if module is not None else "left out")
"""


def test_the_graders_command_line_reads_notebooks_without_building_the_iri_parsers():
    """``python -m autograder`` starts without ``rfc3987_syntax`` (see ``autograder/_quick_start.py``) and still
    validates a notebook; the same process without it builds the parsers, so the probe sees the difference."""
    try:  # this process has it left out (tests/conftest.py): ask pip's records
        importlib.metadata.distribution("rfc3987-syntax")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("rfc3987_syntax is not installed here: jsonschema has nothing to import")
    notebook = str(PACKAGE.parent / "notebooks" / "00_launch" / "00_launch.ipynb")
    seen = {}
    for name, before in (("plain", ""), ("grader", "import autograder.__main__")):
        out = subprocess.run([sys.executable, "-c", IRI_PROBE.format(before=before), notebook], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        seen[name] = out.stdout.strip()
    assert seen == {"plain": "parsers built", "grader": "left out"}, seen
