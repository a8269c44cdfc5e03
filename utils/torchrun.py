"""PyTorch's torchrun, ending in one line: `python -m utils.torchrun [torchrun options] train.py [options]`.

It is torchrun itself (torch.distributed.run), with its options spelled out (torchrun takes any
abbreviation of its own, so a script's `--monitor` was an ambiguous `--monitor-interval`) and two
endings changed:
- stopped by SIGTERM/SIGINT (Ctrl-C, `kill`, SLURM before its time limit), it passes the signal on
  as torchrun does, lets the workers save (a training run stops at its next step; they are given 10
  minutes where torchrun kills them after 30 s), then exits 128 + the
  signal number with one line, not with torchrun's exit code 1 and its SignalException traceback;
- when a worker fails, the worker's own `error: ...` line is the cause the user sees; this adds one
  line naming the failed rank (the likeliest cause: see `_blame`) and its exit code instead of
  torchrun's error dump, and exits with that code.
And --max-restarts starts the workers again after a crash, or an error met while training (a network
disk's hiccup), not after a mistake met before the first training step (an option, a missing file),
which each start would only say again; and the end of a job by another node is one line.
"""

import os
import shutil
import signal
import sys
import tempfile

from utils.errors import NO_RESTART_FILE, PEER_LOST_EXIT_CODE, quiet_interrupts

quiet_interrupts()  # a Ctrl-C while torch loads or the rendezvous waits: one line, not a traceback
from torch.distributed import run as torchrun
from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.launcher import api as launcher

from utils.distributed import LAUNCHER_PID

# how long workers stopped by a signal get to reach their next step and save, before torchrun kills them
# (its --shutdown-timeout, 30 s, is shorter than a validation or a save to a slow disk can take)
STOP_GRACE_SECONDS = 600

# the exit codes of a worker that stopped on a stop signal, saving first (utils/stopping.py, utils/errors.py)
STOPPED = {128 + signum: signal.Signals(signum).name for signum in (signal.SIGTERM, signal.SIGUSR1)}


def _blame(exitcode):
    """How likely a worker's exit is the cause of a failed job (0: most): killed by a signal (SIGKILL from
    the OOM killer, a crash), then an error exit of its own (a traceback's 1 included), then a worker
    that went down with a lost peer (PEER_LOST_EXIT_CODE); stopped by a signal last (killed by SIGTERM,
    or exiting 128 + a stop signal as Kiln's workers do), since torchrun sends SIGTERM to the workers it
    stops after a failure."""
    if exitcode == -signal.SIGTERM or exitcode in STOPPED:
        return 3
    if exitcode == PEER_LOST_EXIT_CODE:
        return 2
    return 0 if exitcode < 0 else 1


class RestartAfterCrashesOnly(LocalElasticAgent):
    """torchrun's agent, whose --max-restarts are not spent on workers that exited with a mistake before
    their first training step: such a worker makes the file that NO_RESTART_FILE names (utils/errors.py);
    and whose workers, stopped by a signal, get STOP_GRACE_SECONDS (or a longer --shutdown-timeout) to save."""

    def _invoke_run(self, role=DEFAULT_ROLE):
        try:
            return super()._invoke_run(role)
        except SignalException:
            # (torch before 2.12 has no such setting: its workers get its 30 s)
            self._shutdown_timeout = max(getattr(self, '_shutdown_timeout', 30), STOP_GRACE_SECONDS)
            raise

    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and os.path.exists(os.environ[NO_RESTART_FILE]):
            self._remaining_restarts = 0
        return result


def main(argv=None):
    """Run torchrun with `argv` (default: the command line); exit as the module docstring says."""
    parser = torchrun.get_args_parser()
    parser.allow_abbrev = False  # what follows the script is the script's: --monitor is not --monitor-interval
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the workers know whose death to stop at, even before they ask
    launcher.LocalElasticAgent = RestartAfterCrashesOnly  # the agent torchrun's launcher makes
    folder = tempfile.mkdtemp(prefix='kiln-torchrun-')
    os.environ[NO_RESTART_FILE] = os.path.join(folder, 'mistake')
    try:
        torchrun.run(parser.parse_args(argv))
    except RendezvousClosedError:  # another node's agent ended the job, after its workers failed
        print('torchrun: the job was ended by another node (its log says why)', file=sys.stderr, flush=True)
        sys.exit(PEER_LOST_EXIT_CODE)
    except SignalException as error:
        print(f'torchrun: stopped by {signal.Signals(error.sigval).name}', file=sys.stderr, flush=True)
        sys.exit(128 + error.sigval)
    except ChildFailedError as error:
        # the cause, not the workers that then failed on the broken connection or were stopped by torchrun;
        # torchrun's timestamps are whole seconds, so a tie there goes to the lowest rank
        rank, failure = min(
            error.failures.items(), key=lambda item: (_blame(item[1].exitcode), item[1].timestamp, item[0])
        )
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # -9: killed by SIGKILL
        who = f'rank {rank}'
        if failure.exitcode in STOPPED:  # no worker failed (else it would be blamed): they stopped
            stopped = sorted(r for r, f in error.failures.items() if f.exitcode == failure.exitcode)
            who = f'rank{"s" if len(stopped) > 1 else ""} {", ".join(map(str, stopped))}'
            name = STOPPED[failure.exitcode]
            how = f'stopped on {name}, exit code {code} (a {name} to one worker stops them all, saving first)'
        elif failure.exitcode > 0:
            how = f'failed with exit code {failure.exitcode} (its error is above)'
        else:
            how = f'was killed by {signal.Signals(-failure.exitcode).name} (signal {-failure.exitcode})'
            if -failure.exitcode == signal.SIGKILL:
                how += '; often the out-of-memory killer (see `dmesg`): lower --batch_size or --num_workers'
        print(f'torchrun: {who} {how}', file=sys.stderr, flush=True)
        sys.exit(code)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == '__main__':
    main()
