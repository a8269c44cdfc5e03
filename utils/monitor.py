"""The monitored metric (--monitor): its best value, and how long it has not improved."""

import math


class Monitor:
    """Tracks `--monitor` over validations: decides which checkpoint is the best and when early
    stopping is due. A non-finite value never counts as an improvement."""

    def __init__(self, name, mode='max', patience=None, min_delta=0.0):
        self.name, self.mode, self.patience, self.min_delta = name, mode, patience, min_delta
        self.best = None  # the best value so far: the best checkpoint's
        self.reference = None  # the last value that improved by more than min_delta: patience counts from it
        self.waited = 0  # validations since then

    def is_better(self, value, than, margin=0.0):
        """Whether `value` beats `than` by more than `margin` in this monitor's direction."""
        return value > than + margin if self.mode == 'max' else value < than - margin

    def update(self, value):
        """Take the metric's value at a validation; return whether it is the best so far."""
        if not math.isfinite(value):
            self.waited += 1
            return False
        if self.reference is None or self.is_better(value, self.reference, self.min_delta):
            self.reference, self.waited = value, 0
        else:
            self.waited += 1
        improved = self.best is None or self.is_better(value, self.best)
        if improved:
            self.best = value
        return improved

    def exhausted(self):
        """Whether early stopping is due (--early_stop_patience validations without an improvement)."""
        return bool(self.patience) and self.waited >= self.patience

    def state_dict(self):
        return {'best': self.best, 'reference': self.reference, 'waited': self.waited}

    def load_state_dict(self, state):
        self.best, self.reference, self.waited = state['best'], state['reference'], state['waited']
