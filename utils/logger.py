"""The Logger: what training and evaluation report, and the one way it reaches the trackers.

The loop records values step by step (`record`, `record_outputs`): they are summed on the device by
a `Recorder` and the task's train metrics, with no host sync. At validation the Logger closes those
sums (`summary`) and sends curves, pictures, texts and options to the experiment trackers
(utils/trackers: TensorBoard by default, then CSV, W&B, MLflow). Everything it writes runs on its
writer thread (utils/background.py), in order, so the training step never waits for a picture to be
drawn or a file to be written; the checkpointer shares that thread, so the points a checkpoint
covers are written before it. Its trackers are rank 0's; on other ranks the list is empty and every
writing call does nothing, so callers never ask which rank they are on.
"""

import os

from metrics import BatchedUpdates
from utils.background import BackgroundWriter
from utils.errors import KilnError
from utils.recorder import Recorder
from utils.trackers import Trackers
from utils.viz import save_png

# what a task's train metrics are asked for: every step, at validation, and by each checkpoint
TRAIN_METRIC_METHODS = ('update', 'compute', 'reset', 'state_dict', 'load_state_dict')
# the Recorder's count of the batches whose outputs reached the train metrics (no value, no kernel): none
# since the last summary (a train_step of yours without record_outputs), and there are no train metrics
# to show, rather than an accuracy of 0
OUTPUTS_RECORDED = 'batches with outputs recorded'


class Logger:
    """Recorder-backed logging to `trackers` (a utils.trackers.Trackers; empty for none), writing on
    `writer` (a BackgroundWriter, made when not given). With a `task`, its train metrics add up the
    training batches' outputs (batched: metrics.BatchedUpdates)."""

    def __init__(self, trackers=None, task=None, writer=None):
        self.trackers = trackers if trackers is not None else Trackers()
        self.recorder = Recorder()
        metrics = task.train_metrics() if task is not None else None
        missing = [name for name in TRAIN_METRIC_METHODS if metrics is not None and not hasattr(metrics, name)]
        if missing:  # said now, not at the first checkpoint after an epoch of training
            raise KilnError(
                f'{type(task).__name__}.train_metrics() gives a {type(metrics).__name__} without '
                f'{", ".join(missing)}: train metrics need {", ".join(TRAIN_METRIC_METHODS)} (a checkpoint keeps '
                f'their counts: see metrics.ConfusionMetrics), or let train_metrics() return None'
            )
        self.train_metrics = None if metrics is None else BatchedUpdates(metrics, task.outputs_to_float)
        self.writer = writer or BackgroundWriter()

    # per step: on the device, no host sync -----------------------------------------------------------
    def record(self, name, value, count=1):
        """Add `value` (a tensor or number: the mean over `count` samples) to `name`'s running sum."""
        self.recorder.record(name, value, count)

    def record_outputs(self, outputs, batch):
        """Add a training batch's outputs (as the model gave them) to the task's train metrics (train/acc, ...)."""
        if self.train_metrics is not None:
            self.train_metrics.update(outputs, batch)
            self.recorder.record(OUTPUTS_RECORDED, 0.0)  # a count on the host

    # at print and validation time ----------------------------------------------------------------------
    def running_means(self):
        """This process's means of every recorded value since the last summary (one host sync)."""
        means = self.recorder.means()
        means.pop(OUTPUTS_RECORDED, None)
        return means

    def summary(self):
        """The train/* values since the last summary over every process (the recorded means and the train
        metrics), then a fresh start. A collective: every process calls it."""
        metrics = self.recorder.summary(all_ranks=True)
        if self.train_metrics is not None:
            if metrics.pop(OUTPUTS_RECORDED, None) is not None:  # the same on every process: a collective's sums
                metrics.update({f'train/{name}': value for name, value in self.train_metrics.compute().items()})
            self.train_metrics.reset()
        return metrics

    # to the trackers, on the writer thread --------------------------------------------------------------
    def log_metrics(self, metrics, step, epoch):
        """Curves: {'train/loss': 0.5, 'val/acc': 0.9, ...} at optimizer step `step`."""
        self._to_trackers('log_metrics', dict(metrics), step, epoch)

    def log_pictures(self, source, draw, step):
        """Pictures of an evaluated batch: `source` (a utils.checkpointer.Snapshot of (batch, outputs))
        is drawn by `draw` (the task's `pictures`) on the writer thread and logged as 'val/<name>'."""
        if self.trackers:
            self.writer.submit(self._log_pictures, source, draw, step)

    def _log_pictures(self, source, draw, step):
        self.trackers.log_images({f'val/{name}': picture for name, picture in draw(*source.get()).items()}, step)

    def save_pictures(self, number, source, draw, folder):
        """Pictures of evaluated batch `number` (`source`: see `log_pictures`), drawn and saved as
        `<folder>/<name>_batch<N>.png` on the writer thread."""
        self.writer.submit(self._save_pictures, number, source, draw, folder)

    @staticmethod
    def _save_pictures(number, source, draw, folder):
        for name, picture in draw(*source.get()).items():
            save_png(picture, os.path.join(folder, f'{name}_batch{number:04d}.png'))

    def log_text(self, tag, text, step):
        """A text (Markdown), e.g. the run's options."""
        self._to_trackers('log_text', tag, text, step)

    def log_hparams(self, hparams):
        """The run's options, shown beside its final metrics (TensorBoard's HParams tab, ...)."""
        self._to_trackers('log_hparams', dict(hparams))

    def commit(self, step):
        """The checkpoint of `step` is written (submit this after it): every point up to `step` is final."""
        self._to_trackers('commit', step)

    def submit(self, function, *args):
        """Run `function(*args)` on the writer thread after everything logged so far (files of the run)."""
        self.writer.submit(function, *args)

    def _to_trackers(self, method, *args):
        if self.trackers:
            self.writer.submit(getattr(self.trackers, method), *args)

    # the end ------------------------------------------------------------------------------------------
    def wait(self):
        """Block until everything logged so far is written; raise a failed write's error."""
        self.writer.wait()

    def close(self, final_metrics=None):
        """Write what is pending, `finish` the trackers with `final_metrics` (a run that ended as planned
        or was stopped cleanly; None: it failed), end the writer thread and close the trackers (even after
        an error; not while a close cut short leaves a job writing to them: the process is ending)."""
        try:
            if final_metrics is not None:
                self._to_trackers('finish', final_metrics)
        finally:
            try:
                self.writer.close()
            finally:
                if not self.writer.busy():
                    self.trackers.close()
