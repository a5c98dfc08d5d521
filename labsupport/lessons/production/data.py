"""The data of a training run, for notebook 09_production: which rank reads which sample (``plot_sampling``), data
loader workers and their seeds (``AugmentedSamples``, ``loader_draws``), an epoch resumed on another world size
(``resumed_reads``) and evaluation under ``DistributedSampler``'s padding (``evaluation_on_ranks``).
"""

from __future__ import annotations

import torch


def plot_sampling(rows: dict, num_samples: int, ax=None):
    """One row per label (e.g. "epoch 0", "epoch 1, no set_epoch"): which rank reads each sample.
    ``rows`` = {label: [indices of rank 0, indices of rank 1, ...]}."""
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1))
    grid = np.full((len(rows), num_samples), np.nan)
    for i, per_rank in enumerate(rows.values()):
        for rank, indices in enumerate(per_rank):
            for pos, idx in enumerate(indices):
                grid[i, idx] = rank
    ax.imshow(grid, aspect="auto", cmap="tab10", vmin=0, vmax=10, interpolation="nearest")
    ranks = max(len(per_rank) for per_rank in rows.values())
    cmap = plt.get_cmap("tab10")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=cmap(r / 10 + 0.05)) for r in range(ranks)],
              labels=[f"rank {r}" for r in range(ranks)], loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.set_yticks(range(len(rows)), list(rows))
    ax.set_xlabel("sample index (colour: the rank that reads it; white: read by no rank)")
    return ax.figure


# ---------------------------------------------------------------------------------------------------------------
# loader workers and their seeds, an epoch resumed on another world size, evaluation and padding


class AugmentedSamples(torch.utils.data.Dataset):
    """Sample ``i`` of ``n`` is ``(i, draw)``, ``draw`` a random number drawn when the sample is read, as a random
    crop or flip draws its parameters. By default the draw comes from the reading process's torch random state (a
    ``DataLoader`` worker's, seeded by the loader); with ``per_sample_seed`` it comes from a generator seeded with
    (``per_sample_seed``, the epoch set by ``set_epoch``, ``i``), so a sample gets the same draw whichever worker,
    rank or world size reads it, and after a restart."""

    def __init__(self, n: int, per_sample_seed: int | None = None):
        self.n, self.seed, self.epoch = n, per_sample_seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.seed is None:
            draw = torch.rand(())
        else:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) * 1_000_003 + int(i))
            draw = torch.rand((), generator=gen)
        return int(i), round(float(draw), 4)


def _pairs(batch):
    return batch  # keep each batch a list of (index, draw) pairs: no collation into tensors


def loader_draws(indices: list, seed: int = 0, generator_seed: int | None = None, num_workers: int = 2,
                 batch_size: int = 2, per_sample_seed: int | None = None, epoch: int = 0) -> dict:
    """Read the samples ``indices`` of an ``AugmentedSamples`` dataset, in that order, through a ``DataLoader`` with
    ``num_workers`` worker processes, as a rank does right after ``torch.manual_seed(seed)`` (every rank seeds alike
    so that its model starts alike). The loader gets ``generator=torch.Generator().manual_seed(generator_seed)``
    when ``generator_seed`` is given, else none. Returns ``{"draws": [(index, draw), ...] in reading order,
    "global_rng_moved": whether creating the loader's iterator drew from the global random state}``. The caller's
    global random state is left as it was."""
    from torch.utils.data import DataLoader

    dataset = AugmentedSamples(max(indices) + 1, per_sample_seed)
    dataset.set_epoch(epoch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        before = torch.get_rng_state()
        gen = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=list(indices), num_workers=num_workers,
                            generator=gen, collate_fn=_pairs)
        batches = iter(loader)  # the workers start here, each seeded with base_seed + worker id
        moved = not torch.equal(before, torch.get_rng_state())
        draws = [pair for batch in batches for pair in batch]
    return {"draws": draws, "global_rng_moved": moved}


def resumed_reads(shard, num_samples: int, batch: int, steps_done: int, world_before: int, world_after: int,
                  epoch: int = 0) -> dict:
    """How many times each sample is read in an epoch that stopped after ``steps_done`` steps of ``batch`` samples
    per rank on ``world_before`` ranks and was finished on ``world_after`` ranks, three ways.

    ``shard(num_samples, num_replicas, rank, epoch=epoch)`` gives a rank's list of indices for the epoch, as
    ``DistributedSampler`` does (your ``shard_indices``). The ways:

    * ``"same N: each rank skips its own steps_done·batch"``: finished on ``world_before`` ranks, each rank reading
      ``indices[steps_done * batch:]`` of its own list (right);
    * ``"other N: each rank skips its own steps_done·batch"``: the same slice of the new ranks' lists (wrong);
    * ``"other N: skip the steps_done·batch·N global samples"``: the epoch's order (one replica's list) without the
      samples already consumed, dealt to the new ranks by torch's ``DistributedSampler`` (right).

    Returns ``{way: counts}``, ``counts[i]`` the number of times sample ``i`` was read in the epoch."""
    from torch.utils.data import DistributedSampler

    def lists(world):
        return [shard(num_samples, world, r, epoch=epoch) for r in range(world)]

    skip = steps_done * batch
    before = [i for mine in lists(world_before) for i in mine[:skip]]
    order = shard(num_samples, 1, 0, epoch=epoch)            # the epoch's order: one replica reads all of it
    rest = order[skip * world_before:]                         # global positions 0 .. skip·N - 1 were consumed
    dealt = [[rest[p] for p in DistributedSampler(range(len(rest)), num_replicas=world_after, rank=r,
                                                  shuffle=False)] for r in range(world_after)]
    after = {
        "same N: each rank skips its own steps_done·batch": [i for mine in lists(world_before) for i in mine[skip:]],
        "other N: each rank skips its own steps_done·batch": [i for mine in lists(world_after) for i in mine[skip:]],
        "other N: skip the steps_done·batch·N global samples": [i for mine in dealt for i in mine],
    }
    counts = {}
    for way, reads in after.items():
        c = [0] * num_samples
        for i in before + reads:
            c[i] += 1
        counts[way] = c
    return counts


def evaluation_on_ranks(correct: list) -> dict:
    """On every rank of the default group (N ranks): the accuracy over a validation set whose sample ``i`` is
    answered right when ``correct[i]``, three ways, each finished by one all-reduce of (right answers, reads):

    * ``"DistributedSampler, padded"``: each rank reads its ``DistributedSampler(shuffle=False)`` share, which
      repeats samples from the start until every rank has ``ceil(n / N)``;
    * ``"padded, repeats weighted 0"``: the same reads, the padding (positions ``n`` and beyond of the padded list,
      which ``DistributedSampler`` deals to rank ``position % N``) counted with weight 0;
    * ``"unequal shares, no padding"``: rank ``r`` reads samples ``r, r + N, ...`` below ``n``.

    Returns ``{way: (accuracy, reads)}``, the same on every rank."""
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    rank, world, n = dist.get_rank(), dist.get_world_size(), len(correct)
    right = torch.tensor([float(c) for c in correct])
    mine = list(DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False))
    position = torch.arange(len(mine)) * world + rank            # where each read sits in the padded list
    ways = {
        "DistributedSampler, padded": (right[mine], torch.ones(len(mine))),
        "padded, repeats weighted 0": (right[mine], (position < n).float()),
        "unequal shares, no padding": (right[rank::world], torch.ones(len(right[rank::world]))),
    }
    out = {}
    for way, (values, weight) in ways.items():
        sums = torch.stack([(values * weight).sum(), weight.sum()])
        dist.all_reduce(sums)                                   # right answers and reads, over every rank
        out[way] = (float(sums[0] / sums[1]), int(sums[1]))
    return out
