"""The progress bar of training, validation, evaluation and prediction."""

import os
import sys

from tqdm import tqdm


def interactive():
    """Whether stderr is shown as it is written: a terminal, or PyCharm's run console (no terminal, but
    it draws carriage returns). Not a log file (SLURM's, `> log`), which would keep every redraw."""
    return getattr(sys.stderr, 'isatty', lambda: False)() or 'PYCHARM_HOSTED' in os.environ


def progress(iterable, enabled, description, total=None):
    """A tqdm progress bar over `iterable`; `enabled` None (--progress_bar not given): where stderr is
    `interactive`; False: a no-op wrapper."""
    if enabled is None:
        enabled = interactive()
    return tqdm(
        iterable,
        desc=description,
        disable=not enabled,
        unit='batch',
        leave=False,
        dynamic_ncols=True,
        mininterval=0.5,
        total=total,
    )
