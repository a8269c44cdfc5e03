"""What a run has measured so far: every validation's metrics, for history.json and the final/* values
(best.pth and early stopping are decided by utils/monitor.py). The shape of pytorch-accelerated's RunHistory."""

import contextlib
import json
import time

from utils.checkpoint import atomic_write_bytes
from utils.errors import KilnError

WRITE_EVERY_S = 30  # history.json is rewritten whole: at most this often while the run goes, and at its end


class RunHistory:
    """The metric values of a run, in the order they were measured; `state_dict`/`load_state_dict`
    carry it through checkpoints."""

    def __init__(self):
        self._metrics = {}
        self._written = (None, time.monotonic())  # (values then, time) of the last copy for history.json

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
        self._written = (None, -float('inf'))  # history.json may lag (a kill): due (unless it holds these)

    def for_file(self, now=False):
        """A copy of the metrics for history.json (see `history_json`) when values came since the last copy
        and WRITE_EVERY_S have passed (`now`: at once), else None. The file is rewritten whole, so a run
        of many thousand validations that saves at each would spend its saves rewriting it."""
        count = sum(map(len, self._metrics.values()))
        if count == self._written[0] or not now and time.monotonic() - self._written[1] < WRITE_EVERY_S:
            return None
        self._written = count, time.monotonic()
        return {name: list(values) for name, values in self._metrics.items()}


def history_json(metrics):
    """history.json's text: {"metrics": {name: [values, oldest first]}}, a metric a line, a non-finite value
    (JSON has none) as null. The lists go through json's C encoder (an indented file goes through Python's:
    seconds for a long run)."""
    lines = [f' {json.dumps(name)}: {_finite(json.dumps(values, default=_number))}' for name, values in metrics.items()]
    return '{"metrics": {\n' + ',\n'.join(lines) + '\n}}\n'


def write_history_json(metrics, path):
    """Write history.json (`history_json`) to `path` atomically (on the writer thread: it takes a while),
    unless the file holds just that (a resumed run that trained nothing leaves it as it was)."""
    text = history_json(metrics).encode()
    with contextlib.suppress(OSError), open(path, 'rb') as f:
        if f.read() == text:
            return
    atomic_write_bytes(text, path)


def _number(value):
    """A metric value that is no float (a 0-d tensor, a numpy number from a task of yours) as one."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def _finite(numbers):
    """A JSON list of numbers with NaN and Infinity (json's words for them) as null."""
    return numbers.replace('-Infinity', 'null').replace('Infinity', 'null').replace('NaN', 'null')
