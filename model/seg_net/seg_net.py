"""A small encoder-decoder for segmentation, built from the blocks in model/submodules.py."""

from torch import nn

from model.submodules import ConvBNReLU, UpBlock


class SegNet(nn.Module):
    """Two 2x down-sampling stages, a bottleneck, and two UpBlocks with skip connections; outputs
    per-pixel class scores (N, num_classes, H, W) at the input's size (a multiple of 4)."""

    made_for_task = 'segment'  # its outputs are what that task reads
    size_multiple = 4  # two stride-2 stages, undone by two up-samplings

    def __init__(self, args, widths=(16, 32, 64)):
        super().__init__()
        self.encoder1 = nn.Sequential(ConvBNReLU(3, widths[0]), ConvBNReLU(widths[0], widths[0]))
        self.encoder2 = nn.Sequential(
            nn.MaxPool2d(2), ConvBNReLU(widths[0], widths[1]), ConvBNReLU(widths[1], widths[1])
        )
        self.bottleneck = nn.Sequential(nn.MaxPool2d(2), ConvBNReLU(widths[1], widths[2]))
        self.decoder2 = UpBlock(widths[2], widths[1], skip_channels=widths[1])
        self.decoder1 = UpBlock(widths[1], widths[0], skip_channels=widths[0])
        self.head = nn.Conv2d(widths[0], args.num_classes, kernel_size=1)

    def forward(self, x):
        skip1 = self.encoder1(x)
        skip2 = self.encoder2(skip1)
        x = self.decoder2(self.bottleneck(skip2), skip2)
        return self.head(self.decoder1(x, skip1))
