"""Recording metrics (Recorder) and writing them to TensorBoard (Logger)."""

import torch
from tqdm import tqdm

from utils.checkpoint import CheckpointKeeper


class Recorder:
    """Accumulates named values step by step; `summary()` returns their batch-size-weighted means.

    Tensor values are kept detached on their device and summed there, so recording never
    waits for the GPU; only `summary()` / `means()` copy the totals to the host, in one go.
    """

    def __init__(self):
        self.sums = {}
        self.counts = {}

    def record(self, name, value, n=1):
        """Add `value` (a tensor or number, the mean over `n` samples) under `name`."""
        if torch.is_tensor(value):
            value = value.detach()
        self.sums[name] = self.sums[name] + value * n if name in self.sums else value * n
        self.counts[name] = self.counts.get(name, 0) + n

    def means(self):
        """The weighted mean of every recorded name, without resetting."""
        names = list(self.sums)
        totals = [self.sums[name] for name in names]
        tensors = [i for i, total in enumerate(totals) if torch.is_tensor(total)]
        if tensors:
            host = torch.stack([totals[i].float().reshape(()) for i in tensors]).tolist()  # one sync
            for i, value in zip(tensors, host):
                totals[i] = value
        return {name: float(total) / self.counts[name] for name, total in zip(names, totals)}

    def state_dict(self):
        """The running sums and counts as plain numbers (one host sync), for checkpoints."""
        means = self.means()
        return {name: [means[name], self.counts[name]] for name in means}

    def load_state_dict(self, state):
        """Continue the sums saved by `state_dict`."""
        self.sums = {name: mean * count for name, (mean, count) in state.items()}
        self.counts = {name: count for name, (_, count) in state.items()}

    def summary(self):
        """The weighted means (see `means`), then a reset for the next epoch."""
        means = self.means()
        self.sums.clear()
        self.counts.clear()
        return means


class Logger:
    """TensorBoard writer of one experiment folder plus a Recorder.

    Record scalars named `train/<name>` or `val/<name>` during an epoch, then `save_curves(step)`
    writes their means as points of TensorBoard curves (train and val get separate charts).
    TensorBoard is imported only when a Logger is made.
    """

    def __init__(self, log_dir, keep_last=1, keep_best=1, monitor_mode='max', purge_step=None):
        from torch.utils.tensorboard import SummaryWriter
        self.log_dir = log_dir
        # purge_step hides points a killed run wrote after its last checkpoint, so a resumed
        # run's curves have no duplicates
        self.writer = SummaryWriter(log_dir, purge_step=purge_step)
        self.recorder = Recorder()
        self.checkpoints = CheckpointKeeper(log_dir, keep_last, keep_best, monitor_mode)

    def record_scalar(self, name, value, n=1):
        """Record one value of `name` (mean over `n` samples) for the current interval."""
        self.recorder.record(name, value, n)

    def save_curves(self, step):
        """Write the means recorded since the last call at x = `step`; return them."""
        means = self.recorder.summary()
        for name, value in means.items():
            self.writer.add_scalar(name, value, step)
        return means

    def save_imgs(self, images, step):
        """Write pictures given as {tag: HxWx3 uint8 array}."""
        for tag, image in images.items():
            self.writer.add_image(tag, image, step, dataformats='HWC')

    def save_check_point(self, state, name, metric=None):
        """Write a checkpoint into the experiment folder as `name` and update last.pth/best.pth
        (see CheckpointKeeper); return whether it is the new best by `metric`."""
        return self.checkpoints.save(state, name, metric)

    def close(self):
        """Flush and close the event file."""
        self.writer.close()


def progress(iterable, enabled, description):
    """A tqdm progress bar over `iterable` (a no-op wrapper when `enabled` is False)."""
    return tqdm(iterable, desc=description, disable=not enabled, unit='batch', leave=False, dynamic_ncols=True,
                mininterval=0.5)
