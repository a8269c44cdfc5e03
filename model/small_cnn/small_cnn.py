"""The default model: a small VGG-style CNN for small images."""

from torch import nn

from model.submodules import ConvBNReLU


class SmallCNN(nn.Module):
    """Three stages of ConvBNReLU blocks with 2x pooling, global average pooling and a linear head."""

    def __init__(self, args, widths=(16, 32, 64)):
        super().__init__()
        layers, in_channels = [], 3
        for index, width in enumerate(widths):
            layers += [ConvBNReLU(in_channels, width), ConvBNReLU(width, width)]
            if index < len(widths) - 1:
                layers.append(nn.MaxPool2d(2))
            in_channels = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(in_channels, args.num_classes)

    def forward(self, x):
        return self.head(self.pool(self.features(x)).flatten(1))
