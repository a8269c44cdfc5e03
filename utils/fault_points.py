"""Named moments where a test can kill the process: KILN_KILL_AT=<name> makes `fault_point(<name>)`
SIGKILL it there (KILN_KILL_AT=<name>:<n>: the n-th time it gets there), so crash safety is checked at
exact moments, not only at random ones."""

import os
import signal

REACHED = {}  # name -> how many times fault_point(name) was called while KILN_KILL_AT names it


def fault_point(name):
    """SIGKILL this process if the environment variable KILN_KILL_AT is `name`, or `name:<n>` and this is
    the n-th time here (tests only set it)."""
    wanted = os.environ.get('KILN_KILL_AT')
    if not wanted or wanted.partition(':')[0] != name:
        return
    REACHED[name] = REACHED.get(name, 0) + 1
    if wanted in (name, f'{name}:{REACHED[name]}'):
        os.kill(os.getpid(), signal.SIGKILL)
