"""torchvision's ResNet-18 adapted to small images, built without downloading weights."""

import torchvision
from torch import nn


class ResNet18(torchvision.models.ResNet):
    """ResNet-18 with a 3x3 stride-1 stem and no max-pool, so 32-pixel inputs keep enough resolution.

    It is torchvision's ResNet itself, so its layer groups (conv1, bn1, ..., layer4, avgpool, fc)
    are what ModelFreezer and --freeze_to see, and torchvision weights load into it by name.
    """

    def __init__(self, args):
        super().__init__(torchvision.models.resnet.BasicBlock, [2, 2, 2, 2], num_classes=args.num_classes)
        self.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.maxpool = nn.Identity()
