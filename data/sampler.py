"""Batches whose order and randomness are a pure function of (seed, epoch, position).

`ResumableBatchSampler` draws each epoch's order from the seed and the epoch, can start an
epoch part-way (for resuming a checkpoint written mid-epoch), and splits the batches between
distributed ranks. Every sample is known by its position in the epoch's order: the device-side
augmentation (data/augment.py) takes its random parameters by position, and `SeededDataset`
seeds python, numpy and torch with (seed, epoch, position) while a sample is read from disk, so
a dataset's own per-sample randomness also comes out the same whatever the number of DataLoader
workers or processes, and whether or not the run was interrupted.
"""

import random

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from utils.errors import KilnError


class SeededBatch(list):
    """A list of dataset indices with their `positions` in the epoch's order and the `seeds` to load them with."""

    def __init__(self, indices, positions, seeds):
        super().__init__(indices)
        self.positions, self.seeds = positions, seeds


def mix(*numbers):
    """A 63-bit seed from a few integers (a SplitMix-style hash), stable across processes."""
    value = 0x9E3779B97F4A7C15
    for number in numbers:
        value = (value ^ (number & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        value ^= value >> 31
    return value >> 1


def dealt(count, rank, world_size):
    """The numbers of the evaluation batches (of `count`, as one process has them) that rank `rank` of
    `world_size` evaluates, in its order: every world_size-th from its own rank's number."""
    return range(rank, count, world_size)


def in_global_order(per_rank):
    """One item per evaluation batch in the batches' order, from `per_rank` (indexed by rank): each
    rank's items of its `dealt` batches, in its order."""
    return [per_rank[number % len(per_rank)][number // len(per_rank)] for number in range(sum(map(len, per_rank)))]


class ResumableBatchSampler(Sampler):
    """Batches of one rank for the current epoch, starting at batch `start`.

    Training (`shuffle=True`) permutes the whole dataset by (seed, epoch), cuts it into global
    batches of `batch_size * world_size` (dropping an incomplete last one, so every rank makes
    the same number of steps) and gives rank r the r-th slice of each (data smaller than one global
    batch make one, its samples dealt out round-robin; fewer samples than ranks are refused). Evaluation
    (`shuffle=False`) cuts the file order into the batches one process evaluates and deals whole
    batches out (`dealt`), without padding: each rank's batches, losses and rows are one process's,
    so no sample is counted twice and the sums come out the same. `limit` keeps only the first
    batches of each epoch (--limit_*_batches: of the global ones in evaluation); `fixed_order` uses
    epoch 0's order every epoch (--overfit_batches).
    """

    def __init__(self, length, batch_size, shuffle, seed=0, rank=0, world_size=1, limit=None, fixed_order=False):
        if shuffle and length < world_size:  # a process with nothing to train on would fail or wait for ever
            raise KilnError(
                f'the training data have {length} sample{"" if length == 1 else "s"}, fewer than the {world_size} '
                f'processes that train on them; start fewer processes or give more data'
            )
        self.length, self.batch_size, self.shuffle = length, batch_size, shuffle
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.limit, self.fixed_order = limit, fixed_order
        self.epoch, self.start = 0, 0
        self._drawn = (None, None)  # (seed, the order it gave)

    def set_epoch(self, epoch, start=0):
        """Make the next iteration give epoch `epoch`'s batches from batch number `start` on."""
        self.epoch, self.start = epoch, start

    def order(self, epoch=None):
        """The sample order (all ranks) of `epoch` (default: the current one): a tensor of indices, not to
        be changed (the same one is handed out until another epoch's is drawn)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return torch.arange(self.length)
        seed = mix(self.seed, 0 if self.fixed_order else epoch)
        if self._drawn[0] != seed:  # drawn once per epoch
            generator = torch.Generator()
            generator.manual_seed(seed)
            self._drawn = seed, torch.randperm(self.length, generator=generator)
        return self._drawn[1]

    def num_batches(self):
        """How many batches a whole epoch has (arithmetic: no order is drawn): in training, those of each
        rank (its slices of the global batches); in evaluation, those of one process, dealt out."""
        if not self.shuffle:
            count = -(-self.length // self.batch_size)
        else:
            count = max(1, self.length // (self.batch_size * self.world_size))
        return min(count, self._limit(count))

    def _limit(self, count):
        """--limit_*_batches as a number of batches: a count, or a fraction of `count`."""
        if not self.limit:
            return count
        return self.limit if isinstance(self.limit, int) else max(1, int(count * self.limit))

    def batches(self, epoch=None):
        """Every batch of this rank in `epoch` (default: the current one), from batch 0, as lists of
        (position in the epoch's order, dataset index)."""
        order = list(enumerate(self.order(epoch).tolist()))
        if not self.shuffle:
            batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
            batches = batches[: self._limit(len(batches))]
            return [batches[number] for number in dealt(len(batches), self.rank, self.world_size)]
        step, first = self.batch_size * self.world_size, self.rank * self.batch_size
        batches = [order[i * step + first : i * step + first + self.batch_size] for i in range(len(order) // step)]
        batches = batches or [order[self.rank :: self.world_size]]  # a tiny dataset still gives one batch
        return batches[: self._limit(len(batches))]

    def __iter__(self):
        epoch, start = self.epoch, self.start  # fixed for this pass, whatever set_epoch does meanwhile
        for batch in self.batches(epoch)[start:]:
            yield SeededBatch(
                [index for _, index in batch],
                [position for position, _ in batch],
                [mix(self.seed, epoch, position) for position, _ in batch],
            )

    def numbers(self):
        """The numbers of this rank's batches of a whole epoch among every rank's, as `dealt` deals them
        (`in_global_order` puts per-batch results back in their order): in evaluation, one process's batch
        numbers; in training (and --overfit_batches' validation), the ranks' slices of each global batch
        numbered one after the other."""
        count = self.num_batches()
        return dealt(count if not self.shuffle else count * self.world_size, self.rank, self.world_size)

    def __len__(self):
        """This rank's batches from batch `start` on."""
        return max(0, len(self.numbers()) - self.start)


class SeededDataset(Dataset):
    """Wraps a dataset so each SeededBatch is read under its samples' own seeds; a batch comes out
    as (samples, positions) for the collate function.

    The caller's random states are put back afterwards, so reading in the main process
    (`num_workers=0`) does not disturb the model's random numbers.
    """

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, batch):
        states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        samples = []
        try:
            for index, seed in zip(batch, batch.seeds):
                random.seed(seed)
                np.random.seed(seed % 2**32)
                torch.default_generator.manual_seed(seed)  # torch.manual_seed also seeds CUDA: 60x slower
                samples.append(self.dataset[index])
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])
        return samples, batch.positions
