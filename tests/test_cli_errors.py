"""Bad output paths for ``python -m autograder grade``: a one-line ``error:`` and exit status 2, no traceback.

The other bad-input cases are in test_grading.py.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import demo_submissions as demo  # noqa: E402


def _one_line_error(proc, *expected):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for text in expected:
        assert text in lines[0], lines[0]


@pytest.mark.parametrize("below", [False, True], ids=["out-is-a-file", "out-is-below-a-file"])
def test_grade_out_is_a_file(tmp_path, below):
    demo.write(tmp_path / "subs", {"alice": "good"})
    existing = tmp_path / "grades.txt"
    existing.write_text("not a folder\n")
    out = existing / "run1" if below else existing
    proc = demo.cli("grade", tmp_path / "subs", "--course", demo.COURSE, "--out", out)
    _one_line_error(proc, "--out", str(out), "exists and is not a directory")
    assert existing.read_text() == "not a folder\n"
