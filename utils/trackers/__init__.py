"""Experiment trackers: where a run's curves, pictures and options go (--loggers).

The training loop talks only to `Trackers` (built by `build_trackers` on global rank 0), which
passes each call on to one `Tracker` per name. The contract that keeps every tracker exact when a
run is SIGKILLed and resumed from its last checkpoint:

- `state_dict()` is called while that checkpoint is assembled, `commit(step)` right after the
  checkpoint of optimizer step `step` is written; after `commit(step)` no metric or picture is
  logged at a step <= `step` any more (texts and options may be: they are not points).
- A resumed run builds its trackers with `resume_step` (the checkpoint's step) and the saved
  `states`, then logs again every point after `resume_step`.
- `finish(final_metrics)` ends a completed run; `close()` always comes last (after an error or a
  stop too). Points logged after the last commit and not finished are dropped by the trackers
  that buffer them (W&B, MLflow): a resume logs them again.

Each tracker lives in its own module, imported only when named, with its library imported lazily.
"""

import contextlib
import importlib
import os
from types import SimpleNamespace

from utils.errors import KilnError

TRACKER_NAMES = ('tensorboard', 'csv', 'wandb', 'mlflow')
_CLASSES = {
    'tensorboard': 'tb_tracker.TensorBoardTracker',
    'csv': 'csv_tracker.CsvTracker',
    'wandb': 'wandb_tracker.WandbTracker',
    'mlflow': 'mlflow_tracker.MlflowTracker',
}
TRACKERS_INSTALL = "python3 -m pip install -e '.[trackers]'"


def require(module, logger, package=None, install=TRACKERS_INSTALL):
    """Import `module` for `--loggers <logger>`; a KilnError naming the install command if it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise KilnError(f'--loggers {logger} needs the {package or module} package: {install}') from None


def valid_text(text):
    """`text` with the bytes of names that are no UTF-8 (kept as surrogates) written as `\\xe9` escapes: event
    files and tracker stores hold UTF-8 only."""
    return text.encode('utf-8', 'surrogateescape').decode('utf-8', 'backslashreplace')


def copied_from(state, folder):
    """The experiment folder whose tracker run the saved tracker `state` names, when that is another folder
    that still exists: `folder` is a copy of it, whose points belong in a run of its own (a folder moved
    away, or a state that names no folder, continues its run)."""
    owner = (state or {}).get('folder')
    if owner is None or not os.path.isdir(owner):
        return None
    same = os.path.samefile(owner, folder) if os.path.exists(folder) else os.path.abspath(folder) == owner
    return None if same else owner


class Tracker:
    """One experiment tracker; the loop calls these methods, each a no-op here."""

    name = None

    def log_hparams(self, hparams):
        """The run's options ({name: number, string, bool or None}), once per start."""

    def log_metrics(self, metrics, step, epoch):
        """Scalars such as {'train/loss': 0.5, 'val/acc': 0.9} at optimizer step `step`."""

    def log_images(self, images, step):
        """Pictures given as {tag: HxWx3 uint8 numpy array} at `step`."""

    def log_text(self, tag, text, step):
        """A (Markdown) text, e.g. the run's options."""

    def commit(self, step):
        """A checkpoint of `step` was just saved: every point up to `step` is final."""

    def finish(self, final_metrics):
        """Clean end of the run, with its final and best metrics ({'final/val/acc': .., 'best/val/acc': ..})."""

    def state_dict(self):
        """Plain data to save in the checkpoint, given back as `state` on resume."""
        return {}

    def close(self):
        """Release files and connections (after `finish`, or instead of it when the run stops early)."""


class Trackers:
    """The trackers of one run: every call goes to each of them; `state_dict` is {name: state}.

    `saved_states` are the states of the checkpoint resumed: those of trackers left out of this
    start are kept in every checkpoint, so that a later start with them continues their runs.
    """

    def __init__(self, trackers=(), saved_states=None):
        self.trackers = list(trackers)
        self.saved_states = dict(saved_states or {})

    def __iter__(self):
        return iter(self.trackers)

    def __len__(self):
        return len(self.trackers)

    def log_hparams(self, hparams):
        for tracker in self.trackers:
            tracker.log_hparams(hparams)

    def log_metrics(self, metrics, step, epoch):
        for tracker in self.trackers:
            tracker.log_metrics(metrics, step, epoch)

    def log_images(self, images, step):
        for tracker in self.trackers:
            tracker.log_images(images, step)

    def log_text(self, tag, text, step):
        for tracker in self.trackers:
            tracker.log_text(tag, text, step)

    def commit(self, step):
        for tracker in self.trackers:
            tracker.commit(step)

    def finish(self, final_metrics):
        for tracker in self.trackers:
            tracker.finish(final_metrics)

    def state_dict(self):
        return {**self.saved_states, **{tracker.name: tracker.state_dict() for tracker in self.trackers}}

    def close(self):
        """Close every tracker, even when one of them fails (the first error is raised afterwards)."""
        error = None
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as e:  # noqa: BLE001 - the others must still be closed
                error = error or e
        if error:
            raise error


def tracker_class(name):
    """The Tracker class of --loggers `name` (its module imported now; its library only when it starts)."""
    module, cls = _CLASSES[name].split('.')
    return getattr(importlib.import_module(f'{__name__}.{module}'), cls)


def keeps_pictures(names):
    """Whether any tracker of `names` (--loggers) keeps pictures: CSV alone does not, so none are drawn for it."""
    return any(tracker_class(name).log_images is not Tracker.log_images for name in names)


def build_trackers(names, folder, run_name, hparams_metric_names=(), resume_step=None, states=None, options=None):
    """The trackers named in `names` (from --loggers) for the experiment folder `folder`.

    `resume_step` is None for a fresh run, else the optimizer step of the checkpoint resumed, whose
    `Trackers.state_dict()` is `states`. `hparams_metric_names` are the final-metric names of every
    task (declared in TensorBoard's HParams tab). `options` has `mlflow_uri`, `wandb_project` and
    `checkpoints_dir` (defaults: None, 'kiln', the folder's parent).
    """
    unknown = [name for name in names if name not in TRACKER_NAMES]
    if unknown:
        raise KilnError(f'unknown --loggers {", ".join(unknown)}; choose from {", ".join(TRACKER_NAMES)}')
    defaults = {
        'mlflow_uri': None,
        'wandb_project': 'kiln',
        'checkpoints_dir': os.path.dirname(os.path.abspath(folder)),
    }
    options = SimpleNamespace(**{key: getattr(options, key, value) for key, value in defaults.items()})
    os.makedirs(folder, exist_ok=True)
    trackers = Trackers(saved_states=states)
    try:
        for name in dict.fromkeys(names):  # each once, in the order given
            trackers.trackers.append(
                tracker_class(name)(
                    folder, run_name, resume_step, (states or {}).get(name), options, tuple(hparams_metric_names)
                )
            )
    except BaseException:
        with contextlib.suppress(Exception):  # the ones already started; the first error is the one to show
            trackers.close()
        raise
    return trackers
