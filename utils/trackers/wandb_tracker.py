"""Weights & Biases: one W&B run per Kiln run, kept across resumes (its id is in the checkpoint).

Without a W&B login the run is written offline under `<folder>/wandb/` (upload it later with
`wandb sync <folder>/wandb/offline-run-*`); set WANDB_MODE to choose yourself.
"""

import json
import netrc
import os
from urllib.parse import urlsplit

from utils.checkpoint import atomic_write_json
from utils.errors import KilnError
from utils.trackers import Tracker, copied_from, require

# W&B's service writes the run's transaction log (the .wandb file: all an offline run has, and what
# `wandb sync` uploads) every x_transaction_log_flush_interval seconds, 15 by default: a SIGKILL lost
# every point committed in the last 15 s. Flushing every 0.1 s leaves a moment as short as the one
# between a checkpoint and its commit.
FLUSH_INTERVAL_S = 0.1


def logged_in():
    """Whether W&B has an API key: WANDB_API_KEY, or a .netrc entry for the W&B server."""
    if os.environ.get('WANDB_API_KEY'):
        return True
    host = urlsplit(os.environ.get('WANDB_BASE_URL') or 'https://api.wandb.ai').netloc
    path = os.path.expanduser(os.environ.get('NETRC') or '~/.netrc')
    try:
        return bool(netrc.netrc(path).authenticators(host))
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode():
    """'online' or 'offline' by login, or None to let WANDB_MODE decide."""
    if os.environ.get('WANDB_MODE'):
        return None
    return 'online' if logged_in() else 'offline'


WRITTEN_STEPS = 'kiln_written_steps.json'  # in <folder>/wandb/: {run id: the last step written to it}


def written_steps(folder):
    """{W&B run id: the last step written to it} of the runs of the experiment folder `folder`."""
    try:
        with open(os.path.join(folder, 'wandb', WRITTEN_STEPS)) as f:
            steps = json.load(f)
    except (OSError, ValueError):
        return {}
    return steps if isinstance(steps, dict) else {}


class WandbTracker(Tracker):
    """Logs to a W&B run; points wait in memory until the checkpoint that covers them is saved.

    W&B keeps only increasing steps, so nothing a resumed run will log again may reach it:
    `commit(step)` and `finish` write the waiting points, one history row per step. The checkpoint
    keeps its waiting numbers (not its pictures): a kill between its write and its commit loses no
    point, as its resume writes those above the last step written (WRITTEN_STEPS). A kill in the
    FLUSH_INTERVAL_S after a commit (while W&B's service still holds the points in memory) loses that
    checkpoint's points (W&B cannot be asked offline what it already has). A resume from an older
    checkpoint than the last one whose points were written (WRITTEN_STEPS says) continues in a new W&B
    run: W&B would keep the first values of the steps it has, and show the resumed run's only after them.
    """

    name = 'wandb'

    def __init__(self, folder, run_name, resume_step=None, state=None, options=None, metric_names=()):
        self.wandb = require('wandb', self.name)
        settings = {}  # older wandb versions have no such setting
        if 'x_transaction_log_flush_interval' in getattr(self.wandb.Settings, 'model_fields', {}):
            settings['settings'] = self.wandb.Settings(x_transaction_log_flush_interval=FLUSH_INTERVAL_S)
        run_id, self.folder = (state or {}).get('run_id'), folder
        if run_id is not None and resume_step is not None and written_steps(folder).get(run_id, 0) > resume_step:
            print(
                f'note: W&B run {run_id} has points after step {resume_step}, which W&B cannot take back: '
                f'this resume logs to a new W&B run, {run_name}-from-step{resume_step}'
            )
            run_id, run_name = None, f'{run_name}-from-step{resume_step}'
        copied = copied_from(state, folder)
        if run_id is not None and copied:
            print(
                f'note: W&B run {run_id} is the run of {copied}, which this folder is a copy of: this resume '
                f'logs to a new W&B run, which starts at step {(resume_step or 0) + 1}'
            )
            run_id = None
        try:
            # create_new: this tracker owns its run, and never finishes or reuses another in the process
            self.run = self.wandb.init(
                project=options.wandb_project,
                name=run_name,
                dir=folder,
                resume='allow',
                id=run_id,
                mode=wandb_mode(),
                reinit='create_new',
                **settings,
            )
        except self.wandb.errors.UsageError as error:  # a bad setting: an invalid project name, WANDB_MODE, ...
            raise KilnError(
                f'W&B refuses to start the run: {str(error).strip().splitlines()[0]}; fix --wandb_project '
                f'({options.wandb_project}) or the WANDB_* environment variables'
            ) from None
        self.pending = {}  # step -> {key: value} not yet written
        self.finished = False
        if run_id is not None:  # the checkpoint's points that its commit did not get to write
            written = written_steps(folder).get(run_id, 0)
            self.pending = {step: dict(row) for step, row in (state or {}).get('pending', []) if step > written}
            self._write()

    def log_hparams(self, hparams):
        # a resumed run may have changed options (more epochs, say): keep the latest
        self.run.config.update(dict(hparams), allow_val_change=True)

    def log_metrics(self, metrics, step, epoch):
        row = self.pending.setdefault(step, {})
        row.update({name: float(value) for name, value in metrics.items()})
        row['epoch'] = epoch

    def log_images(self, images, step):
        self.pending.setdefault(step, {}).update({tag: self.wandb.Image(image) for tag, image in images.items()})

    def log_text(self, tag, text, step):
        # in the summary, not the history: a resumed run logs its options at an older step
        self.run.summary[tag] = text

    def _write(self, up_to=None):
        written = [step for step in sorted(self.pending) if up_to is None or step <= up_to]
        for step in written:
            # commit=True: the row is written now, not when a later step comes
            self.run.log(self.pending.pop(step), step=step, commit=True)
        if written:  # after the rows (a kill between the two: a resume from before them logs them again)
            steps = written_steps(self.folder)
            steps[self.run.id] = max(written[-1], steps.get(self.run.id, 0))
            atomic_write_json(steps, os.path.join(self.folder, 'wandb', WRITTEN_STEPS))

    def state_dict(self):
        numbers = [  # (pictures aside: W&B Images)
            [step, {key: value for key, value in row.items() if isinstance(value, (int, float))}]
            for step, row in sorted(self.pending.items())
        ]
        return {'run_id': self.run.id, 'folder': os.path.abspath(self.folder), 'pending': numbers}

    def commit(self, step):
        self._write(up_to=step)

    def finish(self, final_metrics):
        self._write()
        self.run.summary.update(dict(final_metrics))
        self.run.finish()
        self.finished = True

    def close(self):
        """Without finish: end the run as failed; the points after the last checkpoint are dropped
        (a resume logs them again)."""
        if not self.finished:
            self.pending.clear()
            self.run.finish(exit_code=1)
            self.finished = True
