"""A small anchor-free detector in the style of CenterNet (Zhou et al., "Objects as Points", 2019).

Every object is a peak in a per-class heatmap at the cell holding its box centre, at 1/4 of the
input's resolution; two more maps give the box size and the centre's offset inside its cell
(tasks/detect.py turns them into a loss and into boxes).
"""

import math

from torch import nn

from model.submodules import ConvBNReLU, UpBlock


def _stage(in_channels, out_channels):
    """Halve the resolution with a strided ConvBNReLU, then one more ConvBNReLU."""
    return nn.Sequential(ConvBNReLU(in_channels, out_channels, stride=2), ConvBNReLU(out_channels, out_channels))


class CenterNetHead(nn.Module):
    """Three small branches on the stride-4 features: class heatmap logits, box size and centre
    offset (both in heatmap cells)."""

    def __init__(self, in_channels, num_classes, width=32):
        super().__init__()

        def branch(out_channels):
            return nn.Sequential(
                nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(width, out_channels, 1)
            )

        self.heatmap, self.size, self.offset = branch(num_classes), branch(2), branch(2)
        # start every cell at a 0.1 object probability, as CenterNet does: the first steps would
        # otherwise be spent pushing thousands of background cells down
        nn.init.constant_(self.heatmap[-1].bias, -math.log((1 - 0.1) / 0.1))

    def forward(self, x):
        return {'heatmap': self.heatmap(x), 'size': self.size(x), 'offset': self.offset(x)}


class CenterNet(nn.Module):
    """Encoder down to 1/16 of the input, two UpBlocks with skip connections back to 1/4, and the
    heads. Takes normalized images (B, 3, S, S), S a multiple of 16; returns a dict of 'heatmap'
    logits (B, num_classes, S/4, S/4), 'size' (B, 2, S/4, S/4) and 'offset' (B, 2, S/4, S/4)."""

    made_for_task = 'detect'  # its outputs are what that task reads
    size_multiple = 16  # four stride-2 stages

    def __init__(self, args, widths=(16, 32, 64, 96), head_width=32):
        super().__init__()
        self.stem = _stage(3, widths[0])  # 1/2: nothing small enough to need full resolution
        self.down4 = _stage(widths[0], widths[1])
        self.down8 = _stage(widths[1], widths[2])
        self.down16 = _stage(widths[2], widths[3])
        self.up8 = UpBlock(widths[3], widths[2], skip_channels=widths[2])
        self.up4 = UpBlock(widths[2], widths[1], skip_channels=widths[1])
        self.head = CenterNetHead(widths[1], args.num_classes, head_width)

    def forward(self, x):
        x4 = self.down4(self.stem(x))
        x8 = self.down8(x4)
        return self.head(self.up4(self.up8(self.down16(x8), x8), x4))
