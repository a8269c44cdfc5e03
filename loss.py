"""Loss functions by name (--loss). Add a loss: write it here and add one line to LOSSES.

A loss is called as `loss(scores, target)` by the task (tasks/*.py `loss`): for classification, scores
(N, C) and class indices (N,), or class probabilities (N, C) under --augment mixup or cutmix; for
segmentation (N, C, H, W) and (N, H, W). A task whose `default_loss` is None computes a loss of its own,
and --loss does not apply to it.
"""

from functools import partial

import torch
from torch import nn

from options import did_you_mean
from utils.errors import KilnError


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """nn.CrossEntropyLoss. With --deterministic, scores per pixel (N, C, H, W) are taken as (N*H*W, C):
    the same loss, but CUDA's kernel for the first adds up with atomics and --deterministic refuses it."""

    def forward(self, scores, target):
        if scores.dim() > 2 and torch.are_deterministic_algorithms_enabled():
            classes = scores.shape[1]
            probabilities = target.dim() == scores.dim()  # mixed targets: class probabilities (N, C, H, W)
            target = target.movedim(1, -1).reshape(-1, classes) if probabilities else target.reshape(-1)
            scores = scores.movedim(1, -1).reshape(-1, classes)
        return super().forward(scores, target)


LOSSES = {
    'cross_entropy': CrossEntropyLoss,
    'label_smoothing': partial(CrossEntropyLoss, label_smoothing=0.1),
}


def select_loss(name, **settings):
    """Build the loss named `name`, with `settings` (ignore_index: --ignore_index) where given."""
    if name not in LOSSES:
        raise KilnError(
            f'unknown --loss {name!r}{did_you_mean(name, LOSSES)}; choose one of: {", ".join(sorted(LOSSES))}'
        )
    try:
        return LOSSES[name](**settings)
    except TypeError:
        raise KilnError(f'--loss {name} takes no {", ".join(settings)}; use --loss cross_entropy') from None
