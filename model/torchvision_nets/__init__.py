from model.torchvision_nets.torchvision_nets import (
    TORCHVISION_NETS,
    torchvision_net,
    tv_efficientnet_b0,
    tv_mobilenet_v3_large,
    tv_mobilenet_v3_small,
    tv_resnet18,
    tv_resnet34,
    tv_resnet50,
)

__all__ = [
    'TORCHVISION_NETS',
    'torchvision_net',
    'tv_resnet18',
    'tv_resnet34',
    'tv_resnet50',
    'tv_mobilenet_v3_small',
    'tv_mobilenet_v3_large',
    'tv_efficientnet_b0',
]
