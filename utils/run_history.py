"""What a run has measured so far, epoch by epoch: best-checkpoint and early-stopping decisions read it."""

from abc import ABC, abstractmethod

from utils.checkpoint import atomic_write_json
from utils.errors import KilnError


class RunHistory(ABC):
    """The metric values of a run, in the order they were measured."""

    @property
    @abstractmethod
    def current_epoch(self):
        """The number of epochs completed (1 after the first)."""

    @abstractmethod
    def get_metric_names(self):
        """The set of metric names recorded so far."""

    @abstractmethod
    def get_metric_values(self, metric_name):
        """All values of `metric_name`, oldest first."""

    @abstractmethod
    def get_latest_metric(self, metric_name):
        """The newest value of `metric_name`; a KilnError if it was never recorded."""

    @abstractmethod
    def update_metric(self, metric_name, metric_value):
        """Append a value of `metric_name`."""

    @abstractmethod
    def reset(self):
        """Forget everything."""


class InMemoryRunHistory(RunHistory):
    """A RunHistory kept in a dict; `state_dict`/`load_state_dict` carry it through checkpoints."""

    def __init__(self):
        self._metrics = {}
        self._epoch = 0

    @property
    def current_epoch(self):
        return self._epoch

    def get_metric_names(self):
        return set(self._metrics)

    def get_metric_values(self, metric_name):
        return list(self._metrics.get(metric_name, []))

    def get_latest_metric(self, metric_name):
        values = self._metrics.get(metric_name)
        if not values:
            known = ', '.join(sorted(self._metrics)) or 'none yet'
            raise KilnError(f'no value of metric {metric_name!r} has been recorded (recorded: {known})')
        return values[-1]

    def update_metric(self, metric_name, metric_value):
        self._metrics.setdefault(metric_name, []).append(metric_value)

    def reset(self):
        self._metrics = {}
        self._epoch = 0

    def end_epoch(self):
        """Mark one more epoch as completed."""
        self._epoch += 1

    def state_dict(self):
        """The history as plain data (for checkpoints and JSON)."""
        return {'current_epoch': self._epoch, 'metrics': {k: list(v) for k, v in self._metrics.items()}}

    def load_state_dict(self, state):
        """Restore a history saved with `state_dict`."""
        self._epoch = int(state['current_epoch'])
        self._metrics = {k: list(v) for k, v in state['metrics'].items()}

    def save_json(self, path):
        """Write the history as JSON, atomically (for people and tools; resume reads the checkpoint)."""
        atomic_write_json(self.state_dict(), path)
