"""PyTorch's torchrun, ending in one line: `python -m utils.torchrun [torchrun options] train.py [options]`.

It is torchrun itself (torch.distributed.run), with two endings changed:
- stopped by SIGTERM/SIGINT (Ctrl-C, `kill`, SLURM before its time limit), it passes the signal on
  as torchrun does, lets the workers save (they stop within a step), then exits 128 + the signal
  number with one line, not with torchrun's exit code 1 and its SignalException traceback;
- when a worker fails, the worker's own `error: ...` line is the cause the user sees; this adds one
  line naming the failed rank (the likeliest cause: see `_blame`) and its exit code instead of
  torchrun's error dump, and exits with that code.
"""

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main


def _blame(exitcode):
    """How likely a worker's exit is the cause of a failed job (0: most): killed by a signal (SIGKILL from
    the OOM killer, a crash), then an error exit; SIGTERM last, since torchrun sends it to the workers it
    stops after a failure (a worker stopped by SIGTERM while training saves and exits 143 instead)."""
    if exitcode < 0:
        return 2 if -exitcode == signal.SIGTERM else 0
    return 1


def main(argv=None):
    """Run torchrun with `argv` (default: the command line); exit as the module docstring says."""
    try:
        torchrun_main(argv)
    except SignalException as error:
        name = signal.Signals(error.sigval).name
        print(f'torchrun: stopped by {name}; the workers saved what they had', file=sys.stderr, flush=True)
        sys.exit(128 + error.sigval)
    except ChildFailedError as error:
        # the cause, not the workers that then failed on the broken connection or were stopped by torchrun
        rank, failure = min(
            error.failures.items(), key=lambda item: (_blame(item[1].exitcode), item[1].timestamp, item[0])
        )
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # -9: killed by SIGKILL
        if failure.exitcode > 0:
            how = f'failed with exit code {failure.exitcode} (its error is above)'
        else:
            how = f'was killed by {signal.Signals(-failure.exitcode).name} (signal {-failure.exitcode})'
            if -failure.exitcode == signal.SIGKILL:
                how += '; often the out-of-memory killer (see `dmesg`): lower --batch_size or --num_workers'
        print(f'torchrun: rank {rank} {how}', file=sys.stderr, flush=True)
        sys.exit(code)


if __name__ == '__main__':
    main()
