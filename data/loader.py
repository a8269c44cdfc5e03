"""One split's batches, delivered on the training device as dicts of tensors.

Two paths, chosen by the dataset:
- in memory (the dataset has `tensors()`, e.g. `shapes`, `mem_list`): the decoded uint8 images
  and targets sit on the training device (in host memory when they would take more than a quarter
  of the free GPU memory) and a batch is one `index_select`: no workers, no per-sample Python;
- from disk (any other dataset): DataLoader workers read and decode samples, the task's collate
  stacks them as uint8, and the batch is copied from pinned memory without waiting.
Either way `BatchTransform` (data/augment.py) then normalizes and, for training, augments the
whole batch on the device.
"""

import atexit
import contextlib
import functools
import multiprocessing
import multiprocessing.queues
import os
import signal

import numpy as np
import torch
from torch.utils.data import DataLoader

from data.augment import BatchTransform
from data.sampler import ResumableBatchSampler, SeededDataset, mix
from utils.distributed import die_with_parent, rank, world_size
from utils.errors import KilnError, write_to_stderr_now
from utils.seeding import seed_worker
from utils.stopping import stop_ends_the_wait

AUGMENT_STREAM = -1  # a number no sample position is (they count from 0): the epoch's draws apart from the samples'


def pad_collate(samples):
    """Stack a list of sample dicts into a batch dict; tensors whose first dimension varies (boxes)
    are padded to the longest with -1 (integers) or 0 (floats)."""
    batch = {}
    for key in samples[0]:
        try:
            values = [torch.as_tensor(sample[key]) for sample in samples]
        except (TypeError, ValueError, RuntimeError) as error:
            raise KilnError(
                f"a sample's {key!r} is a {type(samples[0][key]).__name__}, which cannot go into a batch "
                f'({error}); give numbers or tensors, or a task `collate` of its own (tasks/task.py)'
            ) from None
        longest = max(len(v) if v.dim() else 0 for v in values)
        if all(v.shape == values[0].shape for v in values):
            batch[key] = torch.stack(values)
        else:
            fill = 0 if values[0].is_floating_point() else -1
            padded = values[0].new_full((len(values), longest, *values[0].shape[1:]), fill)
            for i, value in enumerate(values):
                padded[i, : len(value)] = value
            batch[key] = padded
    return batch


def _collate_with_positions(collate, item):
    samples, positions = item  # what SeededDataset.__getitems__ gives
    return collate(samples), torch.tensor(positions)


def init_worker(parent, worker_id):
    """A DataLoader worker's start (`functools.partial(init_worker, os.getpid())`): stop signals left to
    the main process, death with it, and its random generators seeded."""
    # a stop signal is the main process's to handle (it finishes the step and saves, and needs its
    # workers for that); Ctrl-C and torchrun send it to the workers too, so they ignore it, and die
    # with the main process instead
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    die_with_parent(parent, 1)  # exits at once with its parent (Linux), not 5 s later
    # a batch that cannot be handed over (shared memory full or limited) fails on the queue's own thread,
    # which prints it and goes on: the main process would wait for that batch forever
    multiprocessing.queues.Queue._on_queue_feeder_error = staticmethod(_end_with_a_lost_batch)
    seed_worker(worker_id)


def _end_with_a_lost_batch(error, batch):
    """A worker's batch could not be sent to the main process: say why in one line and end the worker,
    which the main process notices within seconds (a DataLoader error, see utils/errors.run_cli)."""
    # one write: the workers' lines do not interleave (unbuffered stderr split them)
    write_to_stderr_now(f'error: a DataLoader worker could not hand over its batch: {error}\n')
    os._exit(1)


@atexit.register  # after multiprocessing's own at-exit step, so it runs first (atexit goes last in, first out)
def _kill_workers_left():
    """At exit, end the DataLoader workers still alive with SIGKILL: multiprocessing's own exit ends its
    daemon processes with SIGTERM, which these ignore (see init_worker), and then waits for them forever
    (a worker stuck reading a file, or handing over a batch)."""
    workers = [child for child in multiprocessing.active_children() if child.daemon]
    if workers:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would take these deaths for failures
    for worker in workers:
        worker.kill()


def default_workers(requested):
    """--num_workers, or min(4, CPUs per process) when not given (the CPUs this process may run on, as
    taskset or a job's CPU set leaves them; torchrun's processes share them)."""
    if requested is not None:
        return requested
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1  # (taskset)
    cpus_per_process = cpus // int(os.environ.get('LOCAL_WORLD_SIZE', 1))
    return max(1, min(4, cpus_per_process))


def place_in_memory(tensors, device):
    """The in-memory dataset's tensors on `device` when they take at most a quarter of its free memory,
    else where they are, in host memory (each batch is pinned on its way: a pinned copy of the whole
    dataset would double its host memory, rounded up to a power of two, and speed nothing)."""
    if device.type == 'cuda':
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        free, _ = torch.cuda.mem_get_info(device)
        if size > free // 4:
            return dict(tensors)
    return {key: t.to(device) for key, t in tensors.items()}


class Batches:
    """The batches of one split for this process, epoch by epoch, as dicts of device tensors with
    the images normalized (and, with `augment`, augmented: see data/augment.py)."""

    def __init__(
        self,
        dataset,
        device,
        *,
        batch_size,
        shuffle,
        seed,
        augment=(),
        collate=pad_collate,
        workers=None,
        limit=None,
        fixed_order=False,
        channels_last=False,
        image_size=32,
        options=None,
    ):
        self.dataset, self.device, self.seed = dataset, device, seed
        self.sampler = ResumableBatchSampler(
            len(dataset), batch_size, shuffle, seed, rank(), world_size(), limit, fixed_order
        )
        self.transform = BatchTransform(augment, image_size, channels_last, options)
        tensors = getattr(dataset, 'tensors', None)
        self.memory = place_in_memory(tensors(), device) if tensors else None
        self.loader = None
        if self.memory is None:
            workers = default_workers(workers)
            self.loader = DataLoader(
                SeededDataset(dataset),
                batch_sampler=self.sampler,
                num_workers=workers,
                collate_fn=functools.partial(_collate_with_positions, collate),
                pin_memory=device.type == 'cuda',
                persistent_workers=workers > 0,
                worker_init_fn=functools.partial(init_worker, os.getpid()),
                # each iterator draws its workers' base seed from `generator` (default: the global one, whose
                # state a checkpoint holds; with persistent workers a resumed run would draw it again, and
                # dropout would then differ). SeededDataset and init_worker seed what the workers use.
                generator=torch.Generator(),
            )

    def close(self, stuck=False):
        """Stop this split's DataLoader workers now. Persistent workers ignore stop signals (see
        init_worker), so a run that ends by an error, while something still refers to them, would
        otherwise wait for them at exit forever. `stuck`: they are known not to answer (kill them first,
        rather than wait seconds for each to end by itself)."""
        iterator = getattr(self.loader, '_iterator', None)
        if iterator is not None:
            # (stuck: torch's SIGCHLD handler would take the deaths of the workers killed here for failures)
            chld = signal.signal(signal.SIGCHLD, signal.SIG_DFL) if stuck else None
            try:
                for worker in getattr(iterator, '_workers', ()) if stuck else ():
                    worker.kill()
                iterator._shutdown_workers()  # asks them to end, then SIGTERM (ignored) to those that did not
            finally:
                if stuck:
                    signal.signal(signal.SIGCHLD, chld)
            for worker in iterator._workers:
                if worker.is_alive():
                    worker.kill()
            self.loader._iterator = None

    def __len__(self):
        """Batches in a whole epoch: this process's in training, one process's (every process's together)
        in evaluation, whose batches are dealt out whole (see `numbers`)."""
        return self.sampler.num_batches()

    def numbers(self):
        """The numbers of this process's batches among every process's (see ResumableBatchSampler.numbers)."""
        return self.sampler.numbers()

    def epoch(self, epoch, start=0, stop_ends_wait=None):
        """Yield the batches of `epoch`, from batch number `start` on. `stop_ends_wait`, asked before each
        wait for a worker's batch: True lets a stop signal end that wait (utils/stopping.py)."""
        self.sampler.set_epoch(epoch, start)
        params = None
        if self.transform.random:  # every sample position's parameters, drawn once per epoch
            generator = torch.Generator().manual_seed(mix(self.seed, epoch, AUGMENT_STREAM))
            params = {k: v.to(self.device) for k, v in self.transform.draw(len(self.dataset), generator).items()}
        source = self._from_memory(epoch, start) if self.memory is not None else self._from_loader(stop_ends_wait)
        for batch, positions in source:
            yield self.transform(batch, params and {key: value[positions] for key, value in params.items()}, positions)

    def _from_memory(self, epoch, start):
        batches = self.sampler.batches(epoch)[start:]
        if not batches:
            return
        where = next(iter(self.memory.values())).device
        # one copy per epoch; through numpy, which reads a list of pairs 3x faster than torch.tensor
        pairs = torch.from_numpy(np.array([pair for batch in batches for pair in batch], dtype=np.int64)).to(where)
        for chunk in pairs.split([len(batch) for batch in batches]):
            positions, indices = chunk[:, 0], chunk[:, 1]
            batch = {key: tensor.index_select(0, indices) for key, tensor in self.memory.items()}
            if where.type == 'cpu' and self.device.type != 'cpu':  # pinned, the batch is copied without waiting
                batch = {key: t.pin_memory().to(self.device, non_blocking=True) for key, t in batch.items()}
                positions = positions.pin_memory().to(self.device, non_blocking=True)  # pageable: a sync
            yield batch, positions

    def _from_loader(self, stop_ends_wait):
        iterator = iter(self.loader)
        while True:
            with stop_ends_the_wait() if stop_ends_wait is not None and stop_ends_wait() else contextlib.nullcontext():
                try:
                    batch, positions = next(iterator)
                except StopIteration:
                    return
            yield (
                {key: t.to(self.device, non_blocking=True) for key, t in batch.items()},
                positions.to(self.device, non_blocking=True),
            )
