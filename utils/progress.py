"""The progress bar of training, validation, evaluation and prediction."""

import os
import sys

from tqdm import tqdm


def interactive():
    """Whether stderr is shown as it is written: a terminal, or PyCharm's run console (no terminal, but
    it draws carriage returns). Not a log file (SLURM's, `> log`), which would keep every redraw, nor a
    terminal that cannot move its cursor (TERM=dumb: Emacs' shell), where nested bars leave escapes."""
    if 'PYCHARM_HOSTED' in os.environ:
        return True
    return getattr(sys.stderr, 'isatty', lambda: False)() and os.environ.get('TERM') != 'dumb'


def write_line(text):
    """Print a line of the run's output above the progress bars (a plain print would glue it to the end of
    an open bar's line), at once: into a log file too (SLURM's), not when a buffer fills."""
    tqdm.write(text)
    if sys.stdout is not None:
        sys.stdout.flush()


def unsized_terminal():
    """tqdm's size options for a terminal that says it is 0 wide or high (a pseudo-terminal nobody sized,
    as `script` makes from a job): tqdm would draw nothing there."""
    try:
        columns, lines = os.get_terminal_size(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # not a terminal: tqdm measures nothing either
        return {}
    return {} if columns and lines else {'dynamic_ncols': False, 'ncols': columns or 80, 'nrows': lines or 20}


def progress(iterable, enabled, description, total=None):
    """A tqdm progress bar over `iterable`; `enabled` None (--progress_bar not given): where stderr is
    `interactive`; False: a no-op wrapper."""
    if enabled is None:
        enabled = interactive()
    size = {'dynamic_ncols': True, **(unsized_terminal() if enabled else {})}
    return tqdm(
        iterable, desc=description, disable=not enabled, unit='batch', leave=False, mininterval=0.5, total=total, **size
    )
