"""Model names (--model_type) and multi-GPU wrapping.

To add a model: create a package in model/ with an nn.Module taking `args` (it reads
args.num_classes, args.img_size, ...), and add one line to MODELS.
"""
import torch

from model.linear import LinearClassifier
from model.resnet import ResNet18
from model.seg_net import SegNet
from model.small_cnn import SmallCNN
from model.torchvision_nets import TORCHVISION_NETS, torchvision_net
from utils.distributed import is_distributed, local_rank
from utils.errors import KilnError

MODELS = {
    'small_cnn': SmallCNN,
    'resnet18': ResNet18,
    'linear': LinearClassifier,
    'seg_net': SegNet,  # segmentation (--task segment)
    **{name: torchvision_net(name) for name in TORCHVISION_NETS},  # tv_resnet18, ..., tv_efficientnet_b0
}


def select_model(args):
    """Build the model named by --model_type."""
    if args.model_type not in MODELS:
        raise KilnError(f'unknown --model_type {args.model_type!r}; choose one of: {", ".join(sorted(MODELS))}')
    return MODELS[args.model_type](args)


def equip_multi_gpu(model, args):
    """Wrap the model for several devices: DistributedDataParallel when launched by torchrun,
    else DataParallel when several --gpus are given (the single-process legacy path)."""
    if is_distributed():
        on_gpu = next(model.parameters()).is_cuda
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank()] if on_gpu else None)
    if args.gpus and len(args.gpus) > 1 and not args.cpu:
        return torch.nn.DataParallel(model, device_ids=args.gpus)
    return model
