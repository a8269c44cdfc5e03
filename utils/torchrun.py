"""PyTorch's torchrun, ending in one line: `python -m utils.torchrun [torchrun options] train.py [options]`.

It is torchrun itself (torch.distributed.run), with two endings changed:
- stopped by SIGTERM/SIGINT (Ctrl-C, `kill`, SLURM before its time limit), it passes the signal on
  as torchrun does, lets the workers save (they stop within a step), then exits 128 + the signal
  number with one line, not with torchrun's exit code 1 and its SignalException traceback;
- when a worker fails, the worker's own `error: ...` line is the cause the user sees; this adds one
  line naming the failed rank (one killed by a signal first) and its exit code instead of torchrun's error dump, and exits with that
  code.
"""

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main


def main(argv=None):
    """Run torchrun with `argv` (default: the command line); exit as the module docstring says."""
    try:
        torchrun_main(argv)
    except SignalException as error:
        name = signal.Signals(error.sigval).name
        print(f'torchrun: stopped by {name}; the workers saved what they had', file=sys.stderr, flush=True)
        sys.exit(128 + error.sigval)
    except ChildFailedError as error:
        # a worker killed by a signal is the cause; the others then fail on the broken connection
        rank, failure = min(
            error.failures.items(), key=lambda item: (item[1].exitcode >= 0, item[1].timestamp, item[0])
        )
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # -9: killed by SIGKILL
        how = (
            f'exit code {failure.exitcode}'
            if failure.exitcode > 0
            else f'{signal.Signals(-failure.exitcode).name} (signal {-failure.exitcode})'
        )
        print(f'torchrun: rank {rank} failed with {how} (its error is above)', file=sys.stderr, flush=True)
        sys.exit(code)


if __name__ == '__main__':
    main()
