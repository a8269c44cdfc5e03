"""Recording metrics (Recorder) and writing them to TensorBoard (Logger)."""

import torch
from tqdm import tqdm

from utils.checkpoint import CheckpointKeeper
from utils.distributed import all_reduce_sum, collective_device, is_main_process


class Recorder:
    """Accumulates named values step by step; `summary()` returns their batch-size-weighted means.

    Tensor values are kept detached on their device and summed there (in float64), so recording
    never waits for the GPU; only `summary()` / `means()` copy the totals to the host, in one go.
    With `all_ranks=True` the sums and counts of every torchrun process are added first, so the
    means are those of all samples, exactly as one process would compute them.
    """

    def __init__(self):
        self.sums = {}
        self.counts = {}

    def record(self, name, value, n=1):
        """Add `value` (a tensor or number, the mean over `n` samples) under `name`."""
        value = value.detach().to(torch.float64) * n if torch.is_tensor(value) else float(value) * n
        self.sums[name] = self.sums[name] + value if name in self.sums else value
        self.counts[name] = self.counts.get(name, 0) + n

    def totals(self, all_ranks=False):
        """{name: (sum, count)} as host numbers (one sync; a collective when `all_ranks`)."""
        names = list(self.sums)
        if not names:
            return {}
        device = next((v.device for v in self.sums.values() if torch.is_tensor(v)), None)
        device = collective_device() if all_ranks else device or torch.device('cpu')
        values = torch.stack([torch.as_tensor(self.sums[name], dtype=torch.float64, device=device).reshape(())
                              for name in names] + [torch.tensor(float(self.counts[name]), dtype=torch.float64,
                                                                 device=device) for name in names])
        if all_ranks:
            all_reduce_sum(values)
        host = values.tolist()
        return {name: (host[i], host[len(names) + i]) for i, name in enumerate(names)}

    def means(self, all_ranks=False):
        """The weighted mean of every recorded name, without resetting."""
        return {name: total / count for name, (total, count) in self.totals(all_ranks).items()}

    def state_dict(self):
        """The running sums and counts of all ranks as plain numbers, for checkpoints (a collective
        under torchrun: every rank calls it)."""
        return {name: [total, count] for name, (total, count) in self.totals(all_ranks=True).items()}

    def load_state_dict(self, state):
        """Continue from sums saved by `state_dict` (under torchrun, load them on rank 0 only)."""
        self.sums = {name: total for name, (total, _) in state.items()}
        self.counts = {name: count for name, (_, count) in state.items()}

    def summary(self, all_ranks=False):
        """The weighted means (see `means`), then a reset for the next interval."""
        means = self.means(all_ranks)
        self.sums.clear()
        self.counts.clear()
        return means


class Logger:
    """TensorBoard writer of one experiment folder, its checkpoints, and a Recorder.

    Record scalars named `train/<name>` or `val/<name>` during an epoch, then `save_curves(step)`
    writes their means as points of TensorBoard curves (train and val get separate charts).
    Under torchrun every rank records and reduces, and only rank 0 writes files. TensorBoard is
    imported only when it is on (`tensorboard=True`) in that process.
    """

    def __init__(self, log_dir, keep_last=1, keep_best=1, monitor_mode='max', purge_step=None, tensorboard=True):
        self.log_dir = log_dir
        self.recorder = Recorder()
        self.writes = is_main_process()
        self.writer = None
        if tensorboard and self.writes:
            from torch.utils.tensorboard import SummaryWriter
            # purge_step hides points a killed run wrote after its last checkpoint, so a resumed
            # run's curves have no duplicates
            self.writer = SummaryWriter(log_dir, purge_step=purge_step)
        self.checkpoints = CheckpointKeeper(log_dir, keep_last, keep_best, monitor_mode) if self.writes else None

    def record_scalar(self, name, value, n=1):
        """Record one value of `name` (mean over `n` samples) for the current interval."""
        self.recorder.record(name, value, n)

    def save_curves(self, step):
        """Write the means (over all ranks) recorded since the last call at x = `step`; return them."""
        means = self.recorder.summary(all_ranks=True)
        if self.writer:
            for name, value in means.items():
                self.writer.add_scalar(name, value, step)
        return means

    def save_imgs(self, images, step):
        """Write pictures given as {tag: HxWx3 uint8 array}."""
        if self.writer:
            for tag, image in images.items():
                self.writer.add_image(tag, image, step, dataformats='HWC')

    def save_text(self, tag, text, step=0):
        """Write a text (Markdown) to TensorBoard's Text tab."""
        if self.writer:
            self.writer.add_text(tag, text, step)

    def save_hparams(self, hparams, metrics):
        """Write a run's options and results for TensorBoard's HParams tab (one row per run)."""
        if self.writer:
            self.writer.add_hparams(hparams, metrics, run_name='.')  # '.': beside the run's curves, not a subfolder

    def save_check_point(self, state, name, metric=None):
        """Write a checkpoint into the experiment folder as `name` and update last.pth/best.pth
        (see CheckpointKeeper); return whether it is the new best by `metric`. Rank 0 only."""
        return self.checkpoints.save(state, name, metric) if self.writes else False

    def close(self):
        """Flush and close the event file."""
        if self.writer:
            self.writer.close()


def progress(iterable, enabled, description):
    """A tqdm progress bar over `iterable` (a no-op wrapper when `enabled` is False)."""
    return tqdm(iterable, desc=description, disable=not enabled, unit='batch', leave=False, dynamic_ncols=True,
                mininterval=0.5)
