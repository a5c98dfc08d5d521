"""``grade --shard K/N`` grades deterministic slices of the students, and ``merge`` joins them into what one run
would have written (the demo course)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import demo_submissions as demo  # noqa: E402

from autograder.course import Course  # noqa: E402
from autograder.grading import discover, shard_of  # noqa: E402


def test_shards_are_a_deterministic_partition(tmp_path):
    subs = demo.write(tmp_path / "subs", {f"s{k:02d}": "good" for k in range(7)})
    tasks = discover(subs, Course.at(demo.COURSE), demo.DEMO)
    slices = [shard_of(tasks, (k, 3)) for k in (1, 2, 3)]
    students = [sorted({t.student for t in s}) for s in slices]
    assert sorted(sum(students, [])) == sorted({t.student for t in tasks})
    assert [len(s) for s in students] == [3, 2, 2]
    assert students == [sorted({t.student for t in shard_of(tasks, (k, 3))}) for k in (1, 2, 3)]


@pytest.mark.parametrize("bad", ["0/2", "3/2", "1/0", "x", "1-2"])
def test_bad_shard(tmp_path, bad):
    demo.write(tmp_path / "subs", {"alice": "good"})
    proc = demo.cli("grade", tmp_path / "subs", "--shard", bad, "--course", demo.COURSE)
    assert proc.returncode == 2 and "--shard" in proc.stderr, proc.stderr


def test_shards_merged_equal_one_run(tmp_path, demo_mix_graded, graders_env):
    """Two shards of the demo's mixed class, merged, are its run with two jobs (``demo_mix_graded``)."""
    MIX = demo_mix_graded.MIX
    outs = []
    for k in (1, 2):
        out = tmp_path / f"shard{k}"
        proc = demo.cli("grade", demo_mix_graded.subs, "--shard", f"{k}/2", "--out", out, "--course", demo.COURSE,
                        env=graders_env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        outs.append(out)
    whole = demo_mix_graded.outputs[2]
    merged = tmp_path / "merged"
    proc = demo.cli("merge", *outs, "--out", merged)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Merged 2 outputs: {len(MIX)} notebooks" in proc.stdout, proc.stdout
    assert (merged / "grades.csv").read_bytes() == (whole / "grades.csv").read_bytes()
    for student in MIX:
        page = f"feedback/{student}/{demo.DEMO}.html"
        assert (merged / page).read_text() == (whole / page).read_text(), student
    assert (merged / "logs").exists() == (whole / "logs").exists()

    from nbgrader.api import Gradebook

    from autograder.nbgrader_config import make_config

    course_id = make_config(str(merged)).CourseDirectory.course_id
    grades = demo.read_grades(whole / "grades.csv")
    with Gradebook(f"sqlite:///{merged / 'gradebook.db'}", course_id) as gb:
        assert sorted(s.id for s in gb.students) == sorted(MIX)
        for student in MIX:
            sub = gb.find_submission(demo.DEMO, student)
            assert sub.score == float(grades[(student, demo.DEMO)]["points"]), student

    # merging the same shard twice is an error, not a double count
    proc = demo.cli("merge", outs[0], outs[0], "--out", tmp_path / "twice")
    assert proc.returncode == 2 and "graded in both" in proc.stderr, proc.stderr


def test_grading_inside_a_slurm_task_is_not_taken_for_a_launch(monkeypatch):
    """A `grade --shard` array task runs with SLURM's variables set; the kernels and judges it starts must not see
    them (labsupport would take the kernel for a rank of a multi-task launch)."""
    from autograder.execute import kernel_env
    from autograder.judge import judge_env

    for key, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "RANK": "0",
                       "WORLD_SIZE": "4", "MASTER_ADDR": "node1", "MASTER_PORT": "29500",
                       "TORCHELASTIC_RUN_ID": "x", "SLURM_ARRAY_TASK_ID": "3"}.items():
        monkeypatch.setenv(key, value)
    for env in (kernel_env(), judge_env(demo.REPO)):
        assert not {"SLURM_PROCID", "SLURM_NTASKS", "RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"} & set(env)
        assert env["SLURM_ARRAY_TASK_ID"] == "3" and env["LABSUPPORT_GRADING"] == "1"
