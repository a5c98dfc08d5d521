"""``save_sharded`` / ``load_resharded`` (09, exercise 4): the plan of a check (sizes, dtypes, world sizes), the
saving and loading probes, and ``check_save_sharded``.

Both functions run in the sandbox (``drivers.save_watched``, ``drivers.load_measured``), which may read and write
the folder the checkpoint lies in (``shared``) besides its own. The host reads what the kernel counted for the
sandbox at the barriers around a load: the bytes it read (``rchar`` of ``/proc/<pid>/io``: everything passed
through ``read`` and its kind, whichever code made the call) and its peak resident memory (``VmHWM``, reset through
``clear_refs`` first; a memory-mapped file counts once its pages are touched). The paths a save opened for writing
are its driver's report (an audit hook beside the student's code): they only word an honest mistake, the metadata
written by every rank.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile

import torch

from labsupport import CommCounter, _sandbox

from .._common import BUILT_INS, draw_seed, in_sandbox, run_on_workers, share, short
from .._common import stop_if_any as _stop_if_any
from . import drivers
from .crashes import check_crashes
from .reference import _padded_shard, _values, call_disk, only_shared

#: Seconds per probe: the checkpoint probes move tens of MB through the file system of a loaded machine.
PROBE_TIMEOUT_PRODUCTION = 60.0


def _load_after_save(load_resharded, *args, world_size: int, what: str) -> None:
    """``_load_probe`` on workers right after a save returned on every rank: a missing file then means rank 0 made
    the checkpoint current before every rank had written (whether the loader sees it depends on timing)."""
    try:
        run_on_workers(_load_probe, load_resharded, *args, world_size=world_size, what=what,
                       timeout=PROBE_TIMEOUT_PRODUCTION)
    except AssertionError as exc:
        if "FileNotFoundError" not in str(exc) and "No such file" not in str(exc):
            raise
        raise AssertionError(f"{exc} A file of the checkpoint is missing after save_sharded returned on every rank: "
                             "rank 0 made the new checkpoint the current one before every rank had written its file. "
                             "Wait for every rank (dist.barrier()) before the rename.") from None


def _save_probe(save, numel, dtype_name, tag, directory, die_rank=None):
    """Every rank saves its shard of checkpoint ``tag`` (``drivers.save_watched``; ``die_rank``'s sandbox is killed
    a second after the call began); the paths each rank opened for writing, as its driver saw them, show a file that
    several ranks wrote."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    shard = _padded_shard(_values(numel, getattr(torch, dtype_name), tag), rank, world)
    keep = shard.clone()
    written = call_disk(f"save_sharded(shard, {numel}, directory) on {world} ranks", save, shard, numel, directory,
                        rank == die_rank)
    failure = None
    if not torch.equal(shard, keep):  # the shard as the sandbox left it, copied back onto the host's
        failure = f"save_sharded changed rank {rank}'s shard: leave the tensor you are given untouched."
    reports = share((sorted(set(written)) if isinstance(written, list) else [], failure))
    if any(f for _, f in reports):
        raise AssertionError(next(f for _, f in reports if f))
    by_path = {}
    for r, (paths, _) in enumerate(reports):
        for p in paths:
            by_path.setdefault(p, []).append(r)
    twice = sorted((p, rs) for p, rs in by_path.items() if len(rs) > 1)
    if twice and rank == 0:
        path, ranks = twice[0]
        raise AssertionError(f"save_sharded on {world} ranks: ranks {ranks} all wrote {os.path.basename(path)} "
                             f"({len(twice)} file(s) written by more than one rank): the metadata is the same for "
                             "every rank, write it once, on rank 0; every other file belongs to one rank.")
    return None


class _Readings(CommCounter):
    """The sandbox's counters read by the host at the barriers of ``drivers.load_measured`` (the sandbox waits for
    the host meanwhile): at the first, its peak reset and its resident size and bytes read; at the last, its peak
    and bytes read. Nothing without a sandbox."""

    def __init__(self):
        super().__init__()
        self.start, self.end, self.reset = None, None, False

    def enter(self, call) -> None:
        super().enter(call)
        if call.is_comm and not call.in_comm and call.kind == "barrier" and _sandbox.pid() is not None:
            if self.start is None:
                self.reset = _sandbox.reset_peak()
                self.start = (_sandbox.memory(), _sandbox.io())
            else:
                self.end = (_sandbox.memory(), _sandbox.io())


def _load_probe(load, numel, dtype_name, tag, directory, saved_world, check_memory, what_before):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    expected = _padded_shard(_values(numel, dtype, tag), rank, world)
    needed = expected.numel() * expected.element_size()
    full_bytes = numel * expected.element_size()
    what = f"load_resharded(directory) on {world} ranks of a checkpoint saved on {saved_world}{what_before}"
    # a first call warms up what any loader needs once (imports read .py files, the allocator grows its arenas);
    # the second is measured
    load(directory)
    with _Readings() as readings:
        outcome = load(directory)
    failure = None
    got, storage = (outcome[1], outcome[2] if len(outcome) > 2 else None) if outcome[0] == "ok" else (None, None)
    if outcome[0] != "ok":
        hint = only_shared(outcome[1])
        failure = f"{what} raised {outcome[1]} on rank {rank}: {outcome[2]}{hint}"
    elif not isinstance(got, torch.Tensor):
        failure = f"{what}: rank {rank} got {short(got)}: return this rank's shard as a 1-D tensor."
    elif got.dtype != dtype:
        failure = (f"{what}: rank {rank} got dtype {got.dtype}, the checkpoint holds {dtype}: keep the dtype in the "
                   "metadata.")
    elif got.dim() != 1 or got.numel() != expected.numel():
        failure = (f"{what}: rank {rank} got shape {tuple(got.shape)}, expected ({expected.numel()},): with M = "
                   f"{world} ranks each holds c = ceil({numel}/{world}) = {expected.numel()} elements, padding "
                   "included.")
    elif not torch.equal(got, expected):
        bad = (got != expected).nonzero()
        i = int(bad[0]) if len(bad) else 0
        g = rank * expected.numel() + i
        failure = (f"{what}: rank {rank}'s element {i} (element {g} of the padded parameter) is {got[i].item()!r}, "
                   f"expected {expected[i].item()!r}"
                   + (" (padding must be zero)" if g >= numel else
                      (f" (from checkpoint {'A' if tag == 1 else 'B'}, saved earlier)" if what_before else "")
                      + f": rank r of M needs elements [r*c, (r+1)*c) of the parameter; element e sits in the file "
                        f"of saving rank e // c_saved at position e % c_saved") + ".")
    elif isinstance(storage, int) and storage > needed + 64:  # as the driver saw it: it words an honest mistake
        failure = (f"{what}: rank {rank}'s shard is a view of a buffer of {storage} bytes, its own {needed}: the "
                   "rest stays in memory; read only your range (or .clone() the slice).")
    elif readings.start is not None:  # what the kernel counted for the sandbox, read by the host
        (memory0, io0), (memory1, io1) = readings.start, readings.end or (None, None)
        if (io0 is None or io1 is None) and os.path.exists("/proc/self/io"):  # it counts the host, not the sandbox
            failure = (f"{what}: rank {rank}'s process hid its counters from the grader (/proc/<pid>/io): the bytes a "
                       "load reads are part of the exercise.")
        elif io0 is not None and io1 is not None and io1["rchar"] - io0["rchar"] > needed * 1.25 + 128 * 1024:
            failure = (f"{what}: rank {rank} read {io1['rchar'] - io0['rchar']} bytes from files (the kernel's count), "
                       f"its shard is {needed} bytes and the parameter {full_bytes}: seek to the byte ranges this rank "
                       "needs and read only those (f.seek(offset); f.read(nbytes), or np.fromfile(f, dtype, count, "
                       "offset)).")
        elif check_memory and world >= 4 and readings.reset and memory0 and memory1:
            grown = memory1["peak"] - memory0["rss"]
            if grown > 2.5 * needed + (2 << 20) and grown > 0.6 * full_bytes:
                failure = (f"{what}: rank {rank}'s memory grew by {grown / 2**20:.1f} MiB during the load (the peak "
                           f"the kernel saw), its shard is {needed / 2**20:.1f} MiB and the whole parameter "
                           f"{full_bytes / 2**20:.1f} MiB: never build the full parameter; read each needed range "
                           "straight into your shard.")
    _stop_if_any(failure)
    return None


def _checkpoint_plan(seed: int):
    """Two dtypes (the first checkpoint's and the second's, never the same: a loader must take the saved one), Ψ,
    the world sizes of the first save, of two loads and of the second save."""
    rng = random.Random(seed)
    dtype = rng.choice(["float32", "float32", "float64"])
    second_dtype = rng.choice({"float32": ["bfloat16", "float16"], "float64": ["float32", "bfloat16"]}[dtype])
    elt = 4 if dtype == "float32" else 8
    numel = rng.randint(3 << 20, 4 << 20) // elt * 4 + rng.choice([1, 3, 5, 7])  # about 12-16 MB, never even
    while numel % 3 == 0 or numel % 5 == 0:  # and split unevenly on every world size drawn (2 to 5): each plain
        numel += 2  # load then shows a wrong split of the parameter itself, before the crash trials
    first = rng.choice([2, 3])
    # the first load on 4 or 5 ranks: a shard is then at most a quarter of the parameter, so building the whole
    # parameter shows clearly in the peak memory
    loads = [rng.choice([4, 5]), rng.choice([w for w in (1, 2, 3, 4, 5) if w != first])]
    second = rng.choice([w for w in (2, 3, 4) if w != first])
    return (dtype, second_dtype), numel, first, loads, second


def check_save_sharded(save_sharded, load_resharded):
    """A checkpoint saved on N ranks loaded on M != N (odd sizes, padding): exact shards, only the needed bytes read,
    no full parameter in memory, metadata written once; a save killed half-way leaves the previous checkpoint; a
    save over a checkpoint of another world size and dtype replaces it; a crash at any step of a save leaves the
    previous checkpoint or the new one (``crashes``). Both functions run in the sandbox, which reads and writes the
    folder the checkpoint lies in besides its own."""
    seed = draw_seed()
    (dtype, second_dtype), numel, first, loads, second = _checkpoint_plan(seed)
    base = os.path.realpath(tempfile.mkdtemp(prefix="ckpt-check-"))
    directory = os.path.join(base, "checkpoint")
    what = f"save_sharded / load_resharded (seed {seed}, Ψ = {numel}, {dtype} then {second_dtype})"
    save = in_sandbox(save_sharded, "save_sharded", driver=drivers.save_watched, forbid=BUILT_INS["save_sharded"],
                      shared=[base])
    load = in_sandbox(load_resharded, "load_resharded", driver=drivers.load_measured,
                      forbid=BUILT_INS["load_resharded"], shared=[base])
    try:
        run_on_workers(_save_probe, save, numel, dtype, 1, directory, world_size=first, what=what,
                       timeout=PROBE_TIMEOUT_PRODUCTION)
        if not os.path.exists(directory):
            raise AssertionError(f"{what}: after save_sharded(shard, numel, directory) on {first} ranks, nothing is "
                                 "at directory: save the checkpoint there (a directory of files).")
        _load_after_save(load, numel, dtype, 1, directory, first, True, "", world_size=loads[0], what=what)
        # a save of checkpoint B during which one rank is killed: A must still load, with A's values
        die = first - 1
        try:
            run_on_workers(_save_probe, save, numel, second_dtype, 2, directory, die_rank=die,
                           world_size=first, what=what, timeout=PROBE_TIMEOUT_PRODUCTION)
        except AssertionError:
            pass  # expected: rank `die` was killed, and the others stopped (or failed) in their save
        else:
            raise AssertionError(f"{what}: save_sharded returned on every rank though rank {die} was killed before it "
                                 "saved anything: wait for every rank (dist.barrier()) before making the new "
                                 "checkpoint the current one.")
        try:
            run_on_workers(_load_probe, load, numel, dtype, 1, directory, first, False,
                           f", after a save of new values was interrupted (rank {die} was killed before it wrote)",
                           world_size=loads[1], what=what, timeout=PROBE_TIMEOUT_PRODUCTION)
        except AssertionError as exc:
            raise AssertionError(f"{exc} A save interrupted half-way must leave the previous checkpoint as it was: "
                                 "write every file under a temporary name (or directory) first and make it the "
                                 "checkpoint with os.replace / os.rename only after every rank has written "
                                 "(dist.barrier()), on rank 0.") from None
        # a complete save of B on another world size, over A: B loads
        run_on_workers(_save_probe, save, numel, second_dtype, 2, directory, world_size=second, what=what,
                       timeout=PROBE_TIMEOUT_PRODUCTION)
        _load_after_save(load, numel, second_dtype, 2, directory, second, True,
                         f", saved in {second_dtype} over an older checkpoint of {first} ranks in {dtype}",
                         world_size=first, what=what)
        check_crashes(save_sharded, load_resharded, seed, f"save_sharded / load_resharded (seed {seed})", base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
