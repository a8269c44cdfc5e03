"""Loss functions by name (--loss). Add a loss: write it here and add one line to LOSSES."""

from functools import partial

from torch import nn

from utils.errors import KilnError

LOSSES = {
    'cross_entropy': nn.CrossEntropyLoss,
    'label_smoothing': partial(nn.CrossEntropyLoss, label_smoothing=0.1),
}


def select_loss(name):
    """Build the loss named `name`."""
    if name not in LOSSES:
        raise KilnError(f'unknown --loss {name!r}; choose one of: {", ".join(sorted(LOSSES))}')
    return LOSSES[name]()
