"""Reusable building blocks for models."""

import torch
from torch import nn


class ConvBNReLU(nn.Sequential):
    """Convolution, BatchNorm, ReLU; padding keeps the size (divided by the stride) for odd kernels."""

    def __init__(self, in_channels, out_channels, kernel_size=3, stride=1, dilation=1):
        padding = dilation * (kernel_size - 1) // 2
        super().__init__(
            nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation=dilation, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
        )


def upsample_2x(x):
    """Bilinear 2x upsampling of (N, C, H, W) (align_corners=False) from slices, sums and interleaving,
    whose gradients are deterministic on a GPU, where those of F.interpolate's bilinear mode add up
    with atomics (--deterministic refuses them)."""
    for dim in (-1, -2):
        before = torch.cat([x.narrow(dim, 0, 1), x.narrow(dim, 0, x.shape[dim] - 1)], dim)  # x[i-1], edge kept
        after = torch.cat([x.narrow(dim, 1, x.shape[dim] - 1), x.narrow(dim, x.shape[dim] - 1, 1)], dim)
        x = torch.stack([0.75 * x + 0.25 * before, 0.75 * x + 0.25 * after], dim).flatten(dim - 1, dim)
    return x


class UpBlock(nn.Module):
    """Decoder block: upsample 2x, concatenate an optional skip connection, two ConvBNReLU."""

    def __init__(self, in_channels, out_channels, skip_channels=0):
        super().__init__()
        self.upsample = nn.Upsample(scale_factor=2, mode='bilinear', align_corners=False)
        self.convs = nn.Sequential(
            ConvBNReLU(in_channels + skip_channels, out_channels), ConvBNReLU(out_channels, out_channels)
        )

    def forward(self, x, skip=None):
        x = upsample_2x(x) if torch.are_deterministic_algorithms_enabled() else self.upsample(x)
        if skip is not None:
            x = torch.cat([x, skip], dim=1)
        return self.convs(x)
