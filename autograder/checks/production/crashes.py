"""A crash at every step of a save (09, exercise 4): the previous checkpoint or the new one must load, complete.

A small checkpoint A is saved on 3 ranks; then B (another dtype, other values) is saved over it on 2 ranks, in
sandboxes that may write only the folder the checkpoint lives in. Each sandbox's driver (``drivers.save_stopped``:
an audit hook) stops the save just before each step that changes what is on disk and marks it; at the mark the
rank's host, which the sandbox waits for, copies the whole folder: what a crash of the job at that moment would
leave. An ``open`` that creates or empties a file gives a second copy with that file empty (a crash while it was
being written). The hosts take those copies one at a time (a lock file); a copy during which another rank renamed or
deleted something is taken again, so that every copy is a state the folder was really in. Then ``load_resharded``
on 3 ranks, in sandboxes that may read the copies, reads each distinct state: every rank must get its shard of A, or
every rank its shard of B. The moments are the save's own file-system calls as Python announces them: a save that
changed the disk where Python raises no audit event (through ``ctypes``) would be stopped at fewer points.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile

import torch

from labsupport import CommCounter

from .._common import BUILT_INS, in_sandbox, run_on_workers, short
from . import drivers
from .reference import _padded_shard, _values, call_disk

#: Seconds per probe of the crash sweep: a few hundred elements, but dozens of copies on a loaded machine.
PROBE_TIMEOUT_CRASHES = 60.0


def _listing(root: str) -> list:
    """Every name under ``root`` with its inode (and a symlink's target): what a rename or a delete changes."""
    out = []
    for folder, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
                link = os.readlink(path) if os.path.islink(path) else None
            except OSError:
                continue
            out.append((os.path.relpath(path, root), st.st_ino, link))
    return sorted(out)


def _copy(src: str, dst: str) -> None:
    """``src`` copied to ``dst``, symlinks as symlinks (an absolute one into ``src`` pointing into ``dst``)."""
    shutil.copytree(src, dst, symlinks=True)
    for folder, dirs, files in os.walk(dst):
        for name in dirs + files:
            path = os.path.join(folder, name)
            target = os.readlink(path) if os.path.islink(path) else None
            if target and os.path.isabs(target) and (target + os.sep).startswith(src + os.sep):
                os.remove(path)
                os.symlink(dst + target[len(src):], path)


def _fingerprint(root: str) -> str:
    """The names, symlink targets and file contents under ``root``: equal for equal states."""
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        for name in sorted(dirs + files):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, root).encode() + b"\0")
            if os.path.islink(path):
                h.update(b"link:" + os.readlink(path).encode())
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _snapshotter(root: str, states: str, lock: str, taken: list):
    """What a host does at each mark of ``drivers.save_stopped``: copy ``root`` into ``states``."""
    import fcntl

    def take(description: str, emptied: str | None) -> None:
        with open(lock, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            try:
                for version in ((False, True) if emptied else (False,)):
                    name = os.path.join(states, f"{len(os.listdir(states)):04d}")
                    for _ in range(50):  # again while another rank renamed or deleted something during the copy
                        shutil.rmtree(name, ignore_errors=True)
                        before = _listing(root)
                        try:
                            _copy(root, name)
                        except (OSError, shutil.Error):
                            continue
                        if _listing(root) == before:
                            break
                    if version:  # the path comes from the sandbox: emptied only inside the copy, never through a link
                        target = os.path.normpath(os.path.join(name, os.path.relpath(emptied, root)))
                        try:
                            inside = os.path.join(os.path.realpath(os.path.dirname(target)), "")
                            if inside.startswith(os.path.join(os.path.realpath(name), "")):
                                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW))
                        except OSError:
                            pass
                    taken.append((os.path.basename(name), description, version))
            finally:
                fcntl.flock(held, fcntl.LOCK_UN)

    return take


class _Stops(CommCounter):
    """Calls ``take(description, emptied)`` at each mark of ``drivers.save_stopped``: a broadcast on this rank's own
    group whose bytes name the step (longer than the scenario marks)."""

    def __init__(self, rank: int, take):
        super().__init__()
        self.rank, self.take = rank, take

    def enter(self, call) -> None:
        super().enter(call)
        if call.is_comm and not call.in_comm and call.kind == "broadcast" and tuple(call.group) == (self.rank,) \
                and call.nbytes > len(drivers.STEPPED):
            try:  # ProcessGroup.broadcast([tensor], options)
                description, emptied = json.loads(call.args[0][0].numpy().tobytes().decode())
            except (IndexError, TypeError, AttributeError, ValueError):
                return
            self.take(str(description), emptied if isinstance(emptied, str) else None)


def _save_probe(save, numel, dtype_name, tag, directory, root=None, states=None, lock=None):
    """Every rank saves its shard of checkpoint ``tag``; with ``states``, ``root`` copied there at each step."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    shard = _padded_shard(_values(numel, getattr(torch, dtype_name), tag), rank, world)
    what = f"save_sharded(shard, {numel}, directory) on {world} ranks"
    if states is None:
        call_disk(what, save, shard, numel, directory)
        return []
    taken = []
    with _Stops(rank, _snapshotter(os.path.realpath(root), states, lock, taken)):
        call_disk(what, save, shard, numel, directory, root)
    return taken


def _load_probe(load, numel, versions, directories):
    """For each directory, what ``load_resharded`` gave this rank: "A", "B", or what went wrong."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    shards = {name: _padded_shard(_values(numel, getattr(torch, dtype), tag), rank, world)
              for name, (dtype, tag) in versions.items()}
    out = []
    for outcome in load(directories):
        if outcome[0] != "ok":
            out.append(f"rank {rank} raised {outcome[1]}: {str(outcome[2])[:300]}")
            continue
        got = outcome[1]
        for name, shard in shards.items():
            if isinstance(got, torch.Tensor) and got.dtype == shard.dtype and got.shape == shard.shape and \
                    torch.equal(got, shard):
                out.append(name)
                break
        else:
            out.append(f"rank {rank} got {short(got)}, neither checkpoint's shard")
    return out


def _outcome(verdicts: list) -> str | None:
    """None when every rank loaded A or every rank B, else what went wrong, in words."""
    if all(v == "A" for v in verdicts) or all(v == "B" for v in verdicts):
        return None
    wrong = [v for v in verdicts if v not in ("A", "B")]
    if wrong:
        return wrong[0]
    old = [r for r, v in enumerate(verdicts) if v == "A"]
    return f"ranks {old} loaded the previous checkpoint and the others the new one"


def check_crashes(save_sharded, load_resharded, seed: int, what: str, shared: str) -> None:
    """A crash just before every step of a save of B over A (and while each file it creates is written): the folder
    then loads as A or as B on every rank. The saves run in ``shared``, a folder the caller's sandboxes already
    share (so they are kept); the copies lie elsewhere, open to the loads' sandboxes only."""
    rng = random.Random(seed)
    numel = 2 * rng.randint(150, 400) + 1
    dtype_a, dtype_b = rng.choice([("float32", "float64"), ("float64", "float32"), ("float32", "bfloat16")])
    base = os.path.realpath(tempfile.mkdtemp(prefix="ckpt-crashes-"))
    root, states, lock = os.path.join(shared, "crashes"), os.path.join(base, "states"), os.path.join(base, "lock")
    directory = os.path.join(root, "checkpoint")
    label = f"{what}, a crash at every step of a save (Ψ = {numel})"
    try:
        os.makedirs(root)
        os.makedirs(states)
        plain = in_sandbox(save_sharded, "save_sharded", driver=drivers.save_watched, forbid=BUILT_INS["save_sharded"],
                           shared=[shared])
        stopped = in_sandbox(save_sharded, "save_sharded", driver=drivers.save_stopped,
                             forbid=BUILT_INS["save_sharded"], shared=[shared])
        loads = in_sandbox(load_resharded, "load_resharded", driver=drivers.load_each,
                           forbid=BUILT_INS["load_resharded"], shared=[states])
        run_on_workers(_save_probe, plain, numel, dtype_a, 1, directory, world_size=3, what=label,
                       timeout=PROBE_TIMEOUT_CRASHES)
        taken = run_on_workers(_save_probe, stopped, numel, dtype_b, 2, directory, root, states, lock,
                               world_size=2, what=label, timeout=PROBE_TIMEOUT_CRASHES)
        points = sorted((name, rank, description, emptied) for rank, steps in enumerate(taken)
                        for name, description, emptied in steps)
        first = {}  # one load per distinct state: its first crash point
        for name, rank, description, emptied in points:
            first.setdefault(_fingerprint(os.path.join(states, name)), (name, rank, description, emptied))
        distinct = sorted(first.values())
        verdicts = run_on_workers(_load_probe, loads, numel, {"A": (dtype_a, 1), "B": (dtype_b, 2)},
                                  [os.path.join(states, name, "checkpoint") for name, *_ in distinct],
                                  world_size=3, what=label, timeout=PROBE_TIMEOUT_CRASHES)
        for i, (name, rank, description, emptied) in enumerate(distinct):
            problem = _outcome([v[i] for v in verdicts])
            if problem is None:
                continue
            before = [d for n, r, d, e in points if r == rank and not e and n < name]
            before = before[:-1] if emptied else before  # the open itself
            done = "; ".join(before[-3:]) or "nothing yet"
            when = (f"while rank {rank} was writing {description[len('opened '):-len(' for writing')]} (left empty)"
                    if emptied else f"just before rank {rank} {description}")
            raise AssertionError(
                f"{label}: a crash {when} (its steps before: {done}) leaves a folder that load_resharded on 3 ranks "
                f"reads as neither checkpoint: {problem}. A save must leave the previous checkpoint or the new one, "
                "complete, whatever step it is stopped at: write every new file under a new name, make the new "
                "checkpoint current with one atomic rename (os.replace) on rank 0 once every rank has written "
                "(dist.barrier()), and delete the old files only after that rename.")
    finally:
        shutil.rmtree(base, ignore_errors=True)

