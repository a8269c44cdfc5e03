"""A linear classifier on raw pixels: the baseline the default CNN must clearly beat."""

from torch import nn


class LinearClassifier(nn.Module):
    """Flatten the image and apply one linear layer."""

    def __init__(self, args):
        super().__init__()
        self.head = nn.Linear(3 * args.img_size * args.img_size, args.num_classes)

    def forward(self, x):
        return self.head(x.flatten(1))
