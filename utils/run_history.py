"""What a run has measured so far: every validation's metrics, for history.json and the final/* values
(best.pth and early stopping are decided by utils/monitor.py). The shape of pytorch-accelerated's RunHistory."""

from utils.errors import KilnError


class RunHistory:
    """The metric values of a run, in the order they were measured; `state_dict`/`load_state_dict`
    carry it through checkpoints."""

    def __init__(self):
        self._metrics = {}

    def get_metric_names(self):
        """The set of metric names recorded so far."""
        return set(self._metrics)

    def get_metric_values(self, metric_name):
        """All values of `metric_name`, oldest first."""
        return list(self._metrics.get(metric_name, []))

    def get_latest_metric(self, metric_name):
        """The newest value of `metric_name`; a KilnError if it was never recorded."""
        values = self._metrics.get(metric_name)
        if not values:
            known = ', '.join(sorted(self._metrics)) or 'none yet'
            raise KilnError(f'no value of metric {metric_name!r} has been recorded (recorded: {known})')
        return values[-1]

    def update_metric(self, metric_name, metric_value):
        """Append a value of `metric_name`."""
        self._metrics.setdefault(metric_name, []).append(metric_value)

    def reset(self):
        """Forget everything."""
        self._metrics = {}

    def state_dict(self):
        """The history as plain data (for checkpoints and history.json)."""
        return {'metrics': {k: list(v) for k, v in self._metrics.items()}}

    def load_state_dict(self, state):
        """Restore a history saved with `state_dict`."""
        self._metrics = {k: list(v) for k, v in state['metrics'].items()}
