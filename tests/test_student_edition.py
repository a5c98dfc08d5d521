"""The student edition (``python -m autograder student-edition DIR``) holds no answers and works on its own.

* no file of it contains the body of any solution cell, hidden check or reference implementation (normalised:
  whitespace collapsed, comments and trivial lines dropped, any 3 consecutive lines of a body count);
* no function, cell or module of it holds a solution written with other names (a function-level comparison of
  syntax trees with names and constants erased; see STRUCT_COVERAGE);
* every release notebook and demo runs in it, with only its packages importable, past its unwritten exercises to its
  end (``test_light_install.py``, with the light install's packages);
* ``check`` runs there (visible tests only), and ``pip install DIR`` gives a working package.
"""

import ast
import difflib
import json
import os
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import demo_submissions as demo  # noqa: E402

REPO = demo.REPO
WINDOW = 3           # consecutive non-trivial lines of a body that may not appear together anywhere
MIN_LINE = 12        # shorter lines ("else:", "return out") say nothing
SINGLE_LINE = 45     # a body of one or two lines counts when a line is at least this long


@pytest.fixture(scope="module")
def edition(tmp_path_factory):
    dest = tmp_path_factory.mktemp("edition") / "course"
    proc = demo.cli("student-edition", dest)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dest


def _norm_lines(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        line = " ".join(line.split())
        if not line or line.startswith("#") or line.startswith(('"""', "'''")) or len(line) < MIN_LINE:
            continue
        if "BEGIN SOLUTION" in line or "END SOLUTION" in line:
            continue
        out.append(line)
    return out


def _solution_bodies() -> dict[str, list[str]]:
    """name -> normalised lines of every solution region in solutions/ and every function of autograder/checks/."""
    bodies = {}
    for path in sorted((REPO / "solutions").glob("*/*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            text, inside, region = cell.source, False, []
            for line in text.splitlines():
                if "BEGIN SOLUTION" in line or "BEGIN HIDDEN TESTS" in line:
                    inside, region = True, []
                elif "END SOLUTION" in line or "END HIDDEN TESTS" in line:
                    inside = False
                    bodies[f"{path.stem} cell {i}"] = _norm_lines("\n".join(region))
                elif inside:
                    region.append(line)
    checks = REPO / "autograder" / "checks"
    for path in sorted(checks.rglob("*.py")):  # modules and packages (their submodules too)
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = ast.get_source_segment(source, node) or ""
                lines = _norm_lines("\n".join(body.splitlines()[1:]))  # without the def line
                bodies[f"{path.relative_to(checks).as_posix()}:{node.name}"] = lines
    return {k: v for k, v in bodies.items() if v}


def _windows(lines: list[str]) -> set[tuple[str, ...]]:
    if len(lines) < WINDOW:
        return {tuple(lines)} if max(map(len, lines)) >= SINGLE_LINE or len(lines) == WINDOW - 1 else set()
    return {tuple(lines[i:i + WINDOW]) for i in range(len(lines) - WINDOW + 1)}


def _edition_texts(root: Path) -> dict[str, list[str]]:
    texts = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or ".git" in path.parts:
            continue
        rel = path.relative_to(root).as_posix()
        if path.suffix == ".ipynb":
            nb = json.loads(path.read_text())
            chunks = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in nb["cells"]]
            for k, chunk in enumerate(chunks):
                texts[f"{rel} cell {k}"] = _norm_lines(chunk)
            continue
        try:
            texts[rel] = _norm_lines(path.read_text())
        except UnicodeDecodeError:
            continue
    return texts


def test_layout(edition):
    names = sorted(p.name for p in edition.iterdir())
    assert names == sorted([".gitignore", ".jupyter", "README.md", "autograder", "course", "demos", "environment.yml",
                            "labsupport", "nbgrader_config.py", "notebooks", "pyproject.toml"]
                           + (["LICENSE"] if (REPO / "LICENSE").exists() else []))
    assert not (edition / "autograder" / "checks").exists()
    assert os.access(edition / "course", os.X_OK)
    readme = (edition / "README.md").read_text()
    assert "./course lab" in readme and "python -m autograder check" in readme and "%pip install" in readme
    # no address given: the install lines say to put it in (the demos' too), and no demo links to Colab
    assert '%pip install -q "git+<URL of this repository>"' in readme and "colab.research.google.com" not in readme
    demos = sorted(p.name for p in (edition / "demos").iterdir())
    assert demos == sorted(p.name for p in (REPO / "demos").glob("*.ipynb")) and demos
    for name in demos:
        text = (edition / "demos" / name).read_text()
        assert "OWNER/REPO" not in text and 'git+<URL of this repository>' in text, name
        assert f"(demos/{name})" in readme
    released = sorted(p.name for p in (edition / "notebooks").iterdir())
    assert released == sorted(p.name for p in (REPO / "notebooks").iterdir() if (p / f"{p.name}.ipynb").exists())
    assert not (edition / "autograder" / "_hosted_at.py").exists()     # no address given: none recorded
    for path in edition.rglob("*"):  # the grader's own code names the markers; nothing else may hold one
        if path.is_file() and path.suffix in (".py", ".ipynb", ".md") and "autograder" not in path.parts:
            text = path.read_text()
            for marker in ("BEGIN SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
                assert marker not in text, (path, marker)


#: A word of each notebook's subject that the edition's introduction (README and pyproject.toml) must name.
SUBJECTS = {"01_collectives": "collectives", "02_ring_allreduce": "ring all-reduce", "03_data_parallel": "DDP",
            "04_tensor_parallel": "tensor", "05_pipeline_parallel": "pipeline", "06_zero": "ZeRO", "07_fsdp": "FSDP",
            "08_hybrid_parallel": "hybrid", "09_production": "checkpoints", "10_overlap": "computation"}


def test_the_introduction_names_every_notebook(edition):
    """The README's opening paragraph and pyproject.toml's description name the subject of every notebook of the
    edition, the last ones (hybrid parallelism, a production loop, overlap) included."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    intro = (edition / "README.md").read_text().split("\n\n")[1]
    description = tomllib.loads((edition / "pyproject.toml").read_text())["project"]["description"]
    ids = sorted(p.name for p in (edition / "notebooks").iterdir() if p.name != "00_launch")
    assert ids == sorted(SUBJECTS), ids    # a new notebook needs its subject here
    for aid in ids:
        word = SUBJECTS[aid]
        assert word in intro.replace("\n", " ") or (aid == "03_data_parallel" and "data parallelism" in intro), \
            (aid, intro)
        assert word in description, (aid, description)


def test_the_editions_command_line_offers_only_check(edition, tmp_path):
    """In the edition, ``python -m autograder --help`` lists ``check`` and none of the instructor's commands, and each
    of those, asked for, says that it needs the course repository (not "no release notebooks")."""
    env = _edition_env(edition)
    proc = subprocess.run([sys.executable, "-m", "autograder", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "check" in proc.stdout and "student edition" in proc.stdout, proc.stdout
    from autograder.__main__ import INSTRUCTOR_COMMANDS

    listed = re.findall(r"^ {4}([\w-]+)", proc.stdout, re.M)     # the commands argparse lists, one a line
    assert listed == ["check"], proc.stdout
    for command in INSTRUCTOR_COMMANDS:
        args = [command, str(tmp_path / "out")] if command != "grade" else [command, str(tmp_path)]
        failed = subprocess.run([sys.executable, "-m", "autograder", *args], cwd=edition, env=env,
                                capture_output=True, text=True, timeout=120)
        assert failed.returncode == 2, failed.stdout + failed.stderr
        assert f"`python -m autograder {command}` is one of the instructor's commands" in failed.stderr, failed.stderr
        assert "this is the student edition" in failed.stderr and "python -m autograder check" in failed.stderr
    assert not (tmp_path / "out").exists()
    proc = subprocess.run([sys.executable, "-m", "autograder", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)     # the repository keeps them all
    assert re.findall(r"^ {4}([\w-]+)", proc.stdout, re.M) == [*INSTRUCTOR_COMMANDS, "check"], proc.stdout


def test_the_lab_extras_are_offered_in_the_form_of_the_install():
    """``check`` without the lab extras says how to add them to the install at hand: from git (Colab's
    ``%pip install git+URL``, no course folder) the same address with ``[lab]``; from a course folder
    ``./course setup`` there; otherwise the git form with the edition's recorded address, or a placeholder."""
    from autograder.__main__ import lab_extras_hint

    colab = {"url": "https://github.com/you/course", "vcs_info": {"vcs": "git", "commit_id": "0" * 40}}
    hint = lab_extras_hint(source=colab, folder=None)
    assert 'pip install "distributed-training-course[lab] @ git+https://github.com/you/course"' in hint, hint
    assert "-e" not in hint and "course's folder" not in hint, hint
    colab["vcs_info"]["requested_revision"] = "spring-2027"
    assert "@ git+https://github.com/you/course@spring-2027\"" in lab_extras_hint(source=colab, folder=None)
    here = lab_extras_hint(source={"url": REPO.as_uri(), "dir_info": {"editable": True}}, folder=REPO)
    assert f"./course setup in the course's folder ({REPO})" in here and "pip install -e '.[lab]'" in here, here
    hosted = lab_extras_hint(source={}, folder=None, hosted_at="https://github.com/you/course@main")
    assert '"distributed-training-course[lab] @ git+https://github.com/you/course@main"' in hosted, hosted
    assert "git+<URL of the course's repository>" in lab_extras_hint(source={}, folder=None, hosted_at="")


def test_url_goes_into_the_install_lines_and_colab_links(tmp_path):
    """``--url`` (where the edition will be hosted) fills the README's Colab line and the demos' install lines, and a
    GitHub address gives each demo an Open-in-Colab link; ``--branch`` goes into both; an address pip cannot install
    from, a branch name that cannot go into one, and a branch without an address are refused."""
    from autograder.course import Course
    from autograder.edition import write_edition

    url = "https://github.com/you/distributed-course"
    dest = write_edition(Course.at(REPO), tmp_path / "hosted", url=url)
    readme = (dest / "README.md").read_text()
    assert f'%pip install -q "git+{url}"' in readme and "<URL of this repository>" not in readme
    for path in sorted((dest / "demos").iterdir()):
        nb = nbformat.read(path, as_version=4)
        install = [c.source for c in nb.cells if "%pip install" in c.source]
        assert len(install) == 1 and f'%pip install -q "git+{url}"' in install[0], (path.name, install)
        assert "OWNER/REPO" not in path.read_text() and "Replace" not in install[0], path.name
        assert f"https://colab.research.google.com/github/you/distributed-course/blob/main/demos/{path.name}" in readme

    assert (dest / "autograder" / "_hosted_at.py").read_text().endswith(f"URL = {url!r}\n")
    dest = write_edition(Course.at(REPO), tmp_path / "branch", url=url + "/", branch="spring-2027")
    assert f"URL = '{url}@spring-2027'" in (dest / "autograder" / "_hosted_at.py").read_text()
    readme = (dest / "README.md").read_text()
    assert f'%pip install -q "git+{url}@spring-2027"' in readme, readme
    for path in sorted((dest / "demos").iterdir()):
        assert f'git+{url}@spring-2027\\"' in path.read_text(), path.name
        assert f"github/you/distributed-course/blob/spring-2027/demos/{path.name}" in readme
    assert "blob/main" not in readme

    proc = demo.cli("student-edition", tmp_path / "bad", "--url", url, "--branch", "a b")
    assert proc.returncode == 2 and "--branch 'a b' is not a branch name" in proc.stderr, proc.stderr
    proc = demo.cli("student-edition", tmp_path / "bad", "--branch", "spring-2027")
    assert proc.returncode == 2 and "give --url too" in proc.stderr, proc.stderr
    proc = demo.cli("student-edition", tmp_path / "bad", "--url", "you/course")
    assert proc.returncode == 2 and "--url 'you/course' is not an address pip can install from" in proc.stderr, \
        proc.stderr
    assert not (tmp_path / "bad").exists()


def _leaks(root: Path) -> list[str]:
    bodies = _solution_bodies()
    assert len(bodies) > 20, "found too few solution bodies: is the course there?"
    packages = {name.split("/")[0] for name in bodies if "/" in name.split(":")[0]}
    assert "ring_allreduce" in packages, "the check packages' submodules are not read"
    index = {}
    for name, lines in _edition_texts(root).items():
        for k in range(len(lines)):  # every run of 1, 2 and WINDOW lines
            for n in range(1, WINDOW + 1):
                if k + n <= len(lines):
                    index.setdefault(tuple(lines[k:k + n]), name)
    leaks = []
    for name, lines in bodies.items():
        for w in _windows(lines):
            if w in index:
                leaks.append(f"{name} appears in {index[w]}: {' / '.join(w)[:200]}")
                break
    return leaks


def test_no_answers_in_the_edition(edition):
    """No file of the edition contains 3 consecutive lines of any solution cell, hidden test, check or reference
    implementation (after normalisation); this also catches a helper module that carries an exercise's answer."""
    leaks = _leaks(edition)
    assert not leaks, "\n".join(leaks)


def test_the_leak_test_finds_a_planted_answer(edition, tmp_path):
    """A lesson helper that carries a solution (re-indented, with comments) is found."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(edition, copy)
    nb = nbformat.read(REPO / "solutions" / "01_collectives" / "01_collectives.ipynb", as_version=4)
    answer = next(c.source for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "all_gather")
    body = answer.split("### BEGIN SOLUTION")[1].split("### END SOLUTION")[0]
    planted = "def gather_everything(tensor):\n    # a helper\n" + "\n".join(
        "    " + line for line in body.splitlines())
    (copy / "labsupport" / "helpers_extra.py").write_text(planted)
    leaks = _leaks(copy)
    assert any("helpers_extra.py" in leak for leak in leaks), leaks


# --- Function-level comparison --------------------------------------------------------------------------------
# A line-by-line comparison misses an answer rewritten with other names, an extra index or a reordered loop (a lesson
# module's simulator that was the graded one with a chunk index added). So every solution is also compared as code:
# each statement becomes the sequence of its syntax-tree nodes with every name and constant erased (attribute and
# keyword names kept: they are the API the answer calls), and each solution is matched against every contiguous run
# of statements inside a function (or at the top of a cell or module) that the edition ships.
#
# A run counts as the answer when (see ``_leak_verdict``) the solution has at least STRUCT_MIN_TOKENS nodes, the run
# reproduces at least STRUCT_COVERAGE of them in order, and the two are alike as a whole (difflib's ratio, 2 M / (|a|
# + |b|), at least STRUCT_RATIO), so a long function that happens to contain most node kinds of a short answer does not
# count. Calibrated on the course (a test prints the closest pairs): the answers once shipped in lesson modules score
# coverage 0.95 and ratio 0.82-0.90 (05's simulate_schedule and one_f_one_b_schedule in interleaved.py, 03's
# broadcast_parameters in dp.py); the closest code that is not an answer stays below: the dense attention 04's
# ParallelAttention starts from (coverage 0.72), 00's plot_rank_layout against rank_table (0.74), 02's parameter-server
# demo against 01's all_reduce (coverage 0.88 but ratio 0.69: it does more). Answers shorter than STRUCT_MIN_TOKENS
# nodes (``return x.view_as(x)``, one loop over the ranks with a send) say nothing about where they came from.
STRUCT_MIN_TOKENS = 20
STRUCT_COVERAGE = 0.90
STRUCT_RATIO = 0.80
_BODY_FIELDS = ("body", "orelse", "finalbody", "handlers", "cases")
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _node_tokens(node, out: list) -> None:
    if isinstance(node, (ast.Name, ast.Constant, ast.arg)):
        out.append("_")
    elif isinstance(node, ast.expr_context):
        return
    elif isinstance(node, ast.Attribute):
        out.append("." + node.attr)
        _node_tokens(node.value, out)
    elif isinstance(node, ast.keyword):
        out.append(f"{node.arg}=")
        _node_tokens(node.value, out)
    else:
        out.append(type(node).__name__)
        for field, value in ast.iter_fields(node):
            if field in _BODY_FIELDS or field in ("decorator_list", "returns", "type_comment", "type_params"):
                continue
            for child in (value if isinstance(value, list) else [value]):
                if isinstance(child, ast.AST):
                    _node_tokens(child, out)


def _statements(stmts) -> list[list[str]]:
    """The statements in order, nested ones after their header (a compound statement contributes its header: ``for``
    with its target and iterable, ``if`` with its test), docstrings left out; each as its list of node tokens."""
    out = []
    for stmt in stmts:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            continue
        tokens = [type(stmt).__name__]
        if isinstance(stmt, _DEFS):
            if not isinstance(stmt, ast.ClassDef):
                _node_tokens(stmt.args, tokens)
        else:
            tokens = []
            _node_tokens(stmt, tokens)
        out.append(tokens)
        for field in _BODY_FIELDS:
            inner = getattr(stmt, field, None) or []
            if field == "handlers":
                for handler in inner:
                    head = ["except"]
                    if handler.type is not None:
                        _node_tokens(handler.type, head)
                    out += [head] + _statements(handler.body)
            elif field == "cases":
                for case in inner:
                    out += [["case"]] + _statements(case.body)
            else:
                out += ([[field]] if field != "body" and inner else []) + _statements(inner)
    return out


def _parse(text: str):
    """``text`` as a module (a cell's magics and shell lines left out, a region cut out of a method re-nested), or
    None when it is not Python."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith(("%", "!"))]
    for code in (textwrap.dedent("\n".join(lines)), "class _:\n    def _(self):\n" + "\n".join(lines)):
        try:
            return ast.parse(code)
        except SyntaxError:
            continue
    return None


def _functions(tree):
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _solution_units() -> dict[str, list[list[str]]]:
    """Every solution region of solutions/*/*.ipynb, every function one is in and every function defined in one:
    ``{"05_pipeline_parallel simulate_schedule simulate_schedule()": statements}``."""
    units = {}
    for path in sorted((REPO / "solutions").glob("*/*.ipynb")):
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if "### BEGIN SOLUTION" not in cell.source:
                continue
            gid = cell.metadata.get("nbgrader", {}).get("grade_id", f"cell {i}")
            regions, region, marked = [], None, []
            for n, line in enumerate(cell.source.splitlines(), 1):
                if "### BEGIN SOLUTION" in line:
                    region = []
                    marked.append(n)
                elif "### END SOLUTION" in line and region is not None:
                    regions.append("\n".join(region))
                    region = None
                elif region is not None:
                    region.append(line)
            for k, text in enumerate(regions, 1):
                tree = _parse(text)
                if tree is not None:
                    units[f"{path.stem} {gid} region {k}"] = _statements(tree.body)
                    units.update({f"{path.stem} {gid} {fn.name}()": _statements(fn.body) for fn in _functions(tree)})
            whole = _parse(re.sub(r"### (BEGIN|END) SOLUTION", "", cell.source))
            for fn in _functions(whole) if whole is not None else []:
                if any(fn.lineno <= n <= fn.end_lineno for n in marked):
                    units[f"{path.stem} {gid} {fn.name}()"] = _statements(fn.body)
    kept, seen = {}, set()
    for name, stmts in sorted(units.items(), key=lambda item: not item[0].endswith("()")):  # a function that
        # is all one region: once, by its name
        key = repr(stmts)
        if sum(map(len, stmts)) >= STRUCT_MIN_TOKENS and key not in seen:
            kept[name] = stmts
            seen.add(key)
    return kept


def _shipped_code(root: Path) -> dict[str, str]:
    """The Python the edition at ``root`` ships: its modules, every code cell of its notebooks and demos, and the
    Python that ``course`` runs (its ``<<'PY'`` blocks)."""
    code = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or ".git" in path.parts:
            continue
        rel = path.relative_to(root).as_posix()
        if path.suffix == ".py":
            code[rel] = path.read_text()
        elif path.suffix == ".ipynb":
            for k, cell in enumerate(json.loads(path.read_text())["cells"]):
                if cell["cell_type"] == "code":
                    source = cell["source"]
                    code[f"{rel} cell {k}"] = "".join(source) if isinstance(source, list) else source
        elif path.name == "course":
            for k, block in enumerate(re.findall(r"<<'PY'\n(.*?)\nPY\n", path.read_text(), re.S), 1):
                code[f"{rel} (Python block {k})"] = block
    return code


def _shipped_bodies(code: dict[str, str]) -> dict[str, list[list[str]]]:
    """Every function of ``code`` (``name:function``), and the top level of each cell or module outside its
    definitions, as statement lists."""
    bodies = {}
    for name, text in code.items():
        tree = _parse(text)
        if tree is None:
            continue
        bodies[name] = _statements([s for s in tree.body if not isinstance(s, _DEFS)])
        for fn in _functions(tree):
            bodies[f"{name}:{fn.name}"] = _statements(fn.body)
    return {name: stmts for name, stmts in bodies.items() if stmts}


def _kgrams(tokens: list[str], k: int = 6) -> set:
    return {tuple(tokens[i:i + k]) for i in range(len(tokens) - k + 1)}


def _closest_run(answer: list[list[str]], stmts: list[list[str]]) -> tuple[float, float, int, int]:
    """(ratio, coverage, first, last statement) of the run of ``stmts`` most like ``answer``, among runs of about
    its length (3/4 to 4/3 of its statements): difflib's ratio of the two token sequences, and the share of the
    answer's tokens the run reproduces in order."""
    a = [t for s in answer for t in s]
    counts = Counter(a)
    matcher = difflib.SequenceMatcher(None, autojunk=False)
    matcher.set_seq2(a)
    n = len(answer)
    best = (0.0, 0.0, 0, 0)
    for length in sorted({max(1, n - n // 4), n, n + n // 3 + 1}):
        for start in range(max(1, len(stmts) - length + 1)):
            b = [t for s in stmts[start:start + length] for t in s]
            if 2 * sum((counts & Counter(b)).values()) / (len(a) + len(b)) <= best[0]:
                continue   # cannot beat the best run so far
            matcher.set_seq1(b)
            ratio = matcher.ratio()
            if ratio > best[0]:
                same = sum(block.size for block in matcher.get_matching_blocks())
                best = (ratio, same / len(a), start, min(start + length, len(stmts)))
    return best


def _closest_pairs(code: dict[str, str]) -> list[tuple]:
    """For each solution, the shipped run most like it: [(ratio, coverage, solution, where, tokens)], best first.
    Only pairs that share a sixth of the answer's 6-token sequences are compared in full."""
    units = _solution_units()
    assert len(units) > 40, "found too few solutions: is the course there?"
    bodies = _shipped_bodies(code)
    grams = {name: _kgrams([t for s in stmts for t in s]) for name, stmts in bodies.items()}
    pairs = []
    for unit, answer in units.items():
        mine = _kgrams([t for s in answer for t in s])
        best = None
        for body, stmts in bodies.items():
            if len(mine & grams[body]) < len(mine) / 6:
                continue
            ratio, coverage, first, last = _closest_run(answer, stmts)
            if best is None or ratio > best[0]:
                best = (ratio, coverage, unit, f"{body} (statements {first + 1}-{last})", sum(map(len, answer)))
        if best is not None:
            pairs.append(best)
    return sorted(pairs, reverse=True)


def _leak_verdict(ratio: float, coverage: float) -> bool:
    return coverage >= STRUCT_COVERAGE and ratio >= STRUCT_RATIO


def _structural_leaks(code: dict[str, str]) -> list[str]:
    return [f"{unit} is reproduced by {where}: {coverage:.0%} of its {tokens} syntax nodes in order, "
            f"similarity {ratio:.2f}" for ratio, coverage, unit, where, tokens in _closest_pairs(code)
            if _leak_verdict(ratio, coverage)]


#: A commit whose lesson modules still held two answers: 05_pipeline_parallel's interleaved.py (simulate_interleaved
#: was simulate_schedule with a chunk index, interleaved_schedule one_f_one_b_schedule with chunks) and
#: 03_data_parallel's dp.py (ddp_rank_report broadcast the weights as broadcast_parameters does).
LEAKY_COMMIT = "deefbe804681336672243342379884bba52a81b9"
LEAKY_FILES = ("labsupport/lessons/pipeline_parallel/interleaved.py", "labsupport/lessons/data_parallel/dp.py")


def test_no_answer_is_shipped_as_code_of_the_edition(edition):
    """No function, cell or module of the edition holds a run of statements that is a solution with other names."""
    leaks = _structural_leaks(_shipped_code(edition))
    assert not leaks, "\n".join(leaks)


def test_the_function_level_comparison_finds_the_answers_lesson_modules_once_held():
    """On the lesson modules as they were at LEAKY_COMMIT, the comparison finds 05's simulate_schedule in
    simulate_interleaved and 03's broadcast_parameters in ddp_rank_report, which the line comparison let through."""
    code = {}
    for path in LEAKY_FILES:
        proc = subprocess.run(["git", "show", f"{LEAKY_COMMIT}:{path}"], cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"this copy of the repository lacks commit {LEAKY_COMMIT[:10]} ({proc.stderr.strip()})")
        code[path] = proc.stdout
    leaks = _structural_leaks(code)
    found = {(leak.split(" is reproduced by ")[0], leak.split(" is reproduced by ")[1].split(" (")[0])
             for leak in leaks}
    assert ("05_pipeline_parallel simulate_schedule simulate_schedule()",
            f"{LEAKY_FILES[0]}:simulate_interleaved") in found, leaks
    assert ("03_data_parallel broadcast_parameters broadcast_parameters()",
            f"{LEAKY_FILES[1]}:ddp_rank_report") in found, leaks


def test_the_function_level_comparison_finds_a_renamed_answer_and_not_generic_code():
    """An answer with every name changed, a parameter added and a comment inserted, inside a longer helper, is
    found; short generic code (a loop over the ranks, ``return x``) and the dense attention an exercise starts
    from are not."""
    nb = nbformat.read(REPO / "solutions" / "02_ring_allreduce" / "02_ring_allreduce.ipynb", as_version=4)
    answer = next(c.source for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "ring_all_reduce")
    body = textwrap.dedent(answer.split("### BEGIN SOLUTION")[1].split("### END SOLUTION")[0])
    kept = {"dist", "torch", "range", "len", "min", "max", "sum", "list", "zip", "enumerate", "int", "float"}

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node):
            if node.id not in kept:
                node.id = f"v_{len(node.id)}_{node.id[::-1]}"
            return node

    renamed = ast.unparse(Rename().visit(ast.parse(body)))
    assert renamed.count("v_") > 5 and "### " not in renamed
    helper = ("def spread(tensor, tag=None):\n    stats = {}\n    stats['tag'] = tag\n"
              + textwrap.indent(renamed, "    ") + "\n    stats['done'] = True\n    return stats\n")
    assert _structural_leaks({"labsupport/helper.py": helper}), helper
    generic = ("def send_to_all(t):\n    for r in range(dist.get_world_size()):\n        if r != dist.get_rank():\n"
               "            dist.send(t, r)\n    return t\n")
    from_dense = (REPO / "labsupport" / "lessons" / "tensor_parallel" / "__init__.py").read_text()
    assert not _structural_leaks({"generic.py": generic, "tensor_parallel/__init__.py": from_dense})


#: The development environment has the repository installed in editable mode: its import hook would find
#: ``autograder.checks`` of the repository below the edition's ``autograder``. A student's environment has no such
#: hook; the code run in the edition drops it first.
NO_EDITABLE_FINDER = ("import sys\n"
                      "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]\n")


def _edition_env(edition: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(edition), LABSUPPORT_GRADING="1", MPLBACKEND="Agg")
    return env


@pytest.mark.timeout(600)
def test_check_runs_in_the_edition(edition):
    path = edition / "notebooks" / "01_collectives" / "01_collectives.ipynb"
    proc = subprocess.run([sys.executable, "-m", "autograder", "check", str(path)], cwd=edition,
                          env=_edition_env(edition), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Local estimate: 0 / " in proc.stdout and "NotImplementedError" in proc.stdout, proc.stdout


@pytest.mark.timeout(600)
def test_pip_install_of_the_edition(edition, tmp_path):
    """The Colab line, ``%pip install git+URL``, on a git repository made from the edition as it is written (its
    ``.gitignore`` included): the packages install and work."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(edition, repo)
    git = ["git", "-c", "user.name=Instructor", "-c", "user.email=instructor@example.org",
           "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "Course"]):
        proc = subprocess.run(git + args, cwd=repo, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                           "--target", str(target), f"git+{repo.as_uri()}"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    code = (NO_EDITABLE_FINDER + "import importlib.util, labsupport, autograder, autograder.check, labsupport.plots\n"
            f"assert labsupport.__file__.startswith({str(target)!r}), labsupport.__file__\n"
            "assert importlib.util.find_spec('autograder.checks') is None\n"
            "print(labsupport.run(lambda: 1 + 1, world_size=2, timeout=60))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(target)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[2, 2]" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "autograder", "--help"], cwd=tmp_path, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(target)))
    assert proc.returncode == 0 and "check" in proc.stdout and "student-edition" not in proc.stdout, proc.stderr
    code = (NO_EDITABLE_FINDER + "from autograder.__main__ import lab_extras_hint\nprint(lab_extras_hint())\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(target)))
    assert f'"distributed-training-course[lab] @ git+{repo.as_uri()}"' in proc.stdout, proc.stdout + proc.stderr


def _lab_config(config_path) -> dict:
    """What a lab started with ``JUPYTER_CONFIG_PATH=config_path`` (None: unset) loads: nbgrader's server
    extensions (enabled or not) and the lab plugins its page config disables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER_CONFIG")}
    if config_path:
        env["JUPYTER_CONFIG_PATH"] = str(config_path)
    # what ServerApp itself decides from the config files on its path (as when the lab starts)
    code = ("import json; from jupyter_server.serverapp import ServerApp; app = ServerApp(); app.load_config_file(); "
            "app.find_server_extensions(); print(json.dumps(app.jpserver_extensions))")
    found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    server = {k: v for k, v in json.loads(found.stdout.strip().splitlines()[-1]).items() if k.startswith("nbgrader")}
    code = ("import json; from jupyterlab_server.config import get_page_config; "
            "print(json.dumps(get_page_config([]).get('disabledExtensions', {})))")
    page = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert page.returncode == 0, page.stderr
    disabled = json.loads(page.stdout.strip().splitlines()[-1])
    if isinstance(disabled, list):
        disabled = {name: True for name in disabled}
    return {"server": server, "disabled": {k for k, v in disabled.items() if v}}


def test_the_students_lab_leaves_out_the_instructors_nbgrader_tools(edition):
    """``./course lab`` in the edition puts its ``.jupyter/`` on ``JUPYTER_CONFIG_PATH``: formgrader, Create
    Assignment and the course and assignment lists are off, Validate and its config stay; the instructor's lab (the
    repository, no such folder) keeps everything."""
    from autograder.edition import INSTRUCTOR_LAB_PLUGINS, INSTRUCTOR_SERVER_EXTENSIONS, JUPYTER_DIR

    assert 'JUPYTER_CONFIG_PATH="$here/.jupyter' in (edition / "course").read_text()
    assert (edition / "nbgrader_config.py").is_file()
    student = _lab_config(edition / JUPYTER_DIR)
    for name in INSTRUCTOR_SERVER_EXTENSIONS:
        assert student["server"].get(name) is False, (name, student)
    assert student["server"].get("nbgrader.server_extensions.validate_assignment") is True, student
    assert set(INSTRUCTOR_LAB_PLUGINS) <= student["disabled"], student
    assert "@jupyter/nbgrader:validate-assignment" not in student["disabled"]
    code = ("from nbgrader.server_extensions.validate_assignment.handlers import ValidateAssignmentHandler as H; "
            "print(H.load_config(None).Execute.timeout)")   # Validate reads the server's folder: the edition
    timeout = subprocess.run([sys.executable, "-c", code], cwd=edition, capture_output=True, text=True, timeout=120)
    assert timeout.stdout.split()[-1:] == ["180"], timeout.stdout + timeout.stderr

    assert not (REPO / JUPYTER_DIR).exists()
    instructor = _lab_config(None)
    for name in INSTRUCTOR_SERVER_EXTENSIONS:
        assert instructor["server"].get(name) is True, (name, instructor)
    assert not set(INSTRUCTOR_LAB_PLUGINS) & instructor["disabled"], instructor
