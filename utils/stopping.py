"""When a run stops before its planned end: a stop signal, a non-finite loss or model, or early stopping.

The loop asks `Stopper` after every optimizer step; the answer is one `Stop` value (a reason from
`StopReason` and a message), never a string to parse. Nothing here waits for the GPU on an ordinary
step: signals are host flags, agreed between torchrun processes by a non-blocking all-reduce on a
host (gloo) group that is read one step later; losses are kept as they are and read only at check
points (print intervals and saves).
"""

import contextlib
import dataclasses
import enum
import os
import signal
import sys

import torch
import torch.distributed as dist

from utils.distributed import all_reduce_max, collective_device, host_group, is_distributed
from utils.errors import STOPPING, TERMINATING_SIGNALS, second_stop_signal, write_to_stderr_now

STOP_SIGNALS = (signal.SIGINT, *TERMINATING_SIGNALS)


class StopReason(enum.Enum):
    SIGNAL = 'signal'  # Ctrl-C, kill, a cluster's pre-emption warning, or torchrun gone
    NONFINITE = 'non-finite'  # a loss or model tensor became inf/NaN
    EARLY_STOP = 'early stop'  # --monitor stopped improving


@dataclasses.dataclass(frozen=True)
class Stop:
    """Why a run stopped early: its reason, a message for people, and the signal for SIGNAL stops."""

    reason: StopReason
    message: str
    signum: int | None = None


class StoppedWaitingForData(BaseException):
    """A first stop signal that came while the training loop waited for its next batch (one process):
    a worker stuck in a read (a hung network disk) would hold the step, and the stop, for ever. A
    BaseException, so that the DataLoader's `except Exception` lets it through."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


WAITING_FOR_DATA = []  # non-empty while the training loop of a single process waits for a batch


@contextlib.contextmanager
def stop_ends_the_wait():
    """Inside, a first stop signal raises StoppedWaitingForData: the loop then saves its last step and stops."""
    WAITING_FOR_DATA.append(True)
    try:
        yield
    finally:
        WAITING_FOR_DATA.pop()


class StopSignals:
    """A context manager that turns the first stop signal into a request: `received` is its number.

    A second signal stops at once: a Ctrl-C raises KeyboardInterrupt (`interrupted`, exit code 130), a
    SIGTERM or SIGUSR1 utils.errors.StoppedBySignal (one line, exit code 128 + its number, what job
    scripts read). The first one is noted in utils.errors.STOPPING, so that a second one that comes
    after the loop (while the last files are written) stops at once too. Handlers are installed only in
    the main thread and put back on exit.
    """

    def __init__(self):
        self.received = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.received:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt('second SIGINT')
            raise second_stop_signal(signum)
        self.received = signum
        STOPPING.append(signum)
        if os.environ.get('RANK', '0') == '0':  # under torchrun every process hears it: one says so
            write_to_stderr_now(  # (not print: the signal may have come in the middle of the bar's write)
                ('\n' if getattr(sys.stderr, 'isatty', bool)() else '')  # off the bar's line (and the ^C) in a terminal
                + f'{signal.Signals(signum).name} received: finishing the current step and saving; '
                f'send it again to stop at once\n'
            )
        if WAITING_FOR_DATA:
            raise StoppedWaitingForData(signum)

    def __enter__(self):
        STOPPING.clear()  # a new run (several can train in one process)
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


class Stopper:
    """Collects the reasons to stop early; `stop` is None until one holds (then a Stop).

    Losses are watched by keeping a reference to each (`watch_loss`: no work on the device) and read
    at check points only, where the running sums are read anyway (`check_finite`)."""

    def __init__(self):
        self.signals = StopSignals()
        self.stop = None
        self.watched = []  # (optimizer step, loss) since the last check
        self._pending = None  # (all-reduce handle, flag) of the signal flags sent at the last step

    def __enter__(self):
        self.signals.__enter__()
        return self

    def __exit__(self, *exc):
        if self._pending is not None:  # a collective must not be left in flight
            self._pending[0].wait()
            self._pending = None
        return self.signals.__exit__(*exc)

    def watch_loss(self, loss, step):
        """Keep the loss of a batch of optimizer step `step` for the next check (costs nothing on the device)."""
        self.watched.append((step, loss.detach()))

    def after_step(self):
        """Take up a stop signal after an optimizer step; every process decides alike at the same step
        (under torchrun, one step after the signal, with no wait for the GPU)."""
        if not is_distributed():
            if self.signals.received and self.stop is None:
                self.stop_by_signal(self.signals.received)
            return
        if self._pending is not None:
            handle, flag = self._pending
            handle.wait()
            if flag.item() and self.stop is None:  # a host tensor: no GPU sync
                self.stop_by_signal(int(flag.item()))
        flag = torch.tensor([self.signals.received or 0])
        self._pending = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=host_group(), async_op=True), flag

    def stop_by_signal(self, signum):
        """Stop for the signal `signum` (after a step, or while waiting for data: see StoppedWaitingForData)."""
        self.stop = Stop(StopReason.SIGNAL, f'stopped by {signal.Signals(signum).name}', signum)

    def check_finite(self, model=None, *, losses_finite=None, step=0):
        """Check the losses watched since the last check and, given `model`, its weights and statistics
        (BatchNorm running_var, ...): a non-finite one stops the run. `losses_finite` (True when their
        running sum is finite, read by the caller anyway) spares reading them one by one. Every process
        calls it and all agree. Returns whether everything is finite, i.e. whether the state may be saved."""
        if self.stop is not None and self.stop.reason == StopReason.NONFINITE:
            return False  # the first reason found is the one to report
        none = 2**62  # no bad step: above any step
        bad_step = none
        if self.watched and losses_finite is not True:
            finite = torch.isfinite(torch.stack([loss.float() for _, loss in self.watched])).tolist()
            bad_step = next((s for (s, _), ok in zip(self.watched, finite) if not ok), none)
        self.watched.clear()
        # the earliest of the processes' (a NaN in one process reaches the others a step later, through DDP)
        group = host_group() if is_distributed() else None
        bad_step = -int(all_reduce_max(torch.tensor([-bad_step]), group=group))
        if bad_step < none:
            self.stop = Stop(StopReason.NONFINITE, f'non-finite loss at step {bad_step}')
            return False
        if model is not None:
            tensors = [(n, t) for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()]
            finite = torch.stack([torch.isfinite(t).all() for _, t in tensors]).to(collective_device())
            bad = all_reduce_max((~finite).to(torch.uint8))  # a tensor not finite in any process
            if bad.any():
                name = tensors[int(bad.nonzero()[0])][0]
                self.stop = Stop(StopReason.NONFINITE, f'non-finite values in {name} at step {step}')
                return False
        return True

    def check_early_stop(self, monitor):
        """Stop when the Monitor's patience has run out."""
        if monitor.exhausted() and self.stop is None:
            self.stop = Stop(
                StopReason.EARLY_STOP,
                f'early stop: {monitor.name} did not improve for {monitor.patience} '
                f'validation{"" if monitor.patience == 1 else "s"}',
            )
