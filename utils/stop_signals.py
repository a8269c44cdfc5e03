"""Stopping a run cleanly on SIGINT, SIGTERM or SIGUSR1 (Ctrl-C, `kill`, a cluster's pre-emption)."""
import signal
import sys

STOP_SIGNALS = tuple(getattr(signal, name) for name in ('SIGINT', 'SIGTERM', 'SIGUSR1') if hasattr(signal, name))


class StopSignals:
    """A context manager that turns the first stop signal into a request: `received` is its number.

    The training loop checks `received` after every step (a plain attribute, free to read),
    saves its state and returns. A second signal raises KeyboardInterrupt at once.
    Handlers are installed only in the main thread and put back on exit.
    """

    def __init__(self):
        self.received = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.received:
            raise KeyboardInterrupt(f'second {signal.Signals(signum).name}')
        self.received = signum
        print(f'\n{signal.Signals(signum).name} received: finishing the current step and saving; '
              f'send it again to stop at once', file=sys.stderr, flush=True)

    def __enter__(self):
        try:
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread: leave signals to whoever owns them
            pass
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        return False
