"""TensorBoard: event files in the experiment folder (`tensorboard --logdir <checkpoints_dir>`)."""

from utils.trackers import Tracker, require


class TensorBoardTracker(Tracker):
    """Writes scalars, images, texts and the HParams row with torch's SummaryWriter.

    Points are written at once: a resumed run opens its writer with purge_step = resume_step + 1,
    which makes TensorBoard drop whatever the killed run wrote after its last checkpoint.
    """

    name = 'tensorboard'

    def __init__(self, folder, run_name, resume_step=None, state=None, options=None, metric_names=()):
        self.folder = folder
        self.purge_step = None if resume_step is None else resume_step + 1
        self.last_step = resume_step or 0
        self.metric_names = metric_names
        self.hparams = {}
        self.writer = None

    def _writer(self):
        # importing TensorBoard takes a while: only a run that writes something pays for it
        if self.writer is None:
            tensorboard = require(
                'torch.utils.tensorboard', self.name, 'tensorboard', 'python3 -m pip install tensorboard'
            )
            self.writer = tensorboard.SummaryWriter(self.folder, purge_step=self.purge_step)
        return self.writer

    def log_hparams(self, hparams):
        self.hparams = dict(hparams)  # written by finish, with the results

    def log_metrics(self, metrics, step, epoch):
        self.last_step = max(self.last_step, step)
        writer = self._writer()
        for name, value in metrics.items():
            writer.add_scalar(name, float(value), step)

    def log_images(self, images, step):
        self.last_step = max(self.last_step, step)
        writer = self._writer()
        for tag, image in images.items():
            writer.add_image(tag, image, step, dataformats='HWC')

    def log_text(self, tag, text, step):
        self._writer().add_text(tag, text, step)

    def state_dict(self):
        # on disk before the checkpoint exists: its points can never be lost (purge_step hides
        # any written later, should the checkpoint not be saved after all)
        if self.writer:
            self.writer.flush()
        return {}

    def commit(self, step):
        self.last_step = max(self.last_step, step)
        if self.writer:
            self.writer.flush()

    def finish(self, final_metrics):
        """Write the HParams row: this run's options and results, in the experiment folder itself."""
        writer = self._writer()
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        # every task's metric names are declared, so that runs of different tasks in one logdir
        # each show theirs; only this run's metrics get values
        declared = dict.fromkeys([*self.metric_names, *final_metrics])
        values = {
            name: value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
            for name, value in self.hparams.items()
        }
        # written at the last step, not step 0, so that a resume of this run purges them too
        for summary in hparams_summaries(values, declared):
            writer.file_writer.add_summary(summary, self.last_step)
        for name, value in final_metrics.items():
            if value is not None:
                writer.add_scalar(name, float(value), self.last_step)
        writer.flush()

    def close(self):
        if self.writer:
            self.writer.close()
