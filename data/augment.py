"""Image transforms shared by all datasets: training augmentation and evaluation preprocessing.

Datasets hand these transforms uint8 CHW tensors of side `--img_size`; the transforms return
normalized float tensors. `denormalize` undoes the normalization for pictures.
"""
import torch
from torchvision.transforms import v2

MEAN = (0.5, 0.5, 0.5)
STD = (0.25, 0.25, 0.25)


def train_transform(args):
    """Augmentation for training: small shifts and horizontal flips, then normalization."""
    return v2.Compose([
        v2.RandomCrop(args.img_size, padding=max(1, args.img_size // 16), padding_mode='reflect'),
        v2.RandomHorizontalFlip(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(MEAN, STD),
    ])


def eval_transform(args):
    """Deterministic preprocessing for validation, evaluation and prediction."""
    return v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


def denormalize(images):
    """Map normalized images (N, 3, H, W) back to [0, 1] for display."""
    mean = images.new_tensor(MEAN).view(1, -1, 1, 1)
    std = images.new_tensor(STD).view(1, -1, 1, 1)
    return (images * std + mean).clamp(0, 1)
