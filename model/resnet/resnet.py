"""torchvision's ResNet-18 adapted to small images, built without downloading weights."""
import torchvision
from torch import nn


class ResNet18(nn.Module):
    """ResNet-18 with a 3x3 stride-1 stem and no max-pool, so 32-pixel inputs keep enough resolution."""

    def __init__(self, args):
        super().__init__()
        self.net = torchvision.models.resnet18(weights=None, num_classes=args.num_classes)
        self.net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.net.maxpool = nn.Identity()

    def forward(self, x):
        return self.net(x)
