"""What a student meets, in Chinese after ``use_language("zh")`` (or the notebook's own call of it), and the same
paths in English, word for word as before: a rank's error and a deadlock report (from workers started before the
language was chosen: each call hands the ranks the notebook's environment), a visible test and Validate's checklist
in a kernel, ``python -m autograder check``'s report, the feedback page's headings. The catalog itself is checked in
``test_message_catalog.py``."""

import sys
from pathlib import Path

import pytest

import labsupport
from labsupport.i18n import use_language

ROOT = Path(__file__).resolve().parent.parent


def language_and_pid():
    import os

    from labsupport.i18n import language

    return language(), os.getpid()


def raise_on_rank_1():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 is unhappy")
    dist.recv(torch.zeros(1), src=1)   # waits for rank 1: stopped by the launcher


def _cannot_be_rebuilt():
    raise RuntimeError("cannot be rebuilt here")


class Unpicklable:
    """An argument that pickles in the notebook and fails to unpickle on the ranks."""

    def __reduce__(self):
        return _cannot_be_rebuilt, ()


def recv_from_each_other():
    import torch
    import torch.distributed as dist

    dist.recv(torch.zeros(1), src=1 - dist.get_rank())


@pytest.mark.slow   # the English path is in the quick loop (test_launch.py); this is its Chinese twin
@pytest.mark.timing
def test_a_rank_s_error_in_chinese_from_workers_started_in_english(monkeypatch):
    monkeypatch.setenv("LABSUPPORT_LANG", "en")
    before = labsupport.run(language_and_pid, world_size=2)
    use_language("zh")
    after = labsupport.run(language_and_pid, world_size=2)
    assert [lang for lang, _pid in before] == ["en", "en"] and [lang for lang, _pid in after] == ["zh", "zh"]
    assert [pid for _lang, pid in after] == [pid for _lang, pid in before]   # the same workers
    for lang, head, traceback, stopped in [
            ("zh", "rank 1 抛出 ValueError: rank 1 is unhappy", "rank 1 上的回溯（最近的调用在最后）：", "rank [0] 已被停止。"),
            ("en", "rank 1 raised ValueError: rank 1 is unhappy", "Traceback on rank 1 (most recent call last):",
             "Ranks [0] were stopped.")]:
        use_language(lang)
        with pytest.raises(labsupport.WorkerError) as info:
            labsupport.run(raise_on_rank_1, world_size=2, timeout=120)
        text = str(info.value)
        assert text.startswith(head + "\n\n" + traceback + "\n"), text
        assert text.endswith("\n\n" + stopped), text
    for lang, head in [("zh", "rank 0 在反序列化函数时抛出 RuntimeError: cannot be rebuilt here"),
                       ("en", "rank 0 raised RuntimeError: cannot be rebuilt here while unpickling the function")]:
        use_language(lang)
        with pytest.raises(labsupport.WorkerError) as info:
            labsupport.run(language_and_pid, Unpicklable(), world_size=2, timeout=120)
        assert str(info.value).startswith(head), str(info.value)


@pytest.mark.slow   # the English path is in the quick loop (test_launch.py); this is its Chinese twin
@pytest.mark.timing
def test_a_deadlock_report_in_chinese(settled_timeouts, monkeypatch):
    monkeypatch.setenv("LABSUPPORT_LANG", "en")
    labsupport.run(language_and_pid, world_size=2)
    for lang, head, blocked, stack, advice in [
            ("zh", "2 秒后，2 个 rank 中仍有 2 个在运行：很可能是死锁（某个 rank 在等待一条永远不会到来的消息）。",
             "  rank 0: 阻塞在 recv(src=1)（1 float32），位于 ", "rank 1 的调用栈（最近的调用在最后）：",
             "所有 rank 都已被停止；下一次调用会启动新的工作进程。"),
            ("en", "2 of 2 ranks were still running after 2 s: probably a deadlock (a rank waiting for a message that "
             "never comes).", "  rank 0: blocked in recv(src=1) of 1 float32 at ",
             "Stack of rank 1 (most recent call last):",
             "All ranks were stopped; the next call starts fresh workers.")]:
        use_language(lang)
        with pytest.raises(labsupport.WorkerTimeout) as info:
            labsupport.run(recv_from_each_other, world_size=2, timeout=2)
        text = str(info.value)
        assert text.startswith(head) and text.endswith(advice), text
        assert blocked in text and f"\n\n{stack}\n" in text, text


def _validate(tmp_path, lang):
    """Validate's run (every cell, ``NBGRADER_VALIDATING=1``) of a notebook whose exercise ``f`` is not written and
    whose ``g`` raises on rank 0, in ``lang`` (``None``: the notebook chooses none): (what f's visible test printed,
    g's visible test's error, the checklist)."""
    import nbformat
    from nbclient import NotebookClient

    setup = "import labsupport\nimport torch.distributed as dist\n%load_ext labsupport"
    if lang:
        setup += f"\nfrom labsupport.i18n import use_language\nuse_language({lang!r})"
    cells = [setup, "def f():\n    raise NotImplementedError()", "%%visible_test f\nassert f() == 1",
             "def g():\n    if dist.get_rank() == 0:\n        raise ValueError('g is wrong')\n    return 1",
             "%%visible_test g\nlabsupport.run(lambda: g(), world_size=2, timeout=60)",
             'labsupport.require_passed("f")', 'labsupport.require_passed("g")']
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbformat.write(nb, tmp_path / "exercises.ipynb")   # Validate's kernel finds the order of the exercises here
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NBGRADER_VALIDATING", "1")
        NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(tmp_path)}}).execute()

    def error(cell):
        return "\n".join(line for o in cell.outputs if o.output_type == "error" for line in o.traceback)

    printed = "".join(o.get("text", "") for o in nb.cells[2].outputs if o.output_type == "stream")
    return printed, error(nb.cells[4]), error(nb.cells[6])


@pytest.mark.usefixtures("kernels_share_a_fork_server")
@pytest.mark.slow
@pytest.mark.parametrize("lang", ["zh", None])
def test_visible_tests_and_validate_s_checklist_in_the_notebook_s_language(tmp_path, monkeypatch, lang):
    monkeypatch.delenv("LABSUPPORT_LANG", raising=False)
    printed, failed, checklist = _validate(tmp_path, lang)
    if lang == "zh":
        assert printed.strip() == ("f 尚未开始：它仍然抛出 NotImplementedError。它的可见测试被跳过，笔记本继续运行；Validate 和"
                                   "评分器会把它算作未完成。")
        assert "WorkerError: rank 0 抛出 ValueError: g is wrong\n\nrank 0 上的回溯（最近的调用在最后）：" in failed, failed
        assert checklist.splitlines()[:5] == [
            "2 个练习中有 0 个通过了可见测试（Validate 在一个全新的内核中从头运行了这个笔记本）：",
            "  f  尚未开始：它仍然抛出 NotImplementedError", "  g  未通过：rank 0 抛出 ValueError: g is wrong", "",
            "第一个失败，g："], checklist
    else:
        assert printed.strip() == ("f is not started: it still raises NotImplementedError. Its visible test is skipped "
                                   "and the notebook goes on; Validate and the grader count it as not done.")
        assert "WorkerError: rank 0 raised ValueError: g is wrong\n\nTraceback on rank 0 (most recent call last):" \
            in failed, failed
        assert checklist.splitlines()[:5] == [
            "0 of 2 exercises pass their visible tests (Validate ran this notebook from the top in a fresh kernel):",
            "  f  not started: it still raises NotImplementedError", "  g  fails: rank 0 raised ValueError: g is wrong",
            "", "The first failure, g:"], checklist


@pytest.mark.slow
@pytest.mark.parametrize("lang", ["zh", None])
def test_check_s_report_in_the_notebook_s_language(tmp_path, monkeypatch, lang, graders_env):
    """``python -m autograder check`` of an untouched notebook: Chinese when the notebook chooses Chinese."""
    import nbformat

    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    import demo_submissions as demo

    monkeypatch.delenv("LABSUPPORT_LANG", raising=False)
    nb = demo.release()
    if lang:
        setup = f"from labsupport.i18n import use_language\nuse_language({lang!r})"
        nb.cells.insert(0, nbformat.v4.new_code_cell(setup))
    (tmp_path / demo.DEMO).mkdir()
    path = tmp_path / demo.DEMO / f"{demo.DEMO}.ipynb"
    nbformat.write(nb, path)
    proc = demo.cli("check", path, env=graders_env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    if lang == "zh":
        assert lines[0] == f"正在一个全新的内核中检查 {path}（这会运行每个单元格，可能需要一分钟）……"
        add = ["  add             1 分  FAIL  `test_add_visible`: 尚未开始：它仍然抛出 NotImplementedError",
               "                         另外：`test_add`: 尚未开始：它仍然抛出 NotImplementedError"]
        estimate = "本地估计：可见测试得到 0 / 5 分。"
    else:
        assert lines[0] == f"Checking {path} in a fresh kernel (this runs every cell; it can take a minute)..."
        add = ["  add             1 pts  FAIL  `test_add_visible`: not started: it still raises NotImplementedError",
               "                         also: `test_add`: not started: it still raises NotImplementedError"]
        estimate = "Local estimate: 0 / 5 points from the visible tests."
    assert lines[1:3] == add, proc.stdout
    assert estimate in lines, proc.stdout


def test_the_feedback_page_s_headings(monkeypatch):
    from autograder import feedback

    summary = feedback.Summary("ada", "99_demo", 1, 3, "failed", "the kernel died",
                               [feedback.TestOutcome("t1", 1, 1), feedback.TestOutcome("t2", 0, 2, "no")], ["late"],
                               ["t2"])
    monkeypatch.setenv("LABSUPPORT_LANG", "en")
    page = feedback.render(summary)
    for text in ['<html lang="en">', "<h1>Feedback: 99_demo</h1>", "<th>test</th><th>points</th><th>result</th>",
                 '<span class="ok">passed</span>', '<span class="bad">failed</span>: no',
                 "<strong>Not graded automatically.</strong> the kernel died", "<p>Notes from the grader:</p>",
                 "<strong>Flagged for review.</strong> Your instructor will look", "Student: <strong>ada</strong>"]:
        assert text in page, text
    use_language("zh")
    page = feedback.render(summary)
    for text in ['<html lang="zh-CN">', "<h1>反馈：99_demo</h1>", "<th>测试</th><th>分数</th><th>结果</th>",
                 '<span class="ok">通过</span>', '<span class="bad">未通过</span>: no',
                 "<strong>未能自动评分。</strong> the kernel died", "<p>评分器的说明：</p>",
                 "<strong>已标记，待复核。</strong> 你的老师会查看", "学生： <strong>ada</strong>"]:
        assert text in page, text
