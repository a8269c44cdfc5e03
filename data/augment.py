"""Training augmentation and normalization, done per batch on the training device.

Batches arrive as uint8 images (N, C, H, W) with their targets (`label`, a `mask` (N, H, W), or
`boxes` (N, M, 4) with `box_labels`). Each augmentation moves the targets with the pixels (a
shifted mask, shifted and mirrored boxes). Its random parameters are drawn once per epoch for
every sample position from a generator seeded by (seed, epoch) — see `BatchTransform.draw` — so a
sample gets the same augmentation whatever the batch size, number of workers or processes, and
whether the run was interrupted. All of it is index arithmetic on fixed shapes: no host sync.

Add an augmentation: a class with `draw(count, generator)` and `apply(batch, params)`, one line in
AUGMENTATIONS, and its name in options.AUGMENTATIONS.
"""

import torch

MEAN = (0.5, 0.5, 0.5)
STD = (0.25, 0.25, 0.25)


def _reflect(index, size):
    """Map indices outside [0, size) back inside as mirror images, like padding_mode='reflect'."""
    period = max(2 * (size - 1), 1)
    index = index.remainder(period)
    return torch.where(index >= size, period - index, index)


def _gather_pixels(tensor, rows, columns):
    """`tensor` (N, ..., H, W) with each sample's rows and columns picked by `rows` (N, H), `columns` (N, W)."""
    extra = tensor.dim() - 3  # channel dimensions between N and H
    shape = (len(tensor),) + (1,) * extra
    rows = rows.view(*shape, -1, 1).expand(*tensor.shape[:-1], 1).expand(tensor.shape)
    tensor = tensor.gather(-2, rows)
    columns = columns.view(*shape, 1, -1).expand(tensor.shape)
    return tensor.gather(-1, columns)


class RandomCrop:
    """Shift each image by up to `padding` pixels each way, filling the border by reflection
    (torchvision's RandomCrop with reflect padding, batched)."""

    def __init__(self, image_size):
        self.padding = max(1, image_size // 16)

    def draw(self, count, generator):
        return {'shift': torch.randint(-self.padding, self.padding + 1, (count, 2), generator=generator)}

    def apply(self, batch, params):
        shift = params['shift']
        height, width = batch['image'].shape[-2:]
        rows = _reflect(torch.arange(height, device=shift.device) + shift[:, :1], height)
        columns = _reflect(torch.arange(width, device=shift.device) + shift[:, 1:], width)
        for key in ('image', 'mask'):
            if key in batch:
                batch[key] = _gather_pixels(batch[key], rows, columns)
        if 'boxes' in batch:  # move with the pixels; a box pushed out of the picture is dropped
            offset = shift.flip(1).repeat(1, 2).to(batch['boxes'].dtype).unsqueeze(1)  # (dx, dy, dx, dy)
            boxes = batch['boxes'] - offset
            boxes = torch.stack(
                [
                    boxes[..., 0].clamp(0, width),
                    boxes[..., 1].clamp(0, height),
                    boxes[..., 2].clamp(0, width),
                    boxes[..., 3].clamp(0, height),
                ],
                dim=-1,
            )
            gone = (boxes[..., 2] - boxes[..., 0] < 1) | (boxes[..., 3] - boxes[..., 1] < 1)
            batch['boxes'] = boxes
            batch['box_labels'] = batch['box_labels'].masked_fill(gone, -1)
        return batch


class Flip:
    """Mirror a random half of the images left-right (`dim=-1`) or upside down (`dim=-2`)."""

    def __init__(self, image_size, dim):
        self.dim = dim

    def draw(self, count, generator):
        return {'flip': torch.rand(count, generator=generator) < 0.5}

    def apply(self, batch, params):
        flip = params['flip']
        for key in ('image', 'mask'):
            if key in batch:
                shape = (-1,) + (1,) * (batch[key].dim() - 1)
                batch[key] = torch.where(flip.view(shape), batch[key].flip(self.dim), batch[key])
        if 'boxes' in batch:
            boxes, size = batch['boxes'], batch['image'].shape[self.dim]
            low, high = (0, 2) if self.dim == -1 else (1, 3)
            mirrored = boxes.clone()
            mirrored[..., low], mirrored[..., high] = size - boxes[..., high], size - boxes[..., low]
            batch['boxes'] = torch.where(flip.view(-1, 1, 1), mirrored, boxes)
        return batch


AUGMENTATIONS = {
    'crop': RandomCrop,
    'hflip': lambda image_size: Flip(image_size, dim=-1),
    'vflip': lambda image_size: Flip(image_size, dim=-2),
}


def augmentation_names(option, dataset_default):
    """The augmentations a run uses: --augment ('default', 'none' or 'crop,hflip') over the dataset's own."""
    if option in (None, 'default'):
        return tuple(dataset_default)
    return () if option == 'none' else tuple(option.split(','))


class BatchTransform:
    """Turns a batch of uint8 images into normalized float images on the device, augmenting them
    first when it has augmentations (training); float images are taken as already preprocessed."""

    def __init__(self, names, image_size, channels_last=False):
        self.names = tuple(names)
        self.augmentations = [AUGMENTATIONS[name](image_size) for name in self.names]
        self.channels_last = channels_last
        self.scales = {}  # device -> (255 x mean, 255 x std), made once: a copy per batch would wait for the GPU

    def draw(self, count, generator):
        """Random parameters for `count` sample positions, as {(augmentation index, name): tensor (count, ...)}."""
        return {
            (i, key): value
            for i, augmentation in enumerate(self.augmentations)
            for key, value in augmentation.draw(count, generator).items()
        }

    def __call__(self, batch, params=None):
        """Augment (with `params`, this batch's rows of `draw`) and normalize `batch` in place; return it."""
        if params is not None:
            for i, augmentation in enumerate(self.augmentations):
                augmentation.apply(batch, {key: value for (index, key), value in params.items() if index == i})
        image = batch['image']
        if image.dtype == torch.uint8:
            if image.device not in self.scales:
                self.scales[image.device] = tuple(
                    torch.tensor(values, device=image.device).view(1, -1, 1, 1) * 255 for values in (MEAN, STD)
                )
            mean, std = self.scales[image.device]
            image = (image.float() - mean) / std
        if self.channels_last and image.dim() == 4:
            image = image.contiguous(memory_format=torch.channels_last)
        batch['image'] = image
        if 'mask' in batch:
            batch['mask'] = batch['mask'].long()
        return batch


def denormalize(images):
    """Map normalized images (N, 3, H, W) back to [0, 1] for display."""
    mean = images.new_tensor(MEAN).view(1, -1, 1, 1)
    std = images.new_tensor(STD).view(1, -1, 1, 1)
    return (images.float() * std + mean).clamp(0, 1)
