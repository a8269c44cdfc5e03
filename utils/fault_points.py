"""Named moments where a test can kill the process: KILN_KILL_AT=<name> makes `fault_point(<name>)`
SIGKILL it there, so crash safety is checked at exact moments, not only at random ones."""

import os
import signal


def fault_point(name):
    """SIGKILL this process if the environment variable KILN_KILL_AT is `name` (tests only set it)."""
    if os.environ.get('KILN_KILL_AT') == name:
        os.kill(os.getpid(), signal.SIGKILL)
